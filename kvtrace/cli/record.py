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

import dataclasses
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from kvtrace.cli import command, ui
from kvtrace.cli.options import Codec, Device, DeviceOpt, EvictionPolicyOpt, ForceOpt, IgnoreMemoryCheckOpt, JsonOpt, NoColorOpt, QuietOpt, examples, finite
from kvtrace.cli.record_hicache import HiCacheOpt, HiCacheRatioOpt, HiCacheSizeOpt, HiCacheWritePolicyOpt, host_tier_option
from kvtrace.cli.spec_option import parse_spec
from kvtrace.cli.workload_format import check_rate, infer_format, note_trace_workload, read_once
from kvtrace.errors import ConfigError, EmptyRecordingError, WorkloadError
from kvtrace.record.serving import (
    DEFAULT_CHUNK,
    DEFAULT_CONTEXT_LEN,
    DEFAULT_MAX_PREFILL_TOKENS,
    DEFAULT_MAX_RUNNING,
    DEFAULT_POOL_TOKENS,
    MODEL_NAMES,
    serving_settings,
)

# While recording, every completed step is its own flushed record batch (a killed
# recording keeps every completed step); on completion the trace is rewritten with
# DEFAULT_COMPACT steps per batch, which compresses much better (bigger batches).
DEFAULT_STEPS_PER_BATCH = 1
DEFAULT_COMPACT = 256
FLUSH_INTERVAL_S = 1.0
# SGLang refuses a prompt of max_req_len - 5 tokens or more (max_req_input_len).
PROMPT_MARGIN = 5


class WorkloadFormatOption(str, Enum):
    mooncake = "mooncake"
    azure = "azure"
    lengths = "lengths"
    trace = "trace"


class PolicyOption(str, Enum):
    fcfs = "fcfs"
    lpm = "lpm"


ModelOption = Enum("ModelOption", {name: name for name in MODEL_NAMES}, type=str)  # type: ignore[misc]


def check_serving(pool_tokens: int, page_size: int, chunk: int) -> None:
    """The serving options' checks that involve two of them (one line naming the option).

    Raises:
        typer.BadParameter: the pool holds fewer than 4 pages, or the chunk is below a page.
    """
    _check_pool(pool_tokens, page_size)
    if chunk < 0 or (chunk and chunk < page_size):
        raise typer.BadParameter(
            f"must be 0 (no chunking) or at least the page size {page_size}, found {chunk}", param_hint="--chunk"
        )


def _check_pool(pool_tokens: int, page_size: int) -> None:
    """One line naming the option to change when the pool holds fewer than 4 pages."""
    if pool_tokens >= 4 * page_size:
        return
    if page_size > 1 and pool_tokens >= 4:
        raise typer.BadParameter(
            f"{page_size:,} tokens per page leave fewer than 4 pages in the {pool_tokens:,}-token pool "
            f"(--pool-tokens); give a page size of at most {pool_tokens // 4:,}",
            param_hint="--page-size",
        )
    raise typer.BadParameter(
        f"a pool of {pool_tokens:,} tokens holds fewer than 4 pages of {page_size:,}; "
        f"give at least {4 * page_size:,}",
        param_hint="--pool-tokens",
    )


def _nothing_recorded(summary: Any, context_len: int, pool_tokens: int) -> EmptyRecordingError:
    limit = min(context_len - 1, pool_tokens - 1) - PROMPT_MARGIN
    binding = "--context-len" if context_len <= pool_tokens else "--pool-tokens"
    return EmptyRecordingError(
        f"nothing was recorded: all {summary.rejected:,} requests were rejected on arrival, as SGLang "
        f"rejects a prompt of {limit:,} tokens or more (the limit {binding} sets); raise {binding}"
    )


