"""One op kind's rows of the step a ``Recorder`` is gathering, and the coercion of what an
engine passes (lists, arrays or one scalar for every row) into its columns."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

import numpy as np

IdsLike = Sequence[Hashable] | np.ndarray
IntsLike = Sequence[int] | np.ndarray | int
FloatsLike = Sequence[float] | np.ndarray | float



class Part(NamedTuple):
    """One op kind's rows within the current step (columns as numpy arrays)."""

    ids: np.ndarray  # int64 dense ids
    seq_len: np.ndarray  # int64
    draft_len: np.ndarray | None  # int32 (spec)
    accepted_len: np.ndarray | None  # int32 (spec)
    prefix_len: np.ndarray | None  # int64
    prompt_len: np.ndarray | None  # int64, -1 = null
    block_hashes: Sequence[np.ndarray | None] | None
    token_ids: Sequence[np.ndarray | None] | None
    arrival_s: np.ndarray | None = None  # float64, NaN = unknown


def floats(values: FloatsLike, n: int, name: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim == 0:
        arr = np.full(n, arr)
    if arr.shape != (n,):
        raise ValueError(f"{name} has {arr.shape[0] if arr.ndim else 1} values for {n} requests")
    return arr


def ints(values: IntsLike, n: int, name: str, dtype: type = np.int64) -> np.ndarray:
    arr = np.asarray(values, dtype=dtype)
    if arr.ndim == 0:
        arr = np.full(n, arr, dtype=dtype)
    if arr.shape != (n,):
        raise ValueError(f"{name} has {arr.shape[0] if arr.ndim else 1} values for {n} requests")
    return arr
