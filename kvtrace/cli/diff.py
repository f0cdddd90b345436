"""``kvtrace diff`` (two allocator versions on one trace, or two state logs) and
``kvtrace versions`` (what ``--a`` / ``--b`` / ``--allocator`` accept).

The commands parse and render; ``kvtrace.diff.diff`` does the work and returns a
``DiffReport`` (``--json`` prints its ``to_dict()``). Exit codes: 0 identical,
1 diverged, 2 bad input (one line; a version that does not resolve lists the
valid forms). Rich, numpy, pyarrow and torch are imported inside the commands.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvtrace.cli import command, ui
from kvtrace.cli.options import (
    CheckMode,
    Device,
    DeviceOpt,
    ForceOpt,
    JsonOpt,
    NoColorOpt,
    OnBadOp,
    OnOom,
    QuietOpt,
    WhatIfPageSizeOpt,
    WhatIfPoolTokensOpt,
    EvictionPolicyOpt,
    examples,
)
from kvtrace.cli.record_hicache import HiCacheRatioOpt, HiCacheWritePolicyOpt

if TYPE_CHECKING:
    from kvtrace.diff.diff import DiffReport
    from kvtrace.diff.kvevents import KvEventsReport
    from kvtrace.replay.engine import ReplayOptions
    from kvtrace.diff.rangediff import RangeSettings

DIFF_EXAMPLES = examples(
    "# a refactor in the working tree against the last commit",
    "kvtrace diff sample:mooncake-eagle --a git:HEAD --b worktree",
    "# the bug class SGLang's encapsulation removed, found at its step and request",
    "kvtrace diff sample:mooncake-eagle --b pre-encapsulation",
    "# physical slots too, up to 10 divergences, as JSON",
    "kvtrace diff run.kvtrace --a git:main --b git:my-branch --exact --all 10 --json",
    "# two state logs written by kvtrace replay --out LOG --digests",
    "kvtrace diff a.arrow b.arrow --exact",
    "# every commit of a refactor series that touches allocator/, compared with main, on two traces",
    "kvtrace diff sample:mooncake-eagle sample:azure-code --range main..HEAD",
    "# only the first commit that changed the allocator's behaviour, in about log2(N) replays",
    "kvtrace diff sample:mooncake-eagle --range v0.4..HEAD --bisect",
)


@command("diff", epilog=DIFF_EXAMPLES)
def diff(
    inputs: Annotated[
        list[str],
        typer.Argument(
            metavar="TRACE... | LOG_A LOG_B",
            help="A trace (a .kvtrace file or sample:NAME), or two state logs (kvtrace replay --out); "
            "with --range, one or more traces.",
            show_default=False,
        ),
    ],
    a: Annotated[
        str | None,
        typer.Option(
            "--a",
            help="Version A (kvtrace versions lists them). module:factory, file.py:factory, git:REV and worktree "
            "execute that code (as 'python file.py' would); nothing in a trace is ever executed.",
            show_default="builtin",
        ),
    ] = None,
    b: Annotated[
        str | None,
        typer.Option(
            "--b",
            help="Version B: builtin, token, paged[:N], pre-encapsulation, NAME, module:factory, file.py:factory, "
            "git:REV\\[@PATH], worktree\\[@PATH]. All but the built-in names execute the code they name.",
            show_default=False,
        ),
    ] = None,
    exact: Annotated[
        bool,
        typer.Option("--exact", help="Also compare the physical slots (request rows, free-list order) through per-step state digests."),
    ] = False,
    context: Annotated[int, typer.Option("--context", min=0, help="Steps of the diverging request's history shown on both sides.")] = 5,
    all_: Annotated[
        int | None,
        typer.Option("--all", min=1, help="List up to N divergences (each request once) instead of stopping at the first.", show_default=False),
    ] = None,
    steps: Annotated[
        str | None,
        typer.Option("--steps", help="Compare steps A:B only (B exclusive; earlier steps replay silently).", show_default="every step"),
    ] = None,
    page_size: WhatIfPageSizeOpt = None,
    pool_tokens: WhatIfPoolTokensOpt = None,
    eviction_policy: EvictionPolicyOpt = None,
    hicache_ratio: HiCacheRatioOpt = None,
    hicache_write_policy: HiCacheWritePolicyOpt = None,
    device: DeviceOpt = Device.cpu,
    check: Annotated[
        CheckMode,
        typer.Option(
            "--check",
            help="Invariant checks on both sides: every (a violation is then an outcome compared step by step, "
            "blamed on its request), full, end, never.",
        ),
    ] = CheckMode.end,
    on_oom: Annotated[OnOom, typer.Option("--on-oom", help="At an out-of-memory: stop a side, or skip (drop the request).")] = OnOom.stop,
    on_bad_op: Annotated[OnBadOp, typer.Option("--on-bad-op", help="At an impossible op in the trace: stop, or skip it.")] = OnBadOp.stop,
    rev_range: Annotated[
        str | None,
        typer.Option(
            "--range",
            metavar="BASE..HEAD",
            help="Replay every commit on the first-parent path from BASE to HEAD that touches --path, on each "
            "TRACE, and compare it with BASE: a table, then the first diverging commit's divergence. Results "
            "are cached (allocator tree, trace, options) under $KVTRACE_CACHE_DIR or ~/.cache/kvtrace.",
            show_default=False,
        ),
    ] = None,
    paths: Annotated[
        list[str] | None,
        typer.Option(
            "--path",
            metavar="PATH",
            help="With --range: a commit is replayed when its first-parent diff touches this path (relative to "
            "the repository's top; repeatable); the others are listed as skipped.",
            show_default="allocator",
        ),
    ] = None,
    repo: Annotated[
        str | None,
        typer.Option(
            "--repo", metavar="DIR", help="With --range: the git repository.", show_default="the one holding the current directory"
        ),
    ] = None,
    bisect: Annotated[
        bool,
        typer.Option(
            "--bisect",
            help="With --range: find the first commit that differs from BASE in at most ceil(log2(N+1)) replays of "
            "the N commits (plus BASE's) instead of N. It assumes that once a commit differs, every later one "
            "does (a series that diverges and then comes back can mislead it; the full table cannot be misled).",
        ),
    ] = False,
    jobs: Annotated[
        int | None,
        typer.Option(
            "--jobs",
            min=1,
            help="2: the sides replay in two processes in parallel; 1: in lockstep in this process. With --range: "
            "how many replays run at once (default: every usable core).",
            show_default="2 for traces of 2 MB and more when two cores are free",
        ),
    ] = None,
    quiet: QuietOpt = False,
    no_color: NoColorOpt = False,
    as_json: JsonOpt = False,
    tui: Annotated[bool, typer.Option("--tui", help="Then show both replays side by side in the dashboard, at the first divergence (keys move both sides together).")] = False,
    export: Annotated[Path | None, typer.Option("--export", help="Also write both sides as one timeline (.pftrace: Perfetto; .json: Chrome), two processes on one clock, the first divergence marked on both (written as the diff replays them).", show_default=False)] = None,
    force: ForceOpt = False,
    kv_events: Annotated[
        bool,
        typer.Option(
            "--kv-events",
            help="Also compare the KV events the two versions publish (SGLang's BlockStored / BlockRemoved / "
            "AllBlocksCleared; the sglang version's come from SGLang's own recorder), step by step: order, "
            "hashes and fields. Versions that run in this process only (not git:REV or worktree).",
        ),
    ] = False,
) -> None:
    """Replay TRACE through versions A and B and compare them after every step; or compare
    two saved state logs. Prints "identical over N steps" or the first divergence (step, op,
    request, field, A and B), the request's last steps on both sides and a side-by-side summary.

    With --range BASE..HEAD: every commit of a series against BASE, on every TRACE; one line
    per commit (identical, the first divergence, an error, or skipped), then the first
    diverging commit's divergence as above.

    Exit code: 0 identical (every commit); 1 diverged (some commit diverged or does not
    replay); 2 bad input.
    """
    from kvtrace.cli.replay import check_device, parse_step_range
    from kvtrace.diff.diff import DiffOptions, diff_logs, diff_trace
    from kvtrace.replay.engine import ReplayOptions
    from kvtrace.replay.report import render_diff_report

    start, stop = parse_step_range(steps)
    options = DiffOptions(exact=exact, context=context, max_divergences=all_ or 1)
    replay = ReplayOptions(
        check=check.value, on_oom=on_oom.value, on_bad_op=on_bad_op.value, start_step=start, stop_step=stop  # type: ignore[arg-type]
    )
    if kv_events and (rev_range is not None or len(inputs) != 1):
        raise typer.BadParameter("KV events are compared on one trace replayed by two versions (not with --range "
                                 "or two state logs)", param_hint="--kv-events")
    if kv_events and tui:
        raise typer.BadParameter("the dashboard does not show KV events; drop --tui or --kv-events",
                                 param_hint="--kv-events")
    if kv_events and start is not None:
        raise typer.BadParameter("KV events start at the trace's first step (a window's start would fold the steps "
                                 "before it into one batch); use --steps :B or drop --kv-events", param_hint="--steps")
    tier = {"hicache_ratio": hicache_ratio,
            "hicache_write_policy": None if hicache_write_policy is None else hicache_write_policy.value}
    if hicache_ratio is not None or hicache_write_policy is not None:
        hint = "--hicache-ratio" if hicache_ratio is not None else "--hicache-write-policy"
        for name, value in (("--range", rev_range), ("--tui", tui or None), ("--kv-events", kv_events or None)):
            if value is not None:
                raise typer.BadParameter(f"the host tier what-ifs apply to one trace replayed by two versions; "
                                         f"drop {hint} or {name}", param_hint=hint)
    if rev_range is not None:
        for name, value in (("--a", a), ("--b", b), ("--export", export)):
            if value is not None:
                raise typer.BadParameter(f"--range compares every commit with BASE; drop {name}", param_hint=name)
        check_device(device.value)
        from kvtrace.diff.rangediff import RangeSettings

        settings = RangeSettings(options, replay, page_size, pool_tokens, device.value)
        raise typer.Exit(
            _diff_range(inputs, rev_range, settings, paths=paths, repo=repo, bisect=bisect, jobs=jobs, as_json=as_json)
        )
    target = None
    if export is not None:
        from kvtrace.outputs import OutputFile
        from traces.samples import resolve_trace

        target = OutputFile(export, option="--export", force=force, inputs=[resolve_trace(i) for i in inputs])
    for name, value in (("--path", paths), ("--repo", repo), ("--bisect", bisect or None)):
        if value is not None:
            raise typer.BadParameter(f"{name} goes with --range BASE..HEAD", param_hint=name)
    if len(inputs) == 2:
        for name, value in (("--a", a), ("--b", b), ("--page-size", page_size), ("--pool-tokens", pool_tokens),
                            ("--eviction-policy", eviction_policy), ("--hicache-ratio", hicache_ratio),
                            ("--hicache-write-policy", hicache_write_policy)):
            if value is not None:
                raise typer.BadParameter(f"{name} applies to a trace, not to two state logs", param_hint=name)
        with ui.progress(f"diff {Path(inputs[0]).name} {Path(inputs[1]).name}") as update:
            report = diff_logs(inputs[0], inputs[1], options=options, steps=(start, stop),
                               on_progress=lambda step: update(step, f"step {step:,}"))
    elif len(inputs) == 1:
        if b is None:
            raise typer.BadParameter("give the version to compare with --b SPEC (and --a SPEC, default builtin)", param_hint="--b")
        if jobs is not None and jobs not in (1, 2):
            raise typer.BadParameter(f"{jobs}: use 1 (lockstep in one process) or 2 (two processes)", param_hint="--jobs")
        check_device(device.value)
        if kv_events:
            events_report = _diff_kv_events(inputs[0], a or "builtin", b, replay, page_size, pool_tokens, device.value)
        from contextlib import nullcontext

        from kvtrace.cli.export import export_diff_tee

        with (nullcontext() if target is None else export_diff_tee(target, inputs[0])) as tee, \
                ui.progress(f"diff {Path(inputs[0]).name}") as update:
            report = diff_trace(inputs[0], a or "builtin", b, options=options, replay=replay, page_size=page_size,
                                pool_tokens=pool_tokens, device=device.value, jobs=jobs,
                                eviction_policy=eviction_policy.value if eviction_policy is not None else None,
                                **tier, on_progress=lambda step: update(step, f"step {step:,}"),
                                on_chunk=None if tee is None else tee.chunk)
            if tee is not None:
                tee.finish(report.to_dict())
    else:
        raise typer.BadParameter(f"give one TRACE or two state logs, found {len(inputs)} arguments", param_hint="INPUTS")
    _warn_inputs(report, inputs)
    if target is not None and len(inputs) == 2:
        from kvtrace.cli.export import export_diff

        export_diff(report.to_dict(), inputs, target, a=a or "builtin", b=b or "", page_size=page_size,
                    pool_tokens=pool_tokens, device=device.value, options=replay)
    if tui:
        from kvtrace.tui.run import show_diff

        raise typer.Exit(show_diff(report, inputs, a=a or "builtin", b=b, page_size=page_size, pool_tokens=pool_tokens, device=device.value, options={"check": check.value, "on_oom": on_oom.value, "on_bad_op": on_bad_op.value, "start_step": start, "stop_step": stop}, as_json=as_json,
                                  eviction_policy=eviction_policy.value if eviction_policy is not None else None))
    result = report.to_dict()
    if export is not None:
        result["export"] = str(export)
    if kv_events:
        result["kv_events"] = events_report.to_dict()
    if as_json:
        ui.emit_json(result)
    else:
        render_diff_report(result, ui.console())
        if kv_events:
            ui.console().print(events_report.line(), markup=False)
    raise typer.Exit(0 if report.identical and (not kv_events or events_report.identical) else 1)


def _diff_kv_events(trace: str, a: str, b: str, replay: ReplayOptions, page_size: int | None, pool_tokens: int | None,
                    device: str) -> KvEventsReport:
    """``--kv-events``: both versions' KV event streams compared (``kvtrace.diff.kvevents``)."""
    from kvtrace.diff.kvevents import diff_kv_events

    with ui.progress(f"KV events {Path(trace).name}"):
        return diff_kv_events(trace, a, b, replay=replay, page_size=page_size, pool_tokens=pool_tokens, device=device)


