"""The replay in its own process (``link.ChildReplay`` over ``python -m kvtrace.proc.child``, as
``kvtrace replay --tui`` runs it): keys move it, the screen's fold equals a session's,
the page map comes across (or a note for a version without the ownership query), the
steps replayed go to the state log, and errors in the child (an OOM, a crash, a bad
setup) are notifications and events, never a frozen screen."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from kvtrace.proc.contracts import Command
from kvtrace.statelog.session import StateLogSession
from kvtrace.versions.registry import resolve_version
from kvtrace.replay.engine import ReplayOptions
from kvtrace.replay.session import ReplaySession
from kvtrace.tui.app import KvtraceApp
from kvtrace.tui.widgets.toasts import AlertToasts
from kvtrace.tui.remote.link import ChildReplay, ReplayProcessError
from kvtrace.tui.remote.pagemap import NO_PAGE_MAP
from kvtrace.tui.remote.replayer import FIRST_PASS_S, dashboard_job, live_source, log_job
from kvtrace.tui.widgets.events_log import EventsLog
from tests.helpers import SIZE, TINY, at_step, priority_once_set, settle
from traces.samples import resolve_trace

FAULTY = str(Path(__file__).parent.parent / "kvtrace" / "faulty_allocators.py")


def _child(version: str = "builtin", *, log: str | None = None, **options: object) -> ChildReplay:
    job = dashboard_job(resolve_version(version), str(resolve_trace(TINY)), trace_label=TINY, page_size=None,
                        pool_tokens=options.pop("pool_tokens", None), device="cpu",  # type: ignore[arg-type]
                        options=dataclasses.asdict(ReplayOptions(**options)),  # type: ignore[arg-type]
                        checkpoint_every=20, play=False, log=log)
    assert job.side is not None
    link = ChildReplay(dataclasses.replace(job, side=dataclasses.replace(job.side, checker="inline")))
    link.wait_started()
    return link


@pytest.mark.slow
async def test_keys_move_the_replay_process_and_the_fold_follows(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    link = _child(log=str(log))
    app = KvtraceApp(link)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda a: a.frame.step is None)  # paused before the first step
        assert app.driver.info is not None and app.driver.info.live
        await pilot.press("g", *"90", "enter")
        await settle(pilot, lambda a: at_step(90)(a) and a.frame.page_map_step == 90)
        cells = app.frame.page_cells
        assert cells is not None and cells.positional
        assert int(cells.tokens.sum()) == app.frame.pool.pool_tokens + 16  # every slot, page 0 included
        await pilot.press("shift+left")  # back through a checkpoint: a position message
        await settle(pilot, at_step(0))
        await pilot.press("right", "right", "right")
        await settle(pilot, at_step(3))
        with ReplaySession(TINY, track_state=True, checker="inline") as ref:
            ref.seek(3)
            assert app.driver.state.table() == ref.state.table()
            assert app.frame.pool == ref.last.pool
        assert app.frame.timeline_size == 91  # the timeline keeps every step replayed
        await pilot.press("q")
    assert link.proc.wait(timeout=30) == 0
    with StateLogSession(log) as saved:  # every step replayed once, in order
        assert (saved.first_step, saved.last_step) == (0, 90)


@pytest.mark.slow
async def test_a_version_without_the_ownership_query_says_so() -> None:
    app = KvtraceApp(_child(f"{FAULTY}:without_ownership"))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("right")
        await settle(pilot, lambda a: at_step(0)(a) and a.frame.page_map_note is not None)
        assert app.frame.page_map_note == NO_PAGE_MAP and app.frame.page_cells is None
        await pilot.pause(0.2)
        assert "no page map" in str(app.dashboards[0].query_one("#cell-info").content)


@pytest.mark.slow
async def test_an_oom_and_a_crash_in_the_replay_process_are_reported() -> None:
    link = _child(pool_tokens=640)  # too small for the tiny sample: an OOM stops the replay
    app = KvtraceApp(link)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("space")
        await settle(pilot, lambda a: a.frame.done)
        assert app.main.query_one(AlertToasts).counts().get((0, "oom"), 0) >= 1  # the alert card of its kind
        os.kill(link.proc.pid, signal.SIGKILL)
        await settle(pilot, lambda a: any("exited with code -9" in n.message for n in a._notifications))
        log = app.dashboards[0].query_one(EventsLog)
        assert any("exited with code -9" in str(e.detail) for e in log.shown)
        await pilot.press("left")  # the screen still answers
        await pilot.press("q")


@pytest.mark.parametrize(("every", "seconds"), [(None, FIRST_PASS_S), (60, None)])
def test_the_replay_process_paces_its_first_pass_in_seconds_unless_told_steps(every: int | None,
                                                                            seconds: float | None) -> None:
    job = dashboard_job(resolve_version("builtin"), str(resolve_trace(TINY)), trace_label=TINY, page_size=None,
                        pool_tokens=None, device="cpu", options=dataclasses.asdict(ReplayOptions()),
                        checkpoint_every=20, first_pass_every=every, play=False)
    assert job.side is not None
    source = live_source(dataclasses.replace(job, side=dataclasses.replace(job.side, checker="inline")))
    try:
        session = source.session
        assert (session.first_pass_every, session.first_pass_seconds) == (every, seconds)
    finally:
        source.close()


def test_a_bad_setup_is_one_line() -> None:
    with pytest.raises(ReplayProcessError, match="state log .*: no such file"):
        ChildReplay(log_job("/nonexistent/run.log")).wait_started(timeout=60)


_GARBLED_CHILD = """
import os, sys, time
from multiprocessing.connection import Connection
from kvtrace.proc.contracts import Info
control = Connection(int(sys.argv[-1]), readable=False)
control.send((0, Info("fake", "", "", "builtin", 0, 9, True).to_wire()))
Connection(0, writable=False).recv()  # the screen's first command: it has seen the info message
Connection(1, readable=False).send_bytes(b"not a pickle of an update, forty bytes!!")
time.sleep(120)  # alive, as a child whose stream broke would be
"""


def test_a_broken_update_stream_stops_the_child_and_says_why(tmp_path: Path) -> None:
    script = tmp_path / "garbled_child.py"
    script.write_text(_GARBLED_CHILD)
    python = tmp_path / "python"  # an interpreter that runs the script whatever module it is asked for
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    python.chmod(0o755)
    link = ChildReplay(log_job("unused.log"), python=str(python))
    link.wait_started(timeout=60)
    link.command(Command("play"))
    deadline = time.monotonic() + 60
    items = []
    while time.monotonic() < deadline and not (items and items[-1][0] == "closed"):
        item = link.get(0.1)
        if item is not None:
            items.append(item)
    assert items and items[-1][0] == "closed", items
    assert "update stream broke (ValueError: not an update frame (it begins b'not a pi')" in str(items[-1][1])
    assert link.proc.poll() is not None  # stopped, not left running
    link.close()


_MISSPELLED_CHILD = """
import sys, time
from multiprocessing.connection import Connection
control = Connection(int(sys.argv[-1]), readable=False)
control.send((0, {"kind": "infoo", "name": "fake"}))
time.sleep(120)  # alive: the screen must stop it
"""


def test_a_message_of_an_unknown_kind_stops_the_child_and_names_the_kind(tmp_path: Path) -> None:
    script = tmp_path / "misspelled_child.py"
    script.write_text(_MISSPELLED_CHILD)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    python.chmod(0o755)
    link = ChildReplay(log_job("unused.log"), python=str(python))
    with pytest.raises(ReplayProcessError, match=r"messages broke \(ContractError: unknown message kind 'infoo' "
                                                 r"\(valid: info, status"):
        link.wait_started(timeout=60)
    assert link.proc.poll() is not None  # stopped, not left running


@pytest.mark.slow
def test_the_replay_process_gets_the_environment_defaults_unless_the_user_set_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtrace.tui.remote.link import CHILD_ENV

    def environ(link: ChildReplay) -> dict[str, str]:
        raw = Path(f"/proc/{link.proc.pid}/environ").read_bytes().split(b"\0")
        return dict(item.decode().split("=", 1) for item in raw if b"=" in item)

    if not Path("/proc/self/environ").exists():
        pytest.skip("no /proc: the environment of another process cannot be read here")
    for name in CHILD_ENV:
        monkeypatch.delenv(name, raising=False)
    link = _child()
    try:
        assert {k: environ(link).get(k) for k in CHILD_ENV} == CHILD_ENV
    finally:
        link.close()
    monkeypatch.setenv("NUMPY_MADVISE_HUGEPAGE", "1")
    link = _child()
    try:
        assert environ(link)["NUMPY_MADVISE_HUGEPAGE"] == "1"
    finally:
        link.close()


@pytest.mark.slow
def test_the_replay_process_checks_its_steps_at_a_lower_priority() -> None:
    """Beside a screen the op-sequence checker (the replay process's own child, ahead of
    it) runs ``CHECKER_NICE`` lower than the replay and the screen."""
    from kvtrace.tui.remote.replayer import CHECKER_NICE

    if not hasattr(os, "getpriority") or not Path("/proc/self/task").exists():
        pytest.skip("no /proc or os.getpriority here: another process's children and priority cannot be read")
    job = dashboard_job(resolve_version("builtin"), str(resolve_trace("sample:mooncake-conversation")),
                        trace_label="sample", page_size=None, pool_tokens=None, device="cpu",
                        options=dataclasses.asdict(ReplayOptions()), checkpoint_every=2000, play=False)
    link = ChildReplay(job)
    try:
        link.wait_started()
        pid = link.proc.pid
        children = [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
                    for c in (task / "children").read_text().split()]
        assert len(children) == 1, children  # the checker (it checks the hour's 77,271 steps for seconds)
        wanted = min(os.getpriority(os.PRIO_PROCESS, pid) + CHECKER_NICE, 19)
        assert priority_once_set(children[0], wanted) == wanted
        assert os.getpriority(os.PRIO_PROCESS, pid) == os.getpriority(os.PRIO_PROCESS, 0)  # the replay's own is not
    finally:
        link.close()
