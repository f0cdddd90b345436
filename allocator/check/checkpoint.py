"""Checkpoints of the built-in allocator: save the whole state, restore it exactly.

A replay session seeks by restoring the nearest checkpoint and replaying forward,
so a restore must give back a state from which the same calls produce the same
results: the same free-list order, rows, radix tree (node ids, access times, lock
counts, LRU heap order) and bookkeeping.

Memory is proportional to what is live, not to the pool's capacity: the
``req_to_token`` table (``rows x width`` int32, 134 MB for 256 rows of a 128k
context) is saved as the live prefix ``[0, kv_allocated_len)`` of each row in use;
the free lists as their live entries; the tree as flat arrays. Entries of a row past
its ``kv_allocated_len`` are never read before they are written, so a restore
leaves them as they are.

A hybrid sliding-window allocator (``AllocatorConfig.swa``) is saved whole as well:
the token allocator's copy holds both pools' free lists, their free-group state and
the full -> SWA mapping; the SWA columns of ``ReqKvTable`` (cursor, floor, decode
index, branch point, window-lock receipts) are saved with the others; with the SWA
radix tree (``allocator.swa_radix``) ``SwaTreeState`` adds each node's SWA side (its
SWA slots or a tombstone, SWA lock count, window-boundary uuid), the SWA LRU order and
the tree's SWA ledgers and uuid counter.

A Mamba pool (``AllocatorConfig.mamba``) is saved as ``MambaState``: its free list in
order, an open admission group, the row -> slot mapping and each request's
``MambaReqKv``; with the Mamba radix tree (``allocator.mamba_radix``) ``MambaTreeState``
adds each node's checkpointed state and Mamba lock, the Mamba LRU order and ledgers.

HiCache's tiered tree (``allocator.hiradix``) is saved as ``HiTreeState``: a deep copy
of the whole tree (each node's device and host slots, host lock and uuid, hit count,
in-flight write / load marks), its host pool's free list, the queues of transfers not
yet acked and its ledgers, with the manager's pending ack and tier hit counts. The
tree is copied rather than flattened: its in-flight transfers name nodes, and a copy
keeps those links.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from allocator.mamba import HybridReqToTokenPool, MambaReqKv
from allocator.mamba_radix import MambaRadixCache, MambaTreeState, restore_mamba_tree, save_mamba_tree
from allocator.radix_cache import RadixState, TreeNode, preorder, restore_tree_state, save_tree_state
from allocator.swa_radix import SwaRadixCache, _SwaLru

if TYPE_CHECKING:
    from allocator.manager import KvAllocator

__all__ = ["AllocatorState", "HiTreeState", "SwaTreeState", "restore_allocator_state", "save_allocator_state"]

# KvAllocator's own per-request arrays (indexed by request id); the streaming sessions' two
# are all fill (-1, False) without sessions, so that they add nothing to a digest then.
_MANAGER_ARRAYS = ("_row_of_rid", "_prompt_len", "_prefilling", "_stashed", "_session_held", "_turned")
# ReqKvTable's columns and sums.
_KV_ARRAYS = ("kv_allocated_len", "kv_committed_len", "cache_protected_len", "cache_inserted_len", "rid")
_KV_SCALARS = ("sum_committed", "sum_protected", "sum_allocated_ceil", "max_len_bound")
# The SWA columns and sum, saved only for a hybrid sliding-window allocator.
_SWA_KV_ARRAYS = ("swa_evicted_seqlen", "swa_evict_floor", "decode_batch_idx", "swa_branching_seqlen")
_SWA_KV_SCALARS = ("sum_swa_freed",)


def _kv_names(kv: object) -> tuple[tuple[str, ...], tuple[str, ...]]:
    if getattr(kv, "swa", False):
        return _KV_ARRAYS + _SWA_KV_ARRAYS, _KV_SCALARS + _SWA_KV_SCALARS
    return _KV_ARRAYS, _KV_SCALARS


class SwaTreeState(NamedTuple):
    """The SWA side of an ``SwaRadixCache``, node by node in ``RadixState``'s order."""

    swa_values: tuple[np.ndarray | None, ...]  # each node's SWA slots (read-only views), None: a tombstone
    swa_lock_refs: np.ndarray  # int64 [n]
    swa_uuids: np.ndarray  # int64 [n] window-boundary uuid, -1 none
    lru: np.ndarray  # int64 node ids of the SWA LRU list, most recent first
    scalars: tuple[int, ...]  # SWA evictable, protected, evicted total, next uuid, last lock uuid (-1 none)
    stats: tuple[tuple[str, int], ...]

    def hash_into(self, h: Any) -> None:
        for a in (self.swa_lock_refs, self.swa_uuids, self.lru):
            h.update(np.ascontiguousarray(a).tobytes())
        for value in self.swa_values:
            h.update(b"T" if value is None else np.ascontiguousarray(value).tobytes())
            h.update(b"|")
        h.update(repr((self.scalars, self.stats)).encode())

    @property
    def nbytes(self) -> int:
        arrays = [self.swa_lock_refs, self.swa_uuids, self.lru]
        return sum(a.nbytes for a in arrays) + sum(0 if v is None else v.nbytes for v in self.swa_values)


