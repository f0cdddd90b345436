"""``kvtrace sweep``: what-if grids on this machine's cores or on a Ray cluster, and
``kvtrace sweep report``: their table and plots.

``kvtrace sweep INPUT... --pool-tokens … --out results.parquet`` is ``kvtrace sweep
run …`` (the group's default command). The command parses and checks every option
and every combination up front (one line, exit 2), then hands the grid to
``kvtrace.sweep.run_sweep``; the sweep, Ray and matplotlib are imported only when
a command runs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer.core import TyperGroup

from kvtrace.cli import KvtraceCommand, _flags_as_flags, add_group, ui, whole_option_names
from kvtrace.cli.options import (
    CheckMode,
    Device,
    DeviceOpt,
    ForceOpt,
    JsonOpt,
    NoColorOpt,
    OnOom,
    QuietOpt,
    examples,
    finite,
)
from kvtrace.errors import ConfigError, WorkloadError

if TYPE_CHECKING:
    from kvtrace.sweep import Grid, SweepInput


class _DefaultRun(TyperGroup):
    """``kvtrace sweep ARGS`` runs ``kvtrace sweep run ARGS`` unless ARGS name a subcommand."""

    def get_params(self, ctx: typer.Context) -> list[Any]:
        return _flags_as_flags(super().get_params(ctx))

    def format_help(self, ctx: typer.Context, formatter: Any) -> None:
        with whole_option_names():
            super().format_help(ctx, formatter)

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("-h", "--help"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


SWEEP_EXAMPLES = examples(
    "# re-schedule a workload on 3 pool sizes x 3 page sizes, on every core",
    "kvtrace sweep conversation_trace.jsonl --duration 10m --pool-tokens 100k,400k,1M --page-size 1,16,64 -o r.parquet",
    "# replay a trace's recorded schedule with two allocator versions",
    "kvtrace sweep run.kvtrace --versions builtin,mypkg.alloc:create --pool-tokens 200k,900k -o r.parquet",
    "# schedule a trace's requests anew, with and without EAGLE, on a Ray cluster",
    "kvtrace sweep run.kvtrace --reschedule --spec off,eagle:3,1,4 --pool-tokens 100k,1M --ray auto -o r.parquet",
    "# the table and plots of the results",
    "kvtrace sweep report r.parquet",
)


sweep_app = typer.Typer(
    cls=_DefaultRun,
    no_args_is_help=True,
    epilog=SWEEP_EXAMPLES,
    help="What-if grids: every combination of pool size, page size, version, … over workloads or traces. "
    "'kvtrace sweep INPUT... OPTIONS' is 'kvtrace sweep run INPUT... OPTIONS'.",
)
add_group(sweep_app, "sweep")



def _axis(text: str | None, option: str, *, minimum: int = 1) -> tuple[int | None, ...]:
    from kvtrace.sweep import parse_counts

    if text is None:
        return (None,)
    try:
        return tuple(parse_counts(text, option, minimum=minimum))
    except ValueError as exc:
        raise typer.BadParameter(str(exc).removeprefix(f"{option}: "), param_hint=option) from None


def _ratios(text: str | None, option: str) -> tuple[float | None, ...]:
    from kvtrace.sweep import parse_ratios

    if text is None:
        return (None,)
    try:
        return tuple(parse_ratios(text, option))
    except ValueError as exc:
        raise typer.BadParameter(str(exc).removeprefix(f"{option}: "), param_hint=option) from None


def _versions(text: str) -> tuple[str, ...]:
    from kvtrace.versions.registry import resolve_version

    specs = tuple(v.strip() for v in text.split(",") if v.strip())
    if not specs or len(set(specs)) != len(specs):
        raise typer.BadParameter(f"{text!r}: give distinct versions, comma-separated", param_hint="--versions")
    for spec in specs:
        resolve_version(spec)  # one line naming it when it does not load
    return specs


def _specs(text: str | None) -> tuple[str | None, ...]:
    from kvtrace.cli.spec_option import parse_spec
    from kvtrace.sweep import parse_specs

    if text is None:
        return (None,)
    try:
        specs = parse_specs(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc).removeprefix("--spec: "), param_hint="--spec") from None
    for spec in specs:
        parse_spec(spec)
    return tuple(specs)


def _input(arg: str, reschedule: bool) -> SweepInput:
    """One INPUT: a trace (path or sample:NAME) or a workload file, and how it runs."""
    from kvtrace.cli.workload_format import infer_format
    from kvtrace.sweep import SweepInput
    from traces.reader import TraceReader
    from traces.samples import SAMPLE_PREFIX, resolve_trace

    path = resolve_trace(arg) if arg.startswith(SAMPLE_PREFIX) else Path(arg)
    if not path.exists():
        raise WorkloadError(f"{arg}: no such file; give a workload file, a trace or sample:NAME")
    if path.is_dir():
        raise WorkloadError(f"{arg}: is a directory, expected a workload file or a trace")
    fmt = infer_format(path)
    if fmt == "trace":
        TraceReader(path).meta  # noqa: B018 - one line when it is not a readable trace
    kind = "replay" if fmt == "trace" and not reschedule else "simulate"
    stat = path.stat()
    return SweepInput(label=arg, path=str(path), fmt=fmt, kind=kind, stamp=f"{stat.st_size}-{stat.st_mtime_ns}")


def _check_grid(grid: Grid, given: dict[str, str | None]) -> None:
    """Every combination must be one an allocator and the scheduler model take."""
    from kvtrace.cli.record import check_serving
    from kvtrace.versions.registry import resolve_version
    from kvtrace.record.serving import serving_settings
    from traces.reader import TraceReader

    for name in ("--spec", "--max-running", "--chunk"):
        replayed = [s.label for s in grid.inputs if s.kind == "replay"]
        if given[name] is not None and replayed:
            raise typer.BadParameter(
                f"applies to simulated cells; {replayed[0]} is a trace replayed with its recorded schedule "
                "(add --reschedule to schedule its requests anew)",
                param_hint=name,
            )
    for name in ("--swa-window", "--swa-full-tokens-ratio"):
        if given[name] is None:
            continue
        for source in grid.inputs:
            if source.kind == "replay" or source.fmt == "trace":
                layout = TraceReader(source.path).meta.attention
            else:
                layout = serving_settings(Path(source.path), source.fmt, {}).get("attention")
            if layout is None:
                what = "trace" if source.fmt == "trace" else "workload (simulated as one)"
                raise typer.BadParameter(
                    f"{source.label} is a full-attention {what}: no sliding window or SWA pool to vary; "
                    "give traces of hybrid SWA models (kvtrace info shows a trace's attention)",
                    param_hint=name,
                )
    fixed = {v: resolve_version(v).page_size for v in grid.versions}
    for version, own in fixed.items():
        for page in grid.page_sizes:
            if own is not None and page is not None and page != own:
                raise typer.BadParameter(
                    f"{page} conflicts with --versions {version}, which runs with page size {own}; drop one of the two",
                    param_hint="--page-size",
                )
    for source in grid.inputs:
        base = serving_settings(Path(source.path), source.fmt, {}) if source.kind == "simulate" else None
        meta = TraceReader(source.path).meta.config if base is None else None
        for cell in grid.cells():
            if cell.input != source:
                continue
            page = fixed[cell.version] or cell.page_size
            if base is not None:
                chunk = base["chunk"] if cell.chunk is None else cell.chunk
                check_serving(cell.pool_tokens or base["pool_tokens"], page or base["page_size"], chunk or 0)
            else:
                assert meta is not None
                pool, page = cell.pool_tokens or meta.pool_tokens, page or meta.page_size
                if pool < 2 * page:
                    raise typer.BadParameter(
                        f"{pool:,} tokens hold fewer than two pages of {page:,} ({source.label}); "
                        f"give at least {2 * page:,}",
                        param_hint="--pool-tokens",
                    )


@sweep_app.command("run", cls=KvtraceCommand, epilog=SWEEP_EXAMPLES)
def sweep_run(
    inputs: Annotated[
        list[str],
        typer.Argument(
            metavar="INPUT...",
            help="Workload files (simulated: the scheduler model under each cell's options) and traces "
            "(replayed with each cell's allocator options; --reschedule simulates them too), or sample:NAME.",
            show_default=False,
        ),
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="Results: one Parquet row per cell.")],
    pool_tokens: Annotated[
        str | None, typer.Option("--pool-tokens", help="Pool sizes in tokens, e.g. 100k,400k,1M.", show_default="each input's own")
    ] = None,
    page_size: Annotated[
        str | None, typer.Option("--page-size", help="Page sizes, e.g. 1,16,64.", show_default="each input's own")
    ] = None,
    versions: Annotated[
        str, typer.Option("--versions", help="Allocator versions: builtin, token, paged[:N], module:factory, file.py:factory.")
    ] = "builtin",
    spec: Annotated[
        str | None,
        typer.Option("--spec", help="Speculative settings, e.g. off,eagle:3,1,4 (simulated cells).", show_default="each input's own"),
    ] = None,
    max_running: Annotated[
        str | None, typer.Option("--max-running", help="Request rows, e.g. 128,256 (simulated cells).", show_default="each input's own")
    ] = None,
    chunk: Annotated[
        str | None,
        typer.Option("--chunk", help="Chunked-prefill sizes, 0 for none, e.g. 4096,8192 (simulated cells).", show_default="each input's own"),
    ] = None,
    swa_window: Annotated[
        str | None,
        typer.Option("--swa-window", help="Sliding windows in tokens, e.g. 128,1024 (traces of hybrid SWA models).", show_default="each input's own"),
    ] = None,
    swa_full_tokens_ratio: Annotated[
        str | None,
        typer.Option("--swa-full-tokens-ratio", help="SWA pool tokens per full pool token, e.g. 0.5,0.8 (SWA traces; SGLang's option of that name).", show_default="each input's own"),
    ] = None,
    eviction_policy: Annotated[
        str | None,
        typer.Option("--eviction-policy", help="Radix eviction policies, e.g. lru,lfu,slru (lru lfu fifo mru filo "
                     "priority slru).", show_default="each input's own"),
    ] = None,
    hicache_ratio: Annotated[
        str | None,
        typer.Option("--hicache-ratio", help="HiCache host pool tokens per device pool token, 0 for no host tier, "
                     "e.g. 0,1,2,4 (SGLang's --hicache-ratio).", show_default="each input's own"),
    ] = None,
    hicache_write_policy: Annotated[
        str | None,
        typer.Option("--hicache-write-policy", help="HiCache write policies, e.g. write_through,write_back "
                     "(write_through write_through_selective write_back).", show_default="each input's own"),
    ] = None,
    reschedule: Annotated[
        bool, typer.Option("--reschedule", help="Simulate traces too: their requests scheduled anew under each cell's options.")
    ] = False,
    jobs: Annotated[
        int | None, typer.Option("--jobs", "-j", min=1, help="Worker processes (one cell each at a time).", show_default="the cores")
    ] = None,
    ray: Annotated[
        str | None,
        typer.Option("--ray", help="Run the cells on a Ray cluster: ADDRESS (host:port), auto, or local (start one here).", show_default="off"),
    ] = None,
    check: Annotated[CheckMode, typer.Option("--check", help="Replayed cells: invariant checks.")] = CheckMode.end,
    on_oom: Annotated[OnOom, typer.Option("--on-oom", help="Replayed cells: at an out-of-memory, stop or skip.")] = OnOom.stop,
    device: DeviceOpt = Device.cpu,
    duration: Annotated[
        str | None, typer.Option("--duration", help="Simulated cells: arrivals within this window, e.g. 10m.", show_default="all")
    ] = None,
    time_scale: Annotated[float, typer.Option("--time-scale", help="Simulated cells: multiply arrival times.", callback=finite)] = 1.0,
    rate: Annotated[
        float | None, typer.Option("--rate", help="Simulated cells of the lengths format: arrivals per second.", show_default=False, callback=finite)
    ] = None,
    seed: Annotated[int | None, typer.Option("--seed", min=0, help="Simulated cells: seed.", show_default="each input's own")] = None,
    keep_traces: Annotated[
        Path | None, typer.Option("--keep-traces", help="Keep the simulated cells' traces in this directory.", show_default="none kept")
    ] = None,
    explain: Annotated[
        bool, typer.Option("--explain", help="Replayed cells: also explain their misses (explain.* columns: causes, LRU / Belady / infinite hit rates).")
    ] = False,
    force: ForceOpt = False,
    quiet: QuietOpt = False,
    no_color: NoColorOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Run every combination of the options over the inputs, one cell per worker process.

    Finished cells are on disk at once (OUT.parts/): a sweep stopped or killed loses
    none, and the same command run again runs only the rest. Options not given keep
    each input's own value.

    Exit code: 0 every cell ran clean; 1 some cell found what its run alone exits 1 for
    (violations, an out-of-memory with --on-oom stop, bad ops) or failed (its row
    says what); 2 bad input.
    """
    from kvtrace.cli.workload_format import check_rate
    from kvtrace.outputs import OutputFile
    from kvtrace.sweep import Grid, SweepSettings
    from traces.workloads import parse_duration

    if len(set(inputs)) != len(inputs):
        raise typer.BadParameter("an INPUT is given twice", param_hint="INPUT")
    sources = tuple(_input(arg, reschedule) for arg in inputs)
    target = OutputFile(out, force=force, inputs=[Path(s.path) for s in sources])
    if any(s.fmt == "lengths" for s in sources):
        check_rate("lengths", rate)
    elif rate is not None:
        raise typer.BadParameter("applies to lengths workloads only, and no INPUT is one", param_hint="--rate")
    try:
        duration_s = None if duration is None else parse_duration(duration)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--duration") from None
    if not time_scale > 0:
        raise typer.BadParameter(f"must be a positive factor, found {time_scale}", param_hint="--time-scale")
    if keep_traces is not None and not keep_traces.is_dir():
        raise typer.BadParameter(f"{keep_traces} is not a directory; create it first", param_hint="--keep-traces")
    from kvtrace.cli.replay import check_device

    check_device(device.value)
    grid = Grid(
        inputs=sources,
        versions=_versions(versions),
        pool_tokens=_axis(pool_tokens, "--pool-tokens"),
        page_sizes=_axis(page_size, "--page-size"),
        specs=_specs(spec),
        max_running=_axis(max_running, "--max-running"),
        chunks=_axis(chunk, "--chunk", minimum=0),
        swa_windows=_axis(swa_window, "--swa-window"),
        swa_ratios=_ratios(swa_full_tokens_ratio, "--swa-full-tokens-ratio"),
        eviction_policies=_policies(eviction_policy),
        hicache_ratios=_hicache_ratios(hicache_ratio),
        hicache_write_policies=_write_policies(hicache_write_policy),
        settings=SweepSettings(
            check=check.value,
            on_oom=on_oom.value,
            device=device.value,
            duration_s=duration_s,
            time_scale=time_scale,
            rate=rate,
            seed=seed,
            keep_traces=None if keep_traces is None else str(keep_traces.resolve()),
            explain=explain,
        ),
    )
    _check_grid(grid, {"--spec": spec, "--max-running": max_running, "--chunk": chunk,
                       "--swa-window": swa_window, "--swa-full-tokens-ratio": swa_full_tokens_ratio})
    _warn_about_traces(s for s in sources if s.kind == "simulate" and s.fmt == "trace")
    _run(grid, target, jobs or os.cpu_count() or 1, ray, quiet or as_json, as_json)


