"""Runs of plain decode steps: the fast path of decode-heavy traffic.

A *plain* step holds rows of one op kind only, ``decode`` or ``spec``, and no
explicit token ids. A *run* is consecutive plain steps of one kind over the same
batch: the same requests in the same order, each longer by what it appends (one
token, or its accepted tokens). What a run does to an allocator is fully determined
by its state at the start of the run and the accepted counts, so the engine applies
it in one call (``allocator.base.DecodeRuns``) and builds the run's snapshots from
vectors; each step is still snapshotted. The op-sequence checker checks a run of
plain steps at once too (``traces.checker.OpSequenceChecker.check_run``).

``run_lengths(chunk)`` finds them column-wise, for a whole ``StepChunk`` at once::

    step        k:  s0   s1   s2   s3   s4
    plain          yes  yes  yes  no   yes
    same batch      -   yes  yes   -    -
    run_lengths     3    2    1    0    1
"""

from __future__ import annotations

import numpy as np

from traces.chunks import StepChunk
from traces.schema import DECODE, SPEC

__all__ = ["run_lengths"]


def run_lengths(chunk: StepChunk, op: int = DECODE) -> np.ndarray:
    """int64 [num_steps]: how many plain steps of ``op`` (``DECODE`` or ``SPEC``) over one
    batch start at each step (the step itself included; 0 for a step that is not)."""
    cols = chunk.columns
    starts, stops = chunk.starts, chunk.stops
    k = starts.shape[0]
    sizes = stops - starts
    # Rows of the chunk's steps only (a chunk may leave rows of its batch out).
    row_step = np.repeat(np.arange(k), sizes)
    rows = np.repeat(starts, sizes) + (np.arange(row_step.shape[0]) - np.repeat(np.cumsum(sizes) - sizes, sizes))
    not_plain = (cols.op[rows] != op) | cols.token_ids.valid[rows]
    plain = (sizes > 0) & (np.bincount(row_step, weights=not_plain, minlength=k) == 0)
    grows = cols.accepted_len[rows].astype(np.int64) if op == SPEC else 1
    # continues[s]: step s decodes the same requests as step s - 1, each one token on
    continues = np.zeros(k, np.bool_)
    if k > 1:
        same_size = np.zeros(k, np.bool_)
        same_size[1:] = (sizes[1:] == sizes[:-1]) & (starts[1:] == stops[:-1])
        follows = same_size[row_step]
        prev = np.where(follows, rows - sizes[row_step], rows)
        ok = follows & (cols.rid[rows] == cols.rid[prev]) & (cols.seq_len[rows] == cols.seq_len[prev] + grows)
        bad = np.bincount(row_step, weights=~ok, minlength=k)
        continues = same_size & (bad == 0) & plain
        continues[0] = False
        continues[1:] &= plain[:-1]
    # run_lengths[s] = (index of the run's last step) - s + 1, for plain steps
    breaks = np.flatnonzero(~continues)  # a run (or a lone step) starts at each
    run_id = np.cumsum(~continues) - 1
    ends = np.append(breaks[1:], k) - 1
    out = ends[run_id] - np.arange(k) + 1
    out[~plain] = 0
    return out.astype(np.int64)
