"""``kvtrace diff TRACE... --range BASE..HEAD``: every commit of a series replayed and
compared with BASE, or the first one that changed the allocator's behaviour found by
bisection.

``diff_range`` reads the series (``kvtrace.diff.series``), replays BASE and each commit that
touches the watched paths on each trace, and compares each replay with BASE's on the
same trace with the one step comparator (``kvtrace.diff.walk.compare_sides`` over the two
replays' records). Replays run in a bounded pool of child processes (``kvtrace.proc.child``,
one ``ChildSide`` each, ``jobs`` at a time), each on its commit's ``allocator`` tree,
and are cached (``kvtrace.diff.replaycache``): a commit whose tree, trace and options were
replayed before, in this run or an earlier one, is not replayed again. Two replays whose
records hash the same are identical without a comparison.

A commit that does not import, or whose allocator raises, is an ``error`` on its line
(never an error of the run): it is not shown to preserve behaviour (the run exits 1), nor
to change it (it is never the first diverging commit; a bisection skips it, as ``git
bisect skip`` does). BASE that does not replay is an error of the run (there is nothing
to compare with).

``--bisect`` assumes that "differs from BASE" is monotone along the series (false up to
some commit, true from it on) and finds that commit with at most ceil(log2(N + 1))
replays of the N commits that touch the paths (``first_true``; one more per commit that
does not replay), plus BASE's.

The result is a ``RangeReport``: plain data, ``to_dict()`` is the ``--json`` object.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kvtrace.diff.diff import DiffOptions, DiffReport, SideReport, usable_cpus
from kvtrace.diff.walk import compare_sides
from kvtrace.errors import ConfigError, KvtraceError
from kvtrace.diff.replaycache import CachedReplay, ReplayCache, driver_digest, replay_key, trace_digest
from kvtrace.diff.series import Commit, Series, allocator_checkout, prune_checkouts, read_series
from kvtrace.diff.sides import SideError

if TYPE_CHECKING:
    from kvtrace.replay.engine import ReplayOptions

__all__ = ["CommitResult", "RangeReport", "RangeSettings", "TraceResult", "diff_range", "first_true"]

Status = Literal["identical", "diverged", "error", "skipped", "untested"]
NOT_PRESERVING = ("diverged", "error")
_VERDICT: dict[str, bool | None] = {"identical": False, "diverged": True, "error": None}


@dataclass(frozen=True, slots=True)
class RangeSettings:
    """How every replay of a range runs and how each is compared with BASE's.

    Args:
        options: what to compare (``exact``) and report (``context``, ``max_divergences``).
        replay: checks, OOM and bad-op handling, the ``--steps`` window.
        page_size, pool_tokens, device: what-ifs, the same for every commit.
    """

    options: DiffOptions = DiffOptions()
    replay: ReplayOptions | None = None
    page_size: int | None = None
    pool_tokens: int | None = None
    device: str = "cpu"

    def replay_options(self) -> ReplayOptions:
        from kvtrace.replay.engine import ReplayOptions

        return dataclasses.replace(self.replay or ReplayOptions(), state_digest=self.options.exact)

    def cache_settings(self) -> dict[str, Any]:
        """What a replay's records depend on besides the tree, the trace and the driver."""
        return {
            "replay": dataclasses.asdict(self.replay_options()),
            "page_size": self.page_size,
            "pool_tokens": self.pool_tokens,
            "device": self.device,
        }


