"""``kvtrace replay``: run a trace through an allocator with every invariant checked."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from kvtrace.cli import app
from kvtrace.errors import ConfigError
from kvtrace.replay import CHECK_MODES, ReplayOptions
from kvtrace.report import render_replay_summary
from kvtrace.statelog import StateLogWriter
from kvtrace.tui.run import DASHBOARD_CHECKPOINT_EVERY, DEFAULT_PORT  # (imports no Textual)


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


def check_device(device: str) -> None:
    """Raises ConfigError when cuda is asked for and no GPU is visible."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: torch sees no CUDA GPU on this machine; use --device cpu")


@app.command()
def replay(
    trace: Annotated[str, typer.Argument(help="Trace file (.kvtrace) or sample:NAME.")],
    page_size: Annotated[Optional[int], typer.Option("--page-size", min=1, help="What-if: replay with this page size.")] = None,
    pool_tokens: Annotated[Optional[int], typer.Option("--pool-tokens", min=1, help="What-if: replay with this many KV slots.")] = None,
    device: Annotated[str, typer.Option("--device", help="cpu, or cuda (Triton kernels).")] = "cpu",
    check: Annotated[str, typer.Option("--check", help="Invariant checks: every (after each allocator call, what it touched), full (the whole state after each call), end, never.")] = "end",
    max_violations: Annotated[Optional[int], typer.Option("--max-violations", min=1, help="Stop after this many invariant violations.")] = None,
    first_violation: Annotated[bool, typer.Option("-x", "--exitfirst", help="Stop at the first invariant violation (--max-violations 1).")] = False,
    on_oom: Annotated[str, typer.Option("--on-oom", help="stop at the first out-of-memory, or skip (drop the request).")] = "stop",
    on_bad_op: Annotated[str, typer.Option("--on-bad-op", help="stop at an impossible op in the trace, or skip it.")] = "stop",
    steps: Annotated[Optional[str], typer.Option("--steps", help="Replay window A:B (B exclusive); earlier steps run silently, the summary covers the window.")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", help="Write the step-by-step state log (Arrow) here.")] = None,
    allocator: Annotated[str, typer.Option("--allocator", help="Allocator version: builtin, token, paged[:N], module:factory, file.py:factory.")] = "builtin",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
    tui: Annotated[bool, typer.Option("--tui", help="Show the live dashboard (keys: ? in it).")] = False,
    serve: Annotated[Optional[int], typer.Option("--serve", min=1, max=65535, help=f"With --tui: serve the dashboard as a web page on PORT (default {DEFAULT_PORT}).", metavar="[PORT]")] = None,
    host: Annotated[str, typer.Option("--host", help="With --serve: the address to listen on (a trace can reveal a service's traffic: keep the loopback default unless you mean it).")] = "127.0.0.1",
) -> None:
    """Replay TRACE through the allocator with its invariants checked; print a summary.

    Exit code: 0 clean; 1 violations, out of memory (with --on-oom stop) or skipped bad ops;
    2 bad input.
    """
    from kvtrace.session import ReplaySession

    for name, value, allowed in (
        ("--device", device, ("cpu", "cuda")),
        ("--check", check, CHECK_MODES),
        ("--on-oom", on_oom, ("stop", "skip")),
        ("--on-bad-op", on_bad_op, ("stop", "skip")),
    ):
        if value not in allowed:
            raise typer.BadParameter(f"'{value}' is not one of {', '.join(allowed)}", param_hint=name)
    start, stop = parse_step_range(steps)
    check_dashboard_options(tui, serve, as_json, host)
    check_device(device)
    options = ReplayOptions(
        check=check,  # type: ignore[arg-type]
        on_oom=on_oom,  # type: ignore[arg-type]
        on_bad_op=on_bad_op,  # type: ignore[arg-type]
        start_step=start,
        stop_step=stop,
        max_violations=1 if first_violation else max_violations,
    )
    if serve is not None:
        from kvtrace.tui.run import serve as serve_dashboard

        # Checked here once (bad trace, version, configuration: one line, exit 2) before serving.
        ReplaySession(trace, version=allocator, page_size=page_size, pool_tokens=pool_tokens, device=device,
                      options=options, screen="inline").close()
        serve_dashboard(sys.argv[1:], host=host, port=serve)
        return
    if tui:
        from kvtrace.tui.run import run_live

        with ReplaySession(
            trace, version=allocator, page_size=page_size, pool_tokens=pool_tokens, device=device, options=options,
            checkpoint_every=DASHBOARD_CHECKPOINT_EVERY, track_state=True,
        ) as session:
            log = None
            if out is not None:
                log = StateLogWriter(
                    out, {"trace": str(trace), "allocator": session.version.spec, "config": _config_dict(session.config)}
                )
            run_live(session, log=log)
        return
    err = Console(stderr=True)
    with ReplaySession(
        trace, version=allocator, page_size=page_size, pool_tokens=pool_tokens, device=device, options=options
    ) as session:
        log = None
        if out is not None:
            log = StateLogWriter(
                out, {"trace": str(trace), "allocator": session.version.spec, "config": _config_dict(session.config)}
            )
        try:
            with _progress(err, session) as advance:
                for snap in session.snapshots():
                    if log is not None:
                        log.write(snap)
                    advance(snap.step, snap.time_s)
        finally:
            if log is not None:
                log.close()
        result = session.result()
    summary = result.to_dict()
    if out is not None:
        summary["state_log"] = str(out)
    if (start is not None or stop is not None) and result.stats.steps == 0 and not result.stopped_early:
        err.print(f"[yellow]warning:[/yellow] --steps {steps}: no step of {trace} falls in that window")
    if summary["truncated"]:
        err.print(f"[yellow]warning:[/yellow] {trace}: the trace was cut short; replayed every complete step")
    if as_json:
        sys.stdout.write(json.dumps(summary) + "\n")
    else:
        render_replay_summary(summary, Console(), title=f"kvtrace replay {trace}")
    raise typer.Exit(1 if result.failed else 0)


def _config_dict(config: object) -> dict[str, object]:
    import dataclasses

    d = dataclasses.asdict(config)  # type: ignore[call-overload]
    return {k: v for k, v in d.items() if v is not None}


class _progress:
    """A stderr progress line (steps, simulated time, share of the file read); silent when not a TTY."""

    def __init__(self, console: Console, session: object) -> None:
        self.console = console
        self.session = session
        self.enabled = console.is_terminal
        self._last = 0.0
        self._steps = 0

    def __enter__(self):  # noqa: ANN204
        if not self.enabled:
            return lambda step, t: None
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("replay"),
            BarColumn(),
            TextColumn("{task.percentage:>3.0f}%"),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=self.console,
            transient=True,
        )
        self._progress.start()
        self._task = self._progress.add_task("replay", total=1.0, info="")

        def advance(step: int, t: float) -> None:
            self._steps += 1
            now = time.monotonic()
            if now - self._last < 0.1:
                return
            self._last = now
            done = self.session.progress  # type: ignore[attr-defined]
            self._progress.update(self._task, completed=done, info=f"step {step:,}  t={t:,.0f}s")

        return advance

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self._progress.stop()
