"""The small-batch reductions (``allocator.reduce``) give numpy's results."""

from __future__ import annotations

import numpy as np
import pytest

from allocator.reduce import SMALL, any_true, imax, imin, isum


@pytest.mark.parametrize("n", [1, 2, 30, SMALL, SMALL + 1, 1000])
def test_reductions_match_numpy(n: int) -> None:
    rng = np.random.default_rng(n)
    a = rng.integers(-(1 << 40), 1 << 40, n, dtype=np.int64)
    assert (imin(a), imax(a), isum(a)) == (int(a.min()), int(a.max()), int(a.sum()))
    assert all(type(x) is int for x in (imin(a), imax(a), isum(a)))
    mask = a > 0
    assert any_true(mask) == bool(mask.any())
    assert any_true(np.zeros(n, np.bool_)) is False


def test_empty_arrays_sum_to_zero_and_have_no_minimum() -> None:
    empty = np.zeros(0, np.int64)
    assert isum(empty) == 0
    with pytest.raises(ValueError):
        imin(empty)
