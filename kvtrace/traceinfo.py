"""What ``kvtrace info`` reports about a trace, computed in one streaming pass (a
library function: the ``info`` command renders it, ``kvtrace shrink`` sizes its input
with it)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from traces.metadata import TraceMeta
    from traces.reader import TraceReader

__all__ = ["trace_info"]


def trace_info(reader: TraceReader, *, on_batch: Any = None) -> dict[str, Any]:
    """Everything ``kvtrace info --json`` prints, computed in one streaming pass.

    Vectorised per record batch: memory is flat in trace length (plus one bit
    per request id).
    """
    import numpy as np

    from traces.schema import DECODE, EXTEND, OPS, PREALLOC, SESSION_OPS, SPEC

    meta = reader.meta
    ops = np.zeros(len(OPS), np.int64)
    tokens = {"prefill": 0, "decode": 0, "spec_accepted": 0, "spec_drafted": 0, "prealloc": 0}
    seen = np.zeros(1024, np.bool_)
    steps = rows = 0
    first_step = last_step = None
    first_time = last_time = None
    max_seq_len = 0
    max_rows_per_step = 0
    for columns in reader.iter_columns():
        n = columns.step.shape[0]
        if n == 0:
            continue
        step = columns.step
        bounds = np.flatnonzero(step[1:] != step[:-1]) + 1
        steps += bounds.shape[0] + 1 - int(last_step is not None and int(step[0]) == last_step)
        sizes = np.diff(np.concatenate(([0], bounds, [n])))
        max_rows_per_step = max(max_rows_per_step, int(sizes.max()))
        if first_step is None:
            first_step = int(step[0])
        last_step = int(step[-1])
        times = columns.time_s[np.isfinite(columns.time_s)]  # NaN or infinite times: validate's problems
        if times.size:
            first_time = float(times[0]) if first_time is None else first_time
            last_time = float(times.max()) if last_time is None else max(last_time, float(times.max()))
        rows += n
        op = columns.op
        ops += np.bincount(op, minlength=len(OPS))
        append = columns.append_len.astype(np.int64)
        tokens["prefill"] += int(append[op == EXTEND].sum())
        tokens["decode"] += int(append[op == DECODE].sum())
        tokens["prealloc"] += int(append[op == PREALLOC].sum())
        is_spec = op == SPEC
        tokens["spec_accepted"] += int(columns.accepted_len[is_spec].astype(np.int64).sum())
        tokens["spec_drafted"] += int(columns.draft_len[is_spec].astype(np.int64).sum())
        max_seq_len = max(max_seq_len, int(columns.seq_len.max()))
        rid = columns.rid[(columns.rid >= 0) & (columns.rid < reader.rid_bound)]
        if rid.size:
            top = int(rid.max())
            if top >= seen.shape[0]:
                seen = np.concatenate([seen, np.zeros(max(top + 1, 2 * seen.shape[0]) - seen.shape[0], np.bool_)])
            seen[rid] = True
        if on_batch is not None:
            on_batch()
    config = meta.to_dict()
    recording = reader.recording
    return {
        "kind": "trace",
        "path": str(reader.path),
        "format_version": meta.format_version,
        "ipc_format": reader.ipc_format,
        "source": config["source"],
        "config": config["config"],
        "model": config["model"],
        "attention": attention_info(meta),
        "mamba": mamba_info(meta),
        "namespaces": namespaces_info(meta),
        "hicache": hicache_info(meta),
        "block_size": meta.block_size,
        "created_at": meta.created_at,
        "recording": None if recording is None else dataclasses.asdict(recording),
        "interrupted": bool(recording is not None and recording.interrupted),
        "steps": steps,
        "first_step": first_step,
        "last_step": last_step,
        "rows": rows,
        "max_rows_per_step": max_rows_per_step,
        "requests": int(seen.sum()),
        # the session ops only where the trace may hold them (config.sessions, version 6)
        "ops": {
            name: int(count) for code, (name, count) in enumerate(zip(OPS, ops))
            if code not in SESSION_OPS or meta.config.sessions
        },
        "tokens": tokens,
        "max_seq_len": max_seq_len,
        "duration_s": 0.0 if first_time is None else float(last_time - first_time),  # type: ignore[operator]
        "file_bytes": reader.file_bytes,
        "record_batches": reader.num_record_batches,
        "truncated": reader.truncated,
        "truncation_detail": reader.truncation_detail,
        "extra": config["extra"],
    }


def namespaces_info(meta: TraceMeta) -> dict[str, Any] | None:
    """The trace's cache namespaces: how many, their names, and how many requests each
    holds (None: no request has one)."""
    table = meta.namespaces
    if table is None:
        return None
    counts = [0] * len(table.names)
    for index in table.of_rid:
        if index >= 0:
            counts[index] += 1
    return {"count": len(table.names), "requests": dict(zip(table.names, counts))}


def attention_info(meta: TraceMeta) -> dict[str, Any] | None:
    """The trace's attention layout with both pools' sizes and costs per token (None:
    every layer full attention, one pool)."""
    layout = meta.attention
    if layout is None:
        return None
    out = meta.to_dict()["attention"]
    out.update(
        num_full_layers=len(layout.full_layer_ids),
        num_swa_layers=len(layout.swa_layer_ids),
        layer_kinds=layout.layer_kinds(meta.model.num_layers),
        full_pool_tokens=meta.config.pool_tokens,
        full_bytes_per_token=layout.full_bytes_per_token(meta.model),
        swa_bytes_per_token=layout.swa_bytes_per_token(meta.model),
    )
    return out


def mamba_info(meta: TraceMeta) -> dict[str, Any] | None:
    """A hybrid linear-attention trace's layout with the Mamba slots, the state bytes
    per request and the KV pool's cost per token (None: no linear-attention layer)."""
    from traces.mamba_layout import mamba_slots_per_request

    layout = meta.mamba
    if layout is None:
        return None
    out = meta.to_dict()["mamba"]
    out.update(
        num_full_layers=len(layout.full_layer_ids),
        num_mamba_layers=len(layout.mamba_layer_ids),
        layer_kinds=layout.layer_kinds(meta.model.num_layers),
        state_bytes_per_request=layout.state_bytes_per_request,
        slots_per_request=mamba_slots_per_request(meta.config.radix_cache, meta.config.page_size),
        full_pool_tokens=meta.config.pool_tokens,
        full_bytes_per_token=layout.full_bytes_per_token(meta.model),
    )
    return out


def hicache_info(meta: TraceMeta) -> dict[str, Any] | None:
    """The trace's HiCache host tier (``config.hicache``) with the host memory it takes:
    ``host_bytes``, the pool times the model's bytes per token as SGLang's host pool of a
    full-attention model holds it (None for a hybrid model, whose host copy's bytes per
    token are not modelled). None: no host tier."""
    tier = meta.config.hicache
    if tier is None:
        return None
    out = meta.to_dict()["config"]["hicache"]
    hybrid = meta.attention is not None or meta.mamba is not None
    out.update(
        device_pool_tokens=meta.config.pool_tokens,
        host_bytes=None if hybrid else tier.host_pool_tokens * meta.model.bytes_per_token,
    )
    return out
