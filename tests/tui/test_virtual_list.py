"""The virtualised list redraws only the lines on screen whose rows changed (a frame that
changes one request's lengths costs one line, not the table), every line when it
scrolls or its view changes, and what it shows is always the rows' latest state."""

from __future__ import annotations

import pytest
from textual.app import App, ComposeResult
from textual.strip import Strip

from kvtrace.tui.widgets.virtual_list import VirtualList, cells


class _Rows(VirtualList):
    def __init__(self, values: list[int]) -> None:
        super().__init__(id="rows")
        self.values = values
        self.num_rows = len(values)
        self.title = "title-a"
        self.rendered: list[int] = []

    def view_signature(self) -> object:
        return self.title

    def row_signatures(self, start: int, stop: int) -> list[object]:
        return self.values[start:stop]

    def render_header(self, width: int) -> Strip:
        return cells([(self.title, width, None, "<")], width)

    def render_row(self, index: int, width: int, selected: bool) -> Strip:
        self.rendered.append(index)
        return cells([(f"row{index}={self.values[index]}{'*' if selected else ''}", width, None, "<")], width)


class _ListApp(App[None]):
    def __init__(self, values: list[int]) -> None:
        super().__init__()
        self.values = values

    def compose(self) -> ComposeResult:
        yield _Rows(self.values)


