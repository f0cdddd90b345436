"""The allocation and release functions, each keeping its bookkeeping beside the allocation.

SGLang 0.5.23 semantics (``mem_cache/allocation.py``, ``mem_cache/common.py``,
``disaggregation/decode.py``, ``speculative/eagle_utils.py``); as in SGLang PR
#29432, ``kv_allocated_len``, ``kv_committed_len`` and ``cache_protected_len``
change only inside the function that performs the real allocation or release,
never at a call site. Every function either does all of its work or, when the
pool is short, returns ``OutOfMemory`` having changed nothing but what SGLang
does before it tries (eviction of unlocked cache): no row taken, no slot taken,
no length moved.

One request's row, with the ranges the functions touch (page size 4)::

    position  0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 14 15 | 16 ...
              tree-owned prefix | own KV     | own | spec slack  |
              [0, cache_protected_len)       committed           allocated
    release: (c) checkpoint keeps floor_align(owned) in the tree; (d) frees pages of
    [protected, owned); (f) frees [ceil_align(owned), allocated) (the spec slack).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

import numpy as np

from allocator.base import OutOfMemory
from allocator.mamba import HybridReqToTokenPool, MambaReqKv, MambaSlotsExhausted
from allocator.mamba_radix import MambaInsertResult, MambaRadixCache
from allocator.pages import ceil_align, floor_align, new_page_tokens, num_new_pages, num_pages
from allocator.reduce import imax, isum
from allocator.swa_radix import SwaMatchResult, SwaRadixCache
from allocator.token_to_kv import (
    SLOT_DTYPE,
    HiSparseTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
    alloc_extend_layout,
)

if TYPE_CHECKING:
    from allocator.base import SwaConfig
    from allocator.radix_cache import RadixCache, TreeNode
    from allocator.req_kv import ReqKvTable
    from allocator.req_to_token import ReqToTokenPool
    from allocator.table_writer import CpuTableWriter
    from allocator.token_to_kv import PagedTokenToKVPoolAllocator

__all__ = [
    "CheckpointResult",
    "DecodeResult",
    "ExtendResult",
    "KvContext",
    "ReleaseOutcome",
    "SpecPlan",
    "SpecResult",
    "SwaRun",
    "alloc_for_decode",
    "alloc_for_decode_run",
    "alloc_for_decode_prealloc",
    "alloc_for_decode_prealloc_hisparse",
    "alloc_for_extend",
    "alloc_for_spec_decode",
    "alloc_for_spec_run",
    "alloc_for_swa_decode_run",
    "checkpoint_kv_cache",
    "commit_accepted_tokens",
    "evict_from_tree_cache",
    "extend_fits",
    "prealloc_fits",
    "prepare_spec_decode",
    "record_spec_reserve",
    "release_kv_cache",
    "undo_prealloc",
    "take_spec_slots",
]

_EMPTY = np.empty(0, dtype=np.int64)
_NO_SLOTS = np.empty(0, dtype=SLOT_DTYPE)


@dataclass(slots=True)
class KvContext:
    """Everything the allocation functions act on (SGLang spreads it over the batch).

    Attributes:
        req_to_token_pool: rows and the ``req_to_token`` table.
        token_to_kv_pool_allocator: the KV slot allocator.
        tree_cache: the radix cache (``disable`` when the prefix cache is off).
        req_kv: per-row bookkeeping columns.
        writer: the table writer (host, or host plus device mirror).
        page_size: tokens per page.
        spec_reserve: positions each speculative prepare reserves past ``kv_committed_len``.
        hisparse: the allocator is the HiSparse pair (spec and PD decode allocate
            logical slots only).
        swa: the sliding-window settings when the allocator is the hybrid
            ``SWATokenToKVPoolAllocator`` (full + SWA pools), else None.
        mamba_reqs: a hybrid linear-attention model's per-request Mamba bookkeeping
            by row (``req_to_token_pool`` is then ``HybridReqToTokenPool``), else None.
        mamba_admitting: with the Mamba radix cache, the bookkeeping of the requests an
            extend matched (by rid) before they get rows: the state slot a match's
            copy-on-write gave them (``MambaRadixCache.cow_state``).
        mamba_last_holder: int64 ``[slots + 1]``: the request each Mamba slot was last
            handed to or checkpointed for (-1 never; blame for a slot no one holds).
    """

    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool_allocator: TokenToKVPoolAllocator | PagedTokenToKVPoolAllocator | HiSparseTokenToKVPoolAllocator
    tree_cache: RadixCache
    req_kv: ReqKvTable
    writer: CpuTableWriter
    page_size: int
    spec_reserve: int = 0
    hisparse: bool = False
    swa: SwaConfig | None = None
    mamba_reqs: dict[int, MambaReqKv] | None = None
    mamba_admitting: dict[int, MambaReqKv] | None = None
    mamba_last_holder: np.ndarray | None = None
    # Derived in __post_init__: the row width, and whether the page-1 hot paths may
    # take slots straight from the token allocator's free-list buffer.
    width: int = 0
    direct_token_alloc: bool = False

    def __post_init__(self) -> None:
        self.width = self.req_to_token_pool.max_context_len
        allocator = self.token_to_kv_pool_allocator
        self.direct_token_alloc = type(allocator) is TokenToKVPoolAllocator and not allocator.need_sort

    def pool_available(self) -> int:
        """Slots the request rows draw from (the logical side for HiSparse)."""
        allocator = self.token_to_kv_pool_allocator
        if self.hisparse:
            return allocator.logical_available_size()
        return allocator.available_size()


class ExtendResult(NamedTuple):
    rows: np.ndarray  # int64 [bs] req_to_token row of each request
    out_cache_loc: np.ndarray  # int64 [sum(seq - prefix)] new slots, requests in order
    evicted_tokens: int


class DecodeResult(NamedTuple):
    # int32 [bs]; NOTE: may be a view of the free-list buffer, valid until the next free
    out_cache_loc: np.ndarray
    evicted_tokens: int


class SpecPlan(NamedTuple):
    """``eagle_prepare_for_decode``'s lengths: reserve up to ``nxt`` for each request."""

    cur_kv_lens: np.ndarray  # int64 [bs] kv_allocated_len now
    nxt_kv_lens: np.ndarray  # int64 [bs] max(cur, ceil_align(committed + reserve)), clipped at the row
    num_needed_tokens: int
    overflow: tuple[tuple[int, int, int], ...]  # (row, positions asked, row width)
    counts: np.ndarray  # int64 [bs] nxt - cur
    counts_cumsum: np.ndarray  # int64 [bs] inclusive cumulative sum of counts


class SpecResult(NamedTuple):
    num_tokens: int
    evicted_tokens: int
    out_cache_loc: np.ndarray
    taken: int  # slots taken from the pool (page tails included)


class CheckpointResult(NamedTuple):
    cached_tokens: int  # new tokens the tree stored
    duplicates_freed: int  # slots freed because the tree already had those positions


class ReleaseOutcome(NamedTuple):
    freed_tokens: int
    cached_tokens: int
    overalloc_released: int


# ---------------------------------------------------------------------------- eviction


def evict_from_tree_cache(ctx: KvContext, num_tokens: int) -> int:
    """Evict unlocked cache so ``num_tokens`` fit (SGLang ``evict_from_tree_cache``).

    Evicts ``num_tokens - available`` when positive (whole LRU leaves, may overshoot).

    Returns:
        Tokens evicted.
    """
    tree = ctx.tree_cache
    if tree.disable:
        return 0
    if isinstance(tree, MambaRadixCache):
        # evict_to_free_tokens -> evict_for_alloc: the FULL walk stops once the
        # shortfall is free (a deleted leaf frees its state too)
        shortfall = num_tokens - ctx.token_to_kv_pool_allocator.available_size()
        return tree.evict_pools(shortfall, 0) if shortfall > 0 else 0
    if isinstance(tree, SwaRadixCache):
        # SWATokenToKVPoolAllocator.evict_to_free_tokens: each pool's own shortfall
        allocator = ctx.token_to_kv_pool_allocator
        full_short = max(0, num_tokens - allocator.full_available_size())
        swa_short = max(0, num_tokens - allocator.swa_available_size())
        if full_short or swa_short:
            return tree.evict_pools(full_short, swa_short)
        return 0
    shortfall = num_tokens - ctx.token_to_kv_pool_allocator.available_size()
    if shortfall > 0:
        return tree.evict(shortfall)
    return 0


def tree_lock(ctx: KvContext, row: int, node: TreeNode | None) -> None:
    """Lock ``node`` for ``row`` (keeping the SWA lock's receipt)."""
    tree = ctx.tree_cache
    ctx.req_kv.lock_node[row] = tree.lock(node)
    if isinstance(tree, SwaRadixCache):
        ctx.req_kv.lock_swa_uuid[row] = tree.last_lock_uuid if node is not None else None


# ``ReqKvTable.lock_swa_uuid`` of a lock whose SWA part was released early
# (``SwaConfig.release_prefill_swa``): its final release is FULL only.
SWA_LOCK_RELEASED = -1


def tree_unlock(ctx: KvContext, row: int) -> None:
    """Release ``row``'s lock (SWA up to its receipt's boundary)."""
    kv = ctx.req_kv
    tree = ctx.tree_cache
    if isinstance(tree, SwaRadixCache):
        uuid = kv.lock_swa_uuid[row]
        released = uuid == SWA_LOCK_RELEASED
        tree.unlock(kv.lock_node[row], None if released else uuid, skip_swa=released)
        kv.lock_swa_uuid[row] = None
    else:
        tree.unlock(kv.lock_node[row])
    kv.lock_node[row] = None


def _oom(ctx: KvContext, op: str, rid: int, needed: int, lock_cost: int = 0) -> OutOfMemory:
    return OutOfMemory(
        op=op,
        rid=int(rid),
        needed=int(needed),
        available=int(ctx.token_to_kv_pool_allocator.available_size()),
        evictable=int(ctx.tree_cache.evictable_size()) - lock_cost,
    )


def _kv_unfit(
    ctx: KvContext,
    op: str,
    need_tokens: np.ndarray,
    rids: np.ndarray | None,
    rows: np.ndarray | None = None,
    lock_cost: int = 0,
) -> OutOfMemory | None:
    """None when the batch's ``need_tokens`` (pool slots per request) fit in free +
    evictable slots, else the ``OutOfMemory`` naming the first request whose
    cumulative need does not (``rids[i]``, or the request holding ``rows[i]``).

    Checked before any eviction: a call that cannot succeed must change nothing
    (SGLang would evict, then raise). Evicting everything unlocked frees exactly
    ``evictable_size`` (an unlocked node's whole subtree is unlocked), so this is
    the same decision SGLang's evict-then-allocate makes. ``lock_cost``: evictable
    tokens that locks not taken yet will protect (``RadixCache.peek_match_lock``).
    """
    tree = ctx.tree_cache
    evictable = 0 if tree.disable else tree.evictable_size() - lock_cost
    budget = ctx.token_to_kv_pool_allocator.available_size() + evictable
    needed = isum(need_tokens)
    if needed <= budget:
        return None
    short = _first_short_request(need_tokens, budget)
    rid = rids[short] if rids is not None else ctx.req_kv.rid[rows[short]]
    return _oom(ctx, op, rid, needed, lock_cost)


def _fit_evict_take(
    ctx: KvContext,
    op: str,
    need_tokens: np.ndarray,
    evict_tokens: int | None,
    rids: np.ndarray | None,
    rows: np.ndarray | None,
    take: Callable[..., np.ndarray | None],
    *take_args: object,
) -> tuple[np.ndarray, int, int] | OutOfMemory:
    """The sequence of every allocation: fit, evict, take.

    1. fit: ``_kv_unfit`` of ``need_tokens`` (an ``OutOfMemory``, nothing changed);
    2. evict: ``evict_from_tree_cache(evict_tokens)``, the amount SGLang evicts for
       (paged calls add a page per request); None: no eviction;
    3. take: ``take(*take_args)`` allocates the slots. After 1 and 2 it cannot fail (asserted);
       without eviction it may (free + evictable fit, free alone did not): then
       ``OutOfMemory`` for the first request.

    Returns:
        The slots ``take`` returned, the tokens evicted and the pool slots taken
        (whole pages), or ``OutOfMemory``.
    """
    # Within the free slots alone the batch fits (the usual case): no need to ask the tree.
    # (SWA: swa_window_then_fit decided the fit of each pool already.)
    if ctx.swa is None and isum(need_tokens) > ctx.token_to_kv_pool_allocator.available_size():
        unfit = _kv_unfit(ctx, op, need_tokens, rids, rows)
        if unfit is not None:
            return unfit
    evicted = 0 if evict_tokens is None else evict_from_tree_cache(ctx, evict_tokens)
    before = ctx.pool_available()
    out = take(*take_args)
    if out is None:
        assert evict_tokens is None, f"{op} of {int(need_tokens.sum())} slots failed after evicting to fit"
        rid = rids[0] if rids is not None else ctx.req_kv.rid[rows[0]]
        return _oom(ctx, op, rid, int(need_tokens.sum()))
    return out, evicted, before - ctx.pool_available()


