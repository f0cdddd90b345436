"""Immutable, host-side records of one replayed step: what every consumer reads.

The replay engine builds one ``StepSnapshot`` per step from the allocator's
results; the CLI summary, the state log, the per-request state (``kvtrace.replay.state``),
the dashboard and diff read snapshots only, never the allocator.

Pool counters are the allocator's own ``PoolCounters`` (one type from the
allocator to the screen), one per KV pool: ``pool`` is the full pool (the one pool of
a full-attention model), ``other_pools`` the others of a hybrid model in
``POOL_NAMES`` order (the sliding-window pool, or the Mamba state pool), named by
``other_pool_names``, ``pools`` all of them by name. Each request a step changed appears once in the step's
``RequestDelta`` with its lengths after the step, the op that changed it and the
phase it is in now.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np

from allocator.base import PoolCounters
from traces.schema import OPS

__all__ = [
    "DROPPED_OP",
    "PHASES",
    "UNCHANGED_OP",
    "Event",
    "EventKind",
    "POOL_NAMES",
    "Phase",
    "PoolCounters",
    "RequestDelta",
    "SnapshotBlock",
    "StepSnapshot",
    "op_name",
]

EventKind = Literal[
    "evict",  # tokens evicted from the radix cache to make room
    "overalloc_release",  # speculative slack freed when a request was released
    "finish",
    "retract",
    "abort",
    "hold",  # a streaming session's turn ended, its KV held for the next turn
    "close",  # a streaming session closed, its held KV freed
    "oom",  # an allocation that did not fit
    "dropped",  # a request whose op was skipped (OOM with --on-oom skip, or a bad op)
    "row_overflow",  # a speculative reserve clipped at the row width
    "violation",  # a broken invariant
    "bad_op",  # an impossible op in the trace
]

# A request's phase after a step (``RequestDelta.phase`` holds the index):
#   waiting    PD decode: pre-allocated, its KV arriving from the prefill server
#   prefill    in chunked prefill (more chunks to come)
#   decode     prefill done, one token per step
#   spec       prefill done, speculative steps (draft slots over-allocated)
#   finished   released, its prefix kept in the radix cache
#   retracted  released under memory pressure, waiting to be admitted again
#   aborted    released, nothing cached, the request ends
#   dropped    taken out of the replay after an out-of-memory (--on-oom skip)
Phase = Literal["waiting", "prefill", "decode", "spec", "finished", "retracted", "aborted", "dropped"]
PHASES: tuple[Phase, ...] = ("waiting", "prefill", "decode", "spec", "finished", "retracted", "aborted", "dropped")
(WAITING, PREFILL, DECODE_PHASE, SPEC_PHASE, FINISHED, RETRACTED, ABORTED, DROPPED) = range(len(PHASES))
LIVE_PHASES = frozenset({WAITING, PREFILL, DECODE_PHASE, SPEC_PHASE})

# The pools an allocator may have, in order: the full-attention KV pool (every model
# has it), the sliding-window pool of a hybrid SWA model and the Mamba state pool of a
# hybrid linear-attention model (``pool_counters()`` keys; the Mamba pool counts slots),
# and HiCache's host KV pool under the radix cache (host token slots).
POOL_NAMES: tuple[str, ...] = ("full", "swa", "mamba", "host")


def other_pool_names(names: tuple[str, ...], n: int) -> tuple[str, ...]:
    """The names of ``n`` pools after the full one: ``names`` when given, else the
    first ``n`` of ``POOL_NAMES[1:]`` (what a record written before the names says)."""
    return names if names else POOL_NAMES[1 : 1 + n]

# ``RequestDelta.op`` of a request the replay dropped (no trace op changed it), and
# of a request a keyframe lists although no op changed it that step.
DROPPED_OP = -1
UNCHANGED_OP = -2


def op_name(code: int) -> str:
    """The trace op name of a ``RequestDelta.op`` code."""
    if code == DROPPED_OP:
        return "dropped"
    if code == UNCHANGED_OP:
        return "-"
    return OPS[code]


@dataclass(frozen=True, slots=True)
class Event:
    """Something worth showing on a timeline; ``rid`` is None for pool-wide events."""

    kind: EventKind
    rid: int | None
    tokens: int
    detail: str = ""

    def __reduce__(self) -> tuple[type[Event], tuple[str, int | None, int, str]]:
        # Pickled as its constructor's arguments: a dashboard's updates carry every event,
        # and this is cheaper to write and to read back than a slotted dataclass's own
        # state pickling.
        return (Event, (self.kind, self.rid, self.tokens, self.detail))


class RequestDelta(NamedTuple):
    """The requests a step changed, with their bookkeeping after the step.

    A released request appears with ``allocated == 0``. ``prefix`` is the prefix an
    ``extend`` / ``prealloc`` reused (the radix hit when the request was admitted,
    the already-held length for a continuing chunk), else 0.
    """

    rids: np.ndarray  # int64 [n]
    allocated: np.ndarray  # int64 [n] kv_allocated_len
    committed: np.ndarray  # int64 [n] kv_committed_len
    protected: np.ndarray  # int64 [n] cache_protected_len
    op: np.ndarray  # int8 [n] trace op code that changed it (traces.schema.OPS), DROPPED_OP
    phase: np.ndarray  # int8 [n] index into PHASES
    prefix: np.ndarray  # int64 [n]

    @classmethod
    def empty(cls) -> RequestDelta:
        z = np.zeros(0, np.int64)
        b = np.zeros(0, np.int8)
        return cls(z, z, z, z, b, b, z)

    @property
    def num_requests(self) -> int:
        return int(self.rids.shape[0])


@dataclass(frozen=True, slots=True)
class StepSnapshot:
    """The state after one replayed step.

    ``keyframe``: ``requests`` lists every request holding KV after the step (plus the
    ones the step released), not only the ones it changed: the first snapshot of a
    ``--steps`` window is one, so a consumer that starts there sees the whole state.
    ``digest``: the allocator's ``state_digest()`` after the step when the replay asks
    for it (``ReplayOptions.state_digest``; ``kvtrace diff --exact``), else None.
    ``other_pools``: the counters of the pools after the full one (``pool``), in
    ``POOL_NAMES`` order, named by ``other_pool_names`` (empty: ``POOL_NAMES[1:]``
    in order); empty for a full-attention model.
    ``swa_evicted``: with a sliding-window pool, each request row's SWA cursor
    (``swa_evicted_seqlen``) after the step, aligned with ``requests``; None otherwise.
    It rides beside the ``RequestDelta`` rather than in it, so that what compares,
    logs or exports deltas is the same for every model.
    ``mamba_slot``: with a Mamba pool, each request row's state slot (``mamba_pool_idx``,
    -1: none) after the step, aligned with ``requests`` like ``swa_evicted``; None otherwise.
    """

    step: int
    time_s: float
    pool: PoolCounters
    requests: RequestDelta
    events: tuple[Event, ...]
    num_ops: int
    allocator_s: float  # seconds spent inside allocator calls this step
    keyframe: bool = False
    digest: str | None = None
    other_pools: tuple[PoolCounters, ...] = ()
    swa_evicted: np.ndarray | None = None  # int64 [n] swa_evicted_seqlen per requests row
    other_pool_names: tuple[str, ...] = ()
    mamba_slot: np.ndarray | None = None  # int64 [n] mamba_pool_idx per requests row (-1: none)

    @property
    def pools(self) -> dict[str, PoolCounters]:
        """Every pool's counters after the step, by name (``POOL_NAMES``)."""
        names = other_pool_names(self.other_pool_names, len(self.other_pools))
        return dict(zip(("full", *names), (self.pool, *self.other_pools)))


