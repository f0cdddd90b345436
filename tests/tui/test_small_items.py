"""The dashboard's smaller fixes of issue #41, one Pilot test each: the ``finish``
event kind lists the requests the trace finished, ..."""

from __future__ import annotations

import numpy as np
import pytest

from kvtrace.replay.snapshot import PHASES
from kvtrace.tui.widgets.events_log import EventsLog
from tests.helpers import SIZE, at_step, live_app, settle


async def test_the_finish_kind_lists_the_requests_the_trace_finished() -> None:
    app = live_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("shift+right")
        await settle(pilot, at_step(99))
        log = app.main.query_one(EventsLog)
        while log.kind != "finish":  # k cycles the kinds shown
            await pilot.press("k")
        shown = log.shown
        req = app.frame.requests
        finished = np.flatnonzero(req.phase == PHASES.index("finished"))
        assert shown and finished.shape[0]
        assert {e.kind for e in shown} == {"finish"} and all(e.step <= 99 for e in shown)
        assert {e.rid for e in shown} >= set(finished.tolist())
        for rid in finished.tolist():  # the last finish of each is the step it ended
            assert max(e.step for e in shown if e.rid == rid) == int(req.ended_step[rid]), rid


async def test_request_detail_shows_events_up_to_the_step_shown_and_negative_values() -> None:
    from kvtrace.replay.state import StepEvent
    from kvtrace.tui.driver import RequestHistory
    from kvtrace.tui.screens import RequestDetailScreen
    from kvtrace.tui.widgets.request_table import RequestTable

    from tests.helpers import play_to_end, text_of

    app = live_app()
    async with app.run_test(size=SIZE) as pilot:
        last = await play_to_end(pilot)
        late = [e for e in last.timeline.events if e.rid is not None and e.step > 100]
        seen = {r for r in np.flatnonzero(last.requests.admitted_step >= 0).tolist()
                if 0 <= last.requests.admitted_step[r] <= 90}
        rid = next(e.rid for e in late if e.rid in seen)  # a request with events after step 100
        await pilot.press("g", *"100", "enter")
        await settle(pilot, at_step(100), timeout_s=60)
        app.main.query_one(RequestTable).select_rid(rid)
        await pilot.pause()
        await pilot.press("enter")
        await settle(pilot, lambda a: isinstance(a.screen, RequestDetailScreen)
                     and "events:" in text_of(a.screen.query_one("#detail-events")))
        text = text_of(app.screen.query_one("#detail-events"))
        steps = [int(line.split()[1]) for line in text.splitlines() if line.startswith("step ")]
        assert all(s <= 100 for s in steps), text
        # a broken version's used > allocated: the over-allocation chart goes below zero
        screen = app.screen
        assert isinstance(screen, RequestDetailScreen)
        screen.show_history(RequestHistory(0, rid, np.array([1, 2, 3]), np.array([10, 10, 12]),
                                           np.array([8, 14, 12]), [StepEvent(2, "bad_op", rid, 0, "x")], False))
        await pilot.pause()
        over = screen.query_one("#detail-over")
        assert over._user_y_min is not None and over._user_y_min <= -4


