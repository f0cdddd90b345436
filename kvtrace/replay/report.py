"""Replay summaries: the stable JSON object and its human rendering."""

from __future__ import annotations

import shlex
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from kvtrace.replay.result import ReplayResult

VIOLATIONS_SHOWN = 5
RERUN_CONTEXT_STEPS = 100  # steps before the first violation in the suggested --steps window


def replay_summary(result: ReplayResult) -> dict[str, Any]:
    """The ``kvtrace replay --json`` object (keys are a stable contract; add, never rename).

    It describes the replayed window (``--steps A:B``) and the configuration the
    allocator actually ran with.
    """
    stats = result.stats
    config = result.config
    wall_s = result.wall_s
    duration = (stats.last_time_s - stats.first_time_s) if stats.first_time_s is not None else 0.0
    hit_rate = stats.reused_tokens / stats.admitted_tokens if stats.admitted_tokens else 0.0
    opts = result.options
    return {
        "trace": result.trace,
        "allocator": result.allocator,
        "steps": stats.steps,
        "steps_reported": stats.steps_reported,
        "first_step": stats.first_step,
        "last_step": stats.last_step,
        "window": {"start": opts.start_step, "stop": opts.stop_step},
        "requests": result.requests,
        "ops": stats.ops,
        "device": config.device,
        "page_size": config.page_size,
        "pool_tokens": config.pool_tokens,
        "max_running": config.max_running,
        "radix_cache": config.radix_cache,
        # the radix cache's eviction policy (a version before policies evicts LRU)
        "eviction_policy": getattr(config, "eviction_policy", "lru"),
        "namespaces": result.namespaces,
        "check": opts.check,
        "wall_s": round(wall_s, 6),
        "allocator_s": round(stats.allocator_s, 6),
        "duration_s": round(duration, 6),
        "speedup_vs_realtime": round(duration / wall_s, 3) if wall_s > 0 else None,
        "peak_used_tokens": stats.peak_used_tokens,
        "peak_step": stats.peak_step,
        "prefix_hit_rate": round(hit_rate, 6),
        "prefix_differs_from_recorded": stats.prefix_differs,
        "admissions": stats.admissions,
        "tokens": {
            "prefill": stats.prefill_tokens,
            "reused": stats.reused_tokens,
            "decode": stats.decode_tokens,
            "spec_accepted": stats.spec_accepted,
        },
        "evicted_tokens": stats.evicted_tokens,
        "overalloc": {
            "held_at_start": stats.overalloc_held_at_start,
            "allocated": stats.overalloc_allocated,
            "released": stats.overalloc_released,
            "held_at_end": result.overalloc_held_at_end,
            "page_tail_at_end": result.page_tail_at_end,
        },
        "finishes": stats.finishes,
        "retractions": stats.retractions,
        "aborts": stats.aborts,
        **_sessions_summary(result),
        "oom": asdict(stats.oom) if stats.oom is not None else None,
        "num_ooms": stats.num_ooms,
        "dropped_requests": stats.dropped_requests,
        "skipped_ops": stats.skipped_ops,
        "bad_ops": stats.bad_ops,
        "row_overflows": stats.row_overflows,
        "violations": [asdict(v) for v in stats.violations],
        "num_violations": stats.num_violations,
        "stopped_early": result.stopped_early,
        "truncated": result.truncated,
        **_pools_summary(result),
        **_tiers_summary(result),
    }


def _tiers_summary(result: ReplayResult) -> dict[str, Any]:
    """``{"hicache": ...}`` with HiCache's host tier: its pool and write policy, and the
    admitted prompt tokens by where they came from: ``device`` (a device hit), ``host``
    (a host hit loaded back), ``miss`` (computed). Empty without the tier."""
    tier = getattr(result.config, "hicache", None)
    if tier is None:
        return {}
    st = result.stats
    host = st.host_reused_tokens
    return {
        "hicache": {
            "host_pool_tokens": tier.pool_tokens(result.config.pool_tokens),
            "write_policy": tier.write_policy,
            "prefix_tokens": {
                "device": st.reused_tokens - host,
                "host": host,
                "miss": max(st.admitted_tokens - st.reused_tokens, 0),
            },
        }
    }