def _save_swa_tree(tree: SwaRadixCache, state: RadixState) -> SwaTreeState:
    by_id = {node.id: node for node in tree.iter_nodes()}
    by_id[tree.root_node.id] = tree.root_node
    nodes = [by_id[i] for i in state.ids.tolist()]
    # the uuid counter's next value (read by taking it, then put back)
    next_uuid = next(tree._uuids)
    tree._uuids = itertools.count(next_uuid)
    last = tree.last_lock_uuid
    return SwaTreeState(
        swa_values=tuple(None if n.swa_value is None else _read_only(n.swa_value) for n in nodes),  # type: ignore[attr-defined]
        swa_lock_refs=np.fromiter((n.swa_lock_ref for n in nodes), np.int64, len(nodes)),  # type: ignore[attr-defined]
        swa_uuids=np.fromiter((-1 if n.swa_uuid is None else n.swa_uuid for n in nodes), np.int64, len(nodes)),  # type: ignore[attr-defined]
        lru=np.fromiter((n.id for n in tree.swa_lru), np.int64),
        scalars=(tree.swa_evictable_size_, tree.swa_protected_size_, tree.swa_evicted_tokens_total, next_uuid,
                 -1 if last is None else last),
        stats=tuple(tree.stats.items()),
    )


def _restore_swa_tree(tree: SwaRadixCache, state: SwaTreeState, ids: np.ndarray, by_id: dict[int, TreeNode]) -> None:
    for node_id, value, lock, uuid in zip(ids.tolist(), state.swa_values, state.swa_lock_refs.tolist(),
                                          state.swa_uuids.tolist()):
        node = by_id[node_id]
        node.swa_value = value  # type: ignore[attr-defined]
        node.swa_lock_ref = lock  # type: ignore[attr-defined]
        node.swa_uuid = None if uuid < 0 else uuid  # type: ignore[attr-defined]
    lru = _SwaLru()
    for node_id in reversed(state.lru.tolist()):
        lru.insert_mru(by_id[node_id])  # type: ignore[arg-type]
    tree.swa_lru = lru
    evictable, protected, evicted, next_uuid, last = state.scalars
    tree.swa_evictable_size_, tree.swa_protected_size_, tree.swa_evicted_tokens_total = evictable, protected, evicted
    tree._uuids = itertools.count(next_uuid)
    tree.last_lock_uuid = None if last < 0 else last
    tree.stats = dict(state.stats)


