"""Plain decode steps that evict cached tokens: replayed without re-reading each step
(``ReplayEngine._decode_steps``), with the results of a replay step by step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtrace.replay.engine import ReplayOptions
from kvtrace.replay.session import ReplaySession
from kvtrace.replay.snapshot import StepSnapshot
from traces.schema import DECODE
from traces.synth import generate


@pytest.fixture(scope="module", params=[1, 16])
def evicting_trace(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Many requests through a small pool: finished prompts fill it with cache, so decode
    steps evict."""
    path = tmp_path_factory.mktemp("evict") / f"evict-p{request.param}.kvtrace"
    generate(path, num_requests=50, seed=5, page_size=request.param, pool_tokens=2048, max_running=8, chunk_size=64,
             output_len=(8, 60), prefix_groups=0, early_stop_prob=0.0)
    return path


def _replay(path: Path, runs: bool, check: str) -> tuple[list[StepSnapshot], list[int], object]:
    ahead = []  # steps after which the allocator was already past the step returned
    with ReplaySession(path, options=ReplayOptions(check=check, decode_runs=runs), checker="inline") as s:  # type: ignore[arg-type]
        snaps = []
        for snap in s.snapshots():
            snaps.append(snap)
            if s.allocator_step is not None and s.allocator_step > snap.step:
                ahead.append(snap.step)
        return snaps, ahead, s.result().stats


def _same(a: StepSnapshot, b: StepSnapshot) -> bool:
    return (
        (a.step, a.time_s, a.pool, a.events, a.num_ops, a.keyframe, a.digest, a.other_pools)
        == (b.step, b.time_s, b.pool, b.events, b.num_ops, b.keyframe, b.digest, b.other_pools)
        and all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(a.requests, b.requests))
    )


@pytest.mark.parametrize("check", ["end", "every"])
def test_evicting_decode_steps_go_ahead_with_step_by_step_results(evicting_trace: Path, check: str) -> None:
    fast, ahead, fast_stats = _replay(evicting_trace, True, check)
    slow, _, slow_stats = _replay(evicting_trace, False, check)
    evicting = {s.step for s in fast if any(e.kind == "evict" for e in s.events) and set(s.requests.op.tolist()) == {DECODE}}
    assert evicting, "no plain decode step evicted: the trace does not test what it should"
    # Some evicting decode steps were applied ahead of the snapshot returned (in a run).
    assert evicting & set(ahead)
    assert len(fast) == len(slow)
    assert all(_same(a, b) for a, b in zip(fast, slow))
    fast_stats.allocator_s = slow_stats.allocator_s = 0.0  # type: ignore[attr-defined]
    assert fast_stats == slow_stats


def test_lone_decode_steps_skip_the_op_dispatch_with_step_by_step_results(evicting_trace: Path) -> None:
    """A plain decode step between admissions and finishes (a run of one) goes through
    the engine's lean decode path, not ``replay_step``, with the same results."""
    through_step: list[int] = []
    with ReplaySession(evicting_trace, options=ReplayOptions(check="every"), checker="inline") as s:
        one = s.engine.replay_step

        def replay_step(batch):  # type: ignore[no-untyped-def]
            if set(batch.op.tolist()) == {DECODE}:
                through_step.append(batch.step)
            return one(batch)

        s.engine.replay_step = replay_step  # type: ignore[method-assign]
        fast = list(s.snapshots())
        fast_stats = s.result().stats
    slow, _, slow_stats = _replay(evicting_trace, False, "every")
    decoding = [s.step for s in slow if set(s.requests.op.tolist()) == {DECODE}]
    assert decoding, "no plain decode step: the trace does not test what it should"
    assert through_step == []
    assert len(fast) == len(slow)
    assert all(_same(a, b) for a, b in zip(fast, slow))
    fast_stats.allocator_s = slow_stats.allocator_s = 0.0  # type: ignore[attr-defined]
    assert fast_stats == slow_stats
