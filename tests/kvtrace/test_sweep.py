"""kvtrace sweep: a grid gives the numbers of the separate runs (local processes and a
local Ray), a killed sweep keeps its finished cells and runs only the rest, bad input
is one line with exit 2, and the report prints and plots."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.cli.ui import rounded
from kvtrace.sweep import parse_counts, parse_specs, parts_dir
from kvtrace.sweep.cells import flatten

ROOT = Path(__file__).resolve().parents[2]
MOONCAKE = ROOT / "traces" / "workloads_data" / "mooncake-fast25" / "conversation_trace.jsonl"
KVTRACE = Path(sys.executable).with_name("kvtrace")
# Keys that measure this machine's wall clock, and the trace a sweep does not keep.
NOT_COMPARED = {"wall_s", "allocator_s", "speedup_vs_realtime", "steps_per_s", "out", "file_bytes"}
POOLS, PAGES = ("40000", "60000"), ("1", "16")


def _json(args: list[str]) -> dict[str, Any]:
    result = CliRunner().invoke(app, [*args, "--json", "-q"])
    assert result.exit_code in (0, 1), result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A small workload (4 s of Mooncake arrivals) and a trace recorded from it."""
    base = tmp_path_factory.mktemp("sweep")
    workload = base / "four_seconds.jsonl"
    lines = MOONCAKE.read_text().splitlines()
    first = json.loads(lines[0])["timestamp"]
    workload.write_text("\n".join(ln for ln in lines[:200] if json.loads(ln)["timestamp"] - first < 4000) + "\n")
    trace = base / "recorded.kvtrace"
    report = _json(["record", str(workload), "--out", str(trace), "--page-size", "16", "--pool-tokens", "60000"])
    assert report["requests"] > 10
    return {"workload": workload, "trace": trace}


@pytest.fixture(scope="module")
def separate_runs(inputs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str, str], dict]:
    """The four kvtrace record runs of the workload and the four kvtrace replay runs of
    the trace that the 2 x 2 grids stand for."""
    base = tmp_path_factory.mktemp("separate")
    runs = {}
    for pool in POOLS:
        for page in PAGES:
            what_if = ["--pool-tokens", pool, "--page-size", page]
            out = base / f"{pool}-{page}.kvtrace"
            runs["workload", pool, page] = _json(["record", str(inputs["workload"]), "--out", str(out), *what_if])
            runs["trace", pool, page] = _json(["replay", str(inputs["trace"]), *what_if])
    return runs


def _sweep(inputs: dict[str, Path], out: Path, *extra: str) -> dict[str, Any]:
    args = ["sweep", str(inputs["workload"]), str(inputs["trace"]), "--pool-tokens", ",".join(POOLS)]
    return _json([*args, "--page-size", ",".join(PAGES), "--out", str(out), *extra])


def _check_against(out: Path, inputs: dict[str, Path], separate: dict[tuple[str, str, str], dict]) -> None:
    rows = pq.read_table(out).to_pylist()
    assert len(rows) == 8
    for row in rows:
        which = "workload" if row["input"] == str(inputs["workload"]) else "trace"
        assert row["kind"] == ("simulate" if which == "workload" else "replay")
        alone = separate[which, str(row["param.pool_tokens"]), str(row["param.page_size"])]
        # A cell is ok exactly when its run alone is clean (exit 0).
        assert row["status"] == ("oom" if alone.get("oom") else "ok"), (row["status"], alone.get("oom"))
        expected = flatten(alone)
        compared = [k for k in expected if k not in NOT_COMPARED]
        assert len(compared) > 30
        for key in compared:
            assert rounded(row.get(key)) == expected[key], (which, row["param.pool_tokens"], row["param.page_size"], key)


