"""What the command line prints, in one place.

* ``warn``: the one warning style, ``kvtrace: warning: …`` on stderr.
* ``console``: a rich console that honours ``--no-color`` (and ``NO_COLOR``) and
  never wraps lines when the output is a pipe or a file.
* ``emit_json`` / ``rounded``: ``--json`` output, one object, numbers rounded.
* ``settings``: the ``-q`` / ``--no-color`` / ``--json`` state the shared options set
  (before or after the command's name).
* ``progress``: the progress display of long work, on stderr when it is a terminal.
* ``terminate_on_signals``: SIGINT, SIGTERM and SIGHUP become exceptions between
  two steps of a trace being written, so a command stopped that way closes its
  files (a recording marks its trace interrupted after a whole step).

Nothing here imports rich, numpy or pyarrow at import time (``kvtrace --help``
must start fast).
"""

from __future__ import annotations

import errno
import json
import math
import os
import shlex
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtrace.errors import Terminated

if TYPE_CHECKING:
    from rich.console import Console

# Width given to rich when the output is not a terminal: wide enough that no line
# is ever wrapped (tables size to their content).
PIPE_WIDTH = 10_000
# ``--json`` floats keep this many significant digits, and never fewer decimals
# than JSON_MIN_DECIMALS (a millisecond of a long duration survives).
JSON_DIGITS = 6
JSON_MIN_DECIMALS = 3
ARGV_KEY = "kvtrace.argv"
# A progress display redraws at most this often, however often it is updated.
PROGRESS_EVERY_S = 0.1


@dataclass
class Settings:
    """Output settings of the command being run (reset at the start of each command line)."""

    quiet: bool = False
    no_color: bool = False
    json: bool = False


settings = Settings()


def reset() -> None:
    """Back to the defaults (the root command calls this before parsing)."""
    settings.quiet = False
    settings.no_color = False
    settings.json = False


def set_quiet(value: bool) -> bool:
    """Option callback of ``-q`` / ``--quiet``."""
    if value:
        settings.quiet = True
    return value


def set_no_color(value: bool) -> bool:
    """Option callback of ``--no-color``."""
    if value:
        settings.no_color = True
    return value


def set_json(value: bool) -> bool:
    """Option callback of ``--json``: true when given here or before the command's name."""
    if value:
        settings.json = True
    return settings.json


def no_color_for_textual() -> None:
    """Without colour (``--no-color``), tell the Textual dashboard so (it reads ``NO_COLOR``)."""
    if not color():
        os.environ["NO_COLOR"] = "1"


def require_terminal(alternative: str) -> None:
    """Refuse to start the full-screen dashboard without a terminal: drawn into a pipe or a
    file it would write escape codes and wait for keys that never come.

    Args:
        alternative: what the user can do instead (``"add --serve to ..."``).

    Raises:
        NoTerminalError: stdout, stdin or stderr (where Textual draws) is not a terminal, and
            no other Textual driver (``TEXTUAL_DRIVER``, as a served page sets) draws it.
    """
    from kvtrace.errors import NoTerminalError

    if os.environ.get("TEXTUAL_DRIVER"):  # drawn by another driver (a served page's): no terminal needed
        return
    for name, stream in (("stdout", sys.stdout), ("stdin", sys.stdin), ("stderr", sys.stderr)):
        if stream is None or not stream.isatty():
            raise NoTerminalError(f"the dashboard needs a terminal, and {name} is not one (a pipe or a file); {alternative}")


def color() -> bool:
    """Whether colours and styles are allowed (no ``--no-color``, no ``NO_COLOR``)."""
    return not settings.no_color and not os.environ.get("NO_COLOR")


def console(*, stderr: bool = False) -> Console:
    """A rich console on stdout (or stderr) for this command's output.

    On a terminal it wraps at the terminal's width; into a pipe or a file it never
    wraps. Without colour (``--no-color``, ``NO_COLOR``) it prints plain text.
    """
    from rich.console import Console

    file = sys.stderr if stderr else sys.stdout
    terminal = file.isatty()
    console = Console(
        file=file,
        no_color=not color(),
        highlight=False,
        width=None if terminal else PIPE_WIDTH,
        color_system="auto" if color() else None,
    )
    console.on_broken_pipe = broken_pipe  # type: ignore[method-assign]
    return console


def broken_pipe() -> None:
    """Rich's own answer to a closed pipe is exit code 1; the CLI's is a quiet exit 0."""
    raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))


def warn(message: str) -> None:
    """Print ``kvtrace: warning: MESSAGE`` on stderr (also with ``-q``)."""
    sys.stderr.write(f"kvtrace: warning: {message}\n")
    sys.stderr.flush()


