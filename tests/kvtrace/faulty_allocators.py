"""Deliberately broken allocator versions, loaded by the replay tests as
``tests/kvtrace/faulty_allocators.py:FACTORY`` (a file version spec).

Each reproduces a bug class SGLang has shipped, on top of the built-in allocator:

* ``leaky_overalloc``: a release forgets the speculative over-allocation
  (bookkeeping says ``kv_allocated_len == kv_committed_len``), so the slots of
  ``[committed, allocated)`` are never freed (SGLang #13741/#13826).
* ``double_free``: a finish frees the request's uncached tail a second time
  ("committed KV cache already freed", SGLang #13801/#28702).
* ``stale_row``: a decode returns the slot it just wrote to the free list, so the
  request's ``req_to_token`` row points at a free slot (stale page tails, #35401).
* ``leak_on_retract``: a retraction frees the request's KV one page short, so its
  last page is held by nobody.
* ``overwritten_row``: a decode also writes its new slot over an earlier position
  of another request's row, whose old page is then held by nobody and the new one
  twice.
* ``lock_leak``: an abort or retraction forgets to unlock the request's radix
  path, so the path's lock counts stay one too high.
* ``counters_off``: a decode forgets to count one committed token in the kept sums.

On a hybrid (SWA) trace, two faults touch one pool each:

* ``missed_window_free``: a decode's out-of-window free of the SWA pool is skipped
  (the request's ``swa_evicted_seqlen`` still moves), so those SWA slots are held by
  nobody; the full pool is untouched.
* ``full_only_stale_row``: ``stale_row`` in the full pool only (the slot's SWA side
  stays taken).

On a hybrid linear-attention (Mamba) trace, two faults touch the Mamba pool:

* ``mamba_leak``: a finish gives the row back but not the request's Mamba state slot,
  which no one holds from then on.
* ``mamba_double_free``: a finish frees the request's Mamba state slot twice, so the
  free list lists it twice.

With the radix cache on (Mamba checkpoints in the tree, ``allocator.mamba_radix``):

* ``mamba_checkpoint_double_free``: the first checkpointed state the tree evicts is
  freed twice (the free list lists its slot twice); blamed on the request it was
  checkpointed for.
* ``mamba_state_reuse``: the first admission that matched no state copies a cached
  state anyway, one of a prefix its tokens do not start with.

Each fault fires once, on the first request it can hit, and records that
request (``fault_rid``) so a test can check the replay blames exactly it.

One fault touches only what the radix cache evicts:

* ``mru_evict``: the radix cache evicts its most recently used leaf first (SGLang
  evicts the least recently used), so its KV events remove other blocks.

One fault touches only cache namespaces:

* ``ignore_namespaces``: the radix cache keys by tokens alone, so a request reuses KV
  cached for another namespace (another LoRA adapter or salt) with the same tokens.

``without_digest`` is not broken: the built-in allocator behind the ``Allocator``
protocol alone (no ``state_digest``, no checkpoints), for the paths that need the
optional protocols; ``without_ownership`` hides only ``slot_ownership`` (no page map).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

import numpy as np

from allocator import AllocatorConfig, KvAllocator
from allocator.base import AllocOutcome, AllocResult, ReleaseKind, ReleaseResult
from allocator.radix_cache import RadixCache, TreeNode
from allocator.mamba import HybridReqToTokenPool, MambaReqKv


class _Faulty(KvAllocator):
    def __init__(self, config: AllocatorConfig) -> None:
        super().__init__(config)
        self.fault_rid: int | None = None

    def _fired(self) -> bool:
        return self.fault_rid is not None


class LeakyOveralloc(_Faulty):
    def release(
        self, rids: np.ndarray, owned_lens: np.ndarray, token_ids: Sequence[np.ndarray] | None, kind: ReleaseKind
    ) -> ReleaseResult:
        if not self._fired():
            self.end_step()
            kv, ps = self.req_kv, self.page_size
            for rid in np.asarray(rids).tolist():
                row = self.row_of(rid)
                allocated, committed = int(kv.kv_allocated_len[row]), int(kv.kv_committed_len[row])
                if -(-allocated // ps) > -(-committed // ps):  # whole pages of slack to strand
                    kv.sum_allocated_ceil -= (-(-allocated // ps) + (committed // -ps)) * ps
                    kv.kv_allocated_len[row] = committed
                    self.fault_rid = rid
                    break
        return super().release(rids, owned_lens, token_ids, kind)


class DoubleFree(_Faulty):
    def release(
        self, rids: np.ndarray, owned_lens: np.ndarray, token_ids: Sequence[np.ndarray] | None, kind: ReleaseKind
    ) -> ReleaseResult:
        victim = None
        if not self._fired() and kind == "finish":
            for rid in np.asarray(rids).tolist():
                lens = self.request_lens(np.array([rid]))
                if lens.committed[0] > lens.protected[0] + self.page_size:
                    victim = (rid, self.row_slots(rid)[int(lens.committed[0]) - 1 : int(lens.committed[0])])
                    break
        out = super().release(rids, owned_lens, token_ids, kind)
        if victim is not None:
            self.fault_rid = victim[0]
            self.token_to_kv_pool_allocator.free(victim[1])
        return out


class StaleRow(_Faulty):
    def decode(self, rids: np.ndarray) -> AllocOutcome:
        out = super().decode(rids)
        if not self._fired() and isinstance(out, AllocResult) and len(rids) > 1:
            rid = int(rids[-1])
            slot = self.row_slots(rid)[-1:]
            self.token_to_kv_pool_allocator.free(slot)
            self.fault_rid = rid
        return out


class WithoutDigest:
    """The built-in allocator without the optional protocols (``Digestible``, ``Checkpointable``)."""

    _HIDDEN = frozenset({"state_digest", "save_state", "restore_state"})

    def __init__(self, config: AllocatorConfig) -> None:
        self._inner = KvAllocator(config)
        self.config = config

    def __getattr__(self, name: str) -> object:
        if name in self._HIDDEN:
            raise AttributeError(name)
        return getattr(self._inner, name)


def without_digest(config: AllocatorConfig) -> WithoutDigest:
    return WithoutDigest(config)


class WithoutOwnership(WithoutDigest):
    """The built-in allocator without the optional ``OwnershipQuery`` (``slot_ownership``)."""

    _HIDDEN = frozenset({"slot_ownership"})


def without_ownership(config: AllocatorConfig) -> WithoutOwnership:
    return WithoutOwnership(config)


class LeakOnRetract(_Faulty):
    def release(
        self, rids: np.ndarray, owned_lens: np.ndarray, token_ids: Sequence[np.ndarray] | None, kind: ReleaseKind
    ) -> ReleaseResult:
        if self._fired() or kind != "retract":
            return super().release(rids, owned_lens, token_ids, kind)
        tok = self.token_to_kv_pool_allocator
        original: Callable[..., None] = tok.free_segment
        ps = self.page_size

        def one_page_short(free_index: np.ndarray, start_pos: int = 0) -> None:
            tok.free_segment = original  # type: ignore[method-assign]  # only the first free of the call
            if free_index.shape[0]:
                self.fault_rid = int(np.asarray(rids)[0])
                free_index = free_index[: (free_index.shape[0] - 1) // ps * ps]
            original(free_index, start_pos)

        tok.free_segment = one_page_short  # type: ignore[method-assign]
        try:
            return super().release(rids, owned_lens, token_ids, kind)
        finally:
            tok.free_segment = original  # type: ignore[method-assign]


class OverwrittenRow(_Faulty):
    def decode(self, rids: np.ndarray) -> AllocOutcome:
        out = super().decode(rids)
        rids = np.asarray(rids)
        if self._fired() or not isinstance(out, AllocResult) or rids.shape[0] < 2:
            return out
        victim = int(rids[-1])
        lens = self.request_lens(np.array([victim]))
        pos = int(lens.allocated[0]) - 2
        if pos >= int(lens.protected[0]):
            donor = self.row_slots(int(rids[0]))[-1:]
            self.writer.assign_row(self.row_of(victim), pos, donor.astype(np.int32))
            self.fault_rid = victim
        return out


class LockLeak(_Faulty):
    def release(
        self, rids: np.ndarray, owned_lens: np.ndarray, token_ids: Sequence[np.ndarray] | None, kind: ReleaseKind
    ) -> ReleaseResult:
        victim = None
        if not self._fired() and kind != "finish":
            self.end_step()
            root = self.tree_cache.root_node
            victim = next((rid for rid in np.asarray(rids).tolist()
                           if self.req_kv.lock_node[self.row_of(rid)] not in (None, root)), None)
        if victim is None:
            return super().release(rids, owned_lens, token_ids, kind)
        tree = self.tree_cache
        node = self.req_kv.lock_node[self.row_of(victim)]
        original: Callable[..., None] = tree.unlock

        def unlock(n: object) -> None:
            if n is node:
                tree.unlock = original  # type: ignore[method-assign]
                self.fault_rid = victim
                return
            original(n)

        tree.unlock = unlock  # type: ignore[method-assign]
        try:
            return super().release(rids, owned_lens, token_ids, kind)
        finally:
            tree.unlock = original  # type: ignore[method-assign]


class CountersOff(_Faulty):
    def decode(self, rids: np.ndarray) -> AllocOutcome:
        out = super().decode(rids)
        if not self._fired() and isinstance(out, AllocResult) and len(rids):
            self.req_kv.sum_committed -= 1
            self.fault_rid = int(np.asarray(rids)[0])
        return out


def leaky_overalloc(config: AllocatorConfig) -> KvAllocator:
    return LeakyOveralloc(config)


def double_free(config: AllocatorConfig) -> KvAllocator:
    return DoubleFree(config)


def stale_row(config: AllocatorConfig) -> KvAllocator:
    return StaleRow(config)


def leak_on_retract(config: AllocatorConfig) -> KvAllocator:
    return LeakOnRetract(config)


def overwritten_row(config: AllocatorConfig) -> KvAllocator:
    return OverwrittenRow(config)


def lock_leak(config: AllocatorConfig) -> KvAllocator:
    return LockLeak(config)


def counters_off(config: AllocatorConfig) -> KvAllocator:
    return CountersOff(config)


class MissedWindowFree(_Faulty):
    def decode(self, rids: np.ndarray) -> AllocOutcome:
        if self._fired():
            return super().decode(rids)
        tok = self.token_to_kv_pool_allocator
        original: Callable[..., None] = tok.free_swa_segment

        def skipped(free_index: np.ndarray, *, start_pos: int) -> None:
            if free_index.shape[0] == 0:
                return
            tok.free_swa_segment = original  # type: ignore[method-assign]  # only the first window free
            slot = int(free_index[0])
            self.fault_rid = next(int(r) for r in np.asarray(rids).tolist() if slot in self.row_slots(int(r)))

        tok.free_swa_segment = skipped  # type: ignore[method-assign]
        try:
            return super().decode(rids)
        finally:
            tok.free_swa_segment = original  # type: ignore[method-assign]


class FullOnlyStaleRow(_Faulty):
    def decode(self, rids: np.ndarray) -> AllocOutcome:
        out = super().decode(rids)
        if not self._fired() and isinstance(out, AllocResult) and len(rids) > 1:
            rid = int(rids[-1])
            self.token_to_kv_pool_allocator.free_full(self.row_slots(rid)[-1:])
            self.fault_rid = rid
        return out


def missed_window_free(config: AllocatorConfig) -> KvAllocator:
    return MissedWindowFree(config)


def full_only_stale_row(config: AllocatorConfig) -> KvAllocator:
    return FullOnlyStaleRow(config)


class _MruRadixCache(RadixCache):
    """A radix cache whose eviction heap is ordered by newest access first."""

    def _push(self, node: TreeNode) -> None:
        heapq.heappush(self._heap, (-node.last_access_time, node.id, node))

    def _pop_evictable(self) -> TreeNode | None:
        heap, leaves = self._heap, self.evictable_leaves
        while heap:
            t, _, node = heapq.heappop(heap)
            if node in leaves and node.last_access_time == -t:
                return node
        return None


def mru_evict(config: AllocatorConfig) -> KvAllocator:
    alloc = KvAllocator(config)
    assert type(alloc.tree_cache) is RadixCache, "mru_evict: a plain radix cache only"
    alloc.tree_cache.__class__ = _MruRadixCache  # the same tree, evicting in another order
    return alloc


class _NamespaceBlindRadixCache(RadixCache):
    """A radix cache that drops a key's namespace: equal tokens share KV across adapters."""

    def make_key(self, token_ids: np.ndarray) -> np.ndarray:
        return super().make_key(np.asarray(token_ids))  # a plain array: no namespace


