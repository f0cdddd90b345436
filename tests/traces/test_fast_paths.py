"""The op-sequence checker's fast paths (a plain step, a run of plain steps) find
exactly what its general path finds, on random traces with random damage."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from traces.batches import StepBatch
from traces.checker import OpSequenceChecker, Problem
from traces.reader import TraceReader
from traces.runs import run_lengths
from traces.schema import DECODE, SPEC
from traces.synth import generate
from traces.writer import TraceWriter

_COLUMNS = ("seq_len", "append_len", "draft_len", "accepted_len", "prefix_len", "prompt_len")


class _GeneralOnly(OpSequenceChecker):
    """Every step through the general path (the reference)."""

    def _plain_step(self, batch: StepBatch) -> bool:
        return False


def _damaged(batch: StepBatch, rng: np.random.Generator) -> StepBatch:
    name = _COLUMNS[int(rng.integers(len(_COLUMNS)))]
    values = getattr(batch, name).copy()
    row = int(rng.integers(len(batch)))
    values[row] = values[row] + int(rng.choice([-2, -1, 1, 2, 50, 100_000]))
    if name == "prompt_len":  # negative is null (-1) on disk
        values[row] = abs(int(values[row]))
    return dataclasses.replace(batch, **{name: values})


def _with_runs(reader: TraceReader) -> list[list[Problem]]:
    """What the background checker's loop finds: runs at once, other steps one by one."""
    checker = OpSequenceChecker(reader.meta, rid_bound=reader.rid_bound)
    out: list[list[Problem]] = []
    for chunk in reader.chunks():
        runs = np.maximum(run_lengths(chunk, DECODE), run_lengths(chunk, SPEC))
        i, k = 0, chunk.starts.shape[0]
        while i < k:
            m = int(runs[i])
            if m > 1 and checker.check_run(chunk, i, m):
                out.extend([] for _ in range(m))
                i += m
            else:
                out.append(checker.check(chunk.step_batch(i)))
                i += 1
    assert checker.finish() == _finish_of(reader)
    return out


def _finish_of(reader: TraceReader) -> object:
    ref = _GeneralOnly(reader.meta, rid_bound=reader.rid_bound)
    for batch in TraceReader(reader.path).steps():
        ref.check(batch)
    return ref.finish()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), spec=st.booleans(), damage=st.integers(0, 4))
def test_fast_paths_find_what_the_general_path_finds(seed: int, spec: bool, damage: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        _compare(Path(tmp), seed, spec, damage)


def _compare(tmp_path: Path, seed: int, spec: bool, damage: int) -> None:
    clean = tmp_path / "clean.kvtrace"
    generate(clean, num_requests=12, seed=seed, spec=spec, spec_fraction=1.0 if spec else 0.5,
             output_len=(20, 80), retract_prob=0.05, abort_prob=0.05, max_context_len=4096,
             arrival_rate=5.0)
    reader = TraceReader(clean)
    steps = list(reader.steps())
    rng = np.random.default_rng(seed)
    for index in rng.choice(len(steps), size=min(damage, len(steps)), replace=False).tolist():
        if len(steps[index]):
            steps[index] = _damaged(steps[index], rng)
    path = tmp_path / "damaged.kvtrace"
    with TraceWriter(path, reader.meta, steps_per_batch=8, overwrite=True) as writer:
        for batch in steps:
            writer.write(batch)
    reader = TraceReader(path)
    fast = OpSequenceChecker(reader.meta, rid_bound=reader.rid_bound)
    general = _GeneralOnly(reader.meta, rid_bound=reader.rid_bound)
    expected = []
    for batch in TraceReader(path).steps():
        problems = general.check(batch)
        assert fast.check(batch) == problems, batch.step
        expected.append(problems)
    assert fast.finish() == general.finish()
    assert _with_runs(reader) == expected
