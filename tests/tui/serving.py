"""Helpers for the tests of the served dashboard: start a real ``kvtrace ... --serve PORT``
process on a free loopback port and read the URL (with its token) that it prints."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

_URL = re.compile(r"http://\S+/\?token=[\w-]+")


class Served(NamedTuple):
    """A running server: its process, port and the URL it printed."""

    proc: subprocess.Popen[bytes]
    port: int
    url: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def served(args: list[str], timeout_s: float = 90.0) -> Iterator[Served]:
    """Run ``python -m kvtrace *args --serve PORT`` until the block ends (SIGTERM to its
    process group); yields once it printed its URL and listens."""
    port = free_port()
    out_dir = Path(tempfile.mkdtemp(prefix="kvtrace-serve-"))
    out_path = out_dir / "stdout"
    with out_path.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvtrace", *args, "--serve", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        end = time.monotonic() + timeout_s
        url = None
        while url is None:
            text = out_path.read_text(errors="replace")
            if proc.poll() is not None:
                raise AssertionError(f"the server exited with {proc.returncode}: {text}")
            if time.monotonic() > end:
                raise AssertionError(f"no URL printed after {timeout_s} s: {text!r}")
            found = _URL.search(text)
            if found:
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", port)) == 0:
                        url = found.group(0)
                        break
            time.sleep(0.2)
        yield Served(proc, port, url)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        out_path.unlink(missing_ok=True)
        out_dir.rmdir()