@pytest.mark.slow
def test_a_2x2_grid_gives_the_numbers_of_the_separate_runs(tmp_path: Path, inputs, separate_runs) -> None:
    out = tmp_path / "results.parquet"
    summary = _sweep(inputs, out, "--jobs", "2")
    # The trace recorded with 60,000 tokens runs out of memory replayed in 40,000.
    expected = {"out": str(out), "cells": 8, "done": 6, "found": 2, "failed": 0, "resumed": 0, "runner": "local"}
    assert summary == {**summary, **expected}
    assert not parts_dir(out).exists()
    _check_against(out, inputs, separate_runs)


@pytest.mark.slow
def test_the_same_grid_through_a_local_ray_gives_the_same_numbers(tmp_path: Path, inputs, separate_runs) -> None:
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'kvtrace[ray]')")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        out = tmp_path / "ray.parquet"
        summary = _sweep(inputs, out, "--ray", "auto")
        assert summary["runner"] == "ray" and summary["done"] + summary["found"] == 8 and summary["failed"] == 0
        _check_against(out, inputs, separate_runs)
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_a_killed_sweep_keeps_its_finished_cells_and_runs_only_the_rest(tmp_path: Path, inputs) -> None:
    out = tmp_path / "killed.parquet"
    args = [str(KVTRACE), "sweep", str(inputs["trace"]), "--pool-tokens", "30k,45k,60k,75k", "-j", "1", "-o", str(out)]
    proc = subprocess.Popen([*args, "-q"], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    parts = parts_dir(out)
    deadline = time.monotonic() + 240
    try:
        while not list(parts.glob("*.parquet")):
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "no cell finished in time"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the sweep and its worker, mid-cell
        proc.wait()
    finished = {p.stem: pq.read_table(p).to_pylist()[0] for p in parts.glob("*.parquet")}
    assert 1 <= len(finished) < 4 and not out.exists()
    assert all(row["status"] in ("ok", "oom") for row in finished.values())  # cells that ran: kept
    result = subprocess.run([*args, "--json"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stderr  # the smaller pools run out of memory
    summary = json.loads(result.stdout)
    assert summary["cells"] == 4 and summary["done"] + summary["found"] == 4 and summary["resumed"] == len(finished)
    rows = {row["cell"]: row for row in pq.read_table(out).to_pylist()}
    assert [r["param.pool_tokens"] for r in rows.values()] == [30_000, 45_000, 60_000, 75_000]
    for key, row in finished.items():  # not run again: the very rows of the killed run
        # The merged file has every cell's columns: a null ``oom`` of this cell is there as
        # the null ``oom.*`` columns of a cell that ran out; columns only others have are null.
        merged = rows[key]
        for k, v in row.items():
            if k in merged:
                assert merged[k] == v, k
            else:
                assert v is None and any(m.startswith(k + ".") for m in merged), k
        assert all(merged[k] is None for k in merged.keys() - row.keys())
    assert not parts.exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--check", "sometimes"], "'sometimes' is not one of"),
        (["--on-oom", "retry"], "'retry' is not one of"),
        (["--device", "tpu"], "'tpu' is not one of"),
        (["--pool-tokens", "10q"], "'10q' is not a count"),
        (["--page-size", "16,16"], "'16' is given twice"),
        (["--spec", "eagle:3,1"], "is not a comma-separated list of off and ALGORITHM"),
        (["--spec", "off,eagle:3,1,4"], "applies to simulated cells; "),
        (["--versions", "nosuch"], "unknown allocator 'nosuch'"),
        (["--versions", "paged:16", "--page-size", "1"], "conflicts with --versions paged:16"),
        (["--pool-tokens", "20"], "fewer than two pages of 16"),
        (["--rate", "3"], "applies to lengths workloads only"),
    ],
)
def test_bad_options_are_one_line_and_exit_2(tmp_path: Path, inputs, extra: list[str], message: str) -> None:
    out = tmp_path / "r.parquet"
    result = CliRunner().invoke(app, ["sweep", str(inputs["trace"]), "-o", str(out), *extra])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtrace: error: ") and message in lines[0], lines
    assert not out.exists() and not parts_dir(out).exists()


def test_bad_inputs_and_outputs_are_one_line_and_exit_2(tmp_path: Path, inputs) -> None:
    cases = [
        (["sweep", str(inputs["trace"]), "-o", str(inputs["trace"])], "is the input"),
        (["sweep", str(inputs["workload"]), "-o", str(inputs["workload"])], "is the input"),
        (["sweep", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "r.parquet")], "no such file"),
        (["sweep", str(inputs["trace"]), str(inputs["trace"]), "-o", str(tmp_path / "r.parquet")], "given twice"),
        (["sweep", "report", str(inputs["workload"])], "not a Parquet file"),
        (["sweep", "report", str(tmp_path / "none.parquet")], "no such file"),
    ]
    for args, message in cases:
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (args, lines)