class HiTreeState(NamedTuple):
    """HiCache's tiered tree, whole (see the module docstring)."""

    attrs: dict[str, Any]  # a deep copy of the tree's attributes; its device allocator left out (None)
    ack_due: bool  # KvAllocator._hicache_ack_due: this step's transfers are acked at the next
    hits: tuple[tuple[str, int], ...]  # KvAllocator.hicache_hits

    def nodes(self) -> list[Any]:
        """The copy's nodes, root first, in the order ``_hi_radix_state`` lists them."""
        nodes, stack = [], [self.attrs["root_node"]]
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(reversed(list(node.children.values())))
        return nodes

    def hash_into(self, h: Any) -> None:
        nodes = self.nodes()
        for node in nodes:
            h.update(b"-" if node.host_value is None else np.ascontiguousarray(node.host_value).tobytes())
            h.update(repr((node.host_lock_ref, node.host_uuid, node.hit_count, node.write_through_pending_id,
                           node.load_back_pending_id)).encode())
        host = self.attrs["host_pool"]
        h.update(np.ascontiguousarray(host.free_slots).tobytes())
        h.update(repr([np.asarray(r).tolist() for r in host.release_slots]).encode())
        a = self.attrs
        h.update(repr((sorted(a["ongoing_write_through"]), sorted(a["ongoing_load_back"]), a["_write_queue"],
                       a["_ack_write_queue"], a["_load_queue"], a["_ack_load_queue"], list(a["full_host_duplicates"]),
                       sorted(n.id for n in a["evictable_host_leaves"]), sorted(a["stats"].items()),
                       a.get("_next_uuid"), self.ack_due, self.hits)).encode())

    @property
    def nbytes(self) -> int:
        host = self.attrs["host_pool"]
        total = host.free_slots.nbytes + host.slot_used.nbytes
        for node in self.nodes():
            total += 64 + sum(0 if v is None else v.nbytes for v in (node.value, node.host_value))
        return total


def _save_hi_tree(alloc: KvAllocator) -> HiTreeState:
    tree = alloc.tree_cache
    memo: dict[int, Any] = {id(tree.token_to_kv_pool_allocator): None}  # the live one: restored by reference
    return HiTreeState(
        attrs=copy.deepcopy(vars(tree), memo),
        ack_due=alloc._hicache_ack_due,
        hits=tuple(alloc.hicache_hits.items()),
    )


def _restore_hi_tree(alloc: KvAllocator, state: HiTreeState) -> dict[int, TreeNode]:
    """Put the tiered tree back in place (the same object: the context holds it); its
    nodes by id."""
    tree = alloc.tree_cache
    device = tree.token_to_kv_pool_allocator
    vars(tree).clear()
    vars(tree).update(copy.deepcopy(state.attrs))
    tree.token_to_kv_pool_allocator = device
    alloc._hicache_ack_due = state.ack_due
    alloc.hicache_hits.clear()  # in place: a dict others may read
    alloc.hicache_hits.update(state.hits)
    by_id = {tree.root_node.id: tree.root_node}
    by_id.update((node.id, node) for node in tree.iter_nodes())
    return by_id


_NO_SLOTS = np.empty(0, np.int32)
_NO_SLOTS.flags.writeable = False


def _hi_radix_state(tree: Any) -> RadixState:
    """The tiered tree's device side as a ``RadixState`` (for the digest and the memory
    count; an evicted node's slots are empty). Restores read ``HiTreeState``, not this."""
    nodes, parents = preorder(tree.root_node)
    n = len(nodes)
    return RadixState(
        ids=np.fromiter((x.id for x in nodes), np.int64, n),
        parents=np.array(parents, np.int64),
        keys=tuple(x.key for x in nodes),
        values=tuple(_NO_SLOTS if x.value is None else _read_only(x.value) for x in nodes),
        lock_refs=np.fromiter((x.lock_ref for x in nodes), np.int64, n),
        access_times=np.fromiter((x.last_access_time for x in nodes), np.float64, n),
        heap=np.zeros((0, 2), np.int64),
        evictable_leaves=np.fromiter((x.id for x in tree.evictable_leaves), np.int64),
        scalars=(tree._clock, tree._next_id, tree.evictable_size_, tree.protected_size_, tree.evicted_tokens_total),
        hit_counts=np.fromiter((x.hit_count for x in nodes), np.int64, n),
        priorities=np.fromiter((x.priority for x in nodes), np.int64, n),
    )


def _read_only(value: np.ndarray) -> np.ndarray:
    if not value.flags.writeable:
        return value
    view = value.view()
    view.flags.writeable = False
    return view


