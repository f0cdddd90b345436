"""Candidates judged on every core: each one is built, validated, written to a
temporary file and replayed (or diffed) by a worker process.

``Evaluator`` does one candidate (in a worker, or in this process); ``Runner``
keeps ``jobs`` of them in flight (workers get the table once, pickled to a file). ``first_success`` hands out candidates in order
and returns the first that reproduces the failure (the others still running are
forgotten: their results are dropped when they arrive); ``each`` judges a list
and returns every outcome. A deadline (``--max-time``) raises ``OutOfTime``
between two results; Ctrl-C raises ``KeyboardInterrupt`` there (workers ignore
SIGINT, the runner terminates them on ``close``).
"""

from __future__ import annotations

import itertools
import os
import pickle
import queue
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtrace.errors import USER_ERRORS
from kvtrace.shrink.oracle import Oracle, Outcome
from kvtrace.shrink.table import Candidate, TraceTable, build

if TYPE_CHECKING:
    from kvtrace.shrink.signature import Signature
    from traces.batches import StepBatch
    from traces.metadata import TraceMeta

__all__ = ["Evaluator", "OutOfTime", "Runner", "validate_steps", "write_steps"]


class OutOfTime(Exception):
    """The deadline passed (``--max-time``)."""


def validate_steps(meta: TraceMeta, steps: list[StepBatch]) -> list[str]:
    """The op-sequence problems of a trace held in memory (``kvtrace validate``'s rules)."""
    from traces.checker import OpSequenceChecker

    checker = OpSequenceChecker(meta)
    return [str(p) for batch in steps for p in checker.check(batch)]


def write_steps(path: Path, meta: TraceMeta, steps: list[StepBatch], *, final: bool = False) -> None:
    """Write a trace: fast for a candidate, compact (an IPC file, zstd) when ``final``."""
    from traces.writer import TraceWriter

    if final:
        with TraceWriter(path, meta, compression="zstd", steps_per_batch=64, ipc_format="file") as out:
            for batch in steps:
                out.write(batch)
        return
    with TraceWriter(path, meta, compression="lz4", steps_per_batch=max(1, len(steps)), overwrite=True) as out:
        for batch in steps:
            out.write(batch)


class Evaluator:
    """Judges candidates of one table against one signature, writing them under ``workdir``."""

    def __init__(self, table: TraceTable, oracle: Oracle, signature: Signature, workdir: Path) -> None:
        self.table = table
        self.oracle = oracle
        self.signature = signature
        self.workdir = Path(workdir)
        self._count = itertools.count()

    def __call__(self, cand: Candidate) -> Outcome:
        """Build, validate, write and judge one candidate (never raises)."""
        try:
            meta, steps = build(self.table, cand)
            problems = validate_steps(meta, steps)
            if problems:
                return Outcome("invalid", None, problems[0])
            path = self.workdir / f"candidate-{os.getpid()}-{next(self._count)}.kvtrace"
            try:
                write_steps(path, meta, steps)
                return self.oracle.judge(path, self.signature)
            finally:
                path.unlink(missing_ok=True)
        except USER_ERRORS as exc:  # e.g. a pool no allocator takes
            return Outcome("invalid", None, str(exc))
        except Exception as exc:  # noqa: BLE001 - a version that crashes on this trace
            return Outcome("crashed", None, f"{type(exc).__name__}: {exc}")


_EVALUATORS: dict[str, Evaluator] = {}  # in a worker: by the path of the pickled table


def _worker_start(tie: tuple[int, bool]) -> None:
    import multiprocessing as mp

    from traces import lifeline

    # Ctrl-C is the parent's to handle; the worker dies with the parent.
    parent = mp.parent_process()
    lifeline.settle(tie[0], parent.sentinel if parent is not None else None, tie[1])
    import kvtrace.replay.session  # noqa: F401  (torch and the allocator load while the parent finds the failure)
    import allocator.manager  # noqa: F401


def _worker_judge(task: int, job: tuple[str, Oracle, Signature], cand: Candidate) -> tuple[int, Outcome]:
    table_path, oracle, signature = job
    evaluator = _EVALUATORS.get(table_path)
    if evaluator is None:
        with open(table_path, "rb") as f:
            table = pickle.load(f)
        evaluator = _EVALUATORS[table_path] = Evaluator(table, oracle, signature, Path(table_path).parent)
    return task, evaluator(cand)


@dataclass
class Counts:
    """Candidates judged so far, by outcome."""

    tried: int = 0
    reproduced: int = 0
    invalid: int = 0
    crashed: int = 0

    def add(self, outcome: Outcome) -> None:
        self.tried += 1
        if outcome.status == "reproduced":
            self.reproduced += 1
        elif outcome.status == "invalid":
            self.invalid += 1
        elif outcome.status == "crashed":
            self.crashed += 1