def _first_short_request(need_tokens: np.ndarray, available: int) -> int:
    """Index of the first request whose cumulative need exceeds ``available``."""
    over = np.flatnonzero(np.cumsum(need_tokens) > available)
    return int(over[0]) if over.shape[0] else 0


# ---------------------------------------------------------------------------- extend


def extend_fits(
    ctx: KvContext,
    rids: np.ndarray,
    rows: np.ndarray,
    prefix_lens: np.ndarray,
    seq_lens: np.ndarray,
    lock_cost: int = 0,
    swa_lock_cost: int = 0,
    mamba_lock_cost: int = 0,
) -> OutOfMemory | None:
    """Whether ``alloc_for_extend`` with these lengths can succeed: rows for the new
    requests (``rows[i] == -1``), and the KV pages within free + evictable slots
    (less ``lock_cost``: evictable tokens the new requests' prefix locks will
    protect when they are not taken yet). With an SWA pool each pool is checked
    against its own ledger (``swa_lock_cost``: the SWA locks' share), with a Mamba
    radix cache the state slots against free + evictable checkpoints
    (``mamba_lock_cost``: those the locks will protect). Changes nothing.

    Returns:
        None when the batch fits, else the ``OutOfMemory`` the allocation would give.
    """
    unfit = _extend_rows_unfit(ctx, rids, rows < 0) or _mamba_unfit(ctx, rids, rows, mamba_lock_cost)
    if unfit is not None:
        return unfit
    need = new_page_tokens(prefix_lens, seq_lens, ctx.page_size)
    if ctx.swa is not None:
        # each pool against its own free + evictable (SGLang's evict_to_free_tokens
        # asks the tree for each pool's shortfall); with prefix sharing an extend frees
        # no window, so there is no credit
        return _swa_unfit(ctx, "extend", need, need, 0, rids, None, lock_cost, swa_lock_cost)
    return _kv_unfit(ctx, "extend", need, rids, lock_cost=lock_cost)


def _extend_rows_unfit(ctx: KvContext, rids: np.ndarray, new_mask: np.ndarray) -> OutOfMemory | None:
    """None when the new requests (``new_mask``) get rows, else ``OutOfMemory``
    (op ``"extend_rows"``) naming the first new request without one."""
    pool = ctx.req_to_token_pool
    num_new = int(np.count_nonzero(new_mask))
    if num_new <= pool.available_size():
        return None
    first_new = int(np.flatnonzero(new_mask)[pool.available_size()])
    return OutOfMemory("extend_rows", int(rids[first_new]), num_new, pool.available_size(), 0)


def _mamba_reqs_of(ctx: KvContext, rids: np.ndarray, rows: np.ndarray) -> list[MambaReqKv]:
    """The batch's Mamba bookkeeping in batch order: a continuing request's own, a
    fresh one (no row, no slot yet) for each new request."""
    held = ctx.mamba_reqs
    assert held is not None
    admitting = ctx.mamba_admitting or {}
    return [
        held[r] if r >= 0 else admitting.get(rid) or MambaReqKv(rid) for rid, r in zip(rids.tolist(), rows.tolist())
    ]


def _mamba_unfit(ctx: KvContext, rids: np.ndarray, rows: np.ndarray, lock_cost: int = 0) -> OutOfMemory | None:
    """None when the batch's Mamba slots fit (SGLang ``ensure_mamba_capacity``: one per
    request without a slot, plus its tracking slots, within free slots and, with the
    radix cache, its evictable checkpoints less ``lock_cost``), else ``OutOfMemory``
    with ``pool="mamba"`` naming the first request left without one (op ``"extend"``;
    ``needed`` / ``available`` / ``evictable`` count slots)."""
    if ctx.mamba_reqs is None:
        return None
    pool = ctx.req_to_token_pool
    assert isinstance(pool, HybridReqToTokenPool)
    reqs = _mamba_reqs_of(ctx, rids, rows)
    needed = pool.mamba_slots_needed(reqs)
    available = pool.mamba_available_size() + len(pool.mamba_allocator.group_remaining())
    tree = ctx.tree_cache
    evictable = tree.mamba_evictable_size() - lock_cost if isinstance(tree, MambaRadixCache) else 0
    if needed <= available + evictable:
        return None
    available += evictable
    short = 0
    for i, req in enumerate(reqs):
        short += pool.mamba_slots_needed([req])
        if short > available:
            return OutOfMemory("extend", int(rids[i]), needed, available - evictable, evictable, "mamba")
    return OutOfMemory("extend", int(rids[0]), needed, available - evictable, evictable, "mamba")  # not reached


def _mamba_deficit(ctx: KvContext, rids: np.ndarray, rows: np.ndarray) -> int:
    """Slots the batch's admission needs beyond the free ones (``ensure_mamba_capacity``)."""
    pool = ctx.req_to_token_pool
    assert isinstance(pool, HybridReqToTokenPool)
    needed = pool.mamba_slots_needed(_mamba_reqs_of(ctx, rids, rows))
    return needed - pool.mamba_available_size() - len(pool.mamba_allocator.group_remaining())


def alloc_for_extend(
    ctx: KvContext,
    rids: np.ndarray,
    rows: np.ndarray,
    prefix_lens: np.ndarray,
    seq_lens: np.ndarray,
    prefix_slots: Sequence[np.ndarray | None],
    lock_nodes: Sequence[TreeNode | None],
) -> ExtendResult | OutOfMemory:
    """KV slots and rows for one extend batch (SGLang ``alloc_for_extend``).

    A request holding a row (``rows[i] >= 0``) continues its chunked prefill from
    ``prefix_lens[i]`` (its ``kv_allocated_len``); a new one (``rows[i] == -1``)
    reuses ``prefix_slots[i]`` (its locked radix match, ``lock_nodes[i]``) and gets
    a row. Evicts first as SGLang does (page 1: the exact need; paged: the need plus
    one page per request), then takes the slots (paged: SGLang's three-part layout),
    then the rows, writes ``row[0:prefix]`` (new requests) and ``row[prefix:seq]``,
    and sets ``kv_allocated_len = kv_committed_len = seq`` (new requests also
    ``cache_protected_len = prefix`` and their lock).

    Args:
        rids: int64 ``[bs]`` request ids (recorded per row; named in OutOfMemory).
        rows: int64 ``[bs]`` row of a continuing request, -1 for a new one.
        prefix_lens: int64 ``[bs]`` positions already in the row or matched.
        seq_lens: int64 ``[bs]`` positions after this extend (``> prefix``).
        prefix_slots: per request, the matched slots (new requests), else None.
        lock_nodes: per request, the locked radix node of a new request, else None.

    Returns:
        ``ExtendResult`` or ``OutOfMemory`` (op ``"extend"`` for KV slots,
        ``"extend_rows"`` for request rows; nothing taken either way).
    """
    pool = ctx.req_to_token_pool
    allocator = ctx.token_to_kv_pool_allocator
    kv = ctx.req_kv
    ps = ctx.page_size
    bs = rows.shape[0]
    seq_max = imax(seq_lens) if bs else 0
    if seq_max > ctx.width:
        i = int(np.argmax(seq_lens))
        raise ValueError(
            f"extend: request rid={int(rids[i])} seq_len {seq_max} exceeds the row width {ctx.width}; "
            f"raise max_context_len"
        )
    new_mask = rows < 0
    num_new = int(np.count_nonzero(new_mask))
    unfit = _extend_rows_unfit(ctx, rids, new_mask) or _mamba_unfit(ctx, rids, rows)
    if unfit is not None:
        return unfit

    extend_lens = seq_lens - prefix_lens
    extend_num_tokens = isum(extend_lens)
    table = pool.req_to_token_np
    if ps == 1:
        need = extend_lens
        evict_tokens = extend_num_tokens
        take, take_args = allocator.alloc, (extend_num_tokens,)
    else:
        need = new_page_tokens(prefix_lens, seq_lens, ps)
        last_loc = np.full(bs, -1, dtype=np.int64)
        for i in range(bs):
            prefix = int(prefix_lens[i])
            if prefix == 0:
                continue
            if new_mask[i]:
                last_loc[i] = prefix_slots[i][prefix - 1]
            else:
                last_loc[i] = table[rows[i], prefix - 1]
        evict_tokens = extend_num_tokens + bs * ps
        take, take_args = allocator.alloc_extend, (prefix_lens, seq_lens, last_loc, extend_num_tokens)
    if ctx.swa is not None:
        # maybe_evict_swa, extend mode without prefix sharing: a continuing chunk frees
        # what lies a window behind its prefix (new requests hold no KV yet); the
        # overlap scheduler lags that prefix by its chunked prefill size.
        # (with prefix sharing, maybe_evict_swa frees nothing on extend)
        held = ~new_mask & ctx.tree_cache.disable
        safe_rows = np.where(held, rows, 0)
        pre_lens = prefix_lens - ctx.swa.overlap_chunked_prefill
        unfit = swa_window_then_fit(ctx, "extend", safe_rows, rids, need, pre_lens, held)
        if unfit is not None:
            return unfit
    if ctx.mamba_reqs is not None and isinstance(ctx.tree_cache, MambaRadixCache):
        # SGLang's alloc_req_slots runs before the KV allocation: ensure_mamba_capacity
        # evicts the slot deficit from the tree (once the KV side is known to fit:
        # a call that cannot succeed changes nothing)
        deficit = _mamba_deficit(ctx, rids, rows)
        if deficit > 0:
            unfit = _kv_unfit(ctx, "extend", need, rids)
            if unfit is not None:
                return unfit
            ctx.tree_cache.evict_pools(0, deficit)
    got = _fit_evict_take(ctx, "extend", need, evict_tokens, rids, None, take, *take_args)
    if isinstance(got, OutOfMemory):
        return got
    out, evicted, _ = got

    # From here on nothing can fail.
    rows = rows.copy()
    if ctx.mamba_reqs is not None:
        # SGLang's alloc_req_slots: rows, then each request's Mamba slot in batch order
        # (HybridReqToTokenPool.alloc; a continuing chunk keeps its own)
        assert isinstance(pool, HybridReqToTokenPool)
        reqs = _mamba_reqs_of(ctx, rids, rows)
        selected = pool.alloc_reqs(reqs)
        assert selected is not None
        for req in reqs:
            ctx.mamba_reqs[int(req.req_pool_idx)] = req  # type: ignore[arg-type]
    if num_new:
        new_idx = new_mask.nonzero()[0]
        if ctx.mamba_reqs is not None:
            new_rows = np.array(selected, dtype=np.int64)[new_idx]
        else:
            new_rows = np.array(pool.alloc(num_new), dtype=np.int64)
        rows[new_idx] = new_rows
        with_prefix = [i for i in new_idx.tolist() if prefix_lens[i] > 0]
        if with_prefix:
            idx = np.array(with_prefix, dtype=np.int64)
            ctx.writer.assign(
                rows[idx],
                np.zeros(idx.shape[0], dtype=np.int64),
                prefix_lens[idx],
                np.concatenate([prefix_slots[i][: prefix_lens[i]] for i in with_prefix]),
            )
    ctx.writer.assign(rows, prefix_lens, seq_lens, out)

    old_alloc = kv.kv_allocated_len[rows]
    old_committed = kv.kv_committed_len[rows]
    kv.kv_allocated_len[rows] = seq_lens
    kv.kv_committed_len[rows] = seq_lens
    if seq_max > kv.max_len_bound:
        kv.max_len_bound = seq_max
    kv.sum_committed += isum(seq_lens - old_committed)
    kv.sum_allocated_ceil += num_new_pages(old_alloc, seq_lens, ps) * ps
    if num_new:
        kv.cache_protected_len[new_rows] = prefix_lens[new_idx]
        kv.sum_protected += isum(prefix_lens[new_idx])
        kv.rid[new_rows] = rids[new_idx]
        lock = kv.lock_node
        for i, row in zip(new_idx.tolist(), new_rows.tolist()):
            lock[row] = lock_nodes[i]
    return ExtendResult(rows, out, evicted)


# ---------------------------------------------------------------------------- decode


def alloc_for_decode(ctx: KvContext, rows: np.ndarray, rids: np.ndarray | None = None) -> DecodeResult | OutOfMemory:
    """One new token per request (SGLang ``alloc_for_decode``): slot for position
    ``kv_allocated_len``, then ``kv_allocated_len += 1`` and ``kv_committed_len += 1``.

    Page 1 evicts for exactly ``bs`` slots; paged evicts for ``bs * page_size`` and a
    request gets a new page when its length is a multiple of the page size.

    Raises:
        ValueError: a request is already at its row width (nothing changed).
    """
    kv = ctx.req_kv
    allocated = kv.kv_allocated_len
    seq = allocated[rows]
    bs = rows.shape[0]
    if bs == 0:
        return DecodeResult(_NO_SLOTS, 0)
    if kv.max_len_bound >= ctx.width:
        _check_decode_room(ctx, rows, seq)
    allocator = ctx.token_to_kv_pool_allocator
    ps = ctx.page_size
    evicted = 0
    if ctx.swa is not None:
        need = np.ones(bs, dtype=np.int64) if ps == 1 else (seq % ps == 0).astype(np.int64) * ps
        unfit = swa_window_then_fit(ctx, "decode", rows, rids, need, kv.kv_committed_len[rows], swa_decode_due(ctx, rows))
        if unfit is not None:
            return unfit
    if ps == 1:
        # Hot path: page-1 slots straight off the head of the free list (a view).
        out = allocator.alloc_view(bs) if ctx.direct_token_alloc else None
        if out is None:
            got = _fit_evict_take(ctx, "decode", np.ones(bs, dtype=np.int64), bs, rids, rows, allocator.alloc, bs)
            if isinstance(got, OutOfMemory):
                return got
            out, evicted, _ = got
        taken = bs
    else:
        need = (seq % ps == 0).astype(np.int64) * ps
        last_loc = ctx.writer.read_points(rows, seq - 1)
        got = _fit_evict_take(ctx, "decode", need, bs * ps, rids, rows, allocator.alloc_decode, seq + 1, last_loc)
        if isinstance(got, OutOfMemory):
            return got
        out, evicted, taken = got
    ctx.writer.write_points(rows, seq, out)
    seq += 1
    allocated[rows] = seq
    committed = kv.kv_committed_len
    committed[rows] += 1
    kv.sum_committed += bs
    kv.sum_allocated_ceil += taken
    kv.max_len_bound += 1
    if ctx.swa is not None:
        kv.decode_batch_idx[rows] += 1
    return DecodeResult(out, evicted)


