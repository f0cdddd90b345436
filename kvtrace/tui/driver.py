"""The screen's side of a replay: folds what the replayer sends into its own ``ReplayState``
and posts frames.

The dashboard's worker thread runs ``Driver.run()``; the UI thread only calls
``command(...)`` (queued to the replayer, never waiting for it) and ``ack(seq)``, and
receives what the driver posts: ``Frame`` (at most ``fps`` a second, and at most one
waiting while the screen draws another, until a second passed), ``CellInfo``, ``RequestHistory``,
``RequestExplanation`` and ``Failure``. The replayer (``kvtrace.tui.remote.replayer``, in its own process or a thread) runs
on regardless: the driver folds every record it sends, and the frames show the latest
fold. A frame holds copies of the per-request columns and a bounded view of the
append-only timeline, so widgets read it while the fold goes on. Nothing here imports
Textual.
"""

from __future__ import annotations

import operator
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from allocator.base import PoolCounters
from kvtrace.proc import contracts as wire
from kvtrace.replay.snapshot import FINISHED, PHASES, POOL_NAMES
from kvtrace.replay.state import ReplayState, SavedState, StepEvent
from kvtrace.tui.remote.pagemap import CellDetail, PageCells
from kvtrace.tui.remote.replayer import MAX_HISTORY_STEPS, SPEEDS
from kvtrace.tui.remote.sources import SourceInfo

# Frames a second at most while playing: above the 20 the screen is held to, so that a
# frame arriving a little late still leaves 20 a second (a ceiling of exactly 20 cannot).
DEFAULT_FPS = 24.0

if TYPE_CHECKING:
    from kvtrace.replay.state import Timeline
    from kvtrace.tui.remote.link import ReplayLink
    from kvtrace.replay.snapshot import SnapshotBlock

__all__ = ["ALERT_KINDS", "MAX_HISTORY_STEPS", "AchievedSpeed", "SPEEDS", "CellInfo", "Driver", "Failure", "Frame", "RequestColumns",
           "RequestExplanation", "RequestHistory"]

ALERT_KINDS = frozenset({"oom", "violation", "bad_op"})


class AchievedSpeed:
    """Simulated seconds replayed per wall second, over the frames of the last ``window_s``
    (frame to frame it jumps: a frame that brought a message but no step reads 0×)."""

    def __init__(self, window_s: float = 1.0) -> None:
        self.window_s = window_s
        self._marks: deque[tuple[float, float]] = deque()  # (wall, simulated) of the frames shown

    def reset(self) -> None:
        """Forget the frames so far (playing starts, or the replay jumped)."""
        self._marks.clear()

    def mark(self, wall: float, simulated: float) -> float | None:
        """Note a frame at ``wall`` showing ``simulated``; the speed over the window (None
        before a second frame)."""
        marks = self._marks
        marks.append((wall, simulated))
        while len(marks) > 2 and wall - marks[1][0] >= self.window_s:
            marks.popleft()
        first_wall, first_sim = marks[0]
        return (simulated - first_sim) / (wall - first_wall) if wall > first_wall else None


# The phases of a streaming session's turn in progress (a retracted turn comes back).
_SESSION_TURN = np.array([p in ("waiting", "prefill", "decode", "spec", "retracted") for p in PHASES])


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
    # int64 swa_evicted_seqlen (a model with a sliding-window pool); None: no SWA lengths
    swa_evicted: np.ndarray | None = None
    # int64 mamba_pool_idx, -1: none (a model with a Mamba pool); None: no Mamba slots
    mamba_slot: np.ndarray | None = None

    @classmethod
    def of(cls, state: ReplayState) -> RequestColumns:
        """Copy the columns of ``state`` up to the highest request id seen."""
        phase = state.column("phase")
        seen = np.flatnonzero(phase >= 0)
        n = int(seen[-1]) + 1 if seen.shape[0] else 0
        cols = {name: state.column(name)[:n].copy() for name in
                ("phase", "allocated", "committed", "protected", "prefix_hit", "admitted_step", "ended_step")}
        swa = state.column("swa_evicted")[:n].copy() if state.swa_lengths else None
        mamba = state.column("mamba_slot")[:n].copy() if state.mamba_slots else None
        return cls(page_size=state.page_size, swa_evicted=swa, mamba_slot=mamba, **cols)

    @property
    def size(self) -> int:
        return int(self.phase.shape[0])

    def held(self) -> np.ndarray:
        """Bool per request id: a streaming session held between turns (its turn ended,
        ``finished``, and its KV stayed: only a ``hold`` leaves a finished request any)."""
        return (self.phase == FINISHED) & (self.allocated > 0)

    def open_sessions(self) -> np.ndarray:
        """Bool per request id: a streaming session open now (held between turns, or in a
        later turn: one id per session, so a request that ended a turn before and holds KV
        again, or was retracted since, is a session's turn)."""
        again = (self.ended_step >= 0) & (self.phase >= 0) & _SESSION_TURN[np.maximum(self.phase, 0)]
        return self.held() | again


