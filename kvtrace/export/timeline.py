"""The timeline of a replay, independent of the file format it is written in.

``TimelineBuilder.feed(snapshot)`` turns each ``StepSnapshot`` (of a live replay or a
state log read back) into the records a trace viewer draws, in time order:

- ``Counters``: per pool, the token counts ``COUNTERS`` (a record only when one changed);
- ``HitRate``: the prefix hit rate over the last ``hit_window`` admissions whose prefill
  completed (hit tokens / prompt tokens, as the replay's summary counts them), when a new
  admission completes;
- ``SliceBegin`` / ``SliceEnd``: each request from admission to release on a lane, with
  its phases (prefill, decode, ...) as slices nested in it. A released lane is reused by
  the next admission (the lowest free one), so the lanes are as many as the peak number
  of requests holding KV at once. A request retracted and admitted again is two slices;
- ``Instant``: every event but ``finish`` and a session's ``hold`` (each ends a slice;
  a held one ends ``held``): evictions, retractions, aborts, a session's ``close``,
  out-of-memory, violations, over-allocation releases, bad or dropped ops.

The builder keeps per-request columns (indexed by request id) and the open lanes, never
the records it returned: memory is flat in the length of the replay. The time axis is the
trace's simulated serving time, in nanoseconds (``ts_ns``).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from kvtrace.replay.snapshot import PHASES
from traces.schema import EXTEND, PREALLOC

if TYPE_CHECKING:
    from allocator.base import PoolCounters
    from kvtrace.replay.snapshot import StepSnapshot

__all__ = [
    "COUNTERS",
    "Counters",
    "Flow",
    "HitRate",
    "Instant",
    "Record",
    "SliceBegin",
    "SliceEnd",
    "TimelineBuilder",
    "pools_of",
    "timeline_records",
    "ts_ns",
]

# The counter tracks of a pool, and the ``PoolCounters`` field each one reads.
COUNTERS: tuple[str, ...] = ("free", "evictable", "protected", "committed", "overallocated")
_POOL_FIELDS: tuple[str, ...] = ("available", "evictable", "protected", "committed", "overallocated")
DEFAULT_HIT_WINDOW = 64  # admissions

_LIVE = np.array([p in ("waiting", "prefill", "decode", "spec") for p in PHASES])
_DECODING = frozenset(i for i, p in enumerate(PHASES) if p in ("decode", "spec"))
_NOT_LIVE = -1


class Counters(NamedTuple):
    """A pool's counters (``COUNTERS``, in tokens) from ``ts_ns`` on."""

    ts_ns: int
    pool: str
    values: tuple[int, ...]


class HitRate(NamedTuple):
    """The prefix hit rate (0..1) over the sliding window of admissions, from ``ts_ns`` on."""

    ts_ns: int
    value: float


class SliceBegin(NamedTuple):
    """A slice opens on ``lane``: a request (depth 0) or one of its phases (depth 1)."""

    ts_ns: int
    lane: int
    name: str
    args: dict[str, Any]


class SliceEnd(NamedTuple):
    """The innermost open slice of ``lane`` closes; ``args`` are added to it."""

    ts_ns: int
    lane: int
    args: dict[str, Any]


class Instant(NamedTuple):
    """An event of the replay (``kind``: an ``EventKind``); ``rid`` None for a pool-wide one."""

    ts_ns: int
    kind: str
    rid: int | None
    tokens: int
    detail: str


class Flow(NamedTuple):
    """An arrow from an eviction to a later admission that missed tokens because of it
    (``kvtrace export --flows``): from ``src_lane`` (the evicting request's lane; None: the
    events track) at ``src_ts_ns`` to ``lane`` at ``ts_ns``. ``flow_id`` is unique in the
    process; ``src_args`` / ``args`` annotate the two ends."""

    ts_ns: int
    lane: int
    src_ts_ns: int
    src_lane: int | None
    flow_id: int
    src_args: dict[str, Any]
    args: dict[str, Any]


Record = Counters | HitRate | SliceBegin | SliceEnd | Instant | Flow


