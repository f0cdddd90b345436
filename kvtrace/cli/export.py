"""``kvtrace export``: a replay (of a trace, or a saved state log) as a Perfetto or Chrome trace.

The replay pipeline and the writers (``kvtrace.export``) are imported inside the
command, when it runs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from kvtrace.cli import command, ui
from kvtrace.cli.options import (
    AllocatorOpt,
    CheckMode,
    CheckOpt,
    Device,
    DeviceOpt,
    ExitFirstOpt,
    ForceOpt,
    IgnoreMemoryCheckOpt,
    JsonOpt,
    MaxViolationsOpt,
    NoColorOpt,
    OnBadOp,
    OnBadOpOpt,
    OnOom,
    OnOomOpt,
    QuietOpt,
    StepsOpt,
    WhatIfPageSizeOpt,
    WhatIfPoolTokensOpt,
    examples,
)
from kvtrace.cli.replay import check_device, parse_step_range, warn_truncated
from traces.samples import SAMPLE_PREFIX


class ExportFormat(str, Enum):
    """The file ``kvtrace export`` writes (``kvtrace.export.run.FORMATS``)."""

    perfetto = "perfetto"
    chrome = "chrome"


EXPORT_EXAMPLES = examples(
    "# the one-hour sample as a Perfetto trace: open it at https://ui.perfetto.dev",
    "kvtrace export sample:mooncake-conversation --to perfetto --out conversation.pftrace",
    "# a small replay for chrome://tracing, on a smaller pool (what-if)",
    "kvtrace export sample:tiny --to chrome --out tiny.json --pool-tokens 2048",
    "# a saved state log (kvtrace replay TRACE --out LOG)",
    "kvtrace export run.arrow --out run.pftrace",
)


@command("export", epilog=EXPORT_EXAMPLES)
def export(
    source: Annotated[
        str,
        typer.Argument(
            metavar="TRACE|LOG",
            help=f"A trace (.kvtrace, or {SAMPLE_PREFIX}NAME) to replay, or a state log written by "
            "'kvtrace replay TRACE --out LOG'.",
            show_default=False,
        ),
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="The file to write (.pftrace for perfetto, .json for chrome).", show_default=False)],
    to: Annotated[ExportFormat | None, typer.Option("--to", help="perfetto: Perfetto's protobuf trace, streamed (any length); chrome: Trace Event Format JSON (small replays).", show_default="chrome for a .json --out, else perfetto")] = None,
    flows: Annotated[bool, typer.Option("--flows", help="Draw an arrow from each eviction (the request whose allocation evicted) to every later admission that missed its tokens (kvtrace explain's attribution, run along: about twice the time of a plain export; a trace with a radix cache).")] = False,
    page_size: WhatIfPageSizeOpt = None,
    pool_tokens: WhatIfPoolTokensOpt = None,
    device: DeviceOpt = Device.cpu,
    check: CheckOpt = CheckMode.end,
    max_violations: MaxViolationsOpt = None,
    first_violation: ExitFirstOpt = False,
    on_oom: OnOomOpt = OnOom.stop,
    on_bad_op: OnBadOpOpt = OnBadOp.stop,
    steps: StepsOpt = None,
    allocator: AllocatorOpt = "builtin",
    ignore_memory_check: IgnoreMemoryCheckOpt = False,
    force: ForceOpt = False,
    quiet: QuietOpt = False,
    no_color: NoColorOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Export a replay as a timeline for Perfetto (ui.perfetto.dev) or chrome://tracing.

    A TRACE is replayed (every replay option applies, as in kvtrace replay); a state LOG is
    read back. The file holds, on the trace's simulated serving time: counter tracks per pool
    (free, evictable, protected, committed, over-allocated tokens) and the prefix hit rate over
    the last admissions; each request as a slice from admission to release, with its phases
    nested, packed into reusable lanes (as many as requests held KV at once at the peak); and
    instants for evictions, retractions, aborts, out-of-memory, violations and over-allocation
    releases. With --flows, an arrow from each eviction to every later admission that missed
    tokens because of it.

    Exit code: 0 written; 1 written, and the replay found violations, an out-of-memory (with
    --on-oom stop) or skipped bad ops; 2 bad input.
    """
    from kvtrace.export.run import ProcessExport, format_of, is_state_log, open_timeline_file
    from kvtrace.outputs import OutputFile
    from traces.samples import resolve_trace

    if to is None:
        to = ExportFormat(format_of(out))

    path = resolve_trace(source)  # a missing file: one line (a sample name: its bundled file)
    from_log = not source.startswith(SAMPLE_PREFIX) and is_state_log(path)
    if from_log:
        _refuse_replay_options(page_size=page_size, pool_tokens=pool_tokens, device=device, check=check,
                               max_violations=max_violations, first_violation=first_violation, on_oom=on_oom,
                               on_bad_op=on_bad_op, steps=steps, allocator=allocator,
                               ignore_memory_check=ignore_memory_check, flows=flows)
    start, stop = parse_step_range(steps)
    target = OutputFile(out, force=force, inputs=[path])
    t0 = time.perf_counter()
    failed = False
    summary: dict[str, Any]
    if from_log:
        from kvtrace.statelog.log import read_state_log

        info, snapshots = read_state_log(path)
        name = f"{info.get('trace', source)} ({info.get('allocator', '?')}, state log)"
        with target.writing() as tmp, open_timeline_file(tmp, to.value) as file:
            export_ = ProcessExport(file, name)
            with ui.progress(f"exporting {source}") as line:
                for snap in snapshots:
                    export_.feed(snap)
                    if line.due():
                        line.show(0, f"step {snap.step:,}  t={snap.time_s:,.0f}s")
            written = export_.finish()
        summary = {"input": source, "kind": "state_log"}
    else:
        from kvtrace.replay.engine import ReplayOptions
        from kvtrace.replay.session import ReplaySession

        check_device(device.value)
        options = ReplayOptions(check=check.value, on_oom=on_oom.value, on_bad_op=on_bad_op.value,  # type: ignore[arg-type]
                                start_step=start, stop_step=stop,
                                max_violations=1 if first_violation else max_violations)
        with ReplaySession(source, version=allocator, page_size=page_size, pool_tokens=pool_tokens,
                           device=device.value, options=options, force_memory=ignore_memory_check) as session:
            name = f"{source} ({session.version.spec})"
            tracker = None
            if flows:
                from kvtrace.export.flows import EvictionFlows

                tracker = EvictionFlows.attach(session)  # no radix cache: one line, exit 2
            with target.writing() as tmp, open_timeline_file(tmp, to.value) as file:
                export_ = ProcessExport(file, name, flows=tracker)
                with ui.progress(f"exporting {source}", total=1.0) as line:
                    for snap in session.snapshots():
                        export_.feed(snap)
                        if line.due():
                            line.show(session.progress, f"step {snap.step:,}  t={snap.time_s:,.0f}s")
                written = export_.finish()
            result = session.result()
        failed = result.failed
        summary = {"input": source, "kind": "trace", "replay": result.to_dict()}
        if summary["replay"].get("truncated"):
            warn_truncated(source)
    summary.update({
        "out": str(out),
        "format": to.value,
        "steps": written.steps,
        "first_step": written.first_step,
        "last_step": written.last_step,
        "records": written.records,
        "lanes": written.lanes,
        "pools": list(written.pools),
        **({} if written.flows is None else {"flows": written.flows}),
        "file_bytes": out.stat().st_size,
        "wall_s": time.perf_counter() - t0,
    })
    if as_json:
        ui.emit_json(summary)
    else:
        viewer = "https://ui.perfetto.dev (Open trace file)" if to is ExportFormat.perfetto else "chrome://tracing or https://ui.perfetto.dev"
        ui.console().print(
            f"{out}: {written.steps:,} steps, {written.lanes:,} request lanes, pools {', '.join(written.pools) or '-'}, "
            f"{'' if written.flows is None else f'{written.flows:,} eviction flows, '}"
            f"{summary['file_bytes']:,} bytes ({to.value}); open it in {viewer}",
            markup=False,
            highlight=False,
        )
    raise typer.Exit(1 if failed else 0)