@dataclass(frozen=True, slots=True)
class AllocatorState:
    """Everything ``KvAllocator`` needs to resume: opaque to callers, never mutated."""

    rows: np.ndarray  # int64 [r] rows in use
    row_lens: np.ndarray  # int64 [r] their kv_allocated_len
    row_slots: np.ndarray  # int32: table[row, :len] of each row, concatenated, packed by pages
    slots_page: int  # row_slots holds every slot (1) or the first slot of each page (page size)
    free_rows: tuple[int, ...]
    token_allocator: Any  # a deep copy of the token-to-KV allocator
    tree: RadixState
    kv_arrays: tuple[np.ndarray, ...]
    kv_scalars: tuple[int, ...]
    lock_node_ids: np.ndarray  # int64 [num_rows] id of each row's locked node, -1 none
    manager_arrays: tuple[np.ndarray, ...]
    # SWA only: each row's window-lock receipt (-1 none) and the SWA tree's side
    lock_swa_uuids: np.ndarray | None = None
    swa_tree: SwaTreeState | None = None
    # the live requests' cache namespaces (KvAllocator.request_namespaces)
    request_namespaces: tuple[tuple[int, str], ...] = ()
    # Mamba pool only: a copy of its free list, row -> slot mapping and per-request bookkeeping
    mamba: MambaState | None = None
    # Mamba radix tree only: the whole tree with its states (restored instead of ``tree``)
    mamba_tree: MambaTreeState | None = None
    # HiCache only: the tiered tree, whole (restored instead of ``tree``)
    hi_tree: HiTreeState | None = None

    def digest(self) -> str:
        """A hash of the whole state: equal digests mean equal states (rows, free-list
        order, tree shape, access times and locks, bookkeeping)."""
        h = hashlib.blake2b(digest_size=16)
        for a in (self.rows, self.row_lens, self.slots(), self.lock_node_ids, *self.kv_arrays):
            h.update(np.ascontiguousarray(a).tobytes())
        h.update(repr((self.free_rows, self.kv_scalars)).encode())
        tree = self.tree
        for a in (tree.ids, tree.parents, tree.lock_refs, tree.access_times, np.sort(tree.evictable_leaves)):
            h.update(np.ascontiguousarray(a).tobytes())
        for key, value in zip(tree.keys, tree.values):
            h.update(key)
            h.update(np.ascontiguousarray(value).tobytes())
            h.update(b"|")
        h.update(repr(tree.scalars).encode())
        # the heap's pop order (its array layout may differ after a restore)
        h.update(np.ascontiguousarray(tree.heap[np.lexsort((tree.heap[:, 1], tree.heap[:, 0]))]).tobytes())
        for part in _free_lists(self.token_allocator):
            h.update(np.ascontiguousarray(part).tobytes())
        for a in self.manager_arrays:
            trimmed = np.trim_zeros(a, "b") if a.dtype == np.bool_ else a[: _used_len(a)]
            h.update(trimmed.tobytes())
        if self.lock_swa_uuids is not None:
            h.update(self.lock_swa_uuids.tobytes())
        if self.swa_tree is not None:
            self.swa_tree.hash_into(h)
        if self.mamba_tree is not None:
            m = self.mamba_tree
            h.update(repr(([(n[0], n[4], n[6]) for n in m.nodes], m.lru, m.sizes, m.totals)).encode())
        if self.mamba is not None:
            h.update(self.mamba.free_slots.tobytes())
            h.update(self.mamba.mapping.tobytes())
            h.update(repr([(row, r.rid, r.mamba_pool_idx) for row, r in sorted(self.mamba.reqs.items())]).encode())
            if self.mamba.ping_pong_mapping is not None:  # extra_buffer: the tracking too
                h.update(self.mamba.ping_pong_mapping.tobytes())
                h.update(repr([(row, None if r.ping_pong is None else r.ping_pong.tolist(), r.next_track_idx,
                                r.last_track_idx, r.last_track_seqlen, r.prev_track_seqlen, r.branching_seqlen)
                               for row, r in sorted(self.mamba.reqs.items())]).encode())
        return h.hexdigest()

    def slots(self) -> np.ndarray:
        """``table[row, :len]`` of every row in use, concatenated (unpacked)."""
        return unpack_slots(self.row_slots, self.row_lens, self.slots_page)

    @property
    def nbytes(self) -> int:
        """Memory this checkpoint holds of its own (the tree's keys and slot arrays,
        shared with the live tree and other checkpoints, are counted by ``shared``)."""
        arrays = [self.rows, self.row_lens, self.row_slots, self.lock_node_ids, *self.kv_arrays, *self.manager_arrays]
        tree = self.tree
        arrays += [tree.ids, tree.parents, tree.lock_refs, tree.access_times, tree.heap, tree.evictable_leaves]
        total = sum(a.nbytes for a in arrays) + 16 * len(tree.keys) + _allocator_nbytes(self.token_allocator)
        if self.lock_swa_uuids is not None:
            total += self.lock_swa_uuids.nbytes
        if self.swa_tree is not None:
            total += self.swa_tree.nbytes
        if self.mamba is not None:
            total += self.mamba.free_slots.nbytes + self.mamba.mapping.nbytes + 64 * len(self.mamba.reqs)
        if self.hi_tree is not None:
            total += self.hi_tree.nbytes  # its own copy of the tree
        return total

    def shared(self) -> dict[int, int]:
        """The tree's keys and slot arrays this checkpoint references: id -> bytes
        (sum over the union of several checkpoints' dicts for their shared memory)."""
        out: dict[int, int] = {}
        for key, value in zip(self.tree.keys, self.tree.values):
            out[id(key)] = len(key)
            base = value.base if value.base is not None else value
            out[id(base)] = base.nbytes
        return out


