"""Write a file completely or not at all: a temporary file beside it, renamed into place.

The rename is atomic on POSIX and Windows (``os.replace``), so a reader of the
destination sees the old file or the new one, never half of either; a writer
interrupted at any point (an error, Ctrl-C) leaves the destination as it was. The
application's output policy (which outputs may be overwritten) is
``kvtrace.outputs``; this is the mechanism it and the trace compaction share.

A temporary file is named after its destination and the writing process
(``.NAME.PID-HEX.tmp``), so one left by a process killed outright (SIGKILL, a
power cut) can be told from one being written: ``remove_stale_temporaries``.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["remove_stale_temporaries", "replacing", "stale_temporaries", "temporary_sibling"]

# One ".PID-HEX.tmp" suffix of a temporary name (a compaction of a temporary file adds a second).
_SUFFIX = re.compile(r"\.(\d+)-[0-9a-f]+\.tmp")
# Errors of link(2) that mean "this file system has no hard links", not "the destination exists".
_NO_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS}


def temporary_sibling(dest: str | os.PathLike[str]) -> Path:
    """A fresh hidden name in ``dest``'s directory (same file system, so renames are atomic)."""
    dest = Path(dest)
    return dest.with_name(f".{dest.name}.{os.getpid()}-{secrets.token_hex(3)}.tmp")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    except OverflowError:
        return False
    return True


def stale_temporaries(dest: str | os.PathLike[str]) -> list[Path]:
    """Temporary files of ``dest`` whose writing processes no longer run (killed outright).

    Args:
        dest: the destination the temporary files were written for.

    Returns:
        Their paths, sorted (a temporary file of a live process is not one of them).
    """
    dest = Path(dest)
    pattern = re.compile(r"\.+" + re.escape(dest.name) + r"((?:\.\d+-[0-9a-f]+\.tmp)+)")
    try:
        entries = list(os.scandir(dest.parent))
    except OSError:
        return []
    stale = []
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is None or not entry.is_file(follow_symlinks=False):
            continue
        if not any(_alive(int(pid)) for pid in _SUFFIX.findall(match.group(1))):
            stale.append(Path(entry.path))
    return sorted(stale)


def remove_stale_temporaries(dest: str | os.PathLike[str]) -> list[Path]:
    """Remove ``stale_temporaries(dest)``; return those removed (one that cannot be is kept)."""
    removed = []
    for path in stale_temporaries(dest):
        try:
            path.unlink()
        except OSError:
            continue
        removed.append(path)
    return removed


def _fsync(path: Path) -> None:
    with open(path, "rb") as file:
        os.fsync(file.fileno())


def _link_into_place(tmp: Path, dest: Path) -> None:
    """Put ``tmp`` at ``dest`` unless ``dest`` exists, atomically (FileExistsError if it does)."""
    try:
        os.link(tmp, dest)
    except FileExistsError:
        raise
    except OSError as exc:
        if exc.errno not in _NO_LINKS:
            raise
        # No hard links here: claim the name with an exclusive create, then rename over
        # the (empty) claim.
        os.close(os.open(dest, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        os.replace(tmp, dest)
        return
    tmp.unlink()


@contextmanager
def replacing(dest: str | os.PathLike[str], *, exclusive: bool = False) -> Iterator[Path]:
    """Yield a temporary path to write; rename it over ``dest`` when the block completes.

    The file is flushed to disk before the rename. If the block raises (Ctrl-C
    included), the temporary file is removed and ``dest`` is untouched.

    Args:
        dest: the file to create or replace.
        exclusive: create ``dest`` only if no file has appeared there meanwhile (another
            process writing the same output): the finished file is linked into place,
            which fails if ``dest`` exists, instead of renamed over it.

    Yields:
        The temporary path (not created: the writer creates it).

    Raises:
        FileExistsError: ``exclusive`` and ``dest`` exists (the temporary file is removed).
        OSError: the rename failed (the temporary file is removed).
    """
    dest = Path(dest)
    tmp = temporary_sibling(dest)
    try:
        yield tmp
        _fsync(tmp)
        if exclusive:
            _link_into_place(tmp, dest)
        else:
            os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
