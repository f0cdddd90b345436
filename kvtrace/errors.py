"""The only user-facing errors of kvtrace.

The CLI turns every ``KvtraceError`` into one line on stderr and exit code 2
(``--debug`` shows the traceback). Messages say what, where (file, option,
step, request id) and what to do; they never end with a period-less stack dump.
"""

from __future__ import annotations


class KvtraceError(Exception):
    """Base of every error the user can cause. ``exit_code`` is what the CLI returns."""

    exit_code: int = 2


class TraceError(KvtraceError):
    """A trace file cannot be read: missing, not Arrow, corrupt, unknown version, bad schema."""


class TraceFormatError(TraceError):
    """The file is an Arrow stream but its schema or metadata break the kvtrace contract."""


class WorkloadError(KvtraceError):
    """A workload file (Mooncake JSONL, Azure CSV, lengths CSV) has a bad row or column."""


class ConfigError(KvtraceError):
    """An option or setting is out of range or inconsistent with the trace."""


class VersionSpecError(KvtraceError):
    """An allocator version spec (built-in, module, file, git revision) cannot be loaded."""
