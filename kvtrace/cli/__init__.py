"""The ``kvtrace`` command line: one Typer app, one sub-module per command group.

Error contract (see README "Exit codes"): a ``KvtraceError`` or a trace-file
``TraceError`` (``kvtrace.errors.USER_ERRORS``) becomes one line on stderr and its
exit code (2 for bad input); a command's usage errors (a bad option value,
``typer.BadParameter``) become one line too and exit 2; Ctrl-C exits 130 and
SIGTERM / SIGHUP 128 + the signal number; ``--debug`` anywhere on the command
line shows the traceback instead.

Start-up: importing this package imports typer only. The console script imports
the module of the command it runs (``COMMAND_MODULES``), or all of them for the
root help, completion or a name it does not know; ``app`` (what tests and
library users invoke) has every command. A command imports numpy, pyarrow, rich
tables and torch inside its function, when it runs (``kvtrace --help`` and
``kvtrace info`` never import torch).
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any, Optional

import typer
from typer.core import TyperCommand, TyperGroup

from kvtrace import __version__
from kvtrace.cli import ui
from kvtrace.cli.options import JsonOpt, NoColorOpt, QuietOpt, examples
from kvtrace.errors import USER_ERRORS, KvtraceError

DEBUG_KEY = "kvtrace.debug"
DEFAULT_SERVE_PORT = "8000"  # `--serve` alone (kvtrace.tui.run.DEFAULT_PORT)
# typer vendors click and exports only BadParameter; its base is click's UsageError
# (bad option values, missing arguments, unknown options of a command).
_USAGE_ERROR: type[Exception] = typer.BadParameter.__mro__[1]


def _flags_as_flags(params: list[Any]) -> list[Any]:
    """Boolean flags show no ``<bool>`` value in ``--help`` (an empty metavar)."""
    for param in params:
        if getattr(param, "is_bool_flag", False) and param.metavar is None:
            param.metavar = ""
    return params


def plain_usage(pieces: list[str]) -> list[str]:
    """Usage pieces as kvtrace writes them: ``TRACE``, not typer's ``{TRACE}`` for a required argument."""
    return [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in pieces]


_help_table: type | None = None


@contextmanager
def whole_option_names() -> Iterator[None]:
    """While typer prints a help page, every option name keeps its full width.

    typer lets rich shrink every column of its options table to fit the terminal, the
    names too (``--max-prefill-…`` at 80 columns). Within this block its table gives the
    columns before the type and the help (required mark, names, short names, negative
    flags) a fixed width: only the type and the help wrap (a long word folds).
    """
    global _help_table
    from typer import rich_utils

    if _help_table is None:
        from rich.cells import cell_len
        from rich.table import Table
        from rich.text import Text

        class OptionsTable(Table):
            def add_row(self, *renderables: Any, **kwargs: Any) -> None:
                super().add_row(*renderables, **kwargs)
                if len(renderables) < 6:  # not an options panel (the commands' table)
                    return
                for column, cell in zip(self.columns[:-2], renderables[:-2]):
                    width = cell_len(cell if isinstance(cell, str) else cell.plain)
                    column.width = max(column.width or 0, width)
                for column in self.columns[-2:]:
                    column.overflow = "fold"  # a word longer than the column breaks, whole
                for text in getattr(renderables[-1], "renderables", ()):  # the help: rich Columns of Text
                    if isinstance(text, Text):
                        text.overflow = "fold"

        _help_table = OptionsTable
    original = rich_utils.Table
    rich_utils.Table = _help_table
    try:
        yield
    finally:
        rich_utils.Table = original


class KvtraceCommand(TyperCommand):
    """A kvtrace command: flags are shown as flags in its help, option names whole,
    arguments plainly in its usage."""

    def get_params(self, ctx: typer.Context) -> list[Any]:
        return _flags_as_flags(super().get_params(ctx))

    def collect_usage_pieces(self, ctx: typer.Context) -> list[str]:
        return plain_usage(super().collect_usage_pieces(ctx))

    def format_help(self, ctx: typer.Context, formatter: Any) -> None:
        self.help = reflow_paragraphs(self.help)
        with whole_option_names():
            super().format_help(ctx, formatter)


