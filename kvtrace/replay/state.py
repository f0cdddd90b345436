"""Per-request state of a replay: a fold of step snapshots into the table a user looks at.

``ReplayState.apply(snapshot)`` folds one ``StepSnapshot``; the same fold runs over a
live ``ReplaySession`` and over a state log read back (``kvtrace.statelog.log``), so the
dashboard and reports see the same thing either way.

Per request (numpy columns indexed by request id; ``table()`` gives the rows of the
requests seen so far): phase, used (``kv_committed_len``) and allocated
(``kv_allocated_len``) lengths, over-allocated slots (their difference), the cached
prefix it holds locked (``cache_protected_len``), pages referenced, the prefix hit at
its admission, the step it was first admitted and the step it ended. The timeline
(pool counters per step, every event with its step) is append-only: what was
replayed once stays known when the position moves back, so a chart can show the
whole run with the current step marked.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from allocator.base import PoolCounters
from kvtrace.replay.snapshot import (
    LIVE_PHASES,
    PHASES,
    UNCHANGED_OP,
    RequestDelta,
    SnapshotBlock,
    StepSnapshot,
)
from traces.schema import EXTEND, PREALLOC

__all__ = ["ReplayState", "RequestRow", "SavedState", "StepEvent", "Timeline"]

_LIVE = np.array([i in LIVE_PHASES for i in range(len(PHASES))])
_ENDED = np.array([name in ("finished", "aborted", "dropped") for name in PHASES])
_COLUMNS = (
    # name, dtype, fill
    ("phase", np.int8, -1),  # -1: never seen
    ("allocated", np.int64, 0),
    ("committed", np.int64, 0),
    ("protected", np.int64, 0),
    ("prefix_hit", np.int64, 0),  # radix hit at the last admission
    ("admitted_step", np.int64, -1),  # first admission
    ("ended_step", np.int64, -1),  # finish / abort / drop (-1: not ended)
    ("last_step", np.int64, -1),  # the last step an op changed it
    ("admissions", np.int32, 0),  # 1, or more after retractions
    ("swa_evicted", np.int64, 0),  # swa_evicted_seqlen (a model with a sliding-window pool)
    ("mamba_slot", np.int64, -1),  # mamba_pool_idx (a model with a Mamba pool; -1: none)
)


class StepEvent(NamedTuple):
    """An event with the step it happened in."""

    step: int
    kind: str
    rid: int | None
    tokens: int
    detail: str


class RequestRow(NamedTuple):
    """One request as the table shows it."""

    rid: int
    phase: str
    used: int  # kv_committed_len
    allocated: int  # kv_allocated_len
    overallocated: int  # allocated - used
    protected: int  # cached prefix locked by the request
    pages: int  # pages its row references (ceil(allocated / page size))
    prefix_hit: int
    admitted_step: int
    ended_step: int
    swa_evicted: int | None = None  # swa_evicted_seqlen; None: no SWA lengths (a full-attention model)
    mamba_slot: int | None = None  # its Mamba state slot, -1: none; None: no Mamba slots (no Mamba pool)

    @property
    def swa_len(self) -> int | None:
        """Its tokens past the SWA cursor (``allocated - swa_evicted_seqlen``): those the
        sliding-window layers still hold; None without SWA lengths."""
        return None if self.swa_evicted is None else max(self.allocated - self.swa_evicted, 0)


class Timeline:
    """Pool counters per step and every event, append-only (grows as steps are replayed
    for the first time; moving back in a replay does not shrink it).

    ``counters`` are the full pool's; ``other`` those of the other pools of a hybrid
    model (``StepSnapshot.other_pools``; None for a full-attention model). The reads take
    ``pool``, an index into ``POOL_NAMES`` (0: the full pool).
    """

    _FIELDS = PoolCounters._fields

    def __init__(self) -> None:
        self.steps = np.zeros(1024, np.int64)
        self.times = np.zeros(1024, np.float64)
        self.counters = np.zeros((1024, len(self._FIELDS)), np.int64)
        self.other: np.ndarray | None = None  # int64 [capacity, other pools, fields]
        self.size = 0
        self.events: list[StepEvent] = []
        self._event_steps: list[int] = []
        # per pool: (rows scanned, index of the highest use among them): rows never change
        self._peaks: dict[int, tuple[int, int]] = {}

    @property
    def num_pools(self) -> int:
        """The pools whose counters the timeline holds (1 for a full-attention model)."""
        return 1 if self.other is None else 1 + self.other.shape[1]

    def _grow(self, grow: int, other_pools: int) -> None:
        """Make room for ``grow`` steps, and for ``other_pools`` pools after the full one."""
        if grow > self.steps.shape[0]:
            self.steps = np.resize(self.steps, grow)
            self.times = np.resize(self.times, grow)
            self.counters = np.resize(self.counters, (grow, len(self._FIELDS)))
            if self.other is not None:
                self.other = np.resize(self.other, (grow, *self.other.shape[1:]))
        if other_pools and self.other is None:
            self.other = np.zeros((self.steps.shape[0], other_pools, len(self._FIELDS)), np.int64)

    @property
    def last_step(self) -> int | None:
        return int(self.steps[self.size - 1]) if self.size else None

    def append(self, snap: StepSnapshot) -> None:
        """Record ``snap`` if it is past the last step known."""
        if self.size and snap.step <= self.steps[self.size - 1]:
            return
        self._grow(self.size * 2 if self.size == self.steps.shape[0] else 0, len(snap.other_pools))
        i = self.size
        self.steps[i] = snap.step
        self.times[i] = snap.time_s
        self.counters[i] = snap.pool
        if snap.other_pools:
            self.other[i] = snap.other_pools
        self.size += 1
        for e in snap.events:
            self.events.append(StepEvent(snap.step, e.kind, e.rid, e.tokens, e.detail))
            self._event_steps.append(snap.step)

    def extend(self, block: SnapshotBlock) -> None:
        """Record the steps of ``block`` past the last step known (``append`` for each, at once)."""
        first = 0
        if self.size:
            first = int(np.searchsorted(block.steps, self.steps[self.size - 1], side="right"))
        k = block.num_steps - first
        if k <= 0:
            return
        need = self.size + k
        other = block.other_pools
        self._grow(max(need, self.steps.shape[0] * 2) if need > self.steps.shape[0] else 0,
                   0 if other is None else other.shape[1])
        i = self.size
        self.steps[i:need] = block.steps[first:]
        self.times[i:need] = block.times[first:]
        self.counters[i:need] = block.pools[first:]
        if other is not None:
            self.other[i:need] = other[first:]
        self.size = need
        low = int(block.steps[first])
        for step, e in zip(block.event_steps, block.events):
            if step >= low:
                self.events.append(StepEvent(step, e.kind, e.rid, e.tokens, e.detail))
                self._event_steps.append(step)

    def _pool_rows(self, pool: int) -> np.ndarray:
        """The counters of pool ``pool`` (an index into ``POOL_NAMES``), [capacity, fields]."""
        if pool == 0:
            return self.counters
        if self.other is None or pool > self.other.shape[1]:
            raise IndexError(f"the timeline has no pool {pool}")
        return self.other[:, pool - 1]

    def column(self, name: str, size: int | None = None, pool: int = 0) -> np.ndarray:
        """One counter of pool ``pool`` over the known steps, or the first ``size`` of them (a view).

        A reader in another thread than the one appending passes the ``size`` it saw.
        """
        return self._pool_rows(pool)[: self.size if size is None else size, self._FIELDS.index(name)]

    def used_tokens(self, size: int | None = None, pool: int = 0) -> np.ndarray:
        n = self.size if size is None else size
        return self._used_rows(0, n, pool)

    def pools_at(self, index: int) -> tuple[PoolCounters, ...]:
        """Every pool's counters at row ``index`` (full pool first)."""
        return tuple(PoolCounters(*(int(v) for v in self._pool_rows(p)[index])) for p in range(self.num_pools))

    def index_of(self, step: int) -> int:
        """Index of the last known step <= ``step`` (-1 if none)."""
        return int(np.searchsorted(self.steps[: self.size], step, side="right")) - 1

    def peak(self, size: int | None = None, pool: int = 0) -> tuple[int, int] | None:
        """(step, used tokens) of pool ``pool``'s highest occupancy known (in the first ``size``
        steps), or None."""
        n = self.size if size is None else size
        if not n:
            return None
        scanned, i = self._peaks.get(pool, (0, -1))
        if scanned > n:
            scanned, i = 0, -1
        if n > scanned:  # only the rows appended since the last call (a dashboard asks every frame)
            new = self._used_rows(scanned, n, pool)
            j = scanned + int(np.argmax(new))
            if i < 0 or new[j - scanned] > self._used_rows(i, i + 1, pool)[0]:
                i = j
            self._peaks[pool] = (n, i)
        return int(self.steps[i]), int(self._used_rows(i, i + 1, pool)[0])

    def _used_rows(self, lo: int, hi: int, pool: int = 0) -> np.ndarray:
        rows = self._pool_rows(pool)[lo:hi]
        f = self._FIELDS
        return rows[:, f.index("pool_tokens")] - rows[:, f.index("available")] - rows[:, f.index("evictable")]

    def events_until(self, step: int) -> list[StepEvent]:
        """Events of steps <= ``step``."""
        return self.events[: self.event_index(step)]

    def event_index(self, step: int) -> int:
        """Number of events of steps <= ``step`` (where the events after it start)."""
        import bisect

        return bisect.bisect_right(self._event_steps, step)

    def nbytes(self) -> int:
        return self.steps.nbytes + self.times.nbytes + self.counters.nbytes + (0 if self.other is None else self.other.nbytes)


