"""``kvtrace info`` on a state log (``kvtrace replay --out``): what replay it holds.

One streaming pass over the log's record batches, vectorised per batch: the steps
and their time span, the peak of used KV, the final pool counters, the events by
kind, the allocator time, and (``replay --explain --out``) the missed tokens by
cause. A hybrid sliding-window model's log has each pool's peak and final counters
too (``pools``); the top level is the full pool's.
"""

from __future__ import annotations

from typing import Any

from kvtrace.cli import ui

# The allocator settings the summary table shows (the JSON has them all).
_EXPLAIN_PREFIX = "explain_"  # kvtrace.explain.attribution.STEP_COLUMNS
_CONFIG_SHOWN = ("page_size", "pool_tokens", "max_running", "max_context_len", "device", "radix_cache")


def state_log_info(spec: str) -> dict[str, Any]:
    """Everything ``kvtrace info LOG --json`` prints for a state log.

    Raises:
        TraceError: the file is not a state log this kvtrace reads, or is damaged.
    """
    import numpy as np
    import pyarrow.compute as pc

    from kvtrace.replay.snapshot import PoolCounters
    from kvtrace.statelog.log import open_state_log, other_pools_of
    from traces.samples import resolve_trace

    stored, reader = open_state_log(resolve_trace(spec))
    # each pool's column prefix: the full pool's counters are unprefixed
    prefixes = {"full": "", **{pool: f"{pool}_" for pool in other_pools_of(reader.schema)}}
    steps = keyframes = ops = 0
    allocator_s = 0.0
    first_step = last_step = None
    first_time = last_time = None
    peaks: dict[str, tuple[int, int | None]] = {pool: (-1, None) for pool in prefixes}
    finals: dict[str, dict[str, int] | None] = {pool: None for pool in prefixes}
    events: dict[str, dict[str, int]] = {}
    # replay --explain --out: each step's missed tokens by cause (explain_<cause> columns)
    explain = {name[len(_EXPLAIN_PREFIX):]: 0 for name in reader.schema.names if name.startswith(_EXPLAIN_PREFIX)}
    for batch in reader.iter_batches():
        n = batch.num_rows
        if n == 0:
            continue
        step = batch.column("step").to_numpy()
        time_s = batch.column("time_s").to_numpy()
        for pool, prefix in prefixes.items():
            used = (
                batch.column(f"{prefix}pool_tokens").to_numpy()
                - batch.column(f"{prefix}available").to_numpy()
                - batch.column(f"{prefix}evictable").to_numpy()
            )
            top = int(np.argmax(used))
            if int(used[top]) > peaks[pool][0]:
                peaks[pool] = (int(used[top]), int(step[top]))
            finals[pool] = {  # a log written before session_held has none
                name: int(batch.column(f"{prefix}{name}")[n - 1].as_py())
                for name in PoolCounters._fields if f"{prefix}{name}" in batch.schema.names
            }
        if first_step is None:
            first_step, first_time = int(step[0]), float(time_s[0])
        last_step, last_time = int(step[-1]), float(time_s[-1])
        steps += n
        for cause in explain:
            explain[cause] += int(batch.column(_EXPLAIN_PREFIX + cause).to_numpy().sum())
        keyframes += int(np.count_nonzero(batch.column("keyframe").to_numpy(zero_copy_only=False)))
        ops += int(batch.column("num_ops").to_numpy().sum())
        allocator_s += float(batch.column("allocator_s").to_numpy().sum())
        flat = pc.list_flatten(batch.column("events"))
        if len(flat):
            kinds = flat.field("kind").to_numpy(zero_copy_only=False).astype(str)
            tokens = flat.field("tokens").fill_null(0).to_numpy()
            names, index = np.unique(kinds, return_inverse=True)
            counts = np.bincount(index, minlength=names.shape[0])
            sums = np.bincount(index, weights=tokens, minlength=names.shape[0])
            for name, count, total in zip(names.tolist(), counts.tolist(), sums.tolist()):
                entry = events.setdefault(name, {"count": 0, "tokens": 0})
                entry["count"] += int(count)
                entry["tokens"] += int(total)
    if reader.truncated:
        ui.warn(f"{reader.path}: {reader.truncation_detail}")
    peak_used, peak_step = peaks["full"]
    pools: dict[str, Any] = {}
    if len(prefixes) > 1:  # a full-attention log's one pool is the top level only
        pools["pools"] = {
            pool: {"peak_used_tokens": max(peaks[pool][0], 0), "peak_step": peaks[pool][1], "final": finals[pool]}
            for pool in prefixes
        }
    return {
        "kind": "state_log",
        "path": str(reader.path),
        "version": stored.get("version"),
        "ipc_format": reader.ipc_format,
        "trace": stored.get("trace"),
        "allocator": stored.get("allocator"),
        "config": stored.get("config"),
        "steps": steps,
        "first_step": first_step,
        "last_step": last_step,
        "keyframes": keyframes,
        "duration_s": 0.0 if first_time is None else float(last_time - first_time),  # type: ignore[operator]
        "ops": ops,
        "allocator_s": allocator_s,
        "peak_used_tokens": max(peak_used, 0),
        "peak_step": peak_step,
        "final": finals["full"],
        "events": dict(sorted(events.items())),
        "file_bytes": reader.file_bytes,
        "record_batches": reader.num_record_batches,
        "truncated": reader.truncated,
        "truncation_detail": reader.truncation_detail,
        **pools,
        **({"explain": explain} if explain else {}),
    }


