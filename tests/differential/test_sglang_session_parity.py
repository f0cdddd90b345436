"""Streaming sessions: ``kvtrace diff --a sglang --b builtin --exact`` identical on
``sample:mooncake-sessions``, on session traces recorded from the Mooncake
conversation workload and on a small trace of every session path, at pages 1 and 16: SGLang's own ``StreamingSession`` (in its
``UnifiedRadixCache``) holds, resumes and closes the sessions, and every step's counters
(``session_held`` included, running turns counted as SGLang counts them), request
lengths and physical slots match the built-in allocator's.

Skipped unless ``KVTRACE_SGLANG_PYTHON`` names an interpreter with sglang 0.5.23.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from tests.differential import harness

runner = CliRunner()
WORKLOAD = Path(__file__).resolve().parents[2] / "traces/workloads_data/mooncake-fast25/conversation_trace.jsonl"


def _diff(python: str, trace: str) -> str:
    res = runner.invoke(app, ["diff", trace, "--a", f"sglang:{python}", "--b", "builtin", "--exact"])
    assert res.exit_code == 0, res.output
    assert "identical over" in res.output, res.output
    return res.output


@pytest.mark.slow
def test_the_session_sample_identical_to_sglang_exactly() -> None:
    python = harness.require_sglang()
    _diff(python, "sample:mooncake-sessions")


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16])
def test_a_recorded_conversation_with_sessions_identical_to_sglang_exactly(page_size: int, tmp_path: Path) -> None:
    python = harness.require_sglang()
    trace = tmp_path / f"sessions-{page_size}.kvtrace"
    res = runner.invoke(app, ["record", str(WORKLOAD), "--format", "mooncake", "--duration", "75s",
                              "--pool-tokens", "700000", "--page-size", str(page_size), "--sessions",
                              "--seed", "0", "-o", str(trace), "--json"])  # fmt: skip
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["evicted_tokens"] > 0  # the pool is tight enough to evict
    from kvtrace.traceinfo import trace_info
    from traces.reader import TraceReader

    ops = trace_info(TraceReader(trace))["ops"]
    assert ops["hold"] > 10 and ops["close"] > 5  # sessions resumed and closed, under eviction
    _diff(python, str(trace))


def write_session_trace(path: Path, page_size: int) -> Path:
    """Two conversations and a plain request over one shared system prompt: holds (one
    stopped early, so the tail past it goes back), resumed turns that decode, an abort of
    a resumed turn (its session's KV released), a close; the plain request matches the
    prompt the first turns published."""
    import numpy as np

    from kvtrace.record.recorder import Recorder
    from tests.helpers import make_meta

    system = np.arange(1000, 1032, dtype=np.int64)

    def prompt(first: int, n: int) -> np.ndarray:
        return np.concatenate([system, np.arange(first, first + n, dtype=np.int64)])

    steps: list[list[tuple[str, tuple, dict]]] = [
        [("extend", ([1, 2], [40, 37]), {"prompt_lens": [40, 37], "token_ids": [prompt(2000, 8), prompt(3000, 5)]})],
        [("decode", ([1, 2],), {})],
        [("decode", ([1, 2],), {})],
        [("hold", ([1, 2],), {"held_lens": [42, 38]})],
        [("extend", ([1, 3], [70, 50]), {"prompt_lens": [70, 50], "token_ids": [None, prompt(4000, 18)]})],
        [("decode", ([1, 3],), {})],
        [("hold", ([1],), {}), ("extend", ([2], [60]), {"prompt_lens": [60]})],
        [("finish", ([3],), {}), ("decode", ([2],), {})],
        [("abort", ([2],), {}), ("extend", ([1], [90]), {"prompt_lens": [90]})],
        [("decode", ([1],), {})],
        [("hold", ([1],), {})],
        [("close_session", ([1],), {})],
    ]
    meta = make_meta(sessions=True, page_size=page_size, pool_tokens=1024)
    with Recorder(path, meta, overwrite=True) as rec:
        for t, ops in enumerate(steps):
            rec.begin_step(float(t))
            for op, args, kwargs in ops:
                getattr(rec, op)(*args, **kwargs)
            rec.end_step()
    return path


@pytest.mark.parametrize("page_size", [1, 16])
def test_the_trace_of_every_session_path_replays_clean_on_the_builtin(page_size: int, tmp_path: Path) -> None:
    """The trace the parity test gives SGLang holds what it says (holds, a resumed turn, an
    abort of one, a close) and replays clean here, every check on."""
    trace = write_session_trace(tmp_path / f"turns-{page_size}.kvtrace", page_size)
    res = runner.invoke(app, ["replay", str(trace), "--check", "every", "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["violations"] == [] and summary["steps"] == 12
    assert summary["aborts"] >= 1 and summary["session_held"]["holds"] == 4, summary["session_held"]


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16])
def test_held_resumed_aborted_and_closed_sessions_identical_to_sglang_exactly(page_size: int, tmp_path: Path) -> None:
    python = harness.require_sglang()
    trace = write_session_trace(tmp_path / f"turns-{page_size}.kvtrace", page_size)
    assert "identical over 12 steps" in _diff(python, str(trace))


@pytest.mark.slow
def test_a_finished_session_turn_is_refused_with_one_line(tmp_path: Path) -> None:
    """SGLang keeps a finished later turn's record in its session slot, the built-in
    allocator releases it: the trace checker refuses the op (both sides stop at it, in
    one line) rather than diverge."""
    from kvtrace.record.recorder import Recorder
    from tests.helpers import make_meta

    python = harness.require_sglang()
    trace = tmp_path / "finish.kvtrace"
    with Recorder(trace, make_meta(sessions=True, page_size=1, pool_tokens=1024), overwrite=True) as rec:
        for t, (op, args, kwargs) in enumerate([
            ("extend", ([1], [10]), {"prompt_lens": [10]}), ("hold", ([1],), {}),
            ("extend", ([1], [20]), {"prompt_lens": [20]}), ("finish", ([1],), {}),
        ]):
            rec.begin_step(float(t))
            getattr(rec, op)(*args, **kwargs)
            rec.end_step()
    res = runner.invoke(app, ["diff", str(trace), "--a", f"sglang:{python}", "--b", "builtin", "--exact"])
    assert res.exit_code == 2, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "step 3, request 0: finish of a streaming session's turn" in lines[0], lines


@pytest.mark.slow
def test_the_session_hold_bound_flags_the_same_sessions_on_sglang() -> None:
    """``--session-hold-bound`` on SGLang's side (which offers no per-request record of
    ours) flags the same sessions at the same steps as on the built-in allocator."""
    python = harness.require_sglang()
    found = {}
    for allocator in (f"sglang:{python}", "builtin"):
        res = runner.invoke(app, ["replay", "sample:mooncake-sessions", "--allocator", allocator,
                                  "--session-hold-bound", "2000", "--steps", ":600", "--json"])
        assert res.exit_code == 1, res.output
        summary = json.loads(res.stdout)
        found[allocator] = [(v["step"], v["rid"]) for v in summary["violations"] if v["check"] == "session_hold_bound"]
    theirs, ours = found.values()
    assert ours and theirs == ours
