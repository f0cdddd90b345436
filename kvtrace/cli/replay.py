"""``kvtrace replay``: run a trace through an allocator with every invariant checked.

The replay pipeline (``kvtrace.replay.session``, the allocator, torch) is imported inside
the command, when it runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from kvtrace.cli import command, ui
from kvtrace.cli.record_hicache import HiCacheRatioOpt, HiCacheWritePolicyOpt
from kvtrace.cli.options import (
    CheckMode,
    Device,
    DeviceOpt,
    ForceOpt,
    IgnoreMemoryCheckOpt,
    JsonOpt,
    NoColorOpt,
    OnBadOp,
    OnOom,
    QuietOpt,
    TraceArg,
    WhatIfPageSizeOpt,
    WhatIfPoolTokensOpt,
    EvictionPolicyOpt,
    examples,
    finite,
)
from kvtrace.errors import ConfigError
from kvtrace.tui.run import DEFAULT_PORT  # (imports no Textual)


def parse_step_range(text: str | None) -> tuple[int | None, int | None]:
    """``A:B`` -> (A, B) with either side optional; B is exclusive.

    Raises:
        typer.BadParameter: not of the form A:B with non-negative integers and A < B.
    """
    if text is None:
        return None, None
    if ":" not in text:
        raise typer.BadParameter(f"'{text}' is not a step range; use A:B, A: or :B (B exclusive)", param_hint="--steps")
    lo, hi = text.split(":", 1)
    try:
        start = int(lo) if lo.strip() else None
        stop = int(hi) if hi.strip() else None
    except ValueError:
        raise typer.BadParameter(f"'{text}': both ends must be integers", param_hint="--steps") from None
    if (start is not None and start < 0) or (stop is not None and stop < 0):
        raise typer.BadParameter(f"'{text}': steps are non-negative", param_hint="--steps")
    if start is not None and stop is not None and start >= stop:
        raise typer.BadParameter(f"'{text}': the range is empty (A must be below B)", param_hint="--steps")
    return start, stop


def check_dashboard_options(tui: bool, serve: int | None, as_json: bool, host: str) -> None:
    """Raises typer.BadParameter for dashboard options that do not go together."""
    if serve is not None and not tui:
        raise typer.BadParameter("serving is for the dashboard; add --tui", param_hint="--serve")
    if tui and as_json:
        raise typer.BadParameter("the dashboard prints no JSON; drop --json or --tui", param_hint="--json")
    if host != "127.0.0.1" and serve is None:
        raise typer.BadParameter("--host is where --serve listens; add --tui --serve", param_hint="--host")


def _dashboard(trace: str, allocator: str, page_size: int | None, pool_tokens: int | None, device: str,
               options: Any, target: Any, *, explain: bool = False, eviction_policy: str | None = None,
               tier: dict[str, Any] | None = None) -> None:
    """The replay in the live dashboard, in a process of its own (with --out, the steps it
    replays go to the log; with --explain, its misses are attributed: the ``e`` key;
    ``eviction_policy``: the what-if, None for the trace's; ``tier``: the host tier's
    what-ifs, ``hicache_ratio`` / ``hicache_write_policy``)."""
    import dataclasses

    from kvtrace.versions.registry import resolve_version
    from kvtrace.tui.remote.replayer import dashboard_job
    from kvtrace.tui.run import run_live
    from traces.samples import resolve_trace

    version = resolve_version(allocator)  # a bad spec: one line here, before any process starts
    job = dashboard_job(version, str(resolve_trace(trace)), trace_label=str(trace), page_size=page_size,
                        pool_tokens=pool_tokens, device=device, options=dataclasses.asdict(options), play=True,
                        explain=explain, eviction_policy=eviction_policy, **(tier or {}))
    ui.require_terminal("run it in a terminal, add --serve to show it as a web page, or drop --tui")
    if target is None:
        run_live(job)
        return
    with target.writing() as tmp:
        run_live(dataclasses.replace(job, log=str(tmp)))


def warn_truncated(trace: str) -> None:
    """Warn that ``trace`` was cut short and its complete steps were replayed: the one
    wording of ``replay`` and ``diff`` (the dashboard shows the same note)."""
    from kvtrace.replay.session import TRUNCATED_NOTE

    ui.warn(f"{trace}: {TRUNCATED_NOTE}")


def check_device(device: str) -> None:
    """Raises ConfigError when cuda is asked for and no GPU, or no Triton, is there."""
    if device == "cuda":
        import importlib.util

        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: torch sees no CUDA GPU on this machine; use --device cpu")
        if importlib.util.find_spec("triton") is None:
            raise ConfigError(
                "--device cuda needs Triton, which is installed on Linux (x86_64, aarch64) only; use --device cpu"
            )


REPLAY_EXAMPLES = examples(
    "# replay a bundled sample with its recorded configuration",
    "kvtrace replay sample:mooncake-tiny",
    "# check every invariant after each allocator call, stop at the first violation",
    "kvtrace replay run.kvtrace --check every -x",
    "# what-if: the recorded schedule on a smaller pool with 16-token pages",
    "kvtrace replay run.kvtrace --pool-tokens 100000 --page-size 16",
    "# steps 1000 to 1100 only, with a state log for kvtrace info or polars",
    "kvtrace replay run.kvtrace --steps 1000:1100 --out window.arrow",
    "# the KV events SGLang would publish for this replay, to a file or on a ZMQ PUB socket",
    "kvtrace replay sample:mooncake-tiny --kv-events events.kvev",
    "kvtrace replay sample:mooncake-tiny --kv-events tcp://*:5557 --kv-events-replay tcp://*:5558 --kv-events-paced",
)


@command("replay", epilog=REPLAY_EXAMPLES)
def replay(
    trace: TraceArg,
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
            help="Invariant checks: every (after each allocator call, what it touched), full (the whole state "
            "after each call), end, never.",
        ),
    ] = CheckMode.end,
    max_violations: Annotated[Optional[int], typer.Option("--max-violations", min=1, help="Stop after this many invariant violations.", show_default="no limit")] = None,
    first_violation: Annotated[bool, typer.Option("-x", "--exitfirst", help="Stop at the first invariant violation (--max-violations 1).")] = False,
    session_hold_bound: Annotated[Optional[int], typer.Option("--session-hold-bound", min=0, metavar="TOKENS", help="Streaming sessions: flag each turn whose session keeps more than TOKENS of KV between turns.", show_default="no bound")] = None,
    on_oom: Annotated[OnOom, typer.Option("--on-oom", help="At an out-of-memory: stop, or skip (drop the request).")] = OnOom.stop,
    on_bad_op: Annotated[OnBadOp, typer.Option("--on-bad-op", help="At an impossible op in the trace: stop, or skip it.")] = OnBadOp.stop,
    steps: Annotated[Optional[str], typer.Option("--steps", help="Replay window A:B (B exclusive); earlier steps run silently, the summary covers the window.", show_default="every step")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write the step-by-step state log (an Arrow IPC file) here.", show_default=False)] = None,
    force: ForceOpt = False,
    ignore_memory_check: IgnoreMemoryCheckOpt = False,
    digests: Annotated[bool, typer.Option("--digests", help="Put the allocator's state digest in every row of the state log (--out), for 'kvtrace diff LOG_A LOG_B --exact'.")] = False,
    allocator: Annotated[str, typer.Option("--allocator", help="Allocator version: builtin, token, paged[:N], module:factory, file.py:factory (those two execute the code they name; nothing in a trace is ever executed).")] = "builtin",
    tui: Annotated[bool, typer.Option("--tui", help="Show the live dashboard (keys: ? in it).")] = False,
    serve: Annotated[Optional[int], typer.Option("--serve", min=1, max=65535, help=f"With --tui: serve the dashboard as a web page on PORT (default {DEFAULT_PORT}).", metavar="[PORT]", show_default=False)] = None,
    host: Annotated[str, typer.Option("--host", help="With --serve: the address to listen on (a trace can reveal a service's traffic: keep the loopback default unless you mean it).")] = "127.0.0.1",
    kv_events: Annotated[Optional[str], typer.Option("--kv-events", metavar="FILE|tcp://HOST:PORT", help="Write the KV events SGLang 0.5.23 would publish for this replay (BlockStored / BlockRemoved / AllBlocksCleared, its wire format) to FILE, or publish them on a ZMQ PUB socket bound there.", show_default=False)] = None,
    kv_events_paced: Annotated[bool, typer.Option("--kv-events-paced", help="With --kv-events: publish each step's batch at its time in the trace (else as fast as the replay goes).")] = False,
    kv_events_replay: Annotated[Optional[str], typer.Option("--kv-events-replay", metavar="tcp://HOST:PORT", help="With --kv-events tcp://...: answer replay requests for missed batches here (SGLang's replay endpoint).", show_default=False)] = None,
    kv_events_wait: Annotated[float, typer.Option("--kv-events-wait", min=0.0, metavar="SECONDS", help="With --kv-events tcp://...: wait this long for a first subscriber before publishing, and after the last batch answer replay requests until the subscribers leave, at most this long.", callback=finite)] = 0.0,
    explain: Annotated[bool, typer.Option("--explain", help="Also explain the prefix misses (kvtrace explain): printed after the summary, under \"explain\" in --json; with --out, each step's missed tokens by cause in explain_* columns; with --tui, the e key shows the selected request's.")] = False,
    quiet: QuietOpt = False,
    no_color: NoColorOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Replay TRACE through the allocator with its invariants checked; print a summary.

    What-if options (--page-size, --pool-tokens) replay the recorded schedule: the same
    requests in the same steps, so a pool smaller than the recording's runs out of
    memory early instead of scheduling fewer requests at a time (kvtrace record TRACE
    --pool-tokens N schedules the same requests anew).

    Exit code: 0 clean; 1 violations, out of memory (with --on-oom stop) or skipped
    bad ops; 2 bad input.
    """
    from kvtrace.outputs import OutputFile
    from kvtrace.replay.engine import ReplayOptions
    from kvtrace.replay.report import render_replay_summary
    from kvtrace.replay.session import ReplaySession
    from kvtrace.statelog.log import replay_log_writer
    from traces.samples import resolve_trace

    start, stop = parse_step_range(steps)
    check_dashboard_options(tui, serve, as_json, host)
    if digests and out is None:
        raise typer.BadParameter("state digests go into the state log: add --out LOG", param_hint="--digests")
    check_device(device.value)
    policy = eviction_policy.value if eviction_policy is not None else None
    tier = {"hicache_ratio": hicache_ratio,
            "hicache_write_policy": None if hicache_write_policy is None else hicache_write_policy.value}
    target = None if out is None else OutputFile(out, force=force, inputs=[resolve_trace(trace)])
    if kv_events is not None and start is not None:
        raise typer.BadParameter("KV events start at the trace's first step (a window's start would fold the "
                                 "steps before it into one batch); use --steps :B or drop --kv-events",
                                 param_hint="--steps")
    events_out = _kv_events_target(kv_events, kv_events_replay, kv_events_wait, tui, force, trace)
    options = ReplayOptions(
        state_digest=digests,
        check=check.value,  # type: ignore[arg-type]
        on_oom=on_oom.value,  # type: ignore[arg-type]
        on_bad_op=on_bad_op.value,  # type: ignore[arg-type]
        start_step=start,
        stop_step=stop,
        max_violations=1 if first_violation else max_violations,
        session_hold_bound=session_hold_bound,
    )
    if serve is not None:
        import sys

        from kvtrace.tui.run import serve as serve_dashboard

        # Checked here once (bad trace, version, configuration: one line, exit 2) before serving.
        ReplaySession(trace, version=allocator, page_size=page_size, pool_tokens=pool_tokens, device=device.value,
                      options=options, checker="inline", force_memory=ignore_memory_check,
                      eviction_policy=policy, **tier).close()
        serve_dashboard(sys.argv[1:], host=host, port=serve)
        return
    if tui:
        ui.no_color_for_textual()
        _dashboard(trace, allocator, page_size, pool_tokens, device.value, options, target, explain=explain,
                   eviction_policy=policy, tier=tier)
        return
    with ReplaySession(
        trace, version=allocator, page_size=page_size, pool_tokens=pool_tokens, device=device.value, options=options,
        force_memory=ignore_memory_check, eviction_policy=policy, **tier,
    ) as session, _kv_events_sink(session, events_out, kv_events, kv_events_replay, kv_events_wait,
                                  kv_events_paced) as emitter:
        explainer = _explainer(session) if explain else None
        if target is None:
            _run(session, None, emitter)
        else:
            with target.writing() as tmp:
                step_columns: tuple[str, ...] = ()
                if explainer is not None:
                    from kvtrace.explain.attribution import STEP_COLUMNS as step_columns
                with replay_log_writer(tmp, session, str(trace), step_columns=step_columns) as log:
                    _run(session, log, emitter, None if explainer is None else explainer.attribution.step_causes)
        result = session.result()
    summary = result.to_dict()
    if explainer is not None:
        with ui.progress("oracles"):
            summary["explain"] = explainer.report().to_dict()
    if emitter is not None:
        summary["kv_events"] = {"target": kv_events, **emitter.summary()}
        if not as_json:
            ev = summary["kv_events"]
            where = "published on" if events_out is None else "written to"
            ui.note(f"KV events: {ev['batches']:,} batches ({ev['blocks_stored']:,} blocks stored, "
                    f"{ev['blocks_removed']:,} removed) {where} {kv_events}")
    if out is not None:
        summary["state_log"] = str(out)
    if (start is not None or stop is not None) and result.stats.steps == 0 and not result.stopped_early:
        ui.warn(f"--steps {steps}: no step of {trace} falls in that window")
    if summary["truncated"]:
        warn_truncated(trace)
    if as_json:
        ui.emit_json(summary)
    else:
        render_replay_summary(summary, ui.console(), title=f"kvtrace replay {trace}", rerun=_rerun_options(
            page_size=page_size, pool_tokens=pool_tokens, allocator=allocator, on_oom=on_oom, on_bad_op=on_bad_op))
        if explainer is not None:
            from kvtrace.explain.report import print_report

            print_report(summary["explain"], ui.console(), "\nexplain")
    raise typer.Exit(1 if result.failed else 0)