def _hicache_ratios(text: str | None) -> tuple[float | None, ...]:
    """``--hicache-ratio 0,1,2`` -> ``(0.0, 1.0, 2.0)`` (0: no host tier); None: each input's own."""
    from kvtrace.sweep import parse_hicache_ratios

    if text is None:
        return (None,)
    try:
        return tuple(parse_hicache_ratios(text, "--hicache-ratio"))
    except ValueError as exc:
        raise typer.BadParameter(str(exc).removeprefix("--hicache-ratio: "), param_hint="--hicache-ratio") from None


def _write_policies(text: str | None) -> tuple[str | None, ...]:
    """``--hicache-write-policy write_through,write_back``; None: each input's own."""
    from traces.hicache_layout import WRITE_POLICIES

    if text is None:
        return (None,)
    policies: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if part not in WRITE_POLICIES:
            raise typer.BadParameter(f"{part!r} is not one of {', '.join(WRITE_POLICIES)}", param_hint="--hicache-write-policy")
        if part in policies:
            raise typer.BadParameter(f"{part!r} is given twice", param_hint="--hicache-write-policy")
        policies.append(part)
    return tuple(policies)


def _policies(text: str | None) -> tuple[str | None, ...]:
    """``--eviction-policy lru,lfu`` -> ``("lru", "lfu")``; None: each input's own."""
    from allocator.evict_policy import check_eviction_policy

    if text is None:
        return (None,)
    policies: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        try:
            policy = check_eviction_policy(part)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--eviction-policy") from None
        if policy in policies:
            raise typer.BadParameter(f"{part!r} is given twice", param_hint="--eviction-policy")
        policies.append(policy)
    return tuple(policies)


