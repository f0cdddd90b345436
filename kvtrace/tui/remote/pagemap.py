"""Page-map data for the screen, built on the allocator's ownership query.

The allocator says which state every KV slot is in and which request owns it
(``allocator.ownership``: ``SlotOwnership`` through the optional protocol
``allocator.base.OwnershipQuery``, ``reduce_cells`` to shrink it to a screen's worth of
cells of whole pages, ``cell_pages`` for one cell). What only the screen needs lives
here: the cells of the selected request (highlighted: the pages it owns, and apart
from them the cached prefix pages it pins through its radix lock), the owners of a
clicked cell summed by request (its own slots, the pages it pins, and for evictable
cached pages the last request seen locking their tree node), and, for a state log (which records counters, not slot positions),
the pool laid out by state.

Nothing here imports Textual: the replay side of the dashboard (its own process)
builds these and sends them to the screen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from allocator.ownership import NUM_STATES, OwnershipCells, SlotOwnership, SlotState, cell_pages, reduce_cells

if TYPE_CHECKING:
    from allocator.base import PoolCounters

__all__ = [
    "NO_PAGE_MAP",
    "NO_MAMBA_PAGE_MAP",
    "NO_SWA_PAGE_MAP",
    "STATE_LABELS",
    "CellDetail",
    "LastUsers",
    "PageCells",
    "cell_detail",
    "composition_cells",
    "highlight_cells",
    "pinned_cells",
    "page_map",
]

STATE_LABELS = ("free", "committed", "over-allocated", "page tail", "cached", "locked", "reserved", "leaked")
NO_PAGE_MAP = "no page map for this version (it does not answer slot_ownership())"
NO_SWA_PAGE_MAP = "no map of the swa pool for this version (it does not answer swa_slot_ownership())"
NO_MAMBA_PAGE_MAP = "the mamba pool has no pages: one state slot per running request, counted in the chart"
_OWN_STATES = np.array([SlotState.COMMITTED, SlotState.OVERALLOCATED, SlotState.PAGE_TAIL])


class PageCells(NamedTuple):
    """What the page map draws: the allocator's cells, the selected request's cells (own
    and pinned), and whether the cells are positions in the pool (False: a composition
    by state)."""

    edges: np.ndarray  # int64 [n + 1] slot boundaries: cell i is slots [edges[i], edges[i + 1])
    tokens: np.ndarray  # int64 [n, NUM_STATES] slots of each state in each cell
    dominant: np.ndarray  # int8 [n] the state holding most slots of the cell
    highlight: np.ndarray  # bool [n] cells holding a slot of the selected request
    positional: bool
    pinned: np.ndarray | None = None  # bool [n] cells holding a page it pins through its lock (None: none)

    @classmethod
    def of(cls, cells: OwnershipCells, highlight: np.ndarray | None = None, positional: bool = True,
           pinned: np.ndarray | None = None) -> PageCells:
        """The screen's cells from the allocator's ``OwnershipCells``."""
        n = cells.dominant.shape[0]
        mark = np.zeros(n, bool) if highlight is None else highlight
        return cls(cells.edges, cells.tokens, cells.dominant, mark, positional, pinned)

    @property
    def ownership_cells(self) -> OwnershipCells:
        return OwnershipCells(self.edges, self.tokens, self.dominant)


class CellDetail(NamedTuple):
    """What one cell holds: its pages, slots per state, and the requests owning them."""

    index: int
    first_page: int
    last_page: int  # inclusive
    tokens: dict[str, int]  # state label -> slots
    owners: list[tuple[int, int]]  # (rid, slots), most slots first
    pinned: list[tuple[int, int]] = []  # (rid, slots) of cached pages it pins through a lock, most first
    last_users: list[tuple[int, int]] = []  # (rid, slots) of evictable pages whose node it locked last


class LastUsers:
    """The last request seen locking each radix node, for "who held this evictable
    page". The allocator keeps no such record, so this remembers the lock pins of every
    page map made: a request that locked a node and let go between two maps is missed."""

    def __init__(self) -> None:
        self._rid: dict[int, int] = {}

    def see(self, own: SlotOwnership) -> None:
        """Note the lockers in ``own`` (a later map's pin replaces an earlier one)."""
        if own.pins is not None and own.pins.nodes.shape[0]:
            self._rid.update(zip(own.pins.nodes.tolist(), own.pins.rids.tolist()))

    def of(self, nodes: np.ndarray) -> np.ndarray:
        """int64 ``[k]``: the last locker of each node id, -1 where none was seen."""
        get = self._rid.get
        return np.fromiter((get(n, -1) for n in nodes.tolist()), np.int64, nodes.shape[0])

    def clear(self) -> None:
        self._rid.clear()


def page_map(allocator: object, num_cells: int, rid: int | None = None,
             pool: int = 0) -> tuple[SlotOwnership, PageCells] | None:
    """The page map of a live allocator: the slot ownership of its pool ``pool`` (an
    index into ``POOL_NAMES``: 0 the full pool, 1 a hybrid model's sliding-window pool)
    reduced to ``num_cells`` cells, the cells of request ``rid`` highlighted.

    Returns:
        None when the version does not implement the optional ``OwnershipQuery``
        protocol (``slot_ownership()``; for the SWA pool ``swa_slot_ownership()``): the
        screen then says ``NO_PAGE_MAP`` (``NO_SWA_PAGE_MAP``).
    """
    query = getattr(allocator, "slot_ownership" if pool == 0 else "swa_slot_ownership", None)
    if query is None:
        return None
    own: SlotOwnership | None = query()
    if own is None:
        return None
    cells = reduce_cells(own, max(num_cells, 1))
    return own, PageCells.of(cells, highlight_cells(own, cells, rid), pinned=pinned_cells(own, cells, rid))


def highlight_cells(own: SlotOwnership, cells: OwnershipCells, rid: int | None) -> np.ndarray:
    """bool ``[n]``: the cells holding a slot request ``rid`` owns (none for None)."""
    n = cells.dominant.shape[0]
    mark = np.zeros(n, bool)
    if rid is not None:
        slots = np.flatnonzero(own.owner == rid)
        mark[np.searchsorted(cells.edges, slots, side="right") - 1] = True
    return mark


def pinned_cells(own: SlotOwnership, cells: OwnershipCells, rid: int | None) -> np.ndarray:
    """bool ``[n]``: the cells holding a page request ``rid`` pins through its radix lock
    (none for None, or when the allocator does not say)."""
    n = cells.dominant.shape[0]
    mark = np.zeros(n, bool)
    if rid is not None and own.pins is not None:
        pages = own.pins.pages[own.pins.rids == rid]
        mark[np.searchsorted(cells.edges, pages * own.page_size, side="right") - 1] = True
    return mark


def _by_rid(rids: np.ndarray, slots: np.ndarray, limit: int) -> list[tuple[int, int]]:
    """(rid, slots) summed by request, most slots first, at most ``limit``."""
    keep = rids >= 0
    uniq, where = np.unique(rids[keep], return_inverse=True)
    total = np.bincount(where, weights=slots[keep], minlength=uniq.shape[0]).astype(np.int64)
    order = np.argsort(-total, kind="stable")[:limit]
    return [(int(uniq[i]), int(total[i])) for i in order]


def cell_detail(own: SlotOwnership, cells: PageCells, index: int, max_owners: int = 12,
                last_users: LastUsers | None = None) -> CellDetail:
    """The pages of cell ``index`` with slots per state and the requests holding them:
    each request's own slots (committed, over-allocated, page tail), the cached pages
    it pins through its radix lock, and for evictable cached pages the request
    ``last_users`` last saw locking their node.

    Raises:
        IndexError: ``index`` is not a cell.
    """
    pages = cell_pages(own, cells.ownership_cells, index)
    owned = pages.tokens[:, _OWN_STATES].sum(axis=1)
    held = (pages.owner >= 0) & (owned > 0)
    owners = _by_rid(pages.owner[held], owned[held], max_owners)
    tokens = {STATE_LABELS[s]: int(c) for s, c in enumerate(cells.tokens[index]) if c}
    first = int(pages.pages[0]) if pages.pages.shape[0] else 0
    last = int(pages.pages[-1]) if pages.pages.shape[0] else -1
    pinned: list[tuple[int, int]] = []
    users: list[tuple[int, int]] = []
    if own.pins is not None and pages.pages.shape[0]:
        inside = (own.pins.pages >= first) & (own.pins.pages <= last)
        pinned = _by_rid(own.pins.rids[inside], np.full(int(inside.sum()), own.page_size, np.int64), max_owners)
    if last_users is not None and own.page_node is not None and pages.pages.shape[0]:
        evictable = pages.tokens[:, SlotState.CACHED_EVICTABLE]
        hit = evictable > 0
        rids = last_users.of(own.page_node[pages.pages[hit]])
        users = _by_rid(rids, evictable[hit], max_owners)
    return CellDetail(index, first, last, tokens, owners, pinned, users)


def composition_cells(pool: PoolCounters, num_cells: int) -> PageCells:
    """The pool counters laid out by state over ``num_cells`` cells (no positions: a
    state log does not record which slot holds what; the screen says so)."""
    counts = np.zeros(NUM_STATES, np.int64)
    counts[SlotState.COMMITTED] = pool.committed
    counts[SlotState.OVERALLOCATED] = pool.overallocated
    counts[SlotState.CACHED_LOCKED] = pool.protected
    counts[SlotState.CACHED_EVICTABLE] = pool.evictable
    counts[SlotState.FREE] = pool.available
    order = [SlotState.COMMITTED, SlotState.OVERALLOCATED, SlotState.CACHED_LOCKED, SlotState.CACHED_EVICTABLE,
             SlotState.FREE]
    total = max(int(counts.sum()), 1)
    n = max(1, num_cells)
    edges = np.arange(n + 1, dtype=np.int64) * total // n
    bounds = np.concatenate([[0], np.cumsum(counts[order])])
    tokens = np.zeros((n, NUM_STATES), np.int64)
    for k, s in enumerate(order):  # overlap of each cell with each state's span
        lo, hi = bounds[k], bounds[k + 1]
        tokens[:, s] = np.maximum(0, np.minimum(edges[1:], hi) - np.maximum(edges[:-1], lo))
    return PageCells(edges, tokens, tokens.argmax(axis=1).astype(np.int8), np.zeros(n, bool), False)
