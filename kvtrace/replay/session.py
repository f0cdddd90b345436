"""The replay session: one trace through one allocator version, the library entry of
every consumer (the ``replay`` command, the dashboard, diff, shrink, sweeps).

A session is built from a trace, a version spec and what-if overrides; it decides
the effective configuration once (``kvtrace.replay.config.effective_config``), checks
every step for impossible ops (in a child process by default), drives the
``ReplayEngine`` step by step and yields one ``StepSnapshot`` per step::

    with ReplaySession("sample:tiny", version="paged:16", checkpoint_every=500) as s:
        for snap in s.snapshots():      # or s.step(), one at a time
            ...
        s.seek(120)                     # any step, forwards or backwards
        result = s.result()             # the summary (kvtrace replay --json)

Seek: with ``checkpoint_every=K`` going to any step replays at most K steps from a
checkpoint (``kvtrace.replay.checkpoints`` says when they are taken and what they
hold). Steps replayed once are checked once: going back re-uses their checks.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from allocator.base import Checkpointable, Digestible
from kvtrace.replay.config import check_memory, effective_config, replay_names
from kvtrace.errors import ConfigError, VersionSpecError
from kvtrace.versions.registry import AllocatorVersion, resolve_version
from kvtrace.replay.checkpoints import Checkpoint, Checkpointing
from kvtrace.replay.engine import ReplayEngine, ReplayOptions, StepChecker
from kvtrace.replay.result import ReplayResult
from kvtrace.replay.step_checker import RecordedChecker
from kvtrace.replay.snapshot import SnapshotBlock
from kvtrace.replay.state import ReplayState
from traces.chunks import StepChunk
from traces.ipc import ResumePoint
from traces.reader import TraceReader
from traces.runs import run_lengths
from traces.schema import DECODE, SPEC

if TYPE_CHECKING:
    from allocator.base import Allocator
    from kvtrace.replay.snapshot import StepSnapshot

__all__ = ["ReplaySession", "open_trace"]

CheckerMode = Literal["background", "inline"]
DEFAULT_CHECKPOINT_BUDGET = 1 << 30
MIN_RUN_STEPS = 2  # shorter runs of plain decode steps are replayed step by step
_NO_STEPS = np.zeros(0, np.int64)
TRUNCATED_NOTE = "the trace was cut short; replayed every complete step"
# Steps replayed before they go into a block, and steps gathered in blocks before the
# state folds them (it also folds whenever it is read): much of a fold's cost is per call,
# so it folds many steps at a time.
_FOLD_STEPS = 1024


def open_trace(spec: str | Path) -> TraceReader:
    """Open a trace argument (a path or ``sample:NAME``), validating it once.

    Raises:
        TraceError: the file cannot be read or breaks the format (one clear line).
    """
    from traces.samples import resolve_trace

    return TraceReader(resolve_trace(str(spec)))


class ReplaySession(Checkpointing):
    """One replay of a trace through one allocator version.

    Args:
        trace: a path, ``sample:NAME``, or an open ``TraceReader``.
        version: an allocator version spec (``kvtrace.versions.registry``) or a resolved one.
        page_size: what-if page size (conflicts with a version that fixes another).
        pool_tokens: what-if pool size (rounded down to whole pages).
        eviction_policy: what-if radix eviction policy (None: the trace's).
        hicache_ratio, hicache_write_policy: what-if host tier (None: the trace's; either turns it on).
        device: ``cpu`` or ``cuda``.
        options: checks, OOM and bad-op handling, the ``--steps`` window.
        checkpoint_every: save a checkpoint every this many replayed steps (None:
            none; ``seek`` backwards then replays from the start).
        first_pass_every: the interval for steps replayed for the first time
            (default: ``checkpoint_every``); seeks back fill in the rest.
        first_pass_seconds: instead of ``first_pass_every``: steps replayed for the
            first time take a checkpoint once this many seconds of ``work_clock``
            have passed since the last one (and at least ``checkpoint_every`` steps).
        work_clock: the replay's own seconds for ``first_pass_seconds`` (default: its
            thread's CPU time, which a replay stopped or waiting for a CPU does not
            spend).
        checkpoint_budget: bytes the checkpoints may hold.
        checker: check steps in a child process (``background``) or here (``inline``),
            or the ``checker`` of another session of the same trace that runs
            ahead of this one (lockstep: each step is checked once; that session owns it).
        checker_nice: lower the ``background`` checker's priority by this much
            (``os.nice``): a replay that shares the machine with a dashboard lets the
            dashboard and itself go first (the checker runs ahead in the gaps).
        track_state: keep the per-request ``ReplayState`` fold (``state``).
        allocator_in_step: keep the allocator's state that of the step last returned,
            for callers that query it between steps (slot ownership, a request's
            slots). Off, a run of decode steps may be replayed in one allocator call
            ahead of the snapshots returned (``allocator_step`` says where it is).
        label: how reports name the trace (default: the argument as given).
        force_memory: build the pool even when ``kvtrace.replay.config.check_memory`` finds
            it bigger than the machine's available memory.

    Raises:
        TraceError: the trace cannot be read.
        VersionSpecError: the version does not resolve or its factory fails.
        ConfigError: conflicting options, a configuration no allocator takes, or one
            the machine's memory cannot hold (without ``force_memory``).
    """

    def __init__(
        self,
        trace: str | Path | TraceReader,
        *,
        version: str | AllocatorVersion = "builtin",
        page_size: int | None = None,
        pool_tokens: int | None = None,
        device: str = "cpu",
        eviction_policy: str | None = None,
        hicache_ratio: float | None = None,
        hicache_write_policy: str | None = None,
        options: ReplayOptions | None = None,
        checkpoint_every: int | None = None,
        first_pass_every: int | None = None,
        first_pass_seconds: float | None = None,
        checkpoint_budget: int = DEFAULT_CHECKPOINT_BUDGET,
        checker: CheckerMode | StepChecker = "background",
        checker_nice: int = 0,
        track_state: bool = False,
        allocator_in_step: bool = False,
        label: str | None = None,
        clock: Callable[[], float] = time.perf_counter,
        work_clock: Callable[[], float] = time.thread_time,
        force_memory: bool = False,
    ) -> None:
        if checkpoint_every is not None and checkpoint_every < 1:
            raise ConfigError(f"checkpoint interval must be >= 1 step, found {checkpoint_every}")
        if first_pass_every is not None and checkpoint_every is not None and first_pass_every < checkpoint_every:
            raise ConfigError(f"first-pass checkpoint interval ({first_pass_every}) must be >= the checkpoint interval "
                              f"({checkpoint_every})")
        if first_pass_seconds is not None:
            if first_pass_every is not None:
                raise ConfigError("give the first pass's checkpoint interval in steps or in seconds, not both")
            if not first_pass_seconds > 0:
                raise ConfigError(f"first-pass checkpoint interval must be > 0 seconds, found {first_pass_seconds}")
        self.options = options or ReplayOptions()
        self.version = version if isinstance(version, AllocatorVersion) else resolve_version(version)
        self.reader = trace if isinstance(trace, TraceReader) else open_trace(trace)
        self.label = label if label is not None else str(trace if not isinstance(trace, TraceReader) else trace.path)
        self.meta = self.reader.meta
        self.config = effective_config(
            self.meta, version_spec=self.version.spec, version_page_size=self.version.page_size,
            page_size=page_size, pool_tokens=pool_tokens, device=device, eviction_policy=eviction_policy,
            hicache_ratio=hicache_ratio, hicache_write_policy=hicache_write_policy,
        )
        check_memory(
            self.config,
            num_rids=self.reader.rid_bound,
            names=replay_names(pool_tokens=pool_tokens is not None, page_size=page_size is not None),
            force=force_memory,
        )
        self._clock = clock
        self._track_state = track_state
        self.allocator_in_step = allocator_in_step
        self.checkpoint_every = checkpoint_every
        self.first_pass_every = first_pass_every if checkpoint_every is not None else None
        self.first_pass_seconds = first_pass_seconds if checkpoint_every is not None else None
        self._work_clock = work_clock
        self._first_pass_work_at = 0.0  # work_clock at the last checkpoint the first pass took
        # Paced in seconds, the first pass reads work_clock (a system call) only from
        # checkpoint_every steps past its last checkpoint, and then once every 1/16 of that:
        # the ordinal before which it does not read it again.
        self._next_clock_read = 0
        self.checkpoint_budget = checkpoint_budget
        # The checker runs in a child process on another core; start it before the
        # allocator (which may initialise CUDA).
        self._owns_checker = isinstance(checker, str)
        if checker == "background":
            from traces.checker_process import BackgroundChecker

            self._checker: Any = RecordedChecker(BackgroundChecker(
                self.reader.path, stop=self.options.stop_step, rid_bound=self.reader.rid_bound, nice=checker_nice))
        elif checker == "inline":
            from traces.checker import OpSequenceChecker

            self._checker = RecordedChecker(OpSequenceChecker(self.meta, rid_bound=self.reader.rid_bound))
        else:  # each step is asked for once, in order: seeks and refused runs read the memory
            self._checker = checker if isinstance(checker, RecordedChecker) else RecordedChecker(checker)
        try:
            self._start()
        except BaseException:
            if self._owns_checker:
                self._checker.close()
            raise
        self._checkpoints: list[Checkpoint] = []  # by step
        self._checkpoint_ordinals: list[int] = []  # their ordinals, for bisect
        self._shared: dict[int, int] = {}  # the union of the checkpoints' shared memory: id -> bytes
        self._shared_refs: dict[int, int] = {}  # id -> how many checkpoints hold it
        self._first_pass_from = 0  # the ordinal of the first step never replayed
        self._run_limit: int | None = None  # a seek's target: no run goes past it
        self._wall_s = 0.0
        self._closed = False

    # ------------------------------------------------------------------ set-up
    def _start(self) -> None:
        """A fresh allocator and engine at the start of the trace."""
        self.allocator: Allocator = self.version.create(self.config)
        if self.options.state_digest and not isinstance(self.allocator, Digestible):
            raise VersionSpecError(
                f"--exact: allocator '{self.version.spec}' ({type(self.allocator).__name__}) has no state_digest() "
                "(the optional Digestible protocol of allocator.base), so its physical slots cannot be compared; "
                "drop --exact"
            )
        # A runtime-checkable protocol's isinstance tests every method (tens of µs): once here,
        # not at every step.
        self._saves_state = isinstance(self.allocator, Checkpointable)
        self.engine = ReplayEngine(
            self.meta, self.allocator, self.options, checker=self._checker, clock=self._clock,
            rid_bound=self.reader.rid_bound,
        )
        self.engine.observers = self.observers = getattr(self, "observers", [])  # ReplayObserver: kept on restarts
        self._state: ReplayState | None = ReplayState(self.config.page_size) if self._track_state else None
        self._unfolded: list[StepSnapshot] = []  # replayed, not yet in a block
        self._unfolded_continued: list[bool] = []  # for each of them: the next step of its run follows it
        self._blocks: list[SnapshotBlock] = []  # made of them, not yet folded into the state
        if getattr(self, "_timeline", None) is not None and self._state is not None:
            self._state.timeline = self._timeline  # append-only: survives a restart
        self.last: StepSnapshot | None = None
        self.done = False
        self._open_steps(None, None, 0)

    def _open_steps(self, position: ResumePoint | None, start: int | None, ordinal: int) -> None:
        old = getattr(self, "_chunks", None)
        if old is not None:
            old.close()
        self._chunks: Iterator[StepChunk] = self.reader.chunks(
            start=start, stop=self.options.stop_step, resume=position
        )
        self._chunk: StepChunk | None = None
        self._chunk_steps = _NO_STEPS  # step numbers of the chunk
        self._runs = _NO_STEPS  # traces.runs.run_lengths of the chunk (computed on first use)
        self._index = 0  # the chunk's next step
        self._chunk_base = ordinal  # the ordinal of the chunk's first step
        self._next_base = ordinal  # the ordinal of the next chunk's first step
        self._pending: deque[StepSnapshot] = deque()  # a run's snapshots not returned yet
        self._exhausted = False

    @property
    def checker(self) -> StepChecker:
        """What checks this session's steps (pass it to a session of the same trace that
        replays behind this one, in lockstep, to check every step once)."""
        return self._checker

    @property
    def checkpointable(self) -> bool:
        """Whether seeking backwards restores checkpoints (else it replays from the start)."""
        return (
            self.checkpoint_every is not None
            and self._saves_state
            and self.reader.resumable
        )

    # ------------------------------------------------------------------ stepping
    def _peek(self) -> tuple[StepChunk, int] | None:
        """The chunk and index of the next step (None at the end)."""
        while self._chunk is None or self._index >= self._chunk.num_steps:
            if self._exhausted:
                return None
            try:
                self._chunk = next(self._chunks)
            except StopIteration:
                self._exhausted = True
                self._chunk = None
                return None
            self._chunk_steps = self._chunk.step_numbers()
            self._runs = _NO_STEPS
            self._index = 0
            self._chunk_base = self._next_base
            self._next_base += self._chunk.num_steps
        return self._chunk, self._index

    @property
    def allocator_step(self) -> int | None:
        """The step the allocator's state is after. It runs ahead of ``last`` while a
        run of decode steps replayed in one call is being returned step by step."""
        if self._pending:
            return self._pending[-1].step
        return self.last.step if self.last is not None else None

    def step(self) -> StepSnapshot | None:
        """Replay up to and including the next step of the window; its snapshot, or
        None when the replay is over (the end of the trace or window, or a stop)."""
        if self.done and not self._pending:
            return None
        t0 = self._clock()
        try:
            return self._step()
        finally:
            self._wall_s += self._clock() - t0

    def _step(self) -> StepSnapshot | None:
        if self._pending:
            return self._shown_pending()
        engine = self.engine
        start = self.options.start_step
        while True:
            at = self._peek()
            if at is None:
                self._end()
                return None
            chunk, i = at
            step = int(self._chunk_steps[i])
            ordinal = self._chunk_base + i
            if (start is None or step >= start) and self._due_checkpoint(ordinal):
                self._save_checkpoint(step, chunk.position, ordinal)
            snaps = self._try_run(chunk, i, step)
            if snaps is not None:
                self._first_pass_from = max(self._first_pass_from, self._chunk_base + self._index)
                if snaps:
                    self._pending.extend(snaps[1:])
                    if engine.stopped_early:  # the run's check found violations enough
                        self._end()
                    return self._shown(snaps[0], continued=len(snaps) > 1)
                continue
            self._index += 1
            self._checker.at = self._chunk_base + i  # (a checker of this session's own kind)
            snap = engine.replay_step(chunk.step_batch(i))
            self._first_pass_from = max(self._first_pass_from, ordinal + 1)
            if snap is None:
                if engine.stopped_early:
                    self._end()
                    return None
                continue
            if engine.stopped_early:
                self._end()
            return self._shown(snap)

    def _shown(self, snap: StepSnapshot, continued: bool = False) -> StepSnapshot:
        """``snap`` is returned (``continued``: it is a step of a decode run whose next
        step will be returned next)."""
        self.last = snap
        if self._state is not None:
            self._unfolded.append(snap)
            self._unfolded_continued.append(continued)
            if len(self._unfolded) >= _FOLD_STEPS:
                self.take_block()
        return snap

    def _shown_pending(self) -> StepSnapshot:
        """Return the next step of the run being returned."""
        snap = self._pending.popleft()
        return self._shown(snap, continued=bool(self._pending))

    def _try_run(self, chunk: StepChunk, i: int, step: int) -> list[StepSnapshot] | None:
        """Replay a run of plain decode steps starting at step ``i`` of ``chunk`` in one
        allocator call (``traces.runs``); None when there is none to replay here."""
        # A seek's runs stop at its target: the allocator ends where the caller asked.
        if (self.allocator_in_step and self._run_limit is None) or not self.engine.can_run_decodes():
            return None
        if self._runs is _NO_STEPS:
            self._runs = np.maximum(run_lengths(chunk, DECODE), run_lengths(chunk, SPEC))
        n = int(self._runs[i])
        start = self.options.start_step
        if start is not None and step >= start and not self.engine.in_window:
            return None  # the window's first step enters it by itself (its snapshot is the keyframe)
        steps = self._chunk_steps[i : i + n]
        # A run stays on one side of the window's start, stops at a seek's target and
        # ends where the next checkpoint is due.
        if start is not None and step < start:
            n = int(np.count_nonzero(steps < start))
        if self._run_limit is not None:
            n = min(n, int(np.count_nonzero(steps <= self._run_limit)))
        ordinal = self._chunk_base + i
        # A run ends where the next checkpoint is due; none is taken before the window, and a
        # first pass paced in seconds looks at its clock between runs without cutting them.
        if self.checkpointable and (start is None or step >= start) and not self._paced_in_seconds(ordinal):
            n = min(n, max(self._interval(ordinal) - self._since_checkpoint(ordinal), 1))
        cols, first, size = chunk.columns, int(chunk.starts[i]), int(chunk.stops[i] - chunk.starts[i])
        # A lone plain decode step goes to the engine as a run of one (its lean path).
        least = 1 if n and cols.op[first] == DECODE else MIN_RUN_STEPS
        if n < least or (n := self._checked(chunk, i, n)) < least:
            return None
        op = int(cols.op[first])
        rids = cols.rid[first : first + size]
        accepted = None
        if op == SPEC:  # the run's steps are contiguous rows of equal size
            accepted = cols.accepted_len[first : first + n * size].reshape(n, size)
        snaps = self.engine.replay_run(op, self._chunk_steps[i : i + n], cols.time_s[chunk.starts[i : i + n]], rids, accepted)
        if snaps is None:  # the allocator refused (it would evict, ...): these steps go one by one
            self._runs[i : i + n] = 0
            return None
        # (Fewer snapshots than steps: the engine stopped before a step it left as it was.)
        self._index += len(snaps) or n
        return snaps

    def _checked(self, chunk: StepChunk, i: int, n: int) -> int:
        """Check steps ``i .. i + n - 1`` of ``chunk``; how many lead with no problem (a
        step with one is replayed by itself; its problems are remembered)."""
        check_at = self._checker.check_at
        for j in range(n):
            problems = check_at(chunk, i + j, self._chunk_base + i + j)
            if problems:
                return j
        return n

    @property
    def state(self) -> ReplayState | None:
        """The per-request fold of every step replayed so far (``track_state=True``), else None."""
        if self._state is not None and (self._unfolded or self._blocks):
            self.take_block()
            self._fold_blocks()
        return self._state

    def take_block(self) -> SnapshotBlock | None:
        """The steps returned since the last block was made, as one block (None when there
        were none, or no state is kept); ``state`` folds it later, with others (whenever
        it is read, or once ``_FOLD_STEPS`` steps gather): a consumer streaming those
        same steps (a dashboard's replay process) sends the block to a screen that folds
        it, and the fold here costs one call for many blocks.

        The steps of a decode run other than the last of it in the block carry no
        request rows there: each of them lists the run's batch, whose lengths the next
        step overwrites (same requests, op and phase; no admission or end), so folding
        the last alone gives the same state, for a fraction of the rows."""
        if self._state is None or not self._unfolded:
            return None
        # The last step listed keeps its rows: the rest of its run, if any, is in a later block.
        rows = [not continued or snap.keyframe for snap, continued in zip(self._unfolded, self._unfolded_continued)]
        rows[-1] = True
        block = SnapshotBlock.of(self._unfolded, rows)
        self._unfolded = []
        self._unfolded_continued = []
        self._blocks.append(block)
        if sum(b.num_steps for b in self._blocks) >= _FOLD_STEPS:
            self._fold_blocks()
        return block

    def _fold_blocks(self) -> None:
        if self._blocks and self._state is not None:
            self._state.apply_block(SnapshotBlock.concat(self._blocks))
        self._blocks = []

    def _end(self) -> None:
        if not self.done:
            self.engine.finish()
            self.done = True

    def snapshots(self) -> Iterator[StepSnapshot]:
        """Replay step by step to the end, yielding each snapshot of the window."""
        while True:
            snap = self.step()
            if snap is None:
                return
            yield snap

    def run(self, on_snapshot: Callable[[StepSnapshot], None] | None = None) -> ReplayResult:
        """Replay to the end (or the first stop) and return the result."""
        for snap in self.snapshots():
            if on_snapshot is not None:
                on_snapshot(snap)
        return self.result()

    @property
    def progress(self) -> float:
        """Share of the trace file read so far (0..1), for progress bars."""
        return min(1.0, self.reader.bytes_read / max(self.reader.file_bytes, 1))

    def seek(self, step: int) -> StepSnapshot | None:
        """Go to the state after ``step`` (the last step of the window at or before it;
        the first step of the window if ``step`` is before it) and return that step's
        snapshot. Forwards or backwards; with checkpoints it replays at most
        ``checkpoint_every`` steps.

        A replay that stopped (an out-of-memory, a violation limit) cannot go past
        the step it stopped at.
        """
        t0 = self._clock()
        try:
            return self._seek(step)
        finally:
            self._wall_s += self._clock() - t0

    def fill_checkpoints(self) -> bool:
        """Make going back from here cheap: when the nearest checkpoint before the step
        shown is more than ``checkpoint_every`` steps back (a sparse first pass), replay
        from it to here again, which leaves one every ``checkpoint_every`` steps on the
        way (at most ``first_pass_every`` steps, or some ``first_pass_seconds``; a
        dashboard does it once paused). The
        state afterwards is the same. Returns whether it replayed anything."""
        if not self.checkpointable or self.last is None or self._pending or self.checkpoint_every is None:
            return False
        here = self.last.step
        ordinal = self._chunk_base + self._index  # the next step's
        if self._since_checkpoint(ordinal) <= self.checkpoint_every:
            return False
        best = self._checkpoint_for(here)
        if best is None or best.next_step > here:
            return False
        t0 = self._clock()
        try:
            self._restore(best)
            self._seek(here)
            self.take_block()  # the steps replayed again go to the fold, not to a consumer's next block
        finally:
            self._wall_s += self._clock() - t0
        return True

    def _seek(self, target: int) -> StepSnapshot | None:
        # The snapshots of a run already applied are returned first when they reach the
        # target; past it, the allocator's state is ahead of the target: go back.
        while self._pending and self._pending[0].step <= target:
            self._shown_pending()
        current = self.allocator_step
        best = self._checkpoint_for(target)
        going_back = current is not None and target < current
        if going_back or (best is not None and (current is None or best.next_step > current + 1)):
            if best is not None:
                self._restore(best)
            elif going_back:
                self._restart()
        self._run_limit = target
        try:
            while True:
                if self._pending:  # a run stops at the target: all of it is shown
                    self._shown_pending()
                    continue
                if self.done:
                    break
                at = self._peek()
                if at is None:
                    self._end()
                    break
                if self.last is not None and int(self._chunk_steps[at[1]]) > target:
                    break
                self._step()
        finally:
            self._run_limit = None
        return self.last

    def _restore(self, c: Checkpoint) -> None:
        self.allocator.restore_state(c.allocator)  # type: ignore[attr-defined]
        self.engine.restore_state(c.engine)
        if self.state is not None and c.state is not None:
            self.state.restore(c.state, c.last.pool if c.last is not None else None,
                               c.last.other_pools if c.last is not None else ())
        self.last = c.last
        self.done = False
        self._open_steps(c.position, c.next_step, c.ordinal)

    def _restart(self) -> None:
        """Seek without checkpoints: a fresh allocator from the start of the trace."""
        self._timeline = self.state.timeline if self.state is not None else None
        self._start()

    # ------------------------------------------------------------------ result
    def result(self) -> ReplayResult:
        """The summary of what was replayed so far (complete once ``done``)."""
        engine = self.engine
        counters = self.allocator.counters()
        held = engine.overalloc_held()
        return ReplayResult(
            trace=self.label, allocator=self.version.spec, config=self.config, options=self.options,
            stats=engine.stats,
            requests=engine.num_requests,
            wall_s=self._wall_s,
            overalloc_held_at_end=held,
            page_tail_at_end=counters.overallocated - held,
            stopped_early=engine.stopped_early,
            truncated=bool(self.reader.truncated),
            completed=self.done and not engine.stopped_early,
            pools_at_end=engine.pools_now() if len(engine.pool_names) > 1 else {},
            sessions=self.reader.meta.config.sessions,
            namespaces=0 if self.meta.namespaces is None else len(self.meta.namespaces.names),
        )

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Stop the background checker and release the file."""
        if self._closed:
            return
        self._closed = True
        if self._owns_checker:
            self._checker.close()
        chunks = getattr(self, "_chunks", None)
        if chunks is not None:
            chunks.close()

    def __enter__(self) -> ReplaySession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
