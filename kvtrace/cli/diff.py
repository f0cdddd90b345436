"""``kvtrace diff`` (two allocator versions on one trace, or two state logs) and
``kvtrace versions`` (what ``--a`` / ``--b`` / ``--allocator`` accept).

The commands parse and render; ``kvtrace.diff`` does the work and returns a
``DiffReport`` (``--json`` prints its ``to_dict()``). Exit codes: 0 identical,
1 diverged, 2 bad input (one line; a version that does not resolve lists the
valid forms).
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

import typer
from rich.console import Console

from kvtrace.cli import app

JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")]


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise typer.BadParameter(f"'{value}' is not one of {', '.join(allowed)}", param_hint=name)


@app.command()
def diff(
    inputs: Annotated[list[str], typer.Argument(help="TRACE (a .kvtrace file or sample:NAME), or LOG_A LOG_B: two state logs (kvtrace replay --out).", show_default=False)],
    a: Annotated[Optional[str], typer.Option("--a", help="Version A (kvtrace versions lists them). Default: builtin.")] = None,
    b: Annotated[Optional[str], typer.Option("--b", help="Version B: builtin, token, paged[:N], pre-encapsulation, NAME, module:factory, file.py:factory, git:REV\\[@PATH], worktree\\[@PATH].")] = None,
    exact: Annotated[bool, typer.Option("--exact", help="Also compare the physical slots (request rows, free-list order) through per-step state digests.")] = False,
    context: Annotated[int, typer.Option("--context", min=0, help="Steps of the diverging request's history shown on both sides.")] = 5,
    all_: Annotated[Optional[int], typer.Option("--all", min=1, help="List up to N divergences (each request once) instead of stopping at the first.")] = None,
    steps: Annotated[Optional[str], typer.Option("--steps", help="Compare steps A:B only (B exclusive; earlier steps replay silently).")] = None,
    page_size: Annotated[Optional[int], typer.Option("--page-size", min=1, help="What-if page size for both sides.")] = None,
    pool_tokens: Annotated[Optional[int], typer.Option("--pool-tokens", min=1, help="What-if pool size for both sides.")] = None,
    device: Annotated[str, typer.Option("--device", help="cpu, or cuda (Triton kernels).")] = "cpu",
    check: Annotated[str, typer.Option("--check", help="Invariant checks on both sides: every (a violation is then an outcome compared step by step, blamed on its request), full, end, never.")] = "end",
    on_oom: Annotated[str, typer.Option("--on-oom", help="stop a side at its first out-of-memory, or skip (drop the request).")] = "stop",
    on_bad_op: Annotated[str, typer.Option("--on-bad-op", help="stop at an impossible op in the trace, or skip it.")] = "stop",
    jobs: Annotated[Optional[int], typer.Option("--jobs", help="2: the sides replay in two processes in parallel; 1: in lockstep in this process. Default: 2 for traces of 2 MB and more when two cores are free.")] = None,
    as_json: JsonOption = False,
    tui: Annotated[bool, typer.Option("--tui", help="Then show both replays side by side in the dashboard, at the first divergence (keys move both sides together).")] = False,
) -> None:
    """Replay TRACE through versions A and B and compare them after every step; or compare
    two saved state logs. Prints "identical over N steps" or the first divergence (step, op,
    request, field, A and B), the request's last steps on both sides and a side-by-side summary.

    Exit code: 0 identical; 1 diverged; 2 bad input.
    """
    from kvtrace.cli.replay import check_device, parse_step_range
    from kvtrace.diff import DiffOptions, diff_logs, diff_trace
    from kvtrace.replay import CHECK_MODES, ReplayOptions
    from kvtrace.report import render_diff_report

    start, stop = parse_step_range(steps)
    options = DiffOptions(exact=exact, context=context, max_divergences=all_ or 1)
    if len(inputs) == 2:
        for name, value in (("--a", a), ("--b", b), ("--page-size", page_size), ("--pool-tokens", pool_tokens)):
            if value is not None:
                raise typer.BadParameter(f"{name} applies to a trace, not to two state logs", param_hint=name)
        report = diff_logs(inputs[0], inputs[1], options=options, steps=(start, stop))
    elif len(inputs) == 1:
        if b is None:
            raise typer.BadParameter("give the version to compare with --b SPEC (and --a SPEC, default builtin)", param_hint="--b")
        _choice("--device", device, ("cpu", "cuda"))
        _choice("--check", check, CHECK_MODES)
        _choice("--on-oom", on_oom, ("stop", "skip"))
        _choice("--on-bad-op", on_bad_op, ("stop", "skip"))
        if jobs is not None and jobs not in (1, 2):
            raise typer.BadParameter(f"{jobs}: use 1 (lockstep in one process) or 2 (two processes)", param_hint="--jobs")
        check_device(device)
        replay = ReplayOptions(check=check, on_oom=on_oom, on_bad_op=on_bad_op, start_step=start, stop_step=stop)  # type: ignore[arg-type]
        report = diff_trace(inputs[0], a or "builtin", b, options=options, replay=replay, page_size=page_size,
                            pool_tokens=pool_tokens, device=device, jobs=jobs)
    else:
        raise typer.BadParameter(f"give one TRACE or two state logs, found {len(inputs)} arguments", param_hint="INPUTS")
    if tui:
        from kvtrace.tui.run import show_diff

        raise typer.Exit(show_diff(report, inputs, a=a or "builtin", b=b, page_size=page_size, pool_tokens=pool_tokens, device=device, options={"check": check, "on_oom": on_oom, "on_bad_op": on_bad_op, "start_step": start, "stop_step": stop}, as_json=as_json))
    result = report.to_dict()
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        render_diff_report(result, Console(highlight=False))
    raise typer.Exit(0 if report.identical else 1)


@app.command()
def versions(as_json: JsonOption = False) -> None:
    """List the allocator versions kvtrace diff and replay accept, with where each comes from."""
    from kvtrace.registry import ENTRY_POINT_GROUP, VALID_FORMS, list_versions

    found = list_versions()
    if as_json:
        sys.stdout.write(json.dumps({
            "versions": [{"name": v.name, "kind": v.kind, "origin": v.origin, "description": v.description} for v in found],
            "forms": VALID_FORMS,
        }) + "\n")
        return
    console = Console(highlight=False, soft_wrap=True)
    width = max(len(v.name) for v in found)
    titles = {
        "builtin": "{origin}",
        "installed": f"installed (entry-point group {ENTRY_POINT_GROUP})",
        "git": "git, from {origin} (each runs in its own process)",
        "factory": "factories",
    }
    for kind, title in titles.items():
        rows = [v for v in found if v.kind == kind]
        console.print(title.format(origin=rows[0].origin if rows else "") + ":", markup=False)
        if not rows:
            console.print("  (none)", markup=False)
        for v in rows:
            where = f"  [{v.origin}]" if kind in ("installed", "factory") else ""
            console.print(f"  {v.name:<{width}}  {v.description}{where}", markup=False)
