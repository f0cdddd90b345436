"""``kvtrace info`` and ``kvtrace validate``: what a trace holds, and whether its ops make sense.

Both take a trace path or ``sample:NAME`` (a bundled sample); ``info`` also
recognises a state log (``kvtrace replay --out``) and summarises it. ``info``
exits 0 even for a truncated or interrupted trace (it reports what is complete
and warns on stderr); ``validate`` exits 1 when it finds a problem, and a
truncated file or an interrupted recording is one: a cut recording is worth
flagging.

numpy, pyarrow and rich are imported inside the commands (``kvtrace --help``
starts without them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvtrace.cli import command, ui
from kvtrace.cli.options import JsonOpt, NoColorOpt, QuietOpt, TraceArg, examples

if TYPE_CHECKING:
    from traces.ipc import IpcReader
    from traces.reader import TraceReader


def open_trace(spec: str) -> TraceReader:
    """Open a trace argument (a path or ``sample:NAME``), validating it once.

    Raises:
        TraceError: the file cannot be read or breaks the format (one clear line).
    """
    from traces.reader import TraceReader
    from traces.samples import resolve_trace

    return TraceReader(resolve_trace(spec))


def _is_state_log(spec: str) -> bool:
    """Whether the file is a kvtrace state log (decided from its schema metadata)."""
    from kvtrace.statelog.format import is_state_log_schema
    from traces.errors import TraceError
    from traces.ipc import IpcReader
    from traces.samples import resolve_trace

    try:
        schema = IpcReader(resolve_trace(spec)).schema
    except TraceError:
        return False  # TraceReader says what is wrong, as it would for any trace
    return is_state_log_schema(schema)


def _warn_truncated(reader: IpcReader) -> None:
    if reader.truncated:
        warn_cut_short(reader.path, reader.truncation_detail)


def warn_cut_short(path: object, detail: str | None) -> None:
    """Warn that a file (a trace, a state log) was read up to its last complete batch:
    the one wording of ``info``, ``validate`` and ``diff LOG_A LOG_B``."""
    ui.warn(f"{path}: {detail}")


def _interruption(reader: TraceReader) -> str | None:
    """One line saying the recording did not complete (None when it did, or nothing says)."""
    recording = reader.recording
    if recording is None or not recording.interrupted:
        return None
    steps = f" after {recording.steps:,} steps" if recording.steps is not None else ""
    return f"recording interrupted{steps}: {recording.detail or 'no reason recorded'}"


# --------------------------------------------------------------------------------------
# info
# --------------------------------------------------------------------------------------


def _escaped(value: Any) -> Any:
    """``value`` with every string escaped for rich markup (metadata is the trace's text)."""
    from rich.markup import escape

    if isinstance(value, str):
        return escape(value)
    if isinstance(value, dict):
        return {key: _escaped(item) for key, item in value.items()}
    return value


def _render_info(info: dict[str, Any]) -> None:
    from rich.table import Table

    from kvtrace.replay.report import count

    info = _escaped(info)
    table = Table(title=f"kvtrace info: {info['path']}", show_header=False, title_justify="left")
    table.add_column("field", style="bold")
    table.add_column("value")
    source = info["source"]
    cfg = info["config"]
    model = info["model"]
    spec = cfg.get("spec")
    table.add_row("format version", f"{info['format_version']} (Arrow IPC {info['ipc_format']})")
    table.add_row("source", f"{source['engine']}: {source['workload']}")
    if source.get("license"):
        table.add_row("licence", str(source["license"]))
    if source.get("citation"):
        table.add_row("citation", str(source["citation"]))
    recording = info["recording"]
    if recording is not None or info["created_at"]:
        made = info["created_at"] or "unknown time"
        if recording is not None and recording.get("kvtrace_version"):
            made += f" by kvtrace {recording['kvtrace_version']}"
        table.add_row("recorded", made)
    if recording is not None and recording.get("command"):
        table.add_row("command", recording["command"])
    if recording is not None:
        if info["interrupted"]:
            steps = f" after {recording['steps']:,} steps" if recording.get("steps") is not None else ""
            status = f"[bold red]interrupted[/]{steps}: {recording.get('detail') or 'no reason recorded'}"
        else:
            status = "complete"
        table.add_row("recording", status)
    table.add_row(
        "config",
        f"page_size {cfg['page_size']}, pool_tokens {cfg['pool_tokens']:,}, "
        f"max_running {cfg['max_running']}, max_context_len {cfg['max_context_len']:,}, "
        f"chunk_size {cfg.get('chunk_size')}, policy {cfg.get('schedule_policy')}",
    )
    table.add_row(
        "spec",
        "off" if not spec else (
            f"{spec['algorithm']} steps {spec['num_steps']}, topk {spec['topk']}, "
            f"draft tokens {spec['num_draft_tokens']}"
        ),
    )
    table.add_row("pd decode / hisparse", f"{cfg.get('pd_decode')} / {cfg.get('hisparse')}")
    hicache = info.get("hicache")
    if hicache is not None:  # HiCache's host tier (config.hicache, version 4)
        sized = (
            f"--hicache-size {hicache['host_size_gb']} GB" if hicache.get("host_size_gb") is not None
            else f"--hicache-ratio {hicache['host_ratio']:g}"
        )
        memory = "" if hicache["host_bytes"] is None else f", {hicache['host_bytes'] / 1e9:,.2f} GB"
        table.add_row(
            "host tier",
            f"host pool {hicache['host_pool_tokens']:,} tokens ({sized}{memory}), write policy {hicache['write_policy']}",
        )
    table.add_row(
        "model",
        f"{model['name']}: {model['num_layers']} layers, {model['num_kv_heads']} KV heads, "
        f"head_dim {model['head_dim']}, {model['dtype']} ({model['bytes_per_token']:,} bytes/token)",
    )
    attention = info.get("attention")
    if attention is not None:
        table.add_row(
            "attention",
            f"{attention['num_full_layers']} full + {attention['num_swa_layers']} sliding-window layers "
            f"({attention['layer_kinds']}), window {attention['sliding_window']:,} tokens",
        )
        table.add_row(
            "pools",
            f"full {attention['full_pool_tokens']:,} tokens ({attention['full_bytes_per_token']:,} bytes/token), "
            f"SWA {attention['swa_pool_tokens']:,} tokens ({attention['swa_bytes_per_token']:,} bytes/token), "
            f"SWA/full ratio {attention['swa_full_tokens_ratio']:g}",
        )
    mamba = info.get("mamba")
    if mamba is not None:
        table.add_row(
            "layers",
            f"{mamba['num_full_layers']} full-attention + {mamba['num_mamba_layers']} linear ({mamba['kind']}) "
            f"layers ({mamba['layer_kinds']})",
        )
        table.add_row(
            "pools",
            f"KV {mamba['full_pool_tokens']:,} tokens ({mamba['full_bytes_per_token']:,} bytes/token), "
            f"Mamba {mamba['mamba_cache_size']:,} slots of {mamba['state_bytes_per_request']:,} bytes "
            f"(conv {mamba['conv_state_bytes']:,} + temporal {mamba['temporal_state_bytes']:,} per layer), "
            f"{mamba['slots_per_request']} per request, mamba/full memory ratio {mamba['mamba_full_memory_ratio']:g}",
        )
    namespaces = info.get("namespaces")
    if namespaces is not None:
        shown = ", ".join(f"{name} ({n:,})" for name, n in list(namespaces["requests"].items())[:4])
        more = f", ... {namespaces['count'] - 4:,} more" if namespaces["count"] > 4 else ""
        table.add_row("namespaces", f"{namespaces['count']:,}: {shown}{more} (requests each)")
    table.add_row("block size", str(info["block_size"]))
    steps = info["steps"]
    span = "" if info["first_step"] is None else f" ({info['first_step']:,}..{info['last_step']:,})"
    table.add_row("steps", f"{steps:,}{span}")
    table.add_row("requests", f"{info['requests']:,}")
    table.add_row("rows", f"{info['rows']:,} (at most {info['max_rows_per_step']:,} in a step)")
    table.add_row("ops", ", ".join(f"{name} {count:,}" for name, count in info["ops"].items()))
    tok = info["tokens"]
    table.add_row(
        "tokens",
        f"prefill {tok['prefill']:,}, decode {tok['decode']:,}, spec accepted "
        f"{tok['spec_accepted']:,} of {tok['spec_drafted']:,} drafted, prealloc {tok['prealloc']:,}",
    )
    table.add_row("longest request", count(info["max_seq_len"], "token"))
    table.add_row("duration", f"{info['duration_s']:,.2f} s (simulated)")
    table.add_row("file", f"{count(info['file_bytes'], 'byte')}, {count(info['record_batches'], 'record batch', 'record batches')}")
    table.add_row(
        "truncated",
        f"[bold red]yes[/]: {info['truncation_detail']}" if info["truncated"] else "no",
    )
    ui.console().print(table)


INFO_EXAMPLES = examples(
    "# what a bundled sample holds",
    "kvtrace info sample:mooncake-tiny",
    "# a trace's step count, as JSON, for a script",
    "kvtrace info run.kvtrace --json | jq .steps",
    "# a state log written by kvtrace replay --out",
    "kvtrace info state.arrow",
)


@command("info", epilog=INFO_EXAMPLES)
def info_command(
    trace: TraceArg,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
    no_color: NoColorOpt = False,
) -> None:
    """Show a trace's metadata and what it holds (steps, requests, ops, tokens).

    A truncated trace, or one whose recording was interrupted, is summarised up to
    its last complete batch (exit 0, with a warning on stderr). Given a state log
    (kvtrace replay --out), summarises the replay it holds.
    """
    if _is_state_log(trace):
        from kvtrace.cli.statelog_info import render_state_log_info, state_log_info

        summary = state_log_info(trace)
        if json_output:
            ui.emit_json(summary)
        else:
            render_state_log_info(summary)
        return
    reader = open_trace(trace)
    with ui.progress(f"reading {reader.path.name}", total=reader.file_bytes) as update:
        from kvtrace.traceinfo import trace_info

        info = trace_info(reader, on_batch=lambda: update(reader.bytes_read))
    _warn_truncated(reader)
    interruption = _interruption(reader)
    if interruption is not None and not reader.truncated:
        ui.warn(f"{reader.path}: {interruption}; the trace holds the steps recorded before it")
    if json_output:
        ui.emit_json(info)
    else:
        _render_info(info)


# --------------------------------------------------------------------------------------
# validate
# --------------------------------------------------------------------------------------

VALIDATE_EXAMPLES = examples(
    "# check a recording before sharing it",
    "kvtrace validate run.kvtrace",
    "# every problem, as JSON",
    "kvtrace validate run.kvtrace --max-problems 1000 --json",
)


@command("validate", epilog=VALIDATE_EXAMPLES)
def validate_command(
    trace: TraceArg,
    json_output: JsonOpt = False,
    max_problems: Annotated[
        int,
        typer.Option("--max-problems", min=0, help="Print at most this many problems (all are counted)."),
    ] = 20,
    quiet: QuietOpt = False,
    no_color: NoColorOpt = False,
) -> None:
    """Check that a trace's op sequence makes sense; exit 1 if it does not.

    Reports ops on requests that do not exist or already ended, lengths that
    shrink or do not add up, steps out of order, spec rows without spec settings,
    bad block hashes or token ids, a truncated file and an interrupted recording.
    """
    from traces.checker import OpSequenceChecker, Problem

    reader = open_trace(trace)
    checker = OpSequenceChecker(reader.meta, rid_bound=reader.rid_bound)
    shown: list[Problem] = []
    total = 0
    with ui.progress(f"validating {reader.path.name}", total=reader.file_bytes) as update:
        for batch in reader.steps():
            problems = checker.check(batch)
            if problems:
                total += len(problems)
                room = max_problems - len(shown)
                if room > 0:
                    shown.extend(problems[:room])
            update(reader.bytes_read, f"step {batch.step:,}")
    summary = checker.finish()
    last = reader.last_step if reader.last_step is not None else -1
    # A cut file says it was interrupted already; otherwise an interrupted recording
    # (Ctrl-C, a signal, an error: closed cleanly, but short) is a problem of its own.
    interruption = None if reader.truncated else _interruption(reader)
    for detail in (reader.truncation_detail if reader.truncated else None, interruption):
        if detail is None:
            continue
        total += 1
        if len(shown) < max_problems:
            shown.append(Problem(last, None, detail))
    _warn_truncated(reader)
    ok = total == 0
    if json_output:
        ui.emit_json(
            {
                "path": str(reader.path),
                "ok": ok,
                "num_problems": total,
                "problems": [p.to_dict() for p in shown],
                "truncated": reader.truncated,
                "truncation_detail": reader.truncation_detail,
                "interrupted": bool(reader.recording is not None and reader.recording.interrupted),
                "steps": summary.steps,
                "rows": summary.rows,
                "requests": summary.requests,
                "ended": summary.ended,
                "holding_kv": summary.holding_kv,
                "retracted": summary.retracted,
            }
        )
    else:
        for problem in shown:
            typer.echo(str(problem))
        if total > len(shown):
            typer.echo(f"... and {total - len(shown)} more")
        held = (
            f"; {summary.holding_kv:,} requests still hold KV at the end (a window of a longer "
            "recording is fine)"
            if summary.holding_kv
            else ""
        )
        from kvtrace.replay.report import count

        verdict = "ok" if ok else count(total, "problem")
        typer.echo(f"{verdict}: {summary.steps:,} steps, {summary.requests:,} requests, {summary.rows:,} rows{held}")
    if not ok:
        raise typer.Exit(1)
