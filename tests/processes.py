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


def run_with_terminal_stderr(args: list[str], timeout_s: float = 120.0) -> tuple[int, str, str]:
    """Run ``args`` with stderr on a pseudo-terminal (as in an interactive shell) and
    stdout on a pipe (as under ``| jq``).

    Returns:
        The exit code, stdout, and everything the process wrote to the terminal.
    """
    import pty
    import select
    import subprocess

    master, slave = pty.openpty()
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "120"}
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    drawn = bytearray()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the process closed its end
                break
            if not data:
                break
            drawn += data
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return proc.returncode, out.decode(), drawn.decode(errors="replace")