RECORD_EXAMPLES = examples(
    "# the bundled Mooncake hour on the default H200 serving config",
    "kvtrace record traces/workloads_data/mooncake-fast25/conversation_trace.jsonl --out conv.kvtrace",
    "# ten minutes of it at page 16 with EAGLE speculative decoding",
    "kvtrace record conversation_trace.jsonl --duration 10m --page-size 16 --spec eagle:3,1,4 -o eagle.kvtrace",
    "# a compressed Azure trace at half its request rate",
    "kvtrace record AzureLLMInferenceTrace_code.csv.gz --time-scale 2 -o azure.kvtrace",
    "# length statistics with Poisson arrivals, summary as JSON",
    "kvtrace record sharegpt.csv --format lengths --rate 5 -o sharegpt.kvtrace --json",
    "# what-if: the same requests of a trace scheduled anew on a smaller pool",
    "kvtrace record sample:mooncake-tiny --pool-tokens 120000 -o smaller.kvtrace",
    "# a workload recorded the way a bundled sample was (its whole serving config)",
    "kvtrace record sharegpt.csv --format lengths --rate 5 --like sample:mooncake-eagle -o like.kvtrace",
)

_FROM_TRACE = "the trace's own; for a workload file "


@command("record", epilog=RECORD_EXAMPLES)
def record_command(
    ctx: typer.Context,
    workload: Annotated[
        Path,
        typer.Argument(
            metavar="WORKLOAD",
            help="Workload file: Mooncake JSONL, Azure CSV or length CSV (gzip or zstd compressed too), "
            "or a trace (a path or sample:NAME) whose requests are scheduled anew; '-' reads stdin "
            "(a FIFO or a pipe is read once, too).",
            show_default=False,
        ),
    ],
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Trace to write (.kvtrace); an interrupted recording keeps its steps there.")
    ],
    fmt: Annotated[
        WorkloadFormatOption | None,
        typer.Option("--format", "-f", help="Workload format.", show_default="from the file"),
    ] = None,
    pool_tokens: Annotated[
        int | None,
        typer.Option(help="KV pool size in tokens.", show_default=_FROM_TRACE + f"{DEFAULT_POOL_TOKENS:,}: Llama-3.1-8B on one H200"),
    ] = None,
    page_size: Annotated[int | None, typer.Option(help="Tokens per KV page.", show_default=_FROM_TRACE + "1")] = None,
    max_running: Annotated[
        int | None, typer.Option(help="Request rows (max running requests).", show_default=_FROM_TRACE + str(DEFAULT_MAX_RUNNING))
    ] = None,
    context_len: Annotated[
        int | None, typer.Option(help="Model context length.", show_default=_FROM_TRACE + f"{DEFAULT_CONTEXT_LEN:,}")
    ] = None,
    chunk: Annotated[
        int | None,
        typer.Option(help="Chunked-prefill size in tokens (0: no chunking).", show_default=_FROM_TRACE + str(DEFAULT_CHUNK)),
    ] = None,
    max_prefill_tokens: Annotated[
        int | None,
        typer.Option(help="Token budget of one prefill batch.", show_default=_FROM_TRACE + f"{DEFAULT_MAX_PREFILL_TOKENS:,}"),
    ] = None,
    spec: Annotated[
        str | None,
        typer.Option(help="Speculative decoding ALGORITHM:STEPS,TOPK,DRAFT (e.g. eagle:3,1,4), or off.", show_default=_FROM_TRACE + "off"),
    ] = None,
    spec_acceptance: Annotated[
        float | None, typer.Option(help="Per-draft acceptance probability (alpha).", show_default=_FROM_TRACE + "0.7", callback=finite)
    ] = None,
    pd_decode: Annotated[
        bool | None,
        typer.Option("--pd-decode/--no-pd-decode", help="Model a PD-disaggregated decode server.", show_default=_FROM_TRACE + "off"),
    ] = None,
    radix_cache: Annotated[
        bool | None,
        typer.Option(
            "--radix-cache/--no-radix-cache",
            help="Keep a radix prefix cache.",
            show_default=_FROM_TRACE + "on, off with --pd-decode",
        ),
    ] = None,
    eviction_policy: EvictionPolicyOpt = None,
    namespaces: Annotated[
        int | None,
        typer.Option(
            "--namespaces",
            min=1,
            metavar="N",
            help="Put the requests round-robin into N cache namespaces (adapter-0 .. adapter-N-1, as N "
            "LoRA adapters would): equal prompts in two namespaces share no KV.",
            show_default="as the workload says (a namespaced trace keeps its namespaces)",
        ),
    ] = None,
    sessions: Annotated[
        bool,
        typer.Option(
            "--sessions",
            help="Streaming sessions: a session per conversation, its KV held between turns (the "
            "workload's session_id, else conversations inferred from the block hashes: a request whose "
            "hash_ids extend an earlier one's complete blocks continues it).",
        ),
    ] = False,
    hicache: HiCacheOpt = None,
    hicache_ratio: HiCacheRatioOpt = None,
    hicache_size: HiCacheSizeOpt = None,
    hicache_write_policy: HiCacheWritePolicyOpt = None,
    model: Annotated[
        ModelOption | None,  # type: ignore[valid-type]
        typer.Option(
            help="Model preset (traces/models.py): its KV shape and attention layout. Presets with "
            "sliding-window layers record with SGLang's two KV pools (full and SWA); hybrid "
            "linear-attention presets (qwen3-next-80b-a3b, nemotron-h-8b) with its Mamba state slots "
            "beside the KV pool of their full-attention layers.",
            show_default=_FROM_TRACE + "llama-3.1-8b",
        ),
    ] = None,
    like: Annotated[
        Path | None,
        typer.Option(
            "--like",
            metavar="TRACE",
            help="Take every serving setting (pool, page size, max running, context, chunk, policy, spec, "
            "PD/HiSparse, radix cache, HiCache host tier, model shape and layout) from TRACE's metadata (a path or "
            "sample:NAME); options given still override.",
            show_default=False,
        ),
    ] = None,
    draft_swa_window: Annotated[
        int | None,
        typer.Option(
            "--draft-swa-window",
            metavar="N",
            min=0,
            help="Sliding-window models: tokens back a fused draft reads in the SWA pool (SGLang's "
            "draft_swa_window); the SWA history kept is the larger of it and the window.",
            show_default=_FROM_TRACE + "0",
        ),
    ] = None,
    release_prefill_swa: Annotated[
        bool | None,
        typer.Option(
            "--release-prefill-swa/--no-release-prefill-swa",
            help="Sliding-window models: SGLANG_OPT_RELEASE_PREFILL_SWA, a request's prefix's SWA lock "
            "released once it has decoded a window's worth of steps.",
            show_default=_FROM_TRACE + "off",
        ),
    ] = None,
    duration: Annotated[
        str | None,
        typer.Option(help="Record only arrivals within this window, e.g. 10m, 90s, 1h.", show_default="the whole file"),
    ] = None,
    time_scale: Annotated[
        float, typer.Option(help="Multiply arrival times (2: half the request rate, same traffic between turns).", callback=finite)
    ] = 1.0,
    rate: Annotated[
        float | None, typer.Option(help="Arrival rate in requests/s (lengths format only).", show_default=False, callback=finite)
    ] = None,
    seed: Annotated[
        int | None, typer.Option(min=0, help="Seed of arrivals (lengths) and speculative acceptance.", show_default=_FROM_TRACE + "0")
    ] = None,
    policy: Annotated[PolicyOption | None, typer.Option(help="Waiting-queue policy.", show_default=_FROM_TRACE + "fcfs")] = None,
    step_time: Annotated[
        str | None,
        typer.Option(
            help="Step-time coefficients, e.g. fixed_s=5ms,decode_req_s=20us.",
            show_default=_FROM_TRACE + "fitted to an H200",
        ),
    ] = None,
    device: DeviceOpt = Device.cpu,
    steps_per_batch: Annotated[
        int, typer.Option(help="Steps per record batch while recording (1: every completed step survives a crash).")
    ] = DEFAULT_STEPS_PER_BATCH,
    compact: Annotated[
        int,
        typer.Option(
            help="On completion, rewrite the trace as an Arrow IPC file with this many steps per batch "
            "(0: keep the stream as written)."
        ),
    ] = DEFAULT_COMPACT,
    compression: Annotated[Codec, typer.Option(help="Codec of the finished trace.")] = Codec.zstd,
    flush_interval: Annotated[
        float, typer.Option(help="Also flush the trace every this many wall-clock seconds (0: only per batch).", callback=finite)
    ] = FLUSH_INTERVAL_S,
    force: ForceOpt = False,
    ignore_memory_check: IgnoreMemoryCheckOpt = False,
    quiet: QuietOpt = False,
    no_color: NoColorOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Record a workload through the SGLang-style scheduler model on the real allocator.

    Given a trace, its requests (arrivals, prompts, content, output lengths) are
    scheduled anew: options not given keep the values the trace was recorded with.

    Every completed step is on disk as it is recorded: a recording stopped by Ctrl-C,
    a signal or a crash leaves its steps in the trace, marked interrupted (see
    kvtrace info). An existing --out is replaced only when the recording completes.

    Exit code: 0 recorded; 1 nothing recorded (every request rejected); 2 bad input.
    """
    from kvtrace.outputs import OutputFile
    from kvtrace.record.step_time import StepTimeModel
    from traces import workloads
    from traces.samples import SAMPLE_PREFIX, resolve_trace

    if str(workload).startswith(SAMPLE_PREFIX):
        workload = resolve_trace(str(workload))
    if like is not None and str(like).startswith(SAMPLE_PREFIX):
        like = resolve_trace(str(like))
    from_stdin = str(workload) == workloads.STDIN
    if not from_stdin and not workload.exists():
        raise WorkloadError(f"{workload}: no such file; give the path of a workload file")
    if workload.is_dir():
        raise WorkloadError(f"{workload}: is a directory, expected a workload file")
    inputs = ([] if from_stdin else [workload]) + ([] if like is None else [Path(like)])
    target = OutputFile(out, force=force, inputs=inputs)
    shown = "<stdin>" if from_stdin else str(workload)
    with read_once(workload, shown) as readable:
        fmt_name = fmt.value if fmt is not None else infer_format(readable, shown)
        given = {
            "pool_tokens": pool_tokens, "page_size": page_size, "max_running": max_running, "context_len": context_len,
            "chunk": chunk, "max_prefill_tokens": max_prefill_tokens, "spec_acceptance": spec_acceptance,
            "pd_decode": pd_decode, "seed": seed, "policy": policy.value if policy is not None else None,
            "radix_cache": radix_cache,
            "eviction_policy": eviction_policy.value if eviction_policy is not None else None,
        }  # fmt: skip
        if spec is not None:
            given["spec"] = parse_spec(spec)
        if step_time is not None:
            try:
                given["step_time"] = StepTimeModel.parse(step_time)
            except ValueError as exc:
                raise typer.BadParameter(str(exc), param_hint="--step-time") from None
        settings = serving_settings(readable, fmt_name, given, like=like)
        if model is not None:
            from traces.models import model_preset

            preset = model_preset(model.value)
            settings["model"] = preset.shape
            settings["attention"] = preset.layout(settings["pool_tokens"], settings["page_size"])
            settings["mamba"] = preset.mamba_layout(settings["pool_tokens"])
        else:
            if settings.get("attention") is not None and (pool_tokens is not None or page_size is not None):
                # A trace's layout under another pool or page size: its SWA pool follows the ratio.
                settings["attention"] = settings["attention"].for_pool(settings["pool_tokens"], settings["page_size"])
            if settings.get("mamba") is not None and pool_tokens is not None:
                # Under another pool: the Mamba slots of the memory that holds it.
                settings["mamba"] = settings["mamba"].for_pool(settings["pool_tokens"], settings["model"])
        settings["attention"] = _swa_switches(settings.get("attention"), draft_swa_window, release_prefill_swa)
        from kvtrace.record.simulate import refuse_mamba_radix, refuse_sliding_window

        radix = settings.get("radix_cache")
        if settings.get("mamba") is not None:
            refuse_mamba_radix(
                settings["model"].name, settings["mamba"], page_size=settings["page_size"],
                radix_cache=not settings["pd_decode"] if radix is None else radix, pd_decode=settings["pd_decode"],
                hisparse=bool(settings.get("hisparse", False)),
            )  # fmt: skip

        if settings.get("attention") is not None:
            refuse_sliding_window(
                settings["model"].name, settings["attention"],
                page_size=settings["page_size"], pool_tokens=settings["pool_tokens"],
                hisparse=bool(settings.get("hisparse", False)),
                radix_cache=not settings["pd_decode"] if radix is None else radix,
            )  # fmt: skip
        for name, low in (
            ("pool_tokens", 1), ("page_size", 1), ("max_running", 1), ("context_len", 2), ("max_prefill_tokens", 1),
        ):  # fmt: skip
            if settings[name] < low:
                raise typer.BadParameter(f"must be >= {low}, found {settings[name]}", param_hint="--" + name.replace("_", "-"))
        for name, value, low in (("--steps-per-batch", steps_per_batch, 1), ("--compact", compact, 0)):
            if value < low:
                raise typer.BadParameter(f"must be >= {low}, found {value}", param_hint=name)
        check_serving(settings["pool_tokens"], settings["page_size"], settings["chunk"] or 0)
        resized = pool_tokens is not None or page_size is not None or model is not None
        settings["hicache"] = host_tier_option(settings, enabled=hicache, ratio=hicache_ratio, size_gb=hicache_size,
                                               write_policy=hicache_write_policy, resized=resized)  # fmt: skip
        if not time_scale > 0:
            raise typer.BadParameter(f"must be a positive factor, found {time_scale}", param_hint="--time-scale")
        if not 0.0 <= settings["spec_acceptance"] <= 1.0:
            raise typer.BadParameter(f"must lie in [0, 1], found {settings['spec_acceptance']}", param_hint="--spec-acceptance")
        if flush_interval < 0:
            raise typer.BadParameter(f"must be >= 0, found {flush_interval}", param_hint="--flush-interval")
        check_rate(fmt_name, rate)
        duration_s = None
        if duration is not None:
            try:
                duration_s = workloads.parse_duration(duration)
            except ValueError as exc:
                raise typer.BadParameter(str(exc), param_hint="--duration") from None

        from kvtrace.cli.replay import check_device
        from kvtrace.record.simulate import RecordOptions, record_report, record_workload

        check_device(device.value)

        options = RecordOptions(
            workload=readable,
            fmt=fmt_name,  # type: ignore[arg-type]
            out=out,
            duration_s=duration_s,
            time_scale=time_scale,
            rate=rate,
            device=device.value,
            steps_per_batch=steps_per_batch,
            compression=compression.value,
            flush_interval_s=flush_interval or None,
            compact_steps_per_batch=compact or None,
            command=ui.command_line(ctx.meta),
            force=ignore_memory_check,
            namespaces=namespaces,
            sessions=sessions,
            **settings,
        )
        if fmt_name == "trace":
            note_trace_workload(readable, shown)
        wall0 = time.perf_counter()
        try:
            with target.recording() as live, ui.terminate_on_signals(), _progress(quiet or as_json) as progress_cb:
                # `live` is this run's: a new file it created (empty), or a temporary one.
                result = record_workload(dataclasses.replace(options, out=live, overwrite=True), progress=progress_cb)
                if result.summary.steps == 0:
                    live.unlink(missing_ok=True)
                    raise _nothing_recorded(result.summary, options.context_len, options.pool_tokens)
        except workloads.WorkloadFileError as exc:
            raise WorkloadError(str(exc)) from None
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        except (KeyboardInterrupt, ui.Terminated) as exc:
            from traces.writer import stopped_compacting

            if target.replaces:
                ui.warn(f"recording interrupted; {out} was left as it was")
            elif stopped_compacting(exc):
                ui.warn(
                    f"interrupted while compacting; {out} holds the complete recording, uncompacted "
                    f"('kvtrace compact {out}' makes it an IPC file)"
                )
            elif out.exists():
                ui.warn(f"recording interrupted; {out} holds the steps recorded so far, marked interrupted")
            raise
        wall_s = time.perf_counter() - wall0
        _report(record_report(result, options, wall_s=wall_s), options, workload=Path(shown), as_json=as_json)


def _swa_switches(layout: Any, draft_swa_window: int | None, release_prefill_swa: bool | None) -> Any:
    """The attention layout with the SWA switches given (``AttentionLayout``; None: full
    attention).

    Raises:
        typer.BadParameter: a switch that changes something on a full-attention model.
    """
    for name, value in (("--draft-swa-window", draft_swa_window), ("--release-prefill-swa", release_prefill_swa)):
        if layout is None and value:
            raise typer.BadParameter(
                "the model is full attention (no sliding-window layers); record a sliding-window "
                "preset (e.g. --model gpt-oss-20b) or drop it", param_hint=name,
            )  # fmt: skip
    if layout is None:
        return None
    if draft_swa_window is not None:
        layout = dataclasses.replace(layout, draft_sliding_window=draft_swa_window)
    if release_prefill_swa is not None:
        layout = dataclasses.replace(layout, release_prefill_swa=release_prefill_swa)
    return layout


@contextmanager
def _progress(off: bool) -> Iterator[Callable[[Any], None] | None]:
    """The recording's progress line: finished requests of all, and the rest of the
    scheduler's state; None (no callback) where no line is shown."""
    if off or not ui.progress_shown():
        yield None
        return
    with ui.progress("recording", count=True) as line:

        def progress_cb(p: Any) -> None:
            line.show(p.finished, total=p.total, info=(
                f"finished · arrived {p.arrived:,} running {p.running:,} waiting {p.waiting:,} · "
                f"step {p.steps:,} · sim {p.sim_time_s:,.0f} s"
            ))

        yield progress_cb


