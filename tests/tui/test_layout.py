"""The dashboard at the sizes people use, 80x24 to 200x60: on a small terminal each pair of
panels becomes tabs (``Dashboard.is_small``) rather than losing the chart, the events' text
or a diff's table rows; the footer (``KeyBar``) keeps ``?`` and ``q``; the help wraps.
Snapshots at 80x24, 120x40 and 200x60, and Pilot tests of what each size shows."""

from __future__ import annotations

import pytest

from kvtrace.tui.widgets.dashboard import is_small
from kvtrace.tui.widgets.events_log import EventsLog
from kvtrace.tui.widgets.keybar import Hint, KeyBar, fit_hints
from kvtrace.tui.widgets.request_table import RequestTable
from tests.helpers import at_step, live_app, settle
from tests.tui.test_diff import both_at, diff_app, settle_both

SIZES = [(80, 24), (120, 40), (200, 60)]


def _text(widget: object) -> str:
    """What ``widget`` draws, as plain lines."""
    from textual.geometry import Region

    w, h = widget.size  # type: ignore[attr-defined]
    return "\n".join(strip.text for strip in widget.render_lines(Region(0, 0, w, h)))  # type: ignore[attr-defined]


async def _to_step(pilot, step: int) -> None:  # noqa: ANN001
    await pilot.press("g")
    await pilot.press(*str(step), "enter")
    await settle(pilot, lambda a: at_step(step)(a) and a.frame.page_map_step == step)


@pytest.mark.slow
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_dashboard_at(snap_compare, size: tuple[int, int]) -> None:  # noqa: ANN001
    async def run_before(pilot) -> None:  # noqa: ANN001
        await _to_step(pilot, 60)

    assert snap_compare(live_app(fixed_clock=True), terminal_size=size, run_before=run_before)


@pytest.mark.slow
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_help_at(snap_compare, size: tuple[int, int]) -> None:  # noqa: ANN001
    async def run_before(pilot) -> None:  # noqa: ANN001
        await _to_step(pilot, 10)
        await pilot.press("question_mark")

    assert snap_compare(live_app(fixed_clock=True), terminal_size=size, run_before=run_before)


@pytest.mark.slow
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_diff_at(snap_compare, size: tuple[int, int]) -> None:  # noqa: ANN001
    async def run_before(pilot) -> None:  # noqa: ANN001
        await settle_both(pilot, both_at(1))
        await pilot.pause(0.3)

    assert snap_compare(diff_app(clock=lambda: 0.0), terminal_size=size, run_before=run_before)


@pytest.mark.slow
async def test_at_80x24_every_panel_is_a_tab_away_and_full_width() -> None:
    app = live_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await _to_step(pilot, 60)
        dash = app.dashboards[0]
        assert dash.has_class("-small")
        chart, legend = dash.query_one("#chart"), dash.query_one("#legend")
        assert chart.size.width >= 30 and chart.size.height >= 5, chart.size  # was 0 wide: the legend took it all
        assert legend.size.width > 0
        # The page map: a click on its tab.
        await pilot.click("#tab-pages")
        await pilot.pause()
        assert dash.query_one("#pagemap").region.width >= 70
        assert dash.query_one("#chart").region.width == 0
        # The events, at full width: each with its request and detail, not only its kind.
        await pilot.click("#tab-events")
        await pilot.pause()
        log = dash.query_one(EventsLog)
        assert log.region.width >= 70
        assert dash.query_one(RequestTable).region.width == 0
        assert "rid " in _text(log), _text(log)
        # t: the other panel of each pair, from the keyboard (the tabs never take ← →).
        await pilot.press("t")
        await pilot.pause()
        assert dash.query_one("#chart").region.width >= 30 and dash.query_one(RequestTable).region.width >= 70
        await pilot.press("right")
        await settle(pilot, at_step(61))


async def test_the_footer_keeps_help_and_quit_at_every_width() -> None:
    app = live_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        bar = app.main.query_one(KeyBar)
        keys = [h.key for h in bar.shown()]
        assert "question_mark" in keys and "q" in keys and "space" in keys
        text = _text(bar)
        assert len(text.rstrip()) <= 80 and "? Keys" in text and "q Quit" in text
        await pilot.resize_terminal(200, 60)
        await pilot.pause()
        assert "m" in [h.key for h in bar.shown()]  # wide: every key, the mute key too


def test_fit_hints_drops_the_least_needed_first() -> None:
    hints = [Hint("space", "space", "Play/pause", "toggle_play"), Hint("plus", "+", "Faster", "speed(1)"),
             Hint("question_mark", "?", "Keys", "help"), Hint("q", "q", "Quit", "quit")]
    assert fit_hints(hints, 200) == hints
    assert [h.action for h in fit_hints(hints, 34)] == ["toggle_play", "help", "quit"]
    assert [h.action for h in fit_hints(hints, 5)] == ["help", "quit"]  # never dropped


@pytest.mark.slow
async def test_a_diff_at_80x24_shows_table_rows() -> None:
    app = diff_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await settle_both(pilot, both_at(1))
        await pilot.pause(0.3)
        for dash in app.dashboards:
            assert dash.has_class("-small")
            table = dash.query_one(RequestTable)
            assert table.region.height >= 3, table.region  # a header and rows (was 0 rows)


@pytest.mark.parametrize(("width", "height", "compact", "small"), [
    (80, 21, False, True), (120, 37, False, False), (200, 57, False, False),
    (40, 19, True, True), (60, 35, True, False), (100, 55, True, False),
])
def test_is_small(width: int, height: int, compact: bool, small: bool) -> None:
    assert is_small(width, height, compact) is small
