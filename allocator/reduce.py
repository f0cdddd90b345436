"""Reductions over the few dozen rows of one step's batch, cheaper than numpy's own.

A numpy reduction (``a.sum()``, ``a.min()``, ``a.any()``) pays a fixed cost per call
that dwarfs its work on a batch of a few dozen rows, and one replay step makes dozens
of them. ``argmin`` / ``argmax`` and ``count_nonzero`` skip that machinery, and a
Python ``sum`` over ``tolist()`` is cheaper for a short array. The results are those
of the numpy reductions, as Python ints.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SMALL", "any_true", "imax", "imin", "isum"]

SMALL = 64  # up to this many values, isum adds them in Python


def imin(a: np.ndarray) -> int:
    """``int(a.min())`` of a non-empty 1-D integer array."""
    return int(a[a.argmin()])


def imax(a: np.ndarray) -> int:
    """``int(a.max())`` of a non-empty 1-D integer array."""
    return int(a[a.argmax()])


def isum(a: np.ndarray) -> int:
    """``int(a.sum())`` of a 1-D integer array."""
    return sum(a.tolist()) if a.shape[0] <= SMALL else int(a.sum())


def any_true(mask: np.ndarray) -> bool:
    """``bool(mask.any())``."""
    return bool(np.count_nonzero(mask))
