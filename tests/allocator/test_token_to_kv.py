"""Token, paged and HiSparse allocators: reuse orders, layouts, need_sort, free groups.

Every expected free list below is drawn head first (the next slot or page handed out
is the leftmost).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from allocator import reference
from allocator.token_to_kv import (
    HiSparseTokenToKVPoolAllocator,
    PagedTokenToKVPoolAllocator,
    PageFreeList,
    TokenToKVPoolAllocator,
    alloc_extend_layout,
    num_new_pages,
)


def _a(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


# ------------------------------------------------------------------ free list buffer


def test_page_free_list_take_prepend_append_grow() -> None:
    fl = PageFreeList(_a(1, 2, 3))
    assert fl.take(2).tolist() == [1, 2]
    fl.prepend(_a(9, 8))
    fl.append(_a(7))
    assert fl.view().tolist() == [9, 8, 3, 7]
    # far more than the initial slack on both ends
    fl.prepend(np.arange(100, 300, dtype=np.int64))
    fl.append(np.arange(300, 500, dtype=np.int64))
    assert len(fl) == 404
    assert fl.view()[:2].tolist() == [100, 101] and fl.view()[-1] == 499
    assert fl.view()[200:204].tolist() == [9, 8, 3, 7]
    fl.replace(_a(4, 5))
    assert fl.view().tolist() == [4, 5]


def test_page_free_list_recentres_in_its_own_buffer() -> None:
    """A list that stays short while its ends drift (take at the head, append at the
    tail: token FIFO reuse) recentres in the buffer it has: a replay of an hour drifted
    the list across a 7 MB buffer 153 times, and a fresh buffer each time cost fresh
    memory (page faults) for a few thousand live entries. Order is kept throughout."""
    from collections import deque

    fl = PageFreeList(np.arange(1000, dtype=np.int64))
    buf = fl._buf
    model = deque(range(1000))
    rng = np.random.default_rng(0)
    nxt = 1000
    for _ in range(2000):
        n = int(rng.integers(1, 60))
        got = fl.take(min(n, len(fl))).tolist()
        assert got == [model.popleft() for _ in got]
        k = len(got)  # the list stays at 1,000 entries
        fl.append(np.arange(nxt, nxt + k, dtype=np.int64))
        model.extend(range(nxt, nxt + k))
        nxt += k
    assert nxt > 20 * buf.shape[0]  # the tail crossed the buffer's end many times
    assert fl._buf is buf
    assert fl.view().tolist() == list(model)


# ------------------------------------------------------------------ page size 1


def test_token_vector_fifo_reuse() -> None:
    """Reference §9.1: size 16, alloc(5) -> 1..5; free([1, 2]) -> list ends ..., 16, 1, 2."""
    alloc = TokenToKVPoolAllocator(16)
    assert alloc.alloc(5).tolist() == [1, 2, 3, 4, 5]
    alloc.free(_a(1, 2))
    # free_pages [6 7 ... 16 1 2]
    assert alloc.free_pages.tolist() == [*range(6, 17), 1, 2]
    assert alloc.available_size() == 13
    assert alloc.alloc(12).tolist() == [*range(6, 17), 1]
    assert alloc.alloc(2) is None  # all or nothing: one slot left
    assert alloc.free_pages.tolist() == [2]


def test_token_vector_need_sort_merges_when_short() -> None:
    """Reference §9.1: need_sort, size 8: alloc 1..6, free [5, 1] -> release [5, 1];
    alloc(3) is short of the free list [7 8], merges and sorts -> 1, 5, 7."""
    alloc = TokenToKVPoolAllocator(8, need_sort=True)
    assert alloc.alloc(6).tolist() == [1, 2, 3, 4, 5, 6]
    alloc.free(_a(5, 1))
    assert alloc.release_pages.tolist() == [5, 1]
    assert alloc.free_pages.tolist() == [7, 8]
    assert alloc.available_size() == 4
    assert alloc.alloc(3).tolist() == [1, 5, 7]
    assert alloc.release_pages.tolist() == []
    assert alloc.free_pages.tolist() == [8]


def test_token_free_group_defers_then_appends_in_order() -> None:
    alloc = TokenToKVPoolAllocator(6)
    alloc.alloc(6)
    alloc.free_group_begin()
    alloc.free(_a(4))
    alloc.free(_a(2, 6))
    assert alloc.available_size() == 0
    with pytest.raises(RuntimeError):
        alloc.free_group_begin()
    alloc.free_group_end()
    assert alloc.free_pages.tolist() == [4, 2, 6]


# ------------------------------------------------------------------ paged


def test_paged_vector_extend_and_decode_layout() -> None:
    """Reference §9.2: page 4, size 64 (pages 1..16)."""
    alloc = PagedTokenToKVPoolAllocator(64, 4)
    # r1 0 -> 5: page 1 whole (4..7) then the head of page 2 (8)
    out = alloc.alloc_extend(_a(0), _a(5), _a(-1))
    assert out.tolist() == [4, 5, 6, 7, 8]
    # batch: r0 0 -> 6 (pages 3, 4) and r1 5 -> 11 (last_loc 8: 9, 10, 11, then page 5)
    out = alloc.alloc_extend(_a(0, 5), _a(6, 11), _a(-1, 8))
    assert out.tolist() == [12, 13, 14, 15, 16, 17, 9, 10, 11, 20, 21, 22]
    assert alloc.free_pages.tolist()[:2] == [6, 7]
    # decode to 7 and 12: no new page
    assert alloc.alloc_decode(_a(7, 12), _a(17, 22)).tolist() == [18, 23]
    # decode to 9 with last_loc 19: a new page (6)
    assert alloc.alloc_decode(_a(9), _a(19)).tolist() == [24]
    assert alloc.free_pages.tolist()[0] == 7


def test_paged_free_dedups_sorts_and_prepends() -> None:
    alloc = PagedTokenToKVPoolAllocator(32, 4)  # pages 1..8
    alloc.alloc(16)  # pages 1..4
    # slots of pages 3 and 2, page 3 twice -> unique ascending [2 3] prepended
    alloc.free(_a(13, 12, 9, 14))
    assert alloc.free_pages.tolist() == [2, 3, 5, 6, 7, 8]
    assert alloc.available_size() == 24
    # LIFO: the freed pages come back first
    assert alloc.alloc(8).tolist() == [8, 9, 10, 11, 12, 13, 14, 15]


def test_paged_free_segment_keeps_row_order() -> None:
    alloc = PagedTokenToKVPoolAllocator(64, 4)
    alloc.alloc(64)  # every page
    # a row segment starting at position 8 over pages 9 then 4 (partially used)
    segment = _a(36, 37, 38, 39, 16, 17)
    alloc.free_segment(segment, start_pos=8)
    # free_pages [9 4]
    assert alloc.free_pages.tolist() == [9, 4]
    with pytest.raises(ValueError):
        alloc.free_segment(_a(20), start_pos=2)


def test_paged_free_group_order() -> None:
    """In a group, free() calls are applied first (unique, prepended), then the page-id
    frees as one block in call order in front of them."""
    alloc = PagedTokenToKVPoolAllocator(64, 4)
    alloc.alloc(64)
    alloc.free_group_begin()
    alloc.free_segment(_a(20, 21, 22, 23), start_pos=0)  # page 5
    alloc.free(_a(45))  # page 11
    alloc.free_segment(_a(8, 9, 10, 11, 28), start_pos=4)  # pages 2, 7
    assert alloc.available_size() == 0
    alloc.free_group_end()
    # free_pages [5 2 7 11]
    assert alloc.free_pages.tolist() == [5, 2, 7, 11]


def test_paged_need_sort_stages_and_merges_on_upper_bound() -> None:
    alloc = PagedTokenToKVPoolAllocator(40, 4, need_sort=True)  # pages 1..10
    alloc.alloc(32)  # pages 1..8
    alloc.free(_a(20, 4))  # pages 1, 5 staged
    assert alloc.free_pages.tolist() == [9, 10]
    assert alloc.available_size() == 16
    # one token: upper bound 1 // 4 + 1 + 1 = 2 <= 2 free pages -> no merge
    assert alloc.alloc_extend(_a(0), _a(1), _a(-1)).tolist() == [36]
    assert alloc.staged_pages and alloc.free_pages.tolist() == [10]
    # upper bound 2 > 1 -> merge and sort: [1 5 10]
    assert alloc.alloc_extend(_a(0), _a(3), _a(-1)).tolist() == [4, 5, 6]
    assert alloc.free_pages.tolist() == [5, 10]
    assert alloc.alloc_extend(_a(0), _a(12), _a(-1)) is None
    assert alloc.available_size() == 8


def test_paged_alloc_all_or_nothing() -> None:
    alloc = PagedTokenToKVPoolAllocator(16, 4)  # pages 1..4
    assert alloc.alloc_extend(_a(0, 0), _a(8, 9), _a(-1, -1)) is None
    assert alloc.free_pages.tolist() == [1, 2, 3, 4]
    assert alloc.alloc_decode(_a(1, 1, 1, 1, 1), _a(-1, -1, -1, -1, -1)) is None
    assert alloc.available_size() == 16


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_layout_matches_plain_torch_reference(page_size: int) -> None:
    rng = np.random.default_rng(page_size)
    for _ in range(50):
        bs = int(rng.integers(1, 9))
        prefix = rng.integers(0, 70, bs)
        seq = prefix + rng.integers(0, 70, bs)
        # last_loc must sit on the slot of position prefix-1 (alignment), from pages 100+
        last_loc = np.where(prefix > 0, (100 + np.arange(bs)) * page_size + (prefix - 1) % page_size, -1)
        need = num_new_pages(prefix, seq, page_size)
        pages = rng.permutation(np.arange(200, 200 + need + 5))[:need].astype(np.int64)
        ours = alloc_extend_layout(prefix, seq, last_loc, pages, page_size)
        theirs = reference.alloc_extend(
            torch.from_numpy(prefix), torch.from_numpy(seq), torch.from_numpy(last_loc),
            torch.from_numpy(pages), page_size,
        )
        assert ours.tolist() == theirs.tolist()


# ------------------------------------------------------------------ HiSparse


def test_hisparse_pair_maps_and_frees_both_sides() -> None:
    alloc = HiSparseTokenToKVPoolAllocator(32, 4, host_to_device_ratio=2)  # logical pages 1..16, device 1..8
    assert alloc.available_size() == 32  # min(64, 32)
    logical = alloc.alloc_extend(_a(0), _a(6), _a(-1))
    assert logical.tolist() == [4, 5, 6, 7, 8, 9]
    mapping = alloc.full_to_hisparse_device_index_mapping
    assert mapping[logical].tolist() == [4, 5, 6, 7, 8, 9]
    # logical only: no device pages, mapping stays 0
    only = alloc.alloc_logical_only(_a(6), _a(10), _a(9))
    assert only.tolist() == [10, 11, 12, 13]
    assert mapping[only].tolist() == [0, 0, 0, 0]
    assert alloc.logical_attn_allocator.available_size() == 64 - 12
    assert alloc.hisparse_attn_allocator.available_size() == 32 - 8
    alloc.free(np.concatenate([logical, only]))
    assert alloc.logical_attn_allocator.available_size() == 64
    assert alloc.hisparse_attn_allocator.available_size() == 32
    assert not mapping[:-1].any() and mapping[-1] == -1


def test_hisparse_extend_refuses_when_device_side_short() -> None:
    alloc = HiSparseTokenToKVPoolAllocator(8, 4, host_to_device_ratio=4)  # device pages 1..2
    assert alloc.alloc_extend(_a(0), _a(12), _a(-1)) is None
    assert alloc.logical_attn_allocator.available_size() == 32