@dataclass(frozen=True, slots=True)
class MambaState:
    """The Mamba pool of a ``HybridReqToTokenPool`` (radix cache off: no tree side)."""

    free_slots: np.ndarray  # int64 free list in reuse order
    group: tuple[int, ...] | None  # an open admission group's slots, None: no group
    mapping: np.ndarray  # int32 [rows + 1] row -> state slot
    reqs: dict[int, MambaReqKv]  # row -> the request's bookkeeping (copies)
    last_holder: np.ndarray  # int64 [slots + 1] ``KvAllocator.mamba_last_holder`` (blame only)
    # int64 [rows + 1, ping-pong size] row -> tracking slots (extra_buffer), else None
    ping_pong_mapping: np.ndarray | None = None


def _save_mamba(alloc: KvAllocator) -> MambaState | None:
    pool = alloc.req_to_token_pool
    if not isinstance(pool, HybridReqToTokenPool) or alloc.ctx.mamba_reqs is None:
        return None
    group = pool.mamba_allocator._group
    return MambaState(
        free_slots=pool.mamba_allocator.free_slots.copy(),
        group=None if group is None else tuple(group),
        mapping=pool.req_index_to_mamba_index_mapping.copy(),
        reqs=copy.deepcopy(alloc.ctx.mamba_reqs),
        last_holder=alloc.mamba_last_holder.copy(),  # type: ignore[union-attr]
        ping_pong_mapping=None if pool.req_index_to_mamba_ping_pong_track_buffer_mapping is None
        else pool.req_index_to_mamba_ping_pong_track_buffer_mapping.copy(),
    )


def _restore_mamba(alloc: KvAllocator, state: MambaState) -> None:
    pool = alloc.req_to_token_pool
    assert isinstance(pool, HybridReqToTokenPool) and alloc.ctx.mamba_reqs is not None
    pool.mamba_allocator.free_slots = state.free_slots.copy()
    pool.mamba_allocator._group = None if state.group is None else list(state.group)
    pool.req_index_to_mamba_index_mapping[:] = state.mapping
    if state.ping_pong_mapping is not None:
        assert pool.req_index_to_mamba_ping_pong_track_buffer_mapping is not None
        pool.req_index_to_mamba_ping_pong_track_buffer_mapping[:] = state.ping_pong_mapping
    # in place: the context's dict is the one the allocation functions hold
    alloc.ctx.mamba_reqs.clear()
    alloc.ctx.mamba_reqs.update(copy.deepcopy(state.reqs))
    alloc.mamba_last_holder[:] = state.last_holder  # type: ignore[index]  # in place: the context holds it


def _free_lists(token_allocator: Any) -> list[np.ndarray]:
    """The free slots in reuse order, and everything free (free list + deferred); an
    SWA pair: both pools' and the full -> SWA mapping; HiSparse: the device side too."""
    full = getattr(token_allocator, "full_attn_allocator", None)
    if full is not None:
        swa = token_allocator.swa_attn_allocator
        return [full.free_pages_np(), np.sort(full.get_all_free_pages()), swa.free_pages_np(),
                np.sort(swa.get_all_free_pages()), token_allocator.full_to_swa_index_mapping]
    parts = [token_allocator.free_pages_np(), np.sort(token_allocator.get_all_free_pages())]
    mapping = getattr(token_allocator, "full_to_hisparse_device_index_mapping", None)
    if mapping is not None:
        device = token_allocator.hisparse_attn_allocator
        parts += [mapping, device.free_pages_np(), np.sort(device.get_all_free_pages())]
    return parts


