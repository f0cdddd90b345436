"""The SWA pool's invariants (hybrid sliding-window allocators), each violation with ``pool="swa"``.

A request's row holds full slots; its SWA slots are read through the full -> SWA
mapping. With ``dead_lo = swa_dead_lo`` and ``evicted = swa_evicted_seqlen``::

    row:  0 .. protected .. dead_lo ........ evicted .................. allocated
              | SWA live   | window-freed: unmapped | SWA live (mapped)  |

Checks:

* ``lengths``: ``0 <= swa_evicted_seqlen <= kv_allocated_len``, page aligned.
* ``counters``: the kept ``sum_swa_freed`` equals the recomputed one.
* ``conservation``: ``available + sum(ceil_align(allocated) - protected - window_freed)
  == SWA pool tokens`` (``window_freed = max(0, evicted - dead_lo)``).
* ``window``: live positions map to an SWA slot, window-freed ones to none (a missed
  out-of-window free or a wrong cursor), and no other full slot keeps a mapping.
* ``ownership``: every SWA page is exactly one of free or held by one request (a
  double free shows as a page held twice); page 0 is nobody's; paged, a slot's
  in-page offset equals its position's.

With the SWA radix tree (``allocator.swa_radix``) the tree's live SWA counts as held
(its evictable + protected ledgers in the conservation, its pages in the ownership),
and ``tree`` checks its SWA side: a tombstone holds no SWA (none of its full slots is
mapped); a live node's SWA slots are its full slots' mapping; each node's SWA lock count
is the number of request locks whose trailing window (from the locked node up to the
boundary node its receipt names) passes through it; the ledgers add up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from allocator.base import Violation
from allocator.pages import ceil_align
from allocator.swa_radix import SwaRadixCache

if TYPE_CHECKING:
    from allocator.manager import KvAllocator
    from allocator.swa import SWATokenToKVPoolAllocator

__all__ = ["check_swa"]

_MAX_ITEMS = 8
_POOL = "swa"


def check_swa(
    out: list[Violation],
    allocator: KvAllocator,
    rows: np.ndarray,
    rids: np.ndarray,
    alloc: np.ndarray,
    protected: np.ndarray,
) -> None:
    """Append every broken SWA invariant of ``allocator`` to ``out``.

    Args:
        rows, rids, alloc, protected: int64 rows in use, their request ids,
            ``kv_allocated_len`` and ``cache_protected_len``.
    """
    kv = allocator.req_kv
    tok: SWATokenToKVPoolAllocator = allocator.token_to_kv_pool_allocator  # type: ignore[assignment]
    ps = allocator.page_size
    evicted = kv.swa_evicted_seqlen[rows]
    dead_lo = kv.swa_dead_lo(rows)
    freed = np.maximum(evicted - dead_lo, 0)

    bad = (evicted < 0) | (evicted > alloc) | (evicted % ps != 0)
    for i in np.flatnonzero(bad)[:_MAX_ITEMS].tolist():
        rid = int(rids[i])
        out.append(Violation("lengths", f"rid={rid}: swa_evicted_seqlen {int(evicted[i])} outside "
                             f"[0, allocated {int(alloc[i])}] or not page aligned", rid,
                             {"swa_evicted_seqlen": int(evicted[i]), "allocated": int(alloc[i])}, _POOL))
    if kv.sum_swa_freed != int(freed.sum()):
        out.append(Violation("counters", f"sum_swa_freed kept as {kv.sum_swa_freed}, recomputed {int(freed.sum())}",
                             None, {"kept": int(kv.sum_swa_freed), "recomputed": int(freed.sum())}, _POOL))

    available = tok.swa_available_size()
    held = int((ceil_align(alloc, ps) - protected - freed).sum())
    total = allocator.swa_pool_tokens
    tree = allocator.tree_cache
    cached = 0
    if isinstance(tree, SwaRadixCache):
        cached = tree.swa_evictable_size() + tree.swa_protected_size()
    if available + held + cached != total:
        out.append(Violation("conservation", f"available {available} + uncached {held} + cached {cached} = "
                             f"{available + held + cached}, SWA pool holds {total}", None,
                             {"available": available, "uncached": held, "cached": cached, "pool_tokens": total},
                             _POOL))
    tree_slots = np.empty(0, dtype=np.int64)
    tree_full = np.empty(0, dtype=np.int64)
    if isinstance(tree, SwaRadixCache):
        tree_slots, tree_full = _check_tree(out, allocator, tree)
    ok = ~bad
    _check_window(out, allocator, rows[ok], rids[ok], alloc[ok], protected[ok], dead_lo[ok], evicted[ok],
                  tree_slots, tree_full)


def _check_tree(out: list[Violation], allocator: KvAllocator, tree: SwaRadixCache) -> tuple[np.ndarray, np.ndarray]:
    """The tree's SWA side (see the module docstring); returns its live SWA slots and
    the full slots they belong to."""
    tok: SWATokenToKVPoolAllocator = allocator.token_to_kv_pool_allocator  # type: ignore[assignment]
    mapping = tok.full_to_swa_index_mapping
    kv = allocator.req_kv
    evictable = protected = 0
    slots: list[np.ndarray] = []
    fulls: list[np.ndarray] = []
    # expected SWA lock counts from the rows' locks: from the locked node up to its
    # receipt's boundary node (the root when the window reached it); none for a lock
    # whose SWA part was released early (SwaConfig.release_prefill_swa)
    from allocator.allocation import SWA_LOCK_RELEASED

    expected: dict[int, int] = {}
    lockers: dict[int, int] = {}
    for row in np.flatnonzero(kv.rid >= 0).tolist():
        node = kv.lock_node[row]
        uuid = kv.lock_swa_uuid[row]
        while node is not None and node is not tree.root_node and uuid != SWA_LOCK_RELEASED:
            expected[node.id] = expected.get(node.id, 0) + 1
            lockers.setdefault(node.id, int(kv.rid[row]))
            if uuid is not None and node.swa_uuid == uuid:  # type: ignore[attr-defined]
                break
            node = node.parent
        while node is not None and node is not tree.root_node:  # blame the path above too
            lockers.setdefault(node.id, int(kv.rid[row]))
            node = node.parent
    for node in tree.iter_nodes():
        full = node.value.astype(np.int64)
        swa = node.swa_value  # type: ignore[attr-defined]
        if swa is None:
            mapped = mapping[full] > 0
            if mapped.any():
                out.append(Violation("tree", f"node {node.id} is an SWA tombstone but {int(mapped.sum())} of its "
                                     f"full slots still map to SWA slots", lockers.get(node.id),
                                     {"node": node.id, "count": int(mapped.sum())}, _POOL))
        else:
            if not np.array_equal(mapping[full], swa):
                out.append(Violation("tree", f"node {node.id}: its SWA slots are not its full slots' mapping",
                                     lockers.get(node.id), {"node": node.id}, _POOL))
            slots.append(np.asarray(swa, dtype=np.int64))
            fulls.append(full)
            if node.swa_lock_ref > 0:  # type: ignore[attr-defined]
                protected += len(swa)
            else:
                evictable += len(swa)
        want = expected.get(node.id, 0)
        if node.swa_lock_ref != want:  # type: ignore[attr-defined]
            out.append(Violation("tree", f"node {node.id} holds {node.swa_lock_ref} SWA locks, the requests' "  # type: ignore[attr-defined]
                                 f"windows account for {want} (an SWA lock past the window, or one leaked)",
                                 lockers.get(node.id), {"node": node.id, "swa_lock_ref": node.swa_lock_ref,  # type: ignore[attr-defined]
                                                        "expected": want}, _POOL))
    if (evictable, protected) != (tree.swa_evictable_size(), tree.swa_protected_size()):
        out.append(Violation("counters", f"tree SWA evictable/protected kept as {tree.swa_evictable_size()}/"
                             f"{tree.swa_protected_size()}, recomputed {evictable}/{protected}", None,
                             {"evictable": evictable, "protected": protected}, _POOL))
    if not slots:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    return np.concatenate(slots), np.concatenate(fulls)


def _ranges(rows: np.ndarray, starts: np.ndarray, ends: np.ndarray, width: int) -> tuple[np.ndarray, ...]:
    """Flat table indices, positions and owner index of ``[starts[i], ends[i])`` of each row."""
    counts = np.maximum(ends - starts, 0)
    total = int(counts.sum())
    offsets = np.cumsum(counts) - counts
    positions = np.repeat(starts - offsets, counts) + np.arange(total, dtype=np.int64)
    owner = np.repeat(np.arange(rows.shape[0], dtype=np.int64), counts)
    return np.repeat(rows * width, counts) + positions, positions, owner


def _check_window(out, allocator, rows, rids, alloc, protected, dead_lo, evicted, tree_slots, tree_full) -> None:
    tok = allocator.token_to_kv_pool_allocator
    ps = allocator.page_size
    pool = allocator.req_to_token_pool
    width = pool.max_context_len
    table = pool.req_to_token_np.reshape(-1)
    mapping = tok.full_to_swa_index_mapping
    num_slots = mapping.shape[0] - 1
    live_hi = np.maximum(evicted, dead_lo)
    # live: [protected, min(dead_lo, alloc)) and [max(evicted, dead_lo), alloc)
    parts = [
        _ranges(rows, protected, np.minimum(dead_lo, alloc), width),
        _ranges(rows, np.minimum(live_hi, alloc), alloc, width),
    ]
    flat = np.concatenate([p[0] for p in parts])
    positions = np.concatenate([p[1] for p in parts])
    owner = np.concatenate([p[2] for p in parts])
    full = table[flat].astype(np.int64)
    in_range = (full >= 0) & (full < num_slots)
    swa = np.where(in_range, mapping[np.clip(full, 0, num_slots)], 0)
    unmapped = swa <= 0
    for i in np.unique(owner[unmapped])[:_MAX_ITEMS].tolist():
        sel = unmapped & (owner == i)
        rid = int(rids[i])
        out.append(Violation("window", f"rid={rid}: positions {positions[sel][:4].tolist()} are inside its SWA "
                             f"window (swa_evicted_seqlen {int(evicted[i])}) but hold no SWA slot", rid,
                             {"count": int(sel.sum()), "swa_evicted_seqlen": int(evicted[i])}, _POOL))
    dflat, dpos, downer = _ranges(rows, dead_lo, np.minimum(live_hi, alloc), width)
    dfull = table[dflat].astype(np.int64)
    dmapped = mapping[np.clip(dfull, 0, num_slots)] > 0
    for i in np.unique(downer[dmapped])[:_MAX_ITEMS].tolist():
        sel = dmapped & (downer == i)
        rid = int(rids[i])
        out.append(Violation("window", f"rid={rid}: positions {dpos[sel][:4].tolist()} are below its "
                             f"swa_evicted_seqlen {int(evicted[i])} but still hold SWA slots "
                             f"(an out-of-window free missed, or a wrong cursor)", rid,
                             {"count": int(sel.sum()), "swa_evicted_seqlen": int(evicted[i])}, _POOL))
    num_mapped = int(np.count_nonzero(mapping[:-1] > 0))
    num_live = int(np.count_nonzero(~unmapped)) + int(np.count_nonzero(dmapped)) + int(tree_full.shape[0])
    if num_mapped > num_live:
        out.append(Violation("window", f"{num_mapped - num_live} full slots map to SWA slots no request row holds",
                             None, {"count": num_mapped - num_live}, _POOL))

    # ownership of SWA pages: free list + each request's live pages, once each
    swa_slots, swa_owner, swa_pos = swa[~unmapped], owner[~unmapped], positions[~unmapped]
    if ps > 1 and swa_slots.shape[0]:
        off = swa_slots % ps != swa_pos % ps
        for i in np.unique(swa_owner[off])[:_MAX_ITEMS].tolist():
            rid = int(rids[i])
            out.append(Violation("ownership", f"rid={rid}: positions {swa_pos[off & (swa_owner == i)][:4].tolist()} "
                                 f"map to SWA slots at another in-page offset", rid, {}, _POOL))
    num_pages = allocator.swa_pool_tokens // ps
    pages = swa_slots // ps
    pairs = np.unique(np.stack([swa_owner, pages]), axis=1) if pages.shape[0] else np.zeros((2, 0), np.int64)
    req_owner, req_pages = pairs[0], pairs[1]
    free_pages = tok.swa_attn_allocator.get_all_free_pages().astype(np.int64)
    tree_pages = np.unique(tree_slots // ps) if ps > 1 else tree_slots
    everything = np.concatenate([free_pages, req_pages, tree_pages])
    inside = (everything >= 0) & (everything <= num_pages)
    if not inside.all():
        out.append(Violation("ownership", f"SWA page ids outside 0..{num_pages}: "
                             f"{everything[~inside][:_MAX_ITEMS].tolist()}", None, {}, _POOL))
    counts = np.bincount(everything[inside], minlength=num_pages + 1)
    if counts[0]:
        out.append(Violation("ownership", f"SWA page 0 (reserved) is held {int(counts[0])} times", None,
                             {"count": int(counts[0])}, _POOL))
    for page in (np.flatnonzero(counts[1:] > 1) + 1)[:_MAX_ITEMS].tolist():
        n_free = int((free_pages == page).sum())
        holders = [f"rid={int(rids[i])}" for i in np.unique(req_owner[req_pages == page]).tolist()]
        if n_free:
            holders.insert(0, f"free list x{n_free}")
        rid = int(rids[req_owner[req_pages == page][0]]) if (req_pages == page).any() else None
        out.append(Violation("ownership", f"SWA page {page} is held {int(counts[page])} times: "
                             f"{', '.join(holders)}", rid, {"page": page, "count": int(counts[page])}, _POOL))
    lost = np.flatnonzero(counts[1:] == 0) + 1
    if lost.shape[0]:
        out.append(Violation("ownership", f"{lost.shape[0]} SWA pages are held by nobody (leaked), e.g. "
                             f"{lost[:_MAX_ITEMS].tolist()}", None, {"count": int(lost.shape[0])}, _POOL))