def ignore_namespaces(config: AllocatorConfig) -> KvAllocator:
    alloc = KvAllocator(config)
    assert type(alloc.tree_cache) is RadixCache, "ignore_namespaces: a plain radix cache only"
    alloc.tree_cache.__class__ = _NamespaceBlindRadixCache
    return alloc
class MambaLeak(_Faulty):
    """A finish that gives the request's row back but not its Mamba state slot."""

    def release(
        self, rids: np.ndarray, owned_lens: np.ndarray, token_ids: Sequence[np.ndarray] | None, kind: ReleaseKind
    ) -> ReleaseResult:
        pool = self.req_to_token_pool
        if self._fired() or kind != "finish" or not isinstance(pool, HybridReqToTokenPool):
            return super().release(rids, owned_lens, token_ids, kind)
        original = pool.free_mamba_cache

        def forgotten(req: MambaReqKv, keep: int | None = None) -> None:
            pool.free_mamba_cache = original  # type: ignore[method-assign]  # only the first one
            self.fault_rid = req.rid
            req.mamba_pool_idx = None

        pool.free_mamba_cache = forgotten  # type: ignore[method-assign]
        try:
            return super().release(rids, owned_lens, token_ids, kind)
        finally:
            pool.free_mamba_cache = original  # type: ignore[method-assign]


