"""Which format a workload file given to ``record`` or ``sweep`` is in, recognised from
its first bytes, name or header (``--format`` overrides it)."""

from __future__ import annotations

from pathlib import Path

import typer

from kvtrace.errors import WorkloadError


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
