"""``kvtrace compact``: rewrite a trace recorded as an Arrow IPC stream as an IPC file.

A recording is written as a stream, step by step, and compacted into an IPC
*file* (a footer, bigger record batches, zstd) when it completes. One that was
interrupted, killed, or stopped while compacting stays a stream: kvtrace reads
it, but polars' ``scan_ipc`` / ``read_ipc``, pandas' ``read_feather`` and DuckDB
read IPC files only. This command compacts such a trace, in place (a temporary
file renamed over it) or into ``--out``; what it holds (its steps, its recording
status) does not change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from kvtrace.cli import command, ui
from kvtrace.cli.options import ForceOpt, JsonOpt, NoColorOpt, QuietOpt, TraceArg, examples

# Whole steps per record batch of the compacted file (as a completed recording's).
COMPACT_STEPS_PER_BATCH = 256

COMPACT_EXAMPLES = examples(
    "# an interrupted recording, made readable by polars, pandas and DuckDB, in place",
    "kvtrace compact run.kvtrace",
    "# into another file, the stream left as it is",
    "kvtrace compact run.kvtrace --out run-compact.kvtrace",
)


@command("compact", epilog=COMPACT_EXAMPLES)
def compact(
    trace: TraceArg,
    out: Annotated[
        Optional[Path],
        typer.Option("--out", "-o", help="Write the compacted trace here instead of replacing TRACE.", show_default=False),
    ] = None,
    force: ForceOpt = False,
    steps_per_batch: Annotated[
        int, typer.Option("--steps-per-batch", min=1, help="Whole steps per record batch of the compacted file.")
    ] = COMPACT_STEPS_PER_BATCH,
    quiet: QuietOpt = False,
    no_color: NoColorOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Rewrite TRACE (an Arrow IPC stream: an interrupted or killed recording) as an Arrow IPC
    file, in place unless --out is given; its steps and recording status stay as they are.

    Exit code: 0 compacted; 2 bad input.
    """
    from kvtrace.errors import OutputError
    from kvtrace.outputs import OutputFile, terminating_cleanly
    from traces.atomic import remove_stale_temporaries
    from traces.reader import TraceReader
    from traces.samples import SAMPLE_PREFIX, resolve_trace
    from traces.writer import compact_trace

    source = resolve_trace(trace)
    reader = TraceReader(source)  # a bad trace: one line, before anything is written
    before = reader.ipc_format
    bytes_before = source.stat().st_size
    if out is None:
        if trace.startswith(SAMPLE_PREFIX):
            raise OutputError(f"{trace} is a bundled sample; compact it into a file of yours with --out FILE")
        remove_stale_temporaries(source)  # of an earlier compaction killed outright
        with terminating_cleanly():
            steps = compact_trace(source, steps_per_batch=steps_per_batch)
        dest = source
    else:
        target = OutputFile(out, force=force, inputs=[source])
        with target.writing() as tmp:
            steps = compact_trace(source, steps_per_batch=steps_per_batch, out=tmp)
        dest = out
    compacted = TraceReader(dest)
    summary = {
        "trace": str(trace),
        "out": str(dest),
        "format_before": before,
        "format": compacted.ipc_format,
        "steps": steps,
        "bytes_before": bytes_before,
        "file_bytes": dest.stat().st_size,
        "recording": None if compacted.recording is None else compacted.recording.status,
    }
    if as_json:
        ui.emit_json(summary)
        return
    what = "an IPC stream" if before == "stream" else "already an IPC file"
    ui.console().print(
        f"{dest}: {steps:,} steps, {summary['file_bytes']:,} bytes as an Arrow IPC file "
        f"(was {what}, {bytes_before:,} bytes)",
        markup=False,
        highlight=False,
    )
