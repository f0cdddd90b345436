"""The only user-facing errors of kvtrace.

The CLI turns every error in ``USER_ERRORS`` into one line on stderr and its
``exit_code`` (2 for bad input); ``--debug`` shows the traceback. Messages say
what, where (file, option, step, request id) and what to do.

Trace-file errors are defined in ``traces.errors`` (the ``traces`` package
cannot import ``kvtrace``) and re-exported here: ``TraceError`` and its
subclasses are user errors exactly like ``KvtraceError``, but they are not
subclasses of it. Code that catches "any user error" catches ``USER_ERRORS``.
"""

from __future__ import annotations

import signal

from traces.errors import (
    TraceCorruptError,
    TraceError,
    TraceFormatError,
    TraceMetadataError,
    TraceReadError,
    TraceSchemaError,
    TraceVersionError,
    TraceWriteError,
    UnknownSampleError,
)


class KvtraceError(Exception):
    """Base of every error the user can cause. ``exit_code`` is what the CLI returns."""

    exit_code: int = 2


class WorkloadError(KvtraceError):
    """A workload file (Mooncake JSONL, Azure CSV, lengths CSV) has a bad row or column."""


class ConfigError(KvtraceError):
    """An option or setting is out of range or inconsistent with the trace."""


class VersionSpecError(KvtraceError):
    """An allocator version spec (built-in, module, file, git revision) cannot be loaded."""


class EmptyRecordingError(KvtraceError):
    """A recording that wrote no step (every request was rejected); exit code 1."""

    exit_code = 1


class OutputError(KvtraceError):
    """An output path is refused: it is one of the inputs, it exists (without ``--force``),
    it is a directory, or its directory does not exist."""


class Terminated(BaseException):
    """A termination signal (SIGTERM, SIGHUP) turned into an exception, so that a command
    stopped that way closes its files and removes its temporary ones on the way out.

    A ``BaseException`` like ``KeyboardInterrupt``: code that closes its files on
    the way out (``with`` blocks) does so, and ``except Exception`` does not swallow it.
    The CLI exits with 128 + ``signum``.
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"terminated by {signal.Signals(signum).name}")


class NoTerminalError(KvtraceError):
    """The full-screen dashboard was asked for where there is no terminal to draw it on
    (stdout, stdin or stderr a pipe or a file)."""


# Every exception the CLI reports as one line (never a traceback without --debug).
USER_ERRORS: tuple[type[Exception], ...] = (KvtraceError, TraceError)

__all__ = [
    "USER_ERRORS",
    "ConfigError",
    "EmptyRecordingError",
    "KvtraceError",
    "NoTerminalError",
    "OutputError",
    "Terminated",
    "TraceCorruptError",
    "TraceError",
    "TraceFormatError",
    "TraceMetadataError",
    "TraceReadError",
    "TraceSchemaError",
    "TraceVersionError",
    "TraceWriteError",
    "UnknownSampleError",
    "VersionSpecError",
    "WorkloadError",
]
