"""One sweep at a time writes an output: a lock file beside it (``results.parquet.lock``).

Two sweeps on the same ``--out`` would share its parts directory: one merges and
removes the parts while the other is still writing them, and the result keeps
whatever rows were left (none, often). ``claim(out)`` takes an exclusive ``flock``
on ``OUT.lock`` (holding the owner's PID, for the message of the one refused) for
the whole sweep, or refuses in one line. The kernel drops the lock when its owner
dies, however it dies, so the lock file of a killed sweep is taken over by the next
run (its resume) with no stale-PID guessing. The owner removes the file when done.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvtrace.errors import OutputError

__all__ = ["claim", "lock_path"]


def lock_path(out: Path) -> Path:
    """The lock file of ``out``."""
    return out.with_name(out.name + ".lock")


@contextmanager
def claim(out: Path, *, option: str = "--out") -> Iterator[None]:
    """Own ``out`` for the block: no other process's ``claim(out)`` succeeds meanwhile.

    Raises:
        OutputError: another live process owns ``out`` (one line with its PID), or the
            lock file cannot be created.
    """
    path = lock_path(out)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise OutputError(f"{option} {out}: cannot create its lock file {path} ({exc.strerror or exc})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise OutputError(
                f"{option} {out}: another kvtrace sweep (PID {owner}) is writing it; "
                "wait for it to finish or give another path"
            ) from None
        # NOTE: an owner that just finished unlinks the file before it unlocks it; a
        # lock won on that unlinked file guards nothing, so open the path again.
        try:
            current = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
        os.close(fd)