def _sessions_summary(result: ReplayResult) -> dict[str, Any]:
    """``{"session_held": ...}`` for a trace with streaming sessions: the turns whose KV
    their session kept, the sessions closed, and the most KV sessions held at a step's end
    (SGLang's count: a later turn's row while it runs too); empty otherwise, so that such a summary is what it was before sessions."""
    if not result.sessions:
        return {}
    stats = result.stats
    return {
        "session_held": {
            "holds": stats.session_holds,
            "closes": stats.session_closes,
            "peak_tokens": stats.peak_session_held,
        }
    }


def _pools_summary(result: ReplayResult) -> dict[str, Any]:
    """``{"pools": {name: ...}}``: each KV pool of a hybrid model (its size, peak
    occupancy and step, use at the end, out-of-memory count); empty for a
    full-attention model, whose one pool is the summary's top level (``pool_tokens``,
    ``peak_used_tokens``, ...), as it is the full pool's for a hybrid one."""
    if not result.pools_at_end:
        return {}
    stats = result.stats
    pools: dict[str, Any] = {}
    for name, counters in result.pools_at_end.items():
        peak = stats.pool_peaks.get(name)
        pools[name] = {
            "pool_tokens": counters.pool_tokens,
            "peak_used_tokens": peak.used_tokens if peak is not None else 0,
            "peak_step": peak.step if peak is not None else None,
            "used_tokens_at_end": counters.used_tokens,
            "available_at_end": counters.available,
            "num_ooms": stats.ooms_by_pool.get(name, 0),
        }
    return {"pools": pools}


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` things in words, with thousands separators: ``count(1, "page")`` is "1 page",
    ``count(12031, "request")`` "12,031 requests" (``plural``: when not noun + "s")."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def render_replay_summary(
    summary: dict[str, Any], console: Console, *, title: str = "replay", rerun: tuple[str, ...] = ()
) -> None:
    """Print the summary as rich tables (the human form of ``replay_summary``).

    Args:
        rerun: the options the user gave that change the replay (``--pool-tokens 100``), which the
            "to look closer" command line after a violation repeats.
    """
    s = summary
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("", style="bold")
    table.add_column("")
    window = s["window"]
    span = ""
    if window["start"] is not None or window["stop"] is not None:
        span = f" (window {window['start'] if window['start'] is not None else ''}:{window['stop'] if window['stop'] is not None else ''}"
        span += f", steps {s['first_step']:,}..{s['last_step']:,})" if s["first_step"] is not None else ", no step)"
    table.add_row("steps / requests / ops", f"{s['steps']:,} / {s['requests']:,} / {s['ops']:,}{span}")
    table.add_row("pool", f"{s['pool_tokens']:,} tokens, page size {s['page_size']}, device {s['device']}")
    tok = s["tokens"]
    table.add_row(
        "tokens",
        f"prefill {tok['prefill']:,} computed + {tok['reused']:,} reused, "
        f"decode {tok['decode']:,}, spec accepted {tok['spec_accepted']:,}",
    )
    pct = 100.0 * s["peak_used_tokens"] / s["pool_tokens"] if s["pool_tokens"] else 0.0
    table.add_row("peak occupancy", f"{count(s['peak_used_tokens'], 'token')} ({pct:.1f}%) at step {_num(s['peak_step'])}")
    for name, pool in s.get("pools", {}).items():
        pct = 100.0 * pool["peak_used_tokens"] / pool["pool_tokens"] if pool["pool_tokens"] else 0.0
        unit = "slot" if name == "mamba" else "token"  # the Mamba pool counts state slots (the JSON keeps the keys)
        table.add_row(
            f"{name} pool",
            f"{pool['pool_tokens']:,} {unit}s; peak {count(pool['peak_used_tokens'], unit)} ({pct:.1f}%) at step "
            f"{_num(pool['peak_step'])}; {pool['used_tokens_at_end']:,} used at end; "
            f"{count(pool['num_ooms'], 'out-of-memory', 'out-of-memories')}",
        )
    table.add_row(
        "prefix cache",
        _cache_config(s) +
        f"hit rate {100 * s['prefix_hit_rate']:.1f}% over {count(s['admissions'], 'admission')}; "
        f"{_differs(s['prefix_differs_from_recorded'])}; "
        f"{count(s['evicted_tokens'], 'token')} evicted",
    )
    if "hicache" in s:
        hc = s["hicache"]
        t = hc["prefix_tokens"]
        table.add_row(
            "prefix by tier",
            f"{t['device']:,} device hit + {t['host']:,} host hit loaded back + {t['miss']:,} missed "
            f"(host pool {hc['host_pool_tokens']:,} tokens, {hc['write_policy']})",
        )
    oa = s["overalloc"]
    start = f"held at start {oa['held_at_start']:,} + " if oa["held_at_start"] else ""
    table.add_row(
        "over-allocation",
        f"{start}allocated {oa['allocated']:,} - released {oa['released']:,} = held at end "
        f"{count(oa['held_at_end'], 'speculative slot')}; page-tail padding at end {oa['page_tail_at_end']:,}",
    )
    table.add_row("releases", f"{s['finishes']:,} finished, {s['retractions']:,} retracted, {s['aborts']:,} aborted")
    sh = s.get("session_held")
    if sh and (sh["holds"] or sh["closes"]):
        table.add_row(
            "sessions",
            f"{sh['holds']:,} turns held, {sh['closes']:,} closed; at most "
            f"{count(sh['peak_tokens'], 'token')} held by sessions",
        )
    oom = s["oom"]
    if oom is None:
        table.add_row("out of memory", "none")
    else:
        table.add_row(
            "out of memory",
            f"[red]first at step {oom['step']:,}, request {oom['rid']} ({oom['op']}"
            + (f", {oom['pool']} pool" if oom.get("pool", "full") != "full" else "")
            + f"): needed {oom['needed']:,}, free {oom['free']:,}, evictable {oom['evictable']:,}[/red]"
            + (f"; {s['num_ooms']:,} in all, {count(s['dropped_requests'], 'request')} dropped" if s["num_ooms"] > 1 else ""),
        )
    if s["bad_ops"]:
        table.add_row("bad ops in trace", f"[yellow]{s['bad_ops']:,} skipped[/yellow]")
    nv = s["num_violations"]
    table.add_row("invariants", "[green]clean[/green]" if nv == 0 else f"[red]{count(nv, 'violation')}[/red]")
    speed = s["speedup_vs_realtime"]
    table.add_row(
        "time",
        f"wall {s['wall_s']:,.2f} s (allocator {s['allocator_s']:,.2f} s) for {s['duration_s']:,.1f} s of serving"
        + (f" = {speed:,.0f}x real time" if speed else ""),
    )
    if s["stopped_early"]:
        table.add_row("", "[red]replay stopped early[/red]")
    console.print(table)
    if nv:
        shown = s["violations"][:VIOLATIONS_SHOWN]
        vt = Table(title=f"invariant violations (first {len(shown)} of {nv:,})", title_justify="left")
        for col in ("step", "request", "op", "check", "detail"):
            vt.add_column(col)
        for v in shown:
            vt.add_row(str(v["step"]), "-" if v["rid"] is None else str(v["rid"]), v["op"], v["check"], v["detail"])
        console.print(vt)
        if nv > len(shown):
            console.print(f"... and {nv - len(shown):,} more (all of them with --json)")
        first = shown[0]["step"]
        again = shlex.join(["kvtrace", "replay", s["trace"], *rerun])
        allocator = f" --allocator {shlex.quote(s['allocator'])}" if s["allocator"] != "builtin" and "--allocator" not in rerun else ""
        console.print(
            f"To look closer: {again}{allocator} --steps {max(first - RERUN_CONTEXT_STEPS, 0)}:{first + 1} "
            "--check every (-x stops at the first violation)",
            markup=False,
        )


def _cache_config(s: dict[str, Any]) -> str:
    """'slru eviction, 3 namespaces; ' where the radix cache is not the default one (LRU,
    one namespace), else '' (a default replay's summary reads as it always did)."""
    parts = []
    if s.get("eviction_policy", "lru") != "lru":
        parts.append(f"{s['eviction_policy']} eviction")
    if s.get("namespaces", 0):
        parts.append(count(s["namespaces"], "namespace"))
    return ", ".join(parts) + "; " if parts else ""


def _num(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _differs(n: int) -> str:
    """How many admissions the replay's radix cache gave another prefix hit than the recording's."""
    if n == 1:
        return "1 recomputed prefix hit differs from the recorded one"
    return f"{n:,} recomputed prefix hits differ from the recorded ones"


# ---------------------------------------------------------------------------- kvtrace diff

HISTORY_FIELDS = ("kv_allocated_len", "kv_committed_len", "cache_protected_len")
# Rows of the side-by-side summary: label, how to read it from a replay summary.
_SUMMARY_ROWS: tuple[tuple[str, Any], ...] = (
    ("steps", lambda s: s.get("steps")),
    ("peak occupancy", lambda s: None if s.get("peak_used_tokens") is None else
        f"{s['peak_used_tokens']:,} tokens at step {_num(s.get('peak_step'))}"),
    ("prefix hit rate", lambda s: None if s.get("prefix_hit_rate") is None else f"{100 * s['prefix_hit_rate']:.2f}%"),
    ("evicted tokens", lambda s: s.get("evicted_tokens")),
    ("over-allocation", lambda s: _overalloc(s.get("overalloc"))),
    ("out of memory", lambda s: "none" if s.get("oom") is None else
        f"step {_num(s['oom']['step'])}, request {s['oom']['rid']}"),
    ("invariant violations", lambda s: s.get("num_violations")),
    ("wall time", lambda s: None if s.get("wall_s") is None else f"{s['wall_s']:.2f} s"),
)


def _overalloc(oa: dict[str, Any] | None) -> str | None:
    """allocated / released / held at end (a state log knows only what was released)."""
    if not oa:
        return None
    parts = [oa.get(k) for k in ("allocated", "released", "held_at_end")]
    return " / ".join("?" if p is None else f"{p:,}" for p in parts)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def _lens(values: dict[str, Any] | None) -> str:
    if values is None:
        return "(unchanged)"
    if "kv_allocated_len" in values:
        return " / ".join(f"{values[k]:,}" for k in HISTORY_FIELDS) + f"  {values['phase']}"
    return ", ".join(f"{k}={_cell(v)}" for k, v in values.items())


def _history_op(row: dict[str, Any]) -> str:
    ops = [v["op"] for v in (row["a"], row["b"]) if v is not None and "op" in v]
    return "/".join(dict.fromkeys(ops)) or ""


def render_diff_report(report: dict[str, Any], console: Console) -> None:
    """Print a ``kvtrace diff`` result (``DiffReport.to_dict()``) for a terminal: the
    verdict, each divergence the way pytest shows a failed comparison with its history
    on both sides, and the side-by-side summary."""
    versions = report["versions"]
    label_a = f"A {versions['a']['label']}"
    label_b = f"B {versions['b']['label']}"
    console.print(f"[bold]kvtrace diff {report['trace']}[/bold]  ({report['mode']}{', exact' if report['exact'] else ''})")
    for side in ("a", "b"):
        v = versions[side]
        for line in _fitted(f"  {side.upper()}  {v['spec']}  ", [v["origin"]], console.width, indent=5):
            console.print(line, markup=False, style="dim" if line.startswith("     ") else None, soft_wrap=True)
    for note in report.get("notes", ()):
        console.print(f"[yellow]note:[/yellow] {note}")
    for i, d in enumerate(report["divergences"]):
        who = f", request {d['rid']}" if d["rid"] is not None else ""
        head = "FIRST DIVERGENCE" if i == 0 else f"DIVERGENCE {i + 1}"
        console.print(f"\n[bold red]{head}[/bold red] at step {d['step']:,} ({d['op']}){who}: [bold]{d['field']}[/bold]")
        width = max(len(label_a), len(label_b))
        for label, value in ((label_a, d["a"]), (label_b, d["b"])):
            console.print(f"  {label:<{width}}  {_cell(value)}", markup=False)
        if d["detail"]:
            console.print(f"  {d['detail']}", markup=False)
        if d["also"]:
            console.print(f"  also differing in this step: {', '.join(d['also'])}", markup=False)
        for line in _pool_lines(d, console.width):
            console.print(line, markup=False, soft_wrap=True)
        if d["history"]:
            what = f"request {d['rid']}" if d["rid"] is not None else d["field"]
            unit = " (allocated / committed / protected, phase)" if d["rid"] is not None else ""
            table = Table(title=f"{what}, last {count(len(d['history']), 'step')}{unit}", title_justify="left", box=None)
            for column in ("step", "op", "A", "B"):
                table.add_column(column)
            for h in d["history"]:
                mark = "[red]>[/red] " if h["step"] == d["step"] else "  "
                table.add_row(f"{mark}{h['step']:,}", _history_op(h), _lens(h["a"]), _lens(h["b"]))
            console.print(table)
    summary = Table(title="\nside by side", title_justify="left", box=None)
    summary.add_column("")
    summary.add_column("A")
    summary.add_column("B")
    for label, read in _SUMMARY_ROWS:
        x, y = _cell(read(report["a"])), _cell(read(report["b"]))
        if x == "-" and y == "-":
            continue
        style = "red" if x != y and label != "wall time" else None
        summary.add_row(label, x, y, style=style)
    console.print(summary)
    if report["identical"]:
        console.print(f"[green]identical[/green] over {count(report['steps_compared'], 'step')}")
    else:
        n = len(report["divergences"])
        console.print(
            f"[red]diverged[/red]: {count(n, 'divergence')} in {count(report['steps_compared'], 'step')} compared"
        )


_POOL_SHOWN = ("available", "evictable", "protected", "committed", "overallocated")


def _fitted(head: str, cells: list[str], width: int, indent: int | None = None) -> list[str]:
    """``head`` then ``cells`` joined by ", " in lines of at most ``width`` columns, each
    line after the first indented by ``indent`` (None: under the first cell). A cell is
    kept whole unless it is wider than a line by itself (then it breaks at its spaces);
    a single word wider than a line is left longer."""
    pad = " " * (len(head) if indent is None else indent)
    if len(pad) > width // 2:  # a long head: continue near the left, not at its end
        pad = " " * 8
    tokens: list[str] = []
    for i, cell in enumerate(cells):
        cell += "," if i < len(cells) - 1 else ""
        tokens += cell.split(" ") if len(pad) + len(cell) > width else [cell]
    lines, line, first = [], head, True
    for token in tokens:
        if first or len(line) + 1 + len(token) <= width:
            line = line + token if first else f"{line} {token}"
        else:
            lines.append(line)
            line = pad + token
        first = False
    return [*lines, line]


def _pool_lines(d: dict[str, Any], width: int = 80) -> list[str]:
    """A hybrid (SWA) model's divergence: which pool diverged, and each pool's counters
    after the step (A / B where they differ), wrapped to ``width`` columns under the first
    counter. None on a full-attention trace."""
    pools = d.get("pools")
    if not pools:
        return []
    diverged = d.get("pool")
    others = [name for name, f in pools.items() if f["differs"] and name != diverged]
    head = f"  pool: {diverged} diverged" if diverged else "  pool: every pool's counters are identical at this step"
    lines = [head + (f" ({', '.join(others)} too, in the same step)" if diverged and others else "")]
    name_width = max(len(name) for name in pools)
    for name, f in pools.items():
        a, b = f["a"], f["b"]
        shown = [k for k in _POOL_SHOWN if k in f["differs"]] + [k for k in f["differs"] if k not in _POOL_SHOWN]
        if shown:
            cells = [f"{k} {a[k]:,} / {b[k]:,}" for k in shown]
            lines += _fitted(f"    {name:<{name_width}}  differs (A / B): ", cells, width)
        else:
            cells = [f"{k} {a[k]:,}" for k in _POOL_SHOWN]
            cells[-1] += f" of {a['pool_tokens']:,}"
            lines += _fitted(f"    {name:<{name_width}}  identical: ", cells, width)
    return lines


# ---------------------------------------------------------------------------- kvtrace diff --range

_SUBJECT_CHARS = 60
_ERROR_CHARS = 40  # of an error in its cell; the whole message follows the table


def _range_cell(result: dict[str, Any]) -> str:
    from rich.markup import escape

    if result["status"] == "identical":
        return "[green]identical[/green]"
    if result["status"] == "error":
        error = result["error"] or ""
        short = error if len(error) <= _ERROR_CHARS else error[: _ERROR_CHARS - 3] + "..."
        return f"[red]error: {escape(short)}[/red]"
    d = result["first_divergence"]
    who = f", request {d['rid']}" if d["rid"] is not None else ""
    return f"[red]step {d['step']:,} ({d['op']}{who}): {escape(str(d['field']))}[/red]"


def _replay_times(results: list[dict[str, Any]]) -> str:
    """Each trace's replay time; "(cached)" once when none ran now, else after each that did not."""
    timed = [r for r in results if r["replay_s"] is not None]
    every = bool(timed) and all(r["cached"] for r in timed)
    times = [
        "-" if r["replay_s"] is None else f"{r['replay_s']:.1f} s" + (" cached" if r["cached"] and not every else "")
        for r in results
    ]
    return ", ".join(times) + (" (cached)" if every else "")


def render_range_report(report: dict[str, Any], console: Console) -> None:
    """Print a ``kvtrace diff --range`` result (``RangeReport.to_dict()``): one line per
    commit (short hash, subject, identical / the first divergence / an error on each
    trace, replay time), then the first diverging commit's divergence on each trace
    where it diverged, as ``render_diff_report`` prints a diff."""
    from rich.markup import escape

    commits = report["commits"]
    touched = [c for c in commits if c["status"] != "skipped"]
    paths = ", ".join(report["paths"])
    how = ["bisect"] if report["bisect"] else []
    how += ["exact"] if report["exact"] else []
    console.print(
        f"[bold]kvtrace diff --range {escape(report['range'])}[/bold]  ({len(commits)} commits on the first-parent path, "
        f"{len(touched)} touching {escape(paths)}; {report['replays']} replayed, {report['cached']} from the cache, "
        f"{report['jobs']} at a time{''.join(', ' + h for h in how)})"
    )
    table = Table(box=None, title_justify="left")
    for column in ("commit", "subject", *report["traces"], "replay"):
        table.add_column(escape(column))
    subject = escape(report["base_subject"][:_SUBJECT_CHARS])
    table.add_row(f"  {report['base'][:10]}", subject, *("[dim]BASE[/dim]" for _ in report["traces"]),
                  _replay_times(report["base_replays"]))
    first = report["first_diverging_commit"]
    for c in commits:
        mark = "[red]>[/red] " if c["commit"] == first else "  "
        cells: list[str]
        if c["status"] == "skipped":
            cells = [f"[dim]skipped (touches no {escape(paths)})[/dim]"] * len(report["traces"])
        elif c["status"] == "untested":
            cells = ["[dim]not replayed (bisect)[/dim]"] * len(report["traces"])
        else:
            cells = [_range_cell(t) for t in c["traces"]]
        table.add_row(f"{mark}{c['short']}", escape(c["subject"][:_SUBJECT_CHARS]), *cells, _replay_times(c["traces"]))
    console.print(table)
    for c in commits:
        if c["status"] == "error":
            by_message: dict[str, list[str]] = {}
            for t in c["traces"]:
                if t["status"] == "error":
                    by_message.setdefault(t["error"] or "", []).append(t["trace"])
            for error, where in by_message.items():
                console.print(f"[red]{c['short']} does not replay[/red] on {escape(', '.join(where))}: {escape(error)}")
    if first is not None:
        c = next(c for c in commits if c["commit"] == first)
        console.print(f"\n[bold red]FIRST DIVERGING COMMIT[/bold red] {c['short']}  {escape(c['subject'])}")
        for diff in report["divergences"]:
            console.print()
            render_diff_report(diff, console)
    tested = [c for c in commits if c["status"] not in ("skipped", "untested")]
    identical = sum(1 for c in tested if c["status"] == "identical")
    errors = sum(1 for c in tested if c["status"] == "error")
    verdict = [f"{identical} of {len(tested)} commits replayed identical to BASE"]
    if errors:
        verdict.append(f"[red]{errors} do{'es' if errors == 1 else ''} not replay[/red]")
    if first is not None:
        verdict.append(f"first diverging: [red]{first[:10]}[/red]")
    else:
        verdict.append("none diverges" + (" (bisect: among those it replayed)" if report["bisect"] else ""))
    console.print(("\n" if first is not None else "") + "; ".join(verdict))