def _counting(monkeypatch, owner: type, name: str) -> list[int]:  # noqa: ANN001
    """Count the calls of method ``name`` of ``owner`` (still called) in the list returned."""
    calls: list[int] = []
    real = getattr(owner, name)

    def counted(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


async def _drawn(pilot, rows: _Rows) -> None:  # noqa: ANN001
    """Wait until the list is on screen and nothing more is being drawn."""
    for _ in range(50):
        rows.refresh_rows()
        rows.rendered.clear()
        await pilot.pause()
        if not rows.rendered and "row0=" in _screen_text(pilot.app):
            return
    raise AssertionError("the list kept drawing")


def _screen_text(app: App[None]) -> str:
    """The text on the terminal (what the compositor last drew), line by line."""
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


async def test_only_the_changed_lines_are_drawn_again() -> None:
    app = _ListApp([100 + i for i in range(40)])
    async with app.run_test(size=(40, 12)) as pilot:
        rows = app.query_one(_Rows)
        await _drawn(pilot, rows)
        assert "row0=100" in _screen_text(app) and "row9=109" in _screen_text(app)

        rows.rendered.clear()
        rows.values[3] = 999
        rows.refresh_rows()
        await pilot.pause()
        assert rows.rendered == [3]  # one line, not the page
        assert "row3=999" in _screen_text(app) and "row4=104" in _screen_text(app)

        rows.rendered.clear()
        rows.values[30] = 7  # off screen
        rows.refresh_rows()
        await pilot.pause()
        assert rows.rendered == []

        rows.rendered.clear()
        rows.title = "title-b"  # the view: every line
        rows.refresh_rows()
        await pilot.pause()
        assert "title-b" in _screen_text(app)
        assert sorted(set(rows.rendered)) == list(range(0, rows.page_rows))

        rows.rendered.clear()
        rows.scroll_to(y=20, animate=False)  # a scroll: every line
        await pilot.pause()
        rows.refresh_rows()
        await pilot.pause()
        assert "row20=120" in _screen_text(app) and "row3=999" not in _screen_text(app)
        assert set(range(20, 20 + rows.page_rows)) <= set(rows.rendered)


async def test_the_cursor_and_fewer_rows_redraw_what_they_change() -> None:
    app = _ListApp([100 + i for i in range(40)])
    async with app.run_test(size=(40, 12)) as pilot:
        rows = app.query_one(_Rows)
        await _drawn(pilot, rows)
        rows.move_cursor(2)
        await pilot.pause()
        assert "row2=102*" in _screen_text(app)

        rows.rendered.clear()
        rows.num_rows = 4  # rows past the end draw blank
        rows.refresh_rows()
        await pilot.pause()
        text = _screen_text(app)
        assert "row3=103" in text and "row4=" not in text and "row9=" not in text  # (the height changed: all)

        rows.num_rows = 40  # they come back
        rows.refresh_rows()
        await pilot.pause()
        assert "row9=109" in _screen_text(app)


@pytest.mark.slow
async def test_the_dashboard_lists_drawn_line_by_line_equal_a_full_redraw() -> None:
    """The request table and the events log, redrawn only where their rows' signatures
    changed, show what a redraw of every line shows, step after step and in every sort
    (a signature that missed something a row shows would leave a stale line)."""
    from kvtrace.tui.widgets.events_log import EventsLog
    from kvtrace.tui.widgets.request_table import SORT_KEYS, RequestTable
    from tests.helpers import SIZE, at_step, live_app, settle

    app = live_app()
    async with app.run_test(size=SIZE) as pilot:
        lists = [app.main.query_one(RequestTable), app.main.query_one(EventsLog)]
        table = lists[0]
        step = 0
        for key in SORT_KEYS:
            table.set_sort(key)
            for _ in range(2):
                step += 4
                await pilot.press("g", *str(step), "enter")
                await settle(pilot, at_step(step))
                drawn = _screen_text(app)
                for widget in lists:
                    widget._drawn = None
                    widget.refresh()
                await pilot.pause()
                assert _screen_text(app) == drawn, (key, step)


async def test_a_request_whose_lengths_stay_is_drawn_again_when_its_bar_rescales() -> None:
    """The bars scale to the largest allocation shown: when another request grows past
    it, a request whose lengths did not change gets a shorter bar, and its line is
    drawn again (the bar cells are part of its row's signature, not the scale)."""
    from types import SimpleNamespace

    import numpy as np

    from kvtrace.tui.driver import RequestColumns
    from kvtrace.tui.widgets.request_table import RequestTable

    def frame(big: int) -> SimpleNamespace:
        decode = 2
        cols = RequestColumns(phase=np.array([decode, decode], np.int8), allocated=np.array([100, big]),
                              committed=np.array([100, big]), protected=np.zeros(2, np.int64),
                              prefix_hit=np.zeros(2, np.int64), admitted_step=np.array([0, 1]),
                              ended_step=np.array([-1, -1]), page_size=1)
        return SimpleNamespace(requests=cols, released=[], sessions=False)

    class TableApp(App[None]):
        def compose(self) -> ComposeResult:
            yield RequestTable(id="table", clock=lambda: 0.0)

    app = TableApp()
    async with app.run_test(size=(100, 8)) as pilot:
        table = app.query_one(RequestTable)
        for _ in range(3):
            table.show(frame(100))  # type: ignore[arg-type]
            await pilot.pause()
        assert _screen_text(app).count("█" * 12) == 2  # both at the scale
        table.show(frame(400))  # type: ignore[arg-type]
        await pilot.pause()
        drawn = _screen_text(app)
        assert drawn.count("█" * 12) == 1 and "█" * 3 in drawn  # request 0's bar shrank to a quarter
        table._drawn = None
        table.refresh()
        await pilot.pause()
        assert _screen_text(app) == drawn


@pytest.mark.slow
async def test_a_list_that_grows_tells_its_scrollbar_without_laying_the_screen_out(monkeypatch) -> None:  # noqa: ANN001
    """The virtual height follows the rows; the scrollbar learns it, and is drawn again
    only when its thumb looks different (a long list gaining a few rows a frame keeps
    its look), without a layout of the whole screen; the screen always shows the
    scrollbar a full redraw would."""
    from textual.screen import Screen
    from textual.scrollbar import ScrollBar

    app = _ListApp([100 + i for i in range(40)])
    async with app.run_test(size=(40, 12)) as pilot:
        rows = app.query_one(_Rows)
        await _drawn(pilot, rows)
        layouts = _counting(monkeypatch, Screen, "_refresh_layout")
        bars = _counting(monkeypatch, ScrollBar, "render")
        bar = rows.vertical_scrollbar
        rows.values.extend(100 + i for i in range(40, 1000))
        for n in range(40, 1001, 4):
            rows.num_rows = n
            rows.refresh_rows()
            await pilot.pause()
            assert rows.virtual_size.height == bar.window_virtual_size == n + 1
            if n % 240 == 0:  # what is on screen equals the scrollbar drawn afresh
                shown = app.export_screenshot()
                bar.refresh()
                await pilot.pause()
                assert app.export_screenshot() == shown, n
        assert layouts == []
        assert 0 < len(bars) < 100  # the thumb shrinks a cell-eighth now and then: not 240 draws
        rows.scroll_to_end()
        await pilot.pause()
        rows.refresh_rows()
        await pilot.pause()
        assert "row999=1099" in _screen_text(app)


@pytest.mark.slow
async def test_the_scrollbar_is_drawn_again_only_when_its_thumb_moves(monkeypatch) -> None:  # noqa: ANN001
    """Scrolling a long list a row at a time moves the thumb a cell-eighth every few
    rows: the scrollbar is drawn only then, and the screen always shows the scrollbar a
    full redraw would."""
    from textual.scrollbar import ScrollBar

    app = _ListApp([100 + i for i in range(2000)])
    async with app.run_test(size=(40, 12)) as pilot:
        rows = app.query_one(_Rows)
        await _drawn(pilot, rows)
        drawn = _counting(monkeypatch, ScrollBar, "render")
        bar = rows.vertical_scrollbar
        for y in range(1, 301):
            rows.scroll_to(y=y, animate=False)
            await pilot.pause()
            if y % 60 == 0:  # what is on screen equals the scrollbar drawn afresh
                shown = app.export_screenshot()
                bar.refresh()
                await pilot.pause()
                assert app.export_screenshot() == shown, y
        assert "row300=400" in _screen_text(app) and bar.position == rows.scroll_y == 300
        assert 0 < len(drawn) < 100  # a thumb move every few rows, not 300 draws


async def test_scrolling_to_the_very_end_shows_the_last_row_on_the_bottom_line() -> None:
    """A scrollbar dragged to its end stops where the last row is on the bottom line, with
    no blank lines below it, and its thumb touches the bottom."""
    n = 40
    app = _ListApp([100 + i for i in range(n)])
    async with app.run_test(size=(40, 12)) as pilot:
        rows = app.query_one(_Rows)
        await _drawn(pilot, rows)
        rows.scroll_to(y=10_000, animate=False)  # what a drag to the scrollbar's end asks
        await pilot.pause()
        assert rows.scroll_y == n - rows.page_rows
        rows.refresh_rows()
        await pilot.pause()
        lines = _screen_text(app).splitlines()
        assert lines[rows.page_rows].strip().startswith(f"row{n - 1}="), lines
        bar = rows.vertical_scrollbar  # the thumb ends at the bottom
        assert bar.position + bar.window_size == bar.window_virtual_size == n + 1
        await pilot.click(_Rows, offset=(39, 11))  # the scrollbar's bottom cell
        await pilot.pause()
        assert rows.scroll_y == n - rows.page_rows


def test_a_column_cut_at_the_line_end_shows_no_partial_number() -> None:
    """A line narrower than its columns cuts the last: text is cropped, a right-aligned
    number left blank (cut, 73976 would read 7397)."""
    parts = [("11579", 8, None, "<"), ("512", 8, None, ">"), ("73976", 10, None, ">")]
    assert cells(parts, 26).text == "11579        512     73976"
    assert cells(parts, 20).text == "11579        512    "  # no "7397"
    assert cells(parts, 12).text == "11579       "
    assert cells([("11579", 8, None, "<"), ("decode", 10, None, "<")], 12).text == "11579   deco"