class SnapshotBlock(NamedTuple):
    """Consecutive snapshots as columns: what ``ReplayState.apply_block`` folds with a few
    vectorised operations instead of a loop over steps (``of`` a list of snapshots;
    ``kvtrace.statelog.log.block_of`` a state log's record batch, without building them)."""

    steps: np.ndarray  # int64 [k]
    times: np.ndarray  # float64 [k]
    pools: np.ndarray  # int64 [k, len(PoolCounters._fields)]
    keyframes: np.ndarray  # bool [k]
    num_ops: np.ndarray  # int32 [k]
    allocator_s: np.ndarray  # float64 [k]
    row_counts: np.ndarray  # int64 [k] requests in each step's delta
    requests: RequestDelta  # the k deltas, concatenated in step order
    event_steps: list[int]  # the step of each event
    events: list[Event]  # every event of the k steps, in order
    digests: list[str | None]  # [k] the allocator's state digest after each step (None: not asked)
    # int64 [k, n, len(PoolCounters._fields)]: the n pools after the full one
    # (``StepSnapshot.other_pools``); None for a full-attention model
    other_pools: np.ndarray | None = None
    # int64 [rows]: the SWA cursor of each request row (``StepSnapshot.swa_evicted``), None
    # when no step has one (a full-attention model)
    swa_evicted: np.ndarray | None = None
    # the names of ``other_pools``' pools (``StepSnapshot.other_pool_names``)
    other_pool_names: tuple[str, ...] = ()
    # int64 [rows]: the Mamba state slot of each request row (``StepSnapshot.mamba_slot``),
    # None when no step has one (a model without a Mamba pool)
    mamba_slot: np.ndarray | None = None

    @classmethod
    def of(cls, snaps: Sequence[StepSnapshot], rows: Sequence[bool] | None = None) -> SnapshotBlock:
        """The block of ``snaps`` (consecutive, in step order).

        Args:
            snaps: the steps.
            rows: whether each step's request rows go in (None: every step's); a step
                left out has a row count of 0 (``ReplaySession.take_block`` leaves out the
                rows a later step of the same decode run overwrites).
        """
        k = len(snaps)
        nf = len(PoolCounters._fields)
        if k == 0:
            return cls(np.zeros(0, np.int64), np.zeros(0), np.zeros((0, nf), np.int64), np.zeros(0, bool),
                       np.zeros(0, np.int32), np.zeros(0), np.zeros(0, np.int64), RequestDelta.empty(), [], [], [])
        with_rows = snaps if rows is None else [s for s, keep in zip(snaps, rows, strict=True) if keep]
        if with_rows:
            parts = list(zip(*[s.requests for s in with_rows]))  # per field: the steps' arrays
            delta = RequestDelta(*(np.concatenate(p) for p in parts))
            lengths = np.fromiter(map(len, parts[0]), np.int64, len(with_rows))
        else:
            delta, lengths = RequestDelta.empty(), np.zeros(0, np.int64)
        if rows is None:
            counts = lengths
        else:
            counts = np.zeros(k, np.int64)
            counts[np.fromiter(rows, bool, k)] = lengths
        event_steps: list[int] = []
        events: list[Event] = []
        for s in snaps:
            if s.events:
                event_steps.extend([s.step] * len(s.events))
                events.extend(s.events)
        return cls(
            steps=np.fromiter([s.step for s in snaps], np.int64, k),
            times=np.fromiter([s.time_s for s in snaps], np.float64, k),
            pools=np.fromiter(chain.from_iterable(s.pool for s in snaps), np.int64, k * nf).reshape(k, nf),
            keyframes=np.fromiter([s.keyframe for s in snaps], bool, k),
            num_ops=np.fromiter([s.num_ops for s in snaps], np.int32, k),
            allocator_s=np.fromiter([s.allocator_s for s in snaps], np.float64, k),
            row_counts=counts,
            requests=delta,
            event_steps=event_steps,
            events=events,
            digests=[s.digest for s in snaps],
            other_pools=_other_pools(snaps),
            swa_evicted=_swa_evicted([(s.swa_evicted, s.requests.num_requests) for s in with_rows]),
            other_pool_names=snaps[0].other_pool_names,
            mamba_slot=_row_column([(s.mamba_slot, s.requests.num_requests) for s in with_rows], -1),
        )

    @classmethod
    def concat(cls, blocks: Sequence[SnapshotBlock]) -> SnapshotBlock:
        """One block of consecutive ``blocks`` (in step order): folding it reaches the
        state that folding them one after another does, in one pass."""
        if len(blocks) == 1:
            return blocks[0]
        if not blocks:
            return cls.of([])

        def joined(name: str) -> np.ndarray:
            return np.concatenate([getattr(b, name) for b in blocks])

        return cls(
            steps=joined("steps"),
            times=joined("times"),
            pools=joined("pools"),
            keyframes=joined("keyframes"),
            num_ops=joined("num_ops"),
            allocator_s=joined("allocator_s"),
            row_counts=joined("row_counts"),
            requests=RequestDelta(*(np.concatenate(p) for p in zip(*[b.requests for b in blocks]))),
            event_steps=list(chain.from_iterable(b.event_steps for b in blocks)),
            events=list(chain.from_iterable(b.events for b in blocks)),
            digests=list(chain.from_iterable(b.digests for b in blocks)),
            other_pools=None if blocks[0].other_pools is None else joined("other_pools"),
            swa_evicted=_swa_evicted([(b.swa_evicted, b.requests.num_requests) for b in blocks]),
            other_pool_names=blocks[0].other_pool_names,
            mamba_slot=_row_column([(b.mamba_slot, b.requests.num_requests) for b in blocks], -1),
        )

    @property
    def num_steps(self) -> int:
        return int(self.steps.shape[0])

    def pool(self, i: int) -> PoolCounters:
        """The pool counters after step ``i`` of the block."""
        return PoolCounters(*(int(v) for v in self.pools[i]))

    def other_pools_at(self, i: int) -> tuple[PoolCounters, ...]:
        """The counters of the pools after the full one after step ``i`` (``StepSnapshot.other_pools``)."""
        if self.other_pools is None:
            return ()
        return tuple(PoolCounters(*(int(v) for v in row)) for row in self.other_pools[i])