def test_failed_cells_are_rows_saying_why_and_exit_1(tmp_path: Path, inputs) -> None:
    """A version whose factory fails: every cell fails, the sweep still writes its rows."""
    broken = tmp_path / "broken.py"
    broken.write_text("def create(config):\n    raise RuntimeError('no allocator today')\n")
    out = tmp_path / "r.parquet"
    result = CliRunner().invoke(app, ["sweep", str(inputs["trace"]), "--versions", f"{broken}:create", "-o", str(out), "-j", "1"])
    assert result.exit_code == 1, result.output
    rows = pq.read_table(out).to_pylist()
    assert len(rows) == 1 and rows[0]["status"] == "failed" and "no allocator today" in rows[0]["error"]
    assert "1 cells failed" in result.stderr


@pytest.mark.slow
def test_the_report_prints_a_table_and_plots_per_input(tmp_path: Path, inputs) -> None:
    out = tmp_path / "r.parquet"
    args = ["sweep", str(inputs["trace"]), "--pool-tokens", "50k,60k", "--page-size", "16,32", "-o", str(out), "-j", "2"]
    ran = CliRunner().invoke(app, args)
    assert ran.exit_code == (0 if {r["status"] for r in pq.read_table(out).to_pylist()} == {"ok"} else 1), ran.output
    shown = CliRunner().invoke(app, ["sweep", "report", str(out)])
    assert shown.exit_code == 0, shown.output
    assert "hit rate" in shown.stdout and "60,000" in shown.stdout and "recorded.kvtrace" in shown.stdout
    png = tmp_path / "r-plots" / "recorded.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = _json(["sweep", "report", str(out)])  # run again: it draws its own plots again
    assert report["cells"] == 4 and report["plots"] == [str(png)]
    pools = sorted({r["pool_tokens"] for r in report["rows"]})
    assert pools[-1] == 60_000 and all(0 < r["peak_occupancy"] <= 1 for r in report["rows"])


@pytest.mark.slow
def test_simulated_cells_keep_their_traces_when_asked(tmp_path: Path, inputs) -> None:
    kept = tmp_path / "kept"
    kept.mkdir()
    out = tmp_path / "r.parquet"
    summary = _json(["sweep", str(inputs["workload"]), "--pool-tokens", "50k", "--keep-traces", str(kept), "-o", str(out), "-j", "1"])
    assert summary["done"] == 1
    (trace,) = kept.glob("four_seconds-*.kvtrace")
    row = pq.read_table(out).to_pylist()[0]
    assert row["out"] == str(trace) and row["file_bytes"] == trace.stat().st_size > 0
    info = _json(["info", str(trace)])
    assert info["steps"] == row["steps"] and info["config"]["pool_tokens"] == 50_000


