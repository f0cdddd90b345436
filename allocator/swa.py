"""The hybrid sliding-window allocator: SGLang 0.5.23's ``SWATokenToKVPoolAllocator``.

A hybrid model (full-attention layers and sliding-window layers) keeps two KV pools,
each an allocator of its own (``allocator.token_to_kv``: the page-1 allocator at
page size 1, the paged one above), and one int64 mapping from full slots to SWA
slots. Request rows (``req_to_token``) hold FULL slots only; a token's SWA slot is
``full_to_swa_index_mapping[full_slot]`` (0 = none). Allocations take from both
pools in lockstep (same prefix and seq lens, so a slot's in-page offset is the
same in both); frees return the SWA side first, then the full side::

    full pool   free [5 6 ..]    row r: | 17 18 19 | 33 34 |        (full slots, pages 1 and 2)
                                            |  |  |    |  |
    mapping [full_size + ps + 1]:          81 82 83   49 50          (0 once freed; last entry -1)
                                            v  v  v    v  v
    swa pool    free [2 4 ..]               SWA slots, pages 5 and 3

The mapping's trailing entry is -1, so a ``last_loc`` of -1 (an empty prefix)
translates to -1 on the SWA side as well. ``free_swa`` / ``free_swa_segment``
release only the SWA side of full slots (out-of-window tokens) and clear their
mapping; ``free_full`` / ``free_full_segment`` release the full side of slots
whose SWA side is already gone. ``available_size`` is the smaller pool's.

Free groups defer every free until ``free_group_end``, which releases, in this
order: the SWA pages of segment frees (one concatenation), the SWA slots of
set-shaped ``free_swa`` calls (one concatenation), then the full pool's own group.
The SWA side of a deferred free is read from the mapping (and the mapping
cleared) when the free is called, not at the end of the group.

Not mirrored: the per-request SWA ring (``swa_req_ring_size``, DeepSeek-V4 only)
and ``PureSWATokenToKVPoolAllocator`` (all-SWA models).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from allocator.pages import num_new_pages
from allocator.token_to_kv import SLOT_DTYPE, PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

__all__ = ["SWATokenToKVPoolAllocator"]

_MAP_DTYPE = np.int64


class SWATokenToKVPoolAllocator:
    """A full pool and an SWA pool joined by the full -> SWA slot mapping.

    Same public methods, call order and free-list order as SGLang 0.5.23's class
    (``mem_cache/allocator/swa.py``): ``alloc`` at page size 1, ``alloc_extend`` /
    ``alloc_decode`` / ``alloc_extend_swa_tail`` above it.

    Args:
        size: full pool slots.
        size_swa: SWA pool slots.
        page_size: tokens per page (both pools).
        need_sort: PD-disaggregation mode of both pools (frees staged, merged and
            sorted when an allocation runs short).
        device: informational.

    Attributes:
        full_attn_allocator: the full pool's allocator.
        swa_attn_allocator: the SWA pool's allocator.
        full_to_swa_index_mapping: int64 ``[size + page_size + 1]`` on the host:
            SWA slot of each full slot, 0 where none; the last entry is -1.
    """

    def __init__(
        self,
        size: int,
        size_swa: int,
        page_size: int,
        need_sort: bool = False,
        device: str = "cpu",
    ) -> None:
        self._size_full = size
        self._size_swa = size_swa
        self.page_size = page_size
        self.need_sort = need_sort
        self.device = device
        self.full_attn_allocator: TokenToKVPoolAllocator | PagedTokenToKVPoolAllocator
        self.swa_attn_allocator: TokenToKVPoolAllocator | PagedTokenToKVPoolAllocator
        if page_size == 1:
            self.full_attn_allocator = TokenToKVPoolAllocator(size, need_sort, device)
            self.swa_attn_allocator = TokenToKVPoolAllocator(size_swa, need_sort, device)
        else:
            self.full_attn_allocator = PagedTokenToKVPoolAllocator(size, page_size, need_sort, device)
            self.swa_attn_allocator = PagedTokenToKVPoolAllocator(size_swa, page_size, need_sort, device)
        self.full_to_swa_index_mapping = np.zeros(size + page_size + 1, dtype=_MAP_DTYPE)
        self.full_to_swa_index_mapping[-1] = -1
        self._page_offsets = np.arange(page_size, dtype=_MAP_DTYPE)
        self.free_group: list[np.ndarray] | None = None
        # Deferred SWA frees of an open group: page ids of segment frees, and slots
        # (already read from the mapping) of set-shaped free_swa calls.
        self.swa_page_ids_group: list[np.ndarray] = []
        self.swa_free_group: list[np.ndarray] = []
        self.clear()

    # ------------------------------------------------------------------ sizes

    @property
    def size(self) -> int:
        return min(self._size_full, self._size_swa)

    @property
    def size_full(self) -> int:
        return self._size_full

    @property
    def size_swa(self) -> int:
        return self._size_swa

    def available_size(self) -> int:
        """Tokens both pools can still take: the smaller pool's available size."""
        return min(self.full_attn_allocator.available_size(), self.swa_attn_allocator.available_size())

    def full_available_size(self) -> int:
        return self.full_attn_allocator.available_size()

    def swa_available_size(self) -> int:
        return self.swa_attn_allocator.available_size()

    def new_pages_available(self, num_full_pages: int, num_swa_pages: int) -> bool:
        """Whether each pool has the pages asked of it (staged pages count)."""
        ps = self.page_size
        return (
            num_full_pages <= self.full_attn_allocator.available_size() // ps
            and num_swa_pages <= self.swa_attn_allocator.available_size() // ps
        )

    # ------------------------------------------------------------------ inspection

    def full_free_pages_np(self) -> np.ndarray:
        """The full pool's free list in reuse order (int32 copy; pages, or slots at page 1)."""
        return self.full_attn_allocator.free_pages_np()

    def swa_free_pages_np(self) -> np.ndarray:
        """The SWA pool's free list in reuse order (int32 copy; pages, or slots at page 1)."""
        return self.swa_attn_allocator.free_pages_np()

    def get_all_free_pages(self) -> tuple[np.ndarray, np.ndarray]:
        """Every free page of each pool, free list then staged: ``(full, swa)``."""
        return self.full_attn_allocator.get_all_free_pages(), self.swa_attn_allocator.get_all_free_pages()

    def translate_loc_from_full_to_swa(self, kv_indices: np.ndarray) -> np.ndarray:
        """The SWA slots of full slots (0 where unmapped; -1 for -1)."""
        return self.full_to_swa_index_mapping[kv_indices]

    def mapped_full_slots(self) -> np.ndarray:
        """Full slots with an SWA slot, ascending (int64)."""
        return np.flatnonzero(self.full_to_swa_index_mapping[:-1])

    # ------------------------------------------------------------------ mapping

    def set_full_to_swa_mapping(self, full_indices: np.ndarray, swa_indices: np.ndarray) -> None:
        if full_indices.shape[0] == 0:
            return
        if full_indices.shape[0] != swa_indices.shape[0]:
            raise ValueError(f"mapping {full_indices.shape[0]} full slots to {swa_indices.shape[0]} SWA slots")
        self.full_to_swa_index_mapping[full_indices] = swa_indices

    def clear_full_to_swa_mapping(self, full_indices: np.ndarray) -> None:
        if full_indices.shape[0]:
            self.full_to_swa_index_mapping[full_indices] = 0

    # ------------------------------------------------------------------ alloc

    def alloc(self, need_size: int) -> np.ndarray | None:
        """Page size 1: ``need_size`` slots of each pool, mapped; None (nothing taken)
        if either pool is short."""
        if self.page_size != 1:
            raise NotImplementedError("SWA alloc() is for page size 1; use alloc_extend / alloc_decode")
        if need_size > self.full_attn_allocator.available_size():
            return None
        if need_size > self.swa_attn_allocator.available_size():
            return None
        full = self.full_attn_allocator.alloc(need_size)
        swa = self.swa_attn_allocator.alloc(need_size)
        if full is None or swa is None:
            raise RuntimeError("SWA alloc: a pool ran short after the capacity check")
        self.set_full_to_swa_mapping(full, swa)
        return full

    def alloc_extend(
        self,
        prefix_lens: np.ndarray,
        seq_lens: np.ndarray,
        last_loc: np.ndarray,
        extend_num_tokens: int | None = None,
    ) -> np.ndarray | None:
        """Paged: extend each request from ``prefix_lens`` to ``seq_lens`` in both pools.

        Args:
            prefix_lens, seq_lens: int64 ``[bs]`` lengths before and after.
            last_loc: int64 ``[bs]`` FULL slot of each request's last prefix token
                (-1 for an empty prefix); the SWA side continues from its mapping.
            extend_num_tokens: ``sum(seq_lens - prefix_lens)`` (computed if None).

        Returns:
            int32 ``[extend_num_tokens]`` full slots, or None (nothing taken) if
            either pool lacks the new pages.
        """
        self._require_paged("alloc_extend")
        need = num_new_pages(prefix_lens, seq_lens, self.page_size)
        if not self.new_pages_available(need, need):
            return None
        if extend_num_tokens is None:
            extend_num_tokens = int((seq_lens - prefix_lens).sum())
        swa_last_loc = self.translate_loc_from_full_to_swa(last_loc)
        full = self._paged(self.full_attn_allocator).alloc_extend(
            prefix_lens, seq_lens, last_loc, extend_num_tokens, num_new_pages_hint=need
        )
        swa = self._paged(self.swa_attn_allocator).alloc_extend(
            prefix_lens, seq_lens, swa_last_loc, extend_num_tokens, num_new_pages_hint=need
        )
        if full is None or swa is None:
            raise RuntimeError("SWA alloc_extend: a pool ran short after the capacity check")
        self.set_full_to_swa_mapping(full, swa)
        return full

    def alloc_decode(self, seq_lens: np.ndarray, last_loc: np.ndarray) -> np.ndarray | None:
        """Paged: one slot per request in each pool (``seq_lens`` after the new token).

        NOTE: as SGLang's, no capacity check comes first: each pool allocates on its
        own, so when one pool is short the other's new pages stay taken (the caller
        evicts beforehand so that this does not happen).

        Returns:
            int32 ``[bs]`` full slots, or None if either pool was short.
        """
        self._require_paged("alloc_decode")
        swa_last_loc = self.translate_loc_from_full_to_swa(last_loc)
        full = self._paged(self.full_attn_allocator).alloc_decode(seq_lens, last_loc)
        swa = self._paged(self.swa_attn_allocator).alloc_decode(seq_lens, swa_last_loc)
        if full is None or swa is None:
            return None
        self.full_to_swa_index_mapping[full] = swa
        return full

    def alloc_extend_swa_tail(
        self,
        prefix_lens: np.ndarray,
        seq_lens: np.ndarray,
        last_loc: np.ndarray,
        extend_num_tokens: int,
        swa_tail_len: int,
    ) -> np.ndarray | None:
        """Paged, one request (PD prealloc): full KV for the whole extend, SWA KV only
        for its last ``swa_tail_len`` tokens.

        The SWA tail is allocated as a fresh request (empty prefix, ``last_loc`` -1),
        mapped from the last ``swa_tail_len`` full slots; the head's mapping is
        cleared (left alone when the tail is empty)::

            full  | prefix | head (unmapped) ........ | tail |
            swa                                      | tail |   (fresh pages)

        Returns:
            int32 ``[extend_num_tokens]`` full slots, or None (nothing taken) if
            either pool lacks the pages.
        """
        self._require_paged("alloc_extend_swa_tail")
        if prefix_lens.shape[0] != 1 or seq_lens.shape[0] != 1:
            raise ValueError("alloc_extend_swa_tail takes one request")
        if not 0 <= swa_tail_len <= extend_num_tokens:
            raise ValueError(f"SWA tail {swa_tail_len} outside [0, {extend_num_tokens}]")
        ps = self.page_size
        num_full_pages = num_new_pages(prefix_lens, seq_lens, ps)
        num_swa_pages = -(-swa_tail_len // ps)
        if not self.new_pages_available(num_full_pages, num_swa_pages):
            return None
        full = self._paged(self.full_attn_allocator).alloc_extend(
            prefix_lens, seq_lens, last_loc, extend_num_tokens, num_new_pages_hint=num_full_pages
        )
        if full is None:
            raise RuntimeError("SWA alloc_extend_swa_tail: the full pool ran short after the capacity check")
        if swa_tail_len == 0:
            return full
        zero = np.zeros(1, dtype=np.int64)
        swa = self._paged(self.swa_attn_allocator).alloc_extend(
            zero,
            np.array([swa_tail_len], dtype=np.int64),
            np.array([-1], dtype=np.int64),
            swa_tail_len,
            num_new_pages_hint=num_swa_pages,
        )
        if swa is None:
            raise RuntimeError("SWA alloc_extend_swa_tail: the SWA pool ran short after the capacity check")
        self.set_full_to_swa_mapping(full[-swa_tail_len:], swa)
        if swa_tail_len < extend_num_tokens:
            self.clear_full_to_swa_mapping(full[:-swa_tail_len])
        return full

    # ------------------------------------------------------------------ free

    def free(self, free_index: np.ndarray) -> None:
        """Free full slots in both pools: the SWA side first (it reads the mapping)."""
        if free_index.shape[0] == 0:
            return
        self.free_swa(free_index)
        self.free_full(free_index)

    def free_swa(self, free_index: np.ndarray) -> None:
        """Free the SWA side of any set of full slots and clear their mapping.

        Paged, the whole full page of every slot given is covered: its mapped SWA
        slots are freed (their pages, deduplicated), and unmapped entries skipped.
        At page size 1 the mapping is read as is (an unmapped slot frees slot 0).
        """
        if free_index.shape[0] == 0:
            return
        if self.page_size == 1:
            self._free_swa_pages(free_index, 0)
            return
        full_slots = self._expand_to_full_pages(free_index)
        swa_slots = self.full_to_swa_index_mapping[full_slots]
        self.clear_full_to_swa_mapping(full_slots)
        if self.free_group is not None:
            self.swa_free_group.append(swa_slots)
            return
        self._release_swa(swa_slots)

    def free_swa_segment(self, free_index: np.ndarray, *, start_pos: int) -> None:
        """``free_swa`` of a row segment ``row[start_pos : start_pos + n]`` (page-aligned
        start): one SWA page per full page, ``mapping[free_index[::ps]] // ps``, in
        row order."""
        if free_index.shape[0] == 0:
            return
        self._free_swa_pages(free_index, start_pos)

    def free_full(self, free_index: np.ndarray) -> None:
        """Free full slots whose SWA side is already released (the mapping is not read)."""
        if free_index.shape[0] == 0:
            return
        self.full_attn_allocator.free(free_index)

    def free_segment(self, free_index: np.ndarray, *, start_pos: int) -> None:
        """Free a row segment in both pools, SWA side first."""
        if free_index.shape[0] == 0:
            return
        self.free_swa_segment(free_index, start_pos=start_pos)
        self.full_attn_allocator.free_segment(free_index, start_pos)

    def free_full_segment(self, free_index: np.ndarray, *, start_pos: int) -> None:
        """``free_full`` of a row segment."""
        if free_index.shape[0] == 0:
            return
        self.full_attn_allocator.free_segment(free_index, start_pos)

    def free_segments(self, segments: Iterable[tuple[np.ndarray, int]]) -> None:
        """``free_segment`` of each ``(free_index, start_pos)`` of one request's row
        (ascending, no page shared between two segments)."""
        for free_index, start_pos in self._page_disjoint(segments):
            self.free_segment(free_index, start_pos=start_pos)

    def free_full_segments(self, segments: Iterable[tuple[np.ndarray, int]]) -> None:
        """``free_full_segment`` of each segment, as ``free_segments``."""
        for free_index, start_pos in self._page_disjoint(segments):
            self.free_full_segment(free_index, start_pos=start_pos)

    def _page_disjoint(self, segments: Iterable[tuple[np.ndarray, int]]) -> Iterator[tuple[np.ndarray, int]]:
        ps = self.page_size
        prev_end: int | None = None
        for free_index, start_pos in segments:
            n = int(free_index.shape[0])
            if n == 0:
                continue
            if prev_end is not None and start_pos // ps <= (prev_end - 1) // ps:
                raise ValueError(f"segment at {start_pos} shares a page with the one ending at {prev_end}")
            prev_end = start_pos + n
            yield free_index, start_pos

    def _free_swa_pages(self, free_index: np.ndarray, start_pos: int) -> None:
        ps = self.page_size
        if start_pos % ps:
            raise ValueError(f"free_swa_segment: segment start {start_pos} is not page aligned (page size {ps})")
        reps = free_index[::ps]
        swa_slots = self.full_to_swa_index_mapping[reps]
        if ps == 1:
            swa_pages = swa_slots
            mapped = reps
        else:
            # Both pools page in lockstep, so a full page's SWA peer is one whole page.
            swa_pages = swa_slots // ps
            mapped = self._expand_to_full_pages(reps)
        self.clear_full_to_swa_mapping(mapped)
        swa_pages = swa_pages.astype(SLOT_DTYPE)
        if self.free_group is not None:
            self.swa_page_ids_group.append(swa_pages)
            return
        self.swa_attn_allocator.free_page_ids(swa_pages)

    def _release_swa(self, swa_slots: np.ndarray) -> None:
        if self.page_size > 1:
            # The page expansion picked up unmapped slots (0): not SWA slots.
            swa_slots = swa_slots[swa_slots > 0]
        self.swa_attn_allocator.free(swa_slots.astype(SLOT_DTYPE))

    def _expand_to_full_pages(self, indices: np.ndarray) -> np.ndarray:
        """Every slot of the page of each index (duplicates kept)."""
        ps = self.page_size
        base = (indices.astype(_MAP_DTYPE) // ps) * ps
        return (base[:, None] + self._page_offsets).reshape(-1)

    # ------------------------------------------------------------------ free groups

    def free_group_begin(self) -> None:
        if self.free_group is not None:
            raise RuntimeError("free groups cannot be nested")
        self.free_group = []
        self.swa_free_group = []
        self.swa_page_ids_group = []
        self.full_attn_allocator.free_group_begin()

    def free_group_end(self) -> None:
        """Release the group's frees: SWA segment pages, SWA slots, then the full side."""
        self.free_group = None
        if self.swa_page_ids_group:
            group, self.swa_page_ids_group = self.swa_page_ids_group, []
            self.swa_attn_allocator.free_page_ids(np.concatenate(group))
        if self.swa_free_group:
            group, self.swa_free_group = self.swa_free_group, []
            self._release_swa(np.concatenate(group))
        self.full_attn_allocator.free_group_end()

    def is_free_group_open(self) -> bool:
        return self.free_group is not None

    # ------------------------------------------------------------------ misc

    def merge_and_sort_free(self) -> None:
        self.full_attn_allocator.merge_and_sort_free()
        self.swa_attn_allocator.merge_and_sort_free()

    def clear(self) -> None:
        """Both pools back to all-free, the mapping to 0 (its trailing -1 kept)."""
        self.swa_attn_allocator.clear()
        self.full_attn_allocator.clear()
        self.full_to_swa_index_mapping[:-1] = 0
        self.free_group = None
        self.swa_free_group = []
        self.swa_page_ids_group = []

    def _require_paged(self, what: str) -> None:
        if self.page_size == 1:
            raise NotImplementedError(f"SWA {what}() is for page size > 1; use alloc")

    @staticmethod
    def _paged(allocator: TokenToKVPoolAllocator | PagedTokenToKVPoolAllocator) -> PagedTokenToKVPoolAllocator:
        assert isinstance(allocator, PagedTokenToKVPoolAllocator)
        return allocator
