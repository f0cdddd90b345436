"""Write a file completely or not at all: a temporary file beside it, renamed into place.

The rename is atomic on POSIX and Windows (``os.replace``), so a reader of the
destination sees the old file or the new one, never half of either; a writer
interrupted at any point (an error, Ctrl-C) leaves the destination as it was. The
application's output policy (which outputs may be overwritten) is
``kvtrace.outputs``; this is the mechanism it and the trace compaction share.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["replacing", "temporary_sibling"]


def temporary_sibling(dest: str | os.PathLike[str]) -> Path:
    """A fresh hidden name in ``dest``'s directory (same file system, so renames are atomic)."""
    dest = Path(dest)
    return dest.with_name(f".{dest.name}.{os.getpid()}-{secrets.token_hex(3)}.tmp")


def _fsync(path: Path) -> None:
    with open(path, "rb") as file:
        os.fsync(file.fileno())


@contextmanager
def replacing(dest: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path to write; rename it over ``dest`` when the block completes.

    The file is flushed to disk before the rename. If the block raises (Ctrl-C
    included), the temporary file is removed and ``dest`` is untouched.

    Args:
        dest: the file to create or replace.

    Yields:
        The temporary path (not created: the writer creates it).

    Raises:
        OSError: the rename failed (the temporary file is removed).
    """
    dest = Path(dest)
    tmp = temporary_sibling(dest)
    try:
        yield tmp
        _fsync(tmp)
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
