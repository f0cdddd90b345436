"""Export a replay: its snapshots through the timeline model into a Perfetto or Chrome file.

``open_timeline_file(path, to)`` opens the file (one or more processes on one clock);
``ProcessExport`` feeds one replay's snapshots into one process of it::

    with open_timeline_file(tmp, "perfetto") as out:
        export = ProcessExport(out, "sample:tiny (builtin)")
        for snap in session.snapshots():
            export.feed(snap)
        summary = export.finish()

``is_state_log`` tells a state log (``kvtrace replay --out``) from a trace.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from kvtrace.export.timeline import DEFAULT_HIT_WINDOW, TimelineBuilder, ts_ns

if TYPE_CHECKING:
    from kvtrace.export.flows import EvictionFlows
    from kvtrace.replay.snapshot import StepSnapshot

__all__ = [
    "DiffSidesExport",
    "FORMATS",
    "ExportSummary",
    "Format",
    "ProcessExport",
    "export_sides",
    "format_of",
    "is_state_log",
    "open_timeline_file",
]

Format = Literal["perfetto", "chrome"]
FORMATS: tuple[Format, ...] = ("perfetto", "chrome")


class ExportSummary(NamedTuple):
    """What one replay's export wrote."""

    steps: int
    records: int
    lanes: int  # request lanes: the peak number of requests holding KV at once
    pools: tuple[str, ...]
    first_step: int | None
    last_step: int | None
    flows: int | None = None  # eviction-to-miss arrows, when drawn


@contextmanager
def open_timeline_file(path: str | Path, to: Format) -> Iterator[Any]:
    """Open ``path`` for a timeline in format ``to``; yields an object whose ``process(name)``
    adds a process (a replay) to the file. The file is complete when the block ends.

    Raises:
        ValueError: an unknown format.
    """
    if to == "perfetto":
        from kvtrace.export.perfetto import PerfettoFile

        with open(path, "wb") as f:
            yield PerfettoFile(f)
    elif to == "chrome":
        from kvtrace.export.chrome import ChromeFile

        with open(path, "w", encoding="utf-8") as f:
            out = ChromeFile(f)
            yield out
            out.close()
    else:
        raise ValueError(f"unknown export format {to!r}; use one of {', '.join(FORMATS)}")


class ProcessExport:
    """One replay as one process of a timeline file: ``feed`` its snapshots in step order,
    then ``finish``.

    Args:
        out: the file (``open_timeline_file``).
        name: the process's name in the viewer.
        hit_window: admissions the hit-rate track is taken over.
        flows: the eviction flows of the replay being fed (``EvictionFlows.attach``), if drawn.
        pid: its process id in the viewer (default: 1, 2, ... in order of creation).
    """

    def __init__(self, out: Any, name: str, *, hit_window: int = DEFAULT_HIT_WINDOW,
                 flows: EvictionFlows | None = None, pid: int | None = None) -> None:
        self.process = out.process(name, pid)
        self.builder = TimelineBuilder(hit_window)
        self.flows = flows
        self._write = self.process.write
        self.steps = 0
        self.records = 0
        self.first_step: int | None = None
        self.last_step: int | None = None

    def feed(self, snap: StepSnapshot) -> None:
        """Write the records of one step."""
        if self.first_step is None:
            self.first_step = snap.step
        self.last_step = snap.step
        self.steps += 1
        records = self.builder.feed(snap)
        if self.flows is not None:
            records += self.flows.records(snap, self.builder)
        self.records += len(records)
        for record in records:
            self._write(record)

    def marker(self, ts_ns: int, name: str, args: dict[str, Any]) -> None:
        """A named instant on the process's events track."""
        self.process.marker(ts_ns, name, args)

    def finish(self) -> ExportSummary:
        """Close the slices still open; what was written."""
        records = self.builder.finish()
        self.records += len(records)
        for record in records:
            self._write(record)
        b = self.builder
        flows = None if self.flows is None else self.flows.flows
        return ExportSummary(self.steps, self.records, b.num_lanes, tuple(b.pools), self.first_step, self.last_step,
                             flows)


