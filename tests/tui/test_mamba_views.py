"""The dashboard of a hybrid linear-attention (Mamba) replay shows the Mamba state pool as
a pool of slots: the header's pools line and the occupancy legend count slots (held by
requests, cached checkpoints), the request table gives each request's state slot, live
and from a state log."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from allocator.base import PoolCounters
from kvtrace.tui.widgets.dashboard import Dashboard
from kvtrace.tui.widgets.header import ReplayHeader, pools_text
from kvtrace.tui.widgets.occupancy import OccupancyLegend, legend_lines
from tests.helpers import at_step, live_app, settle

MAMBA = "sample:mooncake-qwen3-next"
STEP = 400  # four requests hold a state slot then
BACK = 250  # before some of them were admitted


async def _to_step(pilot, step: int) -> None:  # noqa: ANN001
    await pilot.press("g")
    await pilot.press(*str(step), "enter")
    await settle(pilot, at_step(step), timeout_s=60)


def _mamba(held: int, total: int = 16, evictable: int = 0, protected: int = 0) -> PoolCounters:
    return PoolCounters(pool_tokens=total, available=total - held - evictable - protected, evictable=evictable,
                        protected=protected, committed=held, overallocated=0, running_requests=held, free_rows=0)


def test_the_mamba_legend_counts_slots_and_names_its_bands_as_slots() -> None:
    text = "\n".join(line.plain for line in legend_lines(_mamba(4), (933, 7), "mamba"))
    assert "held" in text and "committed" not in text, text
    assert "over-allocated" not in text, text  # a state slot is never over-allocated
    assert "cached evictable" not in text, text
    assert f"{'used slots':<19}{4:>10,} {25.0:6.1f}%" in text, text
    assert "ckpt" not in text  # no radix cache: no checkpoints to count, no lines for them
    # the full pool's legend is the one it always was
    full = "\n".join(line.plain for line in legend_lines(_mamba(4), None, "full"))
    assert "committed" in full and "over-allocated" in full and "held" not in full


def test_the_mamba_legend_counts_cached_checkpoints_when_the_pool_has_them() -> None:
    pool = _mamba(4, evictable=3, protected=2)
    text = "\n".join(line.plain for line in legend_lines(pool, None, "mamba"))
    assert f"{'cached ckpts':<19}{5:>10,} {100 * 5 / 16:6.1f}%" in text, text
    assert f"ckpt evictable{'':<3}{3:>10,}" in text and f"ckpt locked{'':<6}{2:>10,}" in text, text
    # a counter the snapshot carries by name wins over the tree's ledgers
    named = SimpleNamespace(**pool._asdict(), cached_checkpoints=6, used_tokens=pool.used_tokens)
    text = "\n".join(line.plain for line in legend_lines(named, None, "mamba"))  # type: ignore[arg-type]
    assert f"{'cached ckpts':<19}{6:>10,}" in text, text


def test_the_pools_line_says_the_mamba_pool_counts_slots() -> None:
    full = PoolCounters(60_000, 13_952, 0, 0, 46_027, 21, 4, 12)
    line = pools_text(SimpleNamespace(pools={"full": full, "mamba": _mamba(4)}), shown="mamba").plain
    assert "full 46,048/60,000 76.7%" in line and "mamba 4/16 slots 25.0%" in line, line


async def test_p_shows_the_mamba_pools_legend_in_slots() -> None:
    app = live_app(MAMBA)
    async with app.run_test(size=(120, 40)) as pilot:
        await _to_step(pilot, STEP)
        mamba = app.frame.pools["mamba"]
        header = app.main.query_one(ReplayHeader).content.plain
        assert f"mamba {mamba.used_tokens}/{mamba.pool_tokens} slots" in header, header
        await pilot.press("p")
        await pilot.pause()
        assert app.main.query_one(Dashboard).query_one("#occupancy").border_title == "occupancy · mamba pool"
        text = app.main.query_one(OccupancyLegend).content.plain
        assert f"held{'':<13}{mamba.committed:>10,}" in text, text
        assert f"used slots{'':<9}{mamba.used_tokens:>10,}" in text, text


def _reference_slots(step: int) -> dict[int, int]:
    """rid -> Mamba state slot of the requests holding KV after ``step``, read from the
    allocator of a replay of its own, step by step."""
    from kvtrace.replay.engine import ReplayOptions
    from kvtrace.replay.session import ReplaySession

    with ReplaySession(MAMBA, options=ReplayOptions(decode_runs=False)) as session:
        while (snap := session.step()) is not None and snap.step < step:
            pass
        alloc = session.allocator
        rids = alloc.live_rids()
        slots = {req.rid: req.mamba_pool_idx for req in alloc.mamba_reqs()}
        return {rid: slots[rid] for rid in rids.tolist()}


def _assert_table_slots(table, want: dict[int, int]) -> None:  # noqa: ANN001
    width = table.size.width
    header = table.render_header(width).text
    assert header.split()[4:6] == ["allocated", "mamba"], header
    assert header.rstrip().endswith("pages"), header  # "over" and "pages" still fit 80 columns
    assert table.sort_keys.index("mamba") == table.sort_keys.index("allocated") + 1
    shown = table.shown_rids.tolist()
    assert any(rid in want for rid in shown) and any(rid not in want for rid in shown)
    start = header.index("allocated") + len("allocated")  # the column after it, right-aligned
    end = header.index("mamba") + len("mamba")
    for i, rid in enumerate(shown):
        text = table.render_row(i, width, False).text
        assert text.split()[0] == str(rid)
        assert text[start:end].strip() == (str(want[rid]) if rid in want else "-"), (rid, text)


async def test_the_request_table_shows_each_requests_mamba_slot_at_80x24() -> None:
    from kvtrace.tui.screens import RequestDetailScreen
    from kvtrace.tui.widgets.request_table import RequestTable

    want = _reference_slots(STEP)
    assert len(set(want.values())) == len(want) >= 2, want  # a slot each
    app = live_app(MAMBA)
    async with app.run_test(size=(80, 24)) as pilot:
        await _to_step(pilot, STEP)
        table = app.main.query_one(RequestTable)
        await pilot.pause()
        assert table.mamba and not table.swa
        _assert_table_slots(table, want)
        table.set_sort("mamba", descending=True)
        await pilot.pause()
        live = [r for r in table.shown_rids.tolist() if r in want]
        assert [want[r] for r in live] == sorted(want.values(), reverse=True)
        # the request detail says it too
        rid = live[0]
        table.select_rid(rid)
        await pilot.pause()
        await pilot.press("enter")
        await pilot.pause(0.3)
        assert isinstance(app.screen, RequestDetailScreen)
        assert f"Mamba: state slot {want[rid]}" in str(app.screen.query_one("#detail-row").render())
        await pilot.press("escape")
        # back in time (a checkpoint, then the steps after it): the slots of then
        await _to_step(pilot, BACK)
        table.set_sort("id", descending=False)
        await pilot.pause()
        _assert_table_slots(table, _reference_slots(BACK))


async def test_a_state_logs_request_table_shows_each_requests_mamba_slot(tmp_path) -> None:  # noqa: ANN001
    """``kvtrace view LOG`` of a Mamba replay: the ``mamba`` column as the live view has
    it (the state log holds the requests' slots)."""
    from typer.testing import CliRunner

    from kvtrace.cli import app as cli
    from kvtrace.tui.widgets.request_table import RequestTable
    from tests.helpers import log_app

    want = _reference_slots(STEP)
    path = tmp_path / "mamba.log"
    result = CliRunner().invoke(cli, ["replay", MAMBA, "--steps", f":{STEP + 1}", "--out", str(path)])
    assert result.exit_code == 0, result.output
    app = log_app(path)
    async with app.run_test(size=(80, 24)) as pilot:
        await _to_step(pilot, STEP)
        table = app.main.query_one(RequestTable)
        await pilot.pause()
        _assert_table_slots(table, want)


def test_a_full_attention_and_an_swa_replay_carry_no_mamba_slots() -> None:
    from kvtrace.replay.session import ReplaySession

    for trace in ("sample:tiny", "sample:mooncake-gpt-oss"):
        with ReplaySession(trace, checker="inline") as session:
            snaps = [session.step() for _ in range(5)]
        assert all(s is not None and s.mamba_slot is None for s in snaps), trace


def test_mamba_slots_travel_in_updates_and_state_logs(tmp_path) -> None:  # noqa: ANN001
    """The slots reach the screen's fold through an update (the live dashboard's pipe)
    and through a state log (``kvtrace view``), equal to the replay's own fold."""
    import numpy as np

    from kvtrace.replay.engine import ReplayOptions
    from kvtrace.replay.session import ReplaySession
    from kvtrace.replay.state import ReplayState
    from kvtrace.statelog.log import MAMBA_SLOT_COLUMN, StateLogWriter, block_of, open_state_log
    from kvtrace.tui.remote.updates import decode_update, encode_update

    path = tmp_path / "m.log"
    with ReplaySession(MAMBA, track_state=True, checker="inline", options=ReplayOptions(stop_step=STEP + 1)) as s:
        screen = ReplayState(s.config.page_size)
        with StateLogWriter(path, {"trace": MAMBA, "allocator": "builtin", "config": {}}) as log:
            while not s.done:
                snaps = [snap for _ in range(37) if (snap := s.step()) is not None]
                for snap in snaps:
                    log.write(snap)
                if not snaps:
                    continue
                block = s.take_block()
                assert block is not None and block.mamba_slot is not None
                got = decode_update(bytearray(encode_update(block)))
                np.testing.assert_array_equal(got.mamba_slot, block.mamba_slot)
                screen.apply_block(got)
        replay = s.state
        assert replay is not None and replay.mamba_slots and screen.mamba_slots
    n = int(replay.seen_rids()[-1]) + 1
    want = replay.column("mamba_slot")[:n]
    assert (want >= 0).sum() >= 2 and (want == -1).sum() >= 1
    np.testing.assert_array_equal(screen.column("mamba_slot")[:n], want)
    _, reader = open_state_log(path)
    assert MAMBA_SLOT_COLUMN in reader.schema.names
    from_log = ReplayState(s.config.page_size)
    for batch in reader.iter_batches():
        from_log.apply_block(block_of(batch))
    np.testing.assert_array_equal(from_log.column("mamba_slot")[:n], want)


@pytest.mark.parametrize("size", [(80, 24), (120, 40)], ids=["80x24", "120x40"])
def test_mamba_dashboard(snap_compare, size: tuple[int, int]) -> None:  # noqa: ANN001
    """The Mamba pool shown (``p``): its chart and slot legend, and the table's ``mamba`` column."""
    async def run_before(pilot) -> None:  # noqa: ANN001
        await _to_step(pilot, STEP)
        await pilot.press("p")
        await settle(pilot, lambda a: a.frame.page_map_pool == 1)
        await pilot.pause(0.3)

    assert snap_compare(live_app(MAMBA, fixed_clock=True), terminal_size=size, run_before=run_before)


def test_the_mamba_pools_panel_lists_which_request_holds_which_slot() -> None:
    """In place of a page map (the pool has no pages): each held slot with its request,
    in slot order, an entry never broken across lines, then the counts."""
    import numpy as np

    from kvtrace.tui.widgets.page_map import mamba_slots_text

    slots = np.array([3, -1, 0, 12, -1], np.int64)  # per request id
    lines = mamba_slots_text(slots, 16, cached=2).plain.splitlines()
    assert lines[0] == "the mamba pool has no pages: a state slot per running request"
    assert lines[1] == "slot 0 rid 2 · slot 3 rid 0 · slot 12 rid 3"
    assert lines[2] == "3 held by requests · 2 checkpoints · 11 free of 16"
    # wrapped between entries only
    assert mamba_slots_text(slots, 16, width=28).plain.splitlines()[1:3] == ["slot 0 rid 2 · slot 3 rid 0", "slot 12 rid 3"]


def test_a_diff_sides_line_counts_the_mamba_pool_in_slots() -> None:
    """A diff side has no legend: the line under its chart says slots for the Mamba pool."""
    from kvtrace.tui.widgets.dashboard import side_numbers

    full = PoolCounters(60_000, 13_952, 0, 0, 46_027, 21, 4, 12)
    frame = SimpleNamespace(pool=full, other_pools=(_mamba(4, evictable=1),), pool_names=("full", "mamba"),
                            peak=lambda pool=0: (933, 7) if pool else (1_427, 58_832))
    line = side_numbers(frame, 1)  # type: ignore[arg-type]
    assert line == "slots held 4 (25.0%) · checkpoints 1 · free 11 of 16 · peak 7 @ 933", line
    assert side_numbers(frame, 0).startswith("used 46,048 (76.7%) · over 21 · ")  # type: ignore[arg-type]


def test_diff_chunks_that_differ_only_in_mamba_slots_are_the_same() -> None:
    """The diff's fast path (whole record batches equal) does not look at the requests'
    Mamba slots, which its step-by-step comparison does not compare: a version that
    reports no slots (-1) keeps the fast path against one that does."""
    import numpy as np
    import pyarrow as pa

    from kvtrace.diff.sides import Chunk
    from kvtrace.replay.session import ReplaySession
    from kvtrace.statelog.log import MAMBA_SLOT_COLUMN, record_batch_of, state_log_schema
    from kvtrace.replay.snapshot import SnapshotBlock

    with ReplaySession(MAMBA, checker="inline") as session:
        block = SnapshotBlock.of([session.step() for _ in range(20)])
    assert block.mamba_slot is not None and (block.mamba_slot >= 0).any()
    schema = state_log_schema(("mamba",))
    with_slots = record_batch_of(block, schema)
    without = record_batch_of(block._replace(mamba_slot=None), schema)
    assert not with_slots.column(MAMBA_SLOT_COLUMN).equals(without.column(MAMBA_SLOT_COLUMN))
    assert Chunk(with_slots).same_as(Chunk(without))
    # any other difference still sends the chunks step by step
    committed = with_slots.column("committed").to_numpy().copy()
    committed[-1] += 1
    other = with_slots.set_column(with_slots.schema.get_field_index("committed"), "committed", pa.array(committed))
    assert not Chunk(with_slots).same_as(Chunk(other))
    assert np.array_equal(with_slots.column("committed").to_numpy()[:-1], committed[:-1])