def note(message: str) -> None:
    """Print ``kvtrace: MESSAGE`` on stderr, unless ``-q``."""
    if not settings.quiet:
        sys.stderr.write(f"kvtrace: {message}\n")
        sys.stderr.flush()


def progress_shown() -> bool:
    """Whether commands show progress: stderr is a terminal and neither ``-q`` nor ``--json``."""
    return not settings.quiet and not settings.json and sys.stderr is not None and sys.stderr.isatty()


class ProgressLine:
    """One transient progress line on stderr: what is being done, a bar, how far, an
    info text and the time taken (optionally the time left). Calling it redraws at most
    every ``PROGRESS_EVERY_S`` seconds; a hot loop asks ``due()`` first so that it
    formats its info text only when the line will be redrawn.

    Where ``progress_shown()`` is false the line is silent: ``due()`` is always false.
    """

    def __init__(self, live: Any = None, task: Any = None) -> None:
        self._live = live
        self._task = task
        self._last = 0.0

    def due(self) -> bool:
        """Whether a redraw is due now (and if so, the clock restarts)."""
        if self._live is None:
            return False
        now = time.monotonic()
        if now - self._last < PROGRESS_EVERY_S:
            return False
        self._last = now
        return True

    def show(self, completed: float, info: str = "", total: float | None = None) -> None:
        """Redraw now: ``completed`` of ``total`` (the total given at the start, unless a
        new one is given here)."""
        if self._live is None:
            return
        if total is not None:
            self._live.update(self._task, total=total)
        self._live.update(self._task, completed=completed, info=info)

    def __call__(self, completed: float, info: str = "", total: float | None = None) -> None:
        """Redraw if one is due (cheap enough to call every step)."""
        if self.due():
            self.show(completed, info, total)


@contextmanager
def progress(what: str, total: float | None = None, *, count: bool = False, eta: bool = False) -> Iterator[ProgressLine]:
    """Show how far long work has gone: one transient line on stderr (erased at the end),
    only where ``progress_shown()``; elsewhere nothing at all. Every command's progress
    is this line.

    Args:
        what: what is being done (``"validating run.kvtrace"``; shown as plain text).
        total: the amount of work (bytes, steps, ...); None while unknown (the bar pulses;
            ``ProgressLine.show`` may give it later).
        count: show ``done/total`` (whole things: cells, requests) instead of a percentage.
        eta: show the time left as well as the time taken.

    Yields:
        The ``ProgressLine``.
    """
    if not progress_shown():
        yield ProgressLine()
        return
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    percent = [TextColumn("{task.percentage:>3.0f}%")] if total is not None else []
    amount = [MofNCompleteColumn()] if count else percent
    left = [TextColumn("eta"), TimeRemainingColumn()] if eta else []
    live = Progress(
        TextColumn(escape(what)), BarColumn(bar_width=24), *amount, TextColumn("{task.fields[info]}", markup=False),
        TimeElapsedColumn(), *left, console=console(stderr=True), transient=True,
    )
    task = live.add_task(what, total=total, info="")
    with live:
        yield ProgressLine(live, task)


def rounded(value: Any) -> Any:
    """``value`` with every float rounded for JSON (nested dicts, lists and tuples too).

    Floats keep ``JSON_DIGITS`` significant digits but at least ``JSON_MIN_DECIMALS``
    decimals; NaN and infinities become None (JSON has neither).
    """
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        if value == 0.0:
            return 0.0
        magnitude = math.floor(math.log10(abs(value)))
        return round(value, max(JSON_MIN_DECIMALS, JSON_DIGITS - 1 - magnitude))
    if isinstance(value, dict):
        return {key: rounded(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(item) for item in value]
    return value


def emit_json(obj: Any) -> None:
    """Print ``obj`` as one JSON object on stdout, numbers rounded (``--json``)."""
    sys.stdout.write(json.dumps(rounded(obj)) + "\n")
    sys.stdout.flush()


def command_line(meta: dict[str, Any]) -> str:
    """The command line being run, shell-quoted (``kvtrace record w.jsonl --out t.kvtrace``).

    Args:
        meta: the click context's ``meta`` (the root command stores the arguments there).
    """
    args = meta.get(ARGV_KEY)
    if args is None:
        args = sys.argv[1:]
    return shlex.join(["kvtrace", *args])


def terminate_on_signals() -> AbstractContextManager[None]:
    """Within the block, SIGINT raises ``KeyboardInterrupt`` and SIGTERM and SIGHUP raise
    ``Terminated`` (``kvtrace.outputs.signals_raise``), so the CLI reports them in one line."""
    from kvtrace.outputs import signals_raise

    names = ("SIGINT", "SIGTERM", "SIGHUP")
    return signals_raise([getattr(signal, name) for name in names if hasattr(signal, name)])