@dataclass(frozen=True, slots=True)
class TraceResult:
    """One commit on one trace: identical to BASE, diverged (the first divergence), or
    an error (the message). ``replay_s``: the replay's wall time (when it ran, in this
    run or the earlier one that cached it); ``cached``: it was not replayed in this run."""

    trace: str
    status: Literal["identical", "diverged", "error"]
    first_divergence: dict[str, Any] | None = None
    steps_compared: int = 0
    replay_s: float | None = None
    cached: bool = False
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class CommitResult:
    """One commit of the series and what it did on each trace (none when skipped or
    not tested by a bisection)."""

    commit: Commit
    status: Status
    traces: tuple[TraceResult, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        replayed = self.status not in ("skipped", "untested")
        return {
            "commit": self.commit.commit,
            "short": self.commit.short,
            "subject": self.commit.subject,
            "status": self.status,
            "first_divergence": {t.trace: t.first_divergence for t in self.traces} if replayed else None,
            "traces": [t.to_dict() for t in self.traces],
        }


@dataclass(frozen=True)
class RangeReport:
    """What ``diff_range`` found. ``to_dict()`` is the ``kvtrace diff --range --json`` object."""

    series: Series
    traces: tuple[str, ...]
    base: tuple[TraceResult, ...]
    commits: tuple[CommitResult, ...]
    first_diverging: CommitResult | None
    reports: tuple[DiffReport, ...]
    bisect: bool
    replays: int
    cached: int
    jobs: int
    exact: bool
    wall_s: float

    @property
    def preserved(self) -> bool:
        """Every commit replayed (or, bisecting, the whole series) is identical to BASE."""
        return self.first_diverging is None and not any(c.status in NOT_PRESERVING for c in self.commits)

    def to_dict(self) -> dict[str, Any]:
        s = self.series
        return {
            "range": s.spec,
            "repo": str(s.repo),
            "paths": list(s.paths),
            "traces": list(self.traces),
            "base": s.base.commit,
            "base_subject": s.base.subject,
            "head": s.head,
            "base_replays": [t.to_dict() for t in self.base],
            "commits": [c.to_dict() for c in self.commits],
            "first_diverging_commit": None if self.first_diverging is None else self.first_diverging.commit.commit,
            "divergences": [r.to_dict() for r in self.reports],
            "bisect": self.bisect,
            "replays": self.replays,
            "cached": self.cached,
            "jobs": self.jobs,
            "exact": self.exact,
            "wall_s": round(self.wall_s, 6),
        }


def first_true(n: int, test: Callable[[int], bool | None]) -> int | None:
    """The first ``i`` in ``[0, n)`` where ``test(i)`` is True, for a ``test`` that is
    False up to some index and True from it on, ignoring the indices where it is None
    (cannot tell); None when it is True nowhere.

    Calls ``test`` at most ceil(log2(n + 1)) times (n + 1 possible answers, halved by
    each call), plus once per None it meets (that index is dropped, nothing is halved).
    """
    candidates = list(range(n))
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        verdict = test(candidates[mid])
        if verdict is None:
            del candidates[mid]
            hi -= 1
        elif verdict:
            hi = mid
        else:
            lo = mid + 1
    return candidates[lo] if lo < len(candidates) else None


@dataclass(frozen=True, slots=True)
class _Trace:
    label: str
    path: str
    digest: str


class _Replays:
    """The replays of a range: from memory, from the cache, or run in the pool."""

    def __init__(self, series: Series, traces: list[_Trace], settings: RangeSettings, jobs: int,
                 cache_root: Path | None, on_replay: Callable[[str], None] | None) -> None:
        from kvtrace.versions.git import cache_dir

        self.series, self.traces, self.settings, self.jobs = series, traces, settings, jobs
        self.cache_root = cache_root if cache_root is not None else cache_dir()
        self.cache = ReplayCache(self.cache_root / "replays")
        self.on_replay = on_replay
        self.driver = driver_digest()
        self.done: dict[tuple[str | None, int], CachedReplay | str] = {}
        self.fresh: set[tuple[str | None, int]] = set()  # replayed in this run
        self.hits = 0
        self._live: set[Any] = set()
        self._lock = threading.Lock()
        self._stopping = False
        self._progress = [0, 0]  # replays done, to do (in this ensure)

    def result(self, commit: Commit, trace: int) -> CachedReplay | str:
        return self.done[(commit.allocator_tree, trace)]

    def ensure(self, commits: Sequence[Commit]) -> None:
        """Every commit on every trace replayed (or found cached), ``jobs`` at a time."""
        todo: list[tuple[Commit, int]] = []
        planned: set[tuple[str | None, int]] = set()
        for commit in commits:
            for i in range(len(self.traces)):
                slot = (commit.allocator_tree, i)
                if slot in self.done or slot in planned:
                    continue
                planned.add(slot)
                if commit.allocator_tree is None:
                    self.done[slot] = "this commit has no allocator package"
                    continue
                hit = self.cache.get(self._key(commit.allocator_tree, i))
                if hit is not None:
                    self.done[slot] = hit
                    self.hits += 1
                else:
                    todo.append((commit, i))
        if not todo:
            return
        self._progress = [0, len(todo)]
        pool = ThreadPoolExecutor(max_workers=min(self.jobs, len(todo)), thread_name_prefix="kvtrace-range")
        try:
            futures = [(commit, i, pool.submit(self._replay, commit, i)) for commit, i in todo]
            for commit, i, future in futures:
                self.done[(commit.allocator_tree, i)] = future.result()
                self.fresh.add((commit.allocator_tree, i))
        except BaseException:
            self._stop()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _key(self, tree: str, trace: int) -> str:
        return replay_key(tree, self.traces[trace].digest, self.settings.cache_settings(), self.driver)

    def _stop(self) -> None:
        with self._lock:
            self._stopping = True
            live = list(self._live)
        for side in live:
            side.close()

    def _replay(self, commit: Commit, trace: int) -> CachedReplay | str:
        """Thread: replay one commit on one trace in a child process, into the cache.
        Returns the cached replay, or the one-line reason it failed."""
        got = self._run_child(commit, trace)
        with self._lock:
            self._progress[0] += 1
            done, total = self._progress
        if self.on_replay is not None:
            label = self.traces[trace].label
            self.on_replay(
                f"could not replay {commit.short} on {label} ({done}/{total})" if isinstance(got, str) else
                f"replayed {commit.short} on {label} in {got.summary.get('wall_s', 0):.1f} s ({done}/{total})"
            )
        return got

    def _run_child(self, commit: Commit, trace: int) -> CachedReplay | str:
        from kvtrace.versions.registry import ChildVersion
        from kvtrace.diff.sides import ChildSide, side_job

        assert commit.allocator_tree is not None
        t = self.traces[trace]
        spec = f"git:{commit.short}"
        name = f"{commit.short} on {t.label}"
        s = self.settings
        writer = self.cache.writer()
        side: Any = None
        try:
            with allocator_checkout(self.series.repo, commit.allocator_tree, self.cache_root) as root:
                version = ChildVersion(spec, spec, root, origin=f"commit {commit.commit[:12]} of {self.series.repo}",
                                       commit=commit.commit)
                job = side_job(version, t.path, trace_label=t.label, page_size=s.page_size, pool_tokens=s.pool_tokens,
                               device=s.device, options=dataclasses.asdict(s.replay_options()), checker="inline")
                with self._lock:
                    if self._stopping:  # the run is being interrupted: start nothing more
                        writer.abort()
                        return "not replayed: the run was interrupted"
                    side = ChildSide(name, job)
                    self._live.add(side)
                for chunk in side.chunks():
                    writer.write(chunk.batch)
                summary = side.summary()
        except KvtraceError as exc:  # the child's error (SideError), or git's
            writer.abort()
            return str(exc).removeprefix(f"side {name} ({spec}): ").removeprefix("internal error: ")
        except BaseException:
            writer.abort()
            raise
        finally:
            if side is not None:
                side.close()
                with self._lock:
                    self._live.discard(side)
        return self.cache.put(self._key(commit.allocator_tree, trace), writer, summary)


def _side(series: Series, commit: Commit, summary: dict[str, Any], base: bool) -> SideReport:
    spec = f"git:{commit.short}"
    label = f"{'BASE ' if base else ''}{commit.short} {commit.subject[:40]}"
    return SideReport(spec, label, f"commit {commit.commit[:12]} of {series.repo}", summary)


def _compare(replays: _Replays, commit: Commit, trace: int, options: DiffOptions) -> tuple[TraceResult, DiffReport | None]:
    """One commit on one trace against BASE."""
    from kvtrace.diff.sides import LogSide

    series, t = replays.series, replays.traces[trace]
    got = replays.result(commit, trace)
    if isinstance(got, str):
        return TraceResult(t.label, "error", error=got), None
    replay_s = got.summary.get("wall_s")
    cached = (commit.allocator_tree, trace) not in replays.fresh
    base = replays.result(series.base, trace)
    assert not isinstance(base, str)
    if got.records == base.records:
        return TraceResult(t.label, "identical", steps_compared=got.steps, replay_s=replay_s, cached=cached), None
    t0 = time.perf_counter()
    sides = [LogSide(base.log), LogSide(got.log)]
    try:
        steps, found = compare_sides(sides[0], sides[1], options)
    finally:
        for side in sides:
            side.close()
    report = DiffReport(
        t.label, _side(series, series.base, {**base.summary, "trace": t.label}, True),
        _side(series, commit, {**got.summary, "trace": t.label}, False), "logs", options.exact, steps, tuple(found),
        time.perf_counter() - t0,
    )
    if report.identical:  # equal records, timings aside, that hash differently (another writer)
        return TraceResult(t.label, "identical", steps_compared=steps, replay_s=replay_s, cached=cached), None
    first = report.to_dict()["first_divergence"]
    return TraceResult(t.label, "diverged", first, steps, replay_s, cached), report


def _commit_result(replays: _Replays, commit: Commit, options: DiffOptions) -> tuple[CommitResult, list[DiffReport]]:
    results, reports = [], []
    for i in range(len(replays.traces)):
        result, report = _compare(replays, commit, i, options)
        results.append(result)
        if report is not None:
            reports.append(report)
    statuses = {r.status for r in results}
    status: Status = "error" if "error" in statuses else "diverged" if "diverged" in statuses else "identical"
    return CommitResult(commit, status, tuple(results)), reports


def _open_traces(traces: Sequence[str]) -> list[_Trace]:
    from kvtrace.replay.session import open_trace

    if not traces:
        raise ConfigError("--range: give at least one TRACE to replay")
    seen: set[str] = set()
    out = []
    for label in traces:
        path = str(open_trace(label).path)  # one clear line for a missing or broken file
        if path in seen:
            raise ConfigError(f"{label}: this trace is given twice")
        seen.add(path)
        out.append(_Trace(label, path, trace_digest(path)))
    return out


def diff_range(
    traces: Sequence[str],
    rev_range: str,
    *,
    paths: Sequence[str] = ("allocator",),
    repo: str | Path | None = None,
    settings: RangeSettings | None = None,
    jobs: int | None = None,
    bisect: bool = False,
    cache_root: Path | None = None,
    on_replay: Callable[[str], None] | None = None,
) -> RangeReport:
    """Replay each commit of ``rev_range`` that touches ``paths`` on each trace and compare
    it with BASE; or, with ``bisect``, find the first commit that differs from BASE.

    Args:
        traces: trace paths or ``sample:NAME``.
        rev_range: ``BASE..HEAD`` (the first-parent path).
        paths: the watched paths (relative to the repository's top).
        repo: a directory inside the repository (default: the current directory).
        settings: replay options, what-ifs, what to compare.
        jobs: replays at once (default: every usable core).
        bisect: replay only what a bisection needs (assumes "differs from BASE" is
            monotone along the series).
        cache_root: the kvtrace cache directory (default ``kvtrace.versions.git.cache_dir()``).
        on_replay: called with a line of progress after each replay (from a worker thread).

    Raises:
        KvtraceError: a bad range, path, trace or option; BASE that does not replay.
    """
    t0 = time.perf_counter()
    settings = settings or RangeSettings()
    if jobs is not None and jobs < 1:
        raise ConfigError(f"--jobs must be at least 1, found {jobs}")
    jobs = jobs or usable_cpus()
    series = read_series(rev_range, paths=paths, repo=repo)
    opened = _open_traces(traces)
    if series.base.allocator_tree is None:
        raise ConfigError(f"--range {rev_range}: BASE {series.base.short} has no allocator package")
    replays = _Replays(series, opened, settings, jobs, cache_root, on_replay)
    touched = series.touched
    results: dict[str, CommitResult] = {}
    reports: dict[str, list[DiffReport]] = {}

    def evaluate(commit: Commit) -> CommitResult:
        if commit.commit not in results:
            replays.ensure([series.base, commit])
            _check_base(replays)
            results[commit.commit], reports[commit.commit] = _commit_result(replays, commit, settings.options)
        return results[commit.commit]

    if bisect:
        found = first_true(len(touched), lambda i: _VERDICT[evaluate(touched[i]).status])
        first = None if found is None else results[touched[found].commit]
    else:
        replays.ensure([series.base, *touched])
        for commit in touched:
            evaluate(commit)
        first = next((results[c.commit] for c in touched if results[c.commit].status == "diverged"), None)
    if not touched:
        replays.ensure([series.base])
        _check_base(replays)
    commits = tuple(
        results.get(c.commit) or CommitResult(c, "untested" if c.touches else "skipped") for c in series.commits
    )
    base = tuple(_base_result(replays, i) for i in range(len(opened)))
    replays.cache.prune()
    prune_checkouts(replays.cache_root)
    return RangeReport(
        series, tuple(t.label for t in opened), base, commits, first,
        tuple(reports.get(first.commit.commit, ())) if first is not None else (), bisect, len(replays.fresh),
        replays.hits, jobs, settings.options.exact, time.perf_counter() - t0,
    )


def _check_base(replays: _Replays) -> None:
    series = replays.series
    for i, t in enumerate(replays.traces):
        got = replays.result(series.base, i)
        if isinstance(got, str):
            raise SideError(f"--range {series.spec}: BASE {series.base.short} ({series.base.subject}) does not replay "
                            f"on {t.label}: {got}")


def _base_result(replays: _Replays, trace: int) -> TraceResult:
    got = replays.result(replays.series.base, trace)
    assert not isinstance(got, str)
    fresh = (replays.series.base.allocator_tree, trace) in replays.fresh
    return TraceResult(replays.traces[trace].label, "identical", steps_compared=got.steps,
                       replay_s=got.summary.get("wall_s"), cached=not fresh)
