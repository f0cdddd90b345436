"""Page ownership: the state and the owner of every KV slot of the pool, vectorised.

Every slot of the pool is, at any instant, in one state (``SlotState``, int8 codes).
For one request's row (page size 4, the last page half used)::

    position  0 ........ cache_protected_len ...... kv_committed_len ...... kv_allocated_len ..| ceil_align
              |  CACHED_* (the tree's pages)  |       COMMITTED       |    OVERALLOCATED     | PAGE_TAIL |

* ``FREE``: on the free list (or staged for the sorted merge); owner -1.
* ``COMMITTED``: a live request's own KV ``[cache_protected_len, kv_committed_len)``.
* ``OVERALLOCATED``: its speculative slack ``[kv_committed_len, kv_allocated_len)``.
* ``PAGE_TAIL``: the padding of its last page ``[kv_allocated_len, ceil_align(kv_allocated_len))``.
  These three carry the request id as owner.
* ``CACHED_EVICTABLE`` / ``CACHED_LOCKED``: in the radix tree, on a node no request
  locks / some request locks (``lock_ref > 0``); owner -1 (the tree's).
* ``RESERVED``: page 0 (the padded tokens' dummy output), nobody's.
* ``UNOWNED``: held by nobody, i.e. leaked (only in a broken state).

``page_holders`` is THE computation of which party holds each page (free list,
radix tree, a request's own range): the invariant checker's ownership pass counts
holders with it, and ``slot_ownership`` colours the pool with it. ``reduce_cells``
shrinks the map to a screen's worth of cells, ``cell_pages`` lists the pages and
owners of one cell, ``request_slots`` gives one request's slots for highlighting.

A cached page has no owner in ``owner`` (the tree holds it), yet a request that locks
a radix node pins every page on the path from that node up to the root: ``lock_pins``
lists those (page, request, node) pairs, and ``slot_ownership`` attaches them
(``SlotOwnership.pins``) with the tree node of every cached page (``page_node``), so
the screen can say who holds the cached part of the pool.
"""

from __future__ import annotations

from enum import IntEnum
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from allocator.pages import ceil_align

if TYPE_CHECKING:
    from allocator.base import Allocator
    from allocator.manager import KvAllocator

__all__ = [
    "NUM_STATES",
    "CellPages",
    "LockPins",
    "OwnershipCells",
    "PageHolders",
    "RequestSlots",
    "SlotOwnership",
    "SlotState",
    "cell_pages",
    "lock_pins",
    "page_holders",
    "reduce_cells",
    "request_slots",
    "slot_ownership",
]


class SlotState(IntEnum):
    """What a slot of the pool is used for (int8 codes of ``SlotOwnership.state``)."""

    FREE = 0
    COMMITTED = 1
    OVERALLOCATED = 2
    PAGE_TAIL = 3
    CACHED_EVICTABLE = 4
    CACHED_LOCKED = 5
    RESERVED = 6
    UNOWNED = 7


NUM_STATES = len(SlotState)


class SlotOwnership(NamedTuple):
    """The state and owner of every slot: slot ``s`` is on page ``s // page_size``.

    Slots ``[0, page_size)`` are page 0 (``RESERVED``); the pool proper is pages
    ``1..num_pages``. Where a broken state has a page held twice, the request's
    claim is shown and ``holders`` says how many parties hold the page.
    """

    state: np.ndarray  # int8 [(num_pages + 1) * page_size] SlotState code per slot
    owner: np.ndarray  # int64 [(num_pages + 1) * page_size] request id holding the slot, -1 none
    holders: np.ndarray  # int64 [num_pages + 1] parties holding each page (1 when sound, 0 for page 0)
    page_size: int
    pins: LockPins | None = None  # pages requests pin through radix locks (None: not known)
    page_node: np.ndarray | None = None  # int64 [num_pages + 1] radix node id of each cached page, -1 else

    def token_counts(self) -> np.ndarray:
        """int64 ``[NUM_STATES]`` slots in each state (``SlotState`` order)."""
        return np.bincount(self.state, minlength=NUM_STATES)


