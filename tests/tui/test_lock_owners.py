"""Ownership through radix locks on the page map: a request pins the cached prefix pages
of its locked node's path; the selected request's pinned cells are drawn apart from its
own; a clicked cell names the requests pinning its pages and, for evictable pages, the
last request seen locking their node."""

from __future__ import annotations

import numpy as np

from allocator.ownership import SlotState
from kvtrace.replay.session import ReplaySession
from kvtrace.tui.remote.pagemap import LastUsers, cell_detail, page_map
from kvtrace.tui.widgets.page_map import HIGHLIGHT_CHAR, PINNED_CHAR, PageMap
from kvtrace.tui.widgets.request_table import RequestTable
from tests.helpers import SIZE, at_step, live_app, settle, text_of

STEP = 60


def _pinning_request(step: int) -> tuple[int, np.ndarray]:
    """A live request with a locked prefix at ``step``, and the pages of that prefix
    (from its row: ``[0, cache_protected_len)``)."""
    with ReplaySession("sample:tiny", track_state=True, checker="inline", allocator_in_step=True) as s:
        s.seek(step)
        alloc = s.allocator
        ps = alloc.page_size
        for rid in s.state.live_rids().tolist():
            prot = int(alloc.request_lens(np.array([rid])).protected[0])
            if prot:
                return int(rid), np.unique(alloc.row_slots(int(rid))[:prot].astype(np.int64) // ps)
    raise AssertionError(f"no request pins a prefix at step {step}")


def test_every_locked_page_is_pinned_by_the_requests_locking_its_path() -> None:
    with ReplaySession("sample:tiny", track_state=True, checker="inline", allocator_in_step=True) as s:
        for i, _ in enumerate(s.snapshots()):
            if i % 10:
                continue
            own = s.allocator.slot_ownership()
            locked = np.unique(np.flatnonzero(own.state == SlotState.CACHED_LOCKED) // own.page_size)
            assert own.pins is not None
            assert np.array_equal(np.unique(own.pins.pages), locked), i
            alloc = s.allocator
            for rid in s.state.live_rids().tolist():  # each request pins its whole protected prefix
                prot = int(alloc.request_lens(np.array([rid])).protected[0])
                prefix = np.unique(alloc.row_slots(rid)[:prot].astype(np.int64) // own.page_size)
                assert np.isin(prefix, own.pins.pages[own.pins.rids == rid]).all(), (i, rid)


def test_a_cached_cell_names_its_pinners_then_its_last_user() -> None:
    rid, prefix = _pinning_request(STEP)
    with ReplaySession("sample:tiny", track_state=True, checker="inline", allocator_in_step=True) as s:
        s.seek(STEP)
        own, cells = page_map(s.allocator, 10_000, rid)  # type: ignore[misc]
        ps = own.page_size
        index = int(np.searchsorted(cells.edges, prefix[0] * ps, side="right") - 1)
        assert cells.pinned is not None and cells.pinned[index]
        detail = cell_detail(own, cells, index)
        assert rid in [r for r, _ in detail.pinned]
        assert rid not in [r for r, _ in detail.owners]  # pinned, not its own
        # step on: a page locked at one step and evictable at the next names one of the
        # requests that pinned it as its last user
        users = LastUsers()
        users.see(own)
        before = own
        checked = 0
        while s.step() is not None:
            own, cells = page_map(s.allocator, 10_000, None)  # type: ignore[misc]
            assert cells.edges.shape[0] - 1 == own.holders.shape[0]  # one page per cell
            was_locked = before.state[::ps] == SlotState.CACHED_LOCKED
            now_evictable = own.state[::ps] == SlotState.CACHED_EVICTABLE
            for page in np.flatnonzero(was_locked & now_evictable)[:3].tolist():
                pinners = set(before.pins.rids[before.pins.pages == page].tolist())  # type: ignore[union-attr]
                named = [r for r, _ in cell_detail(own, cells, page, last_users=users).last_users]
                assert len(named) == 1 and named[0] in pinners, (page, named, pinners)
                checked += 1
            if checked >= 5:
                break
            users.see(own)
            before = own
        assert checked


async def test_the_selected_request_shows_its_pinned_prefix_apart_and_a_cell_its_pinners() -> None:
    rid, prefix = _pinning_request(STEP)
    app = live_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("g", *str(STEP), "enter")
        await settle(pilot, at_step(STEP), timeout_s=60)
        app.main.query_one(RequestTable).select_rid(rid)
        await settle(pilot, lambda a: a.frame.selected_rid == rid and a.frame.page_cells is not None
                     and a.frame.page_cells.pinned is not None and bool(a.frame.page_cells.pinned.any()))
        cells = app.frame.page_cells
        want = np.unique(np.searchsorted(cells.edges, prefix * app.driver.info.page_size, side="right") - 1)
        pinned_only = np.flatnonzero(cells.pinned & ~cells.highlight)
        assert np.isin(pinned_only, want).all() and pinned_only.shape[0], (pinned_only, want)
        page_map_widget = app.main.query_one(PageMap)
        drawn = "".join(ch for ch, _ in page_map_widget._chars)
        assert PINNED_CHAR in drawn and HIGHLIGHT_CHAR in drawn
        assert all(drawn[i] == PINNED_CHAR for i in pinned_only)
        width = page_map_widget.size.width
        i = int(pinned_only[0])
        await pilot.click(PageMap, offset=(i % width, i // width))
        await settle(pilot, lambda a: "pinned by lock" in text_of(a.main.query_one("#cell-info")))
        assert f"rid {rid} (" in text_of(app.main.query_one("#cell-info")).split("pinned by lock")[1]
