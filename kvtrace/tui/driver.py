"""The replay driver: runs a source in one thread, takes commands, posts frames.

The dashboard's worker thread runs ``ReplayDriver.run()``; the UI thread only calls
``command(...)`` (a queue) and receives what the driver posts: ``Frame`` (coalesced:
at most ``fps`` a second while playing, one after every command), ``CellInfo``,
``RequestHistory`` and ``Failure``. A frame holds copies of the per-request columns
and a bounded view of the append-only timeline, so widgets read it while the
replay goes on. Nothing here imports Textual.

Playing paces the replay at ``speed`` times real (simulated) time, or as fast as it
goes (``speed`` None, the default).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtrace.errors import USER_ERRORS

if TYPE_CHECKING:
    from allocator.base import PoolCounters
    from kvtrace.state import ReplayState, StepEvent, Timeline
    from kvtrace.tui.pagemap import CellDetail, PageCells, SlotMap
    from kvtrace.tui.sources import ReplaySource

__all__ = ["SPEEDS", "CellInfo", "Failure", "Frame", "ReplayDriver", "RequestColumns", "RequestHistory"]

SPEEDS: tuple[float | None, ...] = (1.0, 10.0, 100.0, 1_000.0, 10_000.0, None)  # None: as fast as it goes
ALERT_KINDS = frozenset({"oom", "violation", "bad_op"})
MAX_HISTORY_STEPS = 50_000  # a request detail replays at most this many steps


@dataclass(frozen=True, slots=True)
class RequestColumns:
    """Copies of the per-request columns (index = request id) at one step."""

    phase: np.ndarray  # int8, -1: never seen
    allocated: np.ndarray  # int64 kv_allocated_len
    committed: np.ndarray  # int64 kv_committed_len
    protected: np.ndarray  # int64 cache_protected_len
    prefix_hit: np.ndarray  # int64
    admitted_step: np.ndarray  # int64, -1: not admitted
    ended_step: np.ndarray  # int64, -1: not ended
    page_size: int

    @classmethod
    def of(cls, state: ReplayState) -> RequestColumns:
        """Copy the columns of ``state`` up to the highest request id seen."""
        phase = state.column("phase")
        seen = np.flatnonzero(phase >= 0)
        n = int(seen[-1]) + 1 if seen.shape[0] else 0
        cols = {name: state.column(name)[:n].copy() for name in
                ("phase", "allocated", "committed", "protected", "prefix_hit", "admitted_step", "ended_step")}
        return cls(page_size=state.page_size, **cols)

    @property
    def size(self) -> int:
        return int(self.phase.shape[0])


@dataclass(frozen=True, slots=True)
class Frame:
    """What the screen shows at one instant of the replay."""

    seq: int
    step: int | None
    time_s: float
    pool: PoolCounters | None
    requests: RequestColumns
    timeline: Timeline  # append-only; read rows [:timeline_size] and events [:num_events]
    timeline_size: int
    num_events: int
    playing: bool
    speed: float | None  # the pace asked for (None: as fast as it goes)
    achieved_speed: float | None  # simulated seconds per wall second since the last frame
    done: bool
    released: frozenset[int] = frozenset()  # requests whose over-allocation was released since the last frame
    alerts: tuple[StepEvent, ...] = ()  # OOM / violation / bad-op events since the last frame
    page_cells: PageCells | None = None
    page_map_step: int | None = None
    selected_rid: int | None = None

    def peak(self) -> tuple[int, int] | None:
        """(step, used tokens) of the highest occupancy replayed so far."""
        return self.timeline.peak(self.timeline_size)

    def events(self) -> list[StepEvent]:
        """Events known at this frame (every step replayed so far, in step order)."""
        return self.timeline.events[: self.num_events]


@dataclass(frozen=True, slots=True)
class CellInfo:
    """Answer to a page-map cell selection."""

    step: int | None
    detail: CellDetail | None  # None: no slot positions (a state log)
    tokens: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RequestHistory:
    """One request's lengths step by step (for the detail chart) and its events."""

    rid: int
    steps: np.ndarray
    allocated: np.ndarray
    committed: np.ndarray
    events: list[StepEvent]
    clipped: bool  # only the last MAX_HISTORY_STEPS steps


@dataclass(frozen=True, slots=True)
class Failure:
    """An error raised inside the replay (the driver pauses)."""

    message: str


