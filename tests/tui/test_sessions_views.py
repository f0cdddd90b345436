"""The dashboard of a trace with streaming sessions shows the KV sessions hold between
turns: a "session held" band in the occupancy chart and legend, "held" requests (with their
held length) in the request table, the sessions open and held in the header and the
occupancy panel's title; live and from a state log. Other traces show none of it. The
occupancy legend fits a short panel (80x24) by giving the peak's step on the peak's line."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
from typer.testing import CliRunner

from allocator.base import PoolCounters
from kvtrace.cli import app as cli
from kvtrace.tui.widgets.dashboard import Dashboard
from kvtrace.tui.widgets.header import ReplayHeader
from kvtrace.tui.widgets.occupancy import OccupancyLegend, legend_lines
from kvtrace.tui.widgets.request_table import RequestTable
from tests.helpers import TINY, at_step, live_app, log_app, settle

SESSIONS = "sample:mooncake-sessions"
STEP = 1182  # the most session-held KV of the run: 11 sessions open, 9 of them held between turns


class _Reference(NamedTuple):
    pool: PoolCounters
    held: dict[int, int]  # rid -> kv_committed_len of the sessions held between turns
    num_open: int


def _reference(step: int) -> _Reference:
    """The allocator's own view after ``step``, from a replay of its own."""
    from kvtrace.replay.engine import ReplayOptions
    from kvtrace.replay.session import ReplaySession

    with ReplaySession(SESSIONS, options=ReplayOptions(decode_runs=False)) as session:
        while (snap := session.step()) is not None and snap.step < step:
            pass
        assert snap is not None
        alloc = session.allocator
        rids = np.arange(alloc._session_held.shape[0], dtype=np.int64)
        held = rids[alloc.session_held(rids) >= 0]
        lens = {int(r): alloc.kv_info(int(r)).kv_committed_len for r in held.tolist()}
        return _Reference(snap.pool, lens, int(alloc._turned.sum()))


async def _to_step(pilot, step: int) -> None:  # noqa: ANN001
    await pilot.press("g")
    await pilot.press(*str(step), "enter")
    await settle(pilot, at_step(step), timeout_s=90)


def _assert_held_rows(table: RequestTable, held: dict[int, int]) -> None:
    width = table.size.width
    table.set_filter("held")
    assert sorted(table.shown_rids.tolist()) == sorted(held), (table.shown_rids.tolist(), held)
    for i, rid in enumerate(table.shown_rids.tolist()):
        words = table.render_row(i, width, False).text.split()
        assert words[:2] == [str(rid), "held"], words
        assert f"{held[rid]:,}" in words, (rid, words)  # its used length: the KV its session holds
    table.set_filter("")


async def test_the_live_dashboard_shows_the_kv_sessions_hold() -> None:
    want = _reference(STEP)
    assert want.pool.session_held > 0 and want.num_open > len(want.held) >= 2, want
    app = live_app(SESSIONS, checkpoint_every=200)
    async with app.run_test(size=(160, 48)) as pilot:
        await _to_step(pilot, STEP)
        assert app.frame.pool == want.pool
        legend = app.main.query_one(OccupancyLegend).content.plain
        total = want.pool.pool_tokens
        assert f"█ session held{'':<5}{want.pool.session_held:>10,} {100 * want.pool.session_held / total:6.1f}%" \
            in legend, legend
        sessions = f"sessions {want.num_open} open · {len(want.held)} held"
        header = app.main.query_one(ReplayHeader).content.plain.splitlines()[0]
        assert sessions in header and "version builtin" in header, header
        assert app.main.query_one(Dashboard).query_one("#occupancy").border_title == f"occupancy · {sessions}"
        _assert_held_rows(app.main.query_one(RequestTable), want.held)
        # back through a checkpoint: the sessions of then (a checkpoint keeps them)
        earlier = _reference(400)
        await _to_step(pilot, 400)
        assert app.frame.pool == earlier.pool
        _assert_held_rows(app.main.query_one(RequestTable), earlier.held)


async def test_a_state_logs_view_shows_the_kv_sessions_hold(tmp_path: Path) -> None:
    want = _reference(STEP)
    path = tmp_path / "sessions.log"
    result = CliRunner().invoke(cli, ["replay", SESSIONS, "--steps", f":{STEP + 1}", "--out", str(path)])
    assert result.exit_code == 0, result.output
    app = log_app(path)
    async with app.run_test(size=(120, 40)) as pilot:
        await _to_step(pilot, STEP)
        legend = app.main.query_one(OccupancyLegend).content.plain
        assert f"session held{'':<5}{want.pool.session_held:>10,}" in legend, legend
        title = app.main.query_one(Dashboard).query_one("#occupancy").border_title
        assert title == f"occupancy · sessions {want.num_open} open · {len(want.held)} held", title
        _assert_held_rows(app.main.query_one(RequestTable), want.held)


