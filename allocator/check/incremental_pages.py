"""The page half of the incremental checker: a shadow of who holds every page.

``PageShadow`` keeps, per page, one code (``holder``: a kind, or for a page a request
owns ``OWNED + `` its ``req_to_token`` row, so one gather says both whose a page is and
what kind; int16 while the rows allow, so the random accesses stay in cache); per
row, how many pages its request owns; and the number of pages taken or evicted in
the current call that nobody has claimed yet. The journal's events move pages
between kinds::

    FREE --take--> NOBODY --row write (own range)--> OWNED(row) --free--> FREE
                                                        |
    TREE <-----------insert (checkpoint)----------------+     TREE --evict--> NOBODY --free--> FREE

and each move checks the kind it starts from. A call must end with every page it
took or evicted claimed (by a row, the tree or the free list), every row owning
exactly its own range's pages (a free row none) and the free lists as long as the
shadow says. What it finds are anomalies (``Changes.flag``); the full ownership and
row passes describe them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from allocator.ownership import full_side, page_holders

if TYPE_CHECKING:
    from allocator.check.incremental import Changes
    from allocator.manager import KvAllocator

__all__ = ["FREE", "NOBODY", "OWNED", "RESERVED", "TREE", "PageShadow"]

# Page kinds (FREE is 0 so "all free" is one any()). Pages a request may give up are
# NOBODY or owned, the largest codes: a page row r owns holds OWNED + r.
FREE, TREE, RESERVED, NOBODY, OWNED = 0, 1, 2, 3, 4


class PageShadow:
    """Who holds each page, kept from the journal.

    Args:
        allocator: the allocator whose pool is shadowed.
    """

    def __init__(self, allocator: KvAllocator) -> None:
        self.allocator = allocator
        self.ps = allocator.page_size
        self.num_pages = allocator.pool_tokens // self.ps
        self._table = allocator.req_to_token_pool.req_to_token_np
        self._flat = self._table.reshape(-1)
        self._row_base = allocator.writer.row_base
        rows = allocator.req_kv.num_rows
        self._dtype = np.int16 if OWNED + rows <= np.iinfo(np.int16).max else np.int32
        self.holder = np.zeros(0, dtype=self._dtype)  # [num_pages + 1] kind, or OWNED + owning row
        self.held = np.zeros(0, dtype=np.int64)  # int64 [rows] pages owned through each row
        self.free_count = 0  # pages on the free lists (with repeats, as the lists count them)
        self.tree_count = 0  # pages in the tree
        self.nobody = 0  # pages taken or evicted in this call and not claimed yet

    def seed(self, rows: np.ndarray, allocated: np.ndarray, protected: np.ndarray) -> None:
        """Rebuild from the real state (``rows``: rows in use with sane lengths)."""
        a = self.allocator
        holders = page_holders(a, rows, allocated, protected)
        n = self.num_pages
        holder = np.full(n + 1, NOBODY, dtype=self._dtype)
        holder[holders.free_pages[(holders.free_pages >= 0) & (holders.free_pages <= n)]] = FREE
        holder[holders.tree_pages[(holders.tree_pages >= 0) & (holders.tree_pages <= n)]] = TREE
        inside = (holders.req_pages >= 0) & (holders.req_pages <= n)
        pages = holders.req_pages[inside]
        owners = rows[holders.req_index[inside]]
        holder[pages] = OWNED + owners
        holder[0] = RESERVED
        self.holder = holder
        self.held = np.bincount(owners, minlength=a.req_kv.num_rows).astype(np.int64)
        self.free_count = int(holders.free_pages.shape[0])
        self.tree_count = int(holders.tree_pages.shape[0])
        self.nobody = 0

    def pages(self, slots: np.ndarray) -> np.ndarray:
        """int64 page ids of a page-aligned slot array (int64: numpy indexes with intp,
        and converts int32 index arrays to it on every gather and scatter)."""
        ps = self.ps
        return (slots[::ps] // ps if ps > 1 else slots).astype(np.int64)

    def _holders(self, pages: np.ndarray) -> np.ndarray:
        """The holder codes of ``pages``. An id outside the pool reads as page 0 (reserved:
        an anomaly) or the last page; the move's scatter then raises IndexError, on which
        the checker falls back to the full walk."""
        return np.take(self.holder, pages, mode="clip")

    # ------------------------------------------------------------------ moves

    def take(self, pages: np.ndarray, ch: Changes) -> None:
        """Pages left a free list: they must have been free."""
        pages = pages.astype(np.int64)
        if np.count_nonzero(self._holders(pages)):
            ch.flag("a page left the free list while held")
        self.holder[pages] = NOBODY
        self.nobody += pages.shape[0]
        self.free_count -= pages.shape[0]

    def give(self, pages: np.ndarray, ch: Changes, to: int) -> None:
        """Pages went to the free list (``to=FREE``) or into the tree (``to=TREE``): they
        must come from a request or from this call's allocation / eviction."""
        was = self._holders(pages)
        n = pages.shape[0]
        if n:
            first = int(was[0])
            if first >= OWNED and not np.count_nonzero(was != first):  # one row's (a release, a checkpoint)
                self.held[first - OWNED] -= n
            else:
                owned = was >= OWNED
                num_owned = int(np.count_nonzero(owned))
                num_nobody = int(np.count_nonzero(was == NOBODY))
                if num_owned + num_nobody != n:
                    ch.flag("a page freed or cached while free, cached or reserved")
                self.nobody -= num_nobody
                if num_owned:
                    self.held -= np.bincount(was[owned] - OWNED, minlength=self.held.shape[0])
        self.holder[pages] = to
        if to == FREE:
            self.free_count += n
        else:
            self.tree_count += n

    def evict(self, pages: np.ndarray, ch: Changes, freed: bool) -> None:
        """Pages left the tree; ``freed``: the next event gave exactly them to the free list."""
        if np.count_nonzero(self._holders(pages) != TREE):
            ch.flag("an evicted page was not cached")
        self.tree_count -= pages.shape[0]
        if freed:
            self.holder[pages] = FREE
            self.free_count += pages.shape[0]
        else:
            self.holder[pages] = NOBODY
            self.nobody += pages.shape[0]

    # ------------------------------------------------------------------ row entries

    def verify_points(self, ch: Changes, rows: np.ndarray, positions: np.ndarray) -> None:
        """One entry written per row (decode): a fresh page, or (page > 1) the row's own.

        An entry outside the row's own range, or in a free row, is claimed all the same:
        the row then owns more pages than its lengths say, which the end of the call
        sees (an own page cannot land there: the page alignment check sees that). An
        id outside the pool raises IndexError or lands on a page that is not fresh.
        """
        index = self._row_base[rows] + positions
        pages = self._flat[index].astype(np.int64)
        ps = self.ps
        if ps > 1:
            offset = positions % ps
            if np.count_nonzero((pages % ps != offset) | (pages - self._flat[index - offset] != offset)):
                ch.flag("an entry breaks the page alignment")
            pages //= ps
        was = self._holders(pages)
        fresh = was == NOBODY
        if np.count_nonzero(fresh) != pages.shape[0]:
            mine = ~fresh
            if np.count_nonzero(was[mine] != rows[mine] + OWNED):
                ch.flag("an entry points at a page its request does not hold")
            pages, rows = pages[fresh], rows[fresh]
            if ps > 1:
                index, offset = index[fresh], offset[fresh]
        if ps > 1 and pages.shape[0] > 1:
            # A run of decode steps writes several positions of one new page: the page is
            # claimed once per page of a row (the alignment check tied each entry to the
            # entry at its page's start, ``index - offset``).
            _, first = np.unique(index - offset, return_index=True)
            if first.shape[0] != pages.shape[0]:
                pages, rows = pages[first], rows[first]
        self._claim(pages, rows)

    def verify_range(self, ch: Changes, row: int, start: int, end: int) -> None:
        """``row[start:end]`` (own positions of a live row) was written: its pages must be
        the row's or this call's allocation, which the row claims."""
        values = self._table[row, start:end]
        ps = self.ps
        if ps > 1:
            first = start - start % ps
            offsets = np.arange(start, end) % ps
            page_first = np.repeat(self._table[row, first:end:ps].astype(np.int64), ps)[start - first : end - first]
            if np.count_nonzero((values % ps != offsets) | (values - page_first != offsets)):
                ch.flag("an entry breaks the page alignment")
            values = self._table[row, first:end:ps] // ps
        pages = values.astype(np.int64)
        was = self._holders(pages)
        fresh = was == NOBODY
        if int(np.count_nonzero(fresh)) != pages.shape[0]:
            if np.count_nonzero(was[~fresh] != row + OWNED):
                ch.flag("an entry points at a page its request does not hold")
            pages = pages[fresh]
        self._claim(pages, row)

    def _claim(self, pages: np.ndarray, rows: np.ndarray | int) -> None:
        """Rows claim pages that were NOBODY (repeats count twice: the end of the call
        then sees more claims than pages taken)."""
        n = pages.shape[0]
        if not n:
            return
        if isinstance(rows, int):
            self.held[rows] += n
        else:
            counts = np.bincount(rows, minlength=self.held.shape[0]) if int(rows.min()) >= 0 else None
            if counts is None or counts.shape[0] != self.held.shape[0]:
                raise IndexError("a row outside the request-row pool")  # the full walk says what
            self.held += counts
        self.holder[pages] = rows + OWNED
        self.nobody -= n

    # ------------------------------------------------------------------ end of call

    def verify_end(self, ch: Changes, own_pages: np.ndarray) -> None:
        """Every page taken or evicted was claimed; every row owns its own range's pages
        (``own_pages``, per row: 0 for a free row); the free lists hold what the shadow says."""
        if self.nobody:
            ch.flag("pages taken or evicted in the call are held by nobody (or claimed twice)")
            self.nobody = 0
        logical = full_side(self.allocator.token_to_kv_pool_allocator)
        if logical.available_size() != self.free_count * self.ps:
            ch.flag("the free lists hold more or fewer pages than were given back")
        if self.held.tobytes() != own_pages.tobytes():  # both int64 [rows]
            ch.flag("a request holds more or fewer pages than its lengths say")
