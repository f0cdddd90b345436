"""The replay side of the dashboard: runs a source, obeys the screen's commands, streams
the snapshots of the steps it replays and answers the screen's questions.

It runs in a process of its own (``python -m kvtrace.tui.remote.process``, started
by ``link.ChildReplay``), so that the replay has one core while the screen draws on the
other, or in a thread (``link.ThreadReplay``). Nothing here imports Textual.

What it sends (``link.ReplayerEnd``), in order:

* records: the steps replayed while playing or stepping, and every step replayed for
  the first time (the screen's timeline is append-only), as a ``SnapshotBlock`` every
  ``batch_s`` (``kvtrace.tui.remote.updates``); the screen folds them into its own
  ``ReplayState``. Steps
  replayed again inside a seek are not sent: the ``position`` message replaces them;
* messages (``kvtrace.proc.contracts``):
  ``Info`` (first: ``SourceInfo``'s fields),
  ``Status`` (``playing``, ``speed_index``, ``done``; when it changes),
  ``Busy`` (what it is busy with, answering no command meanwhile),
  ``Position`` (after a seek: ``step``, ``time_s``, ``pool``, the per-request
  ``columns`` of ``ReplayState.save()``),
  ``Cells`` (the page map of pool ``pool`` at ``step``: ``edges``, ``tokens``, ``dominant``,
  ``highlight``, ``positional``; or a ``note`` saying why there is none),
  ``Cell`` (a clicked cell: ``step``, ``tokens``, ``detail``),
  ``History`` (a request's lengths step by step and its events),
  ``Explained`` (a request's missed prefix tokens by cause, with explain on),
  ``ReplayError`` (an error inside the replay: the replayer pauses),
  ``InputWarning`` (once the replay is done: what it left out of a damaged input).

Commands (``contracts.Command``): play, pause, toggle, step N (N < 0: back), seek STEP,
speed DELTA (an index into ``SPEEDS``), cells N (the page map's size), pool P (the page
map's pool: an index into ``POOL_NAMES``), select RID|None, cell INDEX, history RID,
explain RID, refresh, quit.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtrace.errors import USER_ERRORS
from kvtrace.proc.contracts import (
    Busy, Cell, CellDetail, Cells, Command, DashboardJob, Explained, History, Info, InputWarning, Position, ReplayError,
    SideJob, Status,
)
from kvtrace.replay.snapshot import SnapshotBlock

if TYPE_CHECKING:
    from allocator.ownership import SlotOwnership
    from kvtrace.replay.snapshot import StepSnapshot
    from kvtrace.tui.remote.link import ReplayerEnd
    from kvtrace.tui.remote.pagemap import LastUsers, PageCells
    from kvtrace.tui.remote.sources import ReplaySource

__all__ = ["CHECKER_NICE", "CHECKPOINT_EVERY", "FILLING", "FIRST_PASS_S", "MAX_HISTORY_STEPS", "SPEEDS", "Replayer", "dashboard_job", "job_source", "live_source", "log_job"]

SPEEDS: tuple[float | None, ...] = (1.0, 10.0, 100.0, 1_000.0, 10_000.0, None)  # None: as fast as it goes
MAX_HISTORY_STEPS = 50_000  # a request detail replays at most this many steps
PACED_MAP_S = 0.5  # page-map cadence while playing at a pace
# At full speed the page maps take at most this share of the replay's own CPU time (its
# thread's: Replayer's work_clock): the interval between two grows to the last map's cost
# over it where mapping is slow (a slower machine, a bigger pool).
MAP_SHARE = 0.01
# The replay's op-sequence checker runs at a lower priority beside a screen: on two cores
# the replay (a core), the screen (half a core) and the checker (a third of one) want more
# than the machine has, and the checker, which runs ahead, can wait (bench/tui.py;
# bench/RESULTS.md).
CHECKER_NICE = 10
CHECKPOINT_EVERY = 2000  # steps between a dashboard's seek checkpoints once filled in
# What the screen's header says while the replay fills in checkpoints where it stopped
# playing (up to some FIRST_PASS_S of replay, during which it answers no command).
FILLING = "making going back quick"
# The first pass takes one once this many seconds of the replay's own CPU time have passed
# since the last (ReplaySession's first_pass_seconds); a seek back fills in the rest on its
# way, and so does the replayer where it stops playing: the first seek far back replays
# some FIRST_PASS_S seconds, whatever a step costs in that trace. A checkpoint holds the
# live rows and the radix tree's arrays (which the live tree drops later), and most of what
# it costs the replay comes after it is taken (fresh memory): so the first pass takes them
# by the replay's time, few of them, rather than every so many steps (bench/RESULTS.md).
FIRST_PASS_S = 2.5


class Replayer:
    """Runs ``source`` until the screen says quit (or goes away).

    Args:
        source: what to replay.
        end: the link to the screen.
        play: start playing at once.
        open_at_first: paused, show the first step at once (``kvtrace view``: a screen
            of empty panels read as broken) rather than wait before it.
        batch_s: seconds between record batches (and status checks) while playing:
            shorter than the screen's frame (20 a second), so that each frame has steps
            to show that the one before did not.
        map_interval_s: seconds between page maps while playing as fast as it goes
            (mapping a large pool costs the replay's time; bench/ownership.py),
            or more: at most ``MAP_SHARE`` of the time goes to
            them; a paced replay maps every ``PACED_MAP_S``, a paused one at every
            step shown.
        clock: monotonic seconds.
        work_clock: the replay's own seconds (its thread's CPU time): at full speed the
            page maps' share is counted in them, so that a replay waiting for a CPU (a
            busy machine, a screen in the same process) does not map more often for it.
    """

    def __init__(
        self,
        source: ReplaySource,
        end: ReplayerEnd,
        *,
        play: bool = True,
        open_at_first: bool = False,
        batch_s: float = 0.03,
        map_interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        work_clock: Callable[[], float] = time.thread_time,
    ) -> None:
        self.source = source
        self.end = end
        self.playing = play
        self._open_at_first = open_at_first and not play
        self.speed_index = len(SPEEDS) - 1
        self.num_cells = 0
        self.map_pool = 0  # the pool the page map shows (an index into POOL_NAMES)
        self.selected_rid: int | None = None
        self._batch_s = batch_s
        self._map_interval_s = map_interval_s
        self._clock = clock
        self._work_clock = work_clock
        self._buf: list[StepSnapshot] = []
        self._frontier: int | None = None  # the highest step sent
        self._own: SlotOwnership | None = None
        self._cells: PageCells | None = None
        # per pool: the last request seen locking each radix node (for evictable pages' owners)
        self._last_users: dict[int, LastUsers] = {}
        self._map_key: tuple[Any, ...] | None = None  # (step, num_cells, pool, rid) of the map sent
        self._map_at = -1e18  # (clock) when the last page map was made
        self._map_work_at = -1e18  # (work_clock) when the last page map was made
        self._map_cost_s = 0.0  # what the last page map took (work_clock)
        self._status: tuple[Any, ...] | None = None
        self._end_noted = False  # the source's end note (a damaged input) was asked for
        self._anchor: tuple[float, float] = (0.0, 0.0)  # (wall, simulated) where pacing started
        self._filled = True  # checkpoints were filled in where the replay last stopped playing
        # (once it stops playing, going back from there is made quick: the first pass
        # leaves them sparse; ReplaySession.fill_checkpoints)

    @property
    def speed(self) -> float | None:
        return SPEEDS[self.speed_index]

    @property
    def moving(self) -> bool:
        """Playing, and not at the end."""
        return self.playing and not self.source.done

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        """Replay and answer until ``quit`` (or the screen goes away)."""
        self.end.send(Info(**dataclasses.asdict(self.source.info)))
        if self._open_at_first and self.source.last is None:
            snap = self._guarded(self.source.step)
            if snap is not None:
                self._send_step(snap)
        self._anchor_now()
        due: float | None = self._clock()
        while due is not None:
            due = self.turn(due)

    def turn(self, due: float) -> float | None:
        """One turn of ``run``'s loop: obey the screen's commands, play until ``due`` (or
        bring the allocator to the step shown), publish what is due; the next ``due``, or
        None once the screen says quit (or has gone away)."""
        if self._guarded(self._obey, due):  # True: quit
            self._flush()
            return None
        now = self._clock()
        if now >= due or not self.moving:
            self._publish(now)
            due = now + self._batch_s
        if not self._filled and not self.moving:
            self._filled = True  # once where it stopped (ReplaySession.fill_checkpoints)
            fill = getattr(self.source, "fill_checkpoints", None)
            if fill is not None:
                self.end.send(Busy(FILLING))
                self._guarded(fill, during=" while filling in checkpoints")
                self.end.send(Busy(None))
        return due

    def _obey(self, due: float) -> bool:
        """Apply the screen's commands, then play until ``due`` or bring the allocator to
        the step shown; True when the screen says quit (or has gone away)."""
        commands = self.end.commands(0.0 if self.moving else 0.25)
        if commands is None or any(c.name == "quit" for c in commands):
            return True
        for command in commands:
            self._apply(command)
        if self.moving:
            self._advance(due)
        else:
            self._exact()
        return False

    def _guarded(self, call: Callable[..., Any], *args: object, during: str = "") -> Any:
        """``call(*args)``; an error inside it pauses the replay and is reported (a bug
        must not freeze the screen), and None is returned."""
        try:
            return call(*args)
        except USER_ERRORS as exc:
            self._fail(str(exc))
        except Exception as exc:  # noqa: BLE001
            self._fail(f"internal error{during}: {type(exc).__name__}: {exc}")
        return None

    def _publish(self, now: float) -> None:
        """Send what the screen has not seen: records, the play state, the page map."""
        self._flush()
        status = (self.moving, self.speed_index, self.source.done)
        if status != self._status:
            if status[2] and not self._end_noted:
                self._end_noted = True
                note = self.source.end_note
                if note is not None:
                    self.end.send(InputWarning(note))
            self._status = status
            self.end.send(Status(*status))
        self._guarded(self._refresh_map, now, during=" while mapping the pool")

    def _fail(self, message: str) -> None:
        self.playing = False
        self._flush()
        self.end.send(ReplayError(message))

    def _anchor_now(self) -> None:
        last = self.source.last
        self._anchor = (self._clock(), last.time_s if last is not None else 0.0)

    def _send_step(self, snap: StepSnapshot) -> None:
        self._buf.append(snap)
        if self._frontier is None or snap.step > self._frontier:
            self._frontier = snap.step

    def _flush(self) -> None:
        """Send the steps buffered as one block (the session's own when it made one of
        exactly these steps: ``take_block``, its rows a decode run overwrites left out;
        steps replayed again inside a seek are not among those sent)."""
        buf = self._buf
        if not buf:
            return
        take = getattr(self.source, "take_block", None)
        block = take() if take is not None else None
        if block is None or block.num_steps != len(buf) or int(block.steps[0]) != buf[0].step \
                or int(block.steps[-1]) != buf[-1].step:
            block = SnapshotBlock.of(buf)
        self.end.records(block)
        self._buf = []

    def _exact(self) -> None:
        """Bring the allocator to the step shown and keep it there (paused: the page map,
        a cell's owners and stepping are exact): the steps of a run it replayed ahead
        are shown first (the pause lands at the end of the run)."""
        src = self.source
        src.set_exact(True)
        while src.last is not None and (src.allocator_step or 0) > src.last.step:
            snap = src.step()
            if snap is None:
                break
            self._send_step(snap)

    def _advance(self, deadline: float) -> None:
        """Replay steps until ``deadline`` (as fast as it goes, or at the pace asked; runs
        of decode steps in one allocator call, as ``kvtrace replay`` does)."""
        src = self.source
        src.set_exact(False)
        self._filled = False
        clock = self._clock
        speed = self.speed
        while True:
            now = clock()
            if now >= deadline:
                return
            if speed is not None and src.last is not None:
                target = self._anchor[1] + speed * (now - self._anchor[0])
                if src.last.time_s >= target:  # ahead of the pace
                    time.sleep(max(deadline - now, 0.0))
                    return
            snap = src.step()
            if snap is None:
                return
            self._send_step(snap)

    # ------------------------------------------------------------------ commands
    def _apply(self, command: Command) -> None:
        src = self.source
        name, arg = command.name, command.arg
        if name in ("step", "seek", "cell", "history"):
            self._exact()
        if name == "play":
            self.playing = True
        elif name == "pause":
            self.playing = False
        elif name == "toggle":
            self.playing = not self.playing
        elif name == "step":
            self.playing = False
            n = int(arg or 0)
            if n > 0:
                for _ in range(n):
                    snap = src.step()
                    if snap is None:
                        break
                    self._send_step(snap)
            elif src.last is not None:
                self._seek(max(src.last.step + n, 0))
        elif name == "seek":
            self.playing = False
            self._seek(int(arg or 0))
        elif name == "speed":
            self.speed_index = min(max(self.speed_index + int(arg or 0), 0), len(SPEEDS) - 1)
        elif name == "cells":
            self.num_cells = int(arg or 0)
        elif name == "pool":
            self.map_pool = max(int(arg or 0), 0)
        elif name == "select":
            self.selected_rid = arg
        elif name == "cell":
            self._flush()
            self.end.send(self._cell_message(int(arg or 0)))
        elif name == "history":
            self._flush()
            self.end.send(self._history_message(int(arg or 0)))
        elif name == "explain":
            self.end.send(self._explain_message(int(arg or 0)))
        elif name != "refresh":
            raise ValueError(f"unknown dashboard command {name!r}")
        self._anchor_now()

    def _seek(self, target: int) -> None:
        """Go to ``target``; steps past the frontier are replayed and sent (the screen's
        timeline must hold every step), the others are not: ``position`` says where
        the replay now is, with the per-request columns there."""
        self._flush()  # the steps sent are the session's block: before it moves
        src = self.source
        frontier = self._frontier
        if frontier is not None and target <= frontier:
            src.seek(target)
        else:
            if frontier is not None and (src.last is None or src.last.step < frontier):
                src.seek(frontier)
            flush_at = self._clock() + self._batch_s
            while not src.done and (src.last is None or src.last.step < target):
                snap = src.step()
                if snap is None:
                    break
                self._send_step(snap)
                if self._clock() >= flush_at:  # the screen shows a long seek's progress
                    self._flush()
                    flush_at = self._clock() + self._batch_s
        self._flush()
        self.end.send(self._position_message())

    def _position_message(self) -> Position:
        src = self.source
        last = src.last
        saved = src.state.save()
        phase = saved.columns["phase"]
        seen = np.flatnonzero(phase >= 0)
        n = int(seen[-1]) + 1 if seen.shape[0] else 0
        return Position(
            step=None if last is None else last.step,
            time_s=0.0 if last is None else last.time_s,
            pool=None if last is None else tuple(int(v) for v in last.pool),
            state_step=saved.step,
            columns={name: col[:n] for name, col in saved.columns.items()},
        )

    # ------------------------------------------------------------------ page map
    def _refresh_map(self, now: float) -> None:
        last = self.source.last
        if self.num_cells <= 0 or last is None:
            return
        key = (last.step, self.num_cells, self.map_pool, self.selected_rid)
        if key == self._map_key:
            return
        moving = self.moving
        work_now = self._work_clock()
        if self.speed is None:  # at most MAP_SHARE of the replay's own time
            if moving and work_now - self._map_work_at < max(self._map_interval_s, self._map_cost_s / MAP_SHARE):
                return
        elif moving and now - self._map_at < min(self._map_interval_s, PACED_MAP_S):
            return
        if self._map_key is not None and self._own is not None and self._cells is not None and key[:3] == self._map_key[:3]:
            from kvtrace.tui.remote.pagemap import highlight_cells, pinned_cells  # only the selection changed

            mark = highlight_cells(self._own, self._cells.ownership_cells, self.selected_rid)
            pins = pinned_cells(self._own, self._cells.ownership_cells, self.selected_rid)
            self._cells = self._cells._replace(highlight=mark, pinned=pins)
        else:
            made = self.source.page_map(self.num_cells, self.selected_rid, self.map_pool)
            self._map_cost_s = self._work_clock() - work_now
            self._own, self._cells = made if made is not None else (None, None)
            if self._own is not None:
                users = self._users(self.map_pool)
                if self._map_key is not None and last.step < self._map_key[0]:
                    users.clear()  # sought back: what was seen later is not "last" here
                users.see(self._own)
        self._map_key = key
        self._map_at, self._map_work_at = now, work_now
        if self._cells is None:
            from kvtrace.tui.remote.pagemap import NO_MAMBA_PAGE_MAP, NO_PAGE_MAP, NO_SWA_PAGE_MAP

            note = NO_PAGE_MAP
            if self.map_pool:
                names = ("full", *last.other_pool_names)
                mamba = self.map_pool < len(names) and names[self.map_pool] == "mamba"
                note = NO_MAMBA_PAGE_MAP if mamba else NO_SWA_PAGE_MAP
            self.end.send(Cells(last.step, note=note, pool=self.map_pool))
            return
        c = self._cells
        step = self.source.allocator_step  # while playing, up to a run's length past ``last``
        self.end.send(Cells(step, c.edges, c.tokens, c.dominant, c.highlight, bool(c.positional), pool=self.map_pool,
                            pinned=c.pinned))

    def _users(self, pool: int) -> LastUsers:
        """The last lockers seen of pool ``pool``'s radix nodes."""
        users = self._last_users.get(pool)
        if users is None:
            from kvtrace.tui.remote.pagemap import LastUsers

            users = self._last_users[pool] = LastUsers()
        return users

    def _cell_message(self, index: int) -> Cell:
        from kvtrace.tui.remote.pagemap import STATE_LABELS, cell_detail

        step = None if self._map_key is None else self._map_key[0]
        cells = self._cells
        if cells is None or not 0 <= index < cells.tokens.shape[0]:
            return Cell(step, {}, None)
        tokens = {STATE_LABELS[s]: int(c) for s, c in enumerate(cells.tokens[index]) if c}
        detail = None
        if self._own is not None:
            d = cell_detail(self._own, cells, index, last_users=self._users(self.map_pool))
            detail = CellDetail(int(d.index), int(d.first_page), int(d.last_page), dict(d.tokens),
                                [(int(r), int(n)) for r, n in d.owners], [(int(r), int(n)) for r, n in d.pinned],
                                [(int(r), int(n)) for r, n in d.last_users])
        return Cell(step, tokens, detail)

    # ------------------------------------------------------------------ explain
    def _explain_message(self, rid: int) -> Explained:
        """Request ``rid``'s missed tokens by cause over its admissions replayed so far."""
        attribution = getattr(self.source, "explain", None)
        if attribution is None:
            return Explained(rid, note="explain is off: start the dashboard with kvtrace replay TRACE --tui --explain")
        causes = attribution.per_request.get(rid)
        if causes is None:
            return Explained(rid, note=f"request {rid} has not been admitted in the steps replayed so far")
        evictions = [(r.step, r.trigger, r.rid, r.batch_size, n) for r, n in attribution.evictions_of(rid)]
        return Explained(rid, sum(causes.values()), dict(causes), evictions)

    # ------------------------------------------------------------------ request history
    def _history_message(self, rid: int) -> History:
        """Replay the request's life (seeking back through checkpoints), then come back."""
        src = self.source
        state = src.state
        here = src.last.step if src.last is not None else None
        empty = History(rid, np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), [], False)
        try:
            row = state.row(rid)
        except KeyError:
            return empty
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
            if self._frontier is not None and snap.step >= self._frontier:
                break  # past what the screen knows: stop here
            snap = src.step()
        if here is not None:
            src.seek(here)
        # the timeline holds every step replayed, past the one shown after a seek back
        upto = here if here is not None else hi
        events = [tuple(e) for e in state.timeline.events if e.rid == rid and e.step <= upto]
        return History(rid, np.array(steps, np.int64), np.array(alloc, np.int64), np.array(used, np.int64), events,
                       clipped)


