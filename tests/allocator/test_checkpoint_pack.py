"""Checkpoints store a paged allocator's rows as one slot per page, exactly."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from allocator.check.checkpoint import pack_slots, unpack_slots


@settings(max_examples=200, deadline=None)
@given(
    page_size=st.sampled_from([1, 4, 16, 64]),
    lens=st.lists(st.integers(0, 300), min_size=0, max_size=8),
    seed=st.integers(0, 2**16),
    break_one=st.booleans(),
)
def test_rows_pack_by_pages_and_unpack_exactly(page_size: int, lens: list[int], seed: int, break_one: bool) -> None:
    rng = np.random.default_rng(seed)
    row_lens = np.array(lens, np.int64)
    pages = [rng.permutation(10_000)[: -(-n // page_size)] for n in lens]
    slots = [
        (p[np.arange(n) // page_size] * page_size + np.arange(n) % page_size).astype(np.int32)
        for p, n in zip(pages, lens)
    ]
    row_slots = np.concatenate(slots) if slots else np.zeros(0, np.int32)
    if break_one and row_slots.shape[0]:
        row_slots[int(rng.integers(row_slots.shape[0]))] += 1  # a slot outside its page's run
    stored, unit = pack_slots(row_slots, row_lens, page_size)
    assert np.array_equal(unpack_slots(stored, row_lens, unit), row_slots)
    if page_size > 1 and not break_one and row_slots.shape[0]:
        assert unit == page_size and stored.shape[0] == sum(-(-n // page_size) for n in lens)