@dataclass(frozen=True, slots=True)
class Frame:
    """What the screen shows at one instant of the replay."""

    seq: int
    side: int  # which replay (0; a diff shows sides 0 and 1)
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
    page_map_note: str | None = None  # why there is no page map
    page_map_pool: int = 0  # the pool ``page_cells`` maps (an index into POOL_NAMES)
    selected_rid: int | None = None
    busy: str | None = None  # what the replay is busy with, answering no command meanwhile
    other_pools: tuple[PoolCounters, ...] = ()  # a hybrid model's pools after ``pool`` (``pool_names[1:]``)
    pool_names: tuple[str, ...] = POOL_NAMES  # the names of ``pool`` and ``other_pools``, in order
    died: str | None = None  # why the replay process went away before the screen quit (None: it did not)
    sessions: bool = False  # the trace has streaming sessions (``SourceInfo.sessions``)

    @property
    def pools(self) -> dict[str, PoolCounters]:
        """Every KV pool's counters at this step, by name (``pool_names``; empty before a step)."""
        if self.pool is None:
            return {}
        return dict(zip(self.pool_names, (self.pool, *self.other_pools)))

    def peak(self, pool: int = 0) -> tuple[int, int] | None:
        """(step, used tokens) of pool ``pool``'s highest occupancy replayed so far (an
        index into ``POOL_NAMES``)."""
        return self.timeline.peak(self.timeline_size, pool)

    def events(self) -> list[StepEvent]:
        """Events known at this frame (every step replayed so far, in step order)."""
        return self.timeline.events[: self.num_events]


@dataclass(frozen=True, slots=True)
class CellInfo:
    """Answer to a page-map cell selection."""

    side: int
    step: int | None
    detail: CellDetail | None  # None: no slot positions (a state log)
    tokens: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RequestHistory:
    """One request's lengths step by step (for the detail chart) and its events."""

    side: int
    rid: int
    steps: np.ndarray
    allocated: np.ndarray
    committed: np.ndarray
    events: list[StepEvent]
    clipped: bool  # only the last MAX_HISTORY_STEPS steps


@dataclass(frozen=True, slots=True)
class RequestExplanation:
    """One request's missed prefix tokens by cause (the replay's ``Explained``): the
    evictions whose tokens it missed are ``(step, trigger, evicting rid, batch size,
    tokens)``, most first; ``note`` says why there is nothing to show."""

    side: int
    rid: int
    missed: int
    causes: dict[str, int]
    evictions: list[tuple[int, str, int, int, int]]
    note: str | None = None


@dataclass(frozen=True, slots=True)
class Failure:
    """An error inside the replay (the replayer pauses), or the replay process gone; or,
    ``severity`` ``warning``, what the replay of a damaged input left out (it went on)."""

    side: int
    message: str
    severity: str = "error"


class _Position(NamedTuple):
    step: int
    time_s: float
    pool: PoolCounters
    other_pools: tuple[PoolCounters, ...] = ()


