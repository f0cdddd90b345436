"""Streaming sessions: ``kvtrace diff --a sglang --b builtin --exact`` identical on
``sample:mooncake-sessions`` and on session traces recorded from the Mooncake
conversation workload at pages 1 and 16: SGLang's own ``StreamingSession`` (in its
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
