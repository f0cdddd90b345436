"""Entries of the dashboard commands: run the app in this terminal, or serve it as a web
page (textual-serve: every browser connection starts the same command in a child
process, its screen streamed over a websocket)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtrace.session import ReplaySession
    from kvtrace.tui.app import KvtraceApp
    from kvtrace.statelog import StateLogWriter

__all__ = ["DASHBOARD_CHECKPOINT_EVERY", "DEFAULT_PORT", "run_live", "run_log", "serve", "serve_command"]

DEFAULT_PORT = 8000  # the default of --serve (kvtrace.cli.DEFAULT_SERVE_PORT)
DASHBOARD_CHECKPOINT_EVERY = 2000  # steps between the live dashboard's seek checkpoints
_TEMPLATES = Path(__file__).parent / "web"


def run_live(session: ReplaySession, *, log: StateLogWriter | None = None, play: bool = True) -> None:
    """Show the dashboard over ``session`` (built with ``track_state=True``) until the user
    quits; each step replayed for the first time goes to ``log`` too."""
    from kvtrace.tui.app import KvtraceApp
    from kvtrace.tui.sources import LiveSource

    _run(KvtraceApp(LiveSource(session, log), play=play))


def run_log(path: str | Path, *, play: bool = False) -> None:
    """Show the dashboard over a saved state log.

    Raises:
        TraceError: the log cannot be read.
    """
    from kvtrace.logsession import StateLogSession
    from kvtrace.tui.app import KvtraceApp
    from kvtrace.tui.sources import LogSource

    _run(KvtraceApp(LogSource(StateLogSession(path)), play=play))


def _run(app: KvtraceApp) -> None:
    """Run the app; return once its replay thread has closed the source (and its log)."""
    try:
        app.run()
    finally:
        app.driver.stop()
        if app.driver.frames_posted:  # the worker started
            app.replay_closed.wait(timeout=60)


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
    """Serve the dashboard at ``http://HOST:PORT`` until interrupted."""
    from textual_serve.server import Server

    command = serve_command(argv)
    server = Server(command, host=host, port=port, title="kvtrace", templates_path=str(_TEMPLATES))
    server.serve()
