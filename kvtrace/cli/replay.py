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
from kvtrace.config import check_memory, replay_names
from kvtrace.errors import ConfigError
from kvtrace.registry import resolve_version
from kvtrace.replay import ReplayEngine, ReplayOptions, allocator_config_for
from kvtrace.report import render_replay_summary, replay_summary
from kvtrace.statelog import StateLogWriter
from traces.validate import BackgroundChecker


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
    check: Annotated[str, typer.Option("--check", help="Invariant checks: every (after each allocator call), end, never.")] = "end",
    on_oom: Annotated[str, typer.Option("--on-oom", help="stop at the first out-of-memory, or skip (drop the request).")] = "stop",
    on_bad_op: Annotated[str, typer.Option("--on-bad-op", help="stop at an impossible op in the trace, or skip it.")] = "stop",
    steps: Annotated[Optional[str], typer.Option("--steps", help="Replay range A:B (B exclusive); earlier steps run silently.")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", help="Write the step-by-step state log (Arrow stream) here.")] = None,
    allocator: Annotated[str, typer.Option("--allocator", help="Allocator version: builtin, token, paged[:N], module:factory, file.py:factory.")] = "builtin",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Build the pool even when it looks bigger than the free memory.")] = False,
) -> None:
    """Replay TRACE through the allocator with its invariants checked; print a summary.

    Exit code: 0 clean; 1 violations, out of memory (with --on-oom stop) or skipped bad ops;
    2 bad input.
    """
    from kvtrace.cli.info import open_trace

    for name, value, allowed in (
        ("--device", device, ("cpu", "cuda")),
        ("--check", check, ("every", "end", "never")),
        ("--on-oom", on_oom, ("stop", "skip")),
        ("--on-bad-op", on_bad_op, ("stop", "skip")),
    ):
        if value not in allowed:
            raise typer.BadParameter(f"'{value}' is not one of {', '.join(allowed)}", param_hint=name)
    start, stop = parse_step_range(steps)
    check_device(device)
    version = resolve_version(allocator)
    reader = open_trace(trace)
    config = allocator_config_for(reader.meta, page_size=page_size, pool_tokens=pool_tokens, device=device)
    names = replay_names(pool_tokens=pool_tokens is not None, page_size=page_size is not None)
    check_memory(config, num_rids=reader.rid_bound, names=names, force=force)
    # The step checker runs in a child process on another core; start it before the
    # allocator (which may initialise CUDA).
    checker = BackgroundChecker(reader.path, stop=stop, rid_bound=reader.rid_bound)
    alloc = version.create(config)
    options = ReplayOptions(check=check, on_oom=on_oom, on_bad_op=on_bad_op, start_step=start, stop_step=stop)  # type: ignore[arg-type]
    engine = ReplayEngine(reader.steps(), reader.meta, alloc, options, checker=checker)
    err = Console(stderr=True)
    log = None
    if out is not None:
        log = StateLogWriter(out, {"trace": str(trace), "allocator": version.spec, "config": _config_dict(config)})
    t0 = time.perf_counter()
    try:
        with _progress(err, reader) as advance:
            for snap in engine.snapshots():
                if log is not None:
                    log.write(snap)
                advance(snap.step, snap.time_s)
    finally:
        checker.close()
        if log is not None:
            log.close()
    wall = time.perf_counter() - t0
    summary = replay_summary(
        engine.stats,
        config,
        requests=engine.num_requests,
        wall_s=wall,
        held_overalloc=alloc.counters().overallocated,
        stopped_early=engine.stopped_early,
    )
    summary["trace"] = str(trace)
    summary["allocator"] = version.spec
    summary["truncated"] = bool(getattr(reader, "truncated", False))
    if out is not None:
        summary["state_log"] = str(out)
    if (start is not None or stop is not None) and engine.stats.steps_reported == 0 and not engine.stopped_early:
        err.print(f"[yellow]warning:[/yellow] --steps {steps}: no step of {trace} falls in that window")
    if summary["truncated"]:
        err.print(f"[yellow]warning:[/yellow] {trace}: the trace was cut short; replayed every complete step")
    if as_json:
        sys.stdout.write(json.dumps(summary) + "\n")
    else:
        render_replay_summary(summary, Console(), title=f"kvtrace replay {trace}")
    failed = summary["num_violations"] > 0 or summary["bad_ops"] > 0 or (on_oom == "stop" and summary["oom"] is not None)
    raise typer.Exit(1 if failed else 0)


def _config_dict(config: object) -> dict[str, object]:
    import dataclasses

    d = dataclasses.asdict(config)  # type: ignore[call-overload]
    return {k: v for k, v in d.items() if v is not None}


class _progress:
    """A stderr progress line (steps, simulated time, share of the file read); silent when not a TTY."""

    def __init__(self, console: Console, reader: object) -> None:
        self.console = console
        self.reader = reader
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
        total = float(getattr(self.reader, "file_bytes", 0) or 1)
        self._task = self._progress.add_task("replay", total=total, info="")

        def advance(step: int, t: float) -> None:
            self._steps += 1
            now = time.monotonic()
            if now - self._last < 0.1:
                return
            self._last = now
            done = float(getattr(self.reader, "bytes_read", 0) or 0)
            self._progress.update(self._task, completed=done, info=f"step {step:,}  t={t:,.0f}s")

        return advance

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self._progress.stop()
