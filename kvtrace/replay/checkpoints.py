"""The replay session's checkpoints: when one is due, taking one within the memory
budget, and which one a seek restores.

A checkpoint is the allocator's and the engine's state (and the per-request fold's)
before a step, and where that step starts in the file. ``ReplaySession`` takes them as
it replays and restores the nearest one before a seek's target.

With ``checkpoint_every=K`` the session saves the allocator and the engine
every K replayed steps (memory proportional to the live state, bounded by
``checkpoint_budget``: past it, every other checkpoint is dropped and K doubles),
so going to any step replays at most K steps. With ``first_pass_every=F`` (> K) the
first pass over the steps takes one every F steps, and replaying those steps again (a
seek back, or ``fill_checkpoints`` where the replay is) fills in the ones every K
steps on its way: the first pass takes and holds a K/F share of them (their fresh
memory costs a replay more than taking them), the first seek into a stretch replays
at most F steps, the next ones at most K. With ``first_pass_seconds=T`` instead, the
first pass takes one once T seconds of the replay's own time (its thread's CPU time)
have passed since the last (and at least K steps): the first seek into a stretch
replays some T seconds, whatever a step costs in that trace.

``Checkpointing`` is the part of the session that keeps them: a base class of
``ReplaySession``, which sets the fields it lists and owns stepping and seeking.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from allocator.base import Allocator
    from kvtrace.replay.engine import EngineState, ReplayEngine
    from kvtrace.replay.snapshot import StepSnapshot
    from kvtrace.replay.state import ReplayState
    from traces.ipc import ResumePoint

__all__ = ["Checkpoint", "Checkpointing"]


@dataclass
class Checkpoint:
    """The state before step ``next_step``: restore it and ``step()`` replays that step."""

    next_step: int
    position: ResumePoint | None  # where ``next_step`` starts in the file
    ordinal: int  # next_step's position among the trace's steps (from 0)
    allocator: object
    engine: EngineState
    state: Any  # ReplayState.save(), or None
    last: StepSnapshot | None  # the snapshot before (None at the start of the window)
    nbytes: int  # its own memory
    shared: dict[int, int]  # memory it may share with others: id -> bytes (``AllocatorState.shared``)


class Checkpointing:
    """The checkpoints of a ``ReplaySession`` (a base of it; its fields are set by the
    session's ``__init__``)."""

    allocator: Allocator
    engine: ReplayEngine
    last: StepSnapshot | None
    checkpoint_every: int | None
    first_pass_every: int | None
    first_pass_seconds: float | None
    checkpoint_budget: int
    _checkpoints: list[Checkpoint]
    _checkpoint_ordinals: list[int]
    _shared: dict[int, int]
    _shared_refs: dict[int, int]
    _first_pass_from: int
    _work_clock: Callable[[], float]
    _first_pass_work_at: float
    _next_clock_read: int
    checkpointable: bool  # properties of the session
    state: ReplayState | None

    def _interval(self, ordinal: int) -> int:
        """Steps between checkpoints where the step of ``ordinal`` is (at least that many
        in a first pass paced in seconds)."""
        assert self.checkpoint_every is not None
        if self.first_pass_every is not None and ordinal >= self._first_pass_from:
            return self.first_pass_every
        return self.checkpoint_every

    def _paced_in_seconds(self, ordinal: int) -> bool:
        """Whether the step of ``ordinal`` is in a first pass paced in seconds."""
        return self.first_pass_seconds is not None and ordinal >= self._first_pass_from

    def _since_checkpoint(self, ordinal: int) -> int:
        """Steps from the last checkpoint at or before the step of ``ordinal`` to it (asked
        at every step: past the newest one, the common case, without a search)."""
        ordinals = self._checkpoint_ordinals
        if ordinals and ordinal >= ordinals[-1]:
            return ordinal - ordinals[-1]
        i = bisect.bisect_right(ordinals, ordinal)
        return ordinal - ordinals[i - 1] if i else ordinal

    def _due_checkpoint(self, ordinal: int) -> bool:
        """Whether a checkpoint is due before the step of ``ordinal`` (asked at every step:
        the checkpointable test only once one may be due)."""
        if not self._checkpoint_ordinals:
            return self.checkpointable  # the start of the window
        if self._since_checkpoint(ordinal) < self._interval(ordinal) or not self.checkpointable:
            return False
        if not self._paced_in_seconds(ordinal):
            return True
        if ordinal < self._next_clock_read:
            return False
        assert self.first_pass_seconds is not None and self.checkpoint_every is not None
        if self._work_clock() - self._first_pass_work_at >= self.first_pass_seconds:
            return True
        self._next_clock_read = ordinal + max(self.checkpoint_every // 16, 1)
        return False

    def _save_checkpoint(self, step: int, position: ResumePoint | None, ordinal: int) -> None:
        at = bisect.bisect_left(self._checkpoint_ordinals, ordinal)
        if at < len(self._checkpoints) and self._checkpoint_ordinals[at] == ordinal:
            return  # replaying again after a seek: this one exists
        if self._paced_in_seconds(ordinal):
            self._first_pass_work_at = self._work_clock()
        saved_alloc = self.allocator.save_state()  # type: ignore[attr-defined]
        saved_engine = self.engine.save_state()
        saved_state = self.state.save() if self.state is not None else None
        nbytes = int(getattr(saved_alloc, "nbytes", 0)) + _engine_nbytes(saved_engine)
        if saved_state is not None:
            nbytes += sum(v.nbytes for v in saved_state.columns.values())
        shares = getattr(saved_alloc, "shared", None)
        shared = shares() if shares is not None else {}
        self._checkpoints.insert(at, Checkpoint(step, position, ordinal, saved_alloc, saved_engine, saved_state,
                                                 self.last, nbytes, shared))
        self._checkpoint_ordinals.insert(at, ordinal)
        self._hold_shared(shared)
        if self.checkpoint_bytes > self.checkpoint_budget and len(self._checkpoints) > 2:
            # Thin out: keep the first (the window's start), every other one after it, and
            # the newest (the next ones are due counting from it).
            kept = self._checkpoints[:1] + self._checkpoints[2::2]
            if kept[-1] is not self._checkpoints[-1]:
                kept.append(self._checkpoints[-1])
            kept_ids = {id(c) for c in kept}
            for c in self._checkpoints:
                if id(c) not in kept_ids:
                    self._release_shared(c.shared)
            self._checkpoints = kept
            self._checkpoint_ordinals = [c.ordinal for c in self._checkpoints]
            assert self.checkpoint_every is not None
            self.checkpoint_every *= 2
            if self.first_pass_every is not None:
                self.first_pass_every *= 2
            if self.first_pass_seconds is not None:
                self.first_pass_seconds *= 2

    def _hold_shared(self, shared: dict[int, int]) -> None:
        refs = self._shared_refs
        self._shared.update(shared)
        for key in shared:
            refs[key] = refs.get(key, 0) + 1

    def _release_shared(self, shared: dict[int, int]) -> None:
        refs = self._shared_refs
        for key in shared:
            left = refs[key] - 1
            if left:
                refs[key] = left
            else:
                del refs[key], self._shared[key]

    @property
    def checkpoint_bytes(self) -> int:
        """Memory the checkpoints hold now (what several share counted once: the union
        of their ``shared``, kept as they come and go)."""
        return sum(c.nbytes for c in self._checkpoints) + sum(self._shared.values())

    @property
    def num_checkpoints(self) -> int:
        return len(self._checkpoints)

    def _checkpoint_for(self, target: int) -> Checkpoint | None:
        best = None
        for c in self._checkpoints:
            if c.next_step <= target or best is None:
                best = c
            else:
                break
        return best


def _engine_nbytes(state: EngineState) -> int:
    return sum(a.nbytes for a in state.arrays.values()) + state.tokens.nbytes
