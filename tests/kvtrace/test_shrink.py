"""``kvtrace shrink``: each deliberately broken allocator and the pre-encapsulation
variant shrink ``sample:tiny`` to a trace of at most 5 requests and 50 steps that fails
the same way, is valid, says where it comes from, and whose emitted test fails against
the broken version and passes against builtin; out-of-memory, --max-time, Ctrl-C,
parallel workers, the JSON contract and the errors."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.replay.engine import ReplayOptions
from kvtrace.replay.session import ReplaySession
from kvtrace.shrink import Oracle, Target, shrink_trace
from kvtrace.shrink.signature import CHECKS
from traces.reader import TraceReader

runner = CliRunner()
FAULTY = str(Path(__file__).with_name("faulty_allocators.py"))
TINY = {"requests": 32, "steps": 139, "ops": 630}


def shrink_json(*args: str, code: int) -> dict:
    result = runner.invoke(app, ["shrink", *args, "--json"])
    assert result.exit_code == code, result.output
    return json.loads(result.stdout)


def load_test(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"emitted_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_emitted(module: ModuleType, attribute: str, version: str, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Run the emitted test with ``attribute`` (ALLOCATOR or B) set to ``version``: passed?"""
    monkeypatch.setattr(module, attribute, version)
    test = next(getattr(module, name) for name in dir(module) if name.startswith("test_"))
    try:
        test()
    except AssertionError:
        return False
    return True


def violations(path: Path, version: str) -> list[str]:
    with ReplaySession(path, version=version, options=ReplayOptions(check="every"), checker="inline") as s:
        return [v.check for v in s.run().stats.violations]


