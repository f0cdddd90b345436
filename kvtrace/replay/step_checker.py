"""The step checker as a session sees it: each step checked once, its problems kept.

A session checks every step for impossible ops before the engine applies it (through
``traces.checker``'s checker, in a child process or here). Seeks replay steps again;
``RecordedChecker`` answers those from memory, so each step is checked once, whatever
the seeks, and a session that replays behind another (lockstep diff) reads the first
one's answers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from traces.chunks import StepChunk
    from traces.batches import StepBatch
    from traces.checker import Problem

__all__ = ["RecordedChecker"]


class _StepNumber(NamedTuple):
    """A step as the background checker needs it: its number (it reads the rows itself)."""

    step: int


class RecordedChecker:
    """Checks each step once (through ``inner``, in file order) and remembers the
    problems, so steps replayed again after a seek are checked from memory.

    Steps are known by their *ordinal* (their position in the file, from 0), which the
    session sets in ``at`` before each ``check``: step numbers may repeat or go back in
    a damaged trace, and such a step must still be checked, not read from memory."""

    def __init__(self, inner: Any) -> None:
        from traces.checker_process import BackgroundChecker

        self.inner = inner
        self._rows_needed = not isinstance(inner, BackgroundChecker)
        self.frontier = -1  # every step at an ordinal <= this one was checked
        self.at = 0  # the ordinal of the step the next check() is about
        self._problems: dict[int, list[Problem]] = {}

    def check(self, batch: StepBatch) -> list[Problem]:
        at = self.at
        if at <= self.frontier:
            return self._problems.get(at, [])
        if at != self.frontier + 1:
            raise AssertionError(f"step ordinal {at} checked before {self.frontier + 1}")
        problems = self.inner.check(batch)
        self.frontier = at
        if problems:
            self._problems[at] = problems
        return problems

    def check_at(self, chunk: StepChunk, i: int, ordinal: int) -> list[Problem]:
        """``check`` of step ``i`` of ``chunk`` (at ``ordinal``), building its rows only for
        a checker that reads them (the background checker reads the file itself)."""
        self.at = ordinal
        if self._rows_needed:
            return self.check(chunk.step_batch(i))
        return self.check(_StepNumber(int(chunk.columns.step[chunk.starts[i]])))  # type: ignore[arg-type]

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()
