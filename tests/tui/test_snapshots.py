"""Snapshot tests of each screen at a fixed terminal size on the tiny sample: paused (no
replay speed shown), a fixed clock (row flashes), nothing else depends on time.

Update with ``pytest tests/tui/test_snapshots.py --snapshot-update`` only after
looking at the report of a failing run (``snapshot_report.html``).
"""

from __future__ import annotations

import pytest

from tests.helpers import SIZE, at_step, live_app, log_app, settle


async def _to_step(pilot, step: int) -> None:  # noqa: ANN001
    await pilot.press("g")
    await pilot.press(*str(step), "enter")
    await settle(pilot, lambda a: at_step(step)(a) and a.frame.page_map_step == step)  # the map comes after


def test_dashboard(snap_compare) -> None:  # noqa: ANN001
    async def run_before(pilot) -> None:  # noqa: ANN001
        await _to_step(pilot, 60)

    assert snap_compare(live_app(fixed_clock=True), terminal_size=SIZE, run_before=run_before)


def test_help(snap_compare) -> None:  # noqa: ANN001
    async def run_before(pilot) -> None:  # noqa: ANN001
        await _to_step(pilot, 10)
        await pilot.press("question_mark")

    assert snap_compare(live_app(fixed_clock=True), terminal_size=SIZE, run_before=run_before)


@pytest.mark.slow
def test_request_detail(snap_compare) -> None:  # noqa: ANN001
    async def run_before(pilot) -> None:  # noqa: ANN001
        await _to_step(pilot, 80)
        pilot.app.main.query_one("#table").select_rid(13)  # speculative: over-allocated slots
        await pilot.press("enter")
        screen = pilot.app.screen
        await settle(pilot, lambda a: "steps changed it" in str(screen.query_one("#detail-events").content))

    assert snap_compare(live_app(fixed_clock=True), terminal_size=SIZE, run_before=run_before)


@pytest.mark.slow
def test_view_of_a_state_log(snap_compare, tiny_log) -> None:  # noqa: ANN001
    async def run_before(pilot) -> None:  # noqa: ANN001
        await _to_step(pilot, 60)
        await pilot.press("slash", *"live", "enter")
        await pilot.pause()

    assert snap_compare(log_app(tiny_log, clock=lambda: 0.0), terminal_size=SIZE, run_before=run_before)