def reflow_paragraphs(text: str | None) -> str | None:
    """A docstring's paragraphs each as one line, for the help's own wrapping: rich help
    keeps the source's line breaks after the first paragraph, which at a width other
    than the source's breaks lines mid-sentence. Paragraphs of indented or bulleted
    lines keep their breaks."""
    if not text:
        return text
    out = []
    for paragraph in text.split("\n\n"):
        lines = paragraph.split("\n")
        if any(line[:1].isspace() or line.lstrip().startswith(("- ", "* ", "\b")) for line in lines):
            out.append(paragraph)
        else:
            out.append(" ".join(line.strip() for line in lines))
    return "\n\n".join(out)


class KvtraceGroup(TyperGroup):
    """Root group: accepts ``--debug`` at any position and turns errors into one line."""

    def get_params(self, ctx: typer.Context) -> list[Any]:
        # typer's own completion options take no shell (they detect it); kvtrace's take one.
        params = [p for p in super().get_params(ctx) if p.name not in _TYPER_COMPLETION_PARAMS]
        return _flags_as_flags(params)

    def format_help(self, ctx: typer.Context, formatter: Any) -> None:
        self.help = reflow_paragraphs(self.help)
        with whole_option_names():
            super().format_help(ctx, formatter)

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        ui.reset()
        if "--debug" in args:
            ctx.meta[DEBUG_KEY] = True
            args = [a for a in args if a != "--debug"]
        ctx.meta[ui.ARGV_KEY] = list(args)
        args = optional_value(args, "--serve", DEFAULT_SERVE_PORT)
        for option in ("--install-completion", "--show-completion"):
            args = optional_value(args, option, CURRENT_SHELL, is_value=lambda arg: not arg.startswith("-"))
        try:
            return super().parse_args(ctx, args)
        except BrokenPipeError:  # the root help's reader went away (| head): done, quietly
            _discard_stdout()
            raise typer.Exit(0) from None
        except _USAGE_ERROR as exc:  # a bad root option: one line, as for a command's
            if type(exc).__name__ == "NoArgsIsHelpError":  # no arguments: the help
                raise
            _usage_error(exc, bool(ctx.meta.get(DEBUG_KEY)))

    def invoke(self, ctx: typer.Context) -> Any:
        debug = bool(ctx.meta.get(DEBUG_KEY))
        try:
            return super().invoke(ctx)
        except _USAGE_ERROR as exc:  # a bad option value or argument of a command: one line
            _usage_error(exc, debug)
        except (typer.Exit, typer.Abort, typer.TyperException):
            raise
        except BrokenPipeError:  # the reader of our output went away (| head): done, quietly
            _discard_stdout()
            raise typer.Exit(0) from None
        except StdoutError as exc:
            if debug:
                traceback.print_exc()
            _discard_stdout()
            typer.echo(f"kvtrace: error: {exc}", err=True)
            raise typer.Exit(exc.exit_code) from None
        except USER_ERRORS as exc:  # KvtraceError and traces' TraceError
            if debug:
                traceback.print_exc()
            typer.echo(f"kvtrace: error: {exc}", err=True)
            raise typer.Exit(getattr(exc, "exit_code", 2)) from None
        except KeyboardInterrupt:
            typer.echo("kvtrace: interrupted", err=True)
            raise typer.Exit(130) from None
        except ui.Terminated as exc:
            typer.echo(f"kvtrace: {exc}", err=True)
            raise typer.Exit(128 + exc.signum) from None
        except Exception as exc:  # a bug in kvtrace, not the user's fault
            if debug:
                traceback.print_exc()
            typer.echo(
                f"kvtrace: internal error: {type(exc).__name__}: {exc} "
                "(rerun with --debug for the traceback)",
                err=True,
            )
            raise typer.Exit(2) from None


class StdoutError(KvtraceError):
    """Standard output cannot be written (a full disk, ``> /dev/full``, a closed descriptor)."""


