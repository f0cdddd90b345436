"""The typed contracts between kvtrace and its children (``kvtrace.proc.contracts``): each
survives its serialisation (JSON for a job, a pickle through a real pipe for a message
or command), and a wire form with an unknown kind or field, or a missing field, fails at
the boundary with an error naming it."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

from kvtrace.proc import contracts as c
from kvtrace.proc.channel import connection

SIDE = c.SideJob(trace="/t/run.kvtrace", spec="git:abc123", label="abc123", origin="commit abc123",
                 trace_label="sample:tiny", page_size=16, pool_tokens=4096, device="cpu",
                 options={"stop_step": 50, "state_digest": True}, checker="inline", checker_fd=7,
                 allocator_root="/tmp/checkout", code="tree:deadbeef")

JOBS = [
    SIDE,
    c.SideJob(trace="t", spec="builtin", label="builtin"),
    c.DashboardJob(play=True, side=SIDE, checkpoint_every=20, first_pass_seconds=2.5, log="/tmp/run.log"),
    c.DashboardJob(play=False, state_log="/tmp/run.log", label="run.log"),
    c.DashboardJob(play=False, side=SIDE, explain=True),
]

MESSAGES = [
    c.Started({"page_size": 16, "pool_tokens": 4096}, "builtin", "kvtrace's own"),
    c.Ended({"steps": 91, "oom": None, "overalloc": {"released": 12}}),
    c.Failed("trace 'x': no such file", True, "Traceback ..."),
    c.Info("sample:tiny", "synthetic", "16 x 256", "builtin", 0, 90, True, 16),
    c.Status(True, 5, False),
    c.Busy("making going back quick"),
    c.Busy(None),
    c.Position(42, 1.5, (4096, 100, 0, 0, 0, 0, 0, 0), 42, {"phase": np.arange(5, dtype=np.int8),
                                                           "allocated": np.arange(5, dtype=np.int64)}),
    c.Position(None, 0.0, None, None, {}),
    c.Cells(42, np.arange(11), np.ones((10, 4), np.int64), np.zeros(10, np.int8), np.zeros(10, bool), True),
    c.Cells(42, note="no page map"),
    c.Cell(42, {"used": 16}, c.CellDetail(3, 12, 15, {"used": 16}, [(1, 12), (4, 4)])),
    c.Cell(None, {}, None),
    c.History(7, np.arange(3), np.array([16, 32, 48]), np.array([10, 20, 30]), [(1, "finish", 7, 48, "")], False),
    c.ReplayError("internal error: boom"),
    c.InputWarning("the last 3 steps were cut"),
    c.Explained(2, 9, {"cold": 1, "evicted": 8}, [(3, "admission", 1, 1, 8)]),
    c.Explained(5, note="explain is off"),
    c.Command("play"),
    c.Command("explain", 2),
    c.Command("seek", 120),
    c.Command("step", -1),
    c.Command("select", None),
    c.Command("select", 4),
]


def _same(a: object, b: object) -> bool:
    """Equal, numpy arrays (anywhere inside) compared by dtype and values."""
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))  # type: ignore[arg-type]
    return a == b


@pytest.mark.parametrize("job", JOBS, ids=lambda j: type(j).__name__)
def test_a_job_survives_the_json_of_its_wire_form(job: c.Contract) -> None:
    back = c.decode(json.loads(json.dumps(job.to_wire())), (c.SideJob, c.DashboardJob))
    assert back == job and type(back) is type(job)


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: m.KIND)
def test_a_message_survives_a_pipe(message: c.Contract) -> None:
    read_fd, write_fd = os.pipe()
    writer, reader = connection(write_fd, readable=False), connection(read_fd, writable=False)
    try:
        writer.send(message.to_wire())
        back = c.decode(reader.recv())
    finally:
        writer.close()
        reader.close()
    assert _same(back, message), (back, message)


def test_every_kind_is_tested() -> None:
    kinds = {type(x) for x in JOBS + MESSAGES} | {c.CellDetail}
    assert kinds == set(c._KINDS.values())


def test_an_unknown_kind_fails_naming_it_and_the_valid_ones() -> None:
    with pytest.raises(c.ContractError, match=r"unknown message kind 'statsu' \(valid: info, status, busy"):
        c.decode({"kind": "statsu", "playing": True}, c.DASHBOARD_MESSAGES)
    with pytest.raises(c.ContractError, match="unknown message kind 'side_job'"):  # a kind this boundary does not carry
        c.decode(SIDE.to_wire(), c.DASHBOARD_MESSAGES)
    with pytest.raises(c.ContractError, match="not a message"):
        c.decode(["play"])


def test_a_misspelled_or_missing_field_fails_naming_it() -> None:
    wire = c.Status(True, 5, False).to_wire()
    wire["speed_idx"] = wire.pop("speed_index")
    with pytest.raises(c.ContractError, match=r"status message: unknown field\(s\) 'speed_idx' \(valid: playing, "
                                              r"speed_index, done\)"):
        c.decode(wire)
    del wire["speed_idx"]
    wire = {k: v for k, v in SIDE.to_wire().items() if k != "spec"}
    with pytest.raises(c.ContractError, match=r"side_job message: missing field\(s\) 'spec'"):
        c.decode(wire)
    nested = JOBS[2].to_wire()
    nested["side"]["traec"] = nested["side"].pop("trace")  # inside the dashboard job's side
    with pytest.raises(c.ContractError, match="side_job message: unknown field.*'traec'"):
        c.decode(nested)


def test_a_misspelled_command_or_argument_fails_at_the_screen() -> None:
    with pytest.raises(c.ContractError, match=r"unknown dashboard command 'sek' \(valid: play, pause"):
        c.Command("sek", 3)  # type: ignore[arg-type]
    with pytest.raises(c.ContractError, match="'seek' takes an int"):
        c.Command("seek")
    with pytest.raises(c.ContractError, match="'play' takes no argument"):
        c.Command("play", 1)
    with pytest.raises(c.ContractError, match="unknown dashboard command 'sek'"):
        c.decode({"kind": "command", "name": "sek", "arg": 3})


def test_a_dashboard_job_replays_a_side_or_a_log() -> None:
    with pytest.raises(c.ContractError, match="either a side or a state log"):
        c.DashboardJob(play=True)
    with pytest.raises(c.ContractError, match="either a side or a state log"):
        c.DashboardJob(play=True, side=SIDE, state_log="x.log")


def test_a_child_given_a_bad_job_reports_it_as_one_error(tmp_path: object) -> None:
    """The child decodes its job inside its error handling: a misspelled field is a
    ``Failed`` on the control channel naming it, and exit code 2."""
    import subprocess
    import sys

    from kvtrace.diff.sides import child_command
    from kvtrace.proc.channel import receive_all

    wire = SIDE.to_wire()
    wire["pagesize"] = wire.pop("page_size")
    read_fd, write_fd = os.pipe()
    proc = subprocess.run(child_command(sys.executable, json.dumps(wire), str(write_fd)), pass_fds=(write_fd,),
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60)
    os.close(write_fd)
    messages = [c.decode(m, (c.Failed,)) for m in receive_all(connection(read_fd, writable=False))]
    assert proc.returncode == 2
    assert len(messages) == 1 and not messages[0].user
    assert "ContractError: side_job message: unknown field(s) 'pagesize'" in messages[0].error
