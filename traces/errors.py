"""The errors of the trace package: every problem a user can cause with a trace file.

``traces`` cannot import ``kvtrace``, so it owns its exception family;
``kvtrace.errors`` re-exports these names and the CLI treats ``TraceError`` like
``KvtraceError``: one line on stderr, exit code ``exit_code`` (2).

Every message is one line that names the file (and, where it applies, the
record batch, step, column or request) and says what to do.

Hierarchy::

    TraceError
    ├── TraceReadError        cannot open: missing, a directory, unreadable, not an Arrow stream
    ├── TraceFormatError      an Arrow stream that breaks the kvtrace contract
    │   ├── TraceSchemaError      required column missing, wrong type, nulls, unknown op
    │   ├── TraceMetadataError    kvtrace metadata missing or invalid
    │   └── TraceVersionError     written by a newer (or unknown) format version
    ├── TraceCorruptError     damaged data before the end of the file
    ├── TraceWriteError       the trace cannot be written (disk full, permission, exists)
    └── UnknownSampleError    ``sample:NAME`` names no bundled sample
"""

from __future__ import annotations

from pathlib import Path


class TraceError(Exception):
    """Base of every trace error. ``exit_code`` is what the CLI returns; ``path`` the file."""

    exit_code: int = 2

    def __init__(self, message: str, *, path: str | Path | None = None) -> None:
        super().__init__(message)
        self.path = None if path is None else str(path)


class TraceReadError(TraceError):
    """The file cannot be opened or is not an Arrow IPC stream."""


class TraceFormatError(TraceError):
    """The file is an Arrow IPC stream but its schema or metadata break the kvtrace contract."""


class TraceSchemaError(TraceFormatError):
    """A required column is missing, has the wrong type, holds nulls, or an op is unknown."""


class TraceMetadataError(TraceFormatError):
    """The ``kvtrace`` schema metadata is missing, not JSON, or lacks a required key."""


class TraceVersionError(TraceFormatError):
    """The trace was written by a format version this kvtrace does not read."""


class TraceCorruptError(TraceError):
    """A complete record batch cannot be decoded (corrupt compressed buffer, garbage)."""


class TraceWriteError(TraceError):
    """The trace cannot be written: the file exists, the disk is full, no permission."""


class UnknownSampleError(TraceError):
    """``sample:NAME`` names no bundled sample trace."""
