"""A streaming session's ``hold`` and ``close`` are events of their own kinds, not a
``finish`` and an ``abort``: in the replay's snapshots, the state log's events column,
the dashboard's events log (its kinds and filter) and the exported timeline (a held turn
ends its slice ``held``; a close is an instant)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.record.recorder import Recorder
from kvtrace.statelog.log import read_state_log
from kvtrace.tui.widgets.events_log import EVENT_KINDS, EventsLog
from tests.helpers import SIZE, live_app, make_meta, play_to_end

runner = CliRunner()


def _two_turns(path: Path) -> Path:
    """Request 0: a session of two turns (held at steps 2 and 4, closed at 5); request 1
    finishes and request 2 is aborted, as before sessions."""
    with Recorder(path, make_meta(sessions=True), overwrite=True) as rec:
        rec.begin_step(0.0)
        rec.extend([0, 1, 2], [10, 6, 6], prompt_lens=[10, 6, 6])
        rec.end_step()
        rec.begin_step(0.1)
        rec.decode([0, 1, 2])
        rec.end_step()
        rec.begin_step(0.2)
        rec.finish([1])
        rec.hold([0])
        rec.abort([2])
        rec.end_step()
        rec.begin_step(0.3)
        rec.extend([0], [20], prefix_lens=[11])
        rec.end_step()
        rec.begin_step(0.4)
        rec.hold([0], held_lens=[19])
        rec.end_step()
        rec.begin_step(0.5)
        rec.close_session([0])
        rec.end_step()
    return path


_WANT = [(2, "finish", 1), (2, "hold", 0), (2, "abort", 2), (4, "hold", 0), (5, "close", 0)]


def test_the_state_log_types_a_hold_and_a_close_as_such(tmp_path: Path) -> None:
    trace = _two_turns(tmp_path / "s.kvtrace")
    log = tmp_path / "s.arrow"
    result = runner.invoke(app, ["replay", str(trace), "--out", str(log), "--json"])
    assert result.exit_code == 0, result.output
    _, snaps = read_state_log(log)
    events = [(s.step, e.kind, e.rid) for s in snaps for e in s.events if e.kind != "overalloc_release"]
    assert events == _WANT
    summary = json.loads(result.stdout)
    assert summary["session_held"]["holds"] == 2 and summary["session_held"]["closes"] == 1


def test_the_export_ends_a_held_turn_held_and_marks_the_close(tmp_path: Path) -> None:
    trace = _two_turns(tmp_path / "s.kvtrace")
    out = tmp_path / "s.json"
    result = runner.invoke(app, ["export", str(trace), "--out", str(out)])
    assert result.exit_code == 0, result.output
    events = json.loads(out.read_text())["traceEvents"]
    instants = [e["name"] for e in events if e.get("ph") == "i" and e["name"] != "overalloc_release"]
    assert instants == ["abort", "close"]
    ends = [e["args"]["end"] for e in events if e.get("ph") == "E" and "end" in e.get("args", {})]
    assert sorted(ends) == ["aborted", "finished", "held", "held"]


async def test_the_events_log_lists_holds_and_closes_under_their_kinds(tmp_path: Path) -> None:
    assert {"hold", "close"} <= set(EVENT_KINDS)
    app_ = live_app(str(_two_turns(tmp_path / "s.kvtrace")))
    async with app_.run_test(size=SIZE) as pilot:
        await play_to_end(pilot)
        log = app_.main.query_one(EventsLog)
        shown: dict[str, list[tuple[int, int | None]]] = {}
        for _ in range(len(EVENT_KINDS)):
            await pilot.press("k")  # the next kind
            shown[log.kind or ""] = [(e.step, e.rid) for e in log.shown]
        assert shown["hold"] == [(2, 0), (4, 0)] and shown["close"] == [(5, 0)]
        assert shown["finish"] == [(2, 1)] and shown["abort"] == [(2, 2)]