def test_without_ray_installed_ray_is_one_line(tmp_path: Path, inputs, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    result = CliRunner().invoke(app, ["sweep", str(inputs["trace"]), "--ray", "auto", "-o", str(tmp_path / "r.parquet")])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--ray needs Ray: pip install 'kvtrace[ray]'" in lines[0], lines
    assert not parts_dir(tmp_path / "r.parquet").exists()


@given(st.lists(st.integers(1, 5_000_000), min_size=1, max_size=6, unique=True))
def test_counts_parse_with_and_without_units(values: list[int]) -> None:
    def spelled(v: int) -> str:
        for scale, unit in ((1_000_000, "M"), (1_000, "k")):
            if v % scale == 0:
                return f"{v // scale}{unit}"
        return str(v)

    assert parse_counts(",".join(spelled(v) for v in values), "--pool-tokens") == values


def test_spec_lists_keep_the_commas_of_each_setting() -> None:
    assert parse_specs("off,eagle:3,1,4,eagle3:5,4,8") == ["off", "eagle:3,1,4", "eagle3:5,4,8"]
    with pytest.raises(ValueError, match="--spec"):
        parse_specs("eagle:3,1,4,")


@pytest.mark.slow
def test_violations_and_ooms_are_marked_in_rows_table_plots_and_exit_code(tmp_path: Path) -> None:
    """pre-encapsulation leaks pages on sample:tiny (its replay alone exits 1 with 2
    violations), and 1,000 tokens run out of memory: the sweep must not call them ok."""
    from kvtrace.sweep.report import load_results, report_rows, series_points

    out = tmp_path / "r.parquet"
    args = ["sweep", "sample:tiny", "--versions", "builtin,pre-encapsulation", "--pool-tokens", "1000,3968", "-j", "2"]
    result = CliRunner().invoke(app, [*args, "-o", str(out), "--json"])
    assert result.exit_code == 1, result.output
    assert json.loads(result.stdout)["found"] == 3 and json.loads(result.stdout)["done"] == 1
    assert "3 cells found problems" in result.stderr
    status = {(r["param.version"], r["param.pool_tokens"]): r for r in pq.read_table(out).to_pylist()}
    leaking = status["pre-encapsulation", 3968]
    assert leaking["status"] == "violations" and leaking["num_violations"] == 2
    assert "139 pages are held by nobody (leaked)" in leaking["problem"]
    assert status["builtin", 1000]["status"] == "oom" and "out of memory at step" in status["builtin", 1000]["problem"]
    assert status["builtin", 3968]["status"] == "ok" and status["builtin", 3968]["problem"] is None

    shown = CliRunner().invoke(app, ["sweep", "report", str(out), "--no-plots"], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    assert "violations" in shown.stdout.splitlines()[2]  # a column of the table's header
    lines = [ln for ln in shown.stdout.splitlines() if ln.startswith("row ")]
    assert len(lines) == 3 and any("pre-encapsulation, pool 3,968): violations: 2 violations" in ln for ln in lines)
    assert any("version builtin, pool 992): oom: out of memory at step" in ln for ln in lines)

    # The plots: a replay the OOM stopped is off the line, a leaking cell is ringed.
    points = series_points(report_rows(load_results(out)), "duration_s")
    builtin, pre = points["version builtin"], points["version pre-encapsulation"]
    assert [p[0] for p in builtin.line] == [3968] and [p[0] for p in builtin.stopped] == [992]
    assert not builtin.violations and [p[0] for p in pre.violations] == [992, 3968]


def test_the_exit_codes_of_a_sweep_are_in_its_help() -> None:
    shown = CliRunner().invoke(app, ["sweep", "run", "--help"], env={"COLUMNS": "200"})
    assert shown.exit_code == 0 and "violations, an out-of-memory with --on-oom stop" in " ".join(shown.stdout.split())


def _racing_sweeps(out: Path) -> list[subprocess.CompletedProcess[str]]:
    args = [sys.executable, "-m", "kvtrace", "sweep", "sample:tiny", "-j", "1", "-q", "-o", str(out)]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=300), *p.communicate()) for p in procs]


