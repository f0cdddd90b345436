"""Pilot tests: every key of the dashboard and every mouse selection, on the tiny sample."""

from __future__ import annotations

import pytest

from kvtrace.tui.screens import GotoScreen, HelpScreen, RequestDetailScreen
from kvtrace.tui.widgets.events_log import EventsLog
from kvtrace.tui.widgets.page_map import PageMap
from kvtrace.tui.widgets.request_table import RequestTable
from kvtrace.tui.widgets.toasts import AlertToasts
from tests.helpers import SIZE, at_step, live_app, log_app, play_to_end, settle, text_of


@pytest.mark.slow
async def test_stepping_keys_and_seeking_back() -> None:
    app = live_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("right")
        await settle(pilot, at_step(0))
        for _ in range(4):
            await pilot.press("right")
        await settle(pilot, at_step(4))
        await pilot.press("left")
        await settle(pilot, at_step(3))
        await pilot.press("shift+right")
        await settle(pilot, at_step(103))
        await pilot.press("shift+left")
        await settle(pilot, at_step(3))
        # going back restored a checkpoint: the fold equals a straight replay to step 3
        from kvtrace.replay.session import ReplaySession

        with ReplaySession("sample:tiny", track_state=True, checker="inline") as ref:
            ref.seek(3)
            assert app.driver.state.table() == ref.state.table()


async def test_space_plays_to_the_end_and_pauses() -> None:
    app = live_app()
    async with app.run_test(size=SIZE) as pilot:
        assert (await play_to_end(pilot)).step == 138
        await pilot.press("left")
        await settle(pilot, at_step(137))
        await pilot.press("space")  # plays again from 137
        await settle(pilot, lambda a: a.frame.done and a.frame.step == 138)


async def test_speed_keys_change_the_pace() -> None:
    app = live_app()
    async with app.run_test(size=SIZE) as pilot:
        assert app.driver.speed is None  # as fast as it goes
        await pilot.press("minus")
        await pilot.press("minus")
        await settle(pilot, lambda a: a.frame.speed == 1_000.0)
        await pilot.press("plus")
        await settle(pilot, lambda a: a.frame.speed == 10_000.0)
        header = text_of(app.main.query_one("#header"))
        assert "10,000×" in header


@pytest.mark.slow
async def test_goto_peak_and_event_keys() -> None:
    app = live_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("g")
        assert isinstance(app.screen, GotoScreen)
        await pilot.press(*"120", "enter")
        await settle(pilot, at_step(120))
        peak = app.frame.peak()
        assert peak is not None
        await pilot.press("P")
        await settle(pilot, at_step(peak[0]))
        events = app.frame.events()
        later = [e.step for e in app.frame.timeline.events[: app.frame.num_events] if e.step > peak[0]]
        assert later, "the tiny sample has events after its peak"
        await pilot.press("n")
        await settle(pilot, at_step(later[0]))
        earlier = [e.step for e in events if e.step < later[0]]
        await pilot.press("N")
        await settle(pilot, at_step(earlier[-1]))
        log = app.main.query_one(EventsLog)
        await pilot.press("k")  # the events log shows one kind; n follows it
        assert log.kind == "overalloc_release"
        assert all(e.kind == "overalloc_release" for e in log.shown)


async def test_o_jumps_to_the_first_oom() -> None:
    # A pool too small for the tiny sample: the replay stops at an out-of-memory.
    app = live_app(pool_tokens=640)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("space")
        await settle(pilot, lambda a: a.frame.done)
        ooms = [e for e in app.frame.events() if e.kind == "oom"]
        assert ooms, "a 640-token pool runs out"
        await pilot.press("shift+left")
        await settle(pilot, lambda a: not a.frame.done)
        await pilot.press("o")
        await settle(pilot, at_step(ooms[0].step))
        toasts = app.main.query_one(AlertToasts)
        assert toasts.counts() == {(0, "oom"): len(ooms)}


@pytest.mark.slow
async def test_filter_sort_and_reverse_keys() -> None:
    app = live_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("shift+right")
        await settle(pilot, at_step(99))
        table = app.main.query_one(RequestTable)
        everyone = len(table.shown_rids)
        await pilot.press("slash")
        await pilot.press(*"finished", "enter")
        await pilot.pause()
        req = app.frame.requests
        assert 0 < len(table.shown_rids) < everyone
        assert all(req.phase[r] == 4 for r in table.shown_rids)
        await pilot.press("slash")
        await pilot.press("ctrl+a", "ctrl+k", *"nonsense", "enter")  # a bad term: warned, filter kept
        await pilot.pause()
        assert table.filter_text == "finished"
        await pilot.press("escape")
        await pilot.press("s")  # id -> phase
        assert table.sort_key == "phase"
        await pilot.press("s", "s")  # -> used -> allocated (largest first)
        assert table.sort_key == "allocated" and table.descending
        await pilot.press("r")
        assert not table.descending