class Driver:
    """Folds one replayer's records and posts frames (``run`` is a worker thread's body).

    Args:
        link: the replayer (``link.ChildReplay`` or ``link.ThreadReplay``).
        post: called (from the driver's thread) with each ``Frame``, ``CellInfo``,
            ``RequestHistory``, ``RequestExplanation`` and ``Failure``.
        side: the side its items say they come from.
        fps: frames a second at most.
        clock: monotonic seconds (the achieved speed; tests fix it).
    """

    def __init__(
        self,
        link: ReplayLink,
        post: Callable[[object], Any],
        *,
        side: int = 0,
        fps: float = DEFAULT_FPS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.link = link
        self._post = post
        self.side = side
        self._frame_s = 1.0 / fps
        self._clock = clock
        self._stopped = threading.Event()
        self.started = threading.Event()  # run() began
        self.closed = threading.Event()  # run() returned and the replayer is gone
        self.info: SourceInfo | None = None
        self.state: ReplayState | None = None
        self.playing = False
        self.speed_index = len(SPEEDS) - 1
        self.done = False
        self.died: str | None = None  # why the replay went away unasked (``Frame.died``)
        self.busy: str | None = None
        self.selected_rid: int | None = None
        self.frames_posted = 0
        self.frames_acked = 0  # the UI sets it to the seq of the last frame it drew
        self.steps_folded = 0
        self._held: list[tuple[int, wire.Contract]] = []  # messages waiting for the records sent before them
        self._last: _Position | None = None
        self._pool_names: tuple[str, ...] = POOL_NAMES  # a hybrid replay's pools, as its blocks name them
        self._cells: PageCells | None = None
        self._map_step: int | None = None
        self._map_note: str | None = None
        self._map_pool = 0
        self._changed = False
        self._posted_at = -1e18
        self._due = -1e18  # when the next frame may be posted
        self._shown_step: int | None = None
        self._shown_events = 0
        self._speed = AchievedSpeed()
        # What each frame not yet drawn announced: a newer frame replaces it in the UI's
        # queue, so the next ones repeat it until the UI acknowledges one drawn after it.
        self._unacked: list[tuple[int, frozenset[int], tuple[StepEvent, ...]]] = []

    # ------------------------------------------------------------------ UI-thread API
    def command(self, name: wire.CommandName, arg: int | None = None) -> None:
        """Send a command to the replayer (see ``kvtrace.tui.remote.replayer``).

        Raises:
            ContractError: an unknown command, or a missing or unexpected argument.
        """
        command = wire.Command(name, None if arg is None else operator.index(arg))  # (a numpy int too)
        if name == "select":
            self.selected_rid = arg
        self.link.command(command)

    def ack(self, seq: int) -> None:
        """The UI drew frame ``seq`` (the next frame waits for this, or a second)."""
        self.frames_acked = max(self.frames_acked, seq)

    def stop(self) -> None:
        """Ask ``run`` to return (thread-safe); it then closes the replayer."""
        self._stopped.set()

    @property
    def speed(self) -> float | None:
        return SPEEDS[self.speed_index]

    # ------------------------------------------------------------------ worker body
    def run(self) -> None:
        """Fold and post until ``stop()``, then close the replayer."""
        self.started.set()
        try:
            self._loop()
        finally:
            self.link.close()
            self.closed.set()

    def _loop(self) -> None:
        link = self.link
        gone = False
        frame_s = self._frame_s
        while not self._stopped.is_set():
            wait = max(min(self._due - time.monotonic(), 0.1), 0.005)
            if gone:
                time.sleep(wait)
                item = None
            else:
                item = link.get(wait)
            deadline = time.monotonic() + frame_s
            while item is not None:
                gone |= self._take(item)
                if gone or time.monotonic() >= deadline:
                    break  # a frame is due: fold the rest after it
                item = link.get(0)
            now = time.monotonic()
            # One frame may wait while the screen draws another (a newer one replaces it
            # in the queue): the screen then finds the next frame ready when it is done.
            behind = self.frames_posted - self.frames_acked > 1 and now < self._posted_at + 1.0
            if self._changed and self.info is not None and now >= self._due and not behind:
                # Frames keep a cadence (a frame a little late does not delay the next),
                # without catching up on time the screen was idle or slow.
                self._due = max(self._due + frame_s, now + frame_s / 2)
                self._post_frame(now)

    def _take(self, item: tuple[str, Any]) -> bool:
        """Apply one item from the link; True when the replayer is gone."""
        kind, value = item
        if kind == "records":
            self._fold(value)
        elif kind == "msg":
            self._held.append(value)
        elif kind == "closed":
            self.done = self._changed = True
            self.playing = False
            self.died = value
            if value is not None:
                self._post(Failure(self.side, value))
            return True
        while self._held and self._held[0][0] <= self.steps_folded:
            self._message(self._held.pop(0)[1])
        return False

    def _fold(self, block: SnapshotBlock) -> None:
        state = self.state
        k = block.num_steps
        if state is not None and k:
            state.apply_block(block)
            if block.other_pool_names:
                self._pool_names = ("full", *block.other_pool_names)
            self._last = _Position(int(block.steps[-1]), float(block.times[-1]), block.pool(k - 1),
                                   block.other_pools_at(k - 1))
            self._changed = True
        self.steps_folded += k

    def _message(self, m: wire.Contract) -> None:
        if isinstance(m, wire.Info):
            self.info = SourceInfo(**{f: getattr(m, f) for f in SourceInfo.__dataclass_fields__})
            self.state = ReplayState(self.info.page_size)
        elif isinstance(m, wire.Busy):
            self.busy = m.what
        elif isinstance(m, wire.Status):
            self.playing, self.speed_index, self.done = bool(m.playing), int(m.speed_index), bool(m.done)
            if self.playing:
                self._speed.reset()
        elif isinstance(m, wire.Position):
            self._restore(m)
            self._speed.reset()  # simulated time jumped
        elif isinstance(m, wire.Cells):
            self._map_step = m.step
            self._map_note = m.note
            self._map_pool = int(m.pool)
            self._cells = None if m.note is not None else PageCells(
                np.asarray(m.edges), np.asarray(m.tokens), np.asarray(m.dominant), np.asarray(m.highlight),
                bool(m.positional), None if m.pinned is None else np.asarray(m.pinned))
        elif isinstance(m, wire.Cell):
            d = m.detail
            detail = None if d is None else CellDetail(d.index, d.first_page, d.last_page, d.tokens, list(d.owners),
                                                     list(d.pinned), list(d.last_users))
            self._post(CellInfo(self.side, m.step, detail, m.tokens))
            return
        elif isinstance(m, wire.History):
            events = [StepEvent(int(s), str(k), None if r is None else int(r), int(t), str(d)) for s, k, r, t, d in m.events]
            self._post(RequestHistory(self.side, int(m.rid), np.asarray(m.steps), np.asarray(m.allocated),
                                      np.asarray(m.committed), events, bool(m.clipped)))
            return
        elif isinstance(m, wire.Explained):
            evictions = [(int(s), str(t), int(r), int(b), int(n)) for s, t, r, b, n in m.evictions]
            self._post(RequestExplanation(self.side, int(m.rid), int(m.missed), dict(m.causes), evictions, m.note))
            return
        elif isinstance(m, wire.ReplayError):
            self.playing = False
            self._post(Failure(self.side, m.message))
        elif isinstance(m, wire.InputWarning):
            self._post(Failure(self.side, m.message, severity="warning"))
        self._changed = True

    def _restore(self, m: wire.Position) -> None:
        state = self.state
        if state is None:
            return
        pool = None if m.pool is None else PoolCounters(*(int(v) for v in m.pool))
        columns = {name: np.array(col) for name, col in m.columns.items()}
        # The position carries the full pool's counters; the other pools' at that step are
        # the timeline's (the records up to it were folded before this message).
        other: tuple[PoolCounters, ...] = ()
        timeline = state.timeline
        if m.step is not None and timeline.num_pools > 1:
            i = timeline.index_of(int(m.step))
            if i >= 0 and int(timeline.steps[i]) == m.step:
                other = timeline.pools_at(i)[1:]
        state.restore(SavedState(m.state_step, columns), pool, other)
        self._last = None if m.step is None or pool is None else _Position(int(m.step), float(m.time_s), pool, other)

    # ------------------------------------------------------------------ frames
    def _post_frame(self, now: float) -> None:
        """Post the frame of the fold now (``now``: monotonic seconds)."""
        state = self.state
        assert state is not None
        last = self._last
        step = last.step if last is not None else None
        timeline = state.timeline
        num_events = len(timeline.events)
        released: set[int] = set()
        if step is not None and (self._shown_step is None or step > self._shown_step):
            lo = timeline.event_index(self._shown_step if self._shown_step is not None else -1)
            for e in timeline.events[lo:timeline.event_index(step)]:
                if e.kind == "overalloc_release" and e.rid is not None:
                    released.add(e.rid)
        alerts = [e for e in timeline.events[self._shown_events:num_events] if e.kind in ALERT_KINDS]
        self._shown_events = max(self._shown_events, num_events)
        self._unacked = [u for u in self._unacked if u[0] > self.frames_acked]
        self._unacked.append((self.frames_posted + 1, frozenset(released), tuple(alerts)))
        released = set().union(*(u[1] for u in self._unacked))
        alerts = [e for u in self._unacked for e in u[2]]
        achieved = None
        if last is not None:
            speed = self._speed.mark(self._clock(), last.time_s)
            achieved = speed if self.playing else None
        self._shown_step = step
        self.frames_posted += 1
        self._posted_at = now
        self._changed = False
        self._post(
            Frame(
                seq=self.frames_posted,
                side=self.side,
                step=step,
                time_s=last.time_s if last is not None else 0.0,
                pool=last.pool if last is not None else None,
                other_pools=last.other_pools if last is not None else (),
                pool_names=self._pool_names,
                requests=RequestColumns.of(state),
                timeline=timeline,
                timeline_size=timeline.size,
                num_events=num_events,
                playing=self.playing and not self.done,
                speed=self.speed,
                achieved_speed=achieved,
                done=self.done,
                released=frozenset(released),
                alerts=tuple(alerts),
                page_cells=self._cells,
                page_map_step=self._map_step,
                page_map_note=self._map_note,
                page_map_pool=self._map_pool,
                selected_rid=self.selected_rid,
                busy=self.busy,
                died=self.died,
                sessions=self.info is not None and self.info.sessions,
            )
        )
