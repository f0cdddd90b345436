"""The SWA pool half of the incremental checker (hybrid sliding-window allocators).

``SwaShadow`` keeps, per SWA page, who holds it (``FREE``, ``RESERVED``, ``NOBODY``,
``TREE`` or ``OWNED +`` the ``req_to_token`` row whose live window maps to it) and,
per row, the SWA pages it claimed when it was last looked at. The SWA pool's free
list (and its staged list) and the SWA radix tree's SWA side (slots a node takes:
``SwaRadixCache.swa_journal``) journal into a journal of their own; between two checks:

* a page leaving the free list must have been free (it becomes nobody's);
* a page coming back must be nobody's, a row's (that row is looked at again) or the
  tree's (a tombstone, a deleted leaf); a page the tree takes must be nobody's or a
  row's, and the tree's pages must add up to its SWA ledgers;
* every row the calls touched (its request named, its row taken, given back or
  written, one of its pages freed) is looked at again over its live window only:
  its live positions map to SWA slots at their in-page offset, and the pages it maps
  to were its own or taken in the call; its window-freed positions map to none,
  checked from where the last look stopped (the whole freed range again once the
  row was taken, given back or rewritten, or its freed range moved its start);
* at the end no page taken or given up is nobody's, the free list is as long as the
  shadow says, and full slots given back to the full pool map to no SWA slot.

The O(rows) checks run whole (cursor bounds, ``sum_swa_freed``, the SWA
conservation). The tree's SWA side node by node (tombstones hold no SWA, SWA slots
are the full slots' mapping, SWA lock counts against the rows' window receipts) is
walked whole, as the full walk does it, after a call that changed the tree (a node
inserted, split, recovered, evicted or locked; a page into or out of the tree); a
call that did not (a plain decode step) skips it. Anything amiss is an anomaly: the
full SWA walk (``swa_invariants.check_swa``) then says what is wrong, so the
violations (check, pool, request) are the full walk's, and the shadow is rebuilt
from the real state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from allocator.base import Violation
from allocator.check import journal as jr
from allocator.check.swa_invariants import _check_tree, _ranges, check_swa
from allocator.pages import ceil_align
from allocator.swa_radix import SwaRadixCache

if TYPE_CHECKING:
    from allocator.manager import KvAllocator
    from allocator.swa import SWATokenToKVPoolAllocator

__all__ = ["SwaShadow"]

FREE, RESERVED, NOBODY, TREE, OWNED = 0, 1, 2, 3, 4
_NONE = np.zeros(0, dtype=np.int64)


class SwaShadow:
    """Who holds each SWA page, kept from the SWA pool's journal (see the module doc).

    Args:
        allocator: an SWA allocator (radix cache off or on).

    Attributes:
        unconfirmed: anomalies the full SWA walk did not confirm (a checker fault).
    """

    def __init__(self, allocator: KvAllocator) -> None:
        self.allocator = allocator
        self.tok: SWATokenToKVPoolAllocator = allocator.token_to_kv_pool_allocator  # type: ignore[assignment]
        self.ps = allocator.page_size
        self.num_pages = allocator.swa_pool_tokens // self.ps
        self.width = allocator.req_to_token_pool.max_context_len
        tree = allocator.tree_cache
        self.tree = tree if isinstance(tree, SwaRadixCache) else None
        self.journal = jr.Journal()
        self.unconfirmed = 0
        self.seed()

    # ------------------------------------------------------------------ journal

    def attach(self) -> None:
        swa = self.tok.swa_attn_allocator
        swa.journal = self.journal  # type: ignore[attr-defined]
        swa._free.journal = self.journal  # type: ignore[attr-defined]
        if self.tree is not None:
            self.tree.swa_journal = self.journal

    def detach(self) -> None:
        swa = self.tok.swa_attn_allocator
        swa.journal = None  # type: ignore[attr-defined]
        swa._free.journal = None  # type: ignore[attr-defined]
        if self.tree is not None:
            self.tree.swa_journal = None

    # ------------------------------------------------------------------ state

    def seed(self) -> None:
        """Rebuild from the real state (assumed sound, or about to be reported whole)."""
        kv = self.allocator.req_kv
        self.holder = np.full(self.num_pages + 1, NOBODY, dtype=np.int64)
        free = self.tok.swa_attn_allocator.get_all_free_pages().astype(np.int64)
        self.holder[free[(free >= 0) & (free <= self.num_pages)]] = FREE
        self.holder[0] = RESERVED
        self.free_count = int(free.shape[0])
        self.tree_count = 0
        if self.tree is not None:
            values = [n.swa_value for n in self.tree.iter_nodes() if n.swa_value is not None]  # type: ignore[attr-defined]
            if values:
                pages = self._pages(np.concatenate(values))
                self.holder[pages[(pages >= 0) & (pages <= self.num_pages)]] = TREE
                self.tree_count = int(pages.shape[0])
        self.row_pages: dict[int, np.ndarray] = {}
        # per row: the window-freed range [lo, hi) last seen unmapped (lo -1: none)
        self.dead_lo_seen = np.full(kv.num_rows, -1, dtype=np.int64)
        self.dead_hi_seen = np.zeros(kv.num_rows, dtype=np.int64)
        self.nobody = 0
        anomalies: list[str] = []
        self._claim(kv.rows_in_use(), anomalies)
        self.nobody = 0
        self.journal.drain()

    def _pages(self, slots: np.ndarray) -> np.ndarray:
        """int64 page ids of a page-aligned SWA slot array (the tree's node values)."""
        ps = self.ps
        return (np.asarray(slots)[::ps] // ps if ps > 1 else np.asarray(slots)).astype(np.int64)

    def _live(self, rows: np.ndarray, anomalies: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(owner row, SWA page) of each live position of ``rows`` (sane lengths only),
        noting window anomalies (an unmapped live position, a mapped freed one, a slot
        at another in-page offset)."""
        kv = self.allocator.req_kv
        ps = self.ps
        alloc = kv.kv_allocated_len[rows]
        protected = kv.cache_protected_len[rows]
        evicted = kv.swa_evicted_seqlen[rows]
        ok = ((protected >= 0) & (protected <= alloc) & (alloc <= self.width) & (protected % ps == 0)
              & (evicted >= 0) & (evicted <= alloc) & (evicted % ps == 0))
        if not ok.all():
            anomalies.append("a row's lengths or SWA cursor are out of bounds")
            rows, alloc, protected, evicted = rows[ok], alloc[ok], protected[ok], evicted[ok]
        if rows.shape[0] == 0:
            return _NONE, _NONE
        dead_lo = kv.swa_dead_lo(rows)
        live_hi = np.maximum(evicted, dead_lo)
        table = self.allocator.req_to_token_pool.req_to_token_np.reshape(-1)
        mapping = self.tok.full_to_swa_index_mapping
        num_slots = mapping.shape[0] - 1
        parts = [_ranges(rows, protected, np.minimum(dead_lo, alloc), self.width),
                 _ranges(rows, np.minimum(live_hi, alloc), alloc, self.width)]
        flat = np.concatenate([p[0] for p in parts])
        positions = np.concatenate([p[1] for p in parts])
        owner = rows[np.concatenate([p[2] for p in parts])]
        full = table[flat].astype(np.int64)
        swa = mapping[np.clip(full, 0, num_slots)]
        if np.count_nonzero((full < 0) | (full >= num_slots) | (swa <= 0)):
            anomalies.append("a live position holds no SWA slot")
        dead_hi = np.minimum(live_hi, alloc)
        seen_lo, seen_hi = self.dead_lo_seen[rows], self.dead_hi_seen[rows]
        dead_from = np.where((seen_lo == dead_lo) & (seen_hi <= dead_hi), np.maximum(seen_hi, dead_lo), dead_lo)
        self.dead_lo_seen[rows] = dead_lo
        self.dead_hi_seen[rows] = dead_hi
        dflat, _, _ = _ranges(rows, dead_from, dead_hi, self.width)
        if dflat.shape[0] and np.count_nonzero(mapping[np.clip(table[dflat].astype(np.int64), 0, num_slots)] > 0):
            anomalies.append("a window-freed position still holds an SWA slot")
        keep = swa > 0
        swa, owner, positions = swa[keep], owner[keep], positions[keep]
        if ps > 1:
            if np.count_nonzero(swa % ps != positions % ps):
                anomalies.append("an SWA slot at another in-page offset")
            swa = swa // ps
        if swa.shape[0] and (int(swa.max()) > self.num_pages):
            anomalies.append("an SWA page outside the pool")
            inside = swa <= self.num_pages
            swa, owner = swa[inside], owner[inside]
        if ps > 1 and swa.shape[0]:
            keys = np.unique(owner * (self.num_pages + 1) + swa)
            owner, swa = keys // (self.num_pages + 1), keys % (self.num_pages + 1)
        return owner, swa

    def _claim(self, rows: np.ndarray, anomalies: list[str]) -> None:
        """Look at ``rows`` again: their old claims go back to nobody, their live pages
        are claimed (each must be nobody's: the row's own, or taken in the call)."""
        if rows.shape[0] == 0:
            return
        holder = self.holder
        old = [self.row_pages.pop(r, _NONE) for r in rows.tolist()]
        if old:
            pages = np.concatenate(old)
            owners = np.repeat(rows, [p.shape[0] for p in old])
            mine = holder[pages] == OWNED + owners
            holder[pages[mine]] = NOBODY
            self.nobody += int(np.count_nonzero(mine))
        in_use = rows[self.allocator.req_kv.rid[rows] >= 0]
        owner, pages = self._live(in_use, anomalies)
        if pages.shape[0] == 0:
            return
        # (a page claimed twice in one look drives ``nobody`` below zero: seen at the end)
        if np.count_nonzero(holder[pages] != NOBODY):
            anomalies.append("an SWA page is held twice, or held and free")
        holder[pages] = OWNED + owner
        self.nobody -= pages.shape[0]
        order = np.argsort(owner, kind="stable")
        owner, pages = owner[order], pages[order]
        bounds = np.flatnonzero(np.diff(owner)) + 1
        for part_rows, part_pages in zip(np.split(owner, bounds), np.split(pages, bounds)):
            self.row_pages[int(part_rows[0])] = part_pages

    # ------------------------------------------------------------------ the check

    def check(self, out: list[Violation], rows: np.ndarray, full_given: list[np.ndarray],
              rewritten: np.ndarray, tree_moved: bool = False) -> None:
        """Verify the SWA pool after the calls since the last check; append the full
        SWA walk's violations to ``out`` when anything is amiss.

        Args:
            rows: int64 rows the calls touched (requests named, rows taken, given back
                or written).
            full_given: full pages given back in the calls and free now (page 1: slots).
            rewritten: int64 rows taken, given back or written other than one entry per
                row (their window-freed range is checked whole).
            tree_moved: the calls changed the radix tree (its SWA side is walked).
        """
        anomalies: list[str] = []
        self.dead_lo_seen[rewritten] = -1
        holder = self.holder
        dirty: list[np.ndarray] = [rows]
        for ev in self.journal.drain():
            pages = np.asarray(ev[1], dtype=np.int64)
            if ev[0] == jr.SWA_CACHE:
                tree_moved = True
                pages = self._pages(pages)
                was = np.take(holder, pages, mode="clip")
                owned = was >= OWNED
                if np.count_nonzero(owned | (was == NOBODY)) != pages.shape[0]:
                    anomalies.append("the tree took an SWA page that was free, cached or reserved")
                if np.count_nonzero(owned):
                    dirty.append(was[owned] - OWNED)
                self.nobody -= int(np.count_nonzero(was == NOBODY))
                holder[np.clip(pages, 0, self.num_pages)] = TREE
                self.tree_count += pages.shape[0]
            elif ev[0] == jr.TAKE:
                if np.count_nonzero(np.take(holder, pages, mode="clip") != FREE):
                    anomalies.append("an SWA page left the free list while held")
                holder[np.clip(pages, 0, self.num_pages)] = NOBODY
                self.nobody += pages.shape[0]
                self.free_count -= pages.shape[0]
            elif ev[0] == jr.GIVE:
                was = np.take(holder, pages, mode="clip")
                owned = was >= OWNED
                cached = int(np.count_nonzero(was == TREE))
                if np.count_nonzero(owned | (was == NOBODY)) + cached != pages.shape[0]:
                    anomalies.append("an SWA page freed while free or reserved")
                if np.count_nonzero(owned):
                    dirty.append(was[owned] - OWNED)
                if cached:
                    tree_moved = True
                    self.tree_count -= cached
                self.nobody -= int(np.count_nonzero(was == NOBODY))
                holder[np.clip(pages, 0, self.num_pages)] = FREE
                self.free_count += pages.shape[0]
        self._check_sums(anomalies)
        mask = np.zeros(self.dead_hi_seen.shape[0], dtype=bool)
        for part in dirty:
            mask[part[part > 0]] = True
        self._claim(np.flatnonzero(mask), anomalies)
        if self.nobody:
            anomalies.append("SWA pages taken or given up are held by nobody, or claimed twice")
        if self.tok.swa_attn_allocator.available_size() != self.free_count * self.ps:
            anomalies.append("the SWA free list holds more or fewer pages than the shadow")
        self._check_full_freed(full_given, anomalies)
        if self.tree is not None:
            tree = self.tree
            if self.tree_count * self.ps != tree.swa_evictable_size() + tree.swa_protected_size():
                anomalies.append("the tree's SWA pages and its SWA ledgers differ")
            if tree_moved:
                found: list[Violation] = []
                _check_tree(found, self.allocator, tree)
                if found:
                    anomalies.append("the tree's SWA side")
        if anomalies:
            a = self.allocator
            kv = a.req_kv
            rows_in_use = kv.rows_in_use()
            alloc, protected = kv.kv_allocated_len[rows_in_use], kv.cache_protected_len[rows_in_use]
            ok = (protected >= 0) & (protected <= alloc) & (alloc <= self.width) & (protected % self.ps == 0)
            before = len(out)
            check_swa(out, a, rows_in_use[ok], kv.rid[rows_in_use][ok], alloc[ok], protected[ok])
            if len(out) == before:
                self.unconfirmed += 1
            self.seed()

    def _check_sums(self, anomalies: list[str]) -> None:
        """The O(rows) checks of the full walk: ``sum_swa_freed`` and the SWA conservation."""
        kv = self.allocator.req_kv
        rows = kv.rows_in_use()
        freed = kv.swa_freed(rows)
        if kv.sum_swa_freed != int(freed.sum()):
            anomalies.append("sum_swa_freed")
        held = int((ceil_align(kv.kv_allocated_len[rows], self.ps) - kv.cache_protected_len[rows] - freed).sum())
        if self.tree is not None:
            held += self.tree.swa_evictable_size() + self.tree.swa_protected_size()
        if self.tok.swa_available_size() + held != self.allocator.swa_pool_tokens:
            anomalies.append("SWA conservation")

    def _check_full_freed(self, full_given: list[np.ndarray], anomalies: list[str]) -> None:
        """Full pages given back and still free map to no SWA slot (a stray mapping)."""
        if not full_given:
            return
        ps = self.ps
        pages = np.concatenate(full_given).astype(np.int64)
        if pages.shape[0] == 0:
            return
        slots = (pages[:, None] * ps + np.arange(ps)).reshape(-1) if ps > 1 else pages
        mapping = self.tok.full_to_swa_index_mapping
        slots = slots[(slots >= 0) & (slots < mapping.shape[0] - 1)]
        if np.count_nonzero(mapping[slots] > 0):
            anomalies.append("a free full slot still maps to an SWA slot")