def alloc_for_decode_run(ctx: KvContext, rows: np.ndarray, num_steps: int) -> np.ndarray | None:
    """``num_steps`` decode steps of the same batch in one go: exactly what
    ``num_steps`` calls of ``alloc_for_decode(ctx, rows)`` do (same slots, same
    free-list order, same bookkeeping), when none of them would evict, merge a
    deferred free list, or reach a row's width. Step ``j`` gives request ``i`` the
    slot of position ``kv_allocated_len[i] + j``; the free list is consumed step by
    step, requests in batch order::

        page 1:   slots = free[0 : num_steps * bs] laid out [step, request]
        paged:    a request whose position p is a multiple of page_size takes the next
                  free page (step-major, request-minor); the others continue their page

    With an SWA pool use ``alloc_for_swa_decode_run`` (this returns None).

    Returns:
        int64 ``[num_steps]``: the pool slots each step took (whole pages), or None
        when the run cannot be done in one block (nothing changed: decode step by step).
    """
    kv = ctx.req_kv
    bs = rows.shape[0]
    if bs == 0 or num_steps < 1 or ctx.hisparse or ctx.swa is not None:
        return None
    if kv.max_len_bound + num_steps >= ctx.width:
        return None  # a row might fill up: the per-step path checks and reports it
    allocator = ctx.token_to_kv_pool_allocator
    num_free = allocator.num_free_pages()  # not counting deferred frees
    ps = ctx.page_size
    if ps == 1:
        # per step: bs <= free slots (no merge of deferred frees, no eviction)
        if num_steps * bs > num_free:
            return None
    else:
        total_pages = _run_new_pages(kv.kv_allocated_len[rows], num_steps, ps)
        # per step: bs <= free pages (no merge) and bs pages' worth available (no eviction)
        if total_pages + bs > num_free or (total_pages + bs) * ps > allocator.available_size():
            return None
    return _decode_block(ctx, rows, num_steps)


