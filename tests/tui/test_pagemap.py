"""The page-map data: every slot's state agrees with the pool counters at every step, the
cells add up, the composition of a state log adds up (hypothesis)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from allocator.base import PoolCounters
from kvtrace.session import ReplaySession
from kvtrace.tui.pagemap import NUM_STATES, SlotState, cell_detail, composition_cells, reduce_cells, slot_ownership


def _check_step(session: ReplaySession) -> None:
    own = slot_ownership(session.allocator)
    assert own is not None
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
        with ReplaySession(trace, track_state=True, screen="inline", allocator_in_step=True) as s:
            for i, _ in enumerate(s.snapshots()):
                if i % every == 0:
                    _check_step(s)


def test_cells_add_up_and_highlight_the_selected_request() -> None:
    with ReplaySession("sample:tiny", track_state=True, screen="inline", allocator_in_step=True) as s:
        s.seek(60)
        own = slot_ownership(s.allocator)
        rid = int(s.state.live_rids()[0])
        cells = reduce_cells(own, 37, highlight_rid=rid)
        ps = own.page_size
        assert cells.tokens.shape == (37, NUM_STATES)
        assert int(cells.tokens.sum()) == own.state.shape[0] - ps  # every slot but page 0's
        assert (np.diff(cells.edges) % ps == 0).all()  # whole pages
        owned = np.flatnonzero(own.owner == rid)
        expect = np.unique(np.searchsorted(cells.edges, owned, side="right") - 1)
        assert np.array_equal(np.flatnonzero(cells.highlight), expect)
        detail = cell_detail(own, cells, int(expect[0]))
        assert rid in [r for r, _ in detail.owners]
        assert sum(detail.tokens.values()) == int(cells.tokens[expect[0]].sum())


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
    assert not cells.positional
