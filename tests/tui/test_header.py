"""The header and the small keys of issue #41: the simulated time never shows 60 seconds, a
replay stopped by an out-of-memory says so (not "done"), the screen says the replay is
starting before its first frame, and Ctrl+C quits."""

from __future__ import annotations

import pytest
from textual.app import App, ComposeResult

from kvtrace.tui.widgets.header import ReplayHeader, clock_time
from tests.helpers import SIZE, live_app, settle, text_of


@pytest.mark.parametrize(("seconds", "shown"), [
    (0.0, "0:00:00.0"), (59.94, "0:00:59.9"), (59.96, "0:01:00.0"), (3839.97, "1:04:00.0"),
    (3599.99, "1:00:00.0"), (3723.4, "1:02:03.4"), (-1.0, "0:00:00.0"),
])
def test_clock_time_rounds_before_it_splits(seconds: float, shown: str) -> None:
    assert clock_time(seconds) == shown


async def test_an_oom_stop_says_stopped_out_of_memory() -> None:
    # A pool too small for the tiny sample: the replay stops at its first out-of-memory.
    app = live_app(pool_tokens=640)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("space")
        await settle(pilot, lambda a: a.frame.done)
        header = text_of(app.main.query_one("#header"))
        assert "stopped: out of memory" in header and "done" not in header, header


async def test_a_replay_played_to_its_end_says_done() -> None:
    app = live_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("space")
        await settle(pilot, lambda a: a.frame.done)
        header = text_of(app.main.query_one("#header"))
        assert "■ done" in header and "stopped" not in header, header


class _HeaderOnly(App[None]):
    def compose(self) -> ComposeResult:
        yield ReplayHeader(id="header")


async def test_the_header_says_the_replay_is_starting_before_its_first_frame() -> None:
    app = _HeaderOnly()
    async with app.run_test(size=(100, 4)) as pilot:
        await pilot.pause()
        assert "starting the replay" in app.query_one(ReplayHeader).content.plain


async def test_ctrl_c_quits() -> None:
    app = live_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, lambda a: a.frame is not None)
        await pilot.press("ctrl+c")
        await pilot.pause()
    assert app.return_code == 0
