"""``kvtrace diff``: identical versions are identical on every bundled trace (with and
without ``--exact``); each injected difference is found at its step, request and field;
the report, its JSON, ``--all``, ``--context``, ``--steps``, two state logs, errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.diff.diff import DiffOptions, diff_trace
from kvtrace.replay.engine import ReplayOptions
from kvtrace.replay.session import ReplaySession
from traces.reader import TraceReader
from traces.samples import resolve_trace
from traces.schema import SPEC

runner = CliRunner()
FAULTY = str(Path(__file__).with_name("faulty_allocators.py"))
SMALL_SAMPLES = ("tiny", "mooncake-tiny", "mooncake-pressure", "mooncake-eagle", "azure-code")


def diff_json(*args: str, code: int | None = None) -> dict:
    result = runner.invoke(app, ["diff", *args, "--json"])
    if code is not None:
        assert result.exit_code == code, result.output
    return json.loads(result.stdout)


# -- identical versions -------------------------------------------------------------------


@pytest.mark.parametrize("sample", SMALL_SAMPLES)
@pytest.mark.slow
def test_identical_versions_are_identical_on_every_bundled_trace(sample: str) -> None:
    """``--exact`` compares everything the plain comparison does, and the digests."""
    jobs = 2 if sample in ("mooncake-pressure", "azure-code") else 1
    exact = diff_trace(f"sample:{sample}", "builtin", "paged", jobs=jobs, options=DiffOptions(exact=True))
    assert exact.identical and exact.exact
    assert exact.steps_compared == exact.a.summary["steps"] == exact.b.summary["steps"] > 0
    timings = ("wall_s", "allocator_s", "speedup_vs_realtime", "allocator")
    assert {k: v for k, v in exact.a.summary.items() if k not in timings} == {
        k: v for k, v in exact.b.summary.items() if k not in timings
    }
    if sample in ("tiny", "mooncake-tiny", "mooncake-eagle"):
        plain = diff_trace(f"sample:{sample}", "builtin", "builtin", jobs=1)
        assert plain.identical and plain.steps_compared == exact.steps_compared


@pytest.mark.slow
def test_the_one_hour_trace_is_identical_exactly_with_the_sides_in_two_processes() -> None:
    report = diff_trace("sample:mooncake-conversation", "builtin", "builtin", jobs=2,
                        options=DiffOptions(exact=True))
    assert report.mode == "parallel" and report.identical
    assert report.steps_compared == report.a.summary["steps"] == 77_271


def test_cli_identical_says_so_and_exits_0() -> None:
    result = runner.invoke(app, ["diff", "sample:tiny", "--b", "builtin", "--exact", "--jobs", "1"])
    assert result.exit_code == 0, result.output
    assert "identical over 139 steps" in result.output
    out = diff_json("sample:tiny", "--b", "token", "--jobs", "1", code=1)  # page 16 vs 1: not identical
    assert out["identical"] is False


# -- injected differences -----------------------------------------------------------------


@pytest.mark.parametrize("fault", ["leaky_overalloc", "double_free", "stale_row"])
def test_each_faulty_allocator_is_found_at_its_step_and_request(fault: str) -> None:
    """With --check every a broken invariant is an outcome of its step, blamed on its
    request: the diff names both. Without it the pool counters show the same step."""
    with ReplaySession("sample:tiny", version=f"{FAULTY}:{fault}", checker="inline",
                       options=ReplayOptions(check="every")) as alone:
        alone.run()
        fault_rid = alone.allocator.fault_rid  # type: ignore[attr-defined]
        fault_step = alone.result().stats.violations[0].step
    assert fault_rid is not None
    out = diff_json("sample:tiny", "--b", f"{FAULTY}:{fault}", "--check", "every", "--jobs", "1", code=1)
    first = out["first_divergence"]
    assert (first["step"], first["rid"], first["field"]) == (fault_step, fault_rid, "events.violation")
    assert first["a"] == "(none)" and first["b"].startswith(f"violation request {fault_rid}")
    counters = diff_json("sample:tiny", "--b", f"{FAULTY}:{fault}", "--jobs", "1", code=1)["first_divergence"]
    assert counters["step"] == fault_step and counters["field"] == "available" and counters["rid"] is None


def test_a_page_size_change_is_found_at_the_first_published_prefix() -> None:
    """Request 0 of tiny is pre-allocated 379 tokens at step 0 and published to the radix
    cache: page aligned, 368 tokens at page 16 and 352 at page 32."""
    out = diff_json("sample:tiny", "--b", "paged:32", "--jobs", "1", code=1)
    first = out["first_divergence"]
    assert {k: first[k] for k in ("step", "op", "rid", "field", "a", "b")} == {
        "step": 0, "op": "prealloc", "rid": 0, "field": "cache_protected_len", "a": 368, "b": 352,
    }
    assert out["a"]["page_size"] == 16 and out["b"]["page_size"] == 32


def _first_spec_step(sample: str) -> int:
    reader = TraceReader(resolve_trace(f"sample:{sample}"))
    return next(b.step for b in reader.steps() if np.any(b.op == SPEC))


@pytest.mark.slow
def test_the_pre_encapsulation_variant_leaks_from_the_first_paged_speculative_step() -> None:
    report = diff_trace("sample:mooncake-eagle", "builtin", "pre-encapsulation", jobs=1,
                        options=DiffOptions(context=4))
    d = report.first_divergence
    assert d is not None
    div = d.divergence
    assert (div.step, div.op, div.field) == (_first_spec_step("mooncake-eagle"), "spec", "kv_allocated_len")
    assert div.a > div.b  # B's bookkeeping forgot the reserve it took
    assert [h.step for h in d.history][-1] == div.step and len(d.history) <= 4
    assert d.history[-1].a["kv_allocated_len"] == div.a and d.history[-1].b["kv_allocated_len"] == div.b
    # the leak grows until B runs out of memory; A serves the whole trace
    assert report.b.summary["oom"] is not None and report.a.summary["oom"] is None
    assert report.b.summary["steps"] < report.a.summary["steps"]
    # at page 1 the call site does update the bookkeeping: identical
    assert diff_trace("sample:mooncake-eagle", "builtin", "pre-encapsulation", jobs=1, page_size=1,
                      replay=ReplayOptions(stop_step=400)).identical


# -- the report ---------------------------------------------------------------------------


def test_json_has_the_contract_keys() -> None:
    out = diff_json("sample:tiny", "--b", "pre-encapsulation", "--jobs", "1", code=1)
    assert {"identical", "steps_compared", "first_divergence", "a", "b"} <= set(out)
    assert set(out["first_divergence"]) >= {"step", "op", "rid", "field", "a", "b"}
    for side in ("a", "b"):  # each the replay summary
        assert {"steps", "peak_used_tokens", "prefix_hit_rate", "evicted_tokens", "overalloc", "oom"} <= set(out[side])
    assert out["steps_compared"] == 2 and out["b"]["allocator"] == "pre-encapsulation"


def test_text_report_shows_the_divergence_its_history_and_the_summary() -> None:
    result = runner.invoke(app, ["diff", "sample:tiny", "--b", "pre-encapsulation", "--jobs", "1", "--context", "2"])
    assert result.exit_code == 1
    text = result.output
    assert "FIRST DIVERGENCE at step 1 (spec), request 0: kv_allocated_len" in text
    assert "A builtin            400" in text and "B pre-encapsulation  379" in text
    assert "request 0, last 2 steps" in text and "400 / 380 / 368" in text and "379 / 380 / 368" in text
    assert "side by side" in text and "peak occupancy" in text and "over-allocation" in text
    assert "diverged: 1 divergence in 2 steps compared" in text


def test_all_lists_each_request_once_and_context_bounds_the_history() -> None:
    report = diff_trace("sample:tiny", "builtin", "pre-encapsulation", jobs=1,
                        options=DiffOptions(max_divergences=4, context=3))
    keys = [d.divergence.rid if d.divergence.rid is not None else d.divergence.field for d in report.divergences]
    assert len(keys) == 4 and len(set(keys)) == 4
    steps = [d.divergence.step for d in report.divergences]
    assert steps == sorted(steps)
    assert all(1 <= len(d.history) <= 3 and d.history[-1].step == d.divergence.step for d in report.divergences)


def test_a_steps_window_compares_that_window_only() -> None:
    out = diff_json("sample:tiny", "--b", "pre-encapsulation", "--steps", "60:90", "--jobs", "1", code=1)
    assert out["first_divergence"]["step"] >= 60 and out["a"]["steps"] == 30
    out = diff_json("sample:tiny", "--b", "builtin", "--steps", "60:90", "--exact", "--jobs", "1", code=0)
    assert out["steps_compared"] == 30


@pytest.mark.slow
def test_the_sides_in_two_processes_report_what_lockstep_reports() -> None:
    lockstep = diff_json("sample:tiny", "--b", "pre-encapsulation", "--exact", "--all", "3", "--jobs", "1", code=1)
    parallel = diff_json("sample:tiny", "--b", "pre-encapsulation", "--exact", "--all", "3", "--jobs", "2", code=1)
    assert (lockstep["mode"], parallel["mode"]) == ("lockstep", "parallel")
    assert lockstep["divergences"] == parallel["divergences"]
    assert lockstep["steps_compared"] == parallel["steps_compared"]


# -- two state logs -----------------------------------------------------------------------


def test_two_state_logs_compare_like_their_replays(tmp_path: Path) -> None:
    logs = {}
    for name, spec, extra in (("a", "builtin", ["--digests"]), ("b", "paged:32", ["--digests"]), ("c", "builtin", [])):
        logs[name] = tmp_path / f"{name}.arrow"
        result = runner.invoke(app, ["replay", "sample:tiny", "--allocator", spec, "--out", str(logs[name]), *extra])
        assert result.exit_code == 0, result.output
    out = diff_json(str(logs["a"]), str(logs["b"]), "--exact", code=1)
    assert out["mode"] == "logs" and out["first_divergence"]["field"] == "cache_protected_len"
    assert out["a"]["steps"] == 139 and out["b"]["page_size"] == 32
    assert diff_json(str(logs["a"]), str(logs["c"]), code=0)["steps_compared"] == 139
    result = runner.invoke(app, ["diff", str(logs["a"]), str(logs["c"]), "--exact"])
    assert result.exit_code == 2 and "c.arrow holds no state digests" in result.stderr
    result = runner.invoke(app, ["diff", str(logs["a"]), str(logs["c"]), "--b", "token"])
    assert result.exit_code == 2 and "--b applies to a trace" in result.stderr


# -- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["sample:tiny"], "--b SPEC"),
        (["sample:tiny", "--b", "nosuch"], "valid forms: builtin, token"),
        (["missing.kvtrace", "--b", "builtin"], "missing.kvtrace"),
        (["sample:tiny", "--b", "builtin", "--jobs", "3"], "--jobs"),
        (["a", "b", "c"], "found 3 arguments"),
        (["sample:tiny", "--b", "builtin", "--steps", "9:3"], "--steps"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["diff", *args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtrace: error:") and message in lines[0]


def test_exact_with_a_version_without_digests_is_one_line() -> None:
    result = runner.invoke(app, ["diff", "sample:tiny", "--b", f"{FAULTY}:without_digest", "--exact", "--jobs", "1"])
    assert result.exit_code == 2
    assert "has no state_digest()" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    result = runner.invoke(app, ["diff", "sample:tiny", "--b", f"{FAULTY}:without_digest", "--jobs", "1"])
    assert result.exit_code == 0, result.output  # compared on counters and lengths


# -- inputs the diff cannot use whole -------------------------------------------------------


def _cut(path: Path, out: Path, keep: float = 2 / 3) -> Path:
    """A copy of ``path`` with its tail cut off (as a copy interrupted half-way leaves it)."""
    data = path.read_bytes()
    out.write_bytes(data[: int(len(data) * keep)])
    return out


def _state_log(path: Path, trace: str = "sample:tiny", steps_per_batch: int = 16) -> Path:
    """A state log as ``kvtrace replay TRACE --out`` writes it, in small record batches."""
    from kvtrace.replay.config import config_dict
    from kvtrace.statelog.log import StateLogWriter, trace_identity

    with ReplaySession(trace, checker="inline") as session:
        info = {"trace": trace, "trace_file": trace_identity(session.reader.path), "allocator": "builtin",
                "config": config_dict(session.config)}
        with StateLogWriter(path, info, steps_per_batch=steps_per_batch) as log:
            for snap in session.snapshots():
                log.write(snap)
    return path


def test_a_truncated_trace_warns_as_replay_does(tmp_path: Path) -> None:
    from kvtrace.replay.session import TRUNCATED_NOTE

    cut = _cut(resolve_trace("sample:tiny"), tmp_path / "cut.kvtrace")
    replay = runner.invoke(app, ["replay", str(cut), "--json"])
    warning = f"kvtrace: warning: {cut}: {TRUNCATED_NOTE}"
    assert replay.exit_code == 0 and replay.stderr.strip() == warning
    result = runner.invoke(app, ["diff", str(cut), "--b", "builtin", "--jobs", "1", "--json"])
    assert result.exit_code == 0, result.output
    assert result.stderr.strip() == warning  # once, not once per side
    assert 0 < json.loads(result.stdout)["steps_compared"] < 139


def test_a_truncated_state_log_warns_as_info_does(tmp_path: Path) -> None:
    full = _state_log(tmp_path / "full.arrow")
    cut = _cut(full, tmp_path / "cut.arrow")
    info = runner.invoke(app, ["info", str(cut), "--json"])
    assert info.exit_code == 0 and "file truncated after step" in info.stderr
    result = runner.invoke(app, ["diff", str(full), str(cut), "--json"])
    assert result.exit_code == 1  # the cut log ends early
    assert result.stderr == info.stderr
    out = json.loads(result.stdout)
    assert out["b"]["truncated"] is True and out["a"]["truncated"] is False
    assert out["b"]["steps"] == json.loads(info.stdout)["steps"] < 139
    quiet = runner.invoke(app, ["diff", str(full), str(full), "--json"])
    assert quiet.exit_code == 0 and quiet.stderr == ""


def test_logs_of_different_traces_warn_naming_both_and_still_compare(tmp_path: Path) -> None:
    a = _state_log(tmp_path / "a.arrow", "sample:tiny")
    b = _state_log(tmp_path / "b.arrow", "sample:mooncake-tiny")
    result = runner.invoke(app, ["diff", str(a), str(b), "--json"])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvtrace: warning: {a} and {b} replay different traces: ")
    assert "sample:tiny (60,808 bytes, hash " in lines[0] and "sample:mooncake-tiny (" in lines[0]
    assert lines[0].endswith("; compared anyway")
    out = json.loads(result.stdout)
    assert out["warnings"] == [lines[0].removeprefix("kvtrace: warning: ")] and out["steps_compared"] >= 1


def test_logs_of_one_trace_under_two_names_do_not_warn(tmp_path: Path) -> None:
    a = _state_log(tmp_path / "a.arrow", "sample:tiny")
    b = _state_log(tmp_path / "b.arrow", str(resolve_trace("sample:tiny")))
    result = runner.invoke(app, ["diff", str(a), str(b), "--json"])
    assert result.exit_code == 0 and result.stderr == ""
    assert json.loads(result.stdout)["warnings"] == []


def test_logs_without_a_trace_hash_are_told_apart_by_name(tmp_path: Path) -> None:
    from kvtrace.diff.diff import diff_logs
    from kvtrace.statelog.log import StateLogWriter, open_state_log, snapshots_of

    logs = []
    for name, trace in (("a", "sample:tiny"), ("b", "sample:mooncake-tiny")):
        _state_log(tmp_path / f"{name}.full", trace)
        info, reader = open_state_log(tmp_path / f"{name}.full")
        logs.append(tmp_path / f"{name}.arrow")  # as kvtrace wrote logs before they held the hash
        with StateLogWriter(logs[-1], {k: v for k, v in info.items() if k not in ("trace_file", "version")}) as log:
            for batch in reader.iter_batches():
                for snap in snapshots_of(batch):
                    log.write(snap)
    report = diff_logs(str(logs[0]), str(logs[1]))
    assert report.warnings == (
        f"{logs[0]} and {logs[1]} replay different traces: sample:tiny and sample:mooncake-tiny "
        "(by name: a log holds no hash of its trace); compared anyway",
    )


# -- progress -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("inputs", ["trace", "logs"])
def test_diff_shows_progress_on_a_terminal_and_nothing_with_json(tmp_path: Path, inputs: str) -> None:
    """stderr a terminal: the progress line is drawn there (and erased); stdout (a pipe)
    holds the report only. --json draws nothing."""
    import sys

    from tests.helpers import run_with_terminal_stderr

    if inputs == "trace":
        args, shown = ["sample:tiny", "--b", "builtin", "--jobs", "1"], "diff sample:tiny"
    else:
        args = [str(_state_log(tmp_path / "a.arrow")), str(_state_log(tmp_path / "b.arrow"))]
        shown = "diff a.arrow b.arrow"
    command = [sys.executable, "-m", "kvtrace", "diff", *args]
    code, out, drawn = run_with_terminal_stderr(command)
    assert code == 0, drawn
    assert "identical over 139 steps" in out and "\x1b" not in out
    assert shown in drawn
    code, out, drawn = run_with_terminal_stderr([*command, "--json"])
    assert code == 0 and drawn == "" and json.loads(out)["identical"] is True