def _explainer(session: Any) -> Any:
    """``--explain``: a ``kvtrace.explain.Explainer`` attached to the session before its first step."""
    from kvtrace.explain.report import Explainer

    return Explainer(session)


def _rerun_options(*, page_size: int | None, pool_tokens: int | None, allocator: str, on_oom: OnOom,
                   on_bad_op: OnBadOp) -> tuple[str, ...]:
    """The options given that change what a replay does, to repeat in a suggested command line."""
    given: list[str] = []
    if pool_tokens is not None:
        given += ["--pool-tokens", str(pool_tokens)]
    if page_size is not None:
        given += ["--page-size", str(page_size)]
    if allocator != "builtin":
        given += ["--allocator", allocator]
    if on_oom is not OnOom.stop:
        given += ["--on-oom", on_oom.value]
    if on_bad_op is not OnBadOp.stop:
        given += ["--on-bad-op", on_bad_op.value]
    return tuple(given)


def _kv_events_target(kv_events: str | None, replay_endpoint: str | None, wait_s: float, tui: bool, force: bool,
                      trace: str) -> Any:
    """The checked ``--kv-events`` file (an ``OutputFile``), or None for an endpoint or none.

    Raises:
        typer.BadParameter: options that need --kv-events, or an endpoint, without it.
        OutputError: the file is refused (exists without --force, ...).
    """
    from kvtrace.events.wire import is_endpoint

    if kv_events is None:
        if replay_endpoint is not None or wait_s:
            raise typer.BadParameter("this publishes KV events; add --kv-events tcp://HOST:PORT",
                                     param_hint="--kv-events-replay / --kv-events-wait")
        return None
    if tui:
        raise typer.BadParameter("the dashboard does not publish KV events; drop --tui or --kv-events",
                                 param_hint="--kv-events")
    if is_endpoint(kv_events):
        if not kv_events.startswith("tcp://"):
            raise typer.BadParameter(f"'{kv_events}': publish on a tcp://HOST:PORT endpoint", param_hint="--kv-events")
        return None
    if replay_endpoint is not None or wait_s:
        raise typer.BadParameter("a replay endpoint and a wait are for a socket; --kv-events names a file",
                                 param_hint="--kv-events-replay / --kv-events-wait")
    from kvtrace.outputs import OutputFile
    from traces.samples import resolve_trace

    return OutputFile(kv_events, option="--kv-events", force=force, inputs=[resolve_trace(trace)])


