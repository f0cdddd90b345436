"""``kvtrace diff`` on a hybrid (SWA) trace compares every pool and names the one that diverged.

A fault planted in one pool only (``faulty_allocators``: a skipped out-of-window free of
the SWA pool, a stale row freed in the full pool only) must be found at the step it
fires, with the pool it touched named in ``--json`` and in the text report and both
pools' counters shown; a full-attention diff keeps its keys as they were.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.replay.engine import ReplayOptions
from kvtrace.replay.session import ReplaySession

runner = CliRunner()
FAULTY = str(Path(__file__).with_name("faulty_allocators.py"))
SWA_SAMPLE = "sample:mooncake-gpt-oss"


def _diff(*args: str, code: int = 1) -> dict:
    result = runner.invoke(app, ["diff", *args, "--json"])
    assert result.exit_code == code, result.output
    return json.loads(result.stdout)


def _fault_step(fault: str) -> tuple[int, int]:
    """The step and request where ``fault`` fires, from its replay alone (--check every)."""
    with ReplaySession(SWA_SAMPLE, version=f"{FAULTY}:{fault}", checker="inline",
                       options=ReplayOptions(check="every")) as alone:
        alone.run()
        rid = alone.allocator.fault_rid  # type: ignore[attr-defined]
        step = alone.result().stats.violations[0].step
    assert rid is not None
    return step, rid


@pytest.mark.parametrize(
    ("fault", "pool", "field"),
    [("missed_window_free", "swa", "swa_available"), ("full_only_stale_row", "full", "available")],
)
def test_a_fault_in_one_pool_is_named_with_its_pool_and_step(fault: str, pool: str, field: str) -> None:
    step, _ = _fault_step(fault)
    out = _diff(SWA_SAMPLE, "--b", f"{FAULTY}:{fault}", "--jobs", "1")
    first = out["first_divergence"]
    assert (first["step"], first["field"], first["pool"], first["rid"]) == (step, field, pool, None)
    figures = out["divergences"][0]["pools"]
    assert set(figures) == {"full", "swa"}
    other = "full" if pool == "swa" else "swa"
    assert "available" in figures[pool]["differs"] and figures[other]["differs"] == []
    assert figures[pool]["a"]["available"] == first["a"] and figures[pool]["b"]["available"] == first["b"]
    assert figures["swa"]["a"]["pool_tokens"] == 48_000 and figures["full"]["a"]["pool_tokens"] == 60_000


def test_the_text_report_names_the_pool_and_shows_both() -> None:
    result = runner.invoke(app, ["diff", SWA_SAMPLE, "--b", f"{FAULTY}:missed_window_free", "--jobs", "1", "--no-color"])
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    assert "  pool: swa diverged" in lines
    assert any(line.startswith("    full  identical: available ") for line in lines)
    assert any(line.startswith("    swa   differs (A / B): available ") for line in lines)


@pytest.mark.slow
def test_the_sides_in_two_processes_name_the_same_pool() -> None:
    """In two processes the records arrive as state-log batches (the ``swa_*`` columns)."""
    lockstep = _diff(SWA_SAMPLE, "--b", f"{FAULTY}:missed_window_free", "--jobs", "1")
    parallel = _diff(SWA_SAMPLE, "--b", f"{FAULTY}:missed_window_free", "--jobs", "2")
    assert parallel["mode"] == "parallel"
    assert parallel["divergences"] == lockstep["divergences"]


def test_two_state_logs_of_an_swa_trace_name_the_pool(tmp_path: Path) -> None:
    logs = []
    for name, spec in (("a", "builtin"), ("b", f"{FAULTY}:missed_window_free")):
        logs.append(tmp_path / f"{name}.arrow")
        result = runner.invoke(app, ["replay", SWA_SAMPLE, "--allocator", spec, "--out", str(logs[-1])])
        assert result.exit_code in (0, 1), result.output
    first = _diff(str(logs[0]), str(logs[1]))["first_divergence"]
    assert (first["field"], first["pool"]) == ("swa_available", "swa")


def test_a_full_attention_diff_has_no_pool_keys() -> None:
    out = _diff("sample:tiny", "--b", f"{FAULTY}:stale_row", "--jobs", "1")
    assert "pool" not in out["first_divergence"]
    assert not {"pool", "pools"} & set(out["divergences"][0])
