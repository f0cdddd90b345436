"""Flows: arrows from each eviction to the later admissions that missed its tokens
(``kvtrace export --flows``), from ``kvtrace explain``'s attribution.

``EvictionFlows.attach(session)`` watches a replay session (before its first step) with an
``Attribution``; after each step is fed to the ``TimelineBuilder``, ``records(snap, builder)``
gives that step's ``Flow`` records. An eviction's end sits on the lane of the request whose
allocator call evicted (the events track when that request holds no lane: a release, or an
evictor explain cannot name); an admission's end on its own lane. One flow per (eviction,
admission) pair: an eviction that made several admissions miss has an arrow to each.

The source of a flow is written when the miss is known, after the eviction's time: viewers
sort events by time before they draw them (Perfetto's trace processor sorts the whole
file; the Trace Event Format is unordered).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtrace.export.timeline import Flow, TimelineBuilder, ts_ns

if TYPE_CHECKING:
    from kvtrace.explain.attribution import Attribution
    from kvtrace.replay.session import ReplaySession
    from kvtrace.replay.snapshot import StepSnapshot

__all__ = ["EvictionFlows"]


class EvictionFlows:
    """The flows of one replay session (see the module's docstring)."""

    def __init__(self, attribution: Attribution) -> None:
        self.attribution = attribution
        attribution.on_evicted_miss = self._missed
        self._pending: list[tuple[int, dict[int, int]]] = []  # this step's (rid, {eviction id: tokens})
        self._sources: dict[int, tuple[int, int | None]] = {}  # eviction id -> (ts, evictor's lane)
        self._known = 0  # evictions whose source is placed
        self._next_id = 0
        self.flows = 0

    @classmethod
    def attach(cls, session: ReplaySession) -> EvictionFlows:
        """Watch ``session`` (not yet stepped).

        Raises:
            ConfigError: the session's allocator has no radix cache, or it is off.
        """
        from kvtrace.explain.attribution import Attribution

        return cls(Attribution.attach(session))

    def _missed(self, rid: int, by_eviction: dict[int, int]) -> None:
        self._pending.append((rid, by_eviction))

    def records(self, snap: StepSnapshot, builder: TimelineBuilder) -> list[Flow]:
        """The flows into this step's admissions (``snap`` already fed to ``builder``)."""
        ts = ts_ns(snap.time_s)
        records = self.attribution.records
        for i in range(self._known, len(records)):
            # NOTE: an eviction of a step outside the --steps window was never fed: it
            # has no source, and the misses it causes draw no arrow.
            if records[i].step == snap.step:
                self._sources[i + 1] = (ts, builder.lane_of(records[i].rid))
        self._known = len(records)
        out: list[Flow] = []
        for rid, by_eviction in self._pending:
            lane = builder.lane_of(rid)
            if lane is None:  # admitted and gone within the step: no slice to point at
                continue
            for rec_id, tokens in by_eviction.items():
                source = self._sources.get(rec_id)
                if source is None:
                    continue
                rec = records[rec_id - 1]
                self._next_id += 1
                src_args = {"eviction": rec_id, "step": rec.step, "trigger": rec.trigger, "evictor_rid": rec.rid,
                            "batch_size": rec.batch_size, "evicted_tokens": self.attribution.record_tokens[rec_id - 1]}
                args = {"rid": rid, "missed_tokens": tokens, "eviction": rec_id, "eviction_step": rec.step,
                        "evictor_rid": rec.rid}
                out.append(Flow(ts, lane, source[0], source[1], self._next_id, src_args, args))
        self.flows += len(out)
        self._pending.clear()
        return out