# ---------------------------------------------------------------------------- child process jobs


def dashboard_job(
    version: Any,
    trace: str,
    *,
    trace_label: str,
    play: bool,
    checkpoint_every: int = CHECKPOINT_EVERY,
    first_pass_every: int | None = None,
    first_pass_seconds: float | None = FIRST_PASS_S,
    log: str | None = None,
    explain: bool = False,
    **side: Any,
) -> DashboardJob:
    """The job of a live dashboard's replay process (``kvtrace.tui.remote.process``): a diff side's job
    (``kvtrace.diff.sides.side_job``: trace, version, and ``side``: the device, the replay
    options and the what-ifs) plus the dashboard's settings; ``log``: a state log to write
    every step replayed for the first time to; ``checkpoint_every`` / ``first_pass_every`` /
    ``first_pass_seconds``: the session's (``ReplaySession``; a dashboard's by default;
    ``first_pass_every``, when given, replaces the seconds); ``explain``: attribute every
    admission's missed tokens (the ``explain`` command; ``kvtrace.explain``)."""
    from kvtrace.diff.sides import side_job

    job = side_job(version, trace, trace_label=trace_label, **side)
    if first_pass_every is not None:
        first_pass_seconds = None
    return DashboardJob(play=play, side=job, checkpoint_every=checkpoint_every, first_pass_every=first_pass_every,
                        first_pass_seconds=first_pass_seconds, log=log, explain=explain)


