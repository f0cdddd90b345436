"""``kvtrace view``: the dashboard over a saved state log (no allocator needed)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvtrace.cli import command, ui
from kvtrace.cli.options import JsonOpt, NoColorOpt, QuietOpt, examples
from kvtrace.tui.run import DEFAULT_PORT  # (imports no Textual)

VIEW_EXAMPLES = examples(
    "# write a state log, then look at it step by step",
    "kvtrace replay sample:mooncake-tiny --out tiny.arrow",
    "kvtrace view tiny.arrow",
    "# the same as a web page on port 8000 of this machine (reach it with ssh -L 8000:127.0.0.1:8000)",
    "kvtrace view tiny.arrow --serve",
)


@command("view", epilog=VIEW_EXAMPLES)
def view(
    log: Annotated[Path, typer.Argument(metavar="LOG", help="A state log written by 'kvtrace replay TRACE --out LOG'.")],
    serve: Annotated[Optional[int], typer.Option("--serve", min=1, max=65535, help=f"Serve the dashboard as a web page on PORT (default {DEFAULT_PORT}).", metavar="[PORT]")] = None,
    host: Annotated[str, typer.Option("--host", help="With --serve: the address to listen on (a log can reveal a service's traffic: keep the loopback default unless you mean it).")] = "127.0.0.1",
    quiet: QuietOpt = False,
    no_color: NoColorOpt = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the log's summary (as kvtrace info LOG --json does) and exit; no dashboard.", callback=ui.set_json)] = False,
) -> None:
    """Show the replay dashboard over a saved state log: the same screens, stepping and seeking
    through the log. The page map shows the pool by state (a log records no slot positions).

    With --json, prints the log's summary instead (the object of kvtrace info LOG --json).

    Exit code: 0 after quitting; 2 when LOG is not a readable state log, or without --serve
    when stdout, stdin or stderr is not a terminal.
    """
    from kvtrace.statelog.session import StateLogSession

    if host != "127.0.0.1" and serve is None:
        raise typer.BadParameter("--host is where --serve listens; add --serve", param_hint="--host")
    if as_json and serve is not None:
        raise typer.BadParameter("the dashboard prints no JSON; drop --json or --serve", param_hint="--json")
    StateLogSession(log).close()  # a bad log: one line and exit 2, before any screen
    if as_json:
        from kvtrace.cli.statelog_info import state_log_info

        ui.emit_json(state_log_info(str(log)))
        return
    if serve is None:
        ui.require_terminal("run it in a terminal, add --serve to show it as a web page, or --json for the summary")
    ui.no_color_for_textual()
    if serve is not None:
        from kvtrace.tui.run import serve as serve_dashboard

        serve_dashboard(sys.argv[1:], host=host, port=serve)
        return
    from kvtrace.tui.run import run_log

    run_log(log)
