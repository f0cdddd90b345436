"""The dashboard of a hybrid SWA replay shows every KV pool: the header's pools line, and
the occupancy panel's chart and legend for the pool ``p`` picks; the figures are the
replay's own (``kvtrace replay --json``'s ``pools``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvtrace.tui.widgets.header import ReplayHeader
from kvtrace.tui.widgets.occupancy import OccupancyChart, OccupancyLegend
from kvtrace.tui.widgets.dashboard import Dashboard
from tests.helpers import at_step, live_app, settle

SWA = "sample:mooncake-gpt-oss"
STEP = 2853  # the sliding-window pool's peak in this sample


async def _to_step(pilot, step: int) -> None:  # noqa: ANN001
    await pilot.press("g")
    await pilot.press(*str(step), "enter")
    await settle(pilot, at_step(step), timeout_s=60)


def _replay_pools(step: int) -> dict[str, dict[str, int]]:
    """``kvtrace replay --json``'s pools after ``step`` (a window ending there)."""
    out = subprocess.run([sys.executable, "-m", "kvtrace", "replay", SWA, "--steps", f"0:{step + 1}", "--json"],
                         capture_output=True, text=True, check=True, env=os.environ.copy())
    return json.loads(out.stdout)["pools"]


@pytest.mark.slow
async def test_swa_pool_figures_on_screen_are_the_replays() -> None:
    pools = _replay_pools(STEP)
    full, swa = pools["full"], pools["swa"]
    app = live_app(SWA)
    async with app.run_test(size=(120, 40)) as pilot:
        await _to_step(pilot, STEP)
        frame = app.frame
        assert set(frame.pools) == {"full", "swa"}
        assert frame.pools["swa"].used_tokens == swa["used_tokens_at_end"]
        assert frame.pools["swa"].pool_tokens == swa["pool_tokens"]
        header = app.main.query_one(ReplayHeader).content.plain
        used, total = swa["used_tokens_at_end"], swa["pool_tokens"]
        assert f"swa {used:,}/{total:,} {100 * used / total:.1f}%" in header, header
        assert f"full {full['used_tokens_at_end']:,}/{full['pool_tokens']:,}" in header, header
        # The occupancy panel shows the full pool until p picks the sliding-window one.
        dash = app.main.query_one(Dashboard)
        legend = app.main.query_one(OccupancyLegend)
        assert f"{full['used_tokens_at_end']:>10,}" in legend.content.plain
        await pilot.press("p")
        await pilot.pause()
        assert dash.query_one("#occupancy").border_title == "occupancy · swa pool"
        assert app.main.query_one(OccupancyChart).pool == 1
        text = legend.content.plain
        assert f"used{'':<15}{used:>10,} {100 * used / total:6.1f}%" in text, text
        # its peak (replayed so far) is the replay's peak of that pool
        assert frame.peak(1) == (swa["peak_step"], swa["peak_used_tokens"])
        assert f"{swa['peak_step']:>10,}" in text
        await pilot.press("p")  # back to the full pool
        await pilot.pause()
        assert dash.query_one("#occupancy").border_title == "occupancy · full pool"


@pytest.mark.slow
def test_swa_dashboard_at_120x40(snap_compare) -> None:  # noqa: ANN001
    async def run_before(pilot) -> None:  # noqa: ANN001
        await _to_step(pilot, STEP)
        await pilot.press("p")
        await pilot.pause(0.3)

    assert snap_compare(live_app(SWA, fixed_clock=True), terminal_size=(120, 40), run_before=run_before)


def test_the_pools_line_lists_every_pool_of_the_replay_and_underlines_the_one_shown() -> None:
    from types import SimpleNamespace

    from kvtrace.replay.session import ReplaySession
    from kvtrace.tui.widgets.header import pools_text

    with ReplaySession(SWA, checker="inline") as session:
        pools = next(snap.pools for snap in session.snapshots() if snap.step == STEP)
    line = pools_text(SimpleNamespace(pools=pools), shown="swa")
    swa = pools["swa"]
    assert list(pools) == ["full", "swa"]
    assert f"swa {swa.used_tokens:,}/{swa.pool_tokens:,} {100 * swa.used_tokens / swa.pool_tokens:.1f}%" in line.plain
    underlined = [line.plain[span.start:span.end] for span in line.spans if "underline" in str(span.style)]
    assert underlined == ["swa"]


async def test_a_mamba_replay_names_its_second_pool_mamba_and_says_it_has_no_pages() -> None:
    """The pools are named as the replay names them (a hybrid linear-attention model's
    second pool is its Mamba state pool, not an SWA one), and its page map says why there
    is none."""
    from textual.widgets import Static

    app = live_app("sample:mooncake-qwen3-next")
    async with app.run_test(size=(120, 40)) as pilot:
        await _to_step(pilot, 400)
        frame = app.frame
        assert list(frame.pools) == ["full", "mamba"]
        header = app.main.query_one(ReplayHeader).content.plain
        assert " mamba " in header and " swa " not in header, header
        await pilot.press("p")
        dash = app.main.query_one(Dashboard)
        await settle(pilot, lambda _app: "mamba pool has no pages" in str(dash.query_one("#cell-info", Static).render()),
                     timeout_s=30)
        assert dash.query_one("#occupancy").border_title == "occupancy · mamba pool"
        assert dash.query_one("#pages").border_title == "state slots · mamba pool"  # no pages to map