class _Stdout:
    """The console script's ``sys.stdout``: the real one (None: closed when kvtrace started),
    its write errors raised as ``StdoutError`` so the CLI tells them from a bug in one
    line. A closed pipe stays ``BrokenPipeError`` (``| head``: not an error)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def _failed(self, exc: OSError) -> StdoutError:
        return StdoutError(f"cannot write to standard output: {os.strerror(exc.errno) if exc.errno else exc}")

    def write(self, text: str) -> int:
        if self._stream is None:
            raise StdoutError("cannot write to standard output: it is closed; redirect it (> FILE, > /dev/null)")
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise self._failed(exc) from None

    def flush(self) -> None:
        if self._stream is None:
            return
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise self._failed(exc) from None

    def isatty(self) -> bool:
        return self._stream is not None and self._stream.isatty()

    def __getattr__(self, name: str) -> Any:
        if self._stream is None:
            if name == "encoding":
                return "utf-8"
            if name == "errors":
                return "strict"
            raise AttributeError(name)
        return getattr(self._stream, name)


def _discard_stdout_descriptor() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        if devnull != 1:
            os.dup2(devnull, 1)
            os.close(devnull)
    except OSError:
        pass


def _discard_stdout() -> None:
    """From now on, what goes to standard output (what is still buffered, at exit too) goes
    to /dev/null: the reader is gone or the output cannot be written, and saying so once
    is enough. Only for the console script's own standard output (``main``)."""
    if isinstance(sys.stdout, _Stdout):
        _discard_stdout_descriptor()


def _usage_error(exc: Any, debug: bool) -> None:
    """Print a usage error (click's ``UsageError``) as one line and exit with its code."""
    if debug:
        traceback.print_exc()
    where = exc.ctx.command_path if exc.ctx is not None else "kvtrace"
    typer.echo(f"kvtrace: error: {exc.format_message()} (see '{where} --help')", err=True)
    raise typer.Exit(exc.exit_code) from None


def optional_value(
    args: list[str], option: str, default: str, *, is_value: Callable[[str], bool] = str.isdigit
) -> list[str]:
    """Give ``option`` its default value where it is not followed by one (``--serve [PORT]``:
    click options take a value or none, not an optional one).

    Args:
        is_value: whether the argument after ``option`` is its value (default: digits).
    """
    out: list[str] = []
    for i, arg in enumerate(args):
        out.append(arg)
        if arg == option and (i + 1 == len(args) or not is_value(args[i + 1])):
            out.append(default)
    return out


# The shells typer completes, and what ``--install-completion`` alone stands for.
SHELLS = ("bash", "zsh", "fish", "powershell", "pwsh")
CURRENT_SHELL = ""
_TYPER_COMPLETION_PARAMS = ("install_completion", "show_completion")


def _completion(ctx: typer.Context, param: Any, value: str | None) -> None:
    """Callback of ``--install-completion [SHELL]`` and ``--show-completion [SHELL]``: typer's
    own, given the shell named (typer's options detect the shell and ignore a name)."""
    if value is None or ctx.resilient_parsing:
        return
    if value != CURRENT_SHELL and value not in SHELLS:
        raise typer.BadParameter(f"'{value}' is not a shell kvtrace completes; use one of {', '.join(SHELLS)}")
    from typer import completion

    handler = completion.install_callback if param.name == "install_shell" else completion.show_callback
    handler(ctx, param, value or True)  # True: the shell kvtrace runs in


_app = typer.Typer(
    name="kvtrace",
    cls=KvtraceGroup,
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    epilog=examples(
        "# what a bundled sample trace holds",
        "kvtrace info sample:tiny",
        "# replay it with every invariant checked after each allocator call",
        "kvtrace replay sample:mooncake-tiny --check every",
        "# record a production workload into a trace",
        "kvtrace record conversation_trace.jsonl --out conv.kvtrace",
    ),
    context_settings={"help_option_names": ["-h", "--help"]},
)


