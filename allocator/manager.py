"""KvAllocator: the built-in ``Allocator`` (SGLang 0.5.23 semantics) driven by request ids.

Composes the request-to-token pool, the token-to-KV allocator, the radix cache and
the per-row bookkeeping, and applies one batched call per op kind in SGLang's
within-step order:

1. ``release`` (finish / retract / abort),
2. ``extend``: checkpoint ("stash") of continuing prefill chunks (once per chunk;
   ``stash_chunked`` does it earlier if the caller wants), then prefix match and
   lock of new requests (in batch order), then ONE ``alloc_for_extend``,
3. ``decode``: one ``alloc_for_decode``,
4. ``spec_decode``: prepare + ``alloc_for_spec_decode`` + commit of accepted tokens,
5. the prompt publish (checkpoint) of requests whose prefill completed this step.

The publish of step 5 is queued by ``extend`` / ``prealloc`` and applied at the end
of the step: at the end of ``spec_decode`` (the step's last allocation; a ``decode``
may be followed by one), or at the start of any other call (including reads), or by
``end_step()``. Call ``end_step()`` before
inspecting the SGLang-named attributes directly.

Frees inside one ``release(kind="finish" | "abort")`` batch and inside one publish
batch are grouped as SGLang's result processors group them
(``free_group_begin`` / ``free_group_end``); retraction frees request by request.

With ``AllocatorConfig.swa`` (a hybrid sliding-window model) the pool
is ``SWATokenToKVPoolAllocator`` (full + SWA pools): the allocation functions free
out-of-window SWA slots before each extend / decode / spec allocation as SGLang's
``maybe_evict_swa`` does, ``counters()`` stays the full pool's and ``pool_counters()``
adds the SWA pool's. With the radix cache on as well, the tree is
``allocator.swa_radix.SwaRadixCache`` (SGLang's unified tree with an SWA component).

White-box attributes with SGLang's names: ``req_to_token_pool`` (``req_to_token``,
``free_slots``), ``token_to_kv_pool_allocator`` (``free_pages``, ...),
``tree_cache``; per-row bookkeeping in ``req_kv``; ``kv_info(rid)`` gives one
request's ``ReqKvInfo`` view.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Sequence

import numpy as np

from allocator.allocation import (
    KvContext,
    SpecPlan,
    SpecResult,
    alloc_for_decode,
    alloc_for_decode_run,
    alloc_for_decode_prealloc,
    alloc_for_decode_prealloc_hisparse,
    alloc_for_extend,
    alloc_for_spec_decode,
    alloc_for_spec_run,
    alloc_for_swa_decode_run,
    alloc_for_swa_spec_run,
    checkpoint_kv_cache,
    commit_accepted_tokens,
    evict_from_tree_cache,
    extend_fits,
    hold_kv,
    prealloc_fits,
    prepare_spec_decode,
    release_kv_cache,
    swa_prealloc_fits,
    swa_radix_prealloc,
    swa_radix_prealloc_fits,
    swa_radix_tail_len,
    undo_prealloc,
)
from allocator.base import (
    AllocatorConfig,
    AllocOutcome,
    AllocResult,
    OutOfMemory,
    RETRACT_DECODE_STEPS,
    PoolCounters,
    ReleaseKind,
    ReleaseResult,
    RequestLens,
    RunResult,
    Violation,
)
from allocator.check.checkpoint import AllocatorState, restore_allocator_state, save_allocator_state
from allocator.check.digest import StateDigest
from allocator.radix_cache import RadixCache, TreeNode
from allocator.reduce import imax, imin, isum
from allocator.req_kv import ReqKvInfo, ReqKvTable
from allocator.req_to_token import ReqToTokenPool
from allocator.sizing import (
    pool_size_tokens,
    req_to_token_width,
    reserve_per_decode,
    uses_bigram_keys,
)
from allocator.mamba import HybridReqToTokenPool, MambaReqKv, extend_track_seqlen
from allocator.mamba_radix import MambaRadixCache
from allocator.swa import SWATokenToKVPoolAllocator
from allocator.swa_radix import SwaRadixCache
from allocator.table_writer import make_table_writer
from allocator.token_to_kv import (
    HiSparseTokenToKVPoolAllocator,
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from traces.namespaces import NamespacedIds, in_namespace, namespace_of

if TYPE_CHECKING:
    from allocator.check.incremental import IncrementalChecker
    from allocator.check.journal import Journal
    from allocator.ownership import SlotOwnership

__all__ = ["KvAllocator", "create_allocator"]

_EMPTY = np.empty(0, dtype=np.int64)
_COUNTER_AVAILABLE = PoolCounters._fields.index("available")
_COUNTER_COMMITTED = PoolCounters._fields.index("committed")
_COUNTER_OVERALLOCATED = PoolCounters._fields.index("overallocated")
_RELEASE_KINDS = ("finish", "retract", "abort")


def _i64(values: object) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.int64)


def _has_duplicates(rids: np.ndarray) -> bool:
    """Whether a request id appears twice in a batch (a set for a short batch: cheaper than ``np.unique``)."""
    n = rids.shape[0]
    if n <= 64:
        return len(set(rids.tolist())) != n
    return bool(np.unique(rids).shape[0] != n)


class KvAllocator:
    """The built-in allocator: SGLang's pools, allocator, radix cache and bookkeeping.

    Args:
        config: sizes and switches.
        free_groups: group the frees of a finish/abort batch and of a publish batch
            as SGLang's result processors do (False: every free applied at once).
        device_flush_every: with ``device="cuda"``, mirror the table writes to the
            device once every this many batched calls (one kernel launch; ``1``:
            after every call). ``sync_device()`` and ``check_integrity()`` mirror
            whatever is pending.

    Raises:
        ValueError: an inconsistent configuration.
    """

    # A run's result (``decode_run``) carries every pool's counters (``RunResult.other_pools``).
    runs_report_pools = True

    def __init__(self, config: AllocatorConfig, *, free_groups: bool = True, device_flush_every: int = 256) -> None:
        config.check()
        self.config = config
        self.free_groups = free_groups
        ps = config.page_size
        self.page_size = ps
        size = pool_size_tokens(config)
        num_rows = config.max_running + config.extra_rows
        if config.mamba is not None:
            self.req_to_token_pool = HybridReqToTokenPool(
                num_rows, req_to_token_width(config), config.mamba, config.device, config.radix_cache
            )
        else:
            self.req_to_token_pool = ReqToTokenPool(num_rows, req_to_token_width(config), config.device)
        allocator: (
            TokenToKVPoolAllocator
            | PagedTokenToKVPoolAllocator
            | HiSparseTokenToKVPoolAllocator
            | SWATokenToKVPoolAllocator
        )
        # The SWA pool's tokens (hybrid sliding-window models), 0 without one.
        self.swa_pool_tokens = 0
        if config.swa is not None:
            self.swa_pool_tokens = config.swa.pool_tokens(size, ps)
            allocator = SWATokenToKVPoolAllocator(size, self.swa_pool_tokens, ps, config.need_sort, config.device)
            self.pool_tokens = size
        elif config.hisparse:
            allocator = HiSparseTokenToKVPoolAllocator(size, ps, config.need_sort, config.hisparse_ratio, config.device)
            self.pool_tokens = allocator.logical_attn_allocator.num_pages * ps
        elif ps == 1:
            allocator = TokenToKVPoolAllocator(size, config.need_sort, config.device)
            self.pool_tokens = size
        else:
            allocator = PagedTokenToKVPoolAllocator(size, ps, config.need_sort, config.device)
            self.pool_tokens = allocator.num_pages * ps
        self.token_to_kv_pool_allocator = allocator
        self.tree_cache: RadixCache
        if config.hicache is not None:
            from allocator.hiradix import HiRadixCache

            self.tree_cache = HiRadixCache.from_config(config.hicache, allocator, self.pool_tokens)
        elif config.swa is not None and config.radix_cache:
            assert isinstance(allocator, SWATokenToKVPoolAllocator)
            self.tree_cache = SwaRadixCache(ps, allocator, config.swa.retain_window, is_eagle=uses_bigram_keys(config.spec))
        elif config.mamba is not None and config.radix_cache:
            # SGLang's UnifiedRadixCache(FULL, MAMBA): checkpointed states beside the KV.
            # NOTE: keyed by tokens even under EAGLE (unified_tree_core.py: is_eagle is
            # off whenever the tree has a MAMBA component).
            assert isinstance(self.req_to_token_pool, HybridReqToTokenPool)
            self.tree_cache = MambaRadixCache(
                ps, allocator, self.req_to_token_pool.mamba_allocator, extra_buffer=config.mamba.extra_buffer,
            )
        else:
            self.tree_cache = RadixCache(
                ps, allocator, disable=not config.radix_cache, is_eagle=uses_bigram_keys(config.spec),
                eviction_policy=config.eviction_policy,
            )
        self.req_kv = ReqKvTable(num_rows + 1, ps, swa=config.swa is not None)
        self.writer = make_table_writer(self.req_to_token_pool, device_flush_every)
        self.ctx = KvContext(
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=allocator,
            tree_cache=self.tree_cache,
            req_kv=self.req_kv,
            writer=self.writer,
            page_size=ps,
            spec_reserve=reserve_per_decode(config.spec, ps),
            hisparse=config.hisparse,
            swa=config.swa,
            mamba_reqs=None if config.mamba is None else {},
            mamba_admitting=None if config.mamba is None else {},
        )
        # The request each Mamba slot was last handed to (-1 never): a leaked or twice
        # freed slot, which no request holds any more, is blamed on it.
        self.mamba_last_holder: np.ndarray | None = (
            None if config.mamba is None else np.full(config.mamba.slots + 1, -1, dtype=np.int64)
        )
        self.ctx.mamba_last_holder = self.mamba_last_holder
        # Mamba radix tree: each admission that copied a cached state, with its match key
        # and the node the state sat on (``check_mamba_pool`` checks the key starts with
        # that node's path while the node still holds the state).
        self.mamba_matches: list[tuple[MambaReqKv, np.ndarray, TreeNode | None]] = []
        self._row_of_rid = np.full(1024, -1, dtype=np.int64)
        self._prompt_len = np.full(1024, -1, dtype=np.int64)
        self._prefilling = np.zeros(1024, dtype=bool)
        # per rid: the chunk end last stashed (checkpointed) into the tree, -1 none
        self._stashed = np.full(1024, -1, dtype=np.int64)
        self._pending_publish: list[tuple[int, int, np.ndarray]] = []
        # Streaming sessions, per rid: the tokens its session holds between turns (-1: not
        # held), and whether it has turned (a later turn publishes nothing to the tree).
        self._session_held = np.full(1024, -1, dtype=np.int64)
        self._turned = np.zeros(1024, dtype=bool)
        self.sum_session_held = 0  # sum of committed - protected over held requests
        # The rids a session owns, from the first hold to the close (or abort): their rows
        # count as ``session_held`` whether a turn runs on them or not (SGLang's split).
        self._session_rids: set[int] = set()
        # per live rid: the cache namespace its token ids carried when admitted (what
        # ``allocator.check.namespaces`` holds its radix lock to); absent: none
        self.request_namespaces: dict[int, str] = {}
        self._namespaced = False  # some request had a namespace: check_integrity checks them
        self._digest: StateDigest | None = None  # kept from the first state_digest() on
        # The incremental checker (attached by the first check_integrity(touched)) and
        # its journal, which also records the requests a prompt publish checkpoints.
        self.journal: Journal | None = None
        self._checker: IncrementalChecker | None = None
        # HiCache: the host tier's transfers of a step are acked at the next step's first
        # allocation (SGLang polls ``check_hicache_events`` before it schedules), and the
        # admissions' prefix tokens by tier: on device, loaded back from host, computed.
        self.hicache = config.hicache is not None
        self._hicache_ack_due = False
        self.hicache_hits = {"device": 0, "host": 0, "miss": 0}

    # ------------------------------------------------------------------ rid <-> row

    def _grow(self, max_rid: int) -> None:
        size = self._row_of_rid.shape[0]
        if max_rid < size:
            return
        new = max(2 * size, max_rid + 1)
        for name, fill in (
            ("_row_of_rid", -1), ("_prompt_len", -1), ("_prefilling", False), ("_stashed", -1),
            ("_session_held", -1), ("_turned", False),
        ):
            old = getattr(self, name)
            arr = np.full(new, fill, dtype=old.dtype)
            arr[:size] = old
            setattr(self, name, arr)

    def _note_namespace(self, rid: int, token_ids: np.ndarray) -> None:
        if type(token_ids) is NamespacedIds and token_ids.namespace is not None:
            self.request_namespaces[rid] = token_ids.namespace
            self._namespaced = True

    def _rows_of(self, rids: np.ndarray) -> np.ndarray:
        """Row per rid, -1 where the request holds none."""
        if rids.shape[0] == 0:
            return _EMPTY
        if rids.dtype != np.int64:
            rids = _i64(rids)
        # One reduction for both checks: as unsigned, a negative id is the largest.
        top = imax(rids.view(np.uint64))
        if top >= self._row_of_rid.shape[0]:
            if top >= 1 << 63:
                raise ValueError(f"request ids must be >= 0, found {imin(rids)}")
            self._grow(top)
        return self._row_of_rid[rids]

    def _held_rows(self, rids: np.ndarray, op: str) -> np.ndarray:
        """Rows of requests that must hold KV (ValueError naming the first that does not)."""
        if self.config.debug_checks:
            if rids.shape[0] and int(rids.min()) < 0:
                raise ValueError(f"{op}: request ids must be >= 0, found {int(rids.min())}")
            if np.unique(rids).shape[0] != rids.shape[0]:
                raise ValueError(f"{op}: a request id appears twice in one batch")
        try:
            rows = self._row_of_rid[rids]
        except IndexError:
            rows = self._rows_of(rids)
        n = rows.shape[0]
        if n and (int(rows[0]) < 0 if n == 1 else imin(rows) < 0):
            bad = int(rids[int(np.argmin(rows))])
            raise ValueError(f"{op}: request rid={bad} holds no KV (never extended, or already released)")
        return rows

    def kv_info(self, rid: int) -> ReqKvInfo | None:
        """SGLang-named read-only view of one request's bookkeeping (None: holds no KV)."""
        self._flush_publish()
        rows = self._rows_of(_i64([rid]))
        return None if rows[0] < 0 else self.req_kv.info(int(rows[0]))

    def row_of(self, rid: int) -> int:
        """The request's ``req_to_token`` row, -1 when it holds none."""
        return int(self._rows_of(_i64([rid]))[0])

    def rows_by_rid(self) -> np.ndarray:
        """The row each request id holds, indexed by request id (-1: none; ids past
        the end hold none). A read-only int64 view of the live map."""
        view = self._row_of_rid.view()
        view.flags.writeable = False
        return view

    # ------------------------------------------------------------------ publish queue

    def end_step(self) -> None:
        """Apply the prompt publishes queued by this step's extend / prealloc."""
        self._flush_publish()
        if self.hicache:
            self._hicache_ack_due = True

    def _hicache_poll(self) -> None:
        """The host tier's per-step poll (SGLang's ``check_hicache_events``, run before
        the scheduler admits): finish the backups and load-backs of the step before, whose
        transfers are synchronous here. Called by the first allocation after ``end_step``."""
        if self._hicache_ack_due:
            self._hicache_ack_due = False
            self.tree_cache.ack()  # type: ignore[attr-defined]

    def poll_hicache(self) -> None:
        """Run the host tier's per-step poll now if it is due (no-op otherwise): the
        scheduler model polls before it admits, as SGLang's ``get_next_batch_to_run``
        does, so admission sees the previous step's backups acknowledged. A replay
        polls at the step's first allocation, after the same releases."""
        if self.hicache:
            self._flush_publish()
            self._hicache_poll()

    def _flush_publish(self) -> None:
        pending = self._pending_publish
        if not pending:
            return
        self._pending_publish = []
        if self.journal is not None:
            self.journal.touch([rid for rid, _, _ in pending])
        allocator = self.token_to_kv_pool_allocator
        grouped = self.free_groups
        if grouped:
            allocator.free_group_begin()
        try:
            for rid, up_to, token_ids in pending:
                row = int(self._row_of_rid[rid])
                if row < 0:
                    continue
                checkpoint_kv_cache(self.ctx, row, up_to, token_ids, int(self._prompt_len[rid]))
        finally:
            if grouped:
                allocator.free_group_end()

    # ------------------------------------------------------------------ extend

    def extend(
        self,
        rids: np.ndarray,
        seq_lens: np.ndarray,
        token_ids: Sequence[np.ndarray],
        prefill_done: np.ndarray | None = None,
    ) -> AllocOutcome:
        """Prefill, or the next prefill chunk of, each request (see ``Allocator.extend``).

        The radix match of a new request uses its whole ``token_ids[i]`` (SGLang
        matches the full fill ids) capped at ``len - 1`` tokens, then at
        ``seq_lens[i] - 1`` so the chunk computes at least one token.

        Raises:
            ValueError: bad batch (lengths, a request extended past its row width,
                a decoding request extended, token ids shorter than ``seq_lens``);
                nothing changed.
        """
        self._flush_publish()
        if self.hicache:
            self._hicache_poll()
        rids = _i64(rids)
        seq_lens = _i64(seq_lens)
        bs = rids.shape[0]
        if bs == 0:
            return AllocResult(0, prefix_lens=_EMPTY.copy())
        if seq_lens.shape[0] != bs or len(token_ids) != bs:
            raise ValueError(
                f"extend: {bs} rids but {seq_lens.shape[0]} seq_lens and {len(token_ids)} token id arrays"
            )
        done = np.ones(bs, dtype=bool) if prefill_done is None else np.asarray(prefill_done, dtype=bool)
        rows = self._rows_of(rids)
        self._check_extend(rids, rows, seq_lens, token_ids)

        ctx = self.ctx
        tree = self.tree_cache
        kv = self.req_kv
        ps = self.page_size
        # With the Mamba tree a call evicts in more places than the KV allocation (a
        # match's copy-on-write, a chunk's state copy, the slot deficit), with a host tier
        # too (a load-back evicts its device shortfall): count them all.
        evicted_before = tree.evicted_tokens_total if isinstance(tree, MambaRadixCache) or self.hicache else -1
        prefix = np.zeros(bs, dtype=np.int64)
        cont = (rows >= 0).nonzero()[0]
        # (a) a continuing chunk first publishes the chunk before (SGLang stash_chunked_request);
        # a session's later turn publishes nothing (SGLang's try_checkpoint)
        stash = cont[~self._turned[rids[cont]]] if cont.size else cont
        self._stash(rids[stash], rows[stash], [token_ids[i] for i in stash.tolist()])
        prefix[cont] = kv.kv_allocated_len[rows[cont]]
        new_idx = (rows < 0).nonzero()[0].tolist()
        keys: list[np.ndarray] = []
        if not tree.disable:
            # SGLang's match key: the fill ids capped at min(len - 1, seq_len - 1) tokens
            # (``_compute_max_prefix_len``; a chunk computes at least one token).
            for i in new_idx:
                toks = token_ids[i]
                self._note_namespace(int(rids[i]), toks)
                keys.append(tree.make_key(toks[: max(min(len(toks), int(seq_lens[i])) - 1, 0)]))
        # (b) decide the fit before any match: a match touches access times and splits
        # nodes, a lock protects evictable cache; a call that fails changes nothing.
        # (Without new requests nothing is matched: alloc_for_extend decides alone.)
        # (With a host tier the match loads host hits back, taking device slots: the fit
        # is alloc_for_extend's alone, and a call that does not fit keeps what it loaded,
        # as SGLang's tree keeps a load-back whose request is not admitted.)
        if keys and not self.hicache:
            # Demand bound with no prefix hit: each request's pages cover at most
            # its new tokens plus one partial page.
            need_max = isum(seq_lens) - isum(prefix) + (bs * (ps - 1) if ps > 1 else 0)
            mamba_tree = tree if isinstance(tree, MambaRadixCache) else None
            if (
                len(new_idx) > self.req_to_token_pool.available_size()
                or need_max > self.token_to_kv_pool_allocator.available_size()
                or (mamba_tree is not None and len(new_idx) > mamba_tree.mamba_allocator.available_size())
            ):
                swa_lock_cost = mamba_lock_cost = 0
                if isinstance(tree, SwaRadixCache):
                    peek, lock_cost, swa_lock_cost = tree.peek_match_lock_swa(keys)
                elif mamba_tree is not None:
                    peek, lock_cost, mamba_lock_cost = mamba_tree.peek_match_lock_mamba(keys)
                else:
                    peek, lock_cost = tree.peek_match_lock(keys)
                prefix[new_idx] = peek
                unfit = extend_fits(ctx, rids, rows, prefix, seq_lens, lock_cost, swa_lock_cost, mamba_lock_cost)
                if unfit is not None:
                    self.writer.end_call()  # the checkpoints of (a) may have rewritten rows
                    return unfit
        # (c) match and lock each new request, in batch order
        lock_nodes: list[TreeNode | None] = [None] * bs
        prefix_slots: list[np.ndarray | None] = [None] * bs
        swa_tree = tree if isinstance(tree, SwaRadixCache) else None
        mamba_tree = tree if isinstance(tree, MambaRadixCache) else None
        admitting = ctx.mamba_admitting
        swa_uuids: list[int | None] = [None] * bs
        branching = np.full(bs, -1, dtype=np.int64)
        host_hits = np.zeros(bs, dtype=np.int64) if self.hicache else None
        for i, key in zip(new_idx, keys):
            if host_hits is not None:
                # match on both tiers, load the host part back (SGLang's add_one_req:
                # match_prefix, then init_load_back of best_match_node)
                hi = tree.match_prefix_hi(key)  # type: ignore[attr-defined]
                loaded, node = tree.init_load_back(hi)  # type: ignore[attr-defined]
                host_hits[i] = loaded
                tree.lock(node)
                lock_nodes[i] = node
                p = hi.device_prefix_len + loaded
                if p:
                    prefix_slots[i] = tree.path_device_indices(node)[:p]
                prefix[i] = p
                continue
            if swa_tree is not None:
                match = swa_tree.match_prefix_swa(key)
                if match.swa_branching_seqlen is not None:
                    branching[i] = match.swa_branching_seqlen
            elif mamba_tree is not None:
                # the state-gated match, then the copy of its state into a slot of the
                # request's own (SGLang finalize_match_result_in_cache), then the lock
                match = mamba_tree.match_prefix_mamba(key)
                req = MambaReqKv(int(rids[i]))
                if mamba_tree.extra_buffer:
                    req.branching_seqlen = match.branching_seqlen
                mamba_tree.cow_state(match.last_node, req)
                assert admitting is not None
                admitting[int(rids[i])] = req
                src = req.mamba_cow_src
                if src is not None:
                    holder = match.last_node if match.last_node.mamba_value == src else next(
                        (n for n in mamba_tree.mamba_lru if n.mamba_value == src), None)
                    self.mamba_matches.append((req, key, holder))
            else:
                match = tree.match_prefix(key)
            node = match.last_node
            tree.lock(node)
            if swa_tree is not None:
                swa_uuids[i] = swa_tree.last_lock_uuid
            lock_nodes[i] = node
            p = match.prefix_len
            if p:
                prefix_slots[i] = tree.path_device_indices(node)[:p]
            prefix[i] = p
        # (d) one allocation for the batch
        res = alloc_for_extend(ctx, rids, rows, prefix, seq_lens, prefix_slots, lock_nodes)
        if admitting:
            # (a request left over holds a copied state: give it back, as SGLang's
            # scheduler does for one the adder rejected)
            pool = self.req_to_token_pool
            assert isinstance(pool, HybridReqToTokenPool)
            for req in admitting.values():
                if req.req_pool_idx is None:
                    pool.free_state_slot(req)
            admitting.clear()
        if isinstance(res, OutOfMemory):  # not reached: extend_fits decided above
            for node, uuid in zip(lock_nodes, swa_uuids):
                if swa_tree is not None:
                    swa_tree.unlock(node, uuid)
                else:
                    tree.unlock(node)
            self.writer.end_call()
            return res
        self._row_of_rid[rids] = res.rows
        resumed = rids[self._session_held[rids] >= 0]
        if resumed.size:  # a session's next turn runs on the held KV from here on
            self.sum_session_held -= int(self._session_held[resumed].sum())
            self._session_held[resumed] = -1
        if self.mamba_last_holder is not None:
            held = self.ctx.mamba_reqs
            assert held is not None
            for i in new_idx:
                self.mamba_last_holder[held[int(res.rows[i])].held_slots()] = int(rids[i])
        if mamba_tree is not None and mamba_tree.extra_buffer:
            self._mamba_track_extend(res.rows, prefix, seq_lens)
        if swa_tree is not None:
            for i in new_idx:
                row = int(res.rows[i])
                self.req_kv.lock_swa_uuid[row] = swa_uuids[i]
                self.req_kv.swa_branching_seqlen[row] = branching[i]
        # (e) requests whose prefill is done publish their prompt at the end of the step
        for i in range(bs):
            rid = int(rids[i])
            if done[i]:
                if self._prompt_len[rid] < 0:
                    self._prompt_len[rid] = seq_lens[i]
                self._prefilling[rid] = False
                if not tree.disable and not self._turned[rid]:
                    self._pending_publish.append((rid, int(seq_lens[i]), token_ids[i]))
            else:
                self._prefilling[rid] = True
        self.writer.end_call()
        evicted = res.evicted_tokens if evicted_before < 0 else tree.evicted_tokens_total - evicted_before
        return AllocResult(int(res.out_cache_loc.shape[0]), evicted, prefix, host_hit_lens=host_hits)

    def _mamba_track_extend(self, rows: np.ndarray, prefix: np.ndarray, seq_lens: np.ndarray) -> None:
        """extra_buffer: the state each chunk's forward tracks (``extend_track_seqlen``)."""
        tree = self.tree_cache
        pool = self.req_to_token_pool
        held = self.ctx.mamba_reqs
        assert isinstance(tree, MambaRadixCache) and isinstance(pool, HybridReqToTokenPool) and held is not None
        for i in range(rows.shape[0]):
            req = held[int(rows[i])]
            p = int(prefix[i])
            seqlen = extend_track_seqlen(
                p, int(seq_lens[i]) - p, tree.checkpoint_grid, tree.cache_chunk, tree.state_chunk, req.branching_seqlen
            )
            if seqlen is not None:
                pool.track_extend(req, seqlen)

    def _mamba_track_decode(self, rows: np.ndarray, pre_lens: np.ndarray) -> None:
        """extra_buffer: the boundaries the decode or verify forwards since ``pre_lens``
        (committed lengths) crossed (``crossed_track_seqlen``), in order."""
        tree = self.tree_cache
        if not (isinstance(tree, MambaRadixCache) and tree.extra_buffer) or rows.shape[0] == 0:
            return
        pool = self.req_to_token_pool
        held = self.ctx.mamba_reqs
        assert isinstance(pool, HybridReqToTokenPool) and held is not None
        grid = tree.track_grid
        post_lens = self.req_kv.kv_committed_len[rows]
        for i in np.flatnonzero(post_lens // grid != pre_lens // grid).tolist():
            req = held[int(rows[i])]
            if req.ping_pong is None:
                continue
            for boundary in range((int(pre_lens[i]) // grid + 1) * grid, int(post_lens[i]) + 1, grid):
                pool.track_decode(req, boundary)

    def stash_chunked(self, rids: np.ndarray, token_ids: Sequence[np.ndarray]) -> None:
        """Checkpoint the prefill computed so far by requests in chunked prefill
        (SGLang's ``stash_chunked_request``, run at the top of every scheduling step).

        ``extend`` does this itself for each continuing chunk before matching new
        requests; calling it earlier in the step is equivalent (each chunk is stashed
        once). It is not part of the allocation: an ``extend`` that then runs out of
        memory leaves the stash done, as SGLang does.

        Raises:
            ValueError: a request is not in chunked prefill, or too few token ids.
        """
        self._flush_publish()
        rids = _i64(rids)
        rows = self._held_rows(rids, "stash_chunked")
        for i in range(rids.shape[0]):
            rid = int(rids[i])
            if not self._prefilling[rid]:
                raise ValueError(f"stash_chunked: request rid={rid} is not in chunked prefill")
            if len(token_ids[i]) < int(self.req_kv.kv_allocated_len[rows[i]]) and not self.tree_cache.disable:
                raise ValueError(f"stash_chunked: request rid={rid} has too few token ids")
        self._stash(rids, rows, token_ids)
        self.writer.end_call()

    def _stash(self, rids: np.ndarray, rows: np.ndarray, token_ids: Sequence[np.ndarray]) -> None:
        if self.tree_cache.disable:
            return
        kv = self.req_kv
        for i in range(rids.shape[0]):
            rid = int(rids[i])
            row = int(rows[i])
            up_to = int(kv.kv_allocated_len[row])
            if self._stashed[rid] == up_to:
                continue
            checkpoint_kv_cache(self.ctx, row, up_to, token_ids[i], int(self._prompt_len[rid]))
            self._stashed[rid] = up_to

    def _check_extend(
        self, rids: np.ndarray, rows: np.ndarray, seq_lens: np.ndarray, token_ids: Sequence[np.ndarray]
    ) -> None:
        width = self.req_to_token_pool.max_context_len
        if rids.shape[0] > 1 and _has_duplicates(rids):
            raise ValueError("extend: a request id appears twice in one batch")
        if imin(seq_lens) < 1:
            raise ValueError(f"extend: request rid={int(rids[int(np.argmin(seq_lens))])} has seq_len < 1")
        if imax(seq_lens) > width:
            i = int(np.argmax(seq_lens))
            raise ValueError(
                f"extend: request rid={int(rids[i])} seq_len {int(seq_lens[i])} exceeds the row width {width} "
                f"(max_context_len {self.config.max_context_len}); raise max_context_len"
            )
        kv = self.req_kv
        for i in (rows >= 0).nonzero()[0].tolist():
            rid = int(rids[i])
            allocated = int(kv.kv_allocated_len[rows[i]])
            if not self._prefilling[rid] and self._session_held[rid] < 0:
                raise ValueError(f"extend: request rid={rid} already finished its prefill (it decodes now)")
            if int(seq_lens[i]) <= allocated:
                raise ValueError(
                    f"extend: request rid={rid} chunk ends at {int(seq_lens[i])}, not past its {allocated} positions"
                )
        if not self.tree_cache.disable:
            for i in range(rids.shape[0]):
                if len(token_ids[i]) < int(seq_lens[i]):
                    raise ValueError(
                        f"extend: request rid={int(rids[i])} has {len(token_ids[i])} token ids, "
                        f"fewer than its seq_len {int(seq_lens[i])}"
                    )

    # ------------------------------------------------------------------ decode / spec

    def decode(self, rids: np.ndarray) -> AllocOutcome:
        """One decode token per request (``alloc_for_decode``)."""
        if self.hicache:
            self._hicache_poll()
        rids = _i64(rids)
        rows = self._held_rows(rids, "decode")
        pre_lens = self.req_kv.kv_committed_len[rows].copy()
        res = alloc_for_decode(self.ctx, rows, rids)
        if isinstance(res, OutOfMemory):
            return res
        self._mamba_track_decode(rows, pre_lens)
        # NOTE: no prompt publish here: a spec_decode of the same step (some requests
        # decode, others verify drafts) must run before it, as in SGLang's step.
        self.writer.end_call()
        return AllocResult(rids.shape[0], res.evicted_tokens)

    def decode_run(self, rids: np.ndarray, num_steps: int) -> RunResult | None:
        """``num_steps`` decode steps of the same batch in one call, exactly as
        ``num_steps`` calls of ``decode(rids)`` (``alloc_for_decode_run``).

        Returns:
            The pool counters and allocated lengths after each step; or None when the
            run cannot be done in one block (it would evict, merge deferred frees or
            reach a row's width, or prompts wait to be published): nothing changed,
            decode step by step.
        """
        if self._pending_publish or self.hicache or not _runs_are_exact(type(self)):
            return None  # (a host tier polls its transfers once per step)
        rids = _i64(rids)
        rows = self._held_rows(rids, "decode")
        allocated = self.req_kv.kv_allocated_len[rows]
        steps = np.arange(1, num_steps + 1, dtype=np.int64)
        committed = rids.shape[0] * steps
        if self.config.swa is not None:
            return self._swa_decode_run(rows, num_steps, allocated, committed)
        before = np.array(self.counters(), dtype=np.int64)
        pre_lens = self.req_kv.kv_committed_len[rows].copy()
        taken = alloc_for_decode_run(self.ctx, rows, num_steps)
        if taken is None:
            return None
        self._mamba_track_decode(rows, pre_lens)
        self.writer.end_call()
        return RunResult(
            _counters_after(before, taken, committed), allocated[None, :] + steps[:, None], self._still_pools(num_steps)
        )

    def _swa_decode_run(
        self, rows: np.ndarray, num_steps: int, allocated: np.ndarray, committed: np.ndarray
    ) -> RunResult | None:
        """``decode_run`` with an SWA pool (``alloc_for_swa_decode_run``): both pools'
        counters after each step (``RunResult.other_pools``: the SWA pool's)."""
        pools = self.pool_counters()
        before_full = np.array(pools["full"], dtype=np.int64)
        before_swa = np.array(pools["swa"], dtype=np.int64)
        run = alloc_for_swa_decode_run(self.ctx, rows, num_steps)
        if run is None:
            return None
        self.writer.end_call()
        swa = _counters_after(before_swa, run.taken, committed)
        swa[:, _COUNTER_AVAILABLE] += np.cumsum(run.swa_released)
        swa[:, _COUNTER_COMMITTED] -= np.cumsum(run.swa_window_freed)
        steps = np.arange(1, num_steps + 1, dtype=np.int64)
        return RunResult(
            _counters_after(before_full, run.taken, committed), allocated[None, :] + steps[:, None], (swa,),
            run.swa_evicted,
        )

    def spec_decode_run(self, rids: np.ndarray, accepted: np.ndarray) -> RunResult | None:
        """``accepted.shape[0]`` speculative steps of the same batch in one call, exactly
        as that many calls of ``spec_decode(rids, accepted[j])`` (``alloc_for_spec_run``;
        with an SWA pool ``alloc_for_swa_spec_run``).

        Returns:
            The pool counters and allocated lengths after each step, or None when the
            run cannot be done in one block (nothing changed).
        """
        if self._pending_publish or self.config.spec is None or not _runs_are_exact(type(self)):
            return None
        rids = _i64(rids)
        accepted = np.ascontiguousarray(accepted, dtype=np.int64)
        if accepted.ndim != 2 or accepted.shape[1] != rids.shape[0] or (accepted.size and int(accepted.min()) < 0):
            return None
        rows = self._held_rows(rids, "spec_decode")
        if self.config.swa is not None:
            return self._swa_spec_decode_run(rows, accepted)
        before = np.array(self.counters(), dtype=np.int64)
        pre_lens = self.req_kv.kv_committed_len[rows].copy()
        got = alloc_for_spec_run(self.ctx, rows, accepted)
        if got is None:
            return None
        self._mamba_track_decode(rows, pre_lens)
        taken, allocated = got
        self.writer.end_call()
        return RunResult(
            _counters_after(before, taken, np.cumsum(accepted.sum(axis=1))), allocated,
            self._still_pools(accepted.shape[0]),
        )

    def _still_pools(self, num_steps: int) -> tuple[np.ndarray, ...]:
        """``RunResult.other_pools`` of a run that leaves them as they are: the Mamba
        pool (decode takes no state slot) after each step; () without one."""
        if self.config.mamba is None:
            return ()
        row = np.array(self._mamba_counters(self.counters()), dtype=np.int64)
        return (np.tile(row, (num_steps, 1)),)

    def _swa_spec_decode_run(self, rows: np.ndarray, accepted: np.ndarray) -> RunResult | None:
        """``spec_decode_run`` with an SWA pool (``alloc_for_swa_spec_run``): both pools'
        counters after each step (``RunResult.other_pools``: the SWA pool's)."""
        pools = self.pool_counters()
        before_full = np.array(pools["full"], dtype=np.int64)
        before_swa = np.array(pools["swa"], dtype=np.int64)
        run = alloc_for_swa_spec_run(self.ctx, rows, accepted)
        if run is None:
            return None
        self.writer.end_call()
        committed = np.cumsum(accepted.sum(axis=1))
        swa = _counters_after(before_swa, run.taken, committed)
        swa[:, _COUNTER_AVAILABLE] += np.cumsum(run.swa_released)
        swa[:, _COUNTER_COMMITTED] -= np.cumsum(run.swa_window_freed)
        return RunResult(_counters_after(before_full, run.taken, committed), run.allocated, (swa,), run.swa_evicted)

    def spec_decode(self, rids: np.ndarray, accepted_lens: np.ndarray) -> AllocOutcome:
        """One speculative step: prepare (reserve to ``ceil_align(committed + reserve)``),
        ``alloc_for_spec_decode``, then commit ``accepted_lens``.

        Raises:
            ValueError: no speculative config, or an accepted count past the reserve
                (outside the row-overflow case); nothing changed.
        """
        if self.config.spec is None:
            raise ValueError("spec_decode: the allocator has no speculative config (AllocatorConfig.spec)")
        rids = _i64(rids)
        accepted = _i64(accepted_lens)
        rows = self._held_rows(rids, "spec_decode")
        ctx = self.ctx
        kv = self.req_kv
        plan = prepare_spec_decode(ctx, rows)
        width = ctx.width
        asked = kv.kv_committed_len[rows] + accepted
        overshoot = False
        if rows.shape[0]:
            over_commit = asked - plan.nxt_kv_lens
            if int(over_commit.max()) > 0:
                overshoot = True
                bad = np.flatnonzero((over_commit > 0) & (plan.nxt_kv_lens < width))
                if bad.shape[0]:
                    i = int(bad[0])
                    raise ValueError(
                        f"spec_decode: request rid={int(rids[i])} accepts {int(accepted[i])} tokens, past its "
                        f"reserve (committed {int(kv.kv_committed_len[rows[i]])}, reserved to "
                        f"{int(plan.nxt_kv_lens[i])})"
                    )
        res = self._reserve_spec(rows, plan, rids)
        if isinstance(res, OutOfMemory):
            return res
        pre_lens = kv.kv_committed_len[rows].copy()
        excess = commit_accepted_tokens(ctx, rows, accepted, asked, may_exceed=overshoot)
        self._mamba_track_decode(rows, pre_lens)
        row_overflow: tuple[tuple[int, int, int], ...] = ()
        if plan.overflow or overshoot:
            overflow = {int(kv.rid[row]): (asked_pos, w) for row, asked_pos, w in plan.overflow}
            if excess is not None:
                for i in np.flatnonzero(excess > 0).tolist():
                    rid = int(rids[i])
                    prev = overflow.get(rid, (0, width))[0]
                    overflow[rid] = (max(prev, int(asked[i])), width)
            row_overflow = tuple((rid, asked_pos, w) for rid, (asked_pos, w) in sorted(overflow.items()))
        if self._pending_publish:
            self._flush_publish()
        self.writer.end_call()
        return AllocResult(res.num_tokens, res.evicted_tokens, row_overflow=row_overflow)

    def _reserve_spec(self, rows: np.ndarray, plan: SpecPlan, rids: np.ndarray) -> SpecResult | OutOfMemory:
        """The speculative reserve of one ``spec_decode`` (a method so that a variant
        can restructure it: ``allocator.pre_encapsulation``)."""
        return alloc_for_spec_decode(self.ctx, rows, plan, rids)

    # ------------------------------------------------------------------ PD prealloc

    def prealloc(self, rids: np.ndarray, fill_lens: np.ndarray, token_ids: Sequence[np.ndarray]) -> AllocOutcome:
        """PD decode: a row and KV for ``fill_lens[i]`` positions per request, one request
        at a time as SGLang's pre-allocation queue does (prefix reused from the local
        radix cache when it is on; HiSparse: logical slots only), then each request's
        KV is published to the radix cache at once, in batch order
        (``process_prebuilt``'s checkpoint, before any decode of the step).

        The prefix match uses the prompt: the request's first fill (a request
        pre-allocated again after a retraction matches its prompt only, as SGLang
        matches ``origin_input_ids``). All or nothing: the batch's fit is decided
        before any match, eviction or allocation (rows, and the pages against free +
        evictable slots less what the batch's locks protect; which request evicts
        what does not change that total), so OutOfMemory changes nothing.

        Raises:
            ValueError: bad batch, or a model with a Mamba pool (not served here)."""
        if self.config.mamba is not None:
            raise ValueError("prealloc: PD decode pre-allocation with a Mamba pool is not implemented")
        self._flush_publish()
        rids = _i64(rids)
        fill_lens = _i64(fill_lens)
        bs = rids.shape[0]
        if fill_lens.shape[0] != bs or len(token_ids) != bs:
            raise ValueError(f"prealloc: {bs} rids but {fill_lens.shape[0]} fill_lens and {len(token_ids)} token arrays")
        rows = self._rows_of(rids)
        if bs and int(rows.max()) >= 0:
            bad = int(rids[int(np.argmax(rows))])
            raise ValueError(f"prealloc: request rid={bad} already holds KV")
        if bs and np.unique(rids).shape[0] != bs:
            raise ValueError("prealloc: a request id appears twice in one batch")
        if bs and int(fill_lens.min()) < 1:
            raise ValueError("prealloc: fill_lens must be >= 1")
        if isinstance(self.tree_cache, SwaRadixCache):
            return self._prealloc_swa_radix(rids, fill_lens, token_ids)
        ctx = self.ctx
        tree = self.tree_cache
        ps = self.page_size
        done: list[int] = []
        prefix = np.zeros(bs, dtype=np.int64)
        evicted_before = tree.evicted_tokens_total
        keys: list[np.ndarray] = []
        if self.config.swa is not None:
            # all or nothing: both pools' fit decided before any allocation
            unfit = swa_prealloc_fits(ctx, rids, fill_lens)
            if unfit is not None:
                return unfit
        if not self.config.hisparse and not tree.disable:
            for i in range(bs):
                fill = int(fill_lens[i])
                if len(token_ids[i]) < fill:
                    raise ValueError(
                        f"prealloc: request rid={int(rids[i])} has {len(token_ids[i])} token ids, fewer than {fill}"
                    )
                prompt = int(self._prompt_len[int(rids[i])])
                self._note_namespace(int(rids[i]), token_ids[i])
                keys.append(tree.make_key(token_ids[i][: fill if prompt < 0 else min(prompt, fill)]))
            unfit = prealloc_fits(ctx, rids, fill_lens, keys)
            if unfit is not None:
                return unfit
        for i in range(bs):
            rid = int(rids[i])
            fill = int(fill_lens[i])
            node: TreeNode | None = None
            if self.config.hisparse:
                res = alloc_for_decode_prealloc_hisparse(ctx, rid, fill)
            else:
                p = 0
                slots = None
                if keys:
                    match = tree.match_prefix(keys[i])
                    node = match.last_node
                    tree.lock(node)
                    p = match.prefix_len
                    if p:
                        slots = tree.path_device_indices(node)[:p]
                prefix[i] = p
                res = alloc_for_decode_prealloc(ctx, rid, fill, p, slots, node, not tree.disable)
            if isinstance(res, OutOfMemory):  # HiSparse, or a batch prealloc_fits let through
                tree.unlock(node)
                undo_prealloc(ctx, self._row_of_rid[done].tolist())
                self._row_of_rid[done] = -1
                self.writer.end_call()
                return res
            self._row_of_rid[rid] = res
            done.append(rid)
        for i in range(bs):
            rid = int(rids[i])
            if self._prompt_len[rid] < 0:
                self._prompt_len[rid] = fill_lens[i]
            self._prefilling[rid] = False
        if keys:
            # process_prebuilt: one checkpoint per request, no free group
            for i in range(bs):
                rid = int(rids[i])
                checkpoint_kv_cache(
                    ctx, int(self._row_of_rid[rid]), int(fill_lens[i]), token_ids[i], int(self._prompt_len[rid])
                )
        evicted = tree.evicted_tokens_total - evicted_before
        self.writer.end_call()
        return AllocResult(int((fill_lens - prefix).sum()), evicted, prefix_lens=prefix)

    def _prealloc_swa_radix(
        self, rids: np.ndarray, fill_lens: np.ndarray, token_ids: Sequence[np.ndarray]
    ) -> AllocOutcome:
        """``prealloc`` with SWA and the decode radix cache (``swa_radix_prealloc`` per
        request, the batch's fit decided first), then ``process_prebuilt``'s checkpoint
        of each request in batch order."""
        ctx = self.ctx
        tree = self.tree_cache
        assert isinstance(tree, SwaRadixCache)
        ps = self.page_size
        bs = rids.shape[0]
        evicted_before = tree.evicted_tokens_total
        keys: list[np.ndarray] = []
        for i in range(bs):
            fill = int(fill_lens[i])
            if len(token_ids[i]) < fill:
                raise ValueError(
                    f"prealloc: request rid={int(rids[i])} has {len(token_ids[i])} token ids, fewer than {fill}"
                )
            prompt = int(self._prompt_len[int(rids[i])])
            n = fill if prompt < 0 else min(prompt, fill)
            if ps > 1:  # the match stops before the SWA tail, which is allocated fresh
                n = min(n, fill - swa_radix_tail_len(ctx, fill))
            self._note_namespace(int(rids[i]), token_ids[i])
            keys.append(tree.make_key(token_ids[i][:n]))
        unfit = swa_radix_prealloc_fits(ctx, tree, rids, fill_lens, keys)
        if unfit is not None:
            return unfit
        prefix = np.zeros(bs, dtype=np.int64)
        for i in range(bs):
            rid = int(rids[i])
            row = swa_radix_prealloc(ctx, tree, rid, int(fill_lens[i]), keys[i])
            prefix[i] = int(self.req_kv.cache_protected_len[row])
            self._row_of_rid[rid] = row
        for i in range(bs):
            rid = int(rids[i])
            if self._prompt_len[rid] < 0:
                self._prompt_len[rid] = fill_lens[i]
            self._prefilling[rid] = False
        for i in range(bs):  # process_prebuilt: one checkpoint per request, no free group
            rid = int(rids[i])
            checkpoint_kv_cache(
                ctx, int(self._row_of_rid[rid]), int(fill_lens[i]), token_ids[i], int(self._prompt_len[rid])
            )
        evicted = tree.evicted_tokens_total - evicted_before
        self.writer.end_call()
        return AllocResult(int((fill_lens - prefix).sum()), evicted, prefix_lens=prefix)

    # ------------------------------------------------------------------ release

    def release(
        self,
        rids: np.ndarray,
        owned_lens: np.ndarray,
        token_ids: Sequence[np.ndarray] | None,
        kind: ReleaseKind,
    ) -> ReleaseResult:
        """Release each request's KV (``release_kv_cache``): ``finish`` checkpoints the
        owned prefix; ``retract`` / ``abort`` cache nothing. Over-allocation is always
        freed. ``owned_lens`` above ``kv_committed_len`` are clipped to it.

        Raises:
            ValueError: unknown kind, a request holding no KV, missing token ids for
                a finish; nothing changed.
        """
        if kind not in _RELEASE_KINDS:
            raise ValueError(f"release: kind must be one of {', '.join(_RELEASE_KINDS)}, found {kind!r}")
        self._flush_publish()
        rids = _i64(rids)
        owned = _i64(owned_lens)
        bs = rids.shape[0]
        if owned.shape[0] != bs:
            raise ValueError(f"release: {bs} rids but {owned.shape[0]} owned_lens")
        rows = self._held_rows(rids, "release")
        if bs > 1 and _has_duplicates(rids):
            raise ValueError("release: a request id appears twice in one batch")
        checkpoint = kind == "finish" and not self.tree_cache.disable
        if checkpoint:
            if token_ids is None or len(token_ids) != bs:
                raise ValueError("release: kind='finish' needs token_ids (one array per request)")
            for i in range(bs):
                if len(token_ids[i]) < min(int(owned[i]), int(self.req_kv.kv_committed_len[rows[i]])):
                    raise ValueError(
                        f"release: request rid={int(rids[i])} has {len(token_ids[i])} token ids, "
                        f"fewer than its owned length {int(owned[i])}"
                    )
        overalloc = np.zeros(bs, dtype=np.int64)
        freed = 0
        cached = 0
        evicted = 0
        allocator = self.token_to_kv_pool_allocator
        grouped = self.free_groups and kind != "retract"
        if grouped:
            allocator.free_group_begin()
        try:
            for i in range(bs):
                rid = int(rids[i])
                out = release_kv_cache(
                    self.ctx,
                    int(rows[i]),
                    int(owned[i]),
                    token_ids[i] if checkpoint else None,
                    int(self._prompt_len[rid]),
                    checkpoint,
                )
                freed += out.freed_tokens
                cached += out.cached_tokens
                overalloc[i] = out.overalloc_released
                self._row_of_rid[rid] = -1
                self._prefilling[rid] = False
                self._stashed[rid] = -1
                if self._session_held[rid] >= 0:  # close: the session's KV goes back
                    self.sum_session_held -= int(self._session_held[rid])
                    self._session_held[rid] = -1
                self._turned[rid] = False
                self._session_rids.discard(rid)
                if kind != "retract":
                    self._prompt_len[rid] = -1
                    self.request_namespaces.pop(rid, None)
                else:
                    evicted += evict_from_tree_cache(self.ctx, self._num_decoding() * RETRACT_DECODE_STEPS)
        finally:
            if grouped:
                allocator.free_group_end()
            self.writer.end_call()
        return ReleaseResult(freed, cached, overalloc, evicted)

    def hold(self, rids: np.ndarray, held_lens: np.ndarray) -> ReleaseResult:
        """Streaming sessions: each turn ends and its session keeps the KV of its first
        ``held_lens`` tokens (clipped to ``kv_committed_len``), neither cached nor freed;
        the row and the tree lock stay (SGLang ``try_cache_finished_req``). The next turn
        is an ``extend`` of the same request from the held length; ``close_session``
        releases it.

        Raises:
            ValueError: a request holding no KV, or one already held, or a sliding-window
                or HiSparse pool (not modelled); nothing changed.
        """
        if self.config.swa is not None or self.config.hisparse:
            raise ValueError("hold: streaming sessions are modelled for full-attention pools only")
        self._flush_publish()
        rids = _i64(rids)
        held = _i64(held_lens)
        bs = rids.shape[0]
        if held.shape[0] != bs:
            raise ValueError(f"hold: {bs} rids but {held.shape[0]} held_lens")
        rows = self._held_rows(rids, "hold")
        if bs and int(self._session_held[rids].max()) >= 0:
            bad = int(rids[int(np.argmax(self._session_held[rids]))])
            raise ValueError(f"hold: request rid={bad} is already held by its session")
        overalloc = np.zeros(bs, dtype=np.int64)
        freed = 0
        kv = self.req_kv
        try:
            for i in range(bs):
                rid = int(rids[i])
                row = int(rows[i])
                out = hold_kv(self.ctx, row, int(held[i]))
                freed += out.freed_tokens
                overalloc[i] = out.overalloc_released
                tokens = int(kv.kv_committed_len[row] - kv.cache_protected_len[row])
                self._session_held[rid] = tokens
                self.sum_session_held += tokens
                self._turned[rid] = True
                self._session_rids.add(rid)
                self._prefilling[rid] = False
                self._stashed[rid] = -1
        finally:
            self.writer.end_call()
        return ReleaseResult(freed, 0, overalloc, 0)

    def close_session(self, rids: np.ndarray) -> ReleaseResult:
        """Streaming sessions: release the KV each request's session holds, nothing cached
        (SGLang ``release_session``: the tail past the tree's prefix is freed, the lock
        goes).

        Raises:
            ValueError: a request its session does not hold; nothing changed.
        """
        rids = _i64(rids)
        self._rows_of(rids)
        if rids.shape[0] and int(self._session_held[rids].min()) < 0:
            bad = int(rids[int(np.argmin(self._session_held[rids]))])
            raise ValueError(f"close: request rid={bad} is not held by a session")
        return self.release(rids, self.req_kv.kv_committed_len[self._row_of_rid[rids]], None, "abort")

    def session_held(self, rids: np.ndarray) -> np.ndarray:
        """Tokens each request's session holds outside the tree (-1: not held)."""
        rids = _i64(rids)
        self._rows_of(rids)
        return self._session_held[rids].copy()

    def _num_decoding(self) -> int:
        """Requests holding KV whose prefill is done (SGLang's running decode batch)."""
        pool = self.req_to_token_pool
        in_use = pool.size - pool.available_size()
        return in_use - int(np.count_nonzero(self._prefilling))

    # ------------------------------------------------------------------ cache

    def evict(self, num_tokens: int) -> int:
        """Evict at least ``num_tokens`` unlocked cached tokens (LRU leaves, whole nodes)."""
        self._flush_publish()
        if self.hicache:
            self._hicache_poll()
        return self.tree_cache.evict(int(num_tokens))

    def evict_to_fit(self, num_tokens: int) -> int:
        """SGLang's ``evict_from_tree_cache``: evict only the shortfall of ``num_tokens``
        against the free slots (e.g. ``remaining_requests * 20`` after a retraction)."""
        self._flush_publish()
        return evict_from_tree_cache(self.ctx, int(num_tokens))

    def match_prefix(self, token_ids: np.ndarray) -> int:
        """Length a new request with these fill ids would reuse (page aligned, capped at
        ``len - 1``). A pure query: no access time is touched and no node split."""
        self._flush_publish()
        tree = self.tree_cache
        if tree.disable:
            return 0
        toks = in_namespace(np.asarray(token_ids, dtype=np.int64), namespace_of(token_ids))
        return tree.peek_prefix_len(tree.make_key(toks[: max(toks.shape[0] - 1, 0)]))

    def match_prefix_hi(self, token_ids: np.ndarray) -> tuple[int, int]:
        """With the host tier: ``(device prefix, host hit)`` a new request with these
        fill ids would match (``HiRadixCache.match_prefix_hi``'s lengths, capped as
        ``match_prefix``); a pure query like it. Without the tier the host hit is 0."""
        if not self.hicache:
            return self.match_prefix(token_ids), 0
        self._flush_publish()
        toks = np.asarray(token_ids, dtype=np.int64)
        tree = self.tree_cache
        return tree.peek_prefix_hi(tree.make_key(toks[: max(toks.shape[0] - 1, 0)]))  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ reads

    def counters(self) -> PoolCounters:
        """Pool token counts now (O(1): sums kept by the allocation functions)."""
        self._flush_publish()
        return self.counters_now()

    def counters_now(self) -> PoolCounters:
        """``counters()`` without publishing the prompts queued for the step's end (what
        the invariant checks read: a check changes nothing)."""
        kv = self.req_kv
        pool = self.req_to_token_pool
        if self.config.hisparse:
            available = self.token_to_kv_pool_allocator.logical_available_size()
        elif self.config.swa is not None:
            available = self.token_to_kv_pool_allocator.full_available_size()
        else:
            available = self.token_to_kv_pool_allocator.available_size()
        s_committed, s_overallocated = self._session_parts()
        return PoolCounters(
            pool_tokens=self.pool_tokens,
            available=available,
            evictable=self.tree_cache.evictable_size(),
            protected=self.tree_cache.protected_size(),
            committed=kv.sum_committed - kv.sum_protected - s_committed,
            overallocated=kv.sum_allocated_ceil - kv.sum_committed - s_overallocated,
            running_requests=pool.size - pool.available_size(),
            free_rows=pool.available_size(),
            session_held=s_committed + s_overallocated,
        )

    def _session_parts(self) -> tuple[int, int]:
        """The session-owned rows' ``committed - protected`` and ``ceil_align(allocated)
        - committed`` sums (O(sessions)). SGLang counts a session's row whole as
        session-held (``kv_private_tokens``: ``ceil_align(kv_allocated_len, page) -
        cache_protected_len``) from the session's take to its close, while a turn runs on
        it too (``pool_stats_observer.session_held_tokens``); the counters move these
        parts out of ``committed`` and ``overallocated`` into ``session_held``. A trace
        opens a session at its first ``hold``, so the first turn counts as a request's."""
        if not self._session_rids:
            return 0, 0
        kv = self.req_kv
        rows = self._row_of_rid[np.fromiter(self._session_rids, dtype=np.int64)]
        committed = kv.kv_committed_len[rows]
        ps = self.page_size
        ceil = -(-kv.kv_allocated_len[rows] // ps) * ps
        return int((committed - kv.cache_protected_len[rows]).sum()), int((ceil - committed).sum())

    def pool_counters(self) -> dict[str, PoolCounters]:
        """Token counts of each KV pool now: ``{"full": counters()}``, and with a
        sliding-window pool ``"swa"`` too (O(1)). With the radix cache the SWA pool's
        evictable / protected are the tree's SWA ledgers (``allocator.swa_radix``); a
        request holds ``ceil_align(allocated) - protected - window_freed`` SWA tokens,
        its window-freed tokens leaving ``committed``."""
        full = self.counters()
        if self.hicache:
            return {"full": full, "host": self._host_counters(full)}
        if self.config.mamba is not None:
            return {"full": full, "mamba": self._mamba_counters(full)}
        if self.config.swa is None:
            return {"full": full}
        kv = self.req_kv
        tree = self.tree_cache
        swa_tree = isinstance(tree, SwaRadixCache)
        swa = PoolCounters(
            pool_tokens=self.swa_pool_tokens,
            available=self.token_to_kv_pool_allocator.swa_available_size(),
            evictable=tree.swa_evictable_size() if swa_tree else 0,
            protected=tree.swa_protected_size() if swa_tree else 0,
            committed=kv.sum_committed - kv.sum_protected - kv.sum_swa_freed,
            overallocated=full.overallocated,
            running_requests=full.running_requests,
            free_rows=full.free_rows,
        )
        return {"full": full, "swa": swa}

    def _host_counters(self, full: PoolCounters) -> PoolCounters:
        """The HiCache host pool in tokens: ``evictable`` the host-only unlocked leaves
        (what host eviction may free), ``protected`` every other host copy (duplicates of
        device nodes, locked or in-flight ones); requests hold no host slot."""
        tree = self.tree_cache
        host = tree.host_pool  # type: ignore[attr-defined]
        available = host.available_size()
        evictable = tree.host_evictable_size()  # type: ignore[attr-defined]
        return PoolCounters(
            pool_tokens=host.size,
            available=available,
            evictable=evictable,
            protected=host.size - available - evictable,
            committed=0,
            overallocated=0,
            running_requests=full.running_requests,
            free_rows=full.free_rows,
        )

    def _mamba_counters(self, full: PoolCounters) -> PoolCounters:
        """The Mamba pool in slots: ``committed`` the slots requests hold, ``evictable`` /
        ``protected`` the checkpoints the Mamba radix tree caches (unlocked / locked;
        0 without the radix cache), nothing over-allocated."""
        pool = self.req_to_token_pool
        assert isinstance(pool, HybridReqToTokenPool)
        held = sum(len(req.held_slots()) for req in self.mamba_reqs())
        tree = self.tree_cache
        mamba_tree = isinstance(tree, MambaRadixCache)
        return PoolCounters(
            pool_tokens=pool.mamba_size,
            available=pool.mamba_available_size(),
            evictable=tree.mamba_evictable_size() if mamba_tree else 0,
            protected=tree.mamba_protected_size() if mamba_tree else 0,
            committed=held,
            overallocated=0,
            running_requests=full.running_requests,
            free_rows=full.free_rows,
        )

    def mamba_reqs(self) -> list[MambaReqKv]:
        """Each request's Mamba bookkeeping (row, state slot), in row order; empty for a
        model without a Mamba pool."""
        held = self.ctx.mamba_reqs
        return [] if held is None else [held[row] for row in sorted(held)]

    def request_lens(self, rids: np.ndarray) -> RequestLens:
        self._flush_publish()
        rows = self._rows_of(_i64(rids))
        kv = self.req_kv
        if rows.shape[0] and imin(rows) >= 0:  # the common case: all still hold KV
            return RequestLens(kv.kv_allocated_len[rows], kv.kv_committed_len[rows], kv.cache_protected_len[rows])
        # (gathers are copies: zero the requests holding none in place)
        none = rows < 0
        safe = rows.copy()
        safe[none] = 0
        lens = RequestLens(kv.kv_allocated_len[safe], kv.kv_committed_len[safe], kv.cache_protected_len[safe])
        for a in lens:
            a[none] = 0
        return lens

    def swa_evicted_lens(self, rids: np.ndarray) -> np.ndarray:
        """int64 ``[n]``: each request's SWA cursor ``swa_evicted_seqlen`` (positions below
        it may have given their SWA slots back; ``allocator.swa_window``); 0 for a request
        holding no KV and for a model without a sliding-window pool. A read only."""
        self._flush_publish()
        rows = self._rows_of(_i64(rids))
        if self.config.swa is None or rows.shape[0] == 0:
            return np.zeros(rows.shape[0], np.int64)
        return np.where(rows >= 0, self.req_kv.swa_evicted_seqlen[np.maximum(rows, 0)], 0).astype(np.int64)

    def mamba_slots(self, rids: np.ndarray) -> np.ndarray:
        """int64 ``[n]``: each request's Mamba state slot (``mamba_pool_idx``), -1 for a
        request holding none and for a model without a Mamba pool. A read only (the
        dashboard's request table shows it)."""
        self._flush_publish()
        rows = self._rows_of(_i64(rids))
        held = self.ctx.mamba_reqs
        out = np.full(rows.shape[0], -1, np.int64)
        if held is None:
            return out
        for i, row in enumerate(rows.tolist()):
            req = held.get(row) if row >= 0 else None
            if req is not None and req.mamba_pool_idx is not None:
                out[i] = req.mamba_pool_idx
        return out

    def holds_kv(self, rids: np.ndarray) -> np.ndarray:
        return self._rows_of(_i64(rids)) >= 0

    def row_slots(self, rid: int) -> np.ndarray:
        self._flush_publish()
        row = self.row_of(rid)
        if row < 0:
            return _EMPTY.copy()
        n = int(self.req_kv.kv_allocated_len[row])
        return self.req_to_token_pool.req_to_token_np[row, :n].astype(np.int64)

    def live_rids(self) -> np.ndarray:
        """Request ids holding KV now (ascending)."""
        return np.sort(self.req_kv.rid[self.req_kv.rid >= 0])

    def sync_device(self) -> None:
        """Make the device ``req_to_token`` (``device="cuda"``) equal to the host copy."""
        self._flush_publish()
        self.writer.sync()

    def save_state(self) -> AllocatorState:
        """A checkpoint of the whole state (``allocator.check.checkpoint``); between steps."""
        return save_allocator_state(self)

    def restore_state(self, state: object) -> None:
        """Go back to a checkpoint ``save_state`` returned (any number of times)."""
        if not isinstance(state, AllocatorState):
            raise TypeError(f"restore_state: expected an AllocatorState, found {type(state).__name__}")
        restore_allocator_state(self, state)

    def state_digest(self) -> str:
        """A digest of the physical state: every row's slots and lengths, the free
        lists in order, the free rows (``allocator.check.digest``; ``Digestible``). The first
        call hashes everything; later calls only what changed since."""
        self._flush_publish()
        if self._digest is None:
            self._digest = StateDigest(self)
        return self._digest.digest()

    def check_integrity(self, touched: np.ndarray | None = None) -> list[Violation]:
        """Every broken invariant (see ``allocator.check.invariants``).

        Args:
            touched: None walks the whole state. Else the request ids of the calls
                since the previous check: the first such check walks the whole state
                and attaches an incremental checker (``allocator.check.incremental``), which
                from then on verifies only what the calls changed.

        Returns:
            The violations found (empty when sound).
        """
        from allocator.check.invariants import check_integrity, check_session_held

        # NOTE: only the device mirror is synced: the prompt publishes queued for the end
        # of the step stay queued, so a check between two calls of a step changes nothing.
        self.writer.sync()
        if self.hicache:
            # (no incremental checker for the host tier yet: every check walks it all)
            from allocator.check.hicache_invariants import check_hicache

            found = check_integrity(self)
            full = self.counters()
            found.extend(check_hicache(self.tree_cache, full.committed + full.overallocated))  # type: ignore[arg-type]
        elif touched is None:
            found = check_integrity(self)
        elif self._checker is None:
            from allocator.check.incremental import IncrementalChecker

            found = check_integrity(self)
            self._checker = IncrementalChecker(self)
        else:
            found = self._checker.check(_i64(touched))
            if self._session_rids:
                check_session_held(found, self)  # O(sessions)
        if self._namespaced:
            from allocator.check.namespaces import check_namespaces

            rows = self.req_kv.rows_in_use()
            check_namespaces(found, self, rows, self.req_kv.rid[rows])
        return found

    def slot_ownership(self) -> SlotOwnership:
        """The state and owner of every slot of the pool (``allocator.ownership``)."""
        from allocator.ownership import slot_ownership

        self._flush_publish()
        return slot_ownership(self)

    def swa_slot_ownership(self) -> SlotOwnership | None:
        """The state and owner of every slot of the sliding-window pool
        (``allocator.swa_window.swa_slot_ownership``); None for a model without one."""
        if self.config.swa is None:
            return None
        from allocator.swa_window import swa_slot_ownership

        self._flush_publish()
        return swa_slot_ownership(self)


def _counters_after(before: np.ndarray, taken: np.ndarray, committed: np.ndarray) -> np.ndarray:
    """Pool counters after each step of a run: ``before`` (the counters at its start) as
    each step takes ``taken[j]`` pool slots and the run has committed ``committed[j]``
    tokens in all by the end of step ``j``."""
    out = np.repeat(before[None, :], taken.shape[0], axis=0)
    slots = np.cumsum(taken)
    out[:, _COUNTER_AVAILABLE] -= slots
    out[:, _COUNTER_COMMITTED] += committed
    out[:, _COUNTER_OVERALLOCATED] += slots - committed
    return out


def create_allocator(config: AllocatorConfig) -> KvAllocator:
    """The built-in allocator for ``config`` (SGLang 0.5.23 semantics)."""
    return KvAllocator(config)


# What a step of decode or speculative decode goes through: a subclass that changes any
# of it (a variant under test, a deliberately broken allocator) replays runs step by step.
_STEP_PATH = ("decode", "spec_decode", "_reserve_spec", "_held_rows", "_flush_publish", "counters")


@functools.cache
def _runs_are_exact(cls: type) -> bool:
    """Whether ``cls`` allocates a step exactly as ``KvAllocator`` does, so its
    ``decode_run`` / ``spec_decode_run`` equal its steps one by one."""
    return all(getattr(cls, name) is getattr(KvAllocator, name) for name in _STEP_PATH)