async def test_the_used_over_bar_is_in_proportion_for_tiny_over_allocation() -> None:
    from kvtrace.tui.widgets.request_table import RequestTable

    eighths = {"█": 8, "▏": 1, "▎": 2, "▍": 3, "▌": 4, "▋": 5, "▊": 6, "▉": 7}
    app = live_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("g", *"100", "enter")
        await settle(pilot, at_step(100), timeout_s=60)
        table = app.main.query_one(RequestTable)
        req = app.frame.requests
        rids = table.shown_rids.tolist()
        scale = int(req.allocated[table.shown_rids].max())
        bar_w = table._widths[2] - 2
        tiny = 0
        for i, rid in enumerate(rids):
            alloc, used = int(req.allocated[rid]), int(req.committed[rid])
            segments = list(table.render_row(i, table.size.width, False))
            over = "".join(s.text for s in segments if s.style is not None and s.style.color is not None
                           and s.style.color.name == "yellow" and set(s.text) <= set(eighths))
            full = "".join(s.text for s in segments if s.style is not None and s.style.color is not None
                           and s.style.color.name == "green" and set(s.text) == {"█"})
            drawn = len(full) * 8 + sum(eighths[c] for c in over)
            assert abs(drawn - alloc * bar_w * 8 / scale) <= 1 or (alloc > used and drawn == len(full) * 8 + 1), rid
            if alloc > used:
                assert over, rid  # any over-allocation shows
                if (alloc - used) * bar_w * 8 / scale < 4:
                    tiny += 1
        assert tiny  # a request a few slots over, drawn a sliver, not a whole cell


async def test_the_eagle_samples_over_allocation_band_shows_on_the_occupancy_chart() -> None:
    """Its over-allocation is ~0.1% of the pool, thinner than a row of the chart."""
    from kvtrace.tui.widgets.occupancy import OccupancyChart
    from kvtrace.tui.widgets.page_map import STATE_COLORS

    from allocator.ownership import SlotState

    app = live_app("sample:mooncake-eagle")
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("g", *"100", "enter")
        await settle(pilot, at_step(100), timeout_s=60)
        await pilot.pause(0.2)
        pool = app.frame.pool
        assert 0 < pool.overallocated < pool.pool_tokens / 200
        canvas = app.main.query_one(OccupancyChart).query_one("#plot")
        colours = {seg.style.color.name for y in range(canvas.size.height) for seg in canvas.render_line(y)
                   if seg.style is not None and seg.style.color is not None and seg.text.strip()}
        assert STATE_COLORS[SlotState.OVERALLOCATED] in colours, colours


async def test_view_of_a_state_log_opens_on_its_first_step(tiny_log) -> None:  # noqa: ANN001
    """``kvtrace view`` (its replay in a process of its own, paused) shows the log's first
    step at once, not a screen of empty panels."""
    from kvtrace.tui.app import KvtraceApp
    from kvtrace.tui.remote.link import ChildReplay
    from kvtrace.tui.remote.replayer import log_job

    link = ChildReplay(log_job(str(tiny_log)))
    link.wait_started(timeout=60)
    app = KvtraceApp(link)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda a: a.frame.step is not None and a.frame.page_cells is not None, timeout_s=60)
        assert app.frame.step == 0 and not app.frame.playing
        assert int(app.frame.page_cells.tokens.sum()) == app.frame.pool.pool_tokens
        await pilot.press("right")
        await settle(pilot, at_step(1))


async def test_the_page_map_legend_names_leaked_pages_and_the_selections_marks() -> None:
    from kvtrace.tui.widgets.page_map import STATE_COLORS, PageMapLegend

    from allocator.ownership import SlotState

    app = live_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("right")
        await settle(pilot, at_step(0))
        text = app.main.query_one(PageMapLegend).render()
        plain = text.plain if hasattr(text, "plain") else str(text)
        assert "█ leaked" in plain and "▒ selected" in plain and "░ pinned by it" in plain, plain
        leaked = [s for s in text.spans if plain[s.start:s.end].startswith("█")
                  and plain[s.end:].lstrip().startswith("leaked")]
        assert leaked and str(leaked[0].style).endswith(STATE_COLORS[SlotState.UNOWNED])


