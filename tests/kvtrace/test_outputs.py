"""Outputs never destroy data: an input is never an output, an existing file is replaced
only with --force and only when the new one is complete (kvtrace.outputs, and the
commands that write through it)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.errors import OutputError
from kvtrace.outputs import OutputFile
from traces.samples import sample_path

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]
MOONCAKE = ROOT / "traces" / "workloads_data" / "mooncake-fast25" / "conversation_trace.jsonl"


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def one_error_line(stderr: str, *fragments: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtrace: error: "), stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


# -- the helper --------------------------------------------------------------------------


def test_an_input_is_refused_however_it_is_spelled(tmp_path: Path) -> None:
    data = tmp_path / "data.kvtrace"
    data.write_bytes(b"x")
    (tmp_path / "link.kvtrace").symlink_to(data)
    os.link(data, tmp_path / "hard.kvtrace")
    (tmp_path / "sub").mkdir()
    for spelling in (data, tmp_path / "link.kvtrace", tmp_path / "hard.kvtrace", tmp_path / "sub" / ".." / "data.kvtrace"):
        with pytest.raises(OutputError, match="is the input .*writing it would destroy the input"):
            OutputFile(spelling, force=True, inputs=[data])
    assert data.read_bytes() == b"x"


def test_existing_files_directories_and_missing_parents(tmp_path: Path) -> None:
    existing = tmp_path / "old.arrow"
    existing.write_bytes(b"old")
    with pytest.raises(OutputError, match=r"old\.arrow already exists; pass --force to overwrite it"):
        OutputFile(existing)
    assert OutputFile(existing, force=True).replaces
    with pytest.raises(OutputError, match="is a directory"):
        OutputFile(tmp_path, force=True)
    with pytest.raises(OutputError, match="does not exist; create it first"):
        OutputFile(tmp_path / "nowhere" / "x.arrow")
    assert not OutputFile(tmp_path / "new.arrow").replaces


def test_writing_renames_into_place_only_when_complete(tmp_path: Path) -> None:
    path = tmp_path / "out.arrow"
    path.write_bytes(b"old")
    out = OutputFile(path, force=True)
    with pytest.raises(KeyboardInterrupt):
        with out.writing() as tmp:
            tmp.write_bytes(b"half")
            assert tmp.parent == tmp_path and path.read_bytes() == b"old"
            raise KeyboardInterrupt
    assert path.read_bytes() == b"old" and leftovers(tmp_path) == []
    with out.writing() as tmp:
        tmp.write_bytes(b"new")
    assert path.read_bytes() == b"new" and leftovers(tmp_path) == []


def test_a_recording_writes_a_new_file_in_place_and_replaces_an_old_one_at_the_end(tmp_path: Path) -> None:
    fresh = OutputFile(tmp_path / "fresh.kvtrace")
    with pytest.raises(KeyboardInterrupt):
        with fresh.recording() as live:
            assert live == tmp_path / "fresh.kvtrace"  # a killed recording leaves its steps here
            live.write_bytes(b"partial")
            raise KeyboardInterrupt
    assert (tmp_path / "fresh.kvtrace").read_bytes() == b"partial"
    old = tmp_path / "old.kvtrace"
    old.write_bytes(b"old")
    again = OutputFile(old, force=True)
    with pytest.raises(KeyboardInterrupt):
        with again.recording() as live:
            assert live != old
            live.write_bytes(b"partial")
            raise KeyboardInterrupt
    assert old.read_bytes() == b"old" and leftovers(tmp_path) == []
    with again.recording() as live:
        live.write_bytes(b"complete")
    assert old.read_bytes() == b"complete"


# -- the commands ------------------------------------------------------------------------


def test_replay_refuses_to_write_its_state_log_over_the_trace(tmp_path: Path) -> None:
    victim = tmp_path / "victim.kvtrace"
    victim.write_bytes(sample_path("tiny").read_bytes())
    before = victim.read_bytes()
    for args in (["--out", str(victim)], ["--out", str(victim), "--force"]):
        result = runner.invoke(app, ["replay", str(victim), *args])
        assert result.exit_code == 2
        one_error_line(result.stderr, f"--out {victim} is the input {victim}")
    assert victim.read_bytes() == before
    sample = runner.invoke(app, ["replay", "sample:tiny", "--out", str(sample_path("tiny")), "--force"])
    assert sample.exit_code == 2 and "is the input" in sample.stderr


def test_replay_out_needs_force_to_replace_a_file(tmp_path: Path) -> None:
    log = tmp_path / "state.arrow"
    log.write_bytes(b"keep me")
    refused = runner.invoke(app, ["replay", "sample:tiny", "--out", str(log)])
    assert refused.exit_code == 2
    one_error_line(refused.stderr, "already exists; pass --force to overwrite it")
    assert log.read_bytes() == b"keep me"
    forced = runner.invoke(app, ["replay", "sample:tiny", "--out", str(log), "--force", "--json"])
    assert forced.exit_code == 0, forced.output
    assert log.read_bytes()[:6] == b"ARROW1" and leftovers(tmp_path) == []


def test_an_interrupted_replay_leaves_the_old_state_log_intact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtrace.statelog.log import StateLogWriter

    log = tmp_path / "state.arrow"
    log.write_bytes(b"the previous log")
    written = []
    original = StateLogWriter.write

    def write_then_interrupt(self: StateLogWriter, snap: object) -> None:
        original(self, snap)
        written.append(snap)
        if len(written) == 40:
            raise KeyboardInterrupt  # Ctrl-C in the middle of the replay

    monkeypatch.setattr(StateLogWriter, "write", write_then_interrupt)
    result = runner.invoke(app, ["replay", "sample:tiny", "--out", str(log), "--force"])
    assert result.exit_code == 130 and "kvtrace: interrupted" in result.stderr
    assert log.read_bytes() == b"the previous log" and leftovers(tmp_path) == []


def test_record_never_writes_over_its_workload(tmp_path: Path) -> None:
    workload = tmp_path / "w.jsonl"
    workload.write_bytes(MOONCAKE.read_bytes()[:20_000].rsplit(b"\n", 1)[0] + b"\n")
    before = workload.read_bytes()
    result = runner.invoke(app, ["record", str(workload), "--out", str(workload), "--force"])
    assert result.exit_code == 2
    one_error_line(result.stderr, f"--out {workload} is the input {workload}")
    assert workload.read_bytes() == before


# -- races, devices, signals, stale temporary files ----------------------------------------


def _kvtrace(*args: str, **popen: object) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-m", "kvtrace", *args], cwd=ROOT, env=env, text=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **popen,  # type: ignore[arg-type]
    )  # fmt: skip


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.mark.slow
def test_two_replays_racing_to_one_new_out_cannot_both_succeed(tmp_path: Path) -> None:
    """Both start before either ends (the existence check passes for both): exactly one
    log is put in place, the other run exits 2 with one line and leaves no temporary file."""
    for attempt in range(2):
        log = tmp_path / f"race{attempt}.arrow"
        procs = [_kvtrace("replay", "sample:tiny", "--out", str(log), "-q", "--json") for _ in range(2)]
        results = [(proc.wait(timeout=300), proc.stderr.read()) for proc in procs]  # type: ignore[union-attr]
        codes = sorted(code for code, _ in results)
        assert codes == [0, 2], results
        loser = next(err for code, err in results if code == 2)
        one_error_line(loser, f"--out {log} was created by another process")
        assert log.read_bytes()[:6] == b"ARROW1" and leftovers(tmp_path) == []


def test_a_finished_output_is_not_put_over_a_file_that_appeared_meanwhile(tmp_path: Path) -> None:
    path = tmp_path / "out.arrow"
    out = OutputFile(path)
    with pytest.raises(OutputError, match="was created by another process while this one ran"):
        with out.writing() as tmp:
            tmp.write_bytes(b"mine")
            path.write_bytes(b"theirs")  # the other run finished first
    assert path.read_bytes() == b"theirs" and leftovers(tmp_path) == []
    fresh = tmp_path / "fresh.kvtrace"
    claim = OutputFile(fresh)
    fresh.write_bytes(b"theirs")
    with pytest.raises(OutputError, match="was created by another process meanwhile"):
        with claim.recording():
            pass
    assert fresh.read_bytes() == b"theirs"


def test_devices_fifos_and_dash_are_refused_even_with_force(tmp_path: Path) -> None:
    null = tmp_path / "null"
    os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # the device /dev/null is
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, kind in ((null, "a character device"), (fifo, "a FIFO")):
        for force in (False, True):
            with pytest.raises(OutputError, match=f"is {kind}, not a regular file"):
                OutputFile(path, force=force)
    with pytest.raises(OutputError, match="--out -: this output is a file, not standard output"):
        OutputFile("-", force=True)
    for args in (
        ["replay", "sample:tiny", "--out", str(null), "--force"],
        ["shrink", "sample:tiny", "--until", "oom", "--pool-tokens", "1200", "--out", str(fifo), "--force"],
        ["record", str(sample_path("tiny")), "--out", str(null), "--force"],
        ["sweep", "sample:tiny", "--pool-tokens", "30k,45k", "--out", str(null), "--force"],
    ):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert "not a regular file" in result.stderr, (args, result.stderr)
    assert stat.S_ISCHR(os.stat(null).st_mode) and stat.S_ISFIFO(os.stat(fifo).st_mode)


@pytest.mark.slow
def test_sigterm_mid_replay_removes_the_temporary_file(tmp_path: Path) -> None:
    log = tmp_path / "state.arrow"
    proc = _kvtrace("replay", "sample:mooncake-conversation", "--out", str(log), "-q")
    deadline = time.monotonic() + 120
    try:
        while not leftovers(tmp_path):
            assert proc.poll() is None, proc.stderr.read()  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the replay never started writing"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert stderr.strip().splitlines() == ["kvtrace: terminated by SIGTERM"]
    assert leftovers(tmp_path) == [] and not log.exists()


def test_temporary_files_of_killed_runs_are_removed_by_the_next_run(tmp_path: Path) -> None:
    log = tmp_path / "state.arrow"
    dead = _dead_pid()
    stale = [
        tmp_path / f".state.arrow.{dead}-0a1b2c.tmp",
        tmp_path / f"..state.arrow.{dead}-0a1b2c.tmp.{dead}-3d4e5f.tmp",  # a compaction's, of a temporary file
    ]
    live = tmp_path / f".state.arrow.{os.getpid()}-abcdef.tmp"  # a run still writing
    other = tmp_path / f".other.arrow.{dead}-0a1b2c.tmp"  # another destination's
    for path in (*stale, live, other):
        path.write_bytes(b"partial")
    result = runner.invoke(app, ["replay", "sample:tiny", "--out", str(log)])
    assert result.exit_code == 0, result.output
    assert leftovers(tmp_path) == sorted([live.name, other.name])