def export_sides(
    path: str | Path,
    to: Format,
    sides: Iterable[tuple[str, Iterable[StepSnapshot]]],
    *,
    mark_step: int | None = None,
    mark: dict[str, Any] | None = None,
    on_step: Callable[[StepSnapshot], None] | None = None,
) -> list[ExportSummary]:
    """Several replays of one trace in one file, one process each, on the same clock
    (``kvtrace diff --export``), written one after the other.

    Args:
        path: the file to write.
        to: its format.
        sides: (process name, snapshots) per replay.
        mark_step: a step marked on every side (the first divergence): an instant named
            ``first divergence`` at that step's time (at the side's last step if it ended before).
        mark: the marker's arguments.
        on_step: called with each snapshot after it is written (progress).
    """
    summaries = []
    with open_timeline_file(path, to) as out:
        for name, snapshots in sides:
            export = ProcessExport(out, name)
            marked = mark_step is None
            last = None
            for snap in snapshots:
                export.feed(snap)
                last = snap
                if not marked and snap.step >= mark_step:  # type: ignore[operator]
                    export.marker(ts_ns(snap.time_s), "first divergence", mark or {})
                    marked = True
                if on_step is not None:
                    on_step(snap)
            if not marked and last is not None:
                export.marker(ts_ns(last.time_s), "first divergence", mark or {})
            summaries.append(export.finish())
    return summaries


class DiffSidesExport:
    """The sides of ``kvtrace diff TRACE --export`` written as the diff reads them: ``chunk``
    is the diff's ``on_chunk`` (each side one process, pid 1 for A, 2 for B), ``finish``
    marks the first divergence on both and closes them, so no side is replayed again.

    Args:
        out: the file (``open_timeline_file``).
        trace: the trace's name, in the processes' names.
    """

    def __init__(self, out: Any, trace: str) -> None:
        self._out = out
        self._trace = trace
        self._exports: dict[int, ProcessExport] = {}
        # Per side, each step fed and its time: where the marker goes once the diff is done.
        self._steps: dict[int, array[int]] = {}
        self._times: dict[int, array[float]] = {}

    def chunk(self, index: int, side: Any, chunk: Any) -> None:
        """Write one chunk of steps of side ``index`` (0: A, 1: B)."""
        export = self._exports.get(index)
        if export is None:
            export = self._side(index, getattr(side, "label", None) or side.spec)
        steps, times = self._steps[index], self._times[index]
        for snap in chunk.snapshots:
            export.feed(snap)
            steps.append(snap.step)
            times.append(snap.time_s)

    def _side(self, index: int, label: str) -> ProcessExport:
        export = self._exports[index] = ProcessExport(self._out, f"{'AB'[index]}: {self._trace} ({label})",
                                                      pid=index + 1)
        self._steps[index], self._times[index] = array("q"), array("d")
        return export

    def finish(self, report: dict[str, Any]) -> list[ExportSummary]:
        """Mark the first divergence of the diff's ``--json`` ``report`` on each side (at its
        step, or at the side's last if it ended before) and close the slices."""
        versions = report.get("versions", {})
        for index, key in enumerate("ab"):
            if index not in self._exports:  # a side with no step: its process, empty
                self._side(index, versions.get(key, {}).get("label") or versions.get(key, {}).get("spec", key))
        first = report.get("first_divergence")
        summaries = []
        for index in sorted(self._exports):
            export, steps, times = self._exports[index], self._steps[index], self._times[index]
            if first is not None and steps:
                at = min(bisect.bisect_left(steps, first["step"]), len(steps) - 1)
                export.marker(ts_ns(times[at]), "first divergence",
                              {k: str(v) for k, v in first.items() if v is not None})
            summaries.append(export.finish())
        return summaries


def format_of(path: str | Path) -> Format:
    """The format a file name asks for: ``chrome`` for ``.json``, else ``perfetto``."""
    return "chrome" if str(path).lower().endswith(".json") else "perfetto"


def is_state_log(path: str | Path) -> bool:
    """Whether ``path`` is a kvtrace state log (from its Arrow schema's metadata); False for
    anything else, a trace or a file that is not Arrow (its reader says what is wrong)."""
    from kvtrace.statelog.format import is_state_log_schema
    from traces.errors import TraceError
    from traces.ipc import IpcReader

    try:
        return is_state_log_schema(IpcReader(path).schema)
    except (TraceError, OSError):
        return False