FAULTS = ["leaky_overalloc", "double_free", "stale_row", "leak_on_retract", "overwritten_row", "lock_leak", "counters_off"]


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.slow
def test_each_broken_allocator_shrinks_to_a_small_trace_and_a_test(
    fault: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = f"{FAULTY}:{fault}"
    small, test_file = tmp_path / "small.kvtrace", tmp_path / f"test_{fault}.py"
    out = shrink_json("sample:tiny", "--until", "violation", "--allocator", broken, "--baseline", "builtin",
                      "--out", str(small), "--emit-test", str(test_file), "--jobs", "1", code=0)
    assert {"out", "signature", "before", "after", "candidates", "wall_s"} <= set(out)
    assert out["before"] == TINY and out["after"]["requests"] <= 5 and out["after"]["steps"] <= 50
    assert out["out"] == str(small) and out["test"] == str(test_file) and out["confirmed"] is True
    assert out["candidates"] >= out["reproducing"] > 0 and out["stopped"] == "done"
    check = out["signature"].removeprefix("violation:").split(".")[0]  # counters.FIELD: the counters check
    assert check in violations(small, broken) and violations(small, "builtin") == []
    # valid, and its metadata says what it is and where it comes from
    result = runner.invoke(app, ["validate", str(small), "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["ok"] is True
    meta = TraceReader(small).meta
    origin = meta.extra["shrunk_from"]
    assert origin["trace"] == "sample:tiny" and origin["failure"] == out["signature"] and origin["allocator"] == broken
    assert meta.source == TraceReader(Path("traces/samples/tiny.kvtrace")).meta.source
    assert meta.recording is not None and meta.recording.status == "complete"
    assert "kvtrace shrink sample:tiny" in (meta.recording.command or "")
    # the emitted test: the trace beside it, passes against builtin, fails against the broken one
    assert test_file.with_suffix(".kvtrace").read_bytes() == small.read_bytes()
    module = load_test(test_file)
    assert run_emitted(module, "ALLOCATOR", "builtin", monkeypatch)
    assert not run_emitted(module, "ALLOCATOR", broken, monkeypatch)


@pytest.mark.slow
def test_the_pre_encapsulation_divergence_shrinks_to_one_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    test_file = tmp_path / "test_spec_reserve.py"
    out = shrink_json("sample:tiny", "--until", "divergence", "--b", "pre-encapsulation",
                      "--emit-test", str(test_file), "--jobs", "1", code=0)
    assert out["signature"] == "divergence:kv_allocated_len" and out["out"] is None
    assert out["after"]["requests"] == 1 and out["after"]["steps"] <= 5
    text = test_file.read_text()
    assert 'A = "builtin"' in text and "diff_trace" in text and "KVTRACE_REGRESS_ALLOCATOR" in text
    module = load_test(test_file)
    assert run_emitted(module, "B", "builtin", monkeypatch)
    assert not run_emitted(module, "B", "pre-encapsulation", monkeypatch)


def test_an_out_of_memory_keeps_its_op_and_the_expect_failure_test_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    test_file = tmp_path / "test_small_pool.py"
    result = runner.invoke(app, ["shrink", "sample:tiny", "--until", "oom", "--pool-tokens", "1200", "--emit-test",
                                 str(test_file), "--expect-failure", "--jobs", "1", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    # progress on stderr (one note per phase when stderr is not a terminal)
    assert "kvtrace: shrink [requests]" in result.stderr and " ops" in result.stderr
    op = out["signature"].removeprefix("oom:")
    assert out["signature"].startswith("oom:") and out["after"]["requests"] <= 5
    assert out["after"]["pool_tokens"] <= 1200
    with ReplaySession(test_file.with_suffix(".kvtrace"), options=ReplayOptions(on_oom="stop"), checker="inline") as s:
        oom = s.run().stats.oom
    assert oom is not None and oom.op == op
    module = load_test(test_file)
    assert module.ALLOCATOR == "builtin" and run_emitted(module, "ALLOCATOR", "builtin", monkeypatch)


def test_a_failure_that_does_not_reproduce_exits_1(tmp_path: Path) -> None:
    never = tmp_path / "never.kvtrace"
    out = shrink_json("sample:tiny", "--until", "violation", "--out", str(never), "--jobs", "1", code=1)
    assert out["reproduced"] is False and out["out"] is None and out["after"] is None
    assert "no invariant violation with builtin over 139 steps" in out["reason"]
    assert not never.exists()


def test_max_time_and_ctrl_c_return_the_best_so_far(tmp_path: Path) -> None:
    oracle = Oracle(Target("violation"), allocator=f"{FAULTY}:stale_row")
    timed = shrink_trace("sample:tiny", oracle, jobs=1, max_time=0)
    assert timed.stopped == "time" and timed.confirmed is not None and timed.confirmed.reproduced
    assert timed.after is not None and timed.after.ops < TINY["ops"]  # cut after the failing step
    seen = []

    def interrupt(progress: object) -> None:
        seen.append(progress)
        if len(seen) == 6:
            raise KeyboardInterrupt

    stopped = shrink_trace("sample:tiny", oracle, jobs=1, on_progress=interrupt)
    assert stopped.stopped == "interrupted" and stopped.confirmed is not None and stopped.confirmed.reproduced
    assert stopped.counts.tried >= 1 and stopped.data is not None
    stopped.write(tmp_path / "best.kvtrace")
    assert TraceReader(tmp_path / "best.kvtrace").meta.extra["shrunk_from"]["failure"] == str(timed.failure.signature)


@pytest.mark.slow
def test_candidates_judged_by_two_worker_processes(tmp_path: Path) -> None:
    out = shrink_json("sample:tiny", "--until", "violation", "--allocator", f"{FAULTY}:double_free",
                      "--out", str(tmp_path / "p.kvtrace"), "--jobs", "2", code=0)
    assert out["jobs"] == 2 and out["after"]["requests"] <= 5 and out["confirmed"] is True


def test_help_has_examples_and_the_shared_flags() -> None:
    result = runner.invoke(app, ["shrink", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    text = result.stdout
    assert "Examples" in text and "$ kvtrace shrink" in text and "<bool>" not in text
    for flag in ("--until", "--max-time", "--emit-test", "--expect-failure", "--baseline", "-q", "--no-color", "--json"):
        assert flag in text, flag


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--until", "leak", "--out", "x.kvtrace"], "--until"),
        (["--until", "divergence", "--out", "x.kvtrace"], "--b SPEC"),
        (["--until", "violation", "--b", "builtin", "--out", "x.kvtrace"], "applies to --until divergence"),
        (["--until", "divergence", "--b", "builtin", "--allocator", "token", "--out", "x.kvtrace"], "--allocator"),
        (["--until", "violation"], "--out SMALL.kvtrace"),
        (["--until", "violation", "--out", "x.kvtrace", "--expect-failure"], "--emit-test"),
        (["--until", "violation", "--emit-test", "regress.py"], "test_NAME.py"),
        (["--until", "violation", "--allocator", "nosuch", "--out", "x.kvtrace"], "valid forms"),
        (["--until", "violation", "--out", "README.md"], "already exists"),
        (["--until", "violation", "--out", "/tmp/test_kvtrace_same.kvtrace", "--emit-test",
          "/tmp/test_kvtrace_same.py"], "are the same file"),
        # refused before the search (a search would print progress: more than one line)
        (["--until", "violation:nosuch", "--out", "x.kvtrace"], "the checks are conservation, counters, device"),
        (["--until", "violation", "--allocator", f"{FAULTY}:stale_row", "--out", "/proc/x.kvtrace"],
         "--out /proc/x.kvtrace: cannot write in /proc"),
        (["--until", "violation", "--allocator", f"{FAULTY}:stale_row", "--emit-test", "/proc/test_x.py"],
         "--emit-test /proc/test_x.py: cannot write in /proc"),
        (["--until", "oom", "--pool-tokens", "1200", "--emit-test", "/tmp/test_kvtrace_oom.py"], "--baseline VERSION"),
        (["--until", "violation", "--out", "x.kvtrace", "--max-time", "nan"], "--max-time': must be a finite number"),
        (["--until", "violation", "--out", "x.kvtrace", "--max-time", "inf"], "--max-time': must be a finite number"),
        (["--until", "violation", "--out", "x.kvtrace", "--max-time", "0"], "--max-time: must be a positive"),
        (["--until", "violation", "--out", "x.kvtrace", "--max-time", "-1"], "--max-time: must be a positive"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["shrink", "sample:tiny", *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_every_check_the_allocator_reports_can_be_asked_for() -> None:
    # violation:CHECK is checked against CHECKS; a check added to the allocator must be added there.
    import re

    root = Path(__file__).resolve().parents[2]
    named = set()
    for source in [*(root / "allocator").rglob("*.py"), root / "kvtrace" / "replay" / "engine.py"]:
        text = source.read_text()
        named |= set(re.findall(r'Violation\(\s*"([a-z_]+)"', text))
        named |= set(re.findall(r'_violation\(\s*[^,()]+,\s*"([a-z_]+)"', text))
    assert "ownership" in named and "row_width" in named
    assert named <= set(CHECKS), named - set(CHECKS)
