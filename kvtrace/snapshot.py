"""Immutable, host-side records of one replayed step: what every consumer reads.

The replay engine builds one ``StepSnapshot`` per step from the allocator's
results; the CLI summary, the state log, the dashboard and diff read snapshots
only, never the allocator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np

EventKind = Literal[
    "evict",  # tokens evicted from the radix cache to make room
    "overalloc_release",  # speculative slack freed when a request was released
    "finish",
    "retract",
    "abort",
    "oom",  # an allocation that did not fit
    "dropped",  # a request whose op was skipped (OOM with --on-oom skip, or a bad op)
    "row_overflow",  # a speculative reserve clipped at the row width
    "violation",  # a broken invariant
    "bad_op",  # an impossible op in the trace
]


class PoolSnapshot(NamedTuple):
    """Pool token counts after a step; the five parts sum to ``pool_tokens``.

    ``committed``: live requests' KV outside the radix cache; ``overallocated``: slots
    requests hold beyond their committed length (speculative slack, page tails);
    ``evictable`` / ``protected``: cached tokens unlocked / locked by a request.
    """

    pool_tokens: int
    available: int
    evictable: int
    protected: int
    committed: int
    overallocated: int
    running_requests: int
    free_rows: int

    @property
    def used_tokens(self) -> int:
        """Tokens that cannot be handed out without evicting or releasing (not free, not evictable)."""
        return self.pool_tokens - self.available - self.evictable


@dataclass(frozen=True, slots=True)
class Event:
    """Something worth showing on a timeline; ``rid`` is None for pool-wide events."""

    kind: EventKind
    rid: int | None
    tokens: int
    detail: str = ""


class RequestDelta(NamedTuple):
    """Bookkeeping of the requests an op touched this step (after the step).

    A released request appears with ``allocated == 0``.
    """

    rids: np.ndarray  # int64 [n]
    allocated: np.ndarray  # int64 [n] kv_allocated_len
    committed: np.ndarray  # int64 [n] kv_committed_len
    protected: np.ndarray  # int64 [n] cache_protected_len

    @classmethod
    def empty(cls) -> RequestDelta:
        z = np.zeros(0, np.int64)
        return cls(z, z, z, z)


@dataclass(frozen=True, slots=True)
class StepSnapshot:
    """The state after one replayed step."""

    step: int
    time_s: float
    pool: PoolSnapshot
    requests: RequestDelta
    events: tuple[Event, ...]
    num_ops: int
    allocator_s: float  # seconds spent inside allocator calls this step