@pytest.mark.slow
def test_two_sweeps_racing_on_one_out_one_writes_the_other_is_refused(tmp_path: Path) -> None:
    """Before the lock, both exited 0 and most races left a result of 0 rows."""
    from kvtrace.sweep.claim import lock_path

    for attempt in range(5):
        out = tmp_path / f"race{attempt}.parquet"
        runs = sorted(_racing_sweeps(out), key=lambda r: r.returncode)
        assert [r.returncode for r in runs] == [0, 2], [(r.returncode, r.stderr) for r in runs]
        refused = runs[1].stderr.strip().splitlines()
        assert len(refused) == 1 and refused[0].startswith(f"kvtrace: error: --out {out}"), refused
        assert "another kvtrace sweep (PID" in refused[0] or "already exists; pass --force" in refused[0]
        assert pq.read_table(out).num_rows == 1
        assert not parts_dir(out).exists() and not lock_path(out).exists()


def test_a_sweep_on_an_out_another_process_owns_is_one_line_and_exit_2(tmp_path: Path) -> None:
    from kvtrace.sweep.claim import claim, lock_path

    out = tmp_path / "r.parquet"
    args = [sys.executable, "-m", "kvtrace", "sweep", "sample:tiny", "-j", "1", "-o", str(out)]
    with claim(out):  # this test's process owns it
        refused = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        f"kvtrace: error: --out {out}: another kvtrace sweep (PID {os.getpid()}) is writing it; "
        "wait for it to finish or give another path"
    ]
    assert not out.exists() and not parts_dir(out).exists() and not lock_path(out).exists()
    # The lock file of an owner that died (killed: it could not remove it) is taken over.
    lock_path(out).write_text("999999999\n")
    with claim(out):
        assert lock_path(out).read_text() == f"{os.getpid()}\n"
    assert not lock_path(out).exists()


def test_a_merge_missing_parts_leaves_the_result_as_it_was(tmp_path: Path) -> None:
    from kvtrace.errors import OutputError
    from kvtrace.outputs import OutputFile
    from kvtrace.sweep import ResultStore

    out = tmp_path / "r.parquet"
    out.write_bytes(b"an earlier result")
    store = ResultStore(out)
    for key in ("a", "b"):
        store.write({"cell": key, "input": "x", "kind": "replay", "status": "ok", "error": None})
    (store.parts / "b.parquet").unlink()  # as another sweep on the same out did
    with pytest.raises(OutputError, match="1 of 2 finished cells are gone"):
        store.merge(["a", "b"], OutputFile(out, force=True))
    assert out.read_bytes() == b"an earlier result"


@pytest.mark.slow
def test_the_report_redraws_its_own_plots_and_refuses_other_files_and_bad_plot_dirs(tmp_path: Path) -> None:
    import pyarrow as pa

    out = tmp_path / "r.parquet"  # two cells' results, as a sweep writes them
    cells = [
        {"cell": str(pool), "input": "sample:tiny", "kind": "replay", "status": "ok", "error": None, "pool_tokens": pool,
         "page_size": 16, "prefix_hit_rate": 0.07, "peak_used_tokens": 900, "retractions": 5, "duration_s": 2.9}
        for pool in (1000, 4000)
    ]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(cells), out)
    png = tmp_path / "r-plots" / "tiny.png"
    for _ in range(2):  # the second run replaced the first's plot
        again = CliRunner().invoke(app, ["sweep", "report", str(out)])
        assert again.exit_code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", again.output
    png.write_bytes(b"someone's notes")  # not a plot of kvtrace: kept without --force
    kept = CliRunner().invoke(app, ["sweep", "report", str(out)])
    assert kept.exit_code == 2 and "tiny.png already exists; pass --force" in kept.stderr
    assert png.read_bytes() == b"someone's notes"

    a_file = tmp_path / "a-file"
    a_file.write_text("")
    if os.geteuid() == 0:  # permissions do not stop root; a read-only file system does
        read_only = Path("/sys/kernel/kvtrace-plots")
    else:
        (tmp_path / "ro").mkdir(mode=0o555)
        read_only = tmp_path / "ro" / "plots"
    for plots, message in (
        (a_file, "is a file, not a directory"),
        (a_file / "sub", "cannot create the directory (Not a directory)"),
        (read_only, "cannot create the directory ("),
    ):
        refused = CliRunner().invoke(app, ["sweep", "report", str(out), "--plots", str(plots)])
        lines = refused.stderr.strip().splitlines()
        assert refused.exit_code == 2 and len(lines) == 1 and f"--plots {plots}" in lines[0] and message in lines[0], lines
        assert "internal error" not in lines[0]