def log_job(path: str, *, label: str | None = None, play: bool = False) -> DashboardJob:
    """The job of a dashboard's process over a saved state log (no allocator)."""
    return DashboardJob(play=play, state_log=str(path), label=label)


def job_source(job: DashboardJob) -> ReplaySource:
    """The source a dashboard's replay process runs for ``job`` (a state log's, or a live
    replay's), set up to last as long as the process."""
    import gc

    source = _log_source(job) if job.state_log is not None else live_source(job)
    # What the set-up made (modules, the trace's reader, the allocator) lives as long as
    # this process: out of the collector's sight, so that the full collections the replay's
    # snapshots set off do not walk it again each time.
    gc.freeze()
    return source


def _log_source(job: DashboardJob) -> ReplaySource:
    from kvtrace.statelog.session import StateLogSession
    from kvtrace.tui.remote.sources import LogSource

    assert job.state_log is not None
    return LogSource(StateLogSession(job.state_log), label=job.label)


def live_source(job: DashboardJob) -> ReplaySource:
    from kvtrace.proc.child import job_checker, job_version
    from kvtrace.replay.engine import ReplayOptions
    from kvtrace.replay.session import ReplaySession
    from kvtrace.statelog.log import replay_log_writer
    from kvtrace.tui.remote.sources import LiveSource

    side: SideJob | None = job.side
    assert side is not None
    options = ReplayOptions(**side.options)
    session = ReplaySession(
        side.trace, version=job_version(side), page_size=side.page_size, pool_tokens=side.pool_tokens,
        device=side.device, options=options, checker=job_checker(side, options), label=side.trace_label,
        checkpoint_every=job.checkpoint_every, first_pass_every=job.first_pass_every,
        first_pass_seconds=job.first_pass_seconds, eviction_policy=side.eviction_policy,
        hicache_ratio=side.hicache_ratio, hicache_write_policy=side.hicache_write_policy,
        track_state=True, allocator_in_step=True,
        checker_nice=CHECKER_NICE,
    )
    log = None
    if job.log:
        try:
            log = replay_log_writer(job.log, session, side.trace_label or side.trace)
        except BaseException:
            session.close()
            raise
    try:
        return LiveSource(session, log, explain=job.explain)
    except BaseException:
        if log is not None:
            log.close()
        session.close()
        raise
