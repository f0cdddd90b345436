"""Run one sweep cell and return its result row.

A simulated cell is ``kvtrace record`` (the scheduler model under the cell's
configuration; ``kvtrace.record.simulate``), its row the ``record --json`` object; a
replayed cell is ``kvtrace replay --json`` (``kvtrace.replay.session``). The row is flat:
nested objects become ``parent.child`` columns and lists JSON text, beside the
cell's ``param.*`` columns, ``cell`` (its key), ``input``, ``kind``, ``status``,
``error``, ``problem`` and ``cell_wall_s``. ``status`` is what the same run alone
would exit with: ``ok`` (clean, exit 0); ``violations``, ``oom`` (an out-of-memory
that stopped the replay) or ``bad-ops`` (the check found something, exit 1;
``problem`` says what, in one line); ``failed`` (the cell could not run: a
configuration no allocator takes, a version that does not load; ``error`` says why).
A failed cell is a row, not a crash of the sweep.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtrace.sweep.grid import Cell

if TYPE_CHECKING:
    from traces.metadata import AttentionLayout

__all__ = ["FOUND", "flatten", "host_tier", "run_cell", "swa_layout"]

# Columns every row has, in this order.
ROW_HEAD = ("cell", "input", "kind", "status", "error")
# Statuses of a cell that ran and whose check found something (its run alone exits 1).
FOUND = ("violations", "oom", "bad-ops")
# What an explained cell adds under ``explain.``: the causes, the oracle gaps' hit rates.
EXPLAIN_COLUMNS = ("missed_tokens", "causes", "hit_rates")
VIOLATIONS_SHOWN = 3  # in a row's one-line problem; the row's ``violations`` column has them all


def flatten(summary: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested summary as flat columns: ``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists
    (violations) become JSON text; None stays None."""
    out: dict[str, Any] = {}
    for key, value in summary.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        elif isinstance(value, (list, tuple)):
            out[name] = json.dumps(value, default=str)
        else:
            out[name] = value
    return out


def run_cell(cell: Cell) -> dict[str, Any]:
    """Run ``cell`` here (a worker process or a Ray task) and return its row.

    User errors (``kvtrace.errors.USER_ERRORS``, a bad workload line, options the
    scheduler model refuses) and bugs alike become a ``failed`` row with the message
    (a bug's prefixed ``internal error``); nothing raises.
    """
    from kvtrace.errors import USER_ERRORS
    from traces.workloads import WorkloadFileError

    row: dict[str, Any] = {"cell": cell.key, "input": cell.input.label, "kind": cell.kind, **cell.params()}
    t0 = time.perf_counter()
    try:
        summary = _simulate(cell) if cell.kind == "simulate" else _replay(cell)
    except (*USER_ERRORS, WorkloadFileError, ValueError) as exc:  # ValueError: options record refuses
        row.update(status="failed", error=str(exc))
    except Exception as exc:  # noqa: BLE001 - a bug in one cell must not lose the others
        row.update(status="failed", error=f"internal error: {type(exc).__name__}: {exc}")
    else:
        status, problem = _judge(cell, summary)
        row.update(status=status, error=None, problem=problem)
        row.update(flatten(summary))
    row["cell_wall_s"] = time.perf_counter() - t0
    return row


def _judge(cell: Cell, summary: dict[str, Any]) -> tuple[str, str | None]:
    """The cell's status and, unless ``ok``, its problem in one line: what ``kvtrace
    replay`` (or ``record``) would report and exit 1 for. Violations come first: a
    leak is the bug, an out-of-memory after it often its consequence."""
    if cell.kind == "simulate":
        found = summary.get("integrity_violations") or []
        if found:
            return "violations", f"{len(found):,} allocator integrity violations; the first: {found[0]}"
        return "ok", None
    problems: list[tuple[str, str]] = []
    num_violations = summary.get("num_violations") or 0
    if num_violations:
        shown = "; ".join(f"{v['check']}: {v['detail']}" for v in summary["violations"][:VIOLATIONS_SHOWN])
        problems.append(("violations", f"{num_violations:,} violations: {shown}"))
    oom = summary.get("oom")
    if oom is not None and cell.settings.on_oom == "stop":
        problems.append(
            ("oom", f"out of memory at step {oom['step']} (request {oom['rid']} needed {oom['needed']:,}, "
                    f"free {oom['free']:,}); the replay stopped there")
        )  # fmt: skip
    if summary.get("bad_ops"):
        problems.append(("bad-ops", f"{summary['bad_ops']:,} impossible ops in the trace skipped"))
    if not problems:
        return "ok", None
    return problems[0][0], "; ".join(text for _, text in problems)


def swa_layout(cell: Cell, layout: AttentionLayout | None, pool_tokens: int, page_size: int) -> AttentionLayout | None:
    """An input's attention layout under the cell's sliding window and SWA/full pool
    ratio (a new ratio sizes the SWA pool from ``pool_tokens`` as SGLang does); the
    layout as it is when the cell sets neither.

    Raises:
        ConfigError: the cell sets one and the input is a full-attention model.
    """
    if cell.swa_window is None and cell.swa_full_tokens_ratio is None:
        return layout
    if layout is None:
        from kvtrace.errors import ConfigError

        raise ConfigError(f"{cell.input.label} is a full-attention model: it has no sliding window or SWA pool to vary")
    import dataclasses

    if cell.swa_window is not None:
        layout = dataclasses.replace(layout, sliding_window=cell.swa_window)
    if cell.swa_full_tokens_ratio is not None:
        layout = dataclasses.replace(layout, swa_full_tokens_ratio=cell.swa_full_tokens_ratio).for_pool(pool_tokens, page_size)
    return layout