_EMPTY_I64 = np.empty(0, dtype=np.int64)


class PageHolders(NamedTuple):
    """Who holds which page, party by party (page ids; page 1: slot ids)."""

    num_pages: int
    free_pages: np.ndarray  # int64 [f] free list, then staged pages
    tree_pages: np.ndarray  # int64 [t] one entry per cached page
    tree_locked: np.ndarray  # bool [t] the page's node is locked (lock_ref > 0)
    req_pages: np.ndarray  # int64 [q] one entry per page of [cache_protected_len, ceil_align(allocated))
    req_index: np.ndarray  # int64 [q] which of the requests passed holds it
    counts: np.ndarray  # int64 [num_pages + 1] holders per page (ids outside the pool not counted)
    outside: np.ndarray  # int64 page ids outside 0..num_pages (a broken state)


def _tree_pages(allocator: KvAllocator) -> tuple[np.ndarray, np.ndarray]:
    """Pages of every radix node and whether each node is locked (one Python pass over nodes)."""
    # (a HiCache node evicted to the host holds no device page: value None)
    nodes = [node for node in allocator.tree_cache.iter_nodes() if node.value is not None]
    if not nodes:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=bool)
    values = np.concatenate([node.value for node in nodes]).astype(np.int64)
    locked = np.repeat(
        np.fromiter((node.lock_ref > 0 for node in nodes), dtype=bool, count=len(nodes)),
        np.fromiter((node.value.shape[0] for node in nodes), dtype=np.int64, count=len(nodes)),
    )
    ps = allocator.page_size
    if ps > 1:
        return values[::ps] // ps, locked[::ps]
    return values, locked


class LockPins(NamedTuple):
    """Pages pinned through radix-cache locks: a request locking node ``n`` keeps every
    node on the path root..n from eviction, so it holds their pages too. One entry per
    (page, request): a page pinned by three requests appears three times."""

    pages: np.ndarray  # int64 [k] page ids (page 1: slot ids)
    rids: np.ndarray  # int64 [k] the request pinning the page
    nodes: np.ndarray  # int64 [k] id of the radix node holding the page


_NO_PINS = LockPins(np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64))


def lock_pins(allocator: KvAllocator) -> LockPins | None:
    """The pages each live request pins through its radix lock (``req_kv.lock_node``).

    One Python pass over the locked paths (a node shared by many requests is read
    once). None when the allocator keeps no lock nodes (another design).
    """
    kv = getattr(allocator, "req_kv", None)
    tree = getattr(allocator, "tree_cache", None)
    locks = getattr(kv, "lock_node", None)
    if locks is None or tree is None:
        return None
    ps = allocator.page_size
    root = tree.root_node
    node_pages: dict[int, np.ndarray] = {}
    pages: list[np.ndarray] = []
    rids: list[np.ndarray] = []
    nodes: list[np.ndarray] = []
    rows = kv.rows_in_use()
    for row, rid in zip(rows.tolist(), kv.rid[rows].tolist()):
        node = locks[row]
        while node is not None and node is not root:
            got = node_pages.get(node.id)
            if got is None:
                value = _EMPTY_I64 if node.value is None else node.value.astype(np.int64)
                got = node_pages[node.id] = value[::ps] // ps if ps > 1 else value
            if got.shape[0]:
                pages.append(got)
                rids.append(np.full(got.shape[0], rid, np.int64))
                nodes.append(np.full(got.shape[0], node.id, np.int64))
            node = node.parent
    if not pages:
        return _NO_PINS
    return LockPins(np.concatenate(pages), np.concatenate(rids), np.concatenate(nodes))


