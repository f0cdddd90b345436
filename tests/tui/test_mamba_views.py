"""The dashboard of a hybrid linear-attention (Mamba) replay shows the Mamba state pool as
a pool of slots: the header's pools line and the occupancy legend count slots (held by
requests, cached checkpoints), the request table gives each request's state slot, live
and from a state log."""

from __future__ import annotations

from types import SimpleNamespace

from allocator.base import PoolCounters
from kvtrace.tui.widgets.dashboard import Dashboard
from kvtrace.tui.widgets.header import ReplayHeader, pools_text
from kvtrace.tui.widgets.occupancy import OccupancyLegend, legend_lines
from tests.helpers import at_step, live_app, settle

MAMBA = "sample:mooncake-qwen3-next"
STEP = 400  # four requests hold a state slot then


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
    assert "ckpt evictable" in text and "ckpt locked" in text and "cached evictable" not in text, text
    assert f"{'used slots':<19}{4:>10,} {25.0:6.1f}%" in text, text
    assert "cached ckpts" not in text  # no radix cache: no checkpoints to count
    # the full pool's legend is the one it always was
    full = "\n".join(line.plain for line in legend_lines(_mamba(4), None, "full"))
    assert "committed" in full and "over-allocated" in full and "held" not in full


def test_the_mamba_legend_counts_cached_checkpoints_when_the_pool_has_them() -> None:
    pool = _mamba(4, evictable=3, protected=2)
    text = "\n".join(line.plain for line in legend_lines(pool, None, "mamba"))
    assert f"{'cached ckpts':<19}{5:>10,} {100 * 5 / 16:6.1f}%" in text, text
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
