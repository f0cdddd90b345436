"""Runs of whole steps, column-wise: what ``TraceReader.chunks`` yields (``StepChunk``)
and how consecutive record batches' rows (``BatchColumns``) are gathered into them.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from traces.batches import Ragged, StepBatch
from traces.ipc import ResumePoint

class BatchColumns(NamedTuple):
    """One record batch as numpy columns (optional ones filled with defaults)."""

    step: np.ndarray
    time_s: np.ndarray
    op: np.ndarray
    rid: np.ndarray
    seq_len: np.ndarray
    append_len: np.ndarray
    draft_len: np.ndarray
    accepted_len: np.ndarray
    prefix_len: np.ndarray
    prompt_len: np.ndarray
    block_hashes: Ragged
    token_ids: Ragged
    arrival_s: np.ndarray | None  # None: the file has no arrival_s column

    def step_batch(self, start: int, stop: int) -> StepBatch:
        return StepBatch(
            int(self.step[start]),
            float(self.time_s[start]),
            self.op[start:stop],
            self.rid[start:stop],
            self.seq_len[start:stop],
            self.append_len[start:stop],
            self.draft_len[start:stop],
            self.accepted_len[start:stop],
            self.prefix_len[start:stop],
            self.prompt_len[start:stop],
            self.block_hashes.slice(start, stop),
            self.token_ids.slice(start, stop),
            None if self.arrival_s is None else self.arrival_s[start:stop],
        )


def _merge_steps(first: StepBatch, second: StepBatch) -> StepBatch:
    def cat(name: str) -> np.ndarray:
        return np.concatenate([getattr(first, name), getattr(second, name)])

    def cat_arrivals() -> np.ndarray:
        return np.concatenate([first.arrivals(), second.arrivals()])

    return StepBatch(
        first.step,
        first.time_s,
        cat("op"),
        cat("rid"),
        cat("seq_len"),
        cat("append_len"),
        cat("draft_len"),
        cat("accepted_len"),
        cat("prefix_len"),
        cat("prompt_len"),
        Ragged.concat([first.block_hashes, second.block_hashes]),
        Ragged.concat([first.token_ids, second.token_ids]),
        None if first.arrival_s is None and second.arrival_s is None else cat_arrivals(),
    )


class StepChunk(NamedTuple):
    """Whole consecutive steps of a trace, column-wise (``TraceReader.chunks``): step ``i``
    is rows ``[starts[i], stops[i])`` of ``columns``. ``position`` is where to resume
    reading to get its steps again (the record batch holding its first row)."""

    columns: BatchColumns
    starts: np.ndarray  # int64 [num_steps]
    stops: np.ndarray  # int64 [num_steps]
    position: ResumePoint | None

    @property
    def num_steps(self) -> int:
        return int(self.starts.shape[0])

    @property
    def last_step(self) -> int:
        return int(self.columns.step[self.starts[-1]])

    def step_numbers(self) -> np.ndarray:
        """int64 [num_steps] the step number of each step."""
        return self.columns.step[self.starts]

    def step_batch(self, i: int) -> StepBatch:
        """Step ``i`` as a ``StepBatch``."""
        return self.columns.step_batch(int(self.starts[i]), int(self.stops[i]))

    def window(self, start: int | None, stop: int | None) -> StepChunk | None:
        """The steps within ``[start, stop)`` (None when none is)."""
        if start is None and stop is None:
            return self
        steps = self.step_numbers()
        keep = np.ones(steps.shape[0], np.bool_)
        if start is not None:
            keep &= steps >= start
        if stop is not None:
            keep &= steps < stop
        if not keep.any():
            return None
        if keep.all():
            return self
        return StepChunk(self.columns, self.starts[keep], self.stops[keep], self.position)


# Steps gathered into one chunk (record batches are concatenated until they hold as many).
CHUNK_STEPS = 256


def _concat_columns(parts: list[BatchColumns]) -> BatchColumns:
    if len(parts) == 1:
        return parts[0]
    return BatchColumns(
        *(
            _concat_arrivals(parts)
            if name == "arrival_s"
            else Ragged.concat([getattr(p, name) for p in parts])
            if isinstance(getattr(parts[0], name), Ragged)
            else np.concatenate([getattr(p, name) for p in parts])
            for name in BatchColumns._fields
        )
    )


def _concat_arrivals(parts: list[BatchColumns]) -> np.ndarray | None:
    """The parts' arrival times (NaN where a part has none), or None when none has any."""
    if all(p.arrival_s is None for p in parts):
        return None
    return np.concatenate(
        [np.full(p.op.shape[0], np.nan) if p.arrival_s is None else p.arrival_s for p in parts]
    )


def _columns_slice(columns: BatchColumns, start: int, stop: int) -> BatchColumns:
    return BatchColumns(
        *(
            value if value is None else value.slice(start, stop) if isinstance(value, Ragged) else value[start:stop]
            for value in columns
        )
    )


def chunk_of(
    blocks: list[tuple[BatchColumns, ResumePoint | None]], keep_last: bool
) -> tuple[StepChunk | None, list[tuple[BatchColumns, ResumePoint | None]]]:
    """The steps of ``blocks`` (consecutive record batches' rows) as one chunk, and, with
    ``keep_last``, the last step's rows held back as the next blocks (it may continue)."""
    columns = _concat_columns([b for b, _ in blocks])
    n = columns.step.shape[0]
    bounds = np.flatnonzero(columns.step[1:] != columns.step[:-1]) + 1
    starts = np.concatenate(([0], bounds)).astype(np.int64)
    stops = np.concatenate((bounds, [n])).astype(np.int64)
    position = blocks[0][1]
    if not keep_last:
        return StepChunk(columns, starts, stops, position), []
    last = int(starts[-1])
    # the held-back step resumes at the batch holding its first row
    ends = np.cumsum([b.step.shape[0] for b, _ in blocks])
    held_at = blocks[int(np.searchsorted(ends, last, side="right"))][1]
    rest = [(_columns_slice(columns, last, n), held_at)]
    if starts.shape[0] == 1:
        return None, rest
    return StepChunk(columns, starts[:-1], stops[:-1], position), rest