async def test_a_killed_replay_process_says_died_at_once_and_quit_fails() -> None:
    import dataclasses
    import os
    import signal
    import time

    from kvtrace.replay.engine import ReplayOptions
    from kvtrace.tui.app import KvtraceApp
    from kvtrace.tui.remote.link import ChildReplay
    from kvtrace.tui.remote.replayer import dashboard_job
    from kvtrace.tui.widgets.header import state_text
    from kvtrace.versions.registry import resolve_version
    from traces.samples import resolve_trace

    job = dashboard_job(resolve_version("builtin"), str(resolve_trace("sample:tiny")), trace_label="sample:tiny",
                        page_size=None, pool_tokens=None, device="cpu",
                        options=dataclasses.asdict(ReplayOptions()), checkpoint_every=20, play=False)
    link = ChildReplay(job)
    link.wait_started(timeout=60)
    app = KvtraceApp(link)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda a: a.frame.step is None)
        for _ in range(6):  # slow, so that it is still playing when killed
            await pilot.press("minus")
        await pilot.press("space")
        await settle(pilot, lambda a: a.frame.playing)
        os.kill(link.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        await settle(pilot, lambda a: "replay process died" in state_text(a.frame, a.driver.info).plain,
                     timeout_s=10)
        assert time.monotonic() - t0 < 2.0
        await pilot.press("q")
        await pilot.pause()
    assert app.return_code == 1


@pytest.mark.slow
def test_kvtrace_replay_tui_exits_1_after_its_replay_process_is_killed() -> None:
    """The real CLI in a pseudo-terminal: SIGKILL the replay process, q, exit code 1."""
    import fcntl
    import os
    import pty
    import signal
    import struct
    import subprocess
    import termios
    import time

    from tests.helpers import descendants
    from tests.tui.test_terminal import KVTRACE, _read_until

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 140, 0, 0))
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "140", "LINES": "40"}
    proc = subprocess.Popen([str(KVTRACE), "replay", "sample:tiny", "--tui"], stdin=slave, stdout=slave,
                            stderr=slave, env=env, close_fds=True, start_new_session=True)
    os.close(slave)
    seen = bytearray()
    try:
        assert _read_until(master, b"sample:tiny", 90, seen), bytes(seen[-2000:])
        children = [p for p in descendants(proc.pid) if b"kvtrace.tui.remote.process" in open(f"/proc/{p}/cmdline", "rb").read()]
        assert children, descendants(proc.pid)
        os.kill(children[0], signal.SIGKILL)
        assert _read_until(master, b"replay process died", 30, seen), bytes(seen[-2000:])
        os.write(master, b"q")
        end = time.monotonic() + 90
        while proc.poll() is None and time.monotonic() < end:
            _read_until(master, b"\x00never", 0.5, seen)
        proc.wait(timeout=1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    assert proc.returncode == 1, bytes(seen[-2000:])
    assert b"the replay process died" in seen


@pytest.mark.parametrize("size", [SIZE, (80, 24)])
async def test_an_active_request_filter_is_named_on_the_requests_panel(size: tuple[int, int]) -> None:
    from textual.widgets import Tab

    app = live_app()
    async with app.run_test(size=size) as pilot:
        await pilot.press("g", *"60", "enter")
        await settle(pilot, at_step(60), timeout_s=60)
        panel = app.main.query_one("#requests")
        tab = app.main.query_one("#tab-requests", Tab)
        assert panel.border_title == "requests" and "filtered" not in str(tab.label)
        await pilot.press("slash", *"live", "enter")
        await pilot.pause()
        assert panel.border_title == "requests · filter: live"
        assert str(tab.label) == "requests (filtered)"
        await pilot.press("slash", *["backspace"] * 4, "enter")  # cleared: every request again
        await pilot.pause()
        assert panel.border_title == "requests" and str(tab.label) == "requests"


async def test_a_diff_shows_each_sides_numbers_and_marks_the_rows_that_differ() -> None:
    from kvtrace.tui.app import differing_requests
    from kvtrace.tui.widgets.request_table import RequestTable

    from tests.tui.test_diff import both_at, diff_app, settle_both

    app = diff_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle_both(pilot, both_at(1))  # the first divergence: request 0's kv_allocated_len
        await pilot.pause(0.2)
        a, b = app.frames
        for dash, frame in zip(app.dashboards, app.frames):
            numbers = str(dash.query_one("#occupancy").border_subtitle)
            assert f"used {frame.pool.used_tokens:,}" in numbers and f"over {frame.pool.overallocated:,}" in numbers
        assert a.pool.overallocated != b.pool.overallocated  # so the two lines differ
        marks = differing_requests(a.requests, b.requests)
        assert marks[0] and marks.sum() >= 1
        for dash in app.dashboards:
            table = dash.query_one(RequestTable)
            rids = table.shown_rids.tolist()
            for i, rid in enumerate(rids):
                first = table.render_row(i, table.size.width, False).text.split()[:2]
                assert ("≠" in first) == bool(rid < marks.shape[0] and marks[rid]), (rid, first)


async def test_x_exports_the_view_and_the_table_under_new_numbered_names(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    import csv

    from kvtrace.tui.widgets.request_table import RequestTable

    monkeypatch.chdir(tmp_path)  # a sample is no file: the exports go to the current directory
    (tmp_path / "kvtrace-sample-tiny-step60-1.svg").write_text("mine")  # taken: never overwritten
    app = live_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("g", *"60", "enter")
        await settle(pilot, at_step(60), timeout_s=60)
        await pilot.press("slash", *"live", "enter")
        await pilot.pause()
        await pilot.press("x")
        await pilot.pause()
        await pilot.press("x")
        await pilot.pause()
        shown = app.main.query_one(RequestTable).shown_rids.tolist()
        messages = [n.message for n in app._notifications]
    assert (tmp_path / "kvtrace-sample-tiny-step60-1.svg").read_text() == "mine"
    for k in (2, 3):
        svg = tmp_path / f"kvtrace-sample-tiny-step60-{k}.svg"
        table = tmp_path / f"kvtrace-sample-tiny-step60-{k}.csv"
        assert svg.read_text().lstrip().startswith("<svg") and "kvtrace" in svg.read_text()
        rows = list(csv.DictReader(table.open()))
        assert [int(r["rid"]) for r in rows] == shown  # the table as shown: its filter and order
        assert all(r["phase"] in ("prefill", "decode", "spec", "waiting") for r in rows)
        assert any(str(svg) in m for m in messages)
    assert not list(tmp_path.glob("*.tmp")) and not (tmp_path / "kvtrace-sample-tiny-step60-4.svg").exists()


@pytest.mark.slow
async def test_T_shows_the_top_holders_over_time_and_a_click_seeks() -> None:
    from kvtrace.tui.screens import HoldersScreen

    app = live_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("g", *"60", "enter")
        await settle(pilot, at_step(60), timeout_s=60)
        alloc = app.frame.requests.allocated
        await pilot.press("T")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, HoldersScreen)
        live = np.flatnonzero(alloc > 0)
        assert screen.rids == live[np.argsort(-alloc[live], kind="stable")[:5]].tolist()
        await settle(pilot, lambda a: isinstance(a.screen, HoldersScreen) and len(a.screen.histories) == len(a.screen.rids),
                     timeout_s=60)
        for rid, h in screen.histories.items():  # each one's lengths, up to the step shown
            assert h.steps.shape[0] and int(h.steps.max()) <= 60 and int(h.allocated[-1]) == int(alloc[rid])
        chart = screen.query_one("#holders-chart")
        canvas = chart.query_one("#plot")
        middle = (chart._x_min + chart._x_max) / 2  # a step inside the holders' lives
        px, _ = chart.get_pixel_from_coordinate(middle, 0)
        want = round(chart.get_coordinate_from_pixel(px, 1)[0])
        await pilot.click("#holders-chart", offset=(canvas.region.x - chart.region.x + px,
                                                    canvas.region.y - chart.region.y + 1))
        await settle(pilot, at_step(want), timeout_s=60)
        assert not isinstance(app.screen, HoldersScreen) and abs(want - middle) <= 3
