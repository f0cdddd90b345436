"""``kvtrace diff``: two allocator versions on one trace (or two state logs), compared
after every step; the first divergence, or up to N of them, and why.

``diff_trace`` builds the two sides (``kvtrace.diff.sides``): in lockstep in this process
when both versions import here and one core is all there is, otherwise in two child
processes that replay in parallel and stream their records (``kvtrace.proc.child``);
``git:`` and ``worktree`` versions always run in a child. ``diff_logs`` reads two
state logs. ``kvtrace.diff.walk.compare_sides`` walks both record streams step by step
with the one step comparator (``kvtrace.diff.compare``): pool counters, each changed
request's ``kv_allocated_len`` / ``kv_committed_len`` / ``cache_protected_len`` / prefix /
phase / op, the step's outcomes (OOM, drops, evictions, over-allocation releases,
violations) and, with ``exact``, the allocators' state digests. Chunks of identical
records are skipped in one comparison per column.

The result is a ``DiffReport``: plain data (``to_dict()`` is the ``--json`` object)
that the CLI renders as text and a screen can render as it likes.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from kvtrace.diff.walk import ReportedDivergence, compare_sides
from kvtrace.errors import ConfigError

if TYPE_CHECKING:
    from kvtrace.replay.engine import ReplayOptions
    from kvtrace.diff.sides import Chunk

__all__ = ["DiffOptions", "DiffReport", "SideReport", "diff_logs", "diff_trace", "usable_cpus"]

Mode = Literal["lockstep", "parallel", "logs"]
# Traces this big replay their sides in two processes by default (the children's
# start-up, Python, torch and the allocator, pays off).
PARALLEL_MIN_BYTES = 2 << 20


@dataclass(frozen=True, slots=True)
class DiffOptions:
    """How to compare.

    Args:
        exact: compare the allocators' state digests too (physical slots).
        context: steps of history shown for a divergence.
        max_divergences: report up to this many divergences (each request once);
            1 stops at the first.
    """

    exact: bool = False
    context: int = 5
    max_divergences: int = 1



@dataclass(frozen=True, slots=True)
class SideReport:
    """One side: its spec, label, where it comes from, its replay summary."""

    spec: str
    label: str
    origin: str
    summary: dict[str, Any]


@dataclass(frozen=True)
class DiffReport:
    """What a diff found. ``to_dict()`` is the ``kvtrace diff --json`` object."""

    trace: str
    a: SideReport
    b: SideReport
    mode: Mode
    exact: bool
    steps_compared: int
    divergences: tuple[ReportedDivergence, ...]
    wall_s: float
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()  # one line each, for stderr (two logs of different traces)

    @property
    def identical(self) -> bool:
        return not self.divergences

    @property
    def first_divergence(self) -> ReportedDivergence | None:
        return self.divergences[0] if self.divergences else None

    def to_dict(self) -> dict[str, Any]:
        first = self.first_divergence
        return {
            "identical": self.identical,
            "steps_compared": self.steps_compared,
            "first_divergence": None if first is None else {
                k: v for k, v in first.to_dict().items() if k in ("step", "op", "rid", "field", "a", "b", "detail", "pool")
            },
            "divergences": [d.to_dict() for d in self.divergences],
            "a": self.a.summary,
            "b": self.b.summary,
            "versions": {
                side: {"spec": r.spec, "label": r.label, "origin": r.origin} for side, r in (("a", self.a), ("b", self.b))
            },
            "trace": self.trace,
            "mode": self.mode,
            "exact": self.exact,
            "wall_s": round(self.wall_s, 6),
            "notes": list(self.notes),
            "warnings": list(self.warnings),
        }


# ---------------------------------------------------------------------------- entry points


def usable_cpus() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def diff_trace(
    trace: str,
    spec_a: str,
    spec_b: str,
    *,
    options: DiffOptions | None = None,
    replay: ReplayOptions | None = None,
    page_size: int | None = None,
    pool_tokens: int | None = None,
    device: str = "cpu",
    eviction_policy: str | None = None,
    hicache_ratio: float | None = None,
    hicache_write_policy: str | None = None,
    jobs: int | None = None,
    on_progress: Callable[[int], None] | None = None,
    on_chunk: Callable[[int, Any, Chunk], None] | None = None,
) -> DiffReport:
    """Replay ``trace`` through versions ``spec_a`` and ``spec_b`` and compare them.

    Args:
        trace: a trace path or ``sample:NAME``.
        spec_a, spec_b: version specs (``kvtrace.versions.registry``).
        options: what to compare and report.
        replay: replay options both sides use (checks, OOM handling, ``--steps``).
        page_size, pool_tokens, device, eviction_policy: what-ifs applied to both sides.
        hicache_ratio, hicache_write_policy: HiCache's host tier on both sides (turned on
            with the ratio or changed; None: the trace's).
        jobs: 2 replays the sides in two processes in parallel, 1 in lockstep in this
            process (versions that import here); None: 2 when two cores are usable.
        on_progress: called with the last step reached, as the comparison goes.
        on_chunk: called with (side index, side, chunk) for every chunk of steps each side
            yields, in order, before it is compared (``kvtrace diff --export`` writes the
            timeline from them: each side replays once).

    Raises:
        KvtraceError: a spec that does not resolve, a bad trace, conflicting options,
            a side that fails (one line naming the side).
    """
    import dataclasses

    from kvtrace.versions.registry import AllocatorVersion, resolve_any
    from kvtrace.replay.engine import ReplayOptions
    from kvtrace.replay.session import open_trace

    options = options or DiffOptions()
    replay = dataclasses.replace(replay or ReplayOptions(), state_digest=options.exact)
    if jobs is not None and jobs not in (1, 2):
        raise ConfigError(f"--jobs must be 1 (lockstep in one process) or 2 (two processes), found {jobs}")
    path = str(open_trace(trace).path)  # one clear line for a missing or broken file
    t0 = time.perf_counter()
    versions = [resolve_any(spec_a), resolve_any(spec_b)]
    in_process = all(isinstance(v, AllocatorVersion) for v in versions)
    if jobs is None:
        jobs = 2 if usable_cpus() >= 2 and os.path.getsize(path) >= PARALLEL_MIN_BYTES else 1
    parallel = jobs == 2 or not in_process
    what_if = {"page_size": page_size, "pool_tokens": pool_tokens, "device": device, "eviction_policy": eviction_policy,
               "hicache_ratio": hicache_ratio, "hicache_write_policy": hicache_write_policy}
    sides: list[Any] = []
    checker: Any = None
    try:
        if parallel:
            checker = _start_children(sides, versions, path, trace, replay, what_if)
        else:
            _start_sessions(sides, versions, path, trace, replay, what_if)
        compared = sides if on_chunk is None else [_Teed(i, side, on_chunk) for i, side in enumerate(sides)]
        steps, found = compare_sides(compared[0], compared[1], options, on_progress)
        reports = [SideReport(s.spec, s.label, s.origin, s.summary()) for s in sides]
    finally:
        for s in reversed(sides):
            s.close()
        if checker is not None:
            checker.terminate()
            checker.join(timeout=10)
    notes = _config_notes(reports[0].summary, reports[1].summary)
    return DiffReport(trace, reports[0], reports[1], "parallel" if parallel else "lockstep", options.exact, steps,
                      tuple(found), time.perf_counter() - t0, notes)


def _start_children(
    sides: list[Any], versions: list[Any], path: str, trace: str, replay: ReplayOptions, what_if: dict[str, Any]
) -> Any:
    """Both sides in child processes (appended to ``sides`` as they start), fed by one
    op-sequence checker (each step checked once); returns the checker's process."""
    import dataclasses

    from kvtrace.diff.sides import ChildSide, side_job
    from traces.checker_process import start_shared_checker

    checker, pipes = start_shared_checker(path, consumers=2, stop=replay.stop_step)
    try:
        for name, version, pipe in zip("AB", versions, pipes):
            job = side_job(version, path, trace_label=trace, options=dataclasses.asdict(replay), **what_if)
            job = dataclasses.replace(job, checker_fd=pipe.fileno())
            sides.append(ChildSide(name, job, python=getattr(version, "python", sys.executable), pass_fds=(pipe.fileno(),)))
    finally:
        for pipe in pipes:
            pipe.close()  # the children hold their own ends
    return checker


