"""run_lengths: runs of plain decode / spec steps over one batch, found column-wise."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from traces.runs import run_lengths
from tests.helpers import make_meta, write_steps
from traces.batches import StepBatch
from traces.metadata import SpecSettings
from traces.reader import TraceReader
from traces.schema import DECODE, SPEC


def chunks_of(path: Path) -> np.ndarray:
    return np.concatenate([run_lengths(c, DECODE) for c in TraceReader(path).chunks()])


def test_runs_break_at_other_ops_new_batches_and_explicit_ids(tmp_path: Path) -> None:
    b = StepBatch.from_columns
    steps = [
        b(0, 0.0, op=["extend", "extend"], rid=[0, 1], seq_len=[8, 5], append_len=[8, 5], prompt_len=[8, 5]),
        b(1, 0.1, op=["decode", "decode"], rid=[0, 1], seq_len=[9, 6], append_len=[1, 1]),
        b(2, 0.2, op=["decode", "decode"], rid=[0, 1], seq_len=[10, 7], append_len=[1, 1]),
        b(3, 0.3, op=["decode", "decode"], rid=[0, 1], seq_len=[11, 8], append_len=[1, 1]),
        b(4, 0.4, op=["decode"], rid=[0], seq_len=[12], append_len=[1]),  # the batch shrank
        b(5, 0.5, op=["decode"], rid=[0], seq_len=[13], append_len=[1], token_ids=[[77]]),  # explicit id
        b(6, 0.6, op=["decode"], rid=[0], seq_len=[14], append_len=[1]),
        b(7, 0.7, op=["decode"], rid=[0], seq_len=[15], append_len=[1]),
    ]
    # one step per record batch (a live recording): the chunks still hold the runs
    path = write_steps(tmp_path / "runs.kvtrace", steps, meta=make_meta(page_size=1), steps_per_batch=1)
    #                    step:  0  1  2  3  4  5  6  7
    assert chunks_of(path).tolist() == [0, 3, 2, 1, 1, 0, 2, 1]


def test_spec_runs_follow_the_accepted_tokens(tmp_path: Path) -> None:
    b = StepBatch.from_columns
    steps = [
        b(0, 0.0, op=["extend"], rid=[0], seq_len=[8], append_len=[8], prompt_len=[8]),
        b(1, 0.1, op=["spec"], rid=[0], seq_len=[10], append_len=[2], draft_len=[4], accepted_len=[2]),
        b(2, 0.2, op=["spec"], rid=[0], seq_len=[11], append_len=[1], draft_len=[4], accepted_len=[1]),
        b(3, 0.3, op=["spec"], rid=[0], seq_len=[14], append_len=[3], draft_len=[4], accepted_len=[3]),
    ]
    meta = make_meta(page_size=1, spec=SpecSettings())
    path = write_steps(tmp_path / "spec.kvtrace", steps, meta=meta, steps_per_batch=100)
    lengths = np.concatenate([run_lengths(c, SPEC) for c in TraceReader(path).chunks()])
    assert lengths.tolist() == [0, 3, 2, 1]
    assert chunks_of(path).tolist() == [0, 0, 0, 0]  # no plain decode step