class Runner:
    """Judges candidates ``jobs`` at a time (``jobs=1``: in this process).

    The workers start at once (they import torch while the caller looks for the
    failure); ``prepare`` then gives them the table to cut candidates from.

    Args:
        jobs: worker processes.
        deadline: ``time.monotonic()`` past which ``OutOfTime`` is raised (None: none).
        on_result: called after every outcome (progress).
    """

    def __init__(
        self,
        jobs: int,
        deadline: float | None = None,
        on_result: Callable[[Outcome], None] | None = None,
    ) -> None:
        self.jobs = max(1, jobs)
        self.deadline = deadline
        self.counts = Counts()
        self._on_result = on_result
        self._evaluator: Evaluator | None = None
        self._job: tuple[str, Oracle, Signature] | None = None
        self._pool: Any = None
        self._done: queue.SimpleQueue[tuple[int, Outcome]] = queue.SimpleQueue()
        self._busy: set[int] = set()  # tasks in flight, current or forgotten
        self._tasks = itertools.count()
        if self.jobs > 1:
            import multiprocessing as mp

            # spawn: the workers start clean (no torch threads inherited through fork)
            from traces import lifeline

            with lifeline.quiet_start():
                self._pool = mp.get_context("spawn").Pool(
                    self.jobs, initializer=_worker_start, initargs=(lifeline.parent_tie(),)
                )

    def prepare(self, evaluator: Evaluator) -> None:
        """Judge candidates of ``evaluator``'s table from now on (its table is pickled
        beside the candidates for the workers)."""
        self._evaluator = evaluator
        if self._pool is not None:
            path = evaluator.workdir / f"table-{next(self._tasks)}.pickle"
            with open(path, "wb") as f:
                pickle.dump(evaluator.table, f, protocol=pickle.HIGHEST_PROTOCOL)
            self._job = (str(path), evaluator.oracle, evaluator.signature)

    # ------------------------------------------------------------------ public
    def first_success(self, candidates: Iterable[Candidate]) -> tuple[Candidate, Outcome] | None:
        """The first candidate (in completion order) that reproduces the failure, or None."""
        if self._pool is None:
            assert self._evaluator is not None
            for cand in candidates:
                self._check_time()
                outcome = self._note(self._evaluator(cand))
                if outcome.reproduced:
                    return cand, outcome
            return None
        pending: Iterator[Candidate] = iter(candidates)
        mine: dict[int, Candidate] = {}
        exhausted = False
        while True:
            self._check_time()
            while not exhausted and len(self._busy) < self.jobs:
                cand = next(pending, None)
                if cand is None:
                    exhausted = True
                    break
                mine[self._submit(cand)] = cand
            if not mine:
                return None
            task, outcome = self._next()
            cand_done = mine.pop(task, None)
            if cand_done is not None and outcome.reproduced:
                return cand_done, outcome  # the others in flight are forgotten

    def each(self, candidates: list[Candidate]) -> list[Outcome]:
        """Every candidate's outcome, in order."""
        if self._pool is None:
            assert self._evaluator is not None
            out = []
            for cand in candidates:
                self._check_time()
                out.append(self._note(self._evaluator(cand)))
            return out
        results: dict[int, Outcome] = {}
        order: list[int] = []
        queue_ = list(candidates)
        while queue_ or any(t not in results for t in order):
            self._check_time()
            while queue_ and len(self._busy) < self.jobs:
                order.append(self._submit(queue_.pop(0)))
            task, outcome = self._next()
            results[task] = outcome
        return [results[t] for t in order]

    def close(self) -> None:
        """Stop the workers now (what they are doing is abandoned)."""
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _check_time(self) -> None:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise OutOfTime()

    def _note(self, outcome: Outcome) -> Outcome:
        self.counts.add(outcome)
        if self._on_result is not None:
            self._on_result(outcome)
        return outcome

    def _submit(self, cand: Candidate) -> int:
        task = next(self._tasks)
        self._busy.add(task)

        def failed(exc: BaseException, task: int = task) -> None:
            self._done.put((task, Outcome("crashed", None, f"{type(exc).__name__}: {exc}")))

        self._pool.apply_async(_worker_judge, (task, self._job, cand), callback=self._done.put, error_callback=failed)
        return task

    def _next(self) -> tuple[int, Outcome]:
        """The next outcome to arrive (forgotten tasks' included: they free a worker)."""
        while True:
            timeout = 0.2
            if self.deadline is not None:
                timeout = min(timeout, max(0.0, self.deadline - time.monotonic()))
            try:
                task, outcome = self._done.get(timeout=timeout)
            except queue.Empty:
                self._check_time()
                continue
            self._busy.discard(task)
            return task, self._note(outcome)