def pools_of(snap: StepSnapshot) -> tuple[tuple[str, PoolCounters], ...]:
    """The pools of a snapshot, each with its name and counters: ``full`` alone for a
    full-attention model, then the replay's other pools under the names the snapshot
    gives them (``swa`` for a sliding-window model, ``mamba`` for a linear-attention one:
    naming them by position would call a Mamba pool "swa"). Every consumer of the
    timeline gets a pool's tracks from its entry here."""
    if not snap.other_pools:
        return (("full", snap.pool),)
    return tuple(snap.pools.items())


def ts_ns(time_s: float) -> int:
    """Simulated seconds as the timeline's nanoseconds."""
    return int(round(time_s * 1e9))


class TimelineBuilder:
    """Turns snapshots, in step order, into timeline records (see the module's docstring).

    Args:
        hit_window: admissions the hit rate is taken over.
    """

    def __init__(self, hit_window: int = DEFAULT_HIT_WINDOW) -> None:
        if hit_window < 1:
            raise ValueError(f"hit_window must be >= 1, found {hit_window}")
        self._phase = np.full(1024, _NOT_LIVE, np.int8)  # live phase, or _NOT_LIVE
        self._lane = np.full(1024, -1, np.int32)
        self._committed = np.zeros(1024, np.int64)
        self._allocated = np.zeros(1024, np.int64)
        self._hit = np.zeros(1024, np.int64)  # prefix hit at the last admission
        self._prompt = np.full(1024, -1, np.int64)  # prompt tokens of the last admission (-1: prefill not done)
        self._counted = np.zeros(1024, bool)  # its last admission counts in the hit rate
        self._free_lanes: list[int] = []  # a heap: the lowest free lane goes first
        self.num_lanes = 0
        self._open = 0
        self.peak_concurrency = 0
        self._counters: dict[str, tuple[int, ...]] = {}
        self._window: deque[tuple[int, int]] = deque(maxlen=hit_window)
        self._window_hit = 0
        self._window_prompt = 0
        self.pools: list[str] = []  # the pools seen, in order of appearance
        self.last_ts_ns = 0

    def feed(self, snap: StepSnapshot) -> list[Record]:
        """The records of one step (its snapshot), in the order a viewer reads them."""
        ts = ts_ns(snap.time_s)
        self.last_ts_ns = ts
        out: list[Record] = []
        for name, pool in pools_of(snap):
            values = tuple(int(getattr(pool, f)) for f in _POOL_FIELDS)
            if self._counters.get(name) != values:
                if name not in self._counters:
                    self.pools.append(name)
                self._counters[name] = values
                out.append(Counters(ts, name, values))
        held: set[int] = set()  # the requests a streaming session holds from this step
        for e in snap.events:
            if e.kind == "hold" and e.rid is not None:
                held.add(e.rid)
            elif e.kind != "finish":
                out.append(Instant(ts, e.kind, e.rid, e.tokens, e.detail))
        if snap.requests.num_requests:
            self._requests(ts, snap, out, held)
        return out

    def lane_of(self, rid: int) -> int | None:
        """The lane of a request holding KV now; None if it holds none."""
        if rid < 0 or rid >= self._phase.shape[0] or self._phase[rid] == _NOT_LIVE:
            return None
        return int(self._lane[rid])

    def finish(self) -> list[Record]:
        """Close the slices of requests still holding KV at the end (``end: running``)."""
        out: list[Record] = []
        ts = self.last_ts_ns
        for rid in np.flatnonzero(self._phase != _NOT_LIVE).tolist():
            self._release(ts, rid, "running", out)
        return out

    # ------------------------------------------------------------------ requests
    def _requests(self, ts: int, snap: StepSnapshot, out: list[Record], held: set[int]) -> None:
        d = snap.requests
        rids = d.rids
        self._ensure(int(rids.max()))
        new = np.where(_LIVE[d.phase], d.phase, _NOT_LIVE).astype(np.int8)
        changed = np.flatnonzero(self._phase[rids] != new)
        if changed.size:
            # Releases first: a lane freed in this step can take an admission of this step.
            order = sorted(changed.tolist(), key=lambda i: new[i] != _NOT_LIVE)
            added = False
            for i in order:
                rid = int(rids[i])
                before, after = int(self._phase[rid]), int(new[i])
                if after == _NOT_LIVE:
                    if before != _NOT_LIVE:
                        self._release(ts, rid, "held" if rid in held else PHASES[int(d.phase[i])], out)
                    continue
                if before == _NOT_LIVE:
                    self._admit(ts, rid, int(d.prefix[i]), int(d.op[i]), out)
                else:
                    out.append(SliceEnd(ts, int(self._lane[rid]), {}))
                out.append(SliceBegin(ts, int(self._lane[rid]), PHASES[after], {}))
                self._phase[rid] = after
                if after in _DECODING and before not in _DECODING:
                    # Prefill done: the prompt is what the request holds now (an extend or a
                    # prealloc completed it), or held before this step's decode token.
                    op = int(d.op[i])
                    prompt = int(d.committed[i]) if op in (EXTEND, PREALLOC) else int(self._committed[rid])
                    self._prompt[rid] = prompt
                    if self._counted[rid]:
                        self._sample_hit(int(self._hit[rid]), prompt)
                        added = True
            if added and self._window_prompt > 0:
                out.append(HitRate(ts, self._window_hit / self._window_prompt))
        live = new != _NOT_LIVE
        if live.all():
            self._committed[rids] = d.committed
            self._allocated[rids] = d.allocated
        else:
            self._committed[rids[live]] = d.committed[live]
            self._allocated[rids[live]] = d.allocated[live]

    def _admit(self, ts: int, rid: int, prefix_hit: int, op: int, out: list[Record]) -> None:
        if self._free_lanes:
            lane = heapq.heappop(self._free_lanes)
        else:
            lane = self.num_lanes
            self.num_lanes += 1
        self._open += 1
        self.peak_concurrency = max(self.peak_concurrency, self._open)
        self._lane[rid] = lane
        self._hit[rid] = prefix_hit
        # As the replay's own hit rate: prefill admissions count, a PD decode's
        # pre-allocation (its KV computed by the prefill server) does not.
        self._counted[rid] = op == EXTEND
        self._prompt[rid] = -1
        self._committed[rid] = 0
        self._allocated[rid] = 0
        out.append(SliceBegin(ts, lane, f"rid {rid}", {"rid": rid, "prefix_hit": prefix_hit}))

    def _release(self, ts: int, rid: int, end: str, out: list[Record]) -> None:
        lane = int(self._lane[rid])
        prompt = int(self._prompt[rid])
        args: dict[str, Any] = {
            "end": end,
            "kv_committed_len": int(self._committed[rid]),
            "kv_allocated_len": int(self._allocated[rid]),
        }
        if prompt >= 0:
            args["prompt_len"] = prompt
            args["output_len"] = max(int(self._committed[rid]) - prompt, 0)
        out.append(SliceEnd(ts, lane, {}))  # the phase
        out.append(SliceEnd(ts, lane, args))  # the request
        heapq.heappush(self._free_lanes, lane)
        self._open -= 1
        self._phase[rid] = _NOT_LIVE
        self._lane[rid] = -1

    def _sample_hit(self, hit: int, prompt: int) -> None:
        if len(self._window) == self._window.maxlen:
            old_hit, old_prompt = self._window[0]
            self._window_hit -= old_hit
            self._window_prompt -= old_prompt
        self._window.append((hit, prompt))
        self._window_hit += hit
        self._window_prompt += prompt

    def _ensure(self, max_rid: int) -> None:
        size = self._phase.shape[0]
        if max_rid < size:
            return
        grow = max(max_rid + 1, size * 2)
        for name, fill in (("_phase", _NOT_LIVE), ("_lane", -1), ("_committed", 0), ("_allocated", 0),
                           ("_hit", 0), ("_prompt", -1), ("_counted", False)):
            old = getattr(self, name)
            arr = np.full(grow, fill, old.dtype)
            arr[:size] = old
            setattr(self, name, arr)


def timeline_records(snapshots: Iterable[StepSnapshot], builder: TimelineBuilder | None = None) -> Iterator[Record]:
    """Every record of ``snapshots`` (in step order), then the closing of open slices."""
    builder = builder or TimelineBuilder()
    for snap in snapshots:
        yield from builder.feed(snap)
    yield from builder.finish()
