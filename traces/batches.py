"""A trace's rows in memory: ``StepBatch`` (the ops of one scheduler step, columnar: what
the reader yields and the writer takes) and ``Ragged`` (a list column as numpy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import numpy as np

from traces.schema import OP_CODE, OP_RANK, OPS


class Ragged(NamedTuple):
    """A list column as numpy: row ``i`` is ``values[offsets[i]:offsets[i+1]]`` where ``valid[i]``.

    A null row (``valid[i]`` False) has an empty slice. ``offsets[0] == 0`` and
    ``offsets[-1] == len(values)``: ``values`` is exactly the rows, concatenated.
    """

    offsets: np.ndarray  # int64 [n+1]
    values: np.ndarray  # [offsets[-1]] uint64 (block_hashes) or int64 (token_ids)
    valid: np.ndarray  # bool [n]

    @property
    def num_rows(self) -> int:
        return int(self.valid.shape[0])

    @property
    def lengths(self) -> np.ndarray:
        """int64 [n]: the length of each row (0 for a null row)."""
        return np.diff(self.offsets)

    def row(self, i: int) -> np.ndarray | None:
        if not self.valid[i]:
            return None
        return self.values[self.offsets[i] : self.offsets[i + 1]]

    def rows(self) -> list[np.ndarray | None]:
        """Every row as its own array (None for a null row); for tests and slow paths."""
        return [self.row(i) for i in range(self.num_rows)]

    @classmethod
    def empty(cls, n: int, dtype: np.dtype | type = np.int64) -> Ragged:
        return cls(np.zeros(n + 1, np.int64), np.zeros(0, dtype), np.zeros(n, np.bool_))

    @classmethod
    def from_rows(cls, rows: Sequence[Any], dtype: np.dtype | type) -> Ragged:
        """Build from one array-like (or None for a null row) per row.

        Raises:
            ValueError: a row is not one-dimensional.
        """
        n = len(rows)
        valid = np.fromiter((r is not None for r in rows), np.bool_, count=n)
        if not valid.any():
            return cls.empty(n, dtype)
        parts = [np.asarray(r, dtype=dtype) for r in rows if r is not None]
        for part in parts:
            if part.ndim != 1:
                raise ValueError(f"a list row must be one-dimensional, found shape {part.shape}")
        lengths = np.zeros(n, np.int64)
        lengths[valid] = [p.shape[0] for p in parts]
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return cls(offsets, np.concatenate(parts), valid)

    @classmethod
    def coerce(cls, data: Any, n: int, dtype: np.dtype | type, name: str = "list column") -> Ragged:
        """``data`` as a Ragged of ``n`` rows: None (all null), a Ragged, or one row per entry.

        Raises:
            ValueError: the row count is not ``n`` or the Ragged is malformed.
        """
        if data is None:
            return cls.empty(n, dtype)
        if isinstance(data, Ragged):
            offsets = np.asarray(data.offsets, np.int64)
            valid = np.asarray(data.valid, np.bool_)
            values = np.asarray(data.values, dtype)
            if valid.shape != (n,) or offsets.shape != (n + 1,):
                raise ValueError(f"{name}: Ragged has {valid.shape[0]} rows, expected {n}")
            if offsets[0] != 0 or offsets[-1] != values.shape[0] or np.any(np.diff(offsets) < 0):
                raise ValueError(f"{name}: Ragged offsets must rise from 0 to len(values)")
            if np.any(offsets[1:][~valid] != offsets[:-1][~valid]):
                raise ValueError(f"{name}: a null row of a Ragged must be empty")
            return cls(offsets, values, valid)
        if len(data) != n:
            raise ValueError(f"{name}: {len(data)} rows, expected {n}")
        return cls.from_rows(data, dtype)

    def take(self, indices: np.ndarray) -> Ragged:
        """The rows at ``indices`` (a permutation or subset), vectorised."""
        lengths = self.lengths[indices]
        offsets = np.zeros(lengths.shape[0] + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        total = int(offsets[-1])
        if total == 0:
            values = self.values[:0]
        else:
            # Position j of the output comes from starts[row(j)] + (j - offsets[row(j)]).
            shift = np.repeat(self.offsets[:-1][indices] - offsets[:-1], lengths)
            values = self.values[np.arange(total, dtype=np.int64) + shift]
        return Ragged(offsets, values, self.valid[indices])

    def slice(self, start: int, stop: int) -> Ragged:
        """Rows ``[start, stop)``; ``values`` is a view."""
        base = self.offsets[start]
        return Ragged(
            self.offsets[start : stop + 1] - base,
            self.values[base : self.offsets[stop]],
            self.valid[start:stop],
        )

    @classmethod
    def concat(cls, parts: Sequence[Ragged]) -> Ragged:
        """The rows of ``parts``, one after the other."""
        if len(parts) == 1:
            return parts[0]
        valid = np.concatenate([p.valid for p in parts])
        sizes = [p.values.shape[0] for p in parts]
        if not any(sizes):
            return cls(np.zeros(valid.shape[0] + 1, np.int64), parts[0].values, valid)
        offsets = np.empty(valid.shape[0] + 1, np.int64)
        offsets[0] = 0
        row, shift = 1, 0
        for part, size in zip(parts, sizes):
            rows = part.valid.shape[0]
            np.add(part.offsets[1:], shift, out=offsets[row : row + rows])
            row += rows
            shift += size
        return cls(offsets, np.concatenate([p.values for p, size in zip(parts, sizes) if size]), valid)

    def equals(self, other: Ragged) -> bool:
        """Same rows, same nulls, same values (dtype aside)."""
        return (
            np.array_equal(self.valid, other.valid)
            and np.array_equal(self.offsets, other.offsets)
            and np.array_equal(self.values, other.values)
        )


def _int_column(data: Any, n: int, dtype: type, name: str, default: int = 0) -> np.ndarray:
    if data is None:
        return np.full(n, default, dtype) if default else np.zeros(n, dtype)
    out = np.asarray(data)
    if out.ndim == 0:
        return np.full(n, out, dtype)
    if out.shape != (n,):
        raise ValueError(f"column '{name}' has shape {out.shape}, expected ({n},)")
    if out.dtype != dtype:
        if out.size == 0:
            return np.zeros(0, dtype)
        if out.dtype.kind not in "iub":
            raise ValueError(f"column '{name}' must hold integers, found dtype {out.dtype}")
        out = out.astype(dtype)
    return out


def op_codes(op: Any, n: int | None = None) -> np.ndarray:
    """``op`` as int8 op codes: codes (any integer array-like) or op names.

    Raises:
        ValueError: an unknown op name or code (the message lists the valid ones).
    """
    arr = np.asarray(op)
    if n is not None and arr.shape != (n,):
        raise ValueError(f"column 'op' has shape {arr.shape}, expected ({n},)")
    if arr.dtype.kind in "iu":
        codes = arr.astype(np.int8, copy=False)
        if codes.size and (int(arr.min()) < 0 or int(arr.max()) >= len(OPS)):
            raise ValueError(f"op codes must lie in [0, {len(OPS)}) (OPS = {OPS})")
        return codes
    if arr.size == 0:
        return np.zeros(0, np.int8)
    names, inverse = np.unique(arr.astype(str), return_inverse=True)
    unknown = [str(x) for x in names if x not in OP_CODE]
    if unknown:
        raise ValueError(f"unknown op {unknown[0]!r}; valid ops: {', '.join(OPS)}")
    lut = np.array([OP_CODE[str(x)] for x in names], np.int8)
    return lut[inverse.reshape(arr.shape)]


_OP_RANK_ARRAY = np.array(OP_RANK, np.int8)


@dataclass(frozen=True, slots=True)
class StepBatch:
    """The ops of one scheduler step, columnar (what ``TraceReader.steps()`` yields and
    ``TraceWriter.write(batch)`` takes). Rows are in ``OP_ORDER``.

    ``prompt_len`` is -1 where the column is null, ``arrival_s`` NaN (or the whole
    column None). Optional columns absent from a file read as zeros / nulls. Arrays
    a reader yields are read-only views.
    """

    step: int
    time_s: float
    op: np.ndarray  # int8 [n] op codes (index into OPS)
    rid: np.ndarray  # int64 [n]
    seq_len: np.ndarray  # int64 [n]
    append_len: np.ndarray  # int32 [n]
    draft_len: np.ndarray  # int32 [n]
    accepted_len: np.ndarray  # int32 [n]
    prefix_len: np.ndarray  # int64 [n]
    prompt_len: np.ndarray  # int64 [n], -1 = null
    block_hashes: Ragged  # uint64 values
    token_ids: Ragged  # int64 values
    arrival_s: np.ndarray | None = None  # float64 [n], NaN = null; None: no row has one

    def __len__(self) -> int:
        return int(self.op.shape[0])

    def rows_of(self, op_code: int) -> np.ndarray:
        """Indices of this step's rows with the given op code (in row order)."""
        return np.flatnonzero(self.op == op_code)

    @classmethod
    def from_columns(
        cls,
        step: int,
        time_s: float,
        *,
        op: Any,
        rid: Any,
        seq_len: Any,
        append_len: Any,
        draft_len: Any = None,
        accepted_len: Any = None,
        prefix_len: Any = None,
        prompt_len: Any = None,
        block_hashes: Any = None,
        token_ids: Any = None,
        arrival_s: Any = None,
        sort: bool = True,
    ) -> StepBatch:
        """Build a step from array-likes, one entry per row, and put its rows in ``OP_ORDER``.

        Args:
            step, time_s: the scheduler step and its start time (seconds).
            op: int8 op codes or op names.
            rid, seq_len, append_len: required columns.
            draft_len, accepted_len, prefix_len: optional (None: zeros; a scalar: every row).
            prompt_len: None (all null), or ints where a negative value or None is null.
            block_hashes, token_ids: None, a ``Ragged``, or one array-like or None per row.
            arrival_s: None (all null), or floats where NaN or None is null.
            sort: stable-sort the rows into ``OP_ORDER`` (off: keep the order given).

        Raises:
            ValueError: a column's length or type does not fit, or an unknown op.
        """
        rid_arr = np.asarray(rid)
        if rid_arr.ndim != 1:
            raise ValueError(f"column 'rid' must be one-dimensional, found shape {rid_arr.shape}")
        n = rid_arr.shape[0]
        rid_arr = _int_column(rid_arr, n, np.int64, "rid")
        if prompt_len is None:
            prompt = np.full(n, -1, np.int64)
        else:
            raw = np.asarray(prompt_len, dtype=object if _has_none(prompt_len) else None)
            if raw.dtype == object:
                raw = np.array([-1 if v is None else v for v in raw.reshape(-1)], np.int64)
            prompt = _int_column(raw, n, np.int64, "prompt_len")
            if np.any(prompt < -1):
                prompt = np.where(prompt < 0, -1, prompt)
        batch = cls(
            step=int(step),
            time_s=float(time_s),
            op=op_codes(op, n),
            rid=rid_arr,
            seq_len=_int_column(seq_len, n, np.int64, "seq_len"),
            append_len=_int_column(append_len, n, np.int32, "append_len"),
            draft_len=_int_column(draft_len, n, np.int32, "draft_len"),
            accepted_len=_int_column(accepted_len, n, np.int32, "accepted_len"),
            prefix_len=_int_column(prefix_len, n, np.int64, "prefix_len"),
            prompt_len=prompt,
            block_hashes=Ragged.coerce(block_hashes, n, np.uint64, "block_hashes"),
            token_ids=Ragged.coerce(token_ids, n, np.int64, "token_ids"),
            arrival_s=None if arrival_s is None else _float_column(arrival_s, n, "arrival_s"),
        )
        return batch.in_op_order() if sort else batch

    def take(self, indices: np.ndarray) -> StepBatch:
        """The rows at ``indices``, in that order."""
        return StepBatch(
            self.step,
            self.time_s,
            self.op[indices],
            self.rid[indices],
            self.seq_len[indices],
            self.append_len[indices],
            self.draft_len[indices],
            self.accepted_len[indices],
            self.prefix_len[indices],
            self.prompt_len[indices],
            self.block_hashes.take(indices),
            self.token_ids.take(indices),
            None if self.arrival_s is None else self.arrival_s[indices],
        )

    def is_op_ordered(self) -> bool:
        """Whether the rows are in ``OP_ORDER``."""
        if self.op.shape[0] < 2:
            return True
        rank = _OP_RANK_ARRAY[self.op]
        return bool((rank[:-1] <= rank[1:]).all())

    def in_op_order(self) -> StepBatch:
        """This step with its rows stably sorted into ``OP_ORDER`` (itself when already so)."""
        if self.is_op_ordered():
            return self
        return self.take(np.argsort(_OP_RANK_ARRAY[self.op], kind="stable"))

    def equals(self, other: StepBatch) -> bool:
        """Same step, time and rows, token content included."""
        return (
            self.step == other.step
            and self.time_s == other.time_s
            and all(
                np.array_equal(getattr(self, name), getattr(other, name))
                for name in (
                    "op", "rid", "seq_len", "append_len", "draft_len",
                    "accepted_len", "prefix_len", "prompt_len",
                )
            )
            and self.block_hashes.equals(other.block_hashes)
            and self.token_ids.equals(other.token_ids)
            and np.array_equal(self.arrivals(), other.arrivals(), equal_nan=True)
        )

    def arrivals(self) -> np.ndarray:
        """float64 [n]: ``arrival_s`` with NaN where a row has none (all NaN when None)."""
        if self.arrival_s is None:
            return np.full(len(self), np.nan)
        return self.arrival_s


def _float_column(data: Any, n: int, name: str) -> np.ndarray:
    raw = np.asarray(data, dtype=object if _has_none(data) else None)
    if raw.dtype == object:
        raw = np.array([np.nan if v is None else v for v in raw.reshape(-1)], np.float64)
    if raw.ndim == 0:
        return np.full(n, raw, np.float64)
    if raw.shape != (n,):
        raise ValueError(f"column '{name}' has shape {raw.shape}, expected ({n},)")
    if raw.size and raw.dtype.kind not in "fiub":
        raise ValueError(f"column '{name}' must hold numbers, found dtype {raw.dtype}")
    return raw.astype(np.float64, copy=False)


def _has_none(data: Any) -> bool:
    return isinstance(data, (list, tuple)) and any(v is None for v in data)