def _warn_about_traces(sources: Any) -> None:
    from traces.trace_workload import arrival_note, read_trace_workload

    for source in sources:
        note = arrival_note(read_trace_workload(source.path))
        if note is not None:
            ui.warn(f"{source.label}: {note}")


def _run(grid: Grid, target: Any, jobs: int, ray: str | None, quiet: bool, as_json: bool) -> None:
    from kvtrace.sweep import run_sweep
    from kvtrace.sweep.cells import FOUND

    with ui.terminate_on_signals(), _Progress(quiet) as progress:
        outcome = run_sweep(grid, target, jobs=jobs, ray=ray, on_start=progress.start, on_row=progress.advance)
    summary = outcome.to_dict(str(target.path))
    summary.update(runner="ray" if ray is not None else "local", jobs=None if ray is not None else jobs)
    if as_json:
        ui.emit_json(summary)
    else:
        ui.note(
            f"{outcome.cells:,} cells ({outcome.resumed:,} from an earlier run), {outcome.found:,} with problems, "
            f"{outcome.failed:,} failed, in {outcome.wall_s:,.1f} s → {target.path}; kvtrace sweep report {target.path}"
        )
    rows = outcome.table.to_pylist() if outcome.found or outcome.failed else []
    if outcome.found:
        first = next(r for r in rows if r["status"] in FOUND)
        ui.warn(f"{outcome.found:,} cells found problems; the first: {_describe(first)}: {first['problem']}")
    if outcome.failed:
        first = next(r for r in rows if r["status"] == "failed")
        ui.warn(f"{outcome.failed:,} cells failed; the first: {_describe(first)}: {first['error']}")
    raise typer.Exit(1 if outcome.found or outcome.failed else 0)