def _start_sessions(
    sides: list[Any], versions: list[Any], path: str, trace: str, replay: ReplayOptions, what_if: dict[str, Any]
) -> None:
    """Both sides as sessions in this process, in lockstep: the second checks its steps
    from the first one's memory. The first checks in a background process, or inline in a
    daemonic process (a worker of ``kvtrace shrink``), which may not start one."""
    import multiprocessing

    from kvtrace.replay.session import ReplaySession
    from kvtrace.diff.sides import SessionSide

    checker = "inline" if multiprocessing.current_process().daemon else "background"
    first = ReplaySession(path, version=versions[0], options=replay, label=trace, checker=checker, **what_if)
    sides.append(SessionSide(first))
    second = ReplaySession(path, version=versions[1], options=replay, label=trace, checker=first.checker, **what_if)
    sides.append(SessionSide(second))


def diff_logs(log_a: str, log_b: str, *, options: DiffOptions | None = None,
              steps: tuple[int | None, int | None] = (None, None),
              on_progress: Callable[[int], None] | None = None) -> DiffReport:
    """Compare two saved state logs (``kvtrace replay --out``) step by step.

    Args:
        steps: ``(start, stop)``: compare only steps in ``[start, stop)``.
        on_progress: called with the last step reached, as the comparison goes.
        on_chunk: called with (side index, side, chunk) for every chunk of steps each side
            yields, in order, before it is compared (``kvtrace diff --export`` writes the
            timeline from them: each side replays once).

    Raises:
        TraceError: a log is missing or not a state log. ConfigError: ``exact`` asked
            but a log holds no state digests.
    """
    from kvtrace.diff.sides import LogSide

    options = options or DiffOptions()
    t0 = time.perf_counter()
    sides = [LogSide(log_a), LogSide(log_b)]
    try:
        wrapped = [_Windowed(s, steps) if steps != (None, None) else s for s in sides]
        if options.exact:
            wrapped = [_RequireDigests(w, s.path) for w, s in zip(wrapped, sides)]
        count, found = compare_sides(wrapped[0], wrapped[1], options, on_progress)
        reports = [SideReport(s.spec, s.label, s.origin, s.summary()) for s in sides]
    finally:
        for s in sides:
            s.close()
    trace = str(sides[0].info.get("trace", ""))
    notes = _config_notes(reports[0].summary, reports[1].summary)
    mismatch = _trace_mismatch(sides[0], sides[1])
    return DiffReport(trace, reports[0], reports[1], "logs", options.exact, count, tuple(found),
                      time.perf_counter() - t0, notes, () if mismatch is None else (mismatch,))


