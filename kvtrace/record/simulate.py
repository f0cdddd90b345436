"""Simulate a workload: the scheduler model (``kvtrace.record.scheduler``) over a workload
file or a trace, on a real allocator, recorded as a trace or kept as a summary only.

``record_workload`` is the library behind ``kvtrace record`` and behind the simulated
cells of ``kvtrace sweep``; ``record_report`` is the ``kvtrace record --json`` object
both print. A trace given as the workload (``fmt="trace"``) is scheduled anew: the
same requests, arrivals and content (``traces.trace_workload``) under new options;
``trace_defaults`` gives the options the trace was recorded with, for what the user
does not override.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from allocator.pages import floor_align
from kvtrace.record.scheduler import SchedulePolicy, Scheduler, SchedulerConfig, max_req_input_len
from kvtrace.record.summary import RecordProgress, RecordSummary
from kvtrace.record.step_time import StepTimeModel
from kvtrace.errors import ConfigError
from traces.hicache_layout import HostTier
from traces.mamba_layout import MambaLayout, mamba_slots_per_request
from traces.metadata import AttentionLayout, ModelShape, SpecSettings, TraceMeta, TraceSource
from traces.namespaces import NamespaceTable

if TYPE_CHECKING:
    from traces.workloads import WorkloadFormat, WorkloadRequest

__all__ = [
    "MODEL_SHAPE_NAME",
    "DiscardRecorder",
    "RecordOptions",
    "RecordResult",
    "record_report",
    "record_workload",
    "refuse_sliding_window",
    "refuse_unserved_hicache",
    "round_robin_namespaces",
    "spec_settings",
    "spec_text",
    "mamba_max_running",
    "refuse_mamba_radix",
    "trace_defaults",
]

MODEL_SHAPE_NAME = "Llama-3.1-8B"
# The model a recording assumes unless told (``traces.models`` preset ``llama-3.1-8b``).
DEFAULT_MODEL_SHAPE = ModelShape(name=MODEL_SHAPE_NAME, num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")


@dataclass(frozen=True, slots=True)
class RecordOptions:
    """Everything ``record_workload`` needs (the CLI's options, checked)."""

    workload: Path
    fmt: WorkloadFormat
    out: Path | None  # None: keep no trace (the summary only)
    pool_tokens: int
    page_size: int = 1
    max_running: int = 256
    context_len: int = 131_072
    chunk: int | None = 8192
    max_prefill_tokens: int = 16384
    spec: SpecSettings | None = None
    spec_acceptance: float = 0.7
    pd_decode: bool = False
    hisparse: bool = False
    radix_cache: bool | None = None  # None: a radix cache unless pd_decode
    eviction_policy: str = "lru"  # the radix cache's (allocator.evict_policy)
    # N: requests go round-robin to cache namespaces adapter-0..N-1 (a what-if: N LoRA
    # adapters); None: each request keeps the namespace its workload gives it
    namespaces: int | None = None
    model: ModelShape = DEFAULT_MODEL_SHAPE
    attention: AttentionLayout | None = None  # None: full attention
    mamba: MambaLayout | None = None  # None: no linear-attention layers
    hicache: HostTier | None = None  # HiCache's host tier (stored in the trace's config), None: none
    # streaming sessions: a session per conversation (kvtrace.record.sessions: named by the
    # workload's session_id, else inferred from the block hashes)
    sessions: bool = False
    duration_s: float | None = None
    time_scale: float = 1.0
    rate: float | None = None
    seed: int = 0
    policy: SchedulePolicy = "fcfs"
    step_time: StepTimeModel = field(default_factory=StepTimeModel)
    device: str = "cpu"
    steps_per_batch: int = 1
    compression: str = "zstd"
    overwrite: bool = False
    flush_interval_s: float | None = 1.0
    compact_steps_per_batch: int | None = 256
    source: TraceSource | None = None
    command: str | None = None  # the command line stored in the trace (default: this process's)
    version: str = "builtin"  # the allocator version the scheduler model runs on (kvtrace.versions.registry)
    force: bool = False  # build the pool even when it looks bigger than the free memory


class RecordResult(NamedTuple):
    """A finished recording: the summary, the allocator's integrity check at the end
    (one line per violation; empty when sound) and the trace metadata written."""

    summary: RecordSummary
    violations: list[str]
    meta: TraceMeta
    block_reuse: dict[str, float] | None


def record_workload(
    options: RecordOptions, progress: Callable[[RecordProgress], None] | None = None
) -> RecordResult:
    """Record a workload file (or a trace, ``fmt="trace"``) into a trace, or with
    ``options.out`` None run it keeping the summary only (the library behind
    ``kvtrace record`` and the simulated cells of ``kvtrace sweep``).

    Raises:
        traces.workloads.WorkloadFileError: a bad row or column in the workload.
        traces.errors.TraceError: a trace workload that cannot be read or re-scheduled,
            or a trace that cannot be written.
        VersionSpecError: ``options.version`` does not resolve or its factory fails.
        ConfigError: a version that fixes another page size than ``options.page_size``,
            or a pool that needs more memory than the machine has (without ``options.force``).
        ValueError: inconsistent options.
    """
    from traces.workload_sources import known_source
    from traces.workloads import MOONCAKE_BLOCK_SIZE, WorkloadFileError, read_workload

    max_input_len = max_req_input_len(options.context_len, floor_align(options.pool_tokens, options.page_size))

    def requests() -> Iterator[WorkloadRequest]:
        stream = read_workload(
            options.workload,
            options.fmt,
            rate=options.rate,
            seed=options.seed,
            duration_s=options.duration_s,
            time_scale=options.time_scale,
        )
        if options.namespaces:
            stream = round_robin_namespaces(stream, options.namespaces, max_input_len)
        if plan is not None:
            return iter(plan.requests)
        return stream

    plan = None
    if options.sessions:
        from kvtrace.record.sessions import plan_sessions

        unserved = [name for name, on in (
            ("PD decode", options.pd_decode), ("HiSparse", options.hisparse), ("Mamba layers", options.mamba is not None),
            ("sliding-window layers", options.attention is not None and bool(options.attention.swa_layer_ids)),
            ("cache namespaces", bool(options.namespaces)), ("HiCache's host tier", options.hicache is not None),
        ) if on]  # fmt: skip
        if unserved:
            raise ValueError(f"streaming sessions are modelled for full-attention pools only, not with {unserved[0]}")
        plan = plan_sessions(requests())
        if any(req.namespace is not None for req in plan.requests):
            raise ValueError("streaming sessions are not modelled with cache namespaces (the workload names some)")

    refuse_sliding_window(
        options.model.name, options.attention,
        page_size=options.page_size, pool_tokens=options.pool_tokens, hisparse=options.hisparse,
        radix_cache=not options.pd_decode if options.radix_cache is None else options.radix_cache,
    )
    refuse_unserved_hicache(options)
    refuse_mamba_radix(
        options.model.name, options.mamba, page_size=options.page_size, pd_decode=options.pd_decode,
        radix_cache=not options.pd_decode if options.radix_cache is None else options.radix_cache,
        hisparse=options.hisparse,
    )
    # Check the whole file first (a streaming pass): a bad line fails at once, not
    # minutes into the recording, and no partial trace is left behind.
    total = 0
    by_rid: list[str | None] = []  # the namespace of each request the scheduler will admit, by rid
    for req in requests():
        total += 1
        if req.input_len < max_input_len:
            by_rid.append(req.namespace)
    namespaces = NamespaceTable.of(by_rid)
    if total == 0:
        window = f" in the first {options.duration_s:g} s" if options.duration_s is not None else ""
        raise WorkloadFileError(options.workload, None, f"holds no requests{window}; nothing to record")
    from kvtrace.replay.config import RECORD_OPTIONS, check_memory, effective_config, unserved_mamba
    from kvtrace.record.recorder import Recorder
    from kvtrace.versions.registry import resolve_version

    version = resolve_version(options.version)
    block_size = MOONCAKE_BLOCK_SIZE if options.fmt == "mooncake" else None
    source = options.source
    if options.fmt == "trace":
        from traces.trace_workload import read_trace_workload

        workload = read_trace_workload(options.workload)
        block_size = workload.block_size
        if source is None:
            source = dataclasses.replace(workload.meta.source, engine="kvtrace-scheduler")
    spec = options.spec
    radix_cache = not options.pd_decode if options.radix_cache is None else options.radix_cache
    config = SchedulerConfig(
        page_size=options.page_size,
        pool_tokens=floor_align(options.pool_tokens, options.page_size),
        max_running=mamba_max_running(options.mamba, options.max_running, radix_cache, options.page_size),
        max_context_len=options.context_len,
        chunk_size=options.chunk,
        max_prefill_tokens=options.max_prefill_tokens,
        policy=options.policy,
        spec=spec,
        spec_acceptance=options.spec_acceptance,
        pd_decode=options.pd_decode,
        hisparse=options.hisparse,
        radix_cache=radix_cache,
        eviction_policy=options.eviction_policy,
        seed=options.seed,
        step_time=options.step_time,
        mamba_slots=None if options.mamba is None else options.mamba.mamba_cache_size,
        hicache=options.hicache,
        sessions=options.sessions,
    )
    source = source or known_source(options.workload, options.fmt)
    meta = TraceMeta(
        config=config.trace_config(),
        source=source,
        model=options.model,
        attention=options.attention,
        mamba=options.mamba,
        namespaces=namespaces,
        block_size=block_size,
        extra={
            "recorder": "kvtrace.scheduler",  # the name traces have always carried, not a module path
            "workload_format": options.fmt,
            "allocator": version.spec,
            "duration_s": options.duration_s,
            "time_scale": options.time_scale,
            "rate": options.rate,
            "seed": options.seed,
            "max_prefill_tokens": options.max_prefill_tokens,
            "spec_acceptance": options.spec_acceptance if spec is not None else None,
            "step_time": {name: getattr(options.step_time, name) for name in options.step_time.__slots__},
        },
    )
    # NOTE: the allocator keeps the Mamba state pool where it serves the trace's
    # switches (``unserved_mamba``); elsewhere it serves the full-attention layers' KV
    # pool only, and the Mamba slots are the scheduler model's budget alone
    # (``SchedulerConfig.mamba_slots``). The host tier is the allocator's, as the
    # replay's: the recording's load-backs are the ones a replay repeats.
    served = unserved_mamba(meta, meta.config.radix_cache) is None
    allocator_config = effective_config(
        meta if served else dataclasses.replace(meta, mamba=None),
        version_spec=version.spec,
        version_page_size=version.page_size,
        page_size=options.page_size,
        device=options.device,
    )
    check_memory(allocator_config, num_rids=total, names=RECORD_OPTIONS, force=options.force)
    allocator = version.create(allocator_config)
    recorder: Any
    if options.out is None:
        recorder = DiscardRecorder()
    else:
        recorder = Recorder(
            options.out,
            meta,
            steps_per_batch=options.steps_per_batch,
            compression=options.compression,
            overwrite=options.overwrite,
            flush_interval_s=options.flush_interval_s,
            dense_ids=True,
            compact_steps_per_batch=options.compact_steps_per_batch,
            command=options.command,
        )
    with recorder:
        scheduler = Scheduler(
            allocator, recorder, config, block_size=block_size, session_turns=None if plan is None else plan.turns
        )
        summary = scheduler.run(requests(), progress=progress, total=total)
    violations = [
        f"{v.check}: {v.detail}" + (f" (request {v.rid})" if v.rid is not None else "")
        for v in allocator.check_integrity()
    ]
    return RecordResult(summary=summary, violations=violations, meta=meta, block_reuse=None)


def round_robin_namespaces(
    requests: Iterable[WorkloadRequest], count: int, max_input_len: int
) -> Iterator[WorkloadRequest]:
    """``requests`` with the admitted ones (prompt below ``max_input_len``) put in cache
    namespaces ``adapter-0`` .. ``adapter-{count-1}`` in turn, by request id: a what-if of
    ``count`` LoRA adapters sharing the traffic (deterministic). Rejected requests keep theirs."""
    rid = 0
    for req in requests:
        if req.input_len >= max_input_len:
            yield req
            continue
        yield dataclasses.replace(req, namespace=f"adapter-{rid % count}")
        rid += 1


def refuse_sliding_window(
    model_name: str,
    layout: AttentionLayout | None,
    *,
    page_size: int,
    pool_tokens: int,
    radix_cache: bool,
    hisparse: bool = False,
) -> None:
    """Refuse, before any workload is read, to record a sliding-window model with a
    switch the SWA allocator does not serve yet (the radix cache, HiSparse).

    NOTE: the rule is the allocator's own (``kvtrace.replay.config.unsupported_swa``
    re-checks its configuration without the switch), so this refusal goes away by
    itself once the allocator serves the switch with SWA.

    Raises:
        ConfigError: naming the model and the switch to turn off.
    """
    if layout is None or not layout.swa_layer_ids:
        return
    from allocator.base import AllocatorConfig
    from kvtrace.replay.config import swa_config_for, unsupported_swa

    ps = max(page_size, 1)
    config = AllocatorConfig(
        pool_tokens=max(pool_tokens // ps * ps, 2 * ps), page_size=ps, radix_cache=radix_cache,
        hisparse=hisparse, swa=swa_config_for(layout, resized=True),
    )  # fmt: skip
    try:
        config.check()
    except ValueError as exc:
        switch = "--no-radix-cache" if radix_cache else "--no-pd-decode"
        message = unsupported_swa(config, exc, advice=f"record it with {{what}} off ({switch})")
        if message is not None:
            raise ConfigError(f"{model_name}: {message}") from None


def refuse_unserved_hicache(options: RecordOptions) -> None:
    """Refuse, before any workload is read, to record HiCache's host tier with a switch
    the tiered allocator (``allocator.hiradix``: a full-attention, LRU radix tree without
    cache namespaces) does not serve; the recording runs on that allocator.

    Raises:
        ConfigError: naming the switch to drop, or the --hicache-* options.
    """
    if options.hicache is None:
        return
    radix_cache = not options.pd_decode if options.radix_cache is None else options.radix_cache
    unserved = [what for what, on in (
        ("--pd-decode", options.pd_decode), ("--spec", options.spec is not None), ("HiSparse", options.hisparse),
        ("--no-radix-cache", not radix_cache), ("a linear-attention --model", options.mamba is not None),
        ("a sliding-window --model", options.attention is not None and bool(options.attention.swa_layer_ids)),
        (f"--eviction-policy {options.eviction_policy}", options.eviction_policy != "lru"),
        ("--namespaces", bool(options.namespaces)),
    ) if on]  # fmt: skip
    if unserved:
        raise ConfigError(
            f"HiCache's host tier is recorded on a full-attention LRU radix cache only, not with {unserved[0]}: "
            "record without it or without the --hicache-* options"
        )


def refuse_mamba_radix(
    model_name: str,
    layout: MambaLayout | None,
    *,
    page_size: int,
    radix_cache: bool,
    pd_decode: bool = False,
    hisparse: bool = False,
) -> None:
    """Refuse, before any workload is read, to record a hybrid linear-attention model
    with the radix cache at a page size above 1 when SGLang has no ``extra_buffer``
    strategy for its layers (Mamba2: SGLang serves it with the radix cache at page 1
    only), since replay refuses such a trace.

    NOTE: the rule is ``kvtrace.replay.config.unserved_mamba``'s radix-cache case
    (PD decode and HiSparse are recorded and refused at replay by that function).

    Raises:
        ConfigError: naming the model and what to record instead.
    """
    if layout is None or not radix_cache or page_size == 1 or layout.kind == "gdn" or pd_decode or hisparse:
        return
    raise ConfigError(
        f"{model_name}: SGLang has no extra_buffer Mamba strategy for {layout.kind} layers and serves them with "
        f"the radix cache at page size 1 only, so replay would refuse this trace: record it with --page-size 1, "
        f"or with --no-radix-cache"
    )


def mamba_max_running(layout: MambaLayout | None, max_running: int, radix_cache: bool, page_size: int = 1) -> int:
    """The request rows a hybrid linear-attention model is served with: SGLang caps
    ``max_running_requests`` at the Mamba slots over the slots per request
    (``resolve_max_num_reqs``); other models keep ``max_running``.

    Raises:
        ConfigError: the slots serve no request.
    """
    if layout is None:
        return max_running
    per_request = mamba_slots_per_request(radix_cache, page_size)
    rows = min(max_running, layout.mamba_cache_size // per_request)
    if rows <= 0:
        raise ConfigError(
            f"{layout.mamba_cache_size} Mamba state slot(s) serve no request ({per_request} per request "
            f"{'with' if radix_cache else 'without'} the radix cache); give a larger --pool-tokens"
        )
    return rows


class DiscardRecorder:
    """The recorder of a simulation that keeps no trace: every op is dropped (the
    scheduler model's summary is all that is kept)."""

    def begin_step(self, time_s: float) -> int:
        return 0

    def end_step(self) -> None:
        return None

    def extend(self, *args: Any, **kwargs: Any) -> None:
        return None

    prealloc = decode = spec = finish = retract = abort = hold = close_session = extend

    def __enter__(self) -> DiscardRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def spec_settings(text: str) -> SpecSettings | None:
    """``off`` -> None; ``ALGORITHM:STEPS,TOPK,DRAFT`` -> ``SpecSettings`` (the text is
    checked by the command line, ``kvtrace.cli.spec_option.parse_spec``).

    Raises:
        ValueError: text of another shape.
    """
    text = text.strip().lower()
    if text in ("off", "none"):
        return None
    algorithm, _, numbers = text.partition(":")
    steps, topk, draft = (int(x) for x in numbers.split(","))
    return SpecSettings(algorithm=algorithm, num_steps=steps, topk=topk, num_draft_tokens=draft)  # type: ignore[arg-type]


def spec_text(spec: SpecSettings | None) -> str | None:
    """``ALGORITHM:STEPS,TOPK,DRAFT`` (what ``--spec`` takes), None when off."""
    if spec is None:
        return None
    return f"{spec.algorithm}:{spec.num_steps},{spec.topk},{spec.num_draft_tokens}"


def trace_defaults(meta: TraceMeta) -> dict[str, Any]:
    """The ``RecordOptions`` a trace was recorded with, read off its metadata: what
    scheduling the trace anew keeps unless an option overrides it.

    Serving settings come from ``meta.config``, the model shape and attention layout
    from ``meta.model`` and ``meta.attention``; the scheduler model's own (prefill
    budget, acceptance probability, seed, step-time coefficients) from
    ``meta.extra`` when a ``kvtrace record`` wrote them. The radix cache is named
    only where it is not what ``pd_decode`` implies (on, unless PD decode).
    """
    cfg = meta.config
    extra = meta.extra or {}
    out: dict[str, Any] = {
        "pool_tokens": cfg.pool_tokens,
        "page_size": cfg.page_size,
        "max_running": cfg.max_running,
        "context_len": cfg.max_context_len,
        "chunk": cfg.chunk_size,
        "spec": cfg.spec,
        "pd_decode": cfg.pd_decode,
        "hisparse": cfg.hisparse,
        "policy": cfg.schedule_policy if cfg.schedule_policy in ("fcfs", "lpm") else "fcfs",
        "model": meta.model,
        "attention": meta.attention,
        "mamba": meta.mamba,
    }
    if cfg.hicache is not None:
        out["hicache"] = cfg.hicache
    if cfg.radix_cache == cfg.pd_decode:
        out["radix_cache"] = cfg.radix_cache
    if cfg.eviction_policy != "lru":
        out["eviction_policy"] = cfg.eviction_policy
    for key in ("max_prefill_tokens", "seed"):
        if isinstance(extra.get(key), int) and not isinstance(extra.get(key), bool):
            out[key] = extra[key]
    if isinstance(extra.get("spec_acceptance"), (int, float)):
        out["spec_acceptance"] = float(extra["spec_acceptance"])
    coefficients = extra.get("step_time")
    if isinstance(coefficients, dict):
        names = {f.name for f in dataclasses.fields(StepTimeModel)}
        known = {k: float(v) for k, v in coefficients.items() if k in names and isinstance(v, (int, float))}
        out["step_time"] = StepTimeModel(**known)
    return out


def record_report(result: RecordResult, options: RecordOptions, *, wall_s: float) -> dict[str, Any]:
    """The ``kvtrace record --json`` object (keys are a stable contract; add, never rename).

    Args:
        result: what ``record_workload`` returned.
        options: the options it ran with.
        wall_s: the wall time it took.
    """
    summary = result.summary
    out = options.out
    return {
        "out": None if out is None else str(out),
        "format": options.fmt,
        "allocator": options.version,
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
        "peak_used_tokens": summary.peak_used_tokens,
        "peak_step": summary.peak_step,
        "duration_s": summary.duration_s,
        "queue_delay_s": summary.queue_delay_s.to_dict(),
        "ttft_s": summary.ttft_s.to_dict(),
        "wall_s": wall_s,
        "steps_per_s": summary.steps / wall_s if wall_s > 0 else 0.0,
        "prefill_steps": summary.prefill_steps,
        "decode_steps": summary.decode_steps,
        "release_steps": summary.release_steps,
        "retract_steps": summary.retract_steps,
        "spec_steps": summary.spec_steps,
        "peak_running": summary.peak_running,
        "peak_waiting": summary.peak_waiting,
        "extend_retries": summary.extend_retries,
        "row_overflows": summary.row_overflows,
        "spec_mean_accepted": (
            summary.spec_accepted_tokens / max(1, summary.spec_ops) if options.spec is not None else None
        ),
        "integrity_violations": result.violations,
        "block_reuse": result.block_reuse,
        "file_bytes": out.stat().st_size if out is not None and out.exists() else 0,
        "config": {
            "page_size": options.page_size,
            "pool_tokens": options.pool_tokens,
            "max_running": result.meta.config.max_running,
            "context_len": options.context_len,
            "chunk": options.chunk,
            "policy": options.policy,
            "spec": spec_text(options.spec),
            "pd_decode": options.pd_decode,
            "model": options.model.name,
            "mamba_slots": None if options.mamba is None else options.mamba.mamba_cache_size,
            "eviction_policy": options.eviction_policy,
            "namespaces": 0 if result.meta.namespaces is None else len(result.meta.namespaces.names),
            **({} if options.hicache is None else {"hicache": dataclasses.asdict(options.hicache)}),
        },
    }