def _describe(row: dict[str, Any]) -> str:
    """A result row's input and the parameters it asked for: ``r.kvtrace (version=token)``."""
    from kvtrace.sweep.grid import PARAM_PREFIX

    asked = [f"{k.removeprefix(PARAM_PREFIX)}={v}" for k, v in row.items() if k.startswith(PARAM_PREFIX) and v is not None]
    return f"{row['input']} ({', '.join(asked)})" if asked else row["input"]


class _Progress:
    """Cells done of the cells to run, with the time left (``ui.progress``)."""

    def __init__(self, off: bool) -> None:
        self.off = off
        self.failed = 0
        self._done = 0
        self._line = ui.ProgressLine()
        self._context: Any = None

    def __enter__(self) -> _Progress:
        if not self.off:
            self._context = ui.progress("sweep", count=True, eta=True)
            self._line = self._context.__enter__()
        return self

    def start(self, todo: int, done: int) -> None:
        if done:
            ui.note(f"resuming: {done:,} cells finished in an earlier run are kept")
        self._line.show(0, "cells", total=todo)

    def advance(self, row: dict[str, Any]) -> None:
        self.failed += row["status"] != "ok"
        self._done += 1
        self._line.show(self._done, f"cells · {self.failed} failed" if self.failed else "cells")

    def __exit__(self, *exc: object) -> None:
        if self._context is not None:
            self._context.__exit__(*exc)