def _used_len(a: np.ndarray) -> int:
    """Length of ``a`` up to its last entry that differs from the fill of its tail
    (per-request arrays grow with the largest request id seen)."""
    fill = a[-1]
    differ = np.flatnonzero(a != fill)
    return int(differ[-1]) + 1 if differ.shape[0] else 0


def _allocator_nbytes(obj: Any) -> int:
    total = 0
    for value in vars(obj).values():
        if isinstance(value, np.ndarray):
            total += value.nbytes
        elif hasattr(value, "__slots__") and hasattr(value, "_buf"):
            total += value._buf.nbytes
        elif hasattr(value, "__dict__"):
            total += _allocator_nbytes(value)
        elif isinstance(value, list):
            total += sum(v.nbytes for v in value if isinstance(v, np.ndarray))
    return total


def save_allocator_state(alloc: KvAllocator) -> AllocatorState:
    """A checkpoint of ``alloc`` between steps (pending publishes are applied first)."""
    alloc.end_step()
    alloc.writer.sync()
    kv = alloc.req_kv
    rows = kv.rows_in_use()
    lens = kv.kv_allocated_len[rows].astype(np.int64)
    table = alloc.req_to_token_pool.req_to_token_np
    row_slots = (
        np.concatenate([table[row, :n] for row, n in zip(rows.tolist(), lens.tolist())])
        if rows.shape[0]
        else np.zeros(0, table.dtype)
    )
    lock_ids = np.array([-1 if node is None else node.id for node in kv.lock_node], np.int64)
    packed, slots_page = pack_slots(row_slots, lens, alloc.config.page_size)
    hi_tree = _save_hi_tree(alloc) if getattr(alloc, "hicache", False) else None
    tree = _hi_radix_state(alloc.tree_cache) if hi_tree is not None else save_tree_state(alloc.tree_cache)
    return AllocatorState(
        rows=rows.astype(np.int64),
        row_lens=lens,
        row_slots=packed,
        slots_page=slots_page,
        free_rows=tuple(alloc.req_to_token_pool.free_slots),
        token_allocator=_copy_without_journal(alloc.token_to_kv_pool_allocator),
        tree=tree,
        kv_arrays=tuple(getattr(kv, name).copy() for name in _kv_names(kv)[0]),
        kv_scalars=tuple(getattr(kv, name) for name in _kv_names(kv)[1]),
        lock_node_ids=lock_ids,
        manager_arrays=tuple(getattr(alloc, name).copy() for name in _MANAGER_ARRAYS),
        lock_swa_uuids=(
            np.array([-1 if u is None else u for u in kv.lock_swa_uuid], np.int64) if kv.swa else None
        ),
        swa_tree=_save_swa_tree(alloc.tree_cache, tree) if isinstance(alloc.tree_cache, SwaRadixCache) else None,
        request_namespaces=tuple(getattr(alloc, "request_namespaces", {}).items()),
        mamba=_save_mamba(alloc),
        mamba_tree=save_mamba_tree(alloc.tree_cache) if isinstance(alloc.tree_cache, MambaRadixCache) else None,
        hi_tree=hi_tree,
    )


def _positions(row_lens: np.ndarray) -> np.ndarray:
    """int64 [sum(row_lens)]: each entry's position in its row."""
    total = int(row_lens.sum())
    starts = np.cumsum(row_lens) - row_lens
    return np.arange(total, dtype=np.int64) - np.repeat(starts, row_lens)


def pack_slots(row_slots: np.ndarray, row_lens: np.ndarray, page_size: int) -> tuple[np.ndarray, int]:
    """Rows' slots stored as the first slot of each page when every page of every row
    is whole and aligned (``page * page_size + offset``, as a paged allocator lays
    them out): ``page_size`` times smaller. Otherwise (page size 1, or a layout that
    breaks the rule) the slots themselves.

    Returns:
        The stored array and what ``unpack_slots`` needs (the page size, or 1).
    """
    if page_size <= 1 or row_slots.shape[0] == 0:
        return row_slots, 1
    offset = _positions(row_lens) % page_size
    base = row_slots.astype(np.int64) - offset
    inside = offset != 0
    if np.count_nonzero(base % page_size) or np.count_nonzero(base[1:][inside[1:]] != base[:-1][inside[1:]]):
        return row_slots, 1
    return row_slots[~inside], page_size