def _refuse_replay_options(**given: Any) -> None:
    """Raises typer.BadParameter naming the first replay option given with a state log."""
    defaults = {"page_size": None, "pool_tokens": None, "device": Device.cpu, "check": CheckMode.end,
                "max_violations": None, "first_violation": False, "on_oom": OnOom.stop, "on_bad_op": OnBadOp.stop,
                "steps": None, "allocator": "builtin", "ignore_memory_check": False, "flows": False}
    names = {"first_violation": "--exitfirst"}
    for key, value in given.items():
        if value != defaults[key]:
            option = names.get(key, "--" + key.replace("_", "-"))
            raise typer.BadParameter(f"{option} applies to a trace it replays, not to a state log (it is read back "
                                     "as it was replayed)", param_hint=option)


@contextmanager
def export_diff_tee(target: Any, trace: str) -> Iterator[Any]:
    """``kvtrace diff TRACE --export``: yields a ``DiffSidesExport`` writing both sides into
    ``target`` (an ``OutputFile``) as the diff replays them (its ``chunk`` is the diff's
    ``on_chunk``; call ``finish(report)`` once the diff is done). The file is put in place
    when the block completes, and left out if it raises."""
    from kvtrace.export.run import DiffSidesExport, format_of, open_timeline_file

    with target.writing() as tmp, open_timeline_file(tmp, format_of(target.path)) as file:
        yield DiffSidesExport(file, trace)


def export_diff(report: dict[str, Any], inputs: list[str], target: Any, *, a: str, b: str, page_size: int | None,
                pool_tokens: int | None, device: str, options: Any) -> None:
    """``kvtrace diff LOG_A LOG_B --export``: both state logs in one timeline file (two
    processes on one clock), read back after the diff, the first divergence marked on both
    (for a trace ``kvtrace diff`` uses ``export_diff_tee``, which writes the sides as the diff
    replays them; here a trace's sides are replayed again).

    Args:
        report: the diff's ``--json`` object (its versions and first divergence).
        inputs: the diff's inputs (one trace, or two state logs).
        target: the ``OutputFile`` to write.
        options: the ``ReplayOptions`` of the diff's replays.
    """
    from kvtrace.export.run import export_sides, format_of

    first = report.get("first_divergence")
    versions = report.get("versions", {})
    labels = [versions.get(side, {}).get("label") or spec for side, spec in (("a", a), ("b", b))]

    def sides() -> Any:
        if len(inputs) == 2:
            from kvtrace.statelog.log import read_state_log

            for side, log in zip("AB", inputs):
                yield f"{side}: {log}", read_state_log(log)[1]
            return
        from kvtrace.replay.session import ReplaySession

        for side, spec, label in zip("AB", (a, b), labels):
            with ReplaySession(inputs[0], version=spec, page_size=page_size, pool_tokens=pool_tokens, device=device,
                               options=options) as session:
                yield f"{side}: {inputs[0]} ({label})", session.snapshots()

    to = format_of(target.path)
    with target.writing() as tmp, ui.progress(f"exporting the diff to {target.path.name}") as line:
        export_sides(tmp, to, sides(), mark_step=None if first is None else first["step"],
                     mark={} if first is None else {k: str(v) for k, v in first.items() if v is not None},
                     on_step=lambda snap: line(0, f"step {snap.step:,}"))