class MambaDoubleFree(_Faulty):
    """A finish that frees the request's Mamba state slot twice (it is then on the free list twice)."""

    def release(
        self, rids: np.ndarray, owned_lens: np.ndarray, token_ids: Sequence[np.ndarray] | None, kind: ReleaseKind
    ) -> ReleaseResult:
        pool = self.req_to_token_pool
        victim = None
        if not self._fired() and kind == "finish" and isinstance(pool, HybridReqToTokenPool):
            rid = int(np.asarray(rids)[0])
            victim = (rid, self.ctx.mamba_reqs[self.row_of(rid)].mamba_pool_idx)  # type: ignore[index]
        out = super().release(rids, owned_lens, token_ids, kind)
        if victim is not None:
            pool.mamba_allocator.free(np.asarray([victim[1]], dtype=np.int64))  # type: ignore[union-attr]
            self.fault_rid = victim[0]
        return out


def mamba_leak(config: AllocatorConfig) -> KvAllocator:
    return MambaLeak(config)


def mamba_double_free(config: AllocatorConfig) -> KvAllocator:
    return MambaDoubleFree(config)


class MambaCheckpointDoubleFree(_Faulty):
    """The tree frees the first checkpointed state it evicts twice."""

    def __init__(self, config: AllocatorConfig) -> None:
        super().__init__(config)
        from allocator.mamba_radix import MambaRadixCache

        tree = self.tree_cache
        assert isinstance(tree, MambaRadixCache), "mamba_checkpoint_double_free: a Mamba radix tree only"
        original = tree._free_states

        def free_states(slots: list[int]) -> None:
            original(slots)
            if slots and not self._fired():
                tree.mamba_allocator.free(np.asarray(slots[:1], dtype=np.int64))
                self.fault_rid = int(self.mamba_last_holder[slots[0]])  # type: ignore[index]

        tree._free_states = free_states  # type: ignore[method-assign]


class MambaStateReuse(_Faulty):
    """The first admission that matched no state copies the most recent cached one."""

    def __init__(self, config: AllocatorConfig) -> None:
        super().__init__(config)
        from allocator.mamba_radix import MambaRadixCache

        tree = self.tree_cache
        assert isinstance(tree, MambaRadixCache), "mamba_state_reuse: a Mamba radix tree only"
        original = tree.cow_state

        def cow_state(node, req):  # noqa: ANN001, ANN202
            other = next(iter(tree.mamba_lru), None)
            if self._fired() or node.mamba_value is not None or node is not tree.root_node or other is None:
                return original(node, req)
            self.fault_rid = req.rid
            return original(other, req)  # a real copy-on-write, from a state of another prefix

        tree.cow_state = cow_state  # type: ignore[method-assign]


def mamba_checkpoint_double_free(config: AllocatorConfig) -> KvAllocator:
    return MambaCheckpointDoubleFree(config)


def mamba_state_reuse(config: AllocatorConfig) -> KvAllocator:
    return MambaStateReuse(config)