def host_tier(cell: Cell, settings: dict[str, Any]) -> Any:
    """A simulated cell's host tier (``traces.hicache_layout.resolve_host_tier`` over the
    input's own): ratio 0 is none; None where the cell turns none on.

    Raises:
        ConfigError: a value the host tier refuses.
    """
    from kvtrace.errors import ConfigError
    from kvtrace.record.simulate import DEFAULT_MODEL_SHAPE
    from traces.hicache_layout import HostTierOptionError, resolve_host_tier

    model = settings.get("model", DEFAULT_MODEL_SHAPE)
    hybrid = settings.get("attention") is not None or settings.get("mamba") is not None
    try:
        return resolve_host_tier(
            settings.get("hicache"), enabled=False if cell.hicache_ratio == 0 else None,
            ratio=cell.hicache_ratio or None, size_gb=None,
            write_policy=None if cell.hicache_ratio == 0 else cell.hicache_write_policy,
            device_tokens=settings["pool_tokens"], page_size=settings["page_size"],
            bytes_per_token=model.bytes_per_token, hybrid_model=model.name if hybrid else None,
        )  # fmt: skip
    except HostTierOptionError as exc:
        raise ConfigError(f"{exc.option}: {exc}") from None


def _replay(cell: Cell) -> dict[str, Any]:
    """``kvtrace replay INPUT --json`` with the cell's options (on an SWA trace, its
    window and pool ratio: the trace's attention layout as ``swa_layout`` changes it)."""
    import dataclasses

    from kvtrace.replay.engine import ReplayOptions
    from kvtrace.replay.session import ReplaySession, open_trace

    s = cell.settings
    options = ReplayOptions(check=s.check, on_oom=s.on_oom)  # type: ignore[arg-type]
    trace: Any = cell.input.label
    if cell.swa_window is not None or cell.swa_full_tokens_ratio is not None:
        trace = open_trace(cell.input.label)
        meta = trace.meta
        layout = swa_layout(cell, meta.attention, meta.config.pool_tokens, meta.config.page_size)
        trace.meta = dataclasses.replace(meta, attention=layout)
    if cell.hicache_ratio == 0:  # no host tier, also for a trace recorded with one
        trace = open_trace(trace) if isinstance(trace, str) else trace
        trace.meta = trace.meta.with_config(hicache=None)
    with ReplaySession(
        trace,
        label=cell.input.label,
        version=cell.version,
        page_size=cell.page_size,
        pool_tokens=cell.pool_tokens,
        device=s.device,
        eviction_policy=cell.eviction_policy,
        hicache_ratio=cell.hicache_ratio or None,
        hicache_write_policy=cell.hicache_write_policy,
        options=options,
        checker="inline",  # the sweep's parallelism is across cells
    ) as session:
        if not s.explain:
            return session.run().to_dict()
        from kvtrace.explain.report import Explainer

        explainer = Explainer(session)
        summary = session.run().to_dict()
    report = explainer.report().to_dict()
    summary["explain"] = {key: report[key] for key in EXPLAIN_COLUMNS}
    return summary


def _simulate(cell: Cell) -> dict[str, Any]:
    """``kvtrace record INPUT --json`` with the cell's options (the trace kept only
    with ``keep_traces``)."""
    from kvtrace.record.serving import serving_settings
    from kvtrace.record.simulate import RecordOptions, record_report, record_workload, spec_settings

    from kvtrace.versions.registry import resolve_version

    s = cell.settings
    path = Path(cell.input.path)
    given: dict[str, Any] = {
        "pool_tokens": cell.pool_tokens,
        "page_size": cell.page_size or resolve_version(cell.version).page_size,  # token, paged:N fix theirs
        "max_running": cell.max_running,
        "chunk": cell.chunk,
        "seed": s.seed,
        "eviction_policy": cell.eviction_policy,
    }
    if cell.spec is not None:
        given["spec"] = spec_settings(cell.spec)
    settings = serving_settings(path, cell.input.fmt, given)
    if cell.swa_window is not None or cell.swa_full_tokens_ratio is not None:
        settings["attention"] = swa_layout(cell, settings.get("attention"), settings["pool_tokens"], settings["page_size"])
    if cell.hicache_ratio is not None or cell.hicache_write_policy is not None:
        settings["hicache"] = host_tier(cell, settings)
    out = None
    if s.keep_traces is not None:
        out = Path(s.keep_traces) / f"{Path(cell.input.label.removeprefix('sample:')).stem}-{cell.key}.kvtrace"
    options = RecordOptions(
        workload=path,
        fmt=cell.input.fmt,  # type: ignore[arg-type]
        out=out,
        duration_s=s.duration_s,
        time_scale=s.time_scale,
        rate=s.rate,
        device=s.device,
        overwrite=True,
        flush_interval_s=None,
        version=cell.version,
        **settings,
    )
    t0 = time.perf_counter()
    result = record_workload(options)
    return record_report(result, options, wall_s=time.perf_counter() - t0)