def _warn_inputs(report: DiffReport, inputs: list[str]) -> None:
    """Warn on stderr about inputs the diff could not use whole (a trace or a state log cut
    short: the same warnings as ``replay`` and ``info``), then the report's own warnings."""
    from kvtrace.cli.info import warn_cut_short
    from kvtrace.cli.replay import warn_truncated

    sides = (report.a.summary, report.b.summary)
    if report.mode == "logs":
        for summary in sides:
            if summary.get("truncated"):
                warn_cut_short(summary.get("state_log"), summary.get("truncation_detail"))
    elif any(summary.get("truncated") for summary in sides):
        warn_truncated(inputs[0])
    for warning in report.warnings:
        ui.warn(warning)


def _diff_range(
    inputs: list[str], rev_range: str, settings: RangeSettings, *, paths: list[str] | None, repo: str | None,
    bisect: bool, jobs: int | None, as_json: bool,
) -> int:
    """``kvtrace diff TRACE... --range BASE..HEAD``: run and render. Returns the exit code
    (0 every commit replayed is identical to BASE, 1 otherwise)."""
    from kvtrace.diff.rangediff import diff_range
    from kvtrace.replay.report import render_range_report

    report = diff_range(
        inputs, rev_range, paths=paths or ("allocator",), repo=repo, bisect=bisect, jobs=jobs, on_replay=ui.note,
        settings=settings,
    )
    if as_json:
        ui.emit_json(report.to_dict())
    else:
        render_range_report(report.to_dict(), ui.console())
    return 0 if report.preserved else 1


