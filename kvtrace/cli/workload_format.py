"""A workload file given to ``record`` or ``sweep``: which format it is in (recognised
from its first bytes, name or header; ``--format`` overrides it), reading it once when it
is a stream, and the options that depend on its format."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer

from kvtrace.cli import ui
from kvtrace.errors import KvtraceError, TraceError, WorkloadError


def infer_format(path: Path, shown: str | None = None) -> str:
    """A workload file's format (or ``trace``), from its first bytes, name or header;
    messages name it ``shown`` (default: the path).

    Raises:
        WorkloadError: the file cannot be read, or is a binary file that is not a trace.
        typer.BadParameter: nothing tells the format (give --format).
    """
    from traces.workloads import WorkloadFileError, guess_format

    try:
        fmt = guess_format(path)
    except WorkloadFileError as exc:
        raise WorkloadError(str(exc)) from None
    if fmt is None:
        raise typer.BadParameter(
            f"cannot tell the format of {shown or path}; give --format mooncake, azure or lengths",
            param_hint="--format",
        )
    return fmt


@contextmanager
def read_once(workload: Path, shown: str) -> Iterator[Path]:
    """The workload as a path that may be opened again (``workloads.rereadable``: a
    stream is copied as it is read, once); errors that name the copy name ``shown``.

    Raises:
        WorkloadError: the workload cannot be read.
    """
    from traces import workloads

    try:
        with workloads.rereadable(workload) as readable:
            if readable == workload:
                yield readable
                return
            try:
                yield readable
            except workloads.WorkloadFileError as exc:
                raise WorkloadError(f"{shown}{':' + str(exc.line) if exc.line else ''}: {exc.message}") from None
            except TraceError as exc:
                if str(readable) not in str(exc):
                    raise
                raise type(exc)(str(exc).replace(str(readable), shown), path=shown) from None
            except KvtraceError as exc:
                if str(readable) not in str(exc):
                    raise
                raise type(exc)(str(exc).replace(str(readable), shown)) from None
    except workloads.WorkloadFileError as exc:
        raise WorkloadError(str(exc)) from None


def check_rate(fmt: str, rate: float | None) -> None:
    """``--rate`` is needed by the lengths format, and only there.

    Raises:
        typer.BadParameter: missing for lengths, not positive, or given for another format.
    """
    if fmt == "lengths":
        if rate is None:
            raise typer.BadParameter("the lengths format needs an arrival rate, e.g. --rate 5", param_hint="--rate")
        if not rate > 0:
            raise typer.BadParameter(f"must be a positive number of requests per second, found {rate}", param_hint="--rate")
    elif rate is not None:
        raise typer.BadParameter(
            f"applies to the lengths format only; {fmt} workloads carry their own arrival times",
            param_hint="--rate",
        )


def note_trace_workload(trace: Path, shown: str) -> None:
    """Warn about what scheduling a trace anew cannot know (naming the trace ``shown``)."""
    from traces.trace_workload import arrival_note, read_trace_workload

    workload = read_trace_workload(trace)
    note = arrival_note(workload)
    if note is not None:
        ui.warn(f"{shown}: {note}")
    if workload.unfinished:
        ui.warn(
            f"{shown}: {workload.unfinished:,} requests never finished in the trace (aborted, or live at its end); "
            "each generates what it had generated there"
        )