REPORT_EXAMPLES = examples(
    "# the table, and one PNG per input in r-plots/",
    "kvtrace sweep report r.parquet",
    "# the rows as JSON, no plots",
    "kvtrace sweep report r.parquet --no-plots --json",
)
_TABLE = (
    ("input", "input", ""), ("kind", "kind", ""), ("version", "version", ""), ("pool", "pool_tokens", ""),
    ("page", "page_size", ""), ("spec", "spec", ""), ("eviction", "eviction_policy", ""),
    ("hit rate", "prefix_hit_rate", "pct"),
    ("peak KV", "peak_occupancy", "pct"), ("retractions", "retractions", ""), ("duration s", "duration_s", ""),
    ("TTFT p50 s", "ttft_p50_s", ""), ("OOM step", "oom_step", ""), ("violations", "violations", ""),
    ("status", "status", ""),
)  # fmt: skip
_SWA_TABLE = (
    ("window", "swa_window", ""), ("SWA ratio", "swa_full_tokens_ratio", ""), ("SWA pool", "swa_pool_tokens", ""),
    ("SWA peak", "swa_peak_occupancy", "pct"),
)  # fmt: skip
_MAMBA_TABLE = (("Mamba slots", "mamba_slots", ""), ("Mamba peak", "mamba_peak_occupancy", "pct"))
_HICACHE_TABLE = (
    ("host ratio", "hicache_ratio", ""), ("host pool", "host_pool_tokens", ""), ("write", "hicache_write_policy", ""),
    ("device hit", "device_hit_rate", "pct"), ("host hit", "host_hit_rate", "pct"), ("miss", "miss_rate", "pct"),
)  # fmt: skip