def _step_kinds(report: dict[str, Any], options: Any) -> str:
    """The steps and their kinds, which add up to the total: prefill (prealloc on a PD
    decode server), decode (speculative when every decode step was), release-only and
    retract-only steps (these two named only when there were some)."""
    r = report
    decode = "spec decode" if r["decode_steps"] and r["spec_steps"] == r["decode_steps"] else "decode"
    kinds = [
        f"{r['prefill_steps']:,} {'prealloc' if options.pd_decode else 'prefill'}",
        f"{r['decode_steps']:,} {decode}",
    ]
    if r["release_steps"]:
        kinds.append(f"{r['release_steps']:,} release-only")
    if r["retract_steps"]:
        kinds.append(f"{r['retract_steps']:,} retract-only")
    return f"{r['steps']:,} ({', '.join(kinds)})"


def _report(report: dict[str, Any], options: Any, *, workload: Path, as_json: bool) -> None:
    """Print the recording's summary: the ``--json`` object, or a table."""
    rejected, requests = report["rejected"], report["requests"]
    if rejected:
        limit = min(options.context_len - 1, options.pool_tokens - 1) - PROMPT_MARGIN
        ui.warn(
            f"{rejected:,} of {requests + rejected:,} requests were rejected on arrival "
            f"(prompts of {limit:,} tokens or more do not fit --context-len / --pool-tokens)"
        )
    if as_json:
        ui.emit_json(report)
        return
    from rich.table import Table

    r = report
    table = Table(title=f"kvtrace record → {r['out']}", show_header=False)
    table.add_column("", style="bold")
    table.add_column("", justify="right")
    ttft = r["ttft_s"]
    rows = [
        ("workload", f"{workload.name} ({options.fmt})"),
        ("requests", f"{r['requests']:,} ({r['finished']:,} finished, {r['rejected']:,} rejected)"),
        ("steps", _step_kinds(r, options)),
        ("simulated time", f"{r['duration_s']:,.1f} s"),
        ("wall time", f"{r['wall_s']:,.1f} s ({r['steps_per_s']:,.0f} steps/s)"),
        ("prefix hit rate", f"{r['prefix_hit_rate']:.1%} of {r['prompt_tokens']:,} prompt tokens"),
        ("peak KV in use", f"{r['peak_used_tokens']:,} of {options.pool_tokens:,} tokens at step {r['peak_step']:,}"),
        ("time to first token", f"p50 {ttft['p50']:,.3f} s, p99 {ttft['p99']:,.3f} s" if ttft["count"] else "none"),
        ("retractions", f"{r['retractions']:,} ({r['retracted_requests']:,} requests)"),
        ("aborts", f"{r['aborts']:,}"),
        ("evicted tokens", f"{r['evicted_tokens']:,}"),
        ("peak running / waiting", f"{r['peak_running']:,} / {r['peak_waiting']:,}"),
        ("allocator integrity", "clean" if not r["integrity_violations"] else f"{len(r['integrity_violations'])} violations"),
        ("trace size", f"{r['file_bytes'] / 1e6:,.2f} MB"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    ui.console().print(table)
