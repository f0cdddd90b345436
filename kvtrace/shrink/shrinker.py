"""``shrink_trace``: find the failure on a trace, then the smallest trace that still
fails the same way.

1. ``Oracle.locate`` replays (or diffs) the input with the what-if options and finds
   the failure, its step and its signature; no failure: the result says why.
2. The rows up to that step become a ``TraceTable`` (the what-ifs written into its
   configuration); the table itself, renumbered, must fail the same way.
3. ``Search`` shrinks it, candidates judged in parallel by a ``Runner``, until no
   phase makes progress, ``max_time`` passes or Ctrl-C.
4. The smallest candidate is written as a compact trace, read back, validated and
   judged once more: the result is a valid trace known to fail the same way.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kvtrace.diff.diff import PARALLEL_MIN_BYTES
from kvtrace.diff.diff import usable_cpus
from kvtrace.errors import ConfigError
from kvtrace.shrink.oracle import Failure, Oracle, Outcome
from kvtrace.shrink.runner import Counts, Evaluator, OutOfTime, Runner, validate_steps, write_steps
from kvtrace.shrink.search import Search
from kvtrace.shrink.table import Candidate, Size, TraceTable, build, with_config

if TYPE_CHECKING:
    from traces.metadata import TraceMeta

__all__ = ["Progress", "ShrinkResult", "shrink_trace"]

Stopped = Literal["done", "time", "interrupted"]


@dataclass(frozen=True, slots=True)
class Progress:
    """Where a shrink stands (for a progress line)."""

    phase: str
    counts: Counts
    size: Size | None
    elapsed_s: float
    left_s: float | None


@dataclass(frozen=True)
class ShrinkResult:
    """What a shrink found and made.

    Attributes:
        trace: the input as given.
        oracle: how traces were judged.
        failure: the failure found on the input (None: it did not fail; ``reason`` says why).
        before: the input's size (``requests``, ``steps``, ``ops``).
        after: the result's size (None without a failure).
        data: the result trace, a complete ``.kvtrace`` file (None without a failure).
        meta: the result's metadata.
        confirmed: the final judging of the result (it reproduces).
        counts: candidates judged, by outcome.
        stopped: ``done`` (no phase makes progress), ``time`` (``max_time``), ``interrupted``.
    """

    trace: str
    oracle: Oracle
    failure: Failure | None
    reason: str
    before: dict[str, int]
    after: Size | None
    data: bytes | None
    meta: TraceMeta | None
    confirmed: Outcome | None
    counts: Counts
    wall_s: float
    stopped: Stopped
    jobs: int
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def reproduced(self) -> bool:
        return self.failure is not None

    def write(self, path: str | os.PathLike[str]) -> None:
        """Write the result trace to ``path`` (normally an ``OutputFile``'s temporary path)."""
        assert self.data is not None
        Path(path).write_bytes(self.data)

    def to_dict(self) -> dict[str, Any]:
        """The ``kvtrace shrink --json`` object (``out`` and ``test`` are the CLI's)."""
        f = self.failure
        return {
            "trace": self.trace,
            "reproduced": self.reproduced,
            "reason": self.reason or None,
            "signature": str(f.signature) if f is not None else None,
            "failure": None if f is None else {"step": f.step, "rid": f.rid, "detail": f.detail},
            "before": self.before,
            "after": None if self.after is None else self.after.to_dict(),
            "candidates": self.counts.tried,
            "reproducing": self.counts.reproduced,
            "invalid": self.counts.invalid,
            "crashed": self.counts.crashed,
            "jobs": self.jobs,
            "stopped": self.stopped,
            "confirmed": None if self.confirmed is None else self.confirmed.reproduced,
            "wall_s": round(self.wall_s, 6),
            "notes": list(self.notes),
        }


def shrink_trace(
    trace: str,
    oracle: Oracle,
    *,
    page_size: int | None = None,
    pool_tokens: int | None = None,
    jobs: int | None = None,
    max_time: float | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    command: str | None = None,
) -> ShrinkResult:
    """Shrink ``trace`` to the smallest trace that still fails as ``oracle`` judges.

    Args:
        trace: a trace path or ``sample:NAME``.
        oracle: the failure asked for and the versions that replay it.
        page_size, pool_tokens: what-if options (written into the result's configuration).
        jobs: worker processes (None: every usable core for a trace of 2 MB or more, else
            1; 1: in this process).
        max_time: seconds the search may take after the failure is found (None: no limit).
        on_progress: called as the search goes (candidates, sizes, time left).
        command: the command line, recorded in the result's metadata.

    Returns:
        The result (``failure`` None when the input does not fail).

    Raises:
        KvtraceError, TraceError: a bad trace, version or option (one line).
    """
    from kvtrace.replay.session import open_trace

    t0 = time.perf_counter()
    reader = open_trace(trace)
    _resolve_versions(oracle)
    if jobs is None:  # workers start in seconds: worth it on a big trace only
        jobs = usable_cpus() if os.path.getsize(reader.path) >= PARALLEL_MIN_BYTES else 1
    deadline_s = max_time
    state: dict[str, Any] = {"phase": "start", "size": None, "deadline": None}

    def report(*_: Any) -> None:
        if on_progress is None:
            return
        deadline = state["deadline"]
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        on_progress(Progress(state["phase"], runner.counts, state["size"], time.perf_counter() - t0, left))

    with tempfile.TemporaryDirectory(prefix="kvtrace-shrink-") as workdir, Runner(jobs, on_result=report) as runner:
        before = _input_size(reader)
        found = oracle.locate(str(reader.path), page_size=page_size, pool_tokens=pool_tokens)
        if isinstance(found, str):
            return ShrinkResult(trace, oracle, None, found, before, None, None, None, None, Counts(),
                                time.perf_counter() - t0, "done", jobs)
        if deadline_s is not None:
            runner.deadline = state["deadline"] = time.monotonic() + deadline_s
        meta = reader.meta
        if page_size is not None or pool_tokens is not None:
            meta = with_config(meta, page_size=page_size or meta.config.page_size,
                               pool_tokens=pool_tokens or meta.config.pool_tokens)
        table = TraceTable(meta, list(open_trace(trace).steps(stop=found.step + 1)))
        evaluator = Evaluator(table, oracle, found.signature, Path(workdir))
        runner.prepare(evaluator)
        best = table.all_rows()
        state["size"] = table.size(best)
        stopped: Stopped = "done"
        search: Search | None = None
        try:
            first = runner.each([best])[0]
            if not first.reproduced:
                return ShrinkResult(
                    trace, oracle, None, f"found at step {found.step} ({found.detail}), but on the trace cut after "
                    f"that step: {first.detail}", before, None, None, None, None, runner.counts,
                    time.perf_counter() - t0, "done", jobs,
                )

            def changed(phase: str) -> None:
                state["phase"] = phase
                state["size"] = search.size if search is not None else state["size"]
                report()

            search = Search(table, runner, found, _page_size(oracle, meta), best, on_change=changed)
            search.run()
        except OutOfTime:
            stopped = "time"
        except KeyboardInterrupt:
            stopped = "interrupted"
        if search is not None:
            best = search.best
        runner.close()
        notes = {"done": [], "time": ["stopped by --max-time"], "interrupted": ["interrupted: the smallest trace so far"]}
        data, result_meta, confirmed = _finish(table, best, oracle, trace, found, before,
                                               page_size, pool_tokens, command, Path(workdir))
    return ShrinkResult(
        trace, oracle, found, "", before, table.size(best), data, result_meta, confirmed, runner.counts,
        time.perf_counter() - t0, stopped, jobs, tuple(notes[stopped]),
    )


def _finish(
    table: TraceTable, best: Candidate, oracle: Oracle, trace: str, failure: Failure,
    before: dict[str, int], page_size: int | None, pool_tokens: int | None, command: str | None, workdir: Path,
) -> tuple[bytes, TraceMeta, Outcome]:
    """Write the best candidate as a compact trace, read it back, validate and judge it."""
    from kvtrace import __version__
    from traces.metadata import Recording, timestamp
    from traces.reader import TraceReader

    origin = {
        "trace": trace,
        "created_at": table.meta.created_at,
        **before,
        "failure": str(failure.signature),
        "step": failure.step,
        "until": str(oracle.target),
        **_versions_of(oracle),
        "what_if": {"page_size": page_size, "pool_tokens": pool_tokens},
    }
    meta, steps = build(table, best, extra={"shrunk_from": origin})
    now = timestamp()
    recording = Recording(status="complete", kvtrace_version=__version__, command=command, finished_at=now,
                          steps=len(steps))
    meta = replace(meta, created_at=now, recording=recording)
    path = workdir / "result.kvtrace"
    write_steps(path, meta, steps, final=True)
    reader = TraceReader(path)
    problems = validate_steps(reader.meta, list(reader.steps()))
    if problems:  # the units keep sequences legal; this would be a bug in them
        raise AssertionError(f"the shrunk trace does not validate: {problems[0]}")
    confirmed = oracle.judge(path, failure.signature)
    return path.read_bytes(), reader.meta, confirmed


def _versions_of(oracle: Oracle) -> dict[str, Any]:
    if oracle.target.kind == "divergence":
        return {"a": oracle.a, "b": oracle.b, "exact": oracle.exact}
    return {"allocator": oracle.allocator, "baseline": oracle.baseline}


def _resolve_versions(oracle: Oracle) -> None:
    """Resolve every version once now: a bad spec is one line before any replay."""
    from kvtrace.versions.registry import resolve_any, resolve_version

    if oracle.target.kind == "divergence":
        resolve_any(oracle.a)
        resolve_any(oracle.b or "")
        return
    for spec in (oracle.allocator, oracle.baseline):
        if spec is not None:
            resolve_version(spec)  # replayed in this process: not a git: or worktree version


def _page_size(oracle: Oracle, meta: TraceMeta) -> int:
    """The page size the versions replay with (both sides' common multiple for a divergence)."""
    from kvtrace.replay.config import effective_config
    from kvtrace.versions.registry import resolve_any

    specs = [oracle.a, oracle.b] if oracle.target.kind == "divergence" else [oracle.allocator]
    sizes = []
    for spec in specs:
        if spec is None:
            continue
        version = resolve_any(spec)
        try:
            sizes.append(effective_config(meta, version_spec=spec, version_page_size=version.page_size).page_size)
        except ConfigError:
            sizes.append(meta.config.page_size)
    return math.lcm(*sizes) if sizes else meta.config.page_size


def _input_size(reader: Any) -> dict[str, int]:
    from kvtrace.traceinfo import trace_info
    from traces.reader import TraceReader

    info = trace_info(TraceReader(reader.path))
    return {"requests": info["requests"], "steps": info["steps"], "ops": info["rows"]}
