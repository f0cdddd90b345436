"""Page-map data: the pool reduced to a screen's worth of cells, coloured by slot state.

Every KV slot is in one state (``SlotState``; the codes of the allocator's ownership
query ``Allocator.slot_ownership()``). For one request's row (page size 4)::

    position 0 ..... cache_protected_len ..... kv_committed_len ..... kv_allocated_len ..| ceil_align
             | CACHED_* (the tree's) |     COMMITTED      |   OVERALLOCATED    | PAGE_TAIL |

``pool_cells(allocator, n)`` is the one place the dashboard reads the allocator: it
maps every slot (``slot_ownership``) and reduces the map to ``n`` cells of whole
pages. A state log holds no slot positions: ``composition_cells`` lays the pool
counters out by state instead (the dashboard labels it so).
"""

from __future__ import annotations

from enum import IntEnum
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from allocator.base import PoolCounters

__all__ = [
    "NUM_STATES",
    "CellDetail",
    "PageCells",
    "SlotMap",
    "SlotState",
    "cell_detail",
    "composition_cells",
    "pool_cells",
    "reduce_cells",
    "slot_ownership",
]


class SlotState(IntEnum):
    """What a slot of the pool holds (int8 codes)."""

    FREE = 0
    COMMITTED = 1
    OVERALLOCATED = 2
    PAGE_TAIL = 3
    CACHED_EVICTABLE = 4
    CACHED_LOCKED = 5
    RESERVED = 6
    UNOWNED = 7


NUM_STATES = len(SlotState)
STATE_LABELS = ("free", "committed", "over-allocated", "page tail", "cached", "locked", "reserved", "leaked")


class SlotMap(NamedTuple):
    """State and owner of every slot; slot ``s`` is on page ``s // page_size``, page 0 reserved."""

    state: np.ndarray  # int8 [(num_pages + 1) * page_size] SlotState code per slot
    owner: np.ndarray  # int64 [(num_pages + 1) * page_size] request id holding the slot, -1 none
    page_size: int


class PageCells(NamedTuple):
    """The pool shrunk to ``n`` cells of whole pages."""

    edges: np.ndarray  # int64 [n + 1] slot boundaries: cell i is slots [edges[i], edges[i + 1])
    tokens: np.ndarray  # int64 [n, NUM_STATES] slots of each state in each cell
    highlight: np.ndarray  # bool [n] cells holding a slot of the selected request
    positional: bool  # False: a composition by state (no slot positions known)

    @property
    def dominant(self) -> np.ndarray:
        """int8 [n] the state holding most slots of each cell."""
        return self.tokens.argmax(axis=1).astype(np.int8)


class CellDetail(NamedTuple):
    """What one cell holds: its pages, slots per state, and the requests owning them."""

    index: int
    first_page: int
    last_page: int  # inclusive
    tokens: dict[str, int]  # state label -> slots
    owners: list[tuple[int, int]]  # (rid, slots), most slots first