def command(name: str, *, epilog: str, **kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a kvtrace command: ``app.command`` with kvtrace's command class (flags
    shown as flags) and an Examples section (``options.examples``)."""
    return _app.command(name, cls=KvtraceCommand, epilog=epilog, **kwargs)


def add_group(group: typer.Typer, name: str) -> None:
    """Register a command group (``kvtrace sweep run|report``) on the root app."""
    _app.add_typer(group, name=name)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"kvtrace {__version__}")
        raise typer.Exit(0)


@_app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", help="Print kvtrace's version and exit.", is_eager=True, callback=_print_version),
    ] = False,
    quiet: QuietOpt = False,
    no_color: NoColorOpt = False,
    as_json: JsonOpt = False,
    install_shell: Annotated[
        Optional[str],
        typer.Option(
            "--install-completion", metavar="[SHELL]", is_eager=True, callback=_completion, show_default=False,
            help=f"Install completion for SHELL ({', '.join(SHELLS)}; default: the shell kvtrace runs in).",
        ),
    ] = None,
    show_shell: Annotated[
        Optional[str],
        typer.Option(
            "--show-completion", metavar="[SHELL]", is_eager=True, callback=_completion, show_default=False,
            help="Print the completion script for SHELL (default: the shell kvtrace runs in), to copy or customise.",
        ),
    ] = None,
) -> None:
    """Record and replay the KV-cache allocator of LLM serving engines, every invariant checked.

    Add --debug anywhere to see the traceback of an error.
    """


# Each command's module, in the order of the root help. A module registers its
# commands on the root app when imported (``command``, ``add_group``).
COMMAND_MODULES: dict[str, str] = {
    "info": "info",
    "validate": "info",
    "record": "record",
    "replay": "replay",
    "explain": "explain",
    "diff": "diff",
    "versions": "diff",
    "view": "view",
    "export": "export",
    "sweep": "sweep",
    "shrink": "shrink",
    "compact": "compact",
    "events": "events",
}
# Set while the shell asks the console script to complete a word (click's completion).
_COMPLETION_VAR = "_KVTRACE_COMPLETE"


def load_commands(names: list[str] | None = None) -> typer.Typer:
    """Import the modules of the named commands (None: every command) and return the root
    app (a module imported before registers nothing again: Python imports it once)."""
    modules = COMMAND_MODULES.values() if names is None else [COMMAND_MODULES[n] for n in names]
    for module in dict.fromkeys(modules):
        importlib.import_module(f"kvtrace.cli.{module}")
    return _app


def command_named(args: list[str]) -> str | None:
    """The command a command line runs when it is one of kvtrace's (None: the root's help,
    its options alone, shell completion, or a name kvtrace does not have)."""
    if _COMPLETION_VAR in os.environ:
        return None
    index = next((i for i, arg in enumerate(args) if not arg.startswith("-")), None)
    if index is None or args[index] not in COMMAND_MODULES:
        return None
    if any(arg in ("-h", "--help") for arg in args[:index]):
        return None  # the root's help (it lists every command), whatever follows
    return args[index]


def __getattr__(name: str) -> Any:
    """``app``: the root app with every command registered."""
    if name == "app":
        return load_commands()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    """Console-script entry point: registers only the command it runs (start-up time).

    Standard output is wrapped (``_Stdout``) so that a failure to write it is one line;
    what is still buffered is flushed here, before the exit code is final. A standard
    output closed at start keeps descriptor 1 on /dev/null: no file kvtrace opens may
    take that number and receive what was meant for the terminal.
    """
    if sys.stdout is None:
        _discard_stdout_descriptor()
    sys.stdout = _Stdout(sys.stdout)
    if len(sys.argv) == 1 or {"--help", "-h"} & set(sys.argv[1:]):
        # Help is printed by typer's own rich console, whose answer to a closed pipe is exit 1.
        import rich.console

        rich.console.Console.on_broken_pipe = staticmethod(ui.broken_pipe)  # type: ignore[method-assign,assignment]
    name = command_named(sys.argv[1:])
    app = load_commands(None if name is None else [name])
    code: Any = 0
    try:
        try:
            app(prog_name="kvtrace")  # exits (SystemExit), unless --help or --version cannot print
        except SystemExit as exc:
            code = exc.code
        sys.stdout.flush()
    except BrokenPipeError:
        _discard_stdout()
    except StdoutError as exc:
        _discard_stdout()
        sys.stderr.write(f"kvtrace: error: {exc}\n")
        code = code or exc.exit_code
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    main()