@contextmanager
def _kv_events_sink(session: Any, target: Any, kv_events: str | None, replay_endpoint: str | None, wait_s: float,
                    paced: bool) -> Iterator[Any]:
    """The replay's ``kvtrace.events.emit.BackgroundEmitter`` writing to the file or socket
    (None without --kv-events); the file is renamed into place when the block completes."""
    if kv_events is None:
        yield None
        return
    from kvtrace.events.emit import BackgroundEmitter
    from kvtrace.events.wire import FileTarget, ZmqTarget

    with contextlib.ExitStack() as stack:
        if target is None:
            where: Any = ZmqTarget(kv_events, replay_endpoint, wait_s)
        else:
            where = FileTarget(str(stack.enter_context(target.writing())))
        emitter = BackgroundEmitter(session, where, paced=paced)
        try:
            yield emitter
        except BaseException:
            emitter.abort()
            raise
        emitter.close()


def _run(session: Any, log: Any, emitter: Any = None, step_values: Any = None) -> None:
    """Replay every step, writing each snapshot to the state log (if any; with
    ``step_values()``'s values, the log's ``step_columns``) and its KV events (if asked
    for), with progress."""
    with ui.progress("replay", total=1.0) as line:
        for snap in session.snapshots():
            if log is not None:
                if step_values is None:
                    log.write(snap)
                else:
                    log.write(snap, step_values())
            if emitter is not None:
                emitter.after(snap)
            if line.due():
                line.show(session.progress, f"step {snap.step:,}  t={snap.time_s:,.0f}s")