def _page_nodes(allocator: KvAllocator, num_pages: int) -> np.ndarray:
    """int64 ``[num_pages + 1]``: the radix node id holding each cached page, -1 elsewhere."""
    out = np.full(num_pages + 1, -1, np.int64)
    nodes = [node for node in allocator.tree_cache.iter_nodes() if node.value is not None]
    if not nodes:
        return out
    values = np.concatenate([node.value for node in nodes]).astype(np.int64)
    ids = np.repeat(np.fromiter((node.id for node in nodes), np.int64, len(nodes)),
                    np.fromiter((node.value.shape[0] for node in nodes), np.int64, len(nodes)))
    ps = allocator.page_size
    if ps > 1:
        values, ids = values[::ps] // ps, ids[::ps]
    inside = (values >= 0) & (values <= num_pages)
    out[values[inside]] = ids[inside]
    return out


def full_side(tok: object) -> object:
    """The allocator of the pool that request rows index: the logical side of a HiSparse
    pair, the full pool of an SWA pair, else ``tok`` itself."""
    from allocator.swa import SWATokenToKVPoolAllocator
    from allocator.token_to_kv import HiSparseTokenToKVPoolAllocator

    if isinstance(tok, HiSparseTokenToKVPoolAllocator):
        return tok.logical_attn_allocator
    if isinstance(tok, SWATokenToKVPoolAllocator):
        return tok.full_attn_allocator
    return tok


