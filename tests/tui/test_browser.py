"""The dashboard served as a web page (``kvtrace replay TRACE --tui --serve PORT``) and
opened in a real headless Chromium: the page shows the header and the occupancy panel.

Needs the operating system's Chromium at /usr/bin/chromium (CI installs it); skipped
with the reason when it is absent.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
KVTRACE = Path(sys.executable).parent / "kvtrace"
# Without the background-networking flags Chromium keeps calling out to a closed network.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium (apt-get install -y chromium)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_listening(port: int, proc: subprocess.Popen, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}: {proc.stdout.read() if proc.stdout else ''}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port} after {timeout_s} s")


def test_served_dashboard_in_headless_chromium() -> None:
    port = _free_port()
    server = subprocess.Popen(
        [str(KVTRACE), "replay", "sample:tiny", "--tui", "--serve", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    profile = tempfile.mkdtemp(prefix="kvtrace-chromium-")
    try:
        _wait_listening(port, server, 90)
        # The page's script connects a websocket and the app draws into the DOM; a virtual
        # time budget lets that run before the DOM is dumped.
        out = subprocess.run(
            [str(CHROMIUM), *FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=60000",
             "--run-all-compositor-stages-before-draw", "--dump-dom", f"http://127.0.0.1:{port}/"],
            capture_output=True, text=True, timeout=120,
        )
        dom = out.stdout
        assert "kvtrace" in dom and "sample:tiny" in dom, dom[-3000:]
        assert "occupancy" in dom, dom[-3000:]
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)
        shutil.rmtree(profile, ignore_errors=True)
