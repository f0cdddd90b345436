"""Entries of the dashboard commands: run the app in this terminal (the replay in a process
of its own), or serve it as a web page (textual-serve: every browser connection starts
the same command in a child process, its screen streamed over a websocket)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtrace.diff.diff import DiffReport
    from kvtrace.proc.contracts import DashboardJob
    from kvtrace.tui.app import KvtraceApp

__all__ = [
    "DEFAULT_PORT", "run_diff", "run_live", "run_log", "serve", "serve_command", "show_diff",
]

DEFAULT_PORT = 8000  # the default of --serve (kvtrace.cli.DEFAULT_SERVE_PORT)


def run_live(job: DashboardJob) -> None:
    """Show the dashboard over the replay ``job`` (``replayer.dashboard_job``) until the
    user quits. The replay runs in its own process; with a log in the job, each step it
    replays for the first time is written there (closed before this returns).

    Raises:
        ReplayProcessError: the replay could not start (a bad trace, version or option:
            its one-line message).
    """
    from kvtrace.tui.remote.link import ChildReplay

    _run([ChildReplay(job)])


def run_log(path: str | Path, *, play: bool = False) -> None:
    """Show the dashboard over a saved state log (read in a process of its own).

    Raises:
        ReplayProcessError: the log cannot be read (its one-line message).
    """
    from kvtrace.tui.remote.link import ChildReplay
    from kvtrace.tui.remote.replayer import log_job

    _run([ChildReplay(log_job(str(path), label=str(path), play=play))])


def run_diff(report: DiffReport, jobs: tuple[DashboardJob, DashboardJob]) -> None:
    """Show the replays of A and B side by side (``jobs``: their ``dashboard_job`` or
    ``log_job``), at the first divergence ``report`` found.

    Raises:
        ReplayProcessError: a side could not start.
    """
    from kvtrace.tui.remote.link import ChildReplay

    links: list[ChildReplay] = []
    try:
        for job in jobs:
            links.append(ChildReplay(job))
    except BaseException:
        for link in links:
            link.close()
        raise
    _run(links, report)


def show_diff(
    report: DiffReport,
    inputs: list[str],
    *,
    a: str,
    b: str | None,
    page_size: int | None,
    pool_tokens: int | None,
    device: str,
    options: dict[str, Any],
    as_json: bool = False,
    eviction_policy: str | None = None,
) -> int:
    """``kvtrace diff ... --tui``: the replays of A and B side by side at the divergence
    ``report`` found (a trace: each version replayed in a process of its own, with the
    what-ifs and replay ``options`` the diff used; two state logs: each log).

    Returns:
        The diff's exit code (0 identical, 1 diverged).

    Raises:
        ConfigError: ``--json`` with ``--tui``. ReplayProcessError: a side could not start.
    """
    import dataclasses

    from kvtrace.errors import ConfigError
    from kvtrace.versions.registry import resolve_any
    from kvtrace.replay.engine import ReplayOptions
    from kvtrace.tui.remote.replayer import dashboard_job, log_job
    from traces.samples import resolve_trace

    if as_json:
        raise ConfigError("--tui shows the diff on the screen; drop --json (or --tui)")
    if len(inputs) == 2:
        jobs = (log_job(inputs[0], label=inputs[0], play=False), log_job(inputs[1], label=inputs[1], play=False))
    else:
        trace = inputs[0]
        replay = dataclasses.asdict(ReplayOptions(**options))  # type: ignore[arg-type]
        jobs = tuple(  # type: ignore[assignment]
            dashboard_job(resolve_any(spec), str(resolve_trace(trace)), trace_label=trace, page_size=page_size,
                          pool_tokens=pool_tokens, device=device, options=replay, play=False,
                          eviction_policy=eviction_policy)
            for spec in (a, b or "builtin")
        )
    run_diff(report, jobs)  # type: ignore[arg-type]
    return 0 if report.identical else 1


def _run(links: list[Any], report: DiffReport | None = None) -> None:
    """Wait for the replays to start, run the app, and return once every replay has
    closed (and written its log).

    Raises:
        ReplayProcessDied: a replay process went away before the user quit (exit 1).
    """
    from kvtrace.tui.app import KvtraceApp

    # Starting a replay (reading the trace, building the allocator) can take seconds: say so on
    # a terminal, and wipe the line once the dashboard takes the screen.
    say = sys.stderr.isatty()
    if say:
        sys.stderr.write("kvtrace: starting the replay…")
        sys.stderr.flush()
    try:
        for link in links:
            link.wait_started()
    except BaseException:
        for link in links:
            link.close()
        raise
    finally:
        if say:
            sys.stderr.write("\r\033[2K")
            sys.stderr.flush()
    app: KvtraceApp = KvtraceApp(links, diff=report)
    try:
        app.run()
    finally:
        app.stop_replays()
        for driver in app.drivers:
            if driver.started.is_set():
                driver.closed.wait(timeout=90)
            else:
                driver.link.close()
    died = app.replay_died()
    if died is not None:
        from kvtrace.tui.remote.link import ReplayProcessDied

        raise ReplayProcessDied(f"the replay process died ({died})")


def serve_command(argv: list[str]) -> str:
    """The shell command a served page runs: this kvtrace with ``argv`` minus the serving
    options (``--serve [PORT]``, ``--host HOST``)."""
    out: list[str] = []
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg == "--host":
            skip = True
            continue
        if arg.startswith("--host=") or arg.startswith("--serve="):
            continue
        if arg == "--serve":
            skip = i + 1 < len(argv) and argv[i + 1].isdigit()
            continue
        out.append(arg)
    return shlex.join([sys.executable, "-m", "kvtrace", *out])


def serve(argv: list[str], *, host: str, port: int) -> None:
    """Serve the dashboard at ``http://HOST:PORT/?token=T`` until interrupted (``T``: a new
    random token, printed with the URL; ``kvtrace.tui.web.DashboardServer``)."""
    from kvtrace.tui.web import DashboardServer

    DashboardServer(serve_command(argv), host=host, port=port).serve()