class ReplayDriver:
    """Owns a replay source and runs it in the calling thread (``run``).

    Args:
        source: what to replay.
        post: called (from the driver's thread) with each ``Frame``, ``CellInfo``,
            ``RequestHistory`` and ``Failure``.
        fps: frames a second while playing.
        map_interval_s: seconds between page-map updates while playing as fast as it
            goes (mapping a million-slot pool costs tens of milliseconds of the replay's
            time; bench/tui.py); a paced replay maps every 0.5 s, a paused one every step.
        play: start playing at once.
        clock: monotonic seconds (tests fix it).
    """

    def __init__(
        self,
        source: ReplaySource,
        post: Callable[[object], Any],
        *,
        fps: float = 20.0,
        map_interval_s: float = 5.0,
        play: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source = source
        self._post = post
        self._frame_s = 1.0 / fps
        self._map_interval_s = map_interval_s
        self._clock = clock
        self._queue: queue.SimpleQueue[tuple[str, tuple[Any, ...]]] = queue.SimpleQueue()
        self._stopped = threading.Event()
        self.playing = play
        self.speed_index = len(SPEEDS) - 1
        self.num_cells = 0
        self.selected_rid: int | None = None
        self.frames_posted = 0
        self.frames_acked = 0  # the UI sets it to the seq of the last frame it drew
        self._posted_at = -1e18
        self._slot_map: SlotMap | None = None
        self._cells: PageCells | None = None
        self._map_step: int | None = None
        self._map_at = -1e18
        self._last_step: int | None = None
        self._last_events = 0
        self._anchor: tuple[float, float] = (0.0, 0.0)  # (wall, simulated) where pacing started
        self._rate_at: tuple[float, float] | None = None

    # ------------------------------------------------------------------ UI-thread API
    def ack(self, seq: int) -> None:
        """The UI drew frame ``seq`` (while playing, the next frame waits for this, so
        the replay does not build frames nobody sees)."""
        self.frames_acked = max(self.frames_acked, seq)

    def command(self, name: str, *args: Any) -> None:
        """Queue a command: play, pause, toggle, step N, seek STEP, speed DELTA, cells N,
        select RID|None, cell INDEX, history RID, refresh."""
        self._queue.put((name, args))

    def stop(self) -> None:
        """Ask ``run`` to return (thread-safe)."""
        self._stopped.set()
        self._queue.put(("refresh", ()))

    @property
    def speed(self) -> float | None:
        return SPEEDS[self.speed_index]

    # ------------------------------------------------------------------ worker body
    def run(self) -> None:
        """Replay until ``stop()``: play, obey commands, post frames."""
        next_frame = self._clock()
        dirty = True
        self._anchor_now()
        while not self._stopped.is_set():
            running = self.playing and not self.source.done
            try:
                dirty |= self._drain(block=not running and not dirty)
                if self.playing and not self.source.done:
                    self._advance_until(next_frame)
            except USER_ERRORS as exc:
                self._fail(str(exc))
                dirty = True
            except Exception as exc:  # noqa: BLE001  a bug must not freeze the screen
                self._fail(f"internal error: {type(exc).__name__}: {exc}")
                dirty = True
            now = self._clock()
            if dirty or now >= next_frame:
                # While the UI still draws the last frame, replay on (for at most a second).
                behind = self.frames_acked < self.frames_posted and now < self._posted_at + 1.0
                if dirty or not behind:
                    self._post_frame()
                    self._posted_at = now
                    dirty = False
                next_frame = now + self._frame_s

    def _fail(self, message: str) -> None:
        self.playing = False
        self._post(Failure(message))

    def _drain(self, block: bool) -> bool:
        """Apply queued commands; True when any changed what is shown."""
        changed = False
        try:
            item = self._queue.get(timeout=0.5) if block else self._queue.get_nowait()
        except queue.Empty:
            return False
        while True:
            changed |= self._apply(*item)
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return changed

    def _apply(self, name: str, args: tuple[Any, ...]) -> bool:
        src = self.source
        if name == "play":
            self.playing = True
        elif name == "pause":
            self.playing = False
        elif name == "toggle":
            self.playing = not self.playing
        elif name == "step":
            self.playing = False
            n = int(args[0])
            if n > 0:
                for _ in range(n):
                    if src.step() is None:
                        break
            elif src.last is not None:
                src.seek(max(src.last.step + n, 0))
        elif name == "seek":
            self.playing = False
            src.seek(int(args[0]))
        elif name == "speed":
            self.speed_index = min(max(self.speed_index + int(args[0]), 0), len(SPEEDS) - 1)
        elif name == "cells":
            self.num_cells = int(args[0])
            self._map_step = None
        elif name == "select":
            self.selected_rid = args[0]
            self._map_step = None
        elif name == "cell":
            self._post(self._cell_info(int(args[0])))
            return False
        elif name == "history":
            self._post(self._history(int(args[0])))
        elif name != "refresh":
            raise ValueError(f"unknown driver command {name!r}")
        self._anchor_now()
        return True

    def _anchor_now(self) -> None:
        last = self.source.last
        self._anchor = (self._clock(), last.time_s if last is not None else 0.0)

    def _advance_until(self, deadline: float) -> None:
        """Replay steps until the frame deadline (as fast as it goes, or paced)."""
        src = self.source
        clock = self._clock
        speed = self.speed
        while True:
            now = clock()
            if now >= deadline:
                return
            if speed is not None and src.last is not None:
                target = self._anchor[1] + speed * (now - self._anchor[0])
                if src.last.time_s >= target:  # ahead of the pace: wait (commands wake us)
                    self._wait(deadline - now)
                    return
            if src.step() is None:
                return

    def _wait(self, seconds: float) -> None:
        try:
            item = self._queue.get(timeout=max(seconds, 0.0))
        except queue.Empty:
            return
        self._queue.put(item)  # handled by the next _drain (order kept: nothing else reads the queue)

    # ------------------------------------------------------------------ frames
    def _post_frame(self) -> None:
        src = self.source
        state = src.state
        last = src.last
        step = last.step if last is not None else None
        timeline = state.timeline
        now = self._clock()
        num_events = len(timeline.events)
        released: set[int] = set()
        if step is not None and (self._last_step is None or step > self._last_step):
            lo = timeline.event_index(self._last_step if self._last_step is not None else -1)
            for e in timeline.events[lo:timeline.event_index(step)]:
                if e.kind == "overalloc_release" and e.rid is not None:
                    released.add(e.rid)
        alerts = [e for e in timeline.events[self._last_events:num_events] if e.kind in ALERT_KINDS]
        self._last_events = max(self._last_events, num_events)
        achieved = None
        if last is not None:
            if self._rate_at is not None and now > self._rate_at[0] and self.playing:
                achieved = (last.time_s - self._rate_at[1]) / (now - self._rate_at[0])
            self._rate_at = (now, last.time_s)
        self._refresh_map(step, now)
        self._last_step = step
        self.frames_posted += 1
        self._post(
            Frame(
                seq=self.frames_posted,
                step=step,
                time_s=last.time_s if last is not None else 0.0,
                pool=last.pool if last is not None else None,
                requests=RequestColumns.of(state),
                timeline=timeline,
                timeline_size=timeline.size,
                num_events=num_events,
                playing=self.playing and not src.done,
                speed=self.speed,
                achieved_speed=achieved,
                done=src.done,
                released=frozenset(released),
                alerts=tuple(alerts),
                page_cells=self._cells,
                page_map_step=self._map_step,
                selected_rid=self.selected_rid,
            )
        )

    def _refresh_map(self, step: int | None, now: float) -> None:
        if self.num_cells <= 0 or step is None:
            return
        stale = self._map_step != step
        if not stale:
            return
        interval = self._map_interval_s if self.speed is None else min(self._map_interval_s, 0.5)
        if self.playing and not self.source.done and now - self._map_at < interval:
            return
        made = self.source.page_map(self.num_cells, self.selected_rid)
        self._slot_map, self._cells = (made if made is not None else (None, None))
        self._map_step = step
        self._map_at = now

    # ------------------------------------------------------------------ queries
    def _cell_info(self, index: int) -> CellInfo:
        from kvtrace.tui.pagemap import STATE_LABELS, cell_detail

        cells = self._cells
        if cells is None or not 0 <= index < cells.tokens.shape[0]:
            return CellInfo(self._map_step, None)
        tokens = {STATE_LABELS[s]: int(c) for s, c in enumerate(cells.tokens[index]) if c}
        if self._slot_map is None:
            return CellInfo(self._map_step, None, tokens)
        return CellInfo(self._map_step, cell_detail(self._slot_map, cells, index), tokens)

    def _history(self, rid: int) -> RequestHistory:
        """Replay the request's life (seeking back through checkpoints), then return."""
        src = self.source
        state = src.state
        here = src.last.step if src.last is not None else None
        try:
            row = state.row(rid)
        except KeyError:
            return RequestHistory(rid, np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), [], False)
        hi = row.ended_step if row.ended_step >= 0 else (here if here is not None else row.admitted_step)
        lo = row.admitted_step if row.admitted_step >= 0 else hi
        clipped = hi - lo > MAX_HISTORY_STEPS
        lo = max(lo, hi - MAX_HISTORY_STEPS)
        steps: list[int] = []
        alloc: list[int] = []
        used: list[int] = []
        snap = src.seek(lo - 1) if lo > 0 else src.seek(lo)
        while snap is not None and snap.step <= hi:
            if snap.step >= lo:
                hit = np.flatnonzero(snap.requests.rids == rid)
                if hit.shape[0]:
                    i = int(hit[0])
                    steps.append(snap.step)
                    alloc.append(int(snap.requests.allocated[i]))
                    used.append(int(snap.requests.committed[i]))
            snap = src.step()
        if here is not None:
            src.seek(here)
        events = [e for e in state.timeline.events if e.rid == rid]
        return RequestHistory(rid, np.array(steps, np.int64), np.array(alloc, np.int64), np.array(used, np.int64),
                              events, clipped)