def unpack_slots(stored: np.ndarray, row_lens: np.ndarray, page_size: int) -> np.ndarray:
    """The inverse of ``pack_slots``."""
    if page_size <= 1:
        return stored
    offset = _positions(row_lens) % page_size
    page_index = np.cumsum(offset == 0) - 1
    return (stored[page_index].astype(np.int64) + offset).astype(stored.dtype)


def _copy_without_journal(token_allocator: Any) -> Any:
    """A deep copy of the token allocator with no incremental-checker journal (an SWA
    pair's journals are its pools')."""
    memo: dict[int, Any] = {}
    for part in (token_allocator, getattr(token_allocator, "full_attn_allocator", None),
                 getattr(token_allocator, "swa_attn_allocator", None)):
        journal = getattr(part, "journal", None)
        if journal is not None:
            memo[id(journal)] = None
    return copy.deepcopy(token_allocator, memo)


def restore_allocator_state(alloc: KvAllocator, state: AllocatorState) -> None:
    """Put ``alloc`` back exactly as it was when ``state`` was saved (in place: every
    object other code holds a reference to stays the same object).

    An attached incremental checker is detached (the next ``check_integrity(touched)``
    walks the whole state and attaches a new one) and the state digest is rebuilt
    from scratch on its next use."""
    alloc.end_step()
    checker = getattr(alloc, "_checker", None)
    if checker is not None:
        checker.detach()
    alloc._digest = None
    pool = alloc.req_to_token_pool
    pool.free_slots = list(state.free_rows)
    # The token allocator is replaced attribute by attribute, so references to it
    # (the context, the radix cache) stay valid.
    fresh = _copy_without_journal(state.token_allocator)
    vars(alloc.token_to_kv_pool_allocator).clear()
    vars(alloc.token_to_kv_pool_allocator).update(vars(fresh))
    if state.hi_tree is not None:
        by_id: dict[int, TreeNode] = _restore_hi_tree(alloc, state.hi_tree)
    elif state.mamba_tree is not None:
        by_id = restore_mamba_tree(alloc.tree_cache, state.mamba_tree)  # type: ignore[arg-type,assignment]
    else:
        by_id = restore_tree_state(alloc.tree_cache, state.tree)
    if state.swa_tree is not None:
        _restore_swa_tree(alloc.tree_cache, state.swa_tree, state.tree.ids, by_id)  # type: ignore[arg-type]
    kv = alloc.req_kv
    arrays, scalars = _kv_names(kv)
    for name, saved in zip(arrays, state.kv_arrays):
        getattr(kv, name)[:] = saved  # in place: the columns are views of torch tensors
    for name, value in zip(scalars, state.kv_scalars):
        setattr(kv, name, value)
    kv.lock_node = [None if i < 0 else by_id[i] for i in state.lock_node_ids.tolist()]
    if state.lock_swa_uuids is not None:
        kv.lock_swa_uuid = [None if u < 0 else u for u in state.lock_swa_uuids.tolist()]
    for name, saved in zip(_MANAGER_ARRAYS, state.manager_arrays):
        setattr(alloc, name, saved.copy())
    held = alloc._session_held
    alloc.sum_session_held = int(held[held >= 0].sum())  # the sum of the arrays just restored
    alloc._session_rids = set(np.flatnonzero(alloc._turned).tolist())  # the rids in a session
    if state.mamba is not None:
        _restore_mamba(alloc, state.mamba)
    if hasattr(alloc, "mamba_matches"):
        alloc.mamba_matches = []  # they name the nodes of the tree just replaced
    alloc._pending_publish = []
    alloc.request_namespaces = dict(state.request_namespaces)
    alloc._namespaced = alloc._namespaced or bool(state.request_namespaces)
    if state.rows.shape[0]:
        starts = np.zeros_like(state.rows)
        alloc.writer.assign(state.rows, starts, state.row_lens, state.slots())
    alloc.writer.end_call()
    alloc.writer.sync()
