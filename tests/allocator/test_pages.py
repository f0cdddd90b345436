"""Page arithmetic (allocator.pages): exact on ints, numpy arrays and torch tensors alike."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from allocator.pages import ceil_align, floor_align, new_page_tokens, num_new_pages, num_pages

page_sizes = st.sampled_from([1, 2, 4, 16, 64, 128])
lengths = st.integers(min_value=0, max_value=2**40)


def test_table_of_the_docstring() -> None:
    # page size 4: lengths 0..9
    assert [num_pages(n, 4) for n in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]
    assert [ceil_align(n, 4) for n in range(10)] == [0, 4, 4, 4, 4, 8, 8, 8, 8, 12]
    assert [floor_align(n, 4) for n in range(10)] == [0, 0, 0, 0, 4, 4, 4, 4, 8, 8]


@given(lengths, page_sizes)
def test_ints_are_the_exact_roundings(length: int, page_size: int) -> None:
    pages = num_pages(length, page_size)
    # the fewest pages that hold length positions
    assert pages * page_size >= length and (pages == 0 or (pages - 1) * page_size < length)
    assert ceil_align(length, page_size) == pages * page_size
    assert floor_align(length, page_size) == length - length % page_size
    assert isinstance(pages, int) and isinstance(ceil_align(length, page_size), int)


@given(st.lists(st.tuples(lengths, lengths), min_size=0, max_size=16), page_sizes)
def test_arrays_and_tensors_match_the_ints(pairs: list[tuple[int, int]], page_size: int) -> None:
    prefix = [min(a, b) for a, b in pairs]
    seq = [max(a, b) for a, b in pairs]
    prefix_np = np.array(prefix, dtype=np.int64)
    seq_np = np.array(seq, dtype=np.int64)
    for fn in (num_pages, ceil_align, floor_align):
        want = [fn(n, page_size) for n in seq]
        got_np = fn(seq_np, page_size)
        assert got_np.dtype == np.int64 and got_np.tolist() == want
        assert fn(torch.tensor(seq, dtype=torch.int64), page_size).tolist() == want
    tokens = new_page_tokens(prefix_np, seq_np, page_size)
    assert tokens.tolist() == [ceil_align(s, page_size) - ceil_align(p, page_size) for p, s in zip(prefix, seq)]
    assert num_new_pages(prefix_np, seq_np, page_size) * page_size == int(tokens.sum())
    if page_size == 1:
        assert tokens.tolist() == [s - p for p, s in zip(prefix, seq)]