def test_the_report_shows_a_failed_cells_parameters_and_why(tmp_path: Path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("def create(config):\n    raise RuntimeError('no allocator today')\n")
    out = tmp_path / "r.parquet"
    args = ["sweep", "sample:tiny", "--versions", f"{broken}:create", "--pool-tokens", "2000", "-j", "1", "-o", str(out)]
    assert CliRunner().invoke(app, args).exit_code == 1
    shown = CliRunner().invoke(app, ["sweep", "report", str(out), "--no-plots"], env={"COLUMNS": "250"})
    assert shown.exit_code == 0, shown.output
    row = next(ln for ln in shown.stdout.splitlines() if "failed" in ln and ln.startswith("│"))
    assert "2,000" in row  # the pool it asked for
    assert f"row 1 (sample:tiny, version {broken}:create, pool 2,000): failed: " in shown.stdout
    assert "no allocator today" in shown.stdout


def _unused_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


@pytest.mark.slow
def test_a_ray_address_where_nothing_answers_is_one_line_within_seconds(tmp_path: Path) -> None:
    """It used to wait in ray.init for minutes, printing Ray's connection logs."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'kvtrace[ray]')")
    out = tmp_path / "r.parquet"
    address = f"127.0.0.1:{_unused_port()}"
    args = [sys.executable, "-m", "kvtrace", "sweep", "sample:tiny", "--ray", address, "-o", str(out)]
    t0 = time.monotonic()
    result = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert time.monotonic() - t0 < 30  # the interpreter and kvtrace's imports; the check itself is instant
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"kvtrace: error: --ray {address}: no Ray cluster answers there (connection refused); start one with "
        f"'ray start --head --port {address.split(':')[1]}' or give --ray auto (the cluster of this machine) or local"
    ]
    assert not out.exists() and not parts_dir(out).exists()
    bad = CliRunner().invoke(app, ["sweep", "sample:tiny", "--ray", "head-node", "-o", str(out)])
    assert bad.exit_code == 2 and bad.stderr.strip().splitlines() == [
        "kvtrace: error: --ray head-node: give HOST:PORT (the head node's GCS port, e.g. 10.0.0.5:6379), auto or local"
    ]


@pytest.mark.slow
def test_a_sweep_on_a_local_ray_prints_only_its_own_lines(tmp_path: Path) -> None:
    """Ray's own log messages ('Token authentication is enabled …') stay off stderr."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'kvtrace[ray]')")
    out = tmp_path / "r.parquet"
    args = [sys.executable, "-m", "kvtrace", "sweep", "sample:tiny", "--ray", "local", "-o", str(out)]
    result = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtrace: 1 cells"), lines
    assert pq.read_table(out).num_rows == 1


def test_the_report_marks_violations_in_results_that_called_them_ok(tmp_path: Path) -> None:
    """Results written before a cell's status said so: the report judges the rows itself."""
    import pyarrow as pa

    from kvtrace.sweep.report import report_rows

    base = {"cell": "k", "input": "sample:tiny", "kind": "replay", "status": "ok", "error": None, "pool_tokens": 3968}
    rows = [
        {**base, "num_violations": 2, "stopped_early": False},
        {**base, "num_violations": 0, "stopped_early": True},
        {**base, "num_violations": 0, "stopped_early": False},
    ]
    assert [r["status"] for r in report_rows(pa.Table.from_pylist(rows))] == ["violations", "oom", "ok"]