VERSIONS_EXAMPLES = examples(
    "# every form kvtrace diff --a / --b and kvtrace replay --allocator accept, with where each comes from",
    "kvtrace versions",
    "# their names, for a script",
    "kvtrace versions --json | jq '.versions[].name'",
)


@command("versions", epilog=VERSIONS_EXAMPLES)
def versions(
    quiet: QuietOpt = False,
    no_color: NoColorOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """List the allocator versions kvtrace diff and replay accept, with where each comes from."""
    from kvtrace.versions.registry import ENTRY_POINT_GROUP, VALID_FORMS, list_versions

    found = list_versions()
    if as_json:
        ui.emit_json({
            "versions": [{"name": v.name, "kind": v.kind, "origin": v.origin, "description": v.description} for v in found],
            "forms": VALID_FORMS,
        })
        return
    console = ui.console()
    width = max(len(v.name) for v in found)
    titles = {
        "builtin": "{origin}",
        "installed": f"installed (entry-point group {ENTRY_POINT_GROUP})",
        "git": "git, from {origin} (each runs in its own process)",
        "sglang": "SGLang (driven in its own process)",
        "factory": "factories",
    }
    for kind, title in titles.items():
        rows = [v for v in found if v.kind == kind]
        console.print(title.format(origin=rows[0].origin if rows else "") + ":", markup=False)
        if not rows:
            console.print("  (none)", markup=False)
        for v in rows:
            where = f"  [{v.origin}]" if kind in ("installed", "factory", "sglang") else ""
            console.print(f"  {v.name:<{width}}  {v.description}{where}", markup=False)