async def test_a_trace_without_sessions_shows_none() -> None:
    app = live_app(TINY)
    async with app.run_test(size=(160, 48)) as pilot:
        await _to_step(pilot, 60)
        assert "session" not in app.main.query_one(OccupancyLegend).content.plain
        assert "session" not in app.main.query_one(ReplayHeader).content.plain
        assert app.main.query_one(Dashboard).query_one("#occupancy").border_title == "occupancy"
        with pytest.raises(ValueError, match="held"):
            app.main.query_one(RequestTable).set_filter("helt")


def _pool(session_held: int = 0) -> PoolCounters:
    return PoolCounters(pool_tokens=1000, available=100, evictable=200, protected=300, committed=250 - session_held,
                        overallocated=150, running_requests=7, free_rows=9, session_held=session_held)


def test_a_short_legend_puts_the_peaks_step_on_the_peaks_line() -> None:
    tall = [line.plain for line in legend_lines(_pool(50), (865, 918), sessions=True)]
    assert len(tall) == 10 and tall[-3].split() == ["peak", "918", "91.8%"] and tall[-2].split() == ["at", "step", "865"]
    short = [line.plain for line in legend_lines(_pool(50), (865, 918), sessions=True, rows=9)]
    assert len(short) == 9 and short[-2].split() == ["peak", "@865", "918", "91.8%"], short
    assert short[:-2] == tall[:-3] and short[-1] == tall[-1]  # nothing else changes
    # room for every line: the legend as it always was
    assert [line.plain for line in legend_lines(_pool(), (865, 918), rows=11)] == \
        [line.plain for line in legend_lines(_pool(), (865, 918))]
    assert "session" not in "".join(line.plain for line in legend_lines(_pool(), None))


@pytest.mark.parametrize("size", [(80, 24), (120, 40)], ids=["80x24", "120x40"])
def test_sessions_dashboard(snap_compare, size: tuple[int, int]) -> None:  # noqa: ANN001
    """Session-held KV in the legend and chart, the held sessions in the table (filtered
    by ``held``), the sessions in the header and the occupancy title."""
    async def run_before(pilot) -> None:  # noqa: ANN001
        await _to_step(pilot, STEP)
        await pilot.press("/", *"held", "enter")
        await pilot.pause(0.3)

    assert snap_compare(live_app(SESSIONS, fixed_clock=True, checkpoint_every=200), terminal_size=size,
                        run_before=run_before)


@pytest.mark.parametrize("trace", [SESSIONS, "sample:mooncake-gpt-oss"])
async def test_the_legend_fits_the_occupancy_panel_at_80x24(trace: str) -> None:
    # The sessions' legend has a line more; a hybrid model's header a row more: every line
    # shows (the running requests were cut), the peak's step on the peak's line.
    app = live_app(trace, checkpoint_every=200)
    async with app.run_test(size=(80, 24)) as pilot:
        await _to_step(pilot, 200)
        legend = app.main.query_one(OccupancyLegend)
        lines = legend.content.plain.splitlines()
        assert len(lines) <= legend.size.height, (lines, legend.size)
        assert lines[-1].startswith("running") and lines[-2].startswith("peak @"), lines
        await pilot.resize_terminal(120, 40)  # room again: the peak's step on a line of its own
        await pilot.pause(0.3)
        lines = legend.content.plain.splitlines()
        assert lines[-2].strip().startswith("at step") and lines[-3].split()[0] == "peak", lines


async def test_a_held_requests_detail_says_what_its_session_keeps() -> None:
    from kvtrace.tui.screens import RequestDetailScreen

    want = _reference(STEP)
    rid = min(want.held)
    app = live_app(SESSIONS, checkpoint_every=200)
    async with app.run_test(size=(120, 40)) as pilot:
        await _to_step(pilot, STEP)
        app.main.query_one(RequestTable).select_rid(rid)
        await pilot.pause()
        await pilot.press("enter")
        await pilot.pause(0.3)
        assert isinstance(app.screen, RequestDetailScreen)
        text = str(app.screen.query_one("#detail-row").render())
        assert text.startswith("phase held · ") and "its turn ended at step " in text, text
        assert f"held: its session keeps {want.held[rid]:,} tokens of KV until its next turn" in text, text


def test_a_diff_sides_line_gives_the_session_held_kv() -> None:
    """A diff side has no legend: the line under its chart names the session-held KV of a
    trace with sessions, and only there."""
    from types import SimpleNamespace

    from kvtrace.tui.widgets.dashboard import side_numbers

    pool = _pool(50)
    for sessions, want in ((True, "used 700 (70.0%) · over 150 · session held 50 · locked 300 · "),
                           (False, "used 700 (70.0%) · over 150 · locked 300 · ")):
        frame = SimpleNamespace(pool=pool, other_pools=(), pool_names=("full",), sessions=sessions,
                                peak=lambda pool=0: (865, 918))
        assert side_numbers(frame, 0).startswith(want), side_numbers(frame, 0)  # type: ignore[arg-type]
