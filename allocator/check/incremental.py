"""IncrementalChecker: verify only what the calls since the last check changed.

The full walk (``invariants.check_integrity``) looks at every page, row entry and
tree node after every call. This checker replays the journal of the primitives
(``allocator.check.journal``: pages taken from and given to the free lists, leaves
inserted into and evicted from the radix tree, locks, row ranges written, rows
taken and given back) against two shadows:

* ``PageShadow`` (``allocator.check.incremental_pages``): who holds each page. Each move
  checks where the page comes from; a call must end with every page it took or
  evicted claimed, every row owning exactly its request's own range's pages (a row
  given back none), and the free lists as long as the shadow says.
* ``LockShadow`` (``allocator.check.incremental_tree``): how many requests lock each node.
  The lock counts along every path the call locked or unlocked and along the old
  and new lock paths of the rows it touched must equal it; new nodes are page
  aligned; the row prefix of a row whose protected length or lock moved equals
  its locked path (from where it was last compared).

A hybrid sliding-window allocator's SWA pool has a shadow of its own
(``SwaShadow``, ``allocator.check.incremental_swa``), run after the full pool's checks
as the full walk runs the SWA checks last.

What is O(rows) runs whole each time, as the full walk does it: lengths, kept sums,
conservation, the row count; a cheap test decides and the full walk's own pass says
what is wrong. A page anomaly is described by the full ownership and row-entry
passes (``invariants.check_pages``), so every violation carries the full walk's
check name and wording, in its order. After any violation the shadows are rebuilt
from the real state (the state after a violation is not what the journal replays).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from allocator.check import journal as jr
from allocator.base import Violation
from allocator.pages import ceil_align
from allocator.check.incremental_pages import FREE, TREE, PageShadow
from allocator.check.incremental_swa import SwaShadow
from allocator.check.incremental_tree import LockShadow
from allocator.check.invariants import (
    check_conservation,
    check_counters,
    check_hisparse,
    check_lengths,
    check_mamba_pool,
    check_pages,
)
from allocator.ownership import full_side
from allocator.token_to_kv import HiSparseTokenToKVPoolAllocator

if TYPE_CHECKING:
    from allocator.manager import KvAllocator
    from allocator.radix_cache import TreeNode

__all__ = ["Changes", "IncrementalChecker"]


@dataclass
class Changes:
    """What one replay of the journal found, for the checks that follow it."""

    evicted_nodes: dict[TreeNode, TreeNode] = field(default_factory=dict)  # node -> parent at eviction
    new_nodes: list[TreeNode] = field(default_factory=list)
    lock_nodes: list[TreeNode] = field(default_factory=list)
    writes: list[tuple[Any, ...]] = field(default_factory=list)
    rows_changed: list[int] = field(default_factory=list)  # rows taken or given back
    rows_freed: list[int] = field(default_factory=list)
    touched: list[int] = field(default_factory=list)  # rids the allocator itself touched (publish)
    prefix_rows: dict[int, int] = field(default_factory=dict)  # row -> first entry written below its protected len
    written: tuple[np.ndarray, np.ndarray] | None = None  # rows, flat table index of live entries written
    given: list[np.ndarray] = field(default_factory=list)  # pages given to the free list (SWA: full pool)
    rows: list[Violation] = field(default_factory=list)
    tree: list[Violation] = field(default_factory=list)
    anomalies: list[str] = field(default_factory=list)  # page anomalies, described by the full page passes

    def flag(self, what: str) -> None:
        """Note a page anomaly (the full ownership / row passes will describe it)."""
        self.anomalies.append(what)


class IncrementalChecker:
    """Checks a ``KvAllocator`` incrementally; attach once, then ``check(touched)`` per call.

    Args:
        allocator: the allocator to watch. Its primitives start journaling into this
            checker, and the shadows are built from its current state (assumed sound:
            ``KvAllocator.check_integrity`` walks the whole state first).

    Attributes:
        unconfirmed: page anomalies the shadow saw that the full ownership / row
            passes did not confirm (a checker fault; 0 in a correct build), and
            ``last_unconfirmed`` what the last of them was.
    """

    def __init__(self, allocator: KvAllocator) -> None:
        self.allocator = allocator
        self.journal = jr.Journal()
        self.unconfirmed = 0
        self.last_unconfirmed: list[str] = []
        self.ps = allocator.page_size
        self.width = allocator.req_to_token_pool.max_context_len
        self._row_base = allocator.writer.row_base
        self._device = allocator.req_to_token_pool.device_req_to_token is not None
        tok = allocator.token_to_kv_pool_allocator
        self._hisparse = tok if isinstance(tok, HiSparseTokenToKVPoolAllocator) else None
        self.pages = PageShadow(allocator)
        self.locks = LockShadow(allocator)
        # A hybrid sliding-window allocator: the SWA pool's shadow.
        self.swa: SwaShadow | None = None
        self._seed()
        if allocator.req_kv.swa:
            self.swa = SwaShadow(allocator)
            self.swa.attach()
        jr.attach_journal(allocator, self.journal)

    def detach(self) -> None:
        """Stop journaling (the allocator's primitives go back to recording nothing); the
        allocator's next ``check_integrity(touched)`` attaches a new checker."""
        jr.detach_journal(self.allocator)
        if self.swa is not None:
            self.swa.detach()
        if self.allocator._checker is self:
            self.allocator._checker = None

    def _seed(self) -> None:
        """Rebuild the shadows from the allocator's real state."""
        a = self.allocator
        kv = a.req_kv
        rows = kv.rows_in_use()
        alloc = kv.kv_allocated_len[rows]
        prot = kv.cache_protected_len[rows]
        ok = (prot >= 0) & (prot <= alloc) & (alloc <= self.width) & (prot % self.ps == 0)
        self.pages.seed(rows[ok], alloc[ok], prot[ok])
        self.locks.seed()
        self.row_free = np.zeros(kv.num_rows, dtype=bool)
        self.row_free[a.req_to_token_pool.free_slots] = True
        if self.swa is not None:
            self.swa.seed()

    # ------------------------------------------------------------------ the check

    def check(self, touched: np.ndarray) -> list[Violation]:
        """Verify what the journal recorded since the last check.

        Args:
            touched: int64 request ids of the calls since the last check.

        Returns:
            The violations, in the full walk's order of checks (empty when sound).
        """
        try:
            return self._check(touched)
        except IndexError:
            # An id outside the pool reached the shadow: the full walk says what is wrong.
            from allocator.check.invariants import check_integrity

            out = check_integrity(self.allocator)
            if not out:
                self.unconfirmed += 1
                self.last_unconfirmed = ["an id outside the pool"]
            self._seed()
            return out

    def _check(self, touched: np.ndarray) -> list[Violation]:
        a = self.allocator
        ps = self.ps
        ch = self._replay(self.journal.drain())
        lengths: list[Violation] = []
        sums: list[Violation] = []
        own_pages = self._check_sums(ch, lengths, sums)
        mapped = None
        if ch.rows_changed or ch.touched or ch.lock_nodes:
            ids = np.concatenate([touched, np.array(ch.touched, dtype=np.int64)]) if ch.touched else touched
            mapped = a._rows_of(ids)
            self._check_maps(ch, ids, mapped)
        self._verify_writes(ch)
        self.pages.verify_end(ch, own_pages)
        if not a.tree_cache.disable:
            self.locks.check(ch, mapped, self.pages.tree_count * ps)
        out = lengths + ch.rows + sums + ch.tree
        if ch.anomalies:
            kv = a.req_kv
            rows = kv.rows_in_use()
            alloc, protected = kv.kv_allocated_len[rows], kv.cache_protected_len[rows]
            ok = (protected >= 0) & (protected <= alloc) & (alloc <= self.width) & (protected % ps == 0)
            before = len(out)
            check_pages(out, a, rows[ok], kv.rid[rows][ok], alloc[ok], protected[ok])
            if len(out) == before:
                self.unconfirmed += 1
                self.last_unconfirmed = ch.anomalies
        if self._hisparse is not None:
            check_hisparse(out, self._hisparse, self._hisparse.logical_attn_allocator.get_all_free_pages(), ps)
        if self._device and ch.written is not None:
            self._check_device(ch, out)
        if self.swa is not None:
            self._check_swa(ch, touched, mapped, out)
        check_mamba_pool(out, a)
        if ch.anomalies or ch.rows or ch.tree:
            self._seed()  # the shadows followed a broken state: start again from the real one
        return out

    def _replay(self, events: list[tuple[Any, ...]]) -> Changes:
        ch = Changes()
        pages = self.pages
        i = 0
        n = len(events)
        while i < n:
            ev = events[i]
            i += 1
            kind = ev[0]
            if kind == jr.TAKE:
                pages.take(ev[1], ch)
            elif kind == jr.POINTS or kind == jr.WRITE:
                ch.writes.append(ev)
            elif kind == jr.GIVE:
                given = ev[1].astype(np.int64)
                pages.give(given, ch, FREE)
                ch.given.append(given)
            elif kind == jr.EVICT:
                i = self._replay_evictions(events, i - 1, ch)
            elif kind == jr.INSERT:
                pages.give(pages.pages(ev[2]), ch, TREE)
                ch.new_nodes.append(ev[1])
            elif kind == jr.LOCK:
                ch.lock_nodes.append(ev[1])
            elif kind == jr.SPLIT:
                self.locks.split(ev[1], ev[2])
                ch.new_nodes += (ev[1], ev[2])
            elif kind == jr.RECOVER:  # the node's old full slots leave the tree, the new ones enter
                pages.evict(pages.pages(ev[2]), ch, False)
                pages.give(pages.pages(ev[3]), ch, TREE)
                ch.new_nodes.append(ev[1])
            elif kind == jr.ROWS_TAKEN or kind == jr.ROWS_FREED:
                self._replay_rows(ev[1], kind == jr.ROWS_TAKEN, ch)
            else:
                ch.touched.extend(ev[1])
        return ch

    def _check_swa(self, ch: Changes, touched: np.ndarray, mapped: np.ndarray | None,
                   out: list[Violation]) -> None:
        """The SWA pool (``SwaShadow``): rows of the requests touched, rows taken, given
        back or written are looked at again; full pages given back and free now must
        map to no SWA slot."""
        a = self.allocator
        parts = [a._rows_of(touched) if mapped is None else mapped, np.array(ch.rows_changed, dtype=np.int64)]
        rewritten = np.array(ch.rows_changed + [row for ev in ch.writes if ev[0] == jr.WRITE
                                                for row in ev[1].tolist()], dtype=np.int64)
        parts += [ev[1] for ev in ch.writes]
        rows = np.concatenate(parts).astype(np.int64)
        given = [p[self.pages.holder[np.clip(p, 0, self.pages.num_pages)] == FREE] for p in ch.given]
        tree_moved = bool(ch.new_nodes or ch.evicted_nodes or ch.lock_nodes)
        self.swa.check(out, rows, given, rewritten, tree_moved)  # type: ignore[union-attr]

    def _replay_evictions(self, events: list[tuple[Any, ...]], i: int, ch: Changes) -> int:
        """Evictions from ``events[i]`` on; returns the index of the next event.

        An eviction frees its node's slots at once (``EVICT`` then ``GIVE`` of the same
        pages): a run of such pairs is checked as one move from the tree to the free
        list. Anything else is replayed event by event."""
        n = len(events)
        j = i
        slots: list[np.ndarray] = []
        given: list[np.ndarray] = []
        while j + 1 < n and events[j][0] == jr.EVICT and events[j + 1][0] == jr.GIVE:
            slots.append(events[j][3])
            given.append(events[j + 1][1])
            j += 2
        pages = self.pages
        if slots:
            evicted = pages.pages(slots[0] if len(slots) == 1 else np.concatenate(slots))
            freed = given[0] if len(given) == 1 else np.concatenate(given)
            if freed.shape[0] == evicted.shape[0] and not np.count_nonzero(freed != evicted):
                pages.evict(evicted, ch, True)
                ch.evicted_nodes.update((events[k][1], events[k][2]) for k in range(i, j, 2))
                return j
        ev = events[i]
        pages.evict(pages.pages(ev[3]), ch, False)
        ch.evicted_nodes[ev[1]] = ev[2]
        return i + 1

    def _replay_rows(self, rows: list[int], taken: bool, ch: Changes) -> None:
        free = self.row_free
        for row in rows:
            if free[row] != taken:
                where = "free and in use" if taken else "free twice"
                ch.rows.append(Violation("rows", f"row {row} is {where}", None, {"row": int(row)}))
            free[row] = not taken
            ch.rows_changed.append(row)
            if not taken:
                ch.rows_freed.append(row)

    # ------------------------------------------------------------------ O(rows) checks

    def _check_sums(self, ch: Changes, lengths: list[Violation], sums: list[Violation]) -> np.ndarray:
        """Lengths (into ``lengths``), the row count, kept sums and conservation (into
        ``sums``), as the full walk checks them: cheap tests on the whole length columns
        (free rows hold zeros: that is checked when a row is given back, the only time
        a row becomes free); when one fails, the full walk's own passes say what.

        Returns:
            int64 ``[rows]`` pages each row's request owns by its lengths (0 for a free row).
        """
        a = self.allocator
        kv = a.req_kv
        ps = self.ps
        alloc, committed, protected = kv.kv_allocated_len, kv.kv_committed_len, kv.cache_protected_len
        ceil_alloc = alloc if ps == 1 else ceil_align(alloc, ps)
        # (count_nonzero and add.reduce: on arrays of a few hundred rows numpy's call
        # overhead is the cost, and these are its cheapest calls)
        total = np.add.reduce
        sum_ceil = int(total(ceil_alloc))
        sum_prot = int(total(protected))
        tree = a.tree_cache
        available = full_side(a.token_to_kv_pool_allocator).available_size()
        pool = a.req_to_token_pool
        count = np.count_nonzero
        fine = (
            count(committed < protected) + count(alloc < committed) + count(protected < 0)
            + count(alloc > self.width) + (count(protected % ps) if ps > 1 else 0) == 0
            and not any(kv.rid[row] < 0 and (alloc[row] or committed[row] or protected[row]
                                             or kv.lock_node[row] is not None) for row in ch.rows_freed)
            and kv.sum_committed == int(total(committed)) and kv.sum_protected == sum_prot
            and kv.sum_allocated_ceil == sum_ceil
            and available + tree.evictable_size() + tree.protected_size() + sum_ceil - sum_prot == a.pool_tokens
        )
        if not fine:
            rows = kv.rows_in_use()
            rids, used_alloc, used_committed, used_prot = kv.rid[rows], alloc[rows], committed[rows], protected[rows]
            used_ceil = ceil_alloc[rows]
            check_lengths(lengths, kv, rows, rids, used_alloc, used_committed, used_prot, self.width, ps)
            check_counters(sums, kv, used_alloc, used_committed, used_prot, used_ceil)
            check_conservation(sums, a, used_ceil, used_prot)
        # the rows in use change only with rows taken or given back
        num_used = int(count(kv.rid >= 0)) if ch.rows_changed or not fine else pool.size - len(pool.free_slots)
        if len(pool.free_slots) + num_used != pool.size:
            num_free = len(pool.free_slots)
            ch.rows.append(Violation("rows", f"free rows {num_free} + rows in use {num_used} = "
                                     f"{num_free + num_used}, pool has {pool.size}", None,
                                     {"free_rows": num_free, "rows_in_use": num_used, "size": pool.size}))
        return ceil_alloc - protected if ps == 1 else ceil_alloc // ps - protected // ps

    def _check_maps(self, ch: Changes, ids: np.ndarray, mapped: np.ndarray) -> None:
        """The rid <-> row maps of the rows taken or given back and of the requests touched."""
        a = self.allocator
        kv = a.req_kv
        for row in ch.rows_changed:
            rid = int(kv.rid[row])
            if rid >= 0 and a.row_of(rid) != row:
                ch.rows.append(Violation("rows", f"rid={rid} holds row {row} but maps to row {a.row_of(rid)}",
                                         rid, {"row": int(row)}))
        if ids.shape[0] and int(mapped.min()) < 0:
            ids, mapped = ids[mapped >= 0], mapped[mapped >= 0]
        found = kv.rid[mapped]
        if found.tobytes() != ids.tobytes():
            for i in np.flatnonzero(found != ids)[:8].tolist():
                ch.rows.append(Violation("rows", f"rid={int(ids[i])} maps to row {int(mapped[i])}, which holds "
                                         f"rid={int(found[i])}", int(ids[i]), {"row": int(mapped[i])}))

    # ------------------------------------------------------------------ row entries

    def _verify_writes(self, ch: Changes) -> None:
        """Entries written point at what their position owns (below ``cache_protected_len``
        the row prefix is compared with the locked path by ``LockShadow``)."""
        kv = self.allocator.req_kv
        for ev in ch.writes:
            if ev[0] == jr.POINTS:
                self.pages.verify_points(ch, ev[1], ev[2])
                if self._device:
                    self._note_written(ch, ev[1], ev[2])
                continue
            for row, start, end in zip(ev[1].tolist(), ev[2].tolist(), ev[3].tolist()):
                end = min(end, int(kv.kv_allocated_len[row]))
                if kv.rid[row] < 0 or start >= end:
                    continue  # a free row, or past the allocated length: not part of the state
                prot = int(kv.cache_protected_len[row])
                if start < prot:
                    ch.prefix_rows[row] = min(ch.prefix_rows.get(row, start), start)
                    start = prot
                if start < end:
                    self.pages.verify_range(ch, row, start, end)
                    if self._device:
                        self._note_written(ch, np.full(end - start, row), np.arange(start, end))

    # ------------------------------------------------------------------ device

    def _note_written(self, ch: Changes, rows: np.ndarray, positions: np.ndarray) -> None:
        index = self._row_base[rows] + positions
        if ch.written is not None:
            rows, index = np.concatenate([ch.written[0], rows]), np.concatenate([ch.written[1], index])
        ch.written = (rows, index)

    def _check_device(self, ch: Changes, out: list[Violation]) -> None:
        """The device table equals the host copy at every entry written (after ``sync``)."""
        import torch

        rows, index = ch.written  # type: ignore[misc]
        flat = self.allocator.req_to_token_pool.req_to_token_np.reshape(-1)
        device = self.allocator.req_to_token_pool.device_req_to_token.view(-1)  # type: ignore[union-attr]
        got = device[torch.from_numpy(index).to(device.device)].cpu().numpy()
        want = flat[index]
        bad = got != want
        for row in np.unique(rows[bad])[:8].tolist():
            sel = np.flatnonzero(bad & (rows == row))
            rid = int(self.allocator.req_kv.rid[row])
            first = int(sel[0])
            out.append(Violation("device", f"rid={rid}: device req_to_token differs from the host copy at "
                                 f"{sel.shape[0]} positions, first {int(index[first] - self._row_base[row])} "
                                 f"(device {int(got[first])}, host {int(want[first])})", rid,
                                 {"count": int(sel.shape[0])}))
