"""The allocator's slot map agrees with the pool counters at the step a session returns
(``allocator_in_step``), and what the screen adds to it: the selected request's cells, a
clicked cell's owners, no map for a version without the query, the composition of a state
log (hypothesis)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from allocator.base import PoolCounters
from allocator.ownership import NUM_STATES, SlotState
from kvtrace.replay.session import ReplaySession
from kvtrace.tui.remote.pagemap import cell_detail, composition_cells, page_map

FAULTY = str(Path(__file__).parent.parent / "kvtrace" / "faulty_allocators.py")


def _check_step(session: ReplaySession) -> None:
    own = session.allocator.slot_ownership()  # the allocator at the step returned (allocator_in_step)
    counts = np.bincount(own.state, minlength=NUM_STATES)
    pool = session.last.pool
    step = session.last.step
    assert counts[SlotState.UNOWNED] == 0, step
    assert counts[SlotState.FREE] == pool.available, step
    assert counts[SlotState.COMMITTED] == pool.committed, step
    assert counts[SlotState.OVERALLOCATED] + counts[SlotState.PAGE_TAIL] == pool.overallocated, step
    assert counts[SlotState.CACHED_EVICTABLE] == pool.evictable, step
    assert counts[SlotState.CACHED_LOCKED] == pool.protected, step
    # every request holding KV owns exactly its [protected, ceil_align(allocated)) slots
    lens = session.state
    for rid in lens.live_rids()[:4]:
        row = lens.row(int(rid))
        ps = own.page_size
        assert int((own.owner == rid).sum()) == -(-row.allocated // ps) * ps - row.protected, (step, rid)


def test_slot_states_match_the_counters_at_every_step() -> None:
    # tiny: every step (page 16, spec, prealloc, retract, abort); mooncake-tiny: a 200k-token
    # pool, every 50th step (mapping it costs ~25 ms)
    for trace, every in (("sample:tiny", 1), ("sample:mooncake-tiny", 50)):
        with ReplaySession(trace, track_state=True, checker="inline", allocator_in_step=True) as s:
            for i, _ in enumerate(s.snapshots()):
                if i % every == 0:
                    _check_step(s)


def test_the_selected_requests_cells_and_a_cells_owners() -> None:
    with ReplaySession("sample:tiny", track_state=True, checker="inline", allocator_in_step=True) as s:
        s.seek(60)
        rid = int(s.state.live_rids()[0])
        made = page_map(s.allocator, 37, rid)
        assert made is not None
        own, cells = made
        ps = own.page_size
        assert cells.tokens.shape == (37, NUM_STATES) and cells.positional
        assert int(cells.tokens.sum()) == own.state.shape[0]  # every slot, page 0 included
        assert (np.diff(cells.edges) % ps == 0).all()  # whole pages
        owned = np.flatnonzero(own.owner == rid)
        expect = np.unique(np.searchsorted(cells.edges, owned, side="right") - 1)
        assert expect.shape[0] and np.array_equal(np.flatnonzero(cells.highlight), expect)
        detail = cell_detail(own, cells, int(expect[0]))
        assert rid in [r for r, _ in detail.owners]
        lo, hi = int(cells.edges[expect[0]]), int(cells.edges[expect[0] + 1])
        assert (detail.first_page, detail.last_page) == (lo // ps, hi // ps - 1)
        for owner, slots in detail.owners:  # each owner's own slots in the cell (committed, over, tail)
            mine = (own.owner[lo:hi] == owner) & np.isin(own.state[lo:hi], [SlotState.COMMITTED,
                                                                             SlotState.OVERALLOCATED,
                                                                             SlotState.PAGE_TAIL])
            assert slots == int(mine.sum()), owner
        assert sum(detail.tokens.values()) == int(cells.tokens[expect[0]].sum())
        assert not page_map(s.allocator, 37, None)[1].highlight.any()  # type: ignore[index]


def test_a_version_without_the_ownership_query_has_no_page_map() -> None:
    with ReplaySession("sample:tiny", version=f"{FAULTY}:without_ownership", checker="inline") as s:
        s.seek(10)
        assert page_map(s.allocator, 20, None) is None


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 10_000), min_size=5, max_size=5),
    st.integers(1, 500),
)
def test_composition_of_counters(parts: list[int], num_cells: int) -> None:
    committed, over, protected, evictable, available = parts
    total = sum(parts)
    pool = PoolCounters(total, available, evictable, protected, committed, over, 0, 0)
    cells = composition_cells(pool, num_cells)
    by_state = cells.tokens.sum(axis=0)
    if total:
        assert by_state[SlotState.COMMITTED] == committed
        assert by_state[SlotState.OVERALLOCATED] == over
        assert by_state[SlotState.CACHED_LOCKED] == protected
        assert by_state[SlotState.CACHED_EVICTABLE] == evictable
        assert by_state[SlotState.FREE] == available
        assert (cells.tokens.sum(axis=1) == np.diff(cells.edges)).all()
        assert (cells.tokens[np.arange(cells.tokens.shape[0]), cells.dominant] == cells.tokens.max(axis=1)).all()
    assert not cells.positional and not cells.highlight.any()


def test_the_page_map_legend_wraps_between_entries_only() -> None:
    """Each colour stays on the line of its name, and no line is wider than asked (when an
    entry fits at all); with no width, one line."""
    from kvtrace.tui.remote.pagemap import STATE_LABELS
    from kvtrace.tui.widgets.page_map import MARKS, legend

    labels = list(STATE_LABELS)  # every state, leaked included, then the selection's marks
    assert "\n" not in legend().plain
    for width in range(16, 130):
        lines = legend(width=width).plain.split("\n")
        assert all(len(line) <= width for line in lines), (width, lines)
        entries = [e for line in lines for e in line.split("  ")]
        assert entries == [f"█ {label}" for label in labels] + [f"{c} {label}" for c, _, label in MARKS], (width, lines)
    assert len(legend(width=40).plain.split("\n")) > 1


def test_step_ticks_stand_apart_at_any_width() -> None:
    """The x axis's step ticks: round intervals, short labels, never closer than their
    labels are wide, more of them on a wider plot."""
    from kvtrace.tui.widgets.occupancy import StepsFormatter

    steps = StepsFormatter()
    counts = []
    for columns in (12, 24, 60, 120, 200):
        steps.columns = columns
        for lo, hi in ((0, 77_270), (0, 138), (1_000, 1_050), (0, 3)):
            ticks, labels = steps.get_ticks_and_labels(lo, hi)
            assert ticks and all(lo <= t <= hi + 1e-9 for t in ticks), (columns, lo, hi, ticks)
            if len(ticks) > 1:
                apart = columns * (ticks[1] - ticks[0]) / (hi - lo)
                assert apart >= max(map(len, labels)) + 1, (columns, labels)
        counts.append(len(steps.get_ticks_and_labels(0, 77_270)[0]))
    assert counts == sorted(counts) and counts[0] < counts[-1]
    steps.columns = 120
    assert steps.get_ticks_and_labels(0, 77_270)[1][:3] == ["0", "10k", "20k"]
