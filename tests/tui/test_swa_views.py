"""The dashboard of a hybrid SWA replay shows the SWA side of its requests and of its
pool: the request table's ``swa`` and ``swa evicted`` columns (and the request
detail's line), and ``p`` turning the page map to the SWA pool; a full-attention
replay's table is the one it always was."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from allocator.ownership import SlotState
from kvtrace.replay.session import ReplaySession
from kvtrace.tui.screens import RequestDetailScreen
from kvtrace.tui.widgets.request_table import RequestTable
from tests.helpers import TINY, at_step, live_app, log_app, settle

SWA = "sample:mooncake-gpt-oss"
STEP = 200  # some requests' windows have slid by then (swa_evicted_seqlen > 0)
_FULL_HEADER = "id↑     phase     used|over          used  allocated    over   pages  prefix  admitted"


async def _to_step(pilot, step: int) -> None:  # noqa: ANN001
    await pilot.press("g")
    await pilot.press(*str(step), "enter")
    await settle(pilot, at_step(step), timeout_s=60)


def _reference(step: int) -> dict[int, tuple[int, int]]:
    """rid -> (allocated, swa_evicted_seqlen) of the requests holding KV after ``step``,
    read from the allocator of a replay of its own, step by step (a run of decode
    steps would take the allocator past ``step``)."""
    from kvtrace.replay.engine import ReplayOptions

    with ReplaySession(SWA, options=ReplayOptions(decode_runs=False)) as session:
        while (snap := session.step()) is not None and snap.step < step:
            pass
        alloc = session.allocator
        rids = alloc.live_rids()
        return dict(zip(rids.tolist(), zip(alloc.request_lens(rids).allocated.tolist(),
                                           alloc.swa_evicted_lens(rids).tolist())))


async def test_the_request_table_shows_each_requests_swa_lengths_at_80x24() -> None:
    want = _reference(STEP)
    assert any(evicted for _, evicted in want.values()), "no window slid by then"
    app = live_app(SWA)
    async with app.run_test(size=(80, 24)) as pilot:
        await _to_step(pilot, STEP)
        table = app.main.query_one(RequestTable)
        table.set_filter("live")
        await pilot.pause()
        width = table.size.width
        header = table.render_header(width).text
        assert header.split()[4:8] == ["allocated", "swa", "swa", "evicted"], header
        assert header.rstrip().endswith("over"), header  # not cut at 80 columns
        assert table.sort_keys.index("swa") == table.sort_keys.index("allocated") + 1
        assert sorted(table.shown_rids.tolist()) == sorted(want)
        for i, rid in enumerate(table.shown_rids.tolist()):
            allocated, evicted = want[rid]
            cols = table.render_row(i, width, False).text.split()
            assert cols[0] == str(rid)
            assert cols[-3:-1] == [f"{allocated - evicted:,}", f"{evicted:,}" if evicted else "·"], cols
        # sorted by the SWA cursor, most first
        table.set_sort("swa evicted")
        await pilot.pause()
        shown = [want[r][1] for r in table.shown_rids.tolist()]
        assert shown == sorted(shown, reverse=True)
        # the request detail says them too
        rid = max(want, key=lambda r: want[r][1])
        table.select_rid(rid)
        await pilot.pause()
        await pilot.press("enter")
        await pilot.pause(0.3)
        assert isinstance(app.screen, RequestDetailScreen)
        allocated, evicted = want[rid]
        line = str(app.screen.query_one("#detail-row").render())
        assert f"SWA: {allocated - evicted:,} tokens past the window's cursor · swa_evicted_seqlen {evicted:,}" in line


async def test_p_shows_the_swa_pools_page_map_named_in_its_title() -> None:
    app = live_app(SWA)
    async with app.run_test(size=(160, 50)) as pilot:
        await _to_step(pilot, STEP)
        pages = app.main.query_one("#pages")
        await settle(pilot, lambda a: a.frame.page_cells is not None)
        assert pages.border_title == "page map · full pool"
        full_free = int(app.frame.page_cells.tokens[:, SlotState.FREE].sum())
        assert full_free == app.frame.pools["full"].available
        await pilot.press("p")
        await settle(pilot, lambda a: a.frame.page_map_pool == 1 and a.frame.page_cells is not None)
        await pilot.pause()
        assert pages.border_title == "page map · swa pool"
        cells = app.frame.page_cells
        swa = app.frame.pools["swa"]
        tokens = cells.tokens.sum(axis=0)
        assert int(cells.edges[-1]) == (swa.pool_tokens // 16 + 1) * 16  # the SWA pool's slots, page 0 too
        assert tokens[SlotState.FREE] == swa.available and tokens[SlotState.COMMITTED] == swa.committed
        assert tokens[SlotState.UNOWNED] == 0
        # a cell's owners are requests holding SWA slots there
        busy = int(np.argmax(cells.tokens[:, SlotState.COMMITTED]))
        app.drivers[0].command("cell", busy)
        await settle(pilot, lambda a: "owners: rid" in str(a.main.query_one("#cell-info").render()))
        await pilot.press("p")  # back to the full pool's map
        await settle(pilot, lambda a: a.frame.page_map_pool == 0)
        await pilot.pause()
        assert pages.border_title == "page map · full pool"


async def test_a_full_attention_replays_table_has_no_swa_columns() -> None:
    app = live_app(TINY)
    async with app.run_test(size=(200, 50)) as pilot:  # wide enough for every column
        await _to_step(pilot, 5)
        table = app.main.query_one(RequestTable)
        assert app.frame.requests.swa_evicted is None and not table.swa
        assert table.render_header(table.size.width).text.rstrip() == _FULL_HEADER
        assert "swa" not in table.sort_keys
        await pilot.press("p")  # one pool: the page map stays the full pool's
        await pilot.pause()
        assert app.main.query_one("#pages").border_title == "page map"


async def test_a_state_logs_p_lays_out_the_swa_pool_by_state(tmp_path: Path) -> None:
    from kvtrace.statelog.log import StateLogWriter

    path = tmp_path / "swa.log"
    with ReplaySession(SWA, checker="inline") as s:
        with StateLogWriter(path, {"trace": SWA, "allocator": s.version.spec,
                                   "config": {"page_size": s.config.page_size, "pool_tokens": s.config.pool_tokens}}) as log:
            for _ in range(30):
                log.write(s.step())
    app = log_app(path)
    async with app.run_test(size=(120, 40)) as pilot:
        await _to_step(pilot, 20)
        await pilot.press("p")
        await settle(pilot, lambda a: a.frame.page_map_pool == 1 and a.frame.page_cells is not None)
        await pilot.pause()
        assert app.main.query_one("#pages").border_title == "swa pool by state (no positions)"
        swa = app.frame.pools["swa"]
        assert int(app.frame.page_cells.tokens[:, SlotState.FREE].sum()) == swa.available
        assert app.frame.requests.swa_evicted is not None  # the log keeps the SWA cursors


async def test_a_state_logs_request_table_shows_each_requests_swa_lengths(tmp_path: Path) -> None:
    """``kvtrace view LOG`` of an SWA replay: the ``swa`` / ``swa evicted`` columns, as
    the live view has them (the state log holds the requests' SWA cursors)."""
    from typer.testing import CliRunner

    from kvtrace.cli import app as cli

    want = _reference(STEP)
    assert any(evicted for _, evicted in want.values()), "no window slid by then"
    path = tmp_path / "swa.log"
    result = CliRunner().invoke(cli, ["replay", SWA, "--steps", f":{STEP + 1}", "--out", str(path)])
    assert result.exit_code == 0, result.stderr
    app = log_app(path)
    async with app.run_test(size=(80, 24)) as pilot:
        await _to_step(pilot, STEP)
        table = app.main.query_one(RequestTable)
        table.set_filter("live")
        await pilot.pause()
        width = table.size.width
        header = table.render_header(width).text
        assert header.split()[4:8] == ["allocated", "swa", "swa", "evicted"], header
        assert sorted(table.shown_rids.tolist()) == sorted(want)
        for i, rid in enumerate(table.shown_rids.tolist()):
            allocated, evicted = want[rid]
            cols = table.render_row(i, width, False).text.split()
            assert cols[0] == str(rid)
            assert cols[-3:-1] == [f"{allocated - evicted:,}", f"{evicted:,}" if evicted else "·"], cols


@pytest.mark.parametrize("size", [(80, 24), (160, 50)], ids=["80x24", "160x50"])
def test_swa_dashboard_with_live_requests(snap_compare, size: tuple[int, int]) -> None:  # noqa: ANN001
    async def run_before(pilot) -> None:  # noqa: ANN001
        await _to_step(pilot, STEP)
        pilot.app.main.query_one(RequestTable).set_filter("live")
        await pilot.press("p")
        await settle(pilot, lambda a: a.frame.page_map_pool == 1)
        await pilot.pause(0.3)

    assert snap_compare(live_app(SWA, fixed_clock=True), terminal_size=size, run_before=run_before)