def page_holders(
    allocator: KvAllocator, rows: np.ndarray, allocated: np.ndarray, protected: np.ndarray
) -> PageHolders:
    """Every party's pages: the free list, the radix tree, and each request's own range.

    Args:
        allocator: the built-in allocator (white-box).
        rows: int64 ``[n]`` rows in use whose lengths are sane (``0 <= protected <=
            allocated <= row width``, ``protected`` page aligned).
        allocated: int64 ``[n]`` their ``kv_allocated_len``.
        protected: int64 ``[n]`` their ``cache_protected_len``.

    Returns:
        The holders, with the number of holders of each page (1 everywhere but
        page 0 when the state is sound).
    """
    logical = full_side(allocator.token_to_kv_pool_allocator)
    ps = allocator.page_size
    num_pages = allocator.pool_tokens // ps
    free_pages = logical.get_all_free_pages().astype(np.int64)
    tree_pages, tree_locked = _tree_pages(allocator)
    pool = allocator.req_to_token_pool
    width = pool.max_context_len
    first_page = protected // ps
    page_counts = np.maximum(ceil_align(allocated, ps) // ps - first_page, 0)
    total = int(page_counts.sum())
    offsets = np.cumsum(page_counts) - page_counts
    page_pos = (np.repeat(first_page - offsets, page_counts) + np.arange(total, dtype=np.int64)) * ps
    req_index = np.repeat(np.arange(rows.shape[0], dtype=np.int64), page_counts)
    flat = pool.req_to_token_np.reshape(-1)
    req_pages = flat[np.repeat(rows * width, page_counts) + page_pos].astype(np.int64) // ps
    everything = np.concatenate([free_pages, tree_pages, req_pages])
    outside = everything[:0]
    if everything.shape[0] and (int(everything.min()) < 0 or int(everything.max()) > num_pages):
        inside = (everything >= 0) & (everything <= num_pages)
        outside = everything[~inside]
        everything = everything[inside]
    counts = np.bincount(everything, minlength=num_pages + 1)
    return PageHolders(num_pages, free_pages, tree_pages, tree_locked, req_pages, req_index, counts, outside)


def _sane_rows(allocator: KvAllocator) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Rows in use whose lengths can be read as ranges, with rid, allocated, committed, protected.

    Returns:
        int64 arrays ``(rows, rids, allocated, committed, protected)``.
    """
    kv = allocator.req_kv
    ps = allocator.page_size
    width = allocator.req_to_token_pool.max_context_len
    rows = kv.rows_in_use()
    alloc = kv.kv_allocated_len[rows]
    committed = kv.kv_committed_len[rows]
    prot = kv.cache_protected_len[rows]
    ok = (prot >= 0) & (prot <= alloc) & (alloc <= width) & (prot % ps == 0)
    if not ok.all():
        rows, alloc, committed, prot = rows[ok], alloc[ok], committed[ok], prot[ok]
    return rows, kv.rid[rows], alloc, committed, prot


def slot_ownership(allocator: KvAllocator) -> SlotOwnership:
    """The state and owner of every slot of ``allocator``'s pool (no Python loop over slots).

    Args:
        allocator: the built-in allocator; its queued prompt publishes must be applied
            (``KvAllocator.slot_ownership`` does that).

    Returns:
        The map; its ``token_counts()`` equal ``counters()`` when the state is sound
        (``available``: FREE, ``evictable``, ``protected``: the CACHED states,
        ``committed``: COMMITTED, ``overallocated``: OVERALLOCATED + PAGE_TAIL).
    """
    ps = allocator.page_size
    rows, rids, alloc, committed, prot = _sane_rows(allocator)
    held = page_holders(allocator, rows, alloc, prot)
    num_pages = held.num_pages
    page_state = np.full(num_pages + 1, SlotState.UNOWNED, dtype=np.int8)
    free_pages, tree_pages, tree_locked = held.free_pages, held.tree_pages, held.tree_locked
    if held.outside.shape[0]:  # a broken state: leave ids outside the pool out
        free_pages = free_pages[(free_pages >= 0) & (free_pages <= num_pages)]
        ok = (tree_pages >= 0) & (tree_pages <= num_pages)
        tree_pages, tree_locked = tree_pages[ok], tree_locked[ok]
    page_state[free_pages] = SlotState.FREE
    # CACHED_LOCKED is CACHED_EVICTABLE + 1
    page_state[tree_pages] = tree_locked.view(np.int8) + np.int8(SlotState.CACHED_EVICTABLE)
    page_state[0] = SlotState.RESERVED
    state = np.repeat(page_state, ps) if ps > 1 else page_state
    num_slots = state.shape[0]
    owner = np.full(num_slots, -1, dtype=np.int64)
    # The requests' own slots, position by position: [protected, ceil_align(allocated)).
    ends = ceil_align(alloc, ps)
    counts = np.maximum(ends - prot, 0)
    total = int(counts.sum())
    if total:
        idx = np.repeat(np.arange(rows.shape[0], dtype=np.int64), counts)
        positions = np.repeat(prot - (np.cumsum(counts) - counts), counts) + np.arange(total, dtype=np.int64)
        # A page tail's slots follow the last allocated slot on its page.
        last = alloc[idx] - 1
        read = np.minimum(positions, last) if ps > 1 else positions
        width = allocator.req_to_token_pool.max_context_len
        flat = allocator.req_to_token_pool.req_to_token_np.reshape(-1)
        slots = flat[rows[idx] * width + read].astype(np.int64)
        if ps > 1:
            slots += positions - read
        slot_state = np.where(
            positions < committed[idx],
            np.int8(SlotState.COMMITTED),
            np.where(positions <= last, np.int8(SlotState.OVERALLOCATED), np.int8(SlotState.PAGE_TAIL)),
        )
        valid = (slots >= ps) & (slots < num_slots)
        if not valid.all():
            slots, slot_state, idx = slots[valid], slot_state[valid], idx[valid]
        state[slots] = slot_state
        owner[slots] = rids[idx]
    pins = lock_pins(allocator)
    if pins is not None and pins.pages.shape[0]:
        inside = (pins.pages >= 0) & (pins.pages <= num_pages)
        if not inside.all():
            pins = LockPins(pins.pages[inside], pins.rids[inside], pins.nodes[inside])
    return SlotOwnership(state, owner, held.counts, ps, pins, _page_nodes(allocator, num_pages))


class OwnershipCells(NamedTuple):
    """The pool shrunk to ``n`` cells of whole pages, for a screen."""

    edges: np.ndarray  # int64 [n + 1] slot boundaries: cell i is slots [edges[i], edges[i + 1])
    tokens: np.ndarray  # int64 [n, NUM_STATES] slots of each state in each cell
    dominant: np.ndarray  # int8 [n] the state holding most slots of the cell (lowest code on a tie)


def reduce_cells(own: SlotOwnership, num_cells: int) -> OwnershipCells:
    """Shrink the slot map to at most ``num_cells`` cells of (nearly) equal whole pages.

    Args:
        own: the slot map.
        num_cells: cells wanted (>= 1); fewer when the pool has fewer pages.

    Returns:
        Cell boundaries, per-state token counts and the dominant state of each cell.

    Raises:
        ValueError: ``num_cells < 1``.
    """
    if num_cells < 1:
        raise ValueError(f"reduce_cells: num_cells must be >= 1, found {num_cells}")
    ps = own.page_size
    num_slots = own.state.shape[0]
    num_pages = num_slots // ps
    n = min(num_cells, num_pages)
    edges = np.arange(n + 1, dtype=np.int64) * num_pages // n * ps
    cell = np.repeat(np.arange(n, dtype=np.int64) * NUM_STATES, np.diff(edges))
    cell += own.state
    tokens = np.bincount(cell, minlength=n * NUM_STATES).reshape(n, NUM_STATES)
    return OwnershipCells(edges, tokens, tokens.argmax(axis=1).astype(np.int8))


class CellPages(NamedTuple):
    """The pages of one cell, one entry per page."""

    pages: np.ndarray  # int64 [k] page ids (page 1: slot ids)
    owner: np.ndarray  # int64 [k] request id holding the page, -1 none
    state: np.ndarray  # int8 [k] the page's dominant state
    tokens: np.ndarray  # int64 [k, NUM_STATES] slots of each state on the page


def cell_pages(own: SlotOwnership, cells: OwnershipCells, index: int) -> CellPages:
    """The pages inside cell ``index`` with their owners (for "select a cell, see its pages").

    Raises:
        IndexError: ``index`` is not a cell.
    """
    n = cells.dominant.shape[0]
    if not 0 <= index < n:
        raise IndexError(f"cell_pages: cell {index} outside 0..{n - 1}")
    ps = own.page_size
    lo, hi = int(cells.edges[index]), int(cells.edges[index + 1])
    pages = np.arange(lo // ps, hi // ps, dtype=np.int64)
    state = own.state[lo:hi].reshape(-1, ps)
    key = np.arange(pages.shape[0], dtype=np.int64)[:, None] * NUM_STATES + state
    tokens = np.bincount(key.reshape(-1), minlength=pages.shape[0] * NUM_STATES).reshape(-1, NUM_STATES)
    return CellPages(pages, own.owner[lo:hi:ps].copy(), tokens.argmax(axis=1).astype(np.int8), tokens)


class RequestSlots(NamedTuple):
    """One request's slots, for highlighting it on the map."""

    prefix: np.ndarray  # int64 [cache_protected_len] its locked radix prefix (the tree's slots)
    own: np.ndarray  # int64 its own slots: [cache_protected_len, ceil_align(kv_allocated_len))


def request_slots(allocator: Allocator, rid: int) -> RequestSlots:
    """The locked prefix and the own slots of request ``rid`` (both empty when it holds no KV).

    Uses the ``Allocator`` protocol only (``request_lens``, ``row_slots``), so any
    allocator version can be highlighted.
    """
    rids = np.array([rid], dtype=np.int64)
    lens = allocator.request_lens(rids)
    slots = allocator.row_slots(rid).astype(np.int64)
    prot = int(lens.protected[0])
    alloc = int(lens.allocated[0])
    own = slots[prot:alloc]
    ps = allocator.config.page_size
    tail = -alloc % ps
    if tail and own.shape[0]:
        own = np.concatenate([own, own[-1] + np.arange(1, tail + 1, dtype=np.int64)])
    return RequestSlots(slots[:prot].copy(), own)