@dataclass
class SavedState:
    """The per-request columns of a ``ReplayState`` at one step (``save`` / ``restore``;
    a dashboard's replay process sends them to its screen after a seek)."""

    step: int | None
    columns: dict[str, np.ndarray]  # name -> per-request column (index = request id)


class ReplayState:
    """The fold of step snapshots: per-request columns, the timeline, the events.

    Args:
        page_size: to count pages.
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.step: int | None = None  # the step of the last snapshot folded
        self.pool: PoolCounters | None = None
        self.other_pools: tuple[PoolCounters, ...] = ()  # ``StepSnapshot.other_pools`` of that step
        self.timeline = Timeline()
        self._cols = {name: np.full(1024, fill, dtype) for name, dtype, fill in _COLUMNS}
        # the snapshots carry the requests' SWA cursors (``StepSnapshot.swa_evicted``)
        self.swa_lengths = False
        # the snapshots carry the requests' Mamba state slots (``StepSnapshot.mamba_slot``)
        self.mamba_slots = False

    # ------------------------------------------------------------------ folding
    def apply(self, snap: StepSnapshot) -> None:
        """Fold one snapshot (a keyframe replaces the per-request state)."""
        d = snap.requests
        cols = self._cols
        if snap.keyframe:
            self._clear_lengths()
        if d.rids.shape[0]:
            self._ensure(int(d.rids.max()))
            rids = d.rids
            phase = d.phase
            changed = d.op != UNCHANGED_OP
            before = cols["phase"][rids]
            was_live = (before >= 0) & _LIVE[np.maximum(before, 0)]
            # an admission: extend / prealloc of a request not holding KV (new or retracted)
            admitted = changed & ((d.op == EXTEND) | (d.op == PREALLOC)) & ~was_live
            if admitted.any():
                ar = rids[admitted]
                cols["prefix_hit"][ar] = d.prefix[admitted]
                first = cols["admitted_step"][ar] < 0
                cols["admitted_step"][ar[first]] = snap.step
                cols["admissions"][ar] += 1
            ended = _ENDED[phase] & changed
            cols["ended_step"][rids[ended]] = snap.step
            cols["phase"][rids] = phase
            cols["allocated"][rids] = d.allocated
            cols["committed"][rids] = d.committed
            cols["protected"][rids] = d.protected
            cols["last_step"][rids[changed]] = snap.step
            if snap.swa_evicted is not None:
                cols["swa_evicted"][rids] = snap.swa_evicted
                self.swa_lengths = True
            if snap.mamba_slot is not None:
                cols["mamba_slot"][rids] = snap.mamba_slot
                self.mamba_slots = True
        self.step = snap.step
        self.pool = snap.pool
        self.other_pools = snap.other_pools
        self.timeline.append(snap)

    def apply_block(self, block: SnapshotBlock) -> None:
        """Fold consecutive snapshots at once: the same state as ``apply`` on each in
        order, in a few vectorised operations over all their rows (the dashboard folds
        thousands of steps a second this way)."""
        k = block.num_steps
        if k == 0:
            return
        ends = np.cumsum(block.row_counts)
        starts = ends - block.row_counts
        lo = 0
        for key in np.flatnonzero(block.keyframes).tolist() + [k]:  # a keyframe first clears the lengths
            if key > lo:
                self._fold_rows(block, int(starts[lo]), int(ends[key - 1]), lo, key)
            if key < k:
                self._clear_lengths()
                lo = key
        self.step = int(block.steps[-1])
        self.pool = block.pool(k - 1)
        self.other_pools = block.other_pools_at(k - 1)
        self.timeline.extend(block)

    def _fold_rows(self, block: SnapshotBlock, r0: int, r1: int, s0: int, s1: int) -> None:
        """Fold rows ``[r0, r1)`` of the block (those of its steps ``[s0, s1)``)."""
        if r1 <= r0:
            return
        d = RequestDelta(*(a[r0:r1] for a in block.requests))
        row_step = np.repeat(block.steps[s0:s1], block.row_counts[s0:s1])
        cols = self._cols
        self._ensure(int(d.rids.max()))
        n = r1 - r0
        order = np.argsort(d.rids, kind="stable")  # by request, then in step order
        rid = d.rids[order]
        first = np.ones(n, bool)
        first[1:] = rid[1:] != rid[:-1]
        last = np.ones(n, bool)
        last[:-1] = first[1:]
        phase = d.phase[order]
        op = d.op[order]
        step = row_step[order]
        before = np.where(first, cols["phase"][rid], np.roll(phase, 1))  # the phase before each row
        changed = op != UNCHANGED_OP
        was_live = (before >= 0) & _LIVE[np.maximum(before, 0)]
        admitted = changed & ((op == EXTEND) | (op == PREALLOC)) & ~was_live
        if admitted.any():
            at = np.flatnonzero(admitted)
            ar = rid[at]
            a_first = np.ones(at.shape[0], bool)
            a_first[1:] = ar[1:] != ar[:-1]
            a_last = np.ones(at.shape[0], bool)
            a_last[:-1] = a_first[1:]
            cols["prefix_hit"][ar[a_last]] = d.prefix[order][at[a_last]]
            fr = ar[a_first]
            unset = cols["admitted_step"][fr] < 0
            cols["admitted_step"][fr[unset]] = step[at[a_first]][unset]
            np.add.at(cols["admissions"], ar, 1)
        for mask, name in ((_ENDED[phase] & changed, "ended_step"), (changed, "last_step")):
            at = np.flatnonzero(mask)
            if at.shape[0]:
                keep = np.ones(at.shape[0], bool)
                keep[:-1] = rid[at][1:] != rid[at][:-1]
                cols[name][rid[at[keep]]] = step[at[keep]]
        final = order[last]
        cols["phase"][rid[last]] = phase[last]
        cols["allocated"][rid[last]] = d.allocated[final]
        cols["committed"][rid[last]] = d.committed[final]
        cols["protected"][rid[last]] = d.protected[final]
        if block.swa_evicted is not None:
            cols["swa_evicted"][rid[last]] = block.swa_evicted[r0:r1][final]
            self.swa_lengths = True
        if block.mamba_slot is not None:
            cols["mamba_slot"][rid[last]] = block.mamba_slot[r0:r1][final]
            self.mamba_slots = True

    def _clear_lengths(self) -> None:
        cols = self._cols
        for name in ("allocated", "committed", "protected", "swa_evicted"):
            cols[name][:] = 0
        cols["mamba_slot"][:] = -1

    def _ensure(self, max_rid: int) -> None:
        size = self._cols["phase"].shape[0]
        if max_rid < size:
            return
        new = max(max_rid + 1, 2 * size)
        for name, dtype, fill in _COLUMNS:
            grown = np.full(new, fill, dtype)
            grown[:size] = self._cols[name]
            self._cols[name] = grown

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> SavedState:
        """The per-request columns now (the timeline is append-only and not saved)."""
        return SavedState(self.step, {k: v.copy() for k, v in self._cols.items()})

    def restore(self, saved: SavedState, pool: PoolCounters | None,
                other_pools: tuple[PoolCounters, ...] = ()) -> None:
        self.step = saved.step
        self.pool = pool
        self.other_pools = other_pools
        self._cols = {k: v.copy() for k, v in saved.columns.items()}
        size = self._cols["phase"].shape[0]
        for name, dtype, fill in _COLUMNS:  # a column the saver did not know
            self._cols.setdefault(name, np.full(size, fill, dtype))

    def copy(self) -> ReplayState:
        return copy.deepcopy(self)

    # ------------------------------------------------------------------ reads
    def column(self, name: str) -> np.ndarray:
        """A per-request column over the requests seen (index = request id)."""
        return self._cols[name]

    def seen_rids(self) -> np.ndarray:
        """Request ids seen so far, ascending."""
        return np.flatnonzero(self._cols["phase"] >= 0)

    def live_rids(self) -> np.ndarray:
        """Requests holding KV now."""
        phase = self._cols["phase"]
        return np.flatnonzero((phase >= 0) & _LIVE[np.maximum(phase, 0)] & (self._cols["allocated"] > 0))

    def pages(self, rids: np.ndarray) -> np.ndarray:
        ps = self.page_size
        return -(-self._cols["allocated"][rids] // ps)

    def row(self, rid: int) -> RequestRow:
        """One request's row (``KeyError`` if never seen)."""
        c = self._cols
        if rid < 0 or rid >= c["phase"].shape[0] or c["phase"][rid] < 0:
            raise KeyError(rid)
        alloc, used = int(c["allocated"][rid]), int(c["committed"][rid])
        return RequestRow(
            rid=rid,
            phase=PHASES[int(c["phase"][rid])],
            used=used,
            allocated=alloc,
            overallocated=alloc - used,
            protected=int(c["protected"][rid]),
            pages=-(-alloc // self.page_size),
            prefix_hit=int(c["prefix_hit"][rid]),
            admitted_step=int(c["admitted_step"][rid]),
            ended_step=int(c["ended_step"][rid]),
            swa_evicted=int(c["swa_evicted"][rid]) if self.swa_lengths else None,
            mamba_slot=int(c["mamba_slot"][rid]) if self.mamba_slots else None,
        )

    def table(self, rids: np.ndarray | None = None) -> list[RequestRow]:
        """Rows of ``rids`` (default: every request seen), for small tables and tests."""
        return [self.row(int(r)) for r in (self.seen_rids() if rids is None else rids)]

    def history(self, rid: int, until: int | None = None) -> list[StepEvent]:
        """The events that named ``rid``, up to step ``until`` (default: now)."""
        step = self.step if until is None else until
        if step is None:
            return []
        return [e for e in self.timeline.events_until(step) if e.rid == rid]

    def phase_counts(self) -> dict[str, int]:
        """Requests per phase."""
        phase = self._cols["phase"]
        counts = np.bincount(phase[phase >= 0], minlength=len(PHASES))
        return {name: int(counts[i]) for i, name in enumerate(PHASES)}

    def nbytes(self) -> int:
        return sum(v.nbytes for v in self._cols.values()) + self.timeline.nbytes()