@sweep_app.command("report", cls=KvtraceCommand, epilog=REPORT_EXAMPLES)
def sweep_report(
    results: Annotated[Path, typer.Argument(metavar="RESULTS", help="The Parquet file of a kvtrace sweep.", show_default=False)],
    plots: Annotated[
        Path | None, typer.Option("--plots", help="Directory of the PNG plots.", show_default="RESULTS' name + -plots")
    ] = None,
    no_plots: Annotated[bool, typer.Option("--no-plots", help="Print the table only.")] = False,
    force: ForceOpt = False,
    quiet: QuietOpt = False,
    no_color: NoColorOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Print a sweep's results as a table, and plot them against pool size.

    Hit rate, peak KV occupancy, retractions and simulated duration against the pool
    size, one PNG per input with a line per page size / version / … ; a sweep over
    HiCache's host tier (--hicache-ratio) also plots the prefix reuse by tier (device
    hits, host hits) against the host pool (INPUT-hicache.png).

    Cells whose check found something (violations, an out-of-memory that stopped the
    replay) or that failed are marked in the status column and listed under the table
    with what happened.

    Exit code: 0 shown; 2 bad input.
    """
    from kvtrace.sweep.report import fmt_cell, load_results, report_rows, write_plots

    t0 = time.perf_counter()
    rows = report_rows(load_results(results))
    written: list[Path] = []
    if not no_plots:
        directory = plots if plots is not None else results.with_name(results.name.split(".")[0] + "-plots")
        written = write_plots(rows, directory, force=force, inputs=[results])
    if as_json:
        ui.emit_json(
            {"results": str(results), "cells": len(rows), "rows": rows, "plots": [str(p) for p in written],
             "wall_s": time.perf_counter() - t0}
        )  # fmt: skip
        return
    from rich.table import Table

    table = Table(title=f"kvtrace sweep report {results}", title_justify="left")
    columns = [c for c in _TABLE if c[1] != "eviction_policy" or any(r["eviction_policy"] != "own" for r in rows)]
    if any("swa_pool_tokens" in row for row in rows):  # a hybrid (SWA) model: its pool too, before the status
        columns = columns[:-1] + list(_SWA_TABLE) + columns[-1:]
    if any("mamba_slots" in row for row in rows):  # a hybrid linear-attention model: its Mamba pool too
        columns = columns[:-1] + list(_MAMBA_TABLE) + columns[-1:]
    if any("device_hit_rate" in row for row in rows):  # HiCache's host tier: reuse split by tier
        columns = columns[:-1] + list(_HICACHE_TABLE) + columns[-1:]
    for header, _, _ in columns:
        table.add_column(
            header,
            justify="left" if header in ("input", "kind", "version", "spec", "eviction", "write", "status") else "right",
        )
    for row in rows:
        table.add_row(*(fmt_cell(row.get(key), kind) for _, key, kind in columns))
    ui.console().print(table)
    for number, row in enumerate(rows, 1):
        why = row["error"] if row["status"] == "failed" else row["problem"]
        if row["status"] != "ok":
            ui.console().print(f"row {number} ({row['input']}, version {row['version']}, pool {fmt_cell(row['pool_tokens'])}): "
                               f"{row['status']}: {why or '-'}", highlight=False, soft_wrap=True)
    for path in written:
        ui.note(f"plot: {path}")