@pytest.mark.slow
async def test_enter_opens_the_request_detail_with_its_history() -> None:
    app = live_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("shift+right")
        await settle(pilot, at_step(99))
        await pilot.press("enter")  # nothing selected: a hint, no screen
        assert not isinstance(app.screen, RequestDetailScreen)
        table = app.main.query_one(RequestTable)
        table.focus()
        await pilot.press("down")  # selects the first row
        await pilot.pause()
        rid = table.selected_rid
        assert rid is not None
        await pilot.press("enter")
        assert isinstance(app.screen, RequestDetailScreen)
        screen = app.screen
        await settle(pilot, lambda a: "steps changed it" in text_of(screen.query_one("#detail-events")))
        await settle(pilot, at_step(99))  # back where it was after replaying the request's life
        await pilot.press("escape")
        assert not isinstance(app.screen, RequestDetailScreen)


async def test_help_and_quit_keys() -> None:
    app = live_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("q")
        await pilot.pause()
    assert app.return_code == 0


@pytest.mark.slow
async def test_mouse_selects_rows_cells_events_and_sorts() -> None:
    app = live_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("shift+right")
        await settle(pilot, at_step(99))
        table = app.main.query_one(RequestTable)
        # a click on a row selects its request; the page map highlights its cells
        live = [int(r) for r in table.shown_rids if app.frame.requests.allocated[r] > 0]
        row = [int(r) for r in table.shown_rids].index(live[0])
        await pilot.click(RequestTable, offset=(2, row + 1))
        assert table.selected_rid == live[0]
        await settle(pilot, lambda a: a.frame.selected_rid == live[0] and a.frame.page_cells is not None
                     and bool(a.frame.page_cells.highlight.any()))
        # a click on the header sorts by that column
        from kvtrace.tui.widgets.request_table import _WIDTHS

        await pilot.click(RequestTable, offset=(sum(_WIDTHS[:4]) + 2, 0))  # inside the allocated column
        assert table.sort_key == "allocated"
        # a click on a page-map cell shows its pages and owners
        await pilot.click(PageMap, offset=(0, 0))
        await settle(pilot, lambda a: "pages " in text_of(a.main.query_one("#cell-info")))
        # a click on an event (twice: select, then choose) seeks to its step
        log = app.main.query_one(EventsLog)
        first = log.shown[int(log.scroll_y)].step  # the event on the first row in view
        await pilot.click(EventsLog, offset=(5, 1))
        await pilot.click(EventsLog, offset=(5, 1))
        await settle(pilot, at_step(first))


async def test_view_of_a_state_log_steps_and_seeks(tiny_log) -> None:  # noqa: ANN001
    app = log_app(tiny_log)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("shift+right")
        await settle(pilot, at_step(99))
        await pilot.press("left")
        await settle(pilot, at_step(98))
        assert not app.driver.info.live
        cells = app.frame.page_cells
        assert cells is not None and not cells.positional
        assert int(cells.tokens.sum()) == app.frame.pool.pool_tokens
        await pilot.click(PageMap, offset=(0, 0))
        await settle(pilot, lambda a: "no slot positions" in text_of(a.main.query_one("#cell-info")))