def render_state_log_info(info: dict[str, Any]) -> None:
    """The state-log summary as a table on stdout."""
    from rich.table import Table

    from kvtrace.replay.report import count

    table = Table(title=f"kvtrace info: {info['path']} (state log)", show_header=False, title_justify="left")
    table.add_column("field", style="bold")
    table.add_column("value")
    table.add_row("state log", f"version {info['version']} (Arrow IPC {info['ipc_format']})")
    table.add_row("replay of", f"{info['trace']} with allocator {info['allocator']}")
    config = info["config"] or {}
    shown = [key for key in _CONFIG_SHOWN if key in config]
    if shown:
        table.add_row("config", ", ".join(f"{key} {config[key]:,}" if isinstance(config[key], int) and not isinstance(config[key], bool) else f"{key} {config[key]}" for key in shown))
    span = "" if info["first_step"] is None else f" ({info['first_step']:,}..{info['last_step']:,})"
    keyframes = f", {count(info['keyframes'], 'keyframe')}" if info["keyframes"] else ""
    table.add_row("steps", f"{info['steps']:,}{span}{keyframes}")
    table.add_row("duration", f"{info['duration_s']:,.2f} s (simulated)")
    table.add_row("ops", f"{info['ops']:,} ({info['allocator_s']:,.3f} s in the allocator)")
    peak = "" if info["peak_step"] is None else f" at step {info['peak_step']:,}"
    table.add_row("peak used", f"{count(info['peak_used_tokens'], 'token')}{peak}")
    final = info["final"]
    if final is not None:
        table.add_row(
            "at the end",
            f"{final['available']:,} available, {final['evictable']:,} evictable, {final['protected']:,} protected, "
            f"{final['committed']:,} committed, {final['overallocated']:,} over-allocated of {final['pool_tokens']:,}; "
            f"{count(final['running_requests'], 'request')} running",
        )
    for name, pool in info.get("pools", {}).items():
        peak = "" if pool["peak_step"] is None else f" at step {pool['peak_step']:,}"
        end = pool["final"]
        at_end = "" if end is None else f"; at the end {end['available']:,} available of {end['pool_tokens']:,}"
        unit = "slot" if name == "mamba" else "token"  # the Mamba pool counts state slots
        table.add_row(f"{name} pool", f"peak used {count(pool['peak_used_tokens'], unit)}{peak}{at_end}")
    events = info["events"]
    table.add_row(
        "events",
        ", ".join(f"{kind} {e['count']:,}" + (f" ({count(e['tokens'], 'token')})" if e["tokens"] else "") for kind, e in events.items())
        or "none",
    )
    if "explain" in info:
        missed = info["explain"]
        table.add_row("missed tokens", f"{sum(missed.values()):,} by cause: "
                      + ", ".join(f"{cause} {n:,}" for cause, n in missed.items()))
    table.add_row("file", f"{count(info['file_bytes'], 'byte')}, {count(info['record_batches'], 'record batch', 'record batches')}")
    table.add_row(
        "truncated",
        f"[bold red]yes[/]: {info['truncation_detail']}" if info["truncated"] else "no",
    )
    ui.console().print(table)
