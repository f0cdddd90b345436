"""``kvtrace record``: turn a production request log into a trace through the scheduler model.

Defaults model SGLang 0.5.23 serving Llama-3.1-8B (bf16) on one NVIDIA H200:

* KV bytes per token = 2 (K and V) x 32 layers x 8 KV heads x 128 x 2 B = 131,072 B
  (128 KiB), so one MiB holds 8 tokens.
* SGLang sizes the pool from ``mem_fraction_static``: on an H200 (143,771 MiB visible)
  with an 8,192-token chunk and decode CUDA graphs up to batch 256 it reserves
  512 + 8,192 x 1.5 + 128 + 256 x 2 = 13,440 MiB, so the fraction is
  round((143,771 - 13,440) / 143,771, 3) = 0.907 and the static memory 130,400 MiB;
  less 15,316 MiB of weights (8.03e9 parameters x 2 B) leaves 115,084 MiB of KV,
  x 8 = 920,672 tokens, rounded down to ``--pool-tokens 920000``.
* ``--max-running 256``: the decode CUDA-graph batch limit SGLang picks on an H200.
* ``--chunk 8192``: SGLang's chunked-prefill size on GPUs of 90-160 GB (H200).
* ``--context-len 131072`` (Llama-3.1), ``--page-size 1`` (SGLang's default).
"""

from __future__ import annotations

import json
import time
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from kvtrace.cli import app
from kvtrace.errors import ConfigError, WorkloadError

DEFAULT_POOL_TOKENS = 920_000
DEFAULT_MAX_RUNNING = 256
DEFAULT_CONTEXT_LEN = 131_072
DEFAULT_CHUNK = 8192
DEFAULT_MAX_PREFILL_TOKENS = 16_384
# While recording, every completed step is its own flushed record batch (a killed
# recording keeps every completed step); on completion the trace is rewritten with
# DEFAULT_COMPACT steps per batch, which compresses ~4x better.
DEFAULT_STEPS_PER_BATCH = 1
DEFAULT_COMPACT = 256
FLUSH_INTERVAL_S = 1.0


class WorkloadFormatOption(str, Enum):
    mooncake = "mooncake"
    azure = "azure"
    lengths = "lengths"


class PolicyOption(str, Enum):
    fcfs = "fcfs"
    lpm = "lpm"


def _parse_spec(text: str) -> Any:
    from traces.schema import SpecSettings

    algorithm, sep, numbers = text.partition(":")
    algorithm = algorithm.strip().lower()
    valid = ("eagle", "eagle3", "standalone")
    if algorithm not in valid or not sep:
        raise typer.BadParameter(
            f"{text!r} is not ALGORITHM:STEPS,TOPK,DRAFT with ALGORITHM one of {', '.join(valid)} "
            "(e.g. eagle:3,1,4)",
            param_hint="--spec",
        )
    try:
        steps, topk, draft = (int(x) for x in numbers.split(","))
    except ValueError:
        raise typer.BadParameter(
            f"{text!r}: expected three integers STEPS,TOPK,DRAFT after '{algorithm}:' (e.g. eagle:3,1,4)",
            param_hint="--spec",
        ) from None
    if steps < 1 or topk < 1 or draft < 2:
        raise typer.BadParameter(
            f"{text!r}: STEPS and TOPK must be >= 1 and DRAFT >= 2", param_hint="--spec"
        )
    if topk == 1 and draft > steps + 1:
        raise typer.BadParameter(
            f"{text!r}: with TOPK 1 a chain of {steps} draft steps verifies at most {steps + 1} tokens",
            param_hint="--spec",
        )
    return SpecSettings(algorithm=algorithm, num_steps=steps, topk=topk, num_draft_tokens=draft)  # type: ignore[arg-type]


def _infer_format(path: Path) -> str:
    if path.suffix.lower() in (".jsonl", ".json"):
        return "mooncake"
    try:
        with path.open("r", encoding="utf-8") as fh:
            header = fh.readline()
    except OSError:
        header = ""
    if "TIMESTAMP" in header and "ContextTokens" in header:
        return "azure"
    if "num_prefill_tokens" in header:
        return "lengths"
    raise typer.BadParameter(
        f"cannot tell the format of {path}; give --format mooncake, azure or lengths",
        param_hint="--format",
    )


