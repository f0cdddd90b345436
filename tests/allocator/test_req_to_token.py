"""ReqToTokenPool: padding row, LIFO row reuse from the end, table shape and sizing."""

from __future__ import annotations

import pytest
import torch

from allocator.base import AllocatorConfig, SpecConfig
from allocator.req_to_token import ReqToTokenPool
from allocator.sizing import alloc_len_per_decode, req_to_token_width, reserve_per_decode, row_extra_len


def test_table_has_padding_row_and_int32() -> None:
    pool = ReqToTokenPool(size=4, max_context_len=10)
    assert pool.req_to_token.shape == (5, 10)
    assert pool.req_to_token.dtype == torch.int32
    assert pool.free_slots == [1, 2, 3, 4]
    assert pool.available_size() == 4


def test_rows_are_taken_from_the_end_and_reused_lifo() -> None:
    pool = ReqToTokenPool(size=4, max_context_len=8)
    # free_slots [1 2 3 4] -> take the last two, in batch order
    assert pool.alloc(2) == [3, 4]
    assert pool.free_slots == [1, 2]
    pool.free(3)
    # free_slots [1 2 3]: the row just freed is the next one handed out
    assert pool.free_slots == [1, 2, 3]
    assert pool.alloc(1) == [3]
    pool.free(4)
    pool.free(3)
    # free_slots [1 2 4 3] -> alloc(2) gives [4, 3]
    assert pool.alloc(2) == [4, 3]
    assert pool.alloc(0) == []
    assert pool.alloc(3) is None
    assert pool.free_slots == [1, 2]


def test_unalloc_restores_free_slots_exactly() -> None:
    pool = ReqToTokenPool(size=5, max_context_len=4)
    pool.free_rows(pool.alloc(5)[::-1])  # a shuffled order
    before = list(pool.free_slots)
    rows = pool.alloc(3)
    pool.unalloc(rows)
    assert pool.free_slots == before


@pytest.mark.parametrize(
    ("spec", "page_size", "per_decode", "reserve", "extra"),
    [
        (None, 1, 1, 0, 4),
        (None, 64, 1, 0, 4),
        (SpecConfig("eagle", 3, 1, 4), 1, 4, 8, 8),
        (SpecConfig("eagle", 3, 1, 4), 16, 4, 8, 8 + 15),
        (SpecConfig("eagle", 5, 4, 8), 1, 20, 40, 12),
        # page > 1, topk > 1 (#26972): ceil((64 - 1 + 5) / 64) * 64 * 4 = 512 per decode
        (SpecConfig("eagle", 5, 4, 8), 64, 512, 1024, 1024 + 63),
        (SpecConfig("dflash", 3, 1, 16), 1, 16, 32, 20),
        (SpecConfig("uno", 3, 1, 4), 1, 5, 10, max(8, 10)),
        (SpecConfig("standalone", 3, 1, 4), 16, 4, 8, 23),
    ],
)
def test_sizing_matches_sglang_formulas(spec, page_size, per_decode, reserve, extra) -> None:
    assert alloc_len_per_decode(spec, page_size) == per_decode
    assert reserve_per_decode(spec, page_size) == reserve
    assert row_extra_len(spec, page_size) == extra
    config = AllocatorConfig(pool_tokens=1024, page_size=page_size, max_context_len=100, spec=spec)
    assert req_to_token_width(config) == 100 + extra
