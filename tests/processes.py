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
