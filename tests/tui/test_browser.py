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
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def _chromium() -> Iterator[int]:
    """A headless Chromium until the block ends; yields its DevTools port."""
    profile = Path(tempfile.mkdtemp(prefix="kvtrace-chromium-"))
    browser = subprocess.Popen(
        [str(CHROMIUM), *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0",
         "--window-size=1400,900", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        active = profile / "DevToolsActivePort"
        end = time.monotonic() + 60
        while not (active.exists() and active.read_text().strip()) and time.monotonic() < end:
            time.sleep(0.2)
        yield int(active.read_text().split()[0])
    finally:
        os.killpg(browser.pid, 15)
        browser.wait(timeout=30)
        shutil.rmtree(profile, ignore_errors=True)


WANTED = ("kvtrace", "sample:tiny", "occupancy", "page map")


def test_served_dashboard_in_headless_chromium() -> None:
    import asyncio

    with served(["replay", "sample:tiny", "--tui"]) as server, _chromium() as debug_port:
        # The URL the server printed: the page and its socket need its token.
        text = asyncio.run(_page_text(debug_port, server.url, WANTED, 90))
        missing = [w for w in WANTED if w not in text]
        assert not missing, f"the page never showed {missing}; it received {len(text)} characters"


_HOP_BY_HOP = {"host", "connection", "upgrade", "keep-alive", "transfer-encoding", "te", "trailer",
               "proxy-authorization", "proxy-authenticate", "content-length", "content-encoding",
               "sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions", "sec-websocket-protocol"}


async def _reverse_proxy(upstream: int, prefix: str, seen: list[str]) -> tuple[object, int]:
    """A reverse proxy on a free loopback port that serves ``upstream``'s pages under
    ``prefix`` (``/kvtrace/x`` -> ``/x``), as nginx does by default: ``Host`` becomes the
    upstream's, the browser's goes in ``X-Forwarded-Host``. Web sockets are relayed both
    ways. Every path it forwards is appended to ``seen``."""
    import asyncio

    import aiohttp
    from aiohttp import web

    http = aiohttp.ClientSession(auto_decompress=False)

    async def forward(request: web.Request) -> web.StreamResponse:
        if not request.path.startswith(prefix):
            raise web.HTTPNotFound()
        path = request.path_qs[len(prefix) - 1:]
        seen.append(path)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        headers["X-Forwarded-Host"] = request.host
        url = f"http://127.0.0.1:{upstream}{path}"
        if request.headers.get("Upgrade", "").lower() == "websocket":
            async with http.ws_connect(url, headers=headers, max_msg_size=0) as back:
                front = web.WebSocketResponse(max_msg_size=0)
                await front.prepare(request)

                async def relay(src: object, dst: object) -> None:
                    async for msg in src:  # type: ignore[attr-defined]
                        if msg.type == aiohttp.WSMsgType.BINARY:
                            await dst.send_bytes(msg.data)  # type: ignore[attr-defined]
                        elif msg.type == aiohttp.WSMsgType.TEXT:
                            await dst.send_str(msg.data)  # type: ignore[attr-defined]
                    await dst.close()  # type: ignore[attr-defined]

                await asyncio.wait([asyncio.ensure_future(relay(front, back)), asyncio.ensure_future(relay(back, front))],
                                   return_when=asyncio.FIRST_COMPLETED)
                return front
        async with http.get(url, headers=headers) as resp:
            body = await resp.read()
            kept = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_BY_HOP}
            return web.Response(status=resp.status, body=body, headers=kept)

    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", forward)
    app.on_cleanup.append(lambda _: http.close())
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


def test_served_dashboard_behind_a_reverse_proxy_on_another_port() -> None:
    """The page names nothing by the server's own address: opened through a proxy on another
    port and under a path prefix, its script, stylesheet and socket all go through the proxy
    (before, the socket went to the server's port and was refused for its foreign origin)."""
    import asyncio

    async def through_proxy(server: object, debug_port: int) -> tuple[str, list[str]]:
        seen: list[str] = []
        runner, port = await _reverse_proxy(server.port, "/kvtrace/", seen)  # type: ignore[attr-defined]
        try:
            token = server.url.split("?token=", 1)[1]  # type: ignore[attr-defined]
            text = await _page_text(debug_port, f"http://127.0.0.1:{port}/kvtrace/?token={token}", WANTED, 90)
        finally:
            await runner.cleanup()  # type: ignore[attr-defined]
        return text, seen

    with served(["replay", "sample:tiny", "--tui"]) as server, _chromium() as debug_port:
        text, seen = asyncio.run(through_proxy(server, debug_port))
    missing = [w for w in WANTED if w not in text]
    assert not missing, f"the page never showed {missing}; it received {len(text)} characters; proxied {seen}"
    assert "/static/js/textual.js" in seen and any(p.startswith("/ws/") for p in seen), seen