def slot_ownership(allocator: object) -> SlotMap | None:
    """State and owner of every slot of a built-in allocator (None for a version that
    does not expose its pool: the map then says so).

    NOTE: the allocator's own ownership query (``Allocator.slot_ownership()``) replaces
    this function body when it is available: ``return allocator.slot_ownership()``.
    """
    if not all(hasattr(allocator, a) for a in ("req_kv", "req_to_token_pool", "tree_cache", "token_to_kv_pool_allocator")):
        return None
    from allocator.token_to_kv import HiSparseTokenToKVPoolAllocator

    a: Any = allocator
    a.end_step()  # apply queued prompt publishes first
    ps = a.page_size
    tok = a.token_to_kv_pool_allocator
    logical = tok.logical_attn_allocator if isinstance(tok, HiSparseTokenToKVPoolAllocator) else tok
    num_pages = a.pool_tokens // ps
    page_state = np.full(num_pages + 1, SlotState.UNOWNED, np.int8)
    free = logical.get_all_free_pages().astype(np.int64)
    page_state[free[(free >= 1) & (free <= num_pages)]] = SlotState.FREE
    nodes = list(a.tree_cache.iter_nodes())
    if nodes:
        values = np.concatenate([n.value for n in nodes]).astype(np.int64)
        locked = np.repeat(np.array([n.lock_ref > 0 for n in nodes]), [n.value.shape[0] for n in nodes])
        pages = values // ps
        ok = (pages >= 1) & (pages <= num_pages)
        page_state[pages[ok]] = np.where(locked[ok], SlotState.CACHED_LOCKED, SlotState.CACHED_EVICTABLE)
    page_state[0] = SlotState.RESERVED
    state = np.repeat(page_state, ps) if ps > 1 else page_state
    owner = np.full(state.shape[0], -1, np.int64)
    kv = a.req_kv
    rows = kv.rows_in_use()
    alloc, committed, prot = kv.kv_allocated_len[rows], kv.kv_committed_len[rows], kv.cache_protected_len[rows]
    ends = -(-alloc // ps) * ps
    counts = np.maximum(ends - prot, 0)
    total = int(counts.sum())
    if total:
        idx = np.repeat(np.arange(rows.shape[0]), counts)
        pos = np.repeat(prot - (np.cumsum(counts) - counts), counts) + np.arange(total)
        last = alloc[idx] - 1
        read = np.minimum(pos, last)  # a page tail's slots follow the last allocated slot on its page
        width = a.req_to_token_pool.max_context_len
        table = a.req_to_token_pool.req_to_token_np.reshape(-1)
        slots = table[rows[idx] * width + read].astype(np.int64) + (pos - read)
        code = np.where(
            pos < committed[idx],
            np.int8(SlotState.COMMITTED),
            np.where(pos <= last, np.int8(SlotState.OVERALLOCATED), np.int8(SlotState.PAGE_TAIL)),
        )
        ok = (slots >= ps) & (slots < state.shape[0])
        state[slots[ok]] = code[ok]
        owner[slots[ok]] = kv.rid[rows[idx[ok]]]
    return SlotMap(state, owner, ps)


def reduce_cells(own: SlotMap, num_cells: int, highlight_rid: int | None = None) -> PageCells:
    """Shrink the slot map to at most ``num_cells`` cells of (nearly) equal whole pages.

    Args:
        own: the slot map.
        num_cells: cells wanted (>= 1).
        highlight_rid: mark the cells holding a slot of this request.

    Returns:
        The cells (page 0, reserved, is left out).
    """
    ps = own.page_size
    num_pages = own.state.shape[0] // ps - 1
    n = max(1, min(num_cells, num_pages))
    edges = ps + np.arange(n + 1, dtype=np.int64) * num_pages // n * ps
    cell_of_slot = np.repeat(np.arange(n, dtype=np.int64), np.diff(edges))
    keys = cell_of_slot * NUM_STATES + own.state[ps:]
    tokens = np.bincount(keys, minlength=n * NUM_STATES).reshape(n, NUM_STATES)
    highlight = np.zeros(n, bool)
    if highlight_rid is not None:
        highlight[cell_of_slot[own.owner[ps:] == highlight_rid]] = True
    return PageCells(edges, tokens, highlight, True)


def pool_cells(allocator: object, num_cells: int, highlight_rid: int | None = None) -> tuple[SlotMap, PageCells] | None:
    """The page map of a live allocator (None when the version exposes no slot ownership)."""
    own = slot_ownership(allocator)
    if own is None:
        return None
    return own, reduce_cells(own, num_cells, highlight_rid)


def composition_cells(pool: PoolCounters, num_cells: int) -> PageCells:
    """The pool counters laid out by state over ``num_cells`` cells (no positions: a
    state log does not record which slot holds what)."""
    counts = np.zeros(NUM_STATES, np.int64)
    counts[SlotState.COMMITTED] = pool.committed
    counts[SlotState.OVERALLOCATED] = pool.overallocated
    counts[SlotState.CACHED_LOCKED] = pool.protected
    counts[SlotState.CACHED_EVICTABLE] = pool.evictable
    counts[SlotState.FREE] = pool.available
    order = [SlotState.COMMITTED, SlotState.OVERALLOCATED, SlotState.CACHED_LOCKED, SlotState.CACHED_EVICTABLE, SlotState.FREE]
    total = max(int(counts.sum()), 1)
    n = max(1, num_cells)
    edges = np.arange(n + 1, dtype=np.int64) * total // n
    bounds = np.concatenate([[0], np.cumsum(counts[order])])
    tokens = np.zeros((n, NUM_STATES), np.int64)
    for k, s in enumerate(order):  # overlap of each cell with each state's span
        lo, hi = bounds[k], bounds[k + 1]
        tokens[:, s] = np.maximum(0, np.minimum(edges[1:], hi) - np.maximum(edges[:-1], lo))
    return PageCells(edges, tokens, np.zeros(n, bool), False)


def cell_detail(own: SlotMap, cells: PageCells, index: int, max_owners: int = 12) -> CellDetail:
    """The pages of cell ``index`` with slots per state and the requests owning them.

    Raises:
        IndexError: ``index`` is not a cell.
    """
    n = cells.tokens.shape[0]
    if not 0 <= index < n:
        raise IndexError(f"cell {index} outside 0..{n - 1}")
    lo, hi = int(cells.edges[index]), int(cells.edges[index + 1])
    ps = own.page_size
    owners = own.owner[lo:hi]
    rids, counts = np.unique(owners[owners >= 0], return_counts=True)
    order = np.argsort(-counts, kind="stable")[:max_owners]
    tokens = {STATE_LABELS[s]: int(c) for s, c in enumerate(cells.tokens[index]) if c}
    return CellDetail(index, lo // ps, hi // ps - 1, tokens, [(int(rids[i]), int(counts[i])) for i in order])