def _swa_evicted(parts: Sequence[tuple[np.ndarray | None, int]]) -> np.ndarray | None:
    """The SWA cursors of consecutive row groups ``(cursors or None, rows)`` as one column
    (zeros for a group without any); None when no group has any."""
    if all(c is None for c, _ in parts):
        return None
    return np.concatenate([np.zeros(n, np.int64) if c is None else np.asarray(c, np.int64) for c, n in parts])


def _row_column(parts: Sequence[tuple[np.ndarray | None, int]], fill: int) -> np.ndarray | None:
    """A per-row column of consecutive row groups ``(values or None, rows)`` as one
    (``fill`` for a group without any); None when no group has any."""
    if all(c is None for c, _ in parts):
        return None
    return np.concatenate([np.full(n, fill, np.int64) if c is None else np.asarray(c, np.int64) for c, n in parts])


def _other_pools(snaps: Sequence[StepSnapshot]) -> np.ndarray | None:
    """The steps' ``other_pools`` as one array (None when no step has any)."""
    n = len(snaps[0].other_pools)
    if n == 0:
        return None
    nf = len(PoolCounters._fields)
    flat = chain.from_iterable(chain.from_iterable(s.other_pools) for s in snaps)
    return np.fromiter(flat, np.int64, len(snaps) * n * nf).reshape(len(snaps), n, nf)