@pytest.mark.slow
async def test_a_trace_cut_short_is_said_once_the_replay_is_done(tmp_path) -> None:  # noqa: ANN001
    from kvtrace.replay.session import TRUNCATED_NOTE
    from traces.samples import resolve_trace

    data = resolve_trace("sample:mooncake-tiny").read_bytes()
    cut = tmp_path / "cut.kvtrace"
    cut.write_bytes(data[: len(data) * 2 // 3])  # the last record batches lost
    app = live_app(str(cut))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("space")
        await settle(pilot, lambda a: a.frame.done and any(TRUNCATED_NOTE in n.message for n in a._notifications))
        assert app.frame.step is not None and app.frame.step > 0  # the complete steps replayed
        note = next(n for n in app._notifications if TRUNCATED_NOTE in n.message)
        assert note.severity == "warning"
        log = app.dashboards[0].query_one(EventsLog)
        assert [e.kind for e in log.shown if TRUNCATED_NOTE in str(e.detail)] == ["warning"]
        line = next(log.render_row(i, 120, False).text for i, e in enumerate(log.shown) if e.kind == "warning")
        assert line.split()[0].isdigit()  # the step it was noted at
        assert line.split()[1:] == ["warning", *TRUNCATED_NOTE.split()]  # the words, no "pool:"
        log.add_failure(None, "the replay process exited")  # an error at no step
        assert log.render_row(log.num_rows - 1, 120, False).text.split() == ["·", "error", *"the replay process exited".split()]
        await pilot.press("q")


async def test_legend_is_drawn_at_its_cadence_while_playing() -> None:
    """While playing, the occupancy legend's numbers follow the frames at most every
    ``Cadence.legend_s`` (drawn at every frame they cost the screen a fifth of its time);
    paused, at once."""
    import dataclasses

    from kvtrace.replay.snapshot import PoolCounters
    from kvtrace.tui.widgets.dashboard import Dashboard
    from kvtrace.tui.widgets.occupancy import OccupancyLegend

    app = live_app()
    async with app.run_test(size=SIZE) as pilot:
        done = await play_to_end(pilot)
        timeline = done.timeline
        used = timeline.used_tokens(done.timeline_size)
        # Two steps whose pools differ in the tokens used (a number the legend shows).
        i = 0
        j = next(k for k in range(done.timeline_size) if used[k] != used[i])
        dash = app.main.query_one(Dashboard)
        legend = app.main.query_one(OccupancyLegend)
        gap = dash.cadence.legend_s
        t0 = app.clock() + 10 * gap  # past the frames the replay itself sent

        def frame(k: int, playing: bool):  # noqa: ANN202
            pool = PoolCounters(*(int(v) for v in timeline.counters[k]))
            return dataclasses.replace(done, step=int(timeline.steps[k]), pool=pool, playing=playing, done=False)

        def shows(k: int) -> bool:
            return f"{int(used[k]):>10,}" in legend.content.plain

        dash.show(frame(i, True), app.driver.info, t0)
        assert shows(i)
        dash.show(frame(j, True), app.driver.info, t0 + gap / 2)
        assert shows(i) and not shows(j)  # too soon: the legend waits
        dash.show(frame(j, True), app.driver.info, t0 + gap)
        assert shows(j)
        dash.show(frame(i, True), app.driver.info, t0 + gap * 1.25)
        assert shows(j)  # too soon again
        dash.show(frame(i, False), app.driver.info, t0 + gap * 1.25)
        assert shows(i)  # paused: at once


async def test_events_log_is_drawn_at_its_cadence_while_playing() -> None:
    """While playing, the events log follows the frames at most every ``Cadence.events_s``
    (at full speed each frame scrolls it by a screenful); paused, or with an alert, at
    once."""
    import dataclasses

    from kvtrace.replay.state import StepEvent
    from kvtrace.tui.widgets.dashboard import Cadence, Dashboard

    app = live_app()
    async with app.run_test(size=SIZE) as pilot:
        done = await play_to_end(pilot)
        steps = sorted({e.step for e in done.events()})
        assert len(steps) >= 3, steps
        dash = app.main.query_one(Dashboard)
        log = app.main.query_one(EventsLog)
        assert dash.cadence == Cadence()
        gap = dash.cadence.events_s
        t0 = app.clock() + 10 * gap  # past the frames the replay itself sent

        def playing_at(step: int, **kw: object):  # noqa: ANN202
            return dataclasses.replace(done, step=step, playing=True, done=False, **kw)

        def last_shown() -> int:
            return log.shown[-1].step

        dash.show(playing_at(steps[0]), app.driver.info, t0)
        assert last_shown() == steps[0]
        dash.show(playing_at(steps[1]), app.driver.info, t0 + gap / 2)
        assert last_shown() == steps[0]  # too soon: the log waits
        dash.show(playing_at(steps[1]), app.driver.info, t0 + gap)
        assert last_shown() == steps[1]
        dash.show(dataclasses.replace(done, step=steps[2], playing=False), app.driver.info, t0 + gap)
        assert last_shown() == steps[2]  # paused: at once
        dash.show(playing_at(steps[1]), app.driver.info, t0 + gap * 1.25)
        assert last_shown() == steps[2]  # playing again: the log waits
        alert = StepEvent(steps[1], "oom", None, 0, "")
        dash.show(playing_at(steps[1], alerts=(alert,)), app.driver.info, t0 + gap + gap / 4)
        assert last_shown() == steps[1]  # an alert: at once
