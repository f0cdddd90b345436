"""The dashboard served as a web page (``kvtrace replay TRACE --tui --serve PORT``) and
opened, at the URL with the token it printed, in a real headless Chromium driven over the
DevTools protocol: the page's terminal receives the header and the occupancy panel.

Needs the operating system's Chromium at /usr/bin/chromium (CI installs it); skipped
with the reason when it is absent.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.tui.serving import served

CHROMIUM = Path("/usr/bin/chromium")
# Without the background-networking flags Chromium keeps calling out to a closed network.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = [pytest.mark.slow,  # a browser
              pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium (apt-get install -y chromium)")]


# Recorded before the page's own scripts run: what the dashboard sends to the page (its
# screen, as terminal text) over the websocket, which xterm then draws on a canvas.
_RECORD_SCREEN = """
(() => {
  const Native = window.WebSocket;
  const decoder = new TextDecoder();
  window.__kvtraceScreen = "";
  function Recording(...args) {
    const ws = new Native(...args);
    ws.addEventListener("message", async (event) => {
      let data = event.data;
      if (typeof data === "string") { window.__kvtraceScreen += data; return; }
      if (data instanceof Blob) data = await data.arrayBuffer();
      window.__kvtraceScreen += decoder.decode(new Uint8Array(data), {stream: true});
    });
    return ws;
  }
  Recording.prototype = Native.prototype;
  Object.assign(Recording, {CONNECTING: 0, OPEN: 1, CLOSING: 2, CLOSED: 3});
  window.WebSocket = Recording;
})();
"""


async def _page_text(debug_port: int, url: str, wanted: tuple[str, ...], timeout_s: float) -> str:
    """Drive the browser over the DevTools protocol: open ``url`` and return what the page
    received once it holds every ``wanted`` string (or when ``timeout_s`` ran out)."""
    import asyncio
    import json

    import aiohttp

    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{debug_port}/json/list") as resp:
            pages = [t for t in await resp.json() if t.get("type") == "page"]
        async with http.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            ids = iter(range(1, 1_000_000))

            async def call(method: str, **params: object) -> dict:
                mid = next(ids)
                await ws.send_str(json.dumps({"id": mid, "method": method, "params": params}))
                async for msg in ws:
                    data = json.loads(msg.data)
                    if data.get("id") == mid:
                        return data.get("result", {})
                raise AssertionError("the browser closed the DevTools connection")

            await call("Page.enable")
            await call("Page.addScriptToEvaluateOnNewDocument", source=_RECORD_SCREEN)
            await call("Page.navigate", url=url)
            end = asyncio.get_running_loop().time() + timeout_s
            text = ""
            while asyncio.get_running_loop().time() < end:
                result = await call("Runtime.evaluate", expression="window.__kvtraceScreen || ''")
                text = result.get("result", {}).get("value", "")
                if all(w in text for w in wanted):
                    break
                await asyncio.sleep(0.5)
            return text


def test_served_dashboard_in_headless_chromium() -> None:
    import asyncio

    profile = Path(tempfile.mkdtemp(prefix="kvtrace-chromium-"))
    browser = None
    try:
        with served(["replay", "sample:tiny", "--tui"]) as server:
            browser = subprocess.Popen(
                [str(CHROMIUM), *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0",
                 "--window-size=1400,900", "about:blank"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            )
            active = profile / "DevToolsActivePort"
            end = time.monotonic() + 60
            while not (active.exists() and active.read_text().strip()) and time.monotonic() < end:
                time.sleep(0.2)
            debug_port = int(active.read_text().split()[0])
            wanted = ("kvtrace", "sample:tiny", "occupancy", "page map")
            # The URL the server printed: the page and its socket need its token.
            text = asyncio.run(_page_text(debug_port, server.url, wanted, 90))
            missing = [w for w in wanted if w not in text]
            assert not missing, f"the page never showed {missing}; it received {len(text)} characters"
    finally:
        if browser is not None:
            os.killpg(browser.pid, 15)
            browser.wait(timeout=30)
        shutil.rmtree(profile, ignore_errors=True)
