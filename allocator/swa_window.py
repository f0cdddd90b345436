"""Out-of-window SWA frees and the SWA-aware release split, over one request's bookkeeping.

SGLang 0.5.23 (``mem_cache/common.py``, ``managers/schedule_batch.py``) frees the SWA
side of a request's tokens once decode has slid past the window, and records how far
in ``swa_evicted_seqlen`` (the SWA entry of ``ReqKvInfo.component_evicted_seqlens``).
The freed range starts at ``swa_dead_lo``: above the tree-owned prefix and the
request's eviction floor. On release, that range goes back full-side only::

    row:  0 ...... protected ... dead_lo ........ swa_evicted ........ owned ..| allocated
          |- tree -|- SWA held -|- SWA freed (full only) -|- both pools -|- overallocated -|

These functions work on ``SwaKvInfo`` (the fields of ``ReqKvInfo`` they read) and a
request's ``req_to_token`` row; they call an ``allocator.swa.SWATokenToKVPoolAllocator``.
``KvAllocator``'s allocation functions (``allocator.allocation``) release through
``free_kv_row_segments`` and apply the same window rule to a whole batch at once
(``plan_window_frees``, columns of ``ReqKvTable``); these one-request forms are the
reference their tests and the SWA pool parity drive. ``swa_slot_ownership`` reads the
same regions to give the state and owner of every SWA slot (the dashboard's SWA page map).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from allocator.pages import ceil_align

if TYPE_CHECKING:
    from allocator.manager import KvAllocator
    from allocator.ownership import SlotOwnership
    from allocator.swa import SWATokenToKVPoolAllocator

__all__ = [
    "SwaKvInfo",
    "coalesce_ranges",
    "free_kv_row",
    "free_kv_row_segments",
    "free_swa_out_of_window_slots",
    "kv_private_swa_tokens",
    "release_kv_row",
    "swa_slot_ownership",
]


@dataclass(slots=True)
class SwaKvInfo:
    """The SWA bookkeeping of one request (SGLang's ``ReqKvInfo`` fields of that name).

    Attributes:
        cache_protected_len: the tree owns ``[0, here)`` (page aligned).
        swa_evict_floor: ``[0, here)`` is never window-evicted.
        swa_evicted_seqlen: the SWA cursor: SWA slots in ``[swa_dead_lo, here)`` are freed.
    """

    cache_protected_len: int = 0
    swa_evict_floor: int = 0
    swa_evicted_seqlen: int = 0

    def swa_dead_lo(self, page_size: int) -> int:
        """The lowest position whose SWA slot the request frees itself:
        ``max(protected, floor)``, page-aligned up only when above ``protected``."""
        lo = max(self.cache_protected_len, self.swa_evict_floor)
        if page_size > 1 and lo > self.cache_protected_len:
            lo = int(ceil_align(lo, page_size))
        return lo


def free_swa_out_of_window_slots(
    kv: SwaKvInfo,
    row: np.ndarray,
    pre_len: int,
    *,
    sliding_window_size: int,
    allocator: SWATokenToKVPoolAllocator,
    supports_prefix_sharing: bool = True,
    retain_floor: int | None = None,
    eviction_interval: int = 1,
) -> None:
    """Free the SWA side of the request's tokens that fell out of the window.

    Nothing happens until ``pre_len - window`` reaches ``swa_evicted_seqlen +
    eviction_interval``. Then the cursor first jumps to ``max(cursor, swa_dead_lo)``
    (stored even if nothing is freed), and the new cursor is ``pre_len`` minus the
    kept tail, floored to a page: the tail is ``window`` without prefix sharing and
    ``ceil_align(max(window, page), page)`` with it (capped by ``retain_floor``).
    ``row[cursor:new_cursor]`` is freed SWA-side with ``free_swa_segment``.

    Args:
        kv: the request's bookkeeping (``swa_evicted_seqlen`` is updated).
        row: the request's ``req_to_token`` row (full slots), at least ``pre_len`` long.
        pre_len: tokens whose KV is committed.
        sliding_window_size: the retained window (SGLang's ``swa_retain_window``).
        allocator: the SWA pool allocator.
        supports_prefix_sharing: whether a prefix tree caches the request.
        retain_floor: the tree's floor (never freed past), prefix sharing only.
        eviction_interval: the minimum advance before a free (decode: 128 in SGLang).

    Raises:
        ValueError: ``cache_protected_len`` is not page aligned.
    """
    ps = allocator.page_size
    if kv.cache_protected_len % ps:
        raise ValueError(f"cache_protected_len {kv.cache_protected_len} is not page aligned (page size {ps})")
    evicted = kv.swa_evicted_seqlen
    if pre_len - sliding_window_size < evicted + eviction_interval:
        return
    evicted = max(evicted, kv.swa_dead_lo(ps))
    kv.swa_evicted_seqlen = evicted
    if supports_prefix_sharing:
        threshold = pre_len - int(ceil_align(max(sliding_window_size, ps), ps))
        if retain_floor is not None:
            threshold = min(threshold, retain_floor)
    else:
        threshold = pre_len - sliding_window_size
    new_evicted = max(evicted, threshold)
    if ps > 1:
        new_evicted = new_evicted // ps * ps
    if new_evicted > evicted:
        allocator.free_swa_segment(row[evicted:new_evicted], start_pos=evicted)
        kv.swa_evicted_seqlen = new_evicted


def coalesce_ranges(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge adjacent half-open ranges (so a page split between two is freed once)."""
    merged: list[tuple[int, int]] = []
    for start, end in ranges:
        if merged and start == merged[-1][1]:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def free_kv_row_segments(
    allocator: SWATokenToKVPoolAllocator,
    segments: Sequence[tuple[np.ndarray, int]],
    *,
    swa_evicted_seqlen: int,
    swa_dead_lo: int = 0,
) -> None:
    """Free ascending disjoint ``(slots, start_pos)`` segments of one row: the part in
    ``[swa_dead_lo, swa_evicted_seqlen)`` full-side only (first), the rest in both pools.

    Raises:
        ValueError: both kinds of part exist and the cursor splits a page.
    """
    dead_lo, dead_hi = swa_dead_lo, max(swa_evicted_seqlen, swa_dead_lo)
    dead: list[tuple[np.ndarray, int]] = []
    alive: list[tuple[np.ndarray, int]] = []
    for slots, start in segments:
        end = start + int(slots.shape[0])
        lo = min(max(dead_lo, start), end)
        hi = min(max(dead_hi, start), end)
        if hi <= lo:
            alive.append((slots, start))
            continue
        dead.append((slots[lo - start : hi - start], lo))
        if lo > start:
            alive.append((slots[: lo - start], start))
        if end > hi:
            alive.append((slots[hi - start :], hi))
    if dead and alive and swa_evicted_seqlen % allocator.page_size:
        raise ValueError(
            f"SWA eviction cursor {swa_evicted_seqlen} splits a page (page size {allocator.page_size})"
        )
    if dead:
        allocator.free_full_segments(dead)
    if alive:
        allocator.free_segments(alive)


def free_kv_row(
    allocator: SWATokenToKVPoolAllocator, kv: SwaKvInfo, row: np.ndarray, ranges: Sequence[tuple[int, int]]
) -> None:
    """Give back ascending disjoint ``[start, end)`` ranges of the request's row
    (``BasePrefixCache.free_kv_row``): coalesced, then split by ``free_kv_row_segments``."""
    free_kv_row_segments(
        allocator,
        [(row[start:end], start) for start, end in coalesce_ranges(ranges)],
        swa_evicted_seqlen=kv.swa_evicted_seqlen,
        swa_dead_lo=kv.swa_dead_lo(allocator.page_size),
    )


def release_kv_row(
    allocator: SWATokenToKVPoolAllocator,
    kv: SwaKvInfo,
    row: np.ndarray,
    owned_kv_len: int,
    kv_allocated_len: int,
) -> None:
    """The frees of ``release_kv_cache`` after any checkpoint: the request's own
    ``[protected, owned)``, then the overallocated ``[ceil_align(owned), allocated)``.
    The bookkeeping is left for the caller to reset."""
    free_kv_row(allocator, kv, row, [(kv.cache_protected_len, owned_kv_len)])
    start = owned_kv_len
    if allocator.page_size > 1:
        start = int(ceil_align(start, allocator.page_size))
    if start < kv_allocated_len:
        free_kv_row(allocator, kv, row, [(start, kv_allocated_len)])


def kv_private_swa_tokens(kv: SwaKvInfo, kv_allocated_len: int, page_size: int) -> int:
    """SWA tokens the request holds outside the tree (the pool-stats term):
    ``ceil(allocated) - protected - max(0, evicted - dead_lo)``."""
    allocated = int(ceil_align(kv_allocated_len, page_size))
    window_freed = max(0, kv.swa_evicted_seqlen - kv.swa_dead_lo(page_size))
    return allocated - kv.cache_protected_len - window_freed


def swa_slot_ownership(allocator: KvAllocator) -> SlotOwnership:
    """The state and owner of every slot of a hybrid allocator's SWA pool, as
    ``allocator.ownership.slot_ownership`` gives them for the full pool (a read only).

    A request row holds full slots; the SWA slot of a position is the mapping's. Per row::

        position  0 ...... protected ... dead_lo ...... swa_evicted ...... committed ... allocated ..| ceil_align
                  |- tree -|- request -|- freed (no SWA slot) -|- COMMITTED -|- OVERALLOCATED -|- PAGE_TAIL -|

    The tree's SWA slots are its nodes' ``swa_value`` (CACHED_LOCKED when the node's
    ``swa_lock_ref > 0``); the SWA free list is FREE; page 0 RESERVED; any other slot
    UNOWNED (a leak, in a broken state only).

    Args:
        allocator: the built-in allocator with a sliding-window pool (``config.swa``).

    Returns:
        The SWA pool's map; its FREE count is ``pool_counters()["swa"].available``.
    """
    from allocator.ownership import SlotOwnership, SlotState
    from allocator.swa import SWATokenToKVPoolAllocator

    tok = allocator.token_to_kv_pool_allocator
    assert isinstance(tok, SWATokenToKVPoolAllocator), f"not a hybrid SWA allocator: {type(tok).__name__}"
    ps = allocator.page_size
    num_pages = allocator.swa_pool_tokens // ps
    page_state = np.full(num_pages + 1, SlotState.UNOWNED, dtype=np.int8)
    free = tok.swa_attn_allocator.get_all_free_pages().astype(np.int64)
    claims = [free]
    page_state[free[(free >= 0) & (free <= num_pages)]] = SlotState.FREE
    tree_slots: list[np.ndarray] = []
    tree_locked: list[bool] = []
    for node in allocator.tree_cache.iter_nodes():
        value = getattr(node, "swa_value", None)
        if value is not None and value.shape[0]:
            tree_slots.append(np.asarray(value, np.int64))
            tree_locked.append(getattr(node, "swa_lock_ref", 0) > 0)
    if tree_slots:
        slots = np.concatenate(tree_slots)
        locked = np.repeat(np.array(tree_locked), [s.shape[0] for s in tree_slots])
        pages, locked = (slots[::ps] // ps, locked[::ps]) if ps > 1 else (slots, locked)
        ok = (pages >= 0) & (pages <= num_pages)
        page_state[pages[ok]] = locked[ok].view(np.int8) + np.int8(SlotState.CACHED_EVICTABLE)
        claims.append(pages)
    page_state[0] = SlotState.RESERVED
    state = np.repeat(page_state, ps) if ps > 1 else page_state
    num_slots = state.shape[0]
    owner = np.full(num_slots, -1, dtype=np.int64)
    kv = allocator.req_kv
    width = allocator.req_to_token_pool.max_context_len
    rows = kv.rows_in_use()
    alloc = kv.kv_allocated_len[rows]
    committed = kv.kv_committed_len[rows]
    prot = kv.cache_protected_len[rows]
    ok = (prot >= 0) & (prot <= alloc) & (alloc <= width)
    rows, alloc, committed, prot = rows[ok], alloc[ok], committed[ok], prot[ok]
    counts = np.maximum(ceil_align(alloc, ps) - prot, 0)
    total = int(counts.sum())
    if total:
        idx = np.repeat(np.arange(rows.shape[0], dtype=np.int64), counts)
        positions = np.repeat(prot - (np.cumsum(counts) - counts), counts) + np.arange(total, dtype=np.int64)
        dead_lo = kv.swa_dead_lo(rows)[idx]
        live = (positions < dead_lo) | (positions >= kv.swa_evicted_seqlen[rows][idx])
        idx, positions = idx[live], positions[live]
        last = alloc[idx] - 1
        read = np.minimum(positions, last) if ps > 1 else positions
        flat = allocator.req_to_token_pool.req_to_token_np.reshape(-1)
        full = flat[rows[idx] * width + read].astype(np.int64)
        slots = tok.translate_loc_from_full_to_swa(full).astype(np.int64)
        mapped = slots > 0
        slots = slots + (positions - read)  # a page tail's slots follow the last allocated one
        slot_state = np.where(
            positions < committed[idx],
            np.int8(SlotState.COMMITTED),
            np.where(positions <= last, np.int8(SlotState.OVERALLOCATED), np.int8(SlotState.PAGE_TAIL)),
        )
        valid = mapped & (slots >= ps) & (slots < num_slots)
        slots, slot_state, idx = slots[valid], slot_state[valid], idx[valid]
        state[slots] = slot_state
        owner[slots] = kv.rid[rows][idx]
        claims.append(np.unique(slots // ps))
    everything = np.concatenate(claims)
    everything = everything[(everything >= 0) & (everything <= num_pages)]
    holders = np.bincount(everything, minlength=num_pages + 1)
    holders[0] = 0
    return SlotOwnership(state, owner, holders, ps)
