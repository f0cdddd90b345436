"""What a replay found: the result (``ReplayResult``) and what it counted, its running
totals (``ReplayStats``), the first out-of-memory and the invariant violations found
(``OomRecord``, ``ViolationRecord``).

``kvtrace.replay.engine.ReplayEngine`` updates the totals step by step; the session
checkpoints them with the engine and returns them in its ``ReplayResult``, whose
summary ``kvtrace.replay.report`` makes; ``kvtrace.shrink`` matches its targets
against the records.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from allocator.base import AllocatorConfig, PoolCounters
    from kvtrace.replay.engine import ReplayOptions

__all__ = ["MAX_VIOLATIONS_KEPT", "OomRecord", "PoolPeak", "ReplayResult", "ReplayStats", "ViolationRecord"]

MAX_VIOLATIONS_KEPT = 1000  # violations listed in full; the rest are counted


@dataclass(frozen=True, slots=True)
class OomRecord:
    """The first allocation that did not fit; ``pool`` is the KV pool that ran short
    (``"full"``, or ``"swa"`` for a hybrid sliding-window model)."""

    step: int
    op: str
    rid: int
    needed: int
    free: int
    evictable: int
    pool: str = "full"


@dataclass(frozen=True, slots=True)
class ViolationRecord:
    """One broken invariant with its blame; ``pool`` is the KV pool it is about."""

    step: int
    rid: int | None
    op: str
    check: str
    detail: str
    pool: str = "full"


@dataclass
class PoolPeak:
    """The highest occupancy of one KV pool over the window (``used_tokens``) and its step."""

    used_tokens: int = 0
    step: int | None = None


@dataclass
class ReplayStats:
    """Running totals of the replayed window; the summary is built from them."""

    steps: int = 0
    steps_reported: int = 0  # steps inside the --steps window (== steps)
    first_step: int | None = None
    last_step: int | None = None
    ops: int = 0
    first_time_s: float | None = None
    last_time_s: float = 0.0
    allocator_s: float = 0.0
    prefill_tokens: int = 0  # tokens computed by extend ops (after the replay's prefix hits)
    reused_tokens: int = 0  # prefix tokens the replay's radix cache supplied
    host_reused_tokens: int = 0  # of those, loaded back from HiCache's host tier at admission
    admitted_tokens: int = 0  # prompt tokens of admissions (the hit-rate denominator)
    admissions: int = 0
    prefix_differs: int = 0  # admissions whose replay hit differs from the recorded one
    decode_tokens: int = 0
    spec_accepted: int = 0
    evicted_tokens: int = 0
    overalloc_held_at_start: int = 0
    overalloc_allocated: int = 0
    overalloc_released: int = 0
    peak_used_tokens: int = 0  # of the full pool (the one pool of a full-attention model)
    peak_step: int | None = None
    # every pool's peak, by pool name, when the allocator has several (hybrid SWA models)
    pool_peaks: dict[str, PoolPeak] = field(default_factory=dict)
    dropped_requests: int = 0
    skipped_ops: int = 0
    bad_ops: int = 0
    retractions: int = 0
    aborts: int = 0
    finishes: int = 0
    session_holds: int = 0  # streaming sessions: turns whose KV their session kept
    session_closes: int = 0
    peak_session_held: int = 0  # the most KV sessions held (SGLang's split) at a step's end
    oom: OomRecord | None = None
    num_ooms: int = 0
    ooms_by_pool: dict[str, int] = field(default_factory=dict)  # out-of-memories by the pool that ran short
    violations: list[ViolationRecord] = field(default_factory=list)
    num_violations: int = 0
    row_overflows: int = 0


@dataclass(frozen=True)
class ReplayResult:
    """What a replay found: the summary every report is made from.

    ``to_dict()`` is the stable ``kvtrace replay --json`` object.
    """

    trace: str
    allocator: str
    config: AllocatorConfig
    options: ReplayOptions
    stats: ReplayStats
    requests: int
    wall_s: float
    overalloc_held_at_end: int
    page_tail_at_end: int
    stopped_early: bool
    truncated: bool
    completed: bool  # the replay reached the end of the trace (or its window)
    # each KV pool's counters at the end, by name (``"full"``, ``"swa"``), when the
    # allocator has several; empty for a full-attention model (its one pool is the
    # summary's top level)
    pools_at_end: dict[str, PoolCounters] = field(default_factory=dict)
    sessions: bool = False  # the trace has streaming sessions (its summary says what they held)
    namespaces: int = 0  # the trace's cache namespaces (``TraceMeta.namespaces``; 0: none)

    @property
    def failed(self) -> bool:
        """Violations, skipped bad ops, or an out-of-memory that stopped the replay."""
        st = self.stats
        return st.num_violations > 0 or st.bad_ops > 0 or (self.options.on_oom == "stop" and st.oom is not None)

    def to_dict(self) -> dict[str, Any]:
        from kvtrace.replay.report import replay_summary

        return replay_summary(self)
