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
reference their tests and the SWA pool parity drive.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from allocator.pages import ceil_align

if TYPE_CHECKING:
    from allocator.swa import SWATokenToKVPoolAllocator

__all__ = [
    "SwaKvInfo",
    "coalesce_ranges",
    "free_kv_row",
    "free_kv_row_segments",
    "free_swa_out_of_window_slots",
    "kv_private_swa_tokens",
    "release_kv_row",
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