def _run_new_pages(seq: np.ndarray, num_steps: int, ps: int) -> int:
    """New pages ``num_steps`` decode steps take from lengths ``seq``: positions in
    ``[seq, seq + num_steps)`` that are multiples of ``ps``."""
    return int((-(-(seq + num_steps) // ps) - (-(-seq // ps))).sum())


def _decode_block(ctx: KvContext, rows: np.ndarray, num_steps: int) -> np.ndarray:
    """``num_steps`` decode steps, none of which evicts, merges deferred frees or
    reaches a row's width (the caller checked). Returns the pool slots each step took
    (int64 ``[num_steps]``)."""
    kv = ctx.req_kv
    bs = rows.shape[0]
    allocator = ctx.token_to_kv_pool_allocator
    ps = ctx.page_size
    seq = kv.kv_allocated_len[rows]
    steps = np.arange(num_steps, dtype=np.int64)
    if ps == 1:
        slots = allocator.alloc(num_steps * bs).astype(np.int64)  # type: ignore[union-attr]
        taken = np.full(num_steps, bs, dtype=np.int64)
    else:
        positions = seq[None, :] + steps[:, None]  # [step, request]
        need = positions % ps == 0
        new_pages = np.count_nonzero(need, axis=1)
        total_pages = int(new_pages.sum())
        last_loc = ctx.writer.read_points(rows, seq - 1).astype(np.int64)
        page_at = np.zeros(need.shape, dtype=np.int64)
        if total_pages:
            # row-major: step by step, requests in batch order
            page_at[need] = allocator.alloc(total_pages * ps)[::ps] // ps  # type: ignore[index]
        # the step of each request's latest new page so far (-1: still on its old page)
        latest = np.maximum.accumulate(np.where(need, steps[:, None], -1), axis=0)
        reqs = np.arange(bs)[None, :]
        slots = np.where(
            latest >= 0,
            page_at[np.maximum(latest, 0), reqs] * ps + positions % ps,
            last_loc[None, :] + 1 + steps[:, None],
        )
        taken = new_pages.astype(np.int64) * ps
    ctx.writer.write_points(np.tile(rows, num_steps), (seq[None, :] + steps[:, None]).reshape(-1), slots.reshape(-1))
    kv.kv_allocated_len[rows] = seq + num_steps
    kv.kv_committed_len[rows] += num_steps
    kv.sum_committed += bs * num_steps
    kv.sum_allocated_ceil += int(taken.sum())
    kv.max_len_bound += num_steps
    return taken


class SwaRun(NamedTuple):
    """What ``alloc_for_swa_decode_run`` did, step by step (int64 ``[num_steps]`` each)."""

    taken: np.ndarray  # slots each step took from each pool (whole pages)
    swa_released: np.ndarray  # SWA slots the step's window frees gave back to the SWA pool
    swa_window_freed: np.ndarray  # change of ``ReqKvTable.sum_swa_freed`` at the step
    swa_evicted: np.ndarray  # int64 [num_steps, bs] each request's SWA cursor after each step


def alloc_for_swa_decode_run(ctx: KvContext, rows: np.ndarray, num_steps: int) -> SwaRun | None:
    """``alloc_for_decode_run`` with an SWA pool: ``num_steps`` calls of
    ``alloc_for_decode(ctx, rows)``, the out-of-window frees included.

    A request's window free is due at the first step where ``decode_batch_idx >= 1``
    and ``committed - retain_window >= swa_evicted_seqlen + eviction_interval``
    (``swa_decode_due``). The full pool, which window frees do not touch, gives the
    slots of the whole run at once (as ``alloc_for_decode_run``). The SWA pool is cut
    at the steps where some request's free is due: such a step first applies the due
    frees (``plan_window_frees``, as ``alloc_for_decode`` does before its slots), then
    the SWA pages of the steps up to the next due one are taken in one go::

        full:    | slots of every step ................................ |
        swa:     | take ......... | frees, take ...... | frees, take ... |

    The new full slots are mapped to their SWA slots at the end, or before frees that
    reach a slot of this run (a window shorter than the run).

    The run is refused (None, nothing changed) unless every step fits without
    eviction, merge of deferred frees, or row width, counting none of the window
    frees (which only give SWA slots back), so that no step of it can fail.
    """
    kv = ctx.req_kv
    swa = ctx.swa
    bs = rows.shape[0]
    if bs == 0 or num_steps < 1 or ctx.hisparse or swa is None or swa.release_prefill_swa:
        return None  # the early lock release happens between steps: step by step
    if kv.max_len_bound + num_steps >= ctx.width:
        return None
    allocator = ctx.token_to_kv_pool_allocator
    ps = ctx.page_size
    total_pages = num_steps * bs if ps == 1 else _run_new_pages(kv.kv_allocated_len[rows], num_steps, ps)
    margin = 0 if ps == 1 else bs  # paged: alloc_decode's merge bound and eviction target
    for pool in (allocator.full_attn_allocator, allocator.swa_attn_allocator):
        if total_pages + margin > pool.num_free_pages() or (total_pages + margin) * ps > pool.available_size():
            return None
    full_pool, swa_pool = allocator.full_attn_allocator, allocator.swa_attn_allocator
    mapping = allocator.full_to_swa_index_mapping
    seq = kv.kv_allocated_len[rows]
    committed = kv.kv_committed_len[rows]
    decoded = kv.decode_batch_idx[rows]
    steps = np.arange(num_steps, dtype=np.int64)
    positions = seq[None, :] + steps[:, None]  # [step, request]
    # The full pool is untouched by window frees: its slots for the whole run at once.
    if ps == 1:
        full_slots = full_pool.alloc(num_steps * bs).astype(np.int64).reshape(num_steps, bs)
        taken = np.full(num_steps, bs, dtype=np.int64)
        first_page = steps * bs  # index of each step's first SWA slot in take order
        swa_ids = np.zeros(num_steps * bs, dtype=np.int64)
    else:
        need = positions % ps == 0
        new_pages = np.count_nonzero(need, axis=1)
        taken = new_pages.astype(np.int64) * ps
        first_page = np.cumsum(new_pages) - new_pages
        # the step of each request's latest new page so far (-1: still on its old page)
        latest = np.maximum.accumulate(np.where(need, steps[:, None], -1), axis=0)
        latest_at = np.maximum(latest, 0)
        reqs = np.arange(bs)[None, :]
        in_page = positions % ps
        last_loc = ctx.writer.read_points(rows, seq - 1).astype(np.int64)
        page_at = np.zeros(need.shape, dtype=np.int64)
        if total_pages:
            page_at[need] = full_pool.alloc(total_pages * ps)[::ps] // ps  # step-major, batch order
        full_slots = np.where(latest >= 0, page_at[latest_at, reqs] * ps + in_page, last_loc[None, :] + 1 + steps[:, None])
        swa_last = mapping[last_loc]
        swa_ids = np.zeros(total_pages, dtype=np.int64)
    first_page = np.append(first_page, total_pages)
    # Frees read the row table (positions below the window), so it is written first.
    ctx.writer.write_points(np.tile(rows, num_steps), positions.reshape(-1), full_slots.reshape(-1))

    def map_steps(a: int, b: int) -> None:
        """Map the full slots of steps [a, b) to the SWA slots taken for them."""
        if ps == 1:
            swa_slots = swa_ids[a * bs : b * bs]
        else:
            page_at[need] = swa_ids
            lat = latest[a:b]
            swa_slots = np.where(
                lat >= 0, page_at[latest_at[a:b], reqs] * ps + in_page[a:b], swa_last[None, :] + 1 + steps[a:b, None]
            ).reshape(-1)
        mapping[full_slots[a:b].reshape(-1)] = swa_slots

    released = np.zeros(num_steps, dtype=np.int64)
    window_freed = np.zeros(num_steps, dtype=np.int64)
    cursors = np.empty((num_steps, bs), dtype=np.int64)
    mapped = 0
    j = 0
    while j < num_steps:
        pre_lens = committed + j
        # swa_decode_due at step j (committed and decode_batch_idx as after j steps)
        gate = kv.swa_evicted_seqlen[rows] + swa.eviction_interval + swa.retain_window - pre_lens
        due = (decoded + j >= 1) & (gate <= 0)
        if due.any():
            # step j's maybe_evict_swa, before its slots as in alloc_for_decode
            plan = plan_window_frees(ctx, rows, pre_lens, due)
            if mapped < j and bool((plan.end > seq).any()):
                map_steps(mapped, j)  # the frees reach slots of this run: map them first
                mapped = j
            swa_before, freed_before = allocator.swa_available_size(), kv.sum_swa_freed
            apply_window_frees(ctx, rows, plan)
            released[j] = allocator.swa_available_size() - swa_before
            window_freed[j] = kv.sum_swa_freed - freed_before
            gate = kv.swa_evicted_seqlen[rows] + swa.eviction_interval + swa.retain_window - pre_lens
        # steps from j to the next due one (at least this one)
        n = min(max(int(np.maximum(gate, 1 - decoded - j).min()), 1), num_steps - j)
        cursors[j : j + n] = kv.swa_evicted_seqlen[rows]
        lo, hi = int(first_page[j]), int(first_page[j + n])
        if hi > lo:  # the SWA pages (slots at page 1) of steps [j, j + n), in take order
            got = swa_pool.alloc((hi - lo) * ps)
            swa_ids[lo:hi] = got if ps == 1 else got[::ps] // ps  # type: ignore[index]
        j += n
    map_steps(mapped, num_steps)
    kv.kv_allocated_len[rows] = seq + num_steps
    kv.kv_committed_len[rows] = committed + num_steps
    kv.sum_committed += bs * num_steps
    kv.sum_allocated_ceil += int(taken.sum())
    kv.max_len_bound += num_steps
    kv.decode_batch_idx[rows] = decoded + num_steps
    return SwaRun(taken, released, window_freed, cursors)


def _check_decode_room(ctx: KvContext, rows: np.ndarray, seq: np.ndarray) -> None:
    """Exact row-width check, run only when the cheap length bound says it may matter."""
    kv = ctx.req_kv
    kv.max_len_bound = int(kv.kv_allocated_len.max())
    if kv.max_len_bound < ctx.width:
        return
    top = int(seq.max())
    if top >= ctx.width:
        bad = int(np.argmax(seq))
        raise ValueError(
            f"decode: request rid={int(kv.rid[rows[bad]])} is at its row width {ctx.width} "
            f"(length {top}); raise max_context_len or finish the request"
        )


# ---------------------------------------------------------------------------- speculative


def prepare_spec_decode(ctx: KvContext, rows: np.ndarray) -> SpecPlan:
    """``eagle_prepare_for_decode`` / DFlash / UNO prepare: per request
    ``nxt = max(cur, ceil_align(committed + reserve, page_size))`` with
    ``cur = kv_allocated_len``; ``num_needed = sum(nxt - cur)``. Changes nothing.

    ``nxt`` past the row width is clipped there and reported (SGLang bounds it only
    for page > 1 with topk > 1; the write would leave the row).
    """
    kv = ctx.req_kv
    ps = ctx.page_size
    cur = kv.kv_allocated_len[rows]
    nxt = kv.kv_committed_len[rows]
    nxt += ctx.spec_reserve
    if ps > 1:
        nxt = ceil_align(nxt, ps)
    np.maximum(nxt, cur, out=nxt)
    overflow: tuple[tuple[int, int, int], ...] = ()
    width = ctx.width
    bs = rows.shape[0]
    if bs and _spec_may_overflow(ctx) and int(nxt.max()) > width:
        over = np.flatnonzero(nxt > width)
        overflow = tuple((int(rows[i]), int(nxt[i]), width) for i in over.tolist())
        np.minimum(nxt, width, out=nxt)
        np.maximum(nxt, cur, out=nxt)
    counts = nxt - cur
    if bs == 0:
        return SpecPlan(cur, nxt, 0, overflow, counts, counts)
    cumsum = np.add.accumulate(counts)
    return SpecPlan(cur, nxt, int(cumsum[-1]), overflow, counts, cumsum)


def _spec_may_overflow(ctx: KvContext) -> bool:
    """Whether some reserve could pass the row width (exact maximum only when the
    cheap bound says so)."""
    kv = ctx.req_kv
    ps = ctx.page_size
    if ceil_align(kv.max_len_bound + ctx.spec_reserve, ps) <= ctx.width:
        return False
    kv.max_len_bound = int(kv.kv_allocated_len.max())
    return ceil_align(kv.max_len_bound + ctx.spec_reserve, ps) > ctx.width


def alloc_for_spec_run(ctx: KvContext, rows: np.ndarray, accepted: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``accepted.shape[0]`` speculative steps of the same batch in one go: exactly what
    as many rounds of ``prepare_spec_decode`` + ``alloc_for_spec_decode`` +
    ``commit_accepted_tokens`` do, when none of them would evict, merge deferred
    frees, clip a reserve at the row width, or commit past its reserve.

    Step ``j`` reserves ``[cur_j, nxt_j)`` with ``nxt_j = max(cur_j, ceil_align(c_j +
    reserve))`` (``c_j`` the committed length before it; ``cur_{j+1} = nxt_j``), then
    commits ``accepted[j]``. The reserved ranges of all steps, step-major and requests
    in batch order, are one paged extend (``alloc_extend_layout``): after a request's
    first reserve its ranges start on a page boundary, so only its first one continues
    a partial page (from the slot before ``cur_0``).

    Args:
        accepted: int64 ``[num_steps, bs]`` tokens each step commits.

    Returns:
        int64 ``[num_steps]``, the pool slots each step took (whole pages), and int64
        ``[num_steps, bs]``, the allocated lengths after each step; or None when the run
        cannot be done in one block (nothing changed: step by step then).
    """
    kv = ctx.req_kv
    num_steps, bs = accepted.shape
    if bs == 0 or num_steps < 1 or ctx.hisparse or ctx.swa is not None:
        return None
    ps = ctx.page_size
    width = ctx.width
    reserve = ctx.spec_reserve
    cur0 = kv.kv_allocated_len[rows]
    c = kv.kv_committed_len[rows][None, :] + np.concatenate(
        [np.zeros((1, bs), np.int64), np.cumsum(accepted, axis=0)]
    )  # [num_steps + 1, bs]: committed before each step, and after the last
    target = c[:-1] + reserve
    if ps > 1:
        target = ceil_align(target, ps)
    nxt = np.maximum(np.maximum.accumulate(target, axis=0), cur0[None, :])
    if int(nxt[-1].max()) > width or bool((c[1:] > nxt).any()):
        return None  # a reserve at the row width, or a commit past it: the per-step path reports
    cur = np.concatenate([cur0[None, :], nxt[:-1]])
    counts = nxt - cur  # [num_steps, bs]
    needed = counts.sum(axis=1)  # per step
    # max_len_bound as the per-step path keeps it (it must never make a step look at the width)
    bound = kv.max_len_bound
    for n in needed.tolist():
        if ceil_align(bound + reserve, ps) > width:
            return None
        if n:
            bound = max(bound, min(ceil_align(bound + reserve, ps), width))
    allocator = ctx.token_to_kv_pool_allocator
    num_free = allocator.num_free_pages()
    available = allocator.available_size()
    if ps == 1:
        taken = needed.astype(np.int64)
        # per step: the slots come off the free list (no merge, no eviction)
        if int(taken.sum()) > num_free:
            return None
    else:
        pages = (num_pages(nxt, ps) - num_pages(cur, ps)).sum(axis=1)
        taken = pages.astype(np.int64) * ps
        before = np.cumsum(pages) - pages  # pages taken by the earlier steps
        moving = needed > 0
        # SGLang's merge bound and its eviction target, at every step that allocates
        if bool(((needed // ps + bs + 1 > num_free - before) & moving).any()):
            return None
        if bool(((needed + bs * ps > available - before * ps) & moving).any()):
            return None
    flat_rows = np.tile(rows, num_steps)
    flat_cur, flat_nxt, flat_counts = cur.reshape(-1), nxt.reshape(-1), counts.reshape(-1)
    total = int(flat_counts.sum())
    if total:
        if ps == 1:
            slots = allocator.alloc(total)
        else:
            last_loc = np.where(cur0 > 0, ctx.writer.read_points(rows, np.maximum(cur0 - 1, 0)), -1)
            flat_last = np.tile(last_loc, num_steps)
            new_pages = int(taken.sum()) // ps
            page_ids = allocator.alloc(new_pages * ps)[::ps] // ps if new_pages else np.zeros(0, np.int64)
            slots = alloc_extend_layout(flat_cur, flat_nxt, flat_last, page_ids, ps)
        keep = flat_counts > 0
        counts_kept = flat_counts[keep]
        ctx.writer.assign(flat_rows[keep], flat_cur[keep], flat_nxt[keep], slots, counts_kept, np.cumsum(counts_kept))
    kv.kv_allocated_len[rows] = nxt[-1]
    kv.kv_committed_len[rows] = c[-1]
    kv.sum_committed += int(accepted.sum())
    kv.sum_allocated_ceil += int(taken.sum())
    kv.max_len_bound = bound
    return taken, nxt


class SwaSpecRun(NamedTuple):
    """What ``alloc_for_swa_spec_run`` did, step by step (int64 ``[num_steps]`` each,
    but ``allocated``)."""

    taken: np.ndarray  # slots each step took from each pool (whole pages)
    allocated: np.ndarray  # int64 [num_steps, bs] allocated lengths after each step
    swa_released: np.ndarray  # SWA slots the step's window frees gave back to the SWA pool
    swa_window_freed: np.ndarray  # change of ``ReqKvTable.sum_swa_freed`` at the step
    swa_evicted: np.ndarray  # int64 [num_steps, bs] each request's SWA cursor after each step


def alloc_for_swa_spec_run(ctx: KvContext, rows: np.ndarray, accepted: np.ndarray) -> SwaSpecRun | None:
    """``alloc_for_spec_run`` with an SWA pool: ``accepted.shape[0]`` rounds of
    ``prepare_spec_decode`` + ``alloc_for_spec_decode`` + ``commit_accepted_tokens``,
    the out-of-window frees of each round's ``maybe_evict_swa`` included.

    The reserves are those of ``alloc_for_spec_run`` (they do not depend on the
    frees). The full pool, which window frees do not touch, gives the slots of every
    step at once. The SWA pool is cut at the steps where some request's free is due
    (``swa_decode_due`` with the committed length before the step): such a step first
    applies its frees, then the SWA pages of the steps up to the next due one are taken
    in one go and mapped at once, so that a later free (a window shorter than the run)
    finds them mapped::

        full:    | reserves of every step ................................ |
        swa:     | take, map .... | frees, take, map . | frees, take, map |

    Refused (None, nothing changed) unless every step fits each pool without eviction
    or a merge of deferred frees, counting none of the window frees (which only give
    SWA slots back), and no reserve reaches the row width or is passed by its commit.

    Args:
        accepted: int64 ``[num_steps, bs]`` tokens each step commits.
    """
    kv = ctx.req_kv
    swa = ctx.swa
    num_steps, bs = accepted.shape
    if bs == 0 or num_steps < 1 or ctx.hisparse or swa is None or swa.release_prefill_swa:
        return None  # the early lock release happens between steps: step by step
    ps = ctx.page_size
    width = ctx.width
    reserve = ctx.spec_reserve
    cur0 = kv.kv_allocated_len[rows]
    committed0 = kv.kv_committed_len[rows]
    c = committed0[None, :] + np.concatenate([np.zeros((1, bs), np.int64), np.cumsum(accepted, axis=0)])
    target = c[:-1] + reserve
    if ps > 1:
        target = ceil_align(target, ps)
    nxt = np.maximum(np.maximum.accumulate(target, axis=0), cur0[None, :])
    if int(nxt[-1].max()) > width or bool((c[1:] > nxt).any()):
        return None
    cur = np.concatenate([cur0[None, :], nxt[:-1]])
    counts = nxt - cur  # [num_steps, bs]
    needed = counts.sum(axis=1)
    bound = kv.max_len_bound
    for n in needed.tolist():
        if ceil_align(bound + reserve, ps) > width:
            return None
        if n:
            bound = max(bound, min(ceil_align(bound + reserve, ps), width))
    allocator = ctx.token_to_kv_pool_allocator
    full_pool, swa_pool = allocator.full_attn_allocator, allocator.swa_attn_allocator
    pages = needed if ps == 1 else (num_pages(nxt, ps) - num_pages(cur, ps)).sum(axis=1)
    pages = pages.astype(np.int64)
    taken = pages * ps
    before = np.cumsum(pages) - pages  # pages taken by the earlier steps
    moving = needed > 0
    for pool in (full_pool, swa_pool):
        num_free, available = pool.num_free_pages(), pool.available_size()
        if ps == 1:
            if int(taken.sum()) > num_free:  # each step's slots come off the free list
                return None
        elif bool(((needed // ps + bs + 1 > num_free - before) & moving).any()) or bool(
            ((needed + bs * ps > available - before * ps) & moving).any()
        ):
            return None  # a step would merge deferred frees or evict
    mapping = allocator.full_to_swa_index_mapping
    flat_cur, flat_nxt, flat_counts = cur.reshape(-1), nxt.reshape(-1), counts.reshape(-1)
    total = int(flat_counts.sum())
    total_pages = int(pages.sum())
    if ps == 1:
        full_slots = full_pool.alloc(total).astype(np.int64) if total else np.zeros(0, np.int64)
        flat_last = swa_last = None
    else:
        full_last = np.where(cur0 > 0, ctx.writer.read_points(rows, np.maximum(cur0 - 1, 0)), -1).astype(np.int64)
        swa_last = np.where(cur0 > 0, mapping[np.maximum(full_last, 0)], -1).astype(np.int64)
        page_ids = full_pool.alloc(total_pages * ps)[::ps] // ps if total_pages else np.zeros(0, np.int64)
        full_slots = alloc_extend_layout(flat_cur, flat_nxt, np.tile(full_last, num_steps), page_ids, ps).astype(np.int64)
    # Frees read the row table (positions below the window), so it is written first.
    keep = flat_counts > 0
    if total:
        counts_kept = flat_counts[keep]
        ctx.writer.assign(
            np.tile(rows, num_steps)[keep], flat_cur[keep], flat_nxt[keep], full_slots, counts_kept, np.cumsum(counts_kept)
        )
    slot_at = np.concatenate([[0], np.cumsum(needed)])  # each step's first slot in full_slots
    page_at = np.concatenate([[0], np.cumsum(pages)])

    def take_swa(a: int, b: int) -> None:
        """Take and map the SWA slots of steps [a, b)."""
        lo, hi = int(slot_at[a]), int(slot_at[b])
        if hi == lo:
            return
        if ps == 1:
            swa_slots = swa_pool.alloc(hi - lo)
        else:
            n = int(page_at[b] - page_at[a])
            ids = swa_pool.alloc(n * ps)[::ps] // ps if n else np.zeros(0, np.int64)  # type: ignore[index]
            swa_slots = alloc_extend_layout(
                cur[a:b].reshape(-1), nxt[a:b].reshape(-1), np.tile(swa_last, b - a), ids, ps  # type: ignore[arg-type]
            )
        mapping[full_slots[lo:hi]] = swa_slots

    released = np.zeros(num_steps, dtype=np.int64)
    window_freed = np.zeros(num_steps, dtype=np.int64)
    cursors = np.empty((num_steps, bs), dtype=np.int64)
    decoded = kv.decode_batch_idx[rows]
    first = decoded[None, :] + np.arange(num_steps, dtype=np.int64)[:, None] >= 1  # [step, request]
    slide = c[:-1] - swa.retain_window - swa.eviction_interval  # due when >= the cursor
    j = 0
    while j < num_steps:
        due = first[j] & (slide[j] >= kv.swa_evicted_seqlen[rows])
        if due.any():
            # step j's maybe_evict_swa, before its reserve as in alloc_for_spec_decode
            plan = plan_window_frees(ctx, rows, c[j], due)
            swa_before, freed_before = allocator.swa_available_size(), kv.sum_swa_freed
            apply_window_frees(ctx, rows, plan)
            released[j] = allocator.swa_available_size() - swa_before
            window_freed[j] = kv.sum_swa_freed - freed_before
        # steps from j to the next one where some free is due (at least this one)
        later = first[j + 1 :] & (slide[j + 1 :] >= kv.swa_evicted_seqlen[rows][None, :])
        hits = np.flatnonzero(later.any(axis=1))
        k = j + 1 + int(hits[0]) if hits.shape[0] else num_steps
        take_swa(j, k)
        cursors[j:k] = kv.swa_evicted_seqlen[rows]
        j = k
    kv.kv_allocated_len[rows] = nxt[-1]
    kv.kv_committed_len[rows] = c[-1]
    kv.sum_committed += int(accepted.sum())
    kv.sum_allocated_ceil += int(taken.sum())
    kv.max_len_bound = bound
    kv.decode_batch_idx[rows] = decoded + num_steps
    return SwaSpecRun(taken, nxt, released, window_freed, cursors)


def alloc_for_spec_decode(
    ctx: KvContext, rows: np.ndarray, plan: SpecPlan, rids: np.ndarray | None = None
) -> SpecResult | OutOfMemory:
    """Reserve ``row[cur:nxt]`` for each request (SGLang ``alloc_for_spec_decode``).

    Skipped when nothing is needed. Page 1: ``alloc(num_needed)``; paged: evict for
    ``num_needed + bs * page_size``, then ``alloc_extend(prefix=cur, seq=nxt)``
    (HiSparse: logical slots only). ``kv_allocated_len = max(kv_allocated_len, nxt)``
    (monotone), here, beside the allocation. Rejected drafts are never freed here: they
    stay in ``[committed, allocated)`` and are reused by the next step.
    """
    if ctx.swa is not None:
        # eagle_prepare_for_decode: maybe_evict_swa first (even when nothing is reserved)
        if ctx.page_size == 1:
            need = plan.counts
        else:
            need = new_page_tokens(plan.cur_kv_lens, plan.nxt_kv_lens, ctx.page_size)
        unfit = swa_window_then_fit(
            ctx, "spec", rows, rids, need, ctx.req_kv.kv_committed_len[rows], swa_decode_due(ctx, rows)
        )
        if unfit is not None:
            return unfit
    res = take_spec_slots(ctx, rows, plan, rids)
    if isinstance(res, SpecResult) and res.num_tokens:
        record_spec_reserve(ctx, rows, plan, res.taken)
    if ctx.swa is not None and isinstance(res, SpecResult):
        ctx.req_kv.decode_batch_idx[rows] += 1
    return res


def take_spec_slots(
    ctx: KvContext, rows: np.ndarray, plan: SpecPlan, rids: np.ndarray | None = None
) -> SpecResult | OutOfMemory:
    """The physical half of ``alloc_for_spec_decode``: evict, take the slots of
    ``row[cur:nxt]`` and write them into the rows; no bookkeeping. (Before SGLang PR
    #29432 this was the whole function and the caller updated ``kv_allocated_len``:
    ``allocator.pre_encapsulation`` keeps that structure.)"""
    cur, nxt, num_needed, _, counts, cumsum = plan
    if num_needed == 0:
        return SpecResult(0, 0, _NO_SLOTS, 0)
    kv = ctx.req_kv
    allocator = ctx.token_to_kv_pool_allocator
    ps = ctx.page_size
    bs = rows.shape[0]
    evicted = 0
    if ps == 1:
        out = allocator.alloc_view(num_needed) if ctx.direct_token_alloc else None
        if out is None:
            got = _fit_evict_take(ctx, "spec", counts, num_needed, rids, rows, allocator.alloc, num_needed)
            if isinstance(got, OutOfMemory):
                return got
            out, evicted, _ = got
        taken = num_needed
    else:
        need = new_page_tokens(cur, nxt, ps)
        last_loc = np.where(cur > 0, ctx.writer.read_points(rows, np.maximum(cur - 1, 0)), -1)
        alloc = allocator.alloc_logical_only if ctx.hisparse else allocator.alloc_extend
        got = _fit_evict_take(
            ctx, "spec", need, num_needed + bs * ps, rids, rows, alloc, cur, nxt, last_loc, num_needed
        )
        if isinstance(got, OutOfMemory):
            return got
        out, evicted, taken = got
    ctx.writer.assign(rows, cur, nxt, out, counts, cumsum)
    return SpecResult(num_needed, evicted, out, taken)


def record_spec_reserve(ctx: KvContext, rows: np.ndarray, plan: SpecPlan, taken: int) -> None:
    """The bookkeeping half: ``kv_allocated_len = nxt`` and the pool sums (``taken``:
    slots the reserve took from the pool, page tails included)."""
    kv = ctx.req_kv
    ps = ctx.page_size
    kv.kv_allocated_len[rows] = plan.nxt_kv_lens
    kv.sum_allocated_ceil += taken
    bound = ceil_align(kv.max_len_bound + ctx.spec_reserve, ps)
    kv.max_len_bound = max(kv.max_len_bound, min(bound, ctx.width))


def commit_accepted_tokens(
    ctx: KvContext,
    rows: np.ndarray,
    accepted_lens: np.ndarray,
    committed_after: np.ndarray | None = None,
    may_exceed: bool = True,
) -> np.ndarray | None:
    """After verify: ``kv_committed_len += accepted`` (drafts kept plus the bonus token).

    A commit past ``kv_allocated_len`` is clipped there (only possible when the
    reserve was clipped at the row width).

    Args:
        committed_after: ``kv_committed_len[rows] + accepted_lens`` if the caller has it.
        may_exceed: False when the caller checked that no commit passes the reserve.

    Returns:
        int64 ``[bs]`` positions asked past ``kv_allocated_len`` (0 where none), or
        None when ``may_exceed`` is False.
    """
    kv = ctx.req_kv
    committed = kv.kv_committed_len[rows] + accepted_lens if committed_after is None else committed_after
    excess = None
    if may_exceed:
        allocated = kv.kv_allocated_len[rows]
        excess = committed - allocated
        if rows.shape[0] and int(excess.max()) > 0:
            committed = np.minimum(committed, allocated)
            excess = np.maximum(excess, 0)
        else:
            excess = np.zeros_like(excess)
    kv.sum_committed += int(np.add.reduce(committed - kv.kv_committed_len[rows])) if may_exceed else int(
        np.add.reduce(accepted_lens)
    )
    kv.kv_committed_len[rows] = committed
    return excess


# ---------------------------------------------------------------------------- PD decode prealloc


def prealloc_fits(
    ctx: KvContext, rids: np.ndarray, fill_lens: np.ndarray, keys: Sequence[np.ndarray]
) -> OutOfMemory | None:
    """Whether ``alloc_for_decode_prealloc`` of each request in turn can succeed: rows
    for the batch, and its pages within free + evictable slots less the evictable
    tokens its prefix locks protect (``RadixCache.peek_match_lock`` of ``keys``, the
    requests' radix keys). Whether a request's own eviction removes cache a later
    request would have matched leaves the total unchanged (the later one needs those
    pages, and does not lock them), so this decides the whole sequence. Changes
    nothing.

    Returns:
        None when the batch fits, else ``OutOfMemory`` (``"prealloc_rows"``, or
        ``"prealloc"`` naming the first request that does not fit and its own need).
    """
    pool = ctx.req_to_token_pool
    bs = rids.shape[0]
    if bs > pool.available_size():
        return OutOfMemory("prealloc_rows", int(rids[pool.available_size()]), bs, pool.available_size(), 0)
    tree = ctx.tree_cache
    pages = ceil_align(fill_lens, ctx.page_size)  # demand with no prefix hit
    available = ctx.token_to_kv_pool_allocator.available_size()
    if int(pages.sum()) <= available:
        return None
    prefix, lock_cost = tree.peek_match_lock(keys)
    need = pages - prefix  # prefix is page aligned
    budget = available + tree.evictable_size() - lock_cost
    if int(need.sum()) <= budget:
        return None
    i = _first_short_request(need, budget)
    return OutOfMemory("prealloc", int(rids[i]), int(need[i]), available, tree.evictable_size() - lock_cost)


def alloc_for_decode_prealloc(
    ctx: KvContext,
    rid: int,
    fill_len: int,
    prefix_len: int,
    prefix_slots: np.ndarray | None,
    lock_node: TreeNode | None,
    evict_for_radix: bool,
) -> int | OutOfMemory:
    """One PD-decode request: a row and slots for ``fill_len`` positions whose KV
    arrives from the prefill server (SGLang ``_pre_alloc`` + ``alloc_for_decode_prealloc``).

    ``row[0:prefix_len]`` reuses the local radix match (``prefix_slots``, locked by
    the caller as ``lock_node``); ``[prefix_len, fill_len)`` is allocated (page 1:
    ``alloc``; paged: ``alloc_extend``). With the decode radix cache on, evicts the
    shortfall of ``required = new pages * page_size`` first. Sets
    ``kv_allocated_len = kv_committed_len = fill_len`` and ``cache_protected_len =
    prefix_len``.

    Returns:
        The row, or ``OutOfMemory`` (op ``"prealloc"`` / ``"prealloc_rows"``).
    """
    pool = ctx.req_to_token_pool
    allocator = ctx.token_to_kv_pool_allocator
    kv = ctx.req_kv
    ps = ctx.page_size
    if pool.available_size() == 0:
        return OutOfMemory("prealloc_rows", int(rid), 1, 0, 0)
    if fill_len > pool.max_context_len:
        raise ValueError(
            f"prealloc: request rid={rid} fill length {fill_len} exceeds the row width {pool.max_context_len}"
        )
    delta = fill_len - prefix_len
    required = new_page_tokens(prefix_len, fill_len, ps)
    if ctx.swa is not None and ps > 1:
        return _swa_tail_prealloc(ctx, rid, fill_len)
    if ps == 1:
        take, take_args = allocator.alloc, (delta,)
    else:
        last_loc = int(prefix_slots[prefix_len - 1]) if prefix_len > 0 else -1
        take = allocator.alloc_extend
        take_args = (
            np.array([prefix_len], dtype=np.int64),
            np.array([fill_len], dtype=np.int64),
            np.array([last_loc], dtype=np.int64),
            delta,
        )
    got = _fit_evict_take(
        ctx,
        "prealloc",
        np.array([required], dtype=np.int64),
        required if evict_for_radix else None,
        np.array([rid], dtype=np.int64),
        None,
        take,
        *take_args,
    )
    if isinstance(got, OutOfMemory):
        return got
    out, _, taken = got
    row = pool.alloc(1)[0]
    _bind_prealloc_row(ctx, row, rid, fill_len, prefix_len, prefix_slots, lock_node, out)
    kv.sum_allocated_ceil += prefix_len + taken
    return row


def _swa_tail_prealloc(ctx: KvContext, rid: int, fill_len: int) -> int | OutOfMemory:
    """``alloc_for_decode_prealloc`` with ``uses_swa_tail`` (paged SWA, no prefix): full
    slots for ``[0, fill_len)``, SWA slots for the last ``swa_tail_len`` positions only
    (``alloc_extend_swa_tail``); ``swa_evicted_seqlen = fill_len - tail``."""
    ps = ctx.page_size
    tail = swa_tail_len(ctx, fill_len)
    unfit = _swa_unfit(
        ctx,
        "prealloc",
        np.array([ceil_align(fill_len, ps)], dtype=np.int64),
        np.array([ceil_align(tail, ps)], dtype=np.int64),
        0,
        np.array([rid], dtype=np.int64),
        None,
    )
    if unfit is not None:
        return unfit
    before = ctx.token_to_kv_pool_allocator.full_available_size()
    out = ctx.token_to_kv_pool_allocator.alloc_extend_swa_tail(
        np.zeros(1, dtype=np.int64),
        np.array([fill_len], dtype=np.int64),
        np.full(1, -1, dtype=np.int64),
        fill_len,
        tail,
    )
    assert out is not None, "SWA tail prealloc failed after the fit check"
    pool = ctx.req_to_token_pool
    row = pool.alloc(1)[0]
    _bind_prealloc_row(ctx, row, rid, fill_len, 0, None, None, out)
    kv = ctx.req_kv
    kv.sum_allocated_ceil += before - ctx.token_to_kv_pool_allocator.full_available_size()
    kv.decode_batch_idx[row] = 0
    kv.set_swa_evicted(row, fill_len - tail)
    return row


def alloc_for_decode_prealloc_hisparse(ctx: KvContext, rid: int, fill_len: int) -> int | OutOfMemory:
    """PD decode with HiSparse: logical slots only for ``[0, fill_len)`` (no prefix
    reuse; device pages are bound later by the HiSparse coordinator)."""
    pool = ctx.req_to_token_pool
    allocator = ctx.token_to_kv_pool_allocator
    if pool.available_size() == 0:
        return OutOfMemory("prealloc_rows", int(rid), 1, 0, 0)
    if fill_len > pool.max_context_len:
        raise ValueError(
            f"prealloc: request rid={rid} fill length {fill_len} exceeds the row width {pool.max_context_len}"
        )
    before = ctx.pool_available()
    out = allocator.alloc_logical_only(
        np.zeros(1, dtype=np.int64), np.array([fill_len], dtype=np.int64), np.full(1, -1, dtype=np.int64), fill_len
    )
    if out is None:
        return _oom(ctx, "prealloc", rid, ceil_align(fill_len, ctx.page_size))
    row = pool.alloc(1)[0]
    _bind_prealloc_row(ctx, row, rid, fill_len, 0, None, None, out)
    ctx.req_kv.sum_allocated_ceil += before - ctx.pool_available()
    return row


def _bind_prealloc_row(
    ctx: KvContext,
    row: int,
    rid: int,
    fill_len: int,
    prefix_len: int,
    prefix_slots: np.ndarray | None,
    lock_node: TreeNode | None,
    out: np.ndarray,
) -> None:
    kv = ctx.req_kv
    if prefix_len:
        ctx.writer.assign_row(row, 0, prefix_slots[:prefix_len])
    ctx.writer.assign_row(row, prefix_len, out)
    kv.kv_allocated_len[row] = fill_len
    kv.kv_committed_len[row] = fill_len
    kv.cache_protected_len[row] = prefix_len
    kv.sum_committed += fill_len
    kv.sum_protected += prefix_len
    kv.rid[row] = rid
    kv.lock_node[row] = lock_node
    if fill_len > kv.max_len_bound:
        kv.max_len_bound = fill_len


def undo_prealloc(ctx: KvContext, rows: Sequence[int]) -> None:
    """Roll back the pre-allocations (``alloc_for_decode_prealloc`` or its HiSparse
    variant) that took ``rows``, in the order they were taken; undone newest first:
    slots and rows go back where they were taken, locks are dropped, the bookkeeping
    is cleared."""
    kv = ctx.req_kv
    ps = ctx.page_size
    allocator = ctx.token_to_kv_pool_allocator
    table = ctx.req_to_token_pool.req_to_token_np
    for row in reversed(rows):
        allocated = int(kv.kv_allocated_len[row])
        protected = int(kv.cache_protected_len[row])
        slots = table[row, protected:allocated].astype(np.int64)
        if isinstance(allocator, TokenToKVPoolAllocator):
            allocator.unalloc(slots)
        elif isinstance(allocator, HiSparseTokenToKVPoolAllocator):
            # logical-only allocation: no device pages to give back
            allocator.logical_attn_allocator.unalloc_pages(slots[::ps] // ps)
        else:
            allocator.unalloc_pages(slots[::ps] // ps)
        tree_unlock(ctx, row)
        kv.clear_row(row)
        ctx.req_to_token_pool.unalloc([row])


# ---------------------------------------------------------------------------- checkpoint / release


def checkpoint_kv_cache(
    ctx: KvContext, row: int, up_to: int, token_ids: np.ndarray, prompt_len: int, finished: bool = False
) -> CheckpointResult:
    """Publish ``row[0:up_to]`` into the radix tree (SGLang ``RadixCache.checkpoint``).

    Inserts the page-aligned key of ``token_ids[:up_to]`` (EAGLE: bigrams, one unit
    shorter) with the row's slots; splits the leaf at the page-aligned prompt
    boundary when the key runs past it (so eviction can drop the output without
    the prompt); frees ``row[cache_protected_len : already_present]`` (the tree had
    those positions: duplicates); re-reads the path (touching it), rewrites those
    row positions with the tree's slots; ``cache_protected_len = key_len``; locks the
    new last node and unlocks the old one. The partial page past the key stays in
    the row, still the request's own.
    """
    tree = ctx.tree_cache
    if tree.disable:
        return CheckpointResult(0, 0)
    if isinstance(tree, SwaRadixCache):
        return checkpoint_swa(ctx, tree, row, up_to, token_ids, finished)
    if isinstance(tree, MambaRadixCache):
        return checkpoint_mamba(ctx, tree, row, up_to, token_ids, finished)
    if getattr(tree, "host_pool", None) is not None:
        return checkpoint_hicache(ctx, row, up_to, token_ids, prompt_len)
    kv = ctx.req_kv
    table = ctx.req_to_token_pool.req_to_token_np
    key_len = tree.key_len(up_to)
    key = tree.make_key(token_ids[:up_to])[:key_len]
    values = table[row, :key_len]  # a view: insert and free copy what they keep
    inserted = int(kv.cache_inserted_len[row])
    prefix_len, _ = tree.insert(key, values, inserted_len=inserted)
    if key_len > inserted:
        kv.cache_inserted_len[row] = key_len
    prompt_key_len = tree.key_len(min(prompt_len, up_to)) if prompt_len > 0 else 0
    if 0 < prompt_key_len < key_len:
        # SGLang inserts the prompt at the request's priority + 1 (requests here have 0)
        tree.insert(key[:prompt_key_len], values[:prompt_key_len], inserted_len=prompt_key_len, priority=1)
    protected = int(kv.cache_protected_len[row])
    duplicates = max(prefix_len - protected, 0)
    if duplicates:
        ctx.token_to_kv_pool_allocator.free_segment(values[protected:prefix_len], protected)
    match = tree.match_prefix(key)
    node = match.last_node
    if duplicates:
        tree_slots = tree.path_device_indices(node)
        ctx.writer.assign_row(row, protected, tree_slots[protected:prefix_len])
    # The tree owns [0, key_len) now: the duplicates went back to the pool, the rest
    # of [protected, key_len) moved from the request's own range into the tree.
    if key_len >= protected:
        kv.cache_protected_len[row] = key_len
        kv.sum_protected += key_len - protected
        tree.unlock(kv.lock_node[row])
        kv.lock_node[row] = tree.lock(node)
    return CheckpointResult(key_len - prefix_len if key_len > prefix_len else 0, duplicates)


def checkpoint_hicache(ctx: KvContext, row: int, up_to: int, token_ids: np.ndarray, prompt_len: int) -> CheckpointResult:
    """``checkpoint_kv_cache`` into a tree with a host tier (``allocator.hiradix``), as
    SGLang's ``UnifiedRadixCache.checkpoint_into_tree`` does it: the insert itself frees
    the duplicates past ``cache_protected_len`` (and hands the request's slots to nodes
    it finds evicted), the prompt boundary is split with an insert that frees nothing,
    the row takes the tree's slots from ``cache_protected_len`` on, and the lock moves
    to the node the insert ended on (no match: a match would touch access times)."""
    tree = ctx.tree_cache
    kv = ctx.req_kv
    table = ctx.req_to_token_pool.req_to_token_np
    key_len = tree.key_len(up_to)
    key = tree.make_key(token_ids[:up_to])[:key_len]
    values = table[row, :key_len].astype(np.int64)  # a copy: the row is rewritten below
    inserted = int(kv.cache_inserted_len[row])
    protected = int(kv.cache_protected_len[row])
    prefix_len, node = tree.insert(key, values, prev_prefix_len=protected, inserted_len=inserted)  # type: ignore[call-arg]
    if key_len > inserted:
        kv.cache_inserted_len[row] = key_len
    prompt_key_len = tree.key_len(min(prompt_len, up_to)) if prompt_len > 0 else 0
    if 0 < prompt_key_len < key_len:
        tree.insert(key[:prompt_key_len], values[:prompt_key_len], prev_prefix_len=prompt_key_len,  # type: ignore[call-arg]
                    inserted_len=prompt_key_len)
    tree_slots = tree.path_device_indices(node)
    duplicates = 0
    if key_len > protected:
        new = tree_slots[protected:key_len]
        duplicates = int(np.count_nonzero(new[:max(prefix_len - protected, 0)] != values[protected:prefix_len]))
        ctx.writer.assign_row(row, protected, new)
    if key_len >= protected:
        kv.cache_protected_len[row] = key_len
        kv.sum_protected += key_len - protected
        tree.unlock(kv.lock_node[row])
        kv.lock_node[row] = tree.lock(node)
    return CheckpointResult(key_len - prefix_len if key_len > prefix_len else 0, duplicates)


def release_kv_cache(
    ctx: KvContext,
    row: int,
    owned_len: int,
    token_ids: np.ndarray | None,
    prompt_len: int,
    checkpoint: bool,
) -> ReleaseOutcome:
    """Give one request's row and KV back (SGLang ``release_kv_cache``).

    (c) with ``checkpoint``, publish ``[0, owned)`` (``checkpoint_kv_cache``);
    (d) free the pages of ``row[cache_protected_len:owned]``; (e) unlock;
    (f) free the over-allocation ``row[ceil_align(owned):allocated]`` (page 1:
    ``[owned, allocated)``); (g) free the row and clear the bookkeeping.

    Returns:
        Slots returned to the free list (duplicates, tail pages, over-allocation),
        tokens newly cached, and positions of over-allocation freed.
    """
    kv = ctx.req_kv
    allocator = ctx.token_to_kv_pool_allocator
    table = ctx.req_to_token_pool.req_to_token_np
    ps = ctx.page_size
    allocated = int(kv.kv_allocated_len[row])
    committed = int(kv.kv_committed_len[row])
    owned = min(owned_len, committed)
    cached = 0
    freed = 0
    if checkpoint and token_ids is not None and not ctx.tree_cache.disable:
        res = checkpoint_kv_cache(ctx, row, owned, token_ids, prompt_len, finished=True)
        cached = res.cached_tokens
        freed += res.duplicates_freed
    protected = int(kv.cache_protected_len[row])
    free_range = allocator.free_segment if ctx.swa is None else _swa_row_freer(ctx, row)
    if owned > protected:
        free_range(table[row, protected:owned], protected)
        freed += ceil_align(owned, ps) - protected
    tree_unlock(ctx, row)
    start = max(ceil_align(owned, ps), protected)
    overalloc = 0
    if start < allocated:
        free_range(table[row, start:allocated], start)
        overalloc = allocated - start
        freed += ceil_align(allocated, ps) - start
    if ctx.mamba_reqs is not None:
        # every Mamba slot the request still holds, then the row (SGLang's
        # cleanup_after_caching_req -> free_mamba_cache, then the row); a finish whose
        # state the Mamba radix tree took (checkpoint_mamba) holds none
        pool = ctx.req_to_token_pool
        assert isinstance(pool, HybridReqToTokenPool)
        req = ctx.mamba_reqs.pop(row)
        if req.holds_mamba:
            pool.release(req)
        else:
            pool.free_req(req)
    else:
        ctx.req_to_token_pool.free(row)
    kv.clear_row(row)
    return ReleaseOutcome(freed, cached, overalloc)


def _insert_mamba_and_relock(
    ctx: KvContext, tree: MambaRadixCache, row: int, key: np.ndarray, values: np.ndarray, state: int, protected: int
) -> tuple[MambaInsertResult, int]:
    """Insert a row's prefix with its Mamba state into the tree, then point the row at the
    tree's slots and move its lock to the inserted node (SGLang's ``cache_unfinished_req`` /
    ``cache_finished_req`` with a Mamba component); the insert's result and the duplicate
    tokens the row computed again."""
    kv = ctx.req_kv
    key_len = len(values)
    res = tree.insert_mamba(key, values, state, prev_prefix_len=protected)
    if key_len > int(kv.cache_inserted_len[row]):
        kv.cache_inserted_len[row] = key_len
    node = res.last_node
    new_indices = tree.path_device_indices(node)
    if new_indices.shape[0] > protected:
        ctx.writer.assign_row(row, protected, new_indices[protected:])
    tree.unlock(kv.lock_node[row])
    kv.lock_node[row] = tree.lock(node)
    kv.cache_protected_len[row] = new_indices.shape[0]
    kv.sum_protected += int(new_indices.shape[0]) - protected
    return res, max(res.prefix_len - protected, 0)


def checkpoint_mamba(
    ctx: KvContext, tree: MambaRadixCache, row: int, up_to: int, token_ids: np.ndarray, finished: bool
) -> CheckpointResult:
    """``checkpoint_kv_cache`` with the Mamba radix cache (SGLang 0.5.23's
    ``UnifiedRadixCache.checkpoint_into_tree`` with a MAMBA component, no_buffer).

    The insert carries a state slot: a finish donates the request's own (the tree
    keeps it unless the end node had a state: then ``free_mamba_cache`` gives it
    back); a chunk boundary or a prompt publish copies the state into a fresh slot
    (``alloc_state_slot``: evicting one checkpoint when none is free), freed again
    when the end node had one. The tree frees duplicates past ``cache_protected_len``
    itself. No prompt-boundary split (SGLang splits only a FULL-only tree), no re-match:
    the row is rewritten from the inserted path, the lock moves to its end, and
    ``cache_protected_len`` becomes the key length::

        row  [0 ........ protected) [protected ....... key_len) [key_len .. allocated)
              tree's (locked)        insert: tree's now          still the request's

    Raises:
        MambaSlotsExhausted: a copy found no slot even after evicting (SGLang asserts).
    """
    pool = ctx.req_to_token_pool
    assert isinstance(pool, HybridReqToTokenPool) and ctx.mamba_reqs is not None
    if pool.enable_mamba_extra_buffer:
        return _checkpoint_mamba_tracked(ctx, tree, row, up_to, token_ids, finished)
    kv = ctx.req_kv
    req = ctx.mamba_reqs[row]
    table = pool.req_to_token_np
    key_len = tree.key_len(up_to)
    protected = int(kv.cache_protected_len[row])
    if finished:
        if req.mamba_pool_idx is None:
            raise MambaSlotsExhausted(f"rid={req.rid}: a finished request holding no Mamba slot (freed twice?)")
        state = req.mamba_pool_idx
    else:
        state = tree.alloc_state_slot()
        if ctx.mamba_last_holder is not None:
            ctx.mamba_last_holder[state] = req.rid
    if key_len <= 0:
        # nothing to key: the copy goes back; a finish keeps its slot for the release
        if not finished:
            pool.mamba_allocator.free(np.asarray([state], dtype=np.int64))
        return CheckpointResult(0, 0)
    key = tree.make_key(token_ids[:up_to])[:key_len]
    values = table[row, :key_len]  # a view: insert copies what it keeps
    res, duplicates = _insert_mamba_and_relock(ctx, tree, row, key, values, state, protected)
    if finished:
        if res.mamba_exist:
            pool.mamba_allocator.free(np.asarray([state], dtype=np.int64))
        req.mamba_pool_idx = None  # the tree's now, or back on the free list
    elif res.mamba_exist:
        pool.mamba_allocator.free(np.asarray([state], dtype=np.int64))
    return CheckpointResult(key_len - res.prefix_len if key_len > res.prefix_len else 0, duplicates)


def _checkpoint_mamba_tracked(
    ctx: KvContext, tree: MambaRadixCache, row: int, up_to: int, token_ids: np.ndarray, finished: bool
) -> CheckpointResult:
    """``checkpoint_mamba`` under extra_buffer (SGLang 0.5.23's ``checkpoint_into_tree``
    with ``enable_mamba_extra_buffer``, ``components/mamba.py`` prepare / cleanup).

    The insert, KV included, is cut to the request's last tracked length (nothing is
    inserted without one): the state offered is the tracking entry that holds it. A
    finish offers that entry and gives back everything else (everything when the end
    node had a state or nothing was inserted; the release frees what is left); a
    publish or chunk stash donates the entry and a fresh slot (``alloc_state_slot``,
    evicting one checkpoint if needed) takes its place, the donated one freed again
    when the end node had a state. Either way the tracked lengths are spent::

        row  [0 .. protected) [protected ... last_track_seqlen) [...... up_to)
              tree's           inserted with the tracked state    still the request's
    """
    kv = ctx.req_kv
    pool = ctx.req_to_token_pool
    assert isinstance(pool, HybridReqToTokenPool) and ctx.mamba_reqs is not None
    req = ctx.mamba_reqs[row]
    cut = req.last_track_seqlen
    keep: int | None = None
    if finished:
        if req.mamba_pool_idx is None:
            raise MambaSlotsExhausted(f"rid={req.rid}: a finished request holding no Mamba slot (freed twice?)")
        cut = cut or 0
        if cut > up_to:
            # the latest state ran past the key; a 1-entry buffer has no older one
            cut = req.prev_track_seqlen if pool.mamba_ping_pong_track_buffer_size == 2 else None
            if cut is not None and cut > up_to:
                cut = None
            keep = None if cut is None else pool.get_mamba_ping_pong_other_idx(req.last_track_idx or 0)
        else:
            keep = req.last_track_idx
    key_len = 0 if cut is None else tree.key_len(min(cut, up_to))
    if key_len <= 0:
        # nothing inserted: a finish leaves its slots to the release; a stash donates nothing
        req.last_track_seqlen = req.prev_track_seqlen = None
        return CheckpointResult(0, 0)
    assert req.ping_pong is not None
    if finished:
        assert keep is not None
        state = int(req.ping_pong[keep])
    else:
        fresh = tree.alloc_state_slot()
        if ctx.mamba_last_holder is not None:
            ctx.mamba_last_holder[fresh] = req.rid
        state = pool.donate_mamba_ping_pong_slot(req, fresh)
    protected = int(kv.cache_protected_len[row])
    key = tree.make_key(token_ids[:key_len])
    values = pool.req_to_token_np[row, :key_len]  # a view: insert copies what it keeps
    res, duplicates = _insert_mamba_and_relock(ctx, tree, row, key, values, state, protected)
    if finished:
        pool.free_mamba_cache(req, keep=None if res.mamba_exist else keep)
    else:
        if res.mamba_exist:
            pool.mamba_allocator.free(np.asarray([state], dtype=np.int64))
        req.last_track_seqlen = req.prev_track_seqlen = None
    return CheckpointResult(key_len - res.prefix_len if key_len > res.prefix_len else 0, duplicates)


# ---------------------------------------------------------------------------- hybrid sliding window (SWA)
#
# With ``ctx.swa`` the allocator is ``SWATokenToKVPoolAllocator``: rows hold full slots,
# each mapped to an SWA slot until the window slides past it. SGLang 0.5.23 with the
# radix cache disabled (``UnifiedRadixCache(FULL, SWA)`` with ``disable``: no prefix
# sharing) frees out-of-window SWA slots in ``ScheduleBatch.maybe_evict_swa``, run
# first by ``alloc_for_extend``, ``alloc_for_decode`` and the speculative prepares.
# Here the frees are planned first, the batch's fit is checked per pool counting what
# they give back, and only then are they applied: a call that does not fit changes
# nothing (SGLang would free, then raise).


class WindowFrees(NamedTuple):
    """What one ``maybe_evict_swa`` pass does to the rows of a batch."""

    due: np.ndarray  # bool [bs] rows whose cursor moves (stored even when nothing is freed)
    start: np.ndarray  # int64 [bs] cursor after the jump to swa_dead_lo
    end: np.ndarray  # int64 [bs] new cursor (end of the freed range)
    freed: int  # SWA tokens freed (whole pages)


def plan_window_frees(ctx: KvContext, rows: np.ndarray, pre_lens: np.ndarray, due: np.ndarray) -> WindowFrees:
    """SGLang ``free_swa_out_of_window_slots`` without prefix sharing, for every row
    where ``due`` and ``pre_len - window >= swa_evicted_seqlen + 1``: the cursor jumps
    to ``max(cursor, swa_dead_lo)`` and advances to ``pre_len - window`` floored to a
    page. Changes nothing."""
    kv = ctx.req_kv
    ps = ctx.page_size
    window = ctx.swa.retain_window  # type: ignore[union-attr]
    evicted = kv.swa_evicted_seqlen[rows]
    due = due & (pre_lens - window >= evicted + 1)
    start = np.maximum(evicted, kv.swa_dead_lo(rows))
    # With prefix sharing (the radix cache on) a page-rounded window is kept, so a key
    # ending at page_floor(pre_len) still has a whole window of live SWA.
    keep = window if ctx.tree_cache.disable else ceil_align(max(window, ps), ps)
    end = np.maximum(start, pre_lens - keep)
    if ps > 1:
        end = end // ps * ps
    end = np.where(due, np.maximum(end, start), evicted)
    start = np.where(due, start, evicted)
    return WindowFrees(due, start, end, int((end - start).sum()))


def apply_window_frees(ctx: KvContext, rows: np.ndarray, plan: WindowFrees) -> None:
    """Free the planned SWA ranges in one free group, batch order, and move the cursors."""
    if not plan.due.any():
        return
    kv = ctx.req_kv
    allocator = ctx.token_to_kv_pool_allocator
    table = ctx.req_to_token_pool.req_to_token_np
    due = np.flatnonzero(plan.due)
    due_rows = rows[due]
    ends = plan.end[due]
    allocator.free_group_begin()
    try:
        for row, start, end in zip(due_rows.tolist(), plan.start[due].tolist(), ends.tolist()):
            if end > start:
                allocator.free_swa_segment(table[row, start:end], start_pos=start)
    finally:
        allocator.free_group_end()
    # ReqKvTable.set_swa_evicted of every due row at once (a batch's rows are distinct)
    before = int(kv.swa_freed(due_rows).sum())
    kv.swa_evicted_seqlen[due_rows] = ends
    kv.sum_swa_freed += int(kv.swa_freed(due_rows).sum()) - before


def _swa_unfit(
    ctx: KvContext,
    op: str,
    need_full: np.ndarray,
    need_swa: np.ndarray,
    swa_credit: int,
    rids: np.ndarray | None,
    rows: np.ndarray | None,
    lock_cost: int = 0,
    swa_lock_cost: int = 0,
) -> OutOfMemory | None:
    """None when the batch's per-request needs fit each pool (the SWA pool with
    ``swa_credit`` tokens about to be window-freed), else ``OutOfMemory`` naming the
    first request that does not fit and the pool. ``lock_cost`` / ``swa_lock_cost``:
    evictable tokens of each ledger that locks not taken yet will protect
    (``SwaRadixCache.peek_match_lock_swa``)."""
    allocator = ctx.token_to_kv_pool_allocator
    tree = ctx.tree_cache
    full_evictable = swa_evictable = 0
    if isinstance(tree, SwaRadixCache) and not tree.disable:
        full_evictable = tree.evictable_size() - lock_cost
        swa_evictable = tree.swa_evictable_size() - swa_lock_cost
    for pool, need, available in (
        ("full", need_full, allocator.full_available_size() + full_evictable),
        ("swa", need_swa, allocator.swa_available_size() + swa_credit + swa_evictable),
    ):
        total = int(need.sum())
        if total > available:
            i = _first_short_request(need, available)
            rid = rids[i] if rids is not None else ctx.req_kv.rid[rows[i]]
            return OutOfMemory(op, int(rid), total, int(available), 0, pool)
    return None


def swa_window_then_fit(
    ctx: KvContext,
    op: str,
    rows: np.ndarray,
    rids: np.ndarray | None,
    need: np.ndarray,
    pre_lens: np.ndarray,
    due: np.ndarray,
) -> OutOfMemory | None:
    """``maybe_evict_swa`` of a batch, then the fit of ``need`` (pool tokens per
    request, the same in both pools) in each pool: planned, checked, applied. With
    ``release_prefill_swa`` a decoding request ``retain_window`` steps in also
    releases the SWA part of its tree lock (its prefix's SWA becomes evictable)."""
    plan = plan_window_frees(ctx, rows, pre_lens, due)
    releases = _swa_lock_releases(ctx, rows)
    credit = plan.freed
    if releases:
        tree = ctx.tree_cache
        assert isinstance(tree, SwaRadixCache)
        credit += tree.peek_swa_release([(ctx.req_kv.lock_node[r], ctx.req_kv.lock_swa_uuid[r]) for r in releases])
    unfit = _swa_unfit(ctx, op, need, need, credit, rids, rows)
    if unfit is not None:
        return unfit
    apply_window_frees(ctx, rows, plan)
    if releases:
        kv = ctx.req_kv
        for r in releases:
            tree.release_swa_lock(kv.lock_node[r], kv.lock_swa_uuid[r])  # type: ignore[arg-type]
            kv.lock_swa_uuid[r] = SWA_LOCK_RELEASED
    return None


def _swa_lock_releases(ctx: KvContext, rows: np.ndarray) -> list[int]:
    """Rows whose SWA lock ``maybe_evict_swa`` releases now (SGLang
    ``release_swa_prefix_lock`` under ``SGLANG_OPT_RELEASE_PREFILL_SWA``): decode steps
    ``>= swa_retain_window``, a lock whose SWA segment stops short of the root (it has
    a uuid), not released yet."""
    swa = ctx.swa
    tree = ctx.tree_cache
    if swa is None or not swa.release_prefill_swa or not isinstance(tree, SwaRadixCache) or tree.disable:
        return []
    kv = ctx.req_kv
    out = []
    for r in rows[kv.decode_batch_idx[rows] >= swa.retain_window].tolist():
        uuid = kv.lock_swa_uuid[r]
        if kv.lock_node[r] is not None and uuid is not None and uuid != SWA_LOCK_RELEASED:
            out.append(r)
    return out


def swa_decode_due(ctx: KvContext, rows: np.ndarray) -> np.ndarray:
    """``maybe_evict_swa``'s decode gate: not on a request's first decode step, and
    only once ``eviction_interval`` tokens have slid out past the cursor
    (``committed - window >= swa_evicted_seqlen + interval``)."""
    kv = ctx.req_kv
    swa = ctx.swa
    assert swa is not None
    committed = kv.kv_committed_len[rows]
    return (kv.decode_batch_idx[rows] >= 1) & (
        committed - swa.retain_window >= kv.swa_evicted_seqlen[rows] + swa.eviction_interval
    )


def swa_tail_len(ctx: KvContext, fill_len: int) -> int:
    """PD prealloc: SWA tokens to allocate for ``fill_len`` (SGLang ``_swa_tail_len``,
    decode radix cache off): ``fill_len - floor_align(max(0, fill_len - window))``.
    Page size 1 takes no tail (the whole fill)."""
    ps = ctx.page_size
    if ps == 1 or fill_len <= 0:
        return max(fill_len, 0)
    window = ctx.swa.window  # type: ignore[union-attr]
    start = max(0, fill_len - window) // ps * ps
    return fill_len - start


def swa_radix_tail_len(ctx: KvContext, fill_len: int) -> int:
    """PD prealloc with the decode radix cache on: SWA tokens to allocate for
    ``fill_len`` (SGLang ``DecodePreallocQueue._swa_tail_len``): the tail keeps a whole
    window before the page-aligned insert boundary, ``fill_len - floor_align(max(0,
    fill_len - 1 - max(window, page_size)))``. Page size 1 takes no tail (the whole fill)."""
    ps = ctx.page_size
    if ps == 1 or fill_len <= 0:
        return max(fill_len, 0)
    window = ctx.swa.window  # type: ignore[union-attr]
    start = max(0, fill_len - 1 - max(window, ps)) // ps * ps
    return fill_len - start


class _SwaRadixTake(NamedTuple):
    match: SwaMatchResult
    uuid: int | None
    prefix_slots: np.ndarray | None
    slots: np.ndarray
    required: int  # full pool slots of the new pages


def _swa_radix_take(tree: SwaRadixCache, ps: int, fill_len: int, key: np.ndarray, tail: int) -> _SwaRadixTake | None:
    """The tree and pool side of ``swa_radix_prealloc``: match and lock, evict, take.
    None: a pool stayed short (the lock is dropped again; evictions stay)."""
    allocator = tree._alloc
    match = tree.match_prefix_swa(key)
    node = match.last_node
    tree.lock(node)
    uuid = tree.last_lock_uuid
    prefix_len = match.prefix_len
    prefix_slots = tree.path_device_indices(node)[:prefix_len] if prefix_len else None
    required = int(new_page_tokens(prefix_len, fill_len, ps))
    if allocator.full_available_size() < required:
        tree.evict_pools(required - allocator.full_available_size(), 0)
    delta = fill_len - prefix_len
    if ps == 1:
        out = allocator.alloc(delta)
    else:
        swa_pages = ceil_align(tail, ps)
        if allocator.swa_available_size() < swa_pages:
            tree.evict_pools(0, swa_pages - allocator.swa_available_size())
        last_loc = int(prefix_slots[prefix_len - 1]) if prefix_len else -1
        out = allocator.alloc_extend_swa_tail(
            np.array([prefix_len], dtype=np.int64),
            np.array([fill_len], dtype=np.int64),
            np.array([last_loc], dtype=np.int64),
            delta,
            tail,
        )
    if out is None:
        tree.unlock(node, uuid)
        return None
    return _SwaRadixTake(match, uuid, prefix_slots, out, required)


def swa_radix_prealloc(
    ctx: KvContext, tree: SwaRadixCache, rid: int, fill_len: int, key: np.ndarray
) -> int:
    """One PD-decode request with SWA and the decode radix cache (SGLang
    ``_match_prefix_and_lock`` + ``_pre_alloc`` + ``alloc_for_decode_prealloc``), once
    ``swa_radix_prealloc_fits`` said the batch fits.

    Matches ``key`` (the prompt, capped before the SWA tail at page > 1) SWA-gated and
    locks the end; then the FULL walk for the full pool's shortfall of the new pages;
    at page > 1 the SWA walk for the SWA pool's shortfall of the tail's pages
    (``reclaim_for_prealloc``) and ``alloc_extend_swa_tail`` with
    ``swa_evicted_seqlen = fill_len - tail``; at page 1 ``alloc`` of the rest in both
    pools (SGLang asks the tree for FULL only there).

    Returns:
        The row.
    """
    pool = ctx.req_to_token_pool
    kv = ctx.req_kv
    ps = ctx.page_size
    if fill_len > pool.max_context_len:
        raise ValueError(
            f"prealloc: request rid={rid} fill length {fill_len} exceeds the row width {pool.max_context_len}"
        )
    tail = swa_radix_tail_len(ctx, fill_len)
    took = _swa_radix_take(tree, ps, fill_len, key, tail)
    assert took is not None, "SWA radix prealloc failed after its trial"
    prefix_len = took.match.prefix_len
    row = pool.alloc(1)[0]
    _bind_prealloc_row(ctx, row, rid, fill_len, prefix_len, took.prefix_slots, took.match.last_node, took.slots)
    kv.lock_swa_uuid[row] = took.uuid
    branching = took.match.swa_branching_seqlen
    kv.swa_branching_seqlen[row] = -1 if branching is None else branching
    kv.decode_batch_idx[row] = 0
    kv.sum_allocated_ceil += prefix_len + took.required
    if ps > 1:
        kv.set_swa_evicted(row, fill_len - tail)
    return row


def swa_radix_prealloc_fits(
    ctx: KvContext, tree: SwaRadixCache, rids: np.ndarray, fill_lens: np.ndarray, keys: Sequence[np.ndarray]
) -> OutOfMemory | None:
    """Whether ``swa_radix_prealloc`` of each request in turn succeeds. Changes nothing.

    Rows first; then, unless each pool's free slots alone cover the batch (no eviction:
    it cannot fail), the batch runs on a ``trial_copy`` of the tree and its allocator.
    SGLang's page-1 path evicts FULL only and then needs the rest free in the SWA pool
    too, so what fits depends on which leaves the FULL walk deletes: only running it
    decides.
    """
    pool = ctx.req_to_token_pool
    bs = rids.shape[0]
    if bs > pool.available_size():
        return OutOfMemory("prealloc_rows", int(rids[pool.available_size()]), bs, pool.available_size(), 0)
    ps = ctx.page_size
    allocator = ctx.token_to_kv_pool_allocator
    tails = [swa_radix_tail_len(ctx, int(f)) for f in fill_lens.tolist()]
    need_full = ceil_align(fill_lens, ps)  # no prefix hit
    need_swa = fill_lens if ps == 1 else ceil_align(np.array(tails, dtype=np.int64), ps)
    if int(need_full.sum()) <= allocator.full_available_size() and int(need_swa.sum()) <= allocator.swa_available_size():
        return None
    trial = tree.trial_copy()
    for i in range(bs):
        if _swa_radix_take(trial, ps, int(fill_lens[i]), keys[i], tails[i]) is None:
            return OutOfMemory("prealloc", int(rids[i]), int(need_full[i]), int(allocator.available_size()),
                               int(tree.evictable_size()))
    return None


def swa_prealloc_fits(ctx: KvContext, rids: np.ndarray, fill_lens: np.ndarray) -> OutOfMemory | None:
    """Whether ``alloc_for_decode_prealloc`` of each request in turn fits both pools
    (no prefix reuse: the radix cache is off): rows, full pages of the fills, SWA
    pages of their tails. Changes nothing."""
    pool = ctx.req_to_token_pool
    bs = rids.shape[0]
    if bs > pool.available_size():
        return OutOfMemory("prealloc_rows", int(rids[pool.available_size()]), bs, pool.available_size(), 0)
    ps = ctx.page_size
    need_full = ceil_align(fill_lens, ps)
    need_swa = np.array([ceil_align(swa_tail_len(ctx, int(f)), ps) for f in fill_lens.tolist()], dtype=np.int64)
    return _swa_unfit(ctx, "prealloc", need_full, need_swa, 0, rids, None)


def _swa_row_freer(ctx: KvContext, row: int) -> Callable[[np.ndarray, int], None]:
    """A ``free_segment``-shaped function for one row of an SWA allocator: the part of
    the range below the row's SWA cursor goes back full-side only
    (``BasePrefixCache.free_kv_row``)."""
    from allocator.swa_window import free_kv_row_segments

    kv = ctx.req_kv
    rows = np.array([row], dtype=np.int64)
    evicted = int(kv.swa_evicted_seqlen[row])
    dead_lo = int(kv.swa_dead_lo(rows)[0])
    allocator = ctx.token_to_kv_pool_allocator

    def free_range(slots: np.ndarray, start: int) -> None:
        free_kv_row_segments(allocator, [(slots, start)], swa_evicted_seqlen=evicted, swa_dead_lo=dead_lo)

    return free_range


def _window_free_one(ctx: KvContext, row: int, pre_len: int) -> None:
    """``free_swa_out_of_window_slots`` of one row, prefix sharing, interval 1."""
    rows = np.array([row], dtype=np.int64)
    plan = plan_window_frees(ctx, rows, np.array([pre_len], dtype=np.int64), np.ones(1, dtype=bool))
    if plan.due[0]:
        start, end = int(plan.start[0]), int(plan.end[0])
        if end > start:
            table = ctx.req_to_token_pool.req_to_token_np
            ctx.token_to_kv_pool_allocator.free_swa_segment(table[row, start:end], start_pos=start)
        ctx.req_kv.set_swa_evicted(row, end)


def checkpoint_swa(
    ctx: KvContext, tree: SwaRadixCache, row: int, up_to: int, token_ids: np.ndarray, finished: bool
) -> CheckpointResult:
    """``UnifiedRadixCache.checkpoint_into_tree`` with FULL and SWA components.

    An unfinished request first frees its own out-of-window SWA (up to a window
    behind the key's end, no interval), so the insert makes tombstones below its
    SWA cursor; a pending branch point (``swa_branching_seqlen`` of the gated match)
    caps the key. No prompt-boundary split insert. Then the row is re-pointed at the
    tree's slots for ``[protected, key_len)`` and the lock moves to the insert's end.
    """
    kv = ctx.req_kv
    table = ctx.req_to_token_pool.req_to_token_np
    eagle = int(tree.is_eagle)
    cache_len = up_to
    protected = int(kv.cache_protected_len[row])
    branching = int(kv.swa_branching_seqlen[row])
    use_branch: int | None = None
    if branching >= 0 and branching > protected and branching + eagle <= up_to:
        cache_len = branching + eagle
        use_branch = branching
    key = tree.make_key(token_ids[:cache_len])
    if not finished:
        _window_free_one(ctx, row, key.shape[0] - 1)
    if cache_len <= 0:
        return CheckpointResult(0, 0)
    key_len = floor_align(key.shape[0], ctx.page_size)
    values = table[row, :key_len]
    res = tree.insert_swa(
        key[:key_len], values, protected, int(kv.swa_evicted_seqlen[row]), use_branch
    )
    new_indices = tree.path_device_indices(res.last_node)
    n = new_indices.shape[0]
    if n > protected:
        ctx.writer.assign_row(row, protected, new_indices[protected:])
    tree_unlock(ctx, row)
    tree_lock(ctx, row, res.last_node)
    rows = np.array([row], dtype=np.int64)
    freed_before = int(kv.swa_freed(rows)[0])
    kv.cache_protected_len[row] = n
    kv.sum_protected += n - protected
    kv.sum_swa_freed += int(kv.swa_freed(rows)[0]) - freed_before
    if res.swa_branch_inserted:
        kv.swa_branching_seqlen[row] = -1
        if not finished:
            # NOTE: SGLang frees up to len(req.get_fill_ids()) - eagle - 1 (swa.py
            # cleanup_after_caching_req); get_fill_ids() is the fill ids cut at
            # extend_end, and checkpoint_kv_cache passes up_to=extend_end: the same.
            _window_free_one(ctx, row, up_to - eagle - 1)
    return CheckpointResult(max(key_len - res.prefix_len, 0), max(res.prefix_len - protected, 0))


# ---------------------------------------------------------------------------- streaming sessions
#
# SGLang's ``StreamingSession`` (``session/streaming_session.py``): a finished turn's KV
# record stays in its session slot, neither inserted into the tree nor freed, and the
# tree lock on its prefix stays; the next turn borrows the record and its prefix is the
# held KV. Only the KV past the held length goes back (``_trim_overshoot``).


def hold_kv(ctx: KvContext, row: int, held_len: int) -> ReleaseOutcome:
    """Keep ``row[:held]`` (``held = min(held_len, kv_committed_len)``, at least the tree's
    protected prefix) for the session and
    free ``row[ceil_align(held):allocated]`` (the partial page stays until the session
    closes); the row, its lock and the lengths up to ``held`` are kept.

    Returns:
        Slots freed, 0 tokens cached, positions of over-allocation freed.
    """
    kv = ctx.req_kv
    ps = ctx.page_size
    allocated = int(kv.kv_allocated_len[row])
    committed = int(kv.kv_committed_len[row])
    held = max(min(held_len, committed), int(kv.cache_protected_len[row]))
    start = ceil_align(held, ps)
    freed = 0
    if start < allocated:
        table = ctx.req_to_token_pool.req_to_token_np
        ctx.token_to_kv_pool_allocator.free_segment(table[row, start:allocated], start)
        freed = ceil_align(allocated, ps) - start
    kv.sum_allocated_ceil += ceil_align(held, ps) - ceil_align(allocated, ps)
    kv.sum_committed += held - committed
    kv.kv_allocated_len[row] = held
    kv.kv_committed_len[row] = held
    return ReleaseOutcome(freed, 0, max(allocated - start, 0))
