"""Page-map data for the screen, built on the allocator's ownership query.

The allocator says which state every KV slot is in and which request owns it
(``allocator.ownership``: ``SlotOwnership`` through the optional protocol
``allocator.base.OwnershipQuery``, ``reduce_cells`` to shrink it to a screen's worth of
cells of whole pages, ``cell_pages`` for one cell). What only the screen needs lives
here: the cells of the selected request (highlighted), the owners of a clicked cell
summed by request, and, for a state log (which records counters, not slot positions),
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
    "NO_SWA_PAGE_MAP",
    "STATE_LABELS",
    "CellDetail",
    "PageCells",
    "cell_detail",
    "composition_cells",
    "highlight_cells",
    "page_map",
]

STATE_LABELS = ("free", "committed", "over-allocated", "page tail", "cached", "locked", "reserved", "leaked")
NO_PAGE_MAP = "no page map for this version (it does not answer slot_ownership())"
NO_SWA_PAGE_MAP = "no map of the swa pool for this version (it does not answer swa_slot_ownership())"
_OWN_STATES = np.array([SlotState.COMMITTED, SlotState.OVERALLOCATED, SlotState.PAGE_TAIL])


class PageCells(NamedTuple):
    """What the page map draws: the allocator's cells, the selected request's cells, and
    whether the cells are positions in the pool (False: a composition by state)."""

    edges: np.ndarray  # int64 [n + 1] slot boundaries: cell i is slots [edges[i], edges[i + 1])
    tokens: np.ndarray  # int64 [n, NUM_STATES] slots of each state in each cell
    dominant: np.ndarray  # int8 [n] the state holding most slots of the cell
    highlight: np.ndarray  # bool [n] cells holding a slot of the selected request
    positional: bool

    @classmethod
    def of(cls, cells: OwnershipCells, highlight: np.ndarray | None = None, positional: bool = True) -> PageCells:
        """The screen's cells from the allocator's ``OwnershipCells``."""
        n = cells.dominant.shape[0]
        mark = np.zeros(n, bool) if highlight is None else highlight
        return cls(cells.edges, cells.tokens, cells.dominant, mark, positional)

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
    return own, PageCells.of(cells, highlight_cells(own, cells, rid))


def highlight_cells(own: SlotOwnership, cells: OwnershipCells, rid: int | None) -> np.ndarray:
    """bool ``[n]``: the cells holding a slot request ``rid`` owns (none for None)."""
    n = cells.dominant.shape[0]
    mark = np.zeros(n, bool)
    if rid is not None:
        slots = np.flatnonzero(own.owner == rid)
        mark[np.searchsorted(cells.edges, slots, side="right") - 1] = True
    return mark


def cell_detail(own: SlotOwnership, cells: PageCells, index: int, max_owners: int = 12) -> CellDetail:
    """The pages of cell ``index`` with slots per state and the requests owning them
    (each request's own slots: committed, over-allocated, page tail).

    Raises:
        IndexError: ``index`` is not a cell.
    """
    pages = cell_pages(own, cells.ownership_cells, index)
    owned = pages.tokens[:, _OWN_STATES].sum(axis=1)
    held = (pages.owner >= 0) & (owned > 0)
    rids, where = np.unique(pages.owner[held], return_inverse=True)
    slots = np.bincount(where, weights=owned[held], minlength=rids.shape[0]).astype(np.int64)
    order = np.argsort(-slots, kind="stable")[:max_owners]
    tokens = {STATE_LABELS[s]: int(c) for s, c in enumerate(cells.tokens[index]) if c}
    first = int(pages.pages[0]) if pages.pages.shape[0] else 0
    last = int(pages.pages[-1]) if pages.pages.shape[0] else -1
    return CellDetail(index, first, last, tokens, [(int(rids[i]), int(slots[i])) for i in order])


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
