"""The real ``kvtrace`` entry point in a pseudo-terminal: the dashboard starts, steps on
→, and quits with q (exit 0)."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

KVTRACE = Path(sys.executable).parent / "kvtrace"

pytestmark = pytest.mark.slow  # the real CLI in a pseudo-terminal


def _read_until(fd: int, needle: bytes, timeout_s: float, seen: bytearray) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                return needle in seen
            if not chunk:
                return needle in seen
            seen.extend(chunk)
            if needle in seen:
                return True
    return needle in seen


def test_kvtrace_replay_tui_in_a_terminal_steps_and_quits() -> None:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 140, 0, 0))
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "140", "LINES": "40"}
    proc = subprocess.Popen(
        [str(KVTRACE), "replay", "sample:tiny", "--tui"],
        stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True, start_new_session=True,
    )
    os.close(slave)
    seen = bytearray()
    try:
        assert _read_until(master, b"sample:tiny", 90, seen), bytes(seen[-2000:])
        os.write(master, b" ")  # pause (it starts playing; on a loaded machine it may be done first)
        assert _read_until(master, b"paused", 30, seen) or b"done" in seen, bytes(seen[-2000:])
        os.write(master, b"\x1b[C")  # → one step
        assert _read_until(master, b"step", 30, seen), bytes(seen[-2000:])
        time.sleep(0.5)
        os.write(master, b"q")
        end = time.monotonic() + 90  # exiting closes the replay process (torch) and the screen
        while proc.poll() is None and time.monotonic() < end:
            _read_until(master, b"\x00never", 0.5, seen)  # keep draining the terminal
        proc.wait(timeout=1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    assert proc.returncode == 0, bytes(seen[-2000:])


def test_kvtrace_replay_tui_says_it_starts_and_quits_on_ctrl_c() -> None:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "80", "LINES": "24"}
    proc = subprocess.Popen(
        [str(KVTRACE), "replay", "sample:tiny", "--tui"],
        stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True, start_new_session=True,
    )
    os.close(slave)
    seen = bytearray()
    try:
        # A word before the dashboard's first frame, not a blank terminal while the replay starts.
        assert _read_until(master, "starting the replay".encode(), 60, seen), bytes(seen[-2000:])
        assert _read_until(master, b"sample:tiny", 90, seen), bytes(seen[-2000:])
        time.sleep(0.5)
        os.write(master, b"\x03")  # Ctrl+C: a key in the dashboard's raw terminal
        end = time.monotonic() + 90
        while proc.poll() is None and time.monotonic() < end:
            _read_until(master, b"\x00never", 0.5, seen)
        proc.wait(timeout=1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    assert proc.returncode == 0, bytes(seen[-2000:])