@app.command("record")
def record_command(
    workload: Annotated[Path, typer.Argument(help="Workload file: Mooncake JSONL, Azure CSV or length CSV.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Trace to write (.kvtrace).")],
    fmt: Annotated[
        WorkloadFormatOption | None,
        typer.Option("--format", "-f", help="Workload format (default: from the file)."),
    ] = None,
    pool_tokens: Annotated[int, typer.Option(help="KV pool size in tokens (default: Llama-3.1-8B on one H200).")] = DEFAULT_POOL_TOKENS,
    page_size: Annotated[int, typer.Option(help="Tokens per KV page.")] = 1,
    max_running: Annotated[int, typer.Option(help="Request rows (max running requests).")] = DEFAULT_MAX_RUNNING,
    context_len: Annotated[int, typer.Option(help="Model context length.")] = DEFAULT_CONTEXT_LEN,
    chunk: Annotated[int, typer.Option(help="Chunked-prefill size in tokens (0: no chunking).")] = DEFAULT_CHUNK,
    max_prefill_tokens: Annotated[int, typer.Option(help="Token budget of one prefill batch.")] = DEFAULT_MAX_PREFILL_TOKENS,
    spec: Annotated[
        str | None, typer.Option(help="Speculative decoding ALGORITHM:STEPS,TOPK,DRAFT, e.g. eagle:3,1,4.")
    ] = None,
    spec_acceptance: Annotated[float, typer.Option(help="Per-draft acceptance probability (alpha).")] = 0.7,
    pd_decode: Annotated[bool, typer.Option("--pd-decode", help="Model a PD-disaggregated decode server.")] = False,
    duration: Annotated[str | None, typer.Option(help="Record only arrivals within this window, e.g. 10m, 90s, 1h.")] = None,
    time_scale: Annotated[
        float, typer.Option(help="Multiply arrival times (2: half the request rate, same traffic between turns).")
    ] = 1.0,
    rate: Annotated[float | None, typer.Option(help="Arrival rate in requests/s (lengths format).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of arrivals (lengths) and speculative acceptance.")] = 0,
    policy: Annotated[PolicyOption, typer.Option(help="Waiting-queue policy.")] = PolicyOption.fcfs,
    step_time: Annotated[
        str | None, typer.Option(help="Step-time coefficients, e.g. fixed_s=5ms,decode_req_s=20us.")
    ] = None,
    device: Annotated[str, typer.Option(help="Allocator device: cpu or cuda.")] = "cpu",
    steps_per_batch: Annotated[
        int, typer.Option(help="Steps per record batch while recording (1: every completed step survives a crash).")
    ] = DEFAULT_STEPS_PER_BATCH,
    compact: Annotated[
        int, typer.Option(help="On completion, rewrite the trace with this many steps per batch (0: keep as written).")
    ] = DEFAULT_COMPACT,
    compression: Annotated[str, typer.Option(help="zstd or lz4.")] = "zstd",
    flush_interval: Annotated[
        float, typer.Option(help="Also flush the trace every this many wall-clock seconds (0: only per batch).")
    ] = FLUSH_INTERVAL_S,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing --out; build the pool even when it looks bigger than the free memory.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
) -> None:
    """Record a workload through the SGLang-style scheduler model on the real allocator."""
    from kvtrace.step_time import StepTimeModel
    from traces import workloads

    if not workload.exists():
        raise WorkloadError(f"{workload}: no such file; give the path of a workload file")
    if workload.is_dir():
        raise WorkloadError(f"{workload}: is a directory, expected a workload file")
    fmt_name = fmt.value if fmt is not None else _infer_format(workload)
    for name, value, low in (
        ("--pool-tokens", pool_tokens, 1),
        ("--page-size", page_size, 1),
        ("--max-running", max_running, 1),
        ("--context-len", context_len, 2),
        ("--max-prefill-tokens", max_prefill_tokens, 1),
        ("--steps-per-batch", steps_per_batch, 1),
        ("--compact", compact, 0),
    ):
        if value < low:
            raise typer.BadParameter(f"must be >= {low}, found {value}", param_hint=name)
    if pool_tokens < 4 * page_size:
        raise typer.BadParameter(
            f"a pool of {pool_tokens} tokens holds fewer than 4 pages of {page_size}", param_hint="--pool-tokens"
        )
    if chunk < 0 or (chunk and chunk < page_size):
        raise typer.BadParameter(
            f"must be 0 (no chunking) or at least the page size {page_size}, found {chunk}", param_hint="--chunk"
        )
    if not time_scale > 0:
        raise typer.BadParameter(f"must be a positive factor, found {time_scale}", param_hint="--time-scale")
    if not 0.0 <= spec_acceptance <= 1.0:
        raise typer.BadParameter(f"must lie in [0, 1], found {spec_acceptance}", param_hint="--spec-acceptance")
    if flush_interval < 0:
        raise typer.BadParameter(f"must be >= 0, found {flush_interval}", param_hint="--flush-interval")
    if compression not in ("zstd", "lz4"):
        raise typer.BadParameter(f"must be zstd or lz4, found {compression!r}", param_hint="--compression")
    if device not in ("cpu", "cuda"):
        raise typer.BadParameter(f"must be cpu or cuda, found {device!r}", param_hint="--device")
    if fmt_name == "lengths":
        if rate is None:
            raise typer.BadParameter("the lengths format needs an arrival rate, e.g. --rate 5", param_hint="--rate")
        if not rate > 0:
            raise typer.BadParameter(f"must be a positive number of requests per second, found {rate}", param_hint="--rate")
    elif rate is not None:
        raise typer.BadParameter(
            f"applies to the lengths format only; {fmt_name} workloads carry their own arrival times",
            param_hint="--rate",
        )
    duration_s = None
    if duration is not None:
        try:
            duration_s = workloads.parse_duration(duration)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--duration") from None
    spec_settings = _parse_spec(spec) if spec is not None else None
    if spec_settings is not None and pd_decode:
        pass  # PD decode servers run EAGLE too; nothing to refuse.
    try:
        model = StepTimeModel.parse(step_time) if step_time else StepTimeModel()
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--step-time") from None
    if out.exists() and not force:
        raise typer.BadParameter(f"{out} already exists; pass --force to overwrite it", param_hint="--out")
    if out.is_dir():
        raise typer.BadParameter(f"{out} is a directory", param_hint="--out")

    from kvtrace.scheduler import RecordOptions, record_workload

    options = RecordOptions(
        workload=workload,
        fmt=fmt_name,  # type: ignore[arg-type]
        out=out,
        pool_tokens=pool_tokens,
        page_size=page_size,
        max_running=max_running,
        context_len=context_len,
        chunk=chunk or None,
        max_prefill_tokens=max_prefill_tokens,
        spec=spec_settings,
        spec_acceptance=spec_acceptance,
        pd_decode=pd_decode,
        duration_s=duration_s,
        time_scale=time_scale,
        rate=rate,
        seed=seed,
        policy=policy.value,  # type: ignore[arg-type]
        step_time=model,
        device=device,
        steps_per_batch=steps_per_batch,
        compression=compression,
        overwrite=force,
        flush_interval_s=flush_interval or None,
        compact_steps_per_batch=compact or None,
        force=force,
    )

    progress_cb = None
    live = None
    if not quiet and not as_json:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        console = Console(stderr=True)
        live = Progress(
            TextColumn("recording"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        task = live.add_task("", total=None)

        def progress_cb(p: Any) -> None:
            # The bar counts finished requests; the text the rest of the state.
            live.update(
                task,
                total=p.total,
                completed=p.finished,
                description=(
                    f"finished · arrived {p.arrived:,} running {p.running:,} waiting {p.waiting:,} · "
                    f"step {p.steps:,} · sim {p.sim_time_s:,.0f} s"
                ),
            )

        live.start()
    wall0 = time.perf_counter()
    try:
        result = record_workload(options, progress=progress_cb)
    except workloads.WorkloadFileError as exc:
        raise WorkloadError(str(exc)) from None
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    finally:
        if live is not None:
            live.stop()
    wall_s = time.perf_counter() - wall0
    summary = result.summary
    report = {
        "out": str(out),
        "format": fmt_name,
        "steps": summary.steps,
        "requests": summary.requests,
        "finished": summary.finished,
        "rejected": summary.rejected,
        "aborts": summary.aborted,
        "retractions": summary.retractions,
        "retracted_requests": summary.retracted_requests,
        "evicted_tokens": summary.evicted_tokens,
        "prefix_hit_rate": summary.prefix_hit_rate,
        "prefix_hit_tokens": summary.prefix_hit_tokens,
        "prompt_tokens": summary.prompt_tokens,
        "duration_s": summary.duration_s,
        "wall_s": wall_s,
        "steps_per_s": summary.steps / wall_s if wall_s > 0 else 0.0,
        "prefill_steps": summary.prefill_steps,
        "decode_steps": summary.decode_steps,
        "peak_running": summary.peak_running,
        "peak_waiting": summary.peak_waiting,
        "extend_retries": summary.extend_retries,
        "row_overflows": summary.row_overflows,
        "spec_mean_accepted": (
            summary.spec_accepted_tokens / max(1, summary.spec_ops) if spec_settings is not None else None
        ),
        "integrity_violations": result.violations,
        "block_reuse": result.block_reuse,
        "file_bytes": out.stat().st_size if out.exists() else 0,
        "config": {
            "page_size": page_size,
            "pool_tokens": pool_tokens,
            "max_running": max_running,
            "context_len": context_len,
            "chunk": chunk or None,
            "policy": policy.value,
            "spec": spec,
            "pd_decode": pd_decode,
        },
    }
    if as_json:
        typer.echo(json.dumps(report))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvtrace record → {out}", show_header=False)
    table.add_column("", style="bold")
    table.add_column("", justify="right")
    rows = [
        ("workload", f"{workload.name} ({fmt_name})"),
        ("requests", f"{summary.requests:,} ({summary.finished:,} finished, {summary.rejected:,} rejected)"),
        ("steps", f"{summary.steps:,} ({summary.prefill_steps:,} prefill, {summary.decode_steps:,} decode)"),
        ("simulated time", f"{summary.duration_s:,.1f} s"),
        ("wall time", f"{wall_s:,.1f} s ({report['steps_per_s']:,.0f} steps/s)"),
        ("prefix hit rate", f"{summary.prefix_hit_rate:.1%} of {summary.prompt_tokens:,} prompt tokens"),
        ("retractions", f"{summary.retractions:,} ({summary.retracted_requests:,} requests)"),
        ("aborts", f"{summary.aborted:,}"),
        ("evicted tokens", f"{summary.evicted_tokens:,}"),
        ("peak running / waiting", f"{summary.peak_running:,} / {summary.peak_waiting:,}"),
        ("allocator integrity", "clean" if not result.violations else f"{len(result.violations)} violations"),
        ("trace size", f"{report['file_bytes'] / 1e6:,.2f} MB"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    Console().print(table)
