"""Helpers for tests that look at other processes."""

from __future__ import annotations

import os
import time


def priority_once_set(pid: int, wanted: int, timeout_s: float = 30.0) -> int:
    """Process ``pid``'s priority once it is ``wanted`` (a child lowers its own soon after
    it starts), or as it is after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while os.getpriority(os.PRIO_PROCESS, pid) != wanted and time.monotonic() < deadline:
        time.sleep(0.01)
    return os.getpriority(os.PRIO_PROCESS, pid)


def descendants(pid: int) -> list[int]:
    """The living descendants of ``pid`` (from ``/proc``: Linux)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # gone meanwhile
                continue
            if fields[0] != "Z":
                parents.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(condition: object, timeout_s: float, what: str) -> None:
    """Poll ``condition()`` every 20 ms until true; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