def _trace_mismatch(a: Any, b: Any) -> str | None:
    """One line when two state logs (``LogSide``s) are replays of different traces, naming
    both and what tells them apart; None when they replay the same one.

    Logs that record the trace file's hash (``kvtrace.statelog.trace_identity``) are
    compared by it (the same bytes under two names are one trace); others by the
    trace's name as given to ``kvtrace replay``."""
    name_a, name_b = a.info.get("trace"), b.info.get("trace")
    file_a, file_b = a.info.get("trace_file") or {}, b.info.get("trace_file") or {}
    if file_a.get("digest") and file_b.get("digest"):
        if file_a["digest"] == file_b["digest"]:
            return None
        what = " and ".join(
            f"{name} ({size:,} bytes, hash {digest[:12]})"
            for name, size, digest in ((name_a, file_a.get("file_bytes") or 0, file_a["digest"]),
                                       (name_b, file_b.get("file_bytes") or 0, file_b["digest"]))
        )
    elif name_a != name_b:
        what = f"{name_a} and {name_b} (by name: a log holds no hash of its trace)"
    else:
        return None
    return f"{a.path} and {b.path} replay different traces: {what}; compared anyway"


class _Teed:
    """A side whose chunks are also handed to ``on_chunk`` as the comparison reads them."""

    def __init__(self, index: int, side: Any, on_chunk: Callable[[int, Any, Chunk], None]) -> None:
        self._index, self._side, self._on_chunk = index, side, on_chunk

    def chunks(self) -> Iterator[Chunk]:
        for chunk in self._side.chunks():
            self._on_chunk(self._index, self._side, chunk)
            yield chunk


class _Windowed:
    """A side's chunks restricted to steps ``[start, stop)``."""

    def __init__(self, side: Any, steps: tuple[int | None, int | None]) -> None:
        self.side, (self.start, self.stop) = side, steps

    def chunks(self) -> Iterator[Chunk]:
        from kvtrace.diff.sides import Chunk

        for chunk in self.side.chunks():
            keep = [s for s in chunk.snapshots
                    if (self.start is None or s.step >= self.start) and (self.stop is None or s.step < self.stop)]
            if keep:
                yield Chunk(snaps=keep)


class _RequireDigests:
    """A log side whose records must carry state digests (``--exact``)."""

    def __init__(self, side: Any, path: Any) -> None:
        self.side, self.path = side, path

    def chunks(self) -> Iterator[Chunk]:
        for chunk in self.side.chunks():
            if len(chunk) and chunk.snapshots[0].digest is None:
                raise ConfigError(
                    f"--exact: {self.path} holds no state digests; write it with 'kvtrace replay TRACE --out LOG "
                    "--digests', or compare without --exact"
                )
            yield chunk


def _config_notes(a: dict[str, Any], b: dict[str, Any]) -> tuple[str, ...]:
    out = []
    for key in ("page_size", "pool_tokens"):
        if a.get(key) is not None and b.get(key) is not None and a.get(key) != b.get(key):
            out.append(f"the sides replay with different {key.replace('_', ' ')}: {a.get(key)} and {b.get(key)}")
    return tuple(out)
