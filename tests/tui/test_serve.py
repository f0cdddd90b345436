"""The served dashboard (``kvtrace replay TRACE --tui --serve PORT``) streams only to the
holder of the token it printed, from a page of the served host: a real server process, a
real HTTP / web socket client (aiohttp)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from urllib.parse import parse_qs, urlsplit

import aiohttp
import pytest

from kvtrace.tui.web.server import is_loopback, is_unspecified
from tests.tui.serving import Served, served


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    with served(["replay", "sample:tiny", "--tui"]) as running:
        yield running


def _token(server: Served) -> str:
    return parse_qs(urlsplit(server.url).query)["token"][0]


async def _status(url: str, **headers: str) -> int:
    async with aiohttp.ClientSession() as http, http.get(url, headers=headers) as resp:
        return resp.status


async def _socket_status(url: str, **kw: object) -> int:
    """The status of a web socket handshake at ``url`` (101 when it opened)."""
    async with aiohttp.ClientSession() as http:
        try:
            async with http.ws_connect(url, **kw):  # type: ignore[arg-type]
                return 101
        except aiohttp.WSServerHandshakeError as error:
            return error.status


@pytest.mark.slow
def test_the_printed_url_is_loopback_with_a_token(server: Served) -> None:
    parts = urlsplit(server.url)
    assert parts.hostname == "127.0.0.1" and parts.port == server.port
    assert len(_token(server)) >= 32


@pytest.mark.slow
def test_the_page_needs_the_token(server: Served) -> None:
    base = f"http://127.0.0.1:{server.port}/"
    assert asyncio.run(_status(base)) == 403
    assert asyncio.run(_status(base + "?token=wrong")) == 403
    assert asyncio.run(_status(base + "?token=" + _token(server)[:-1])) == 403
    assert asyncio.run(_status(server.url)) == 200


@pytest.mark.slow
def test_the_page_refuses_a_foreign_host_or_origin(server: Served) -> None:
    # A DNS-rebound name (evil.example.com -> 127.0.0.1) keeps the page's origin its own.
    assert asyncio.run(_status(server.url, Host=f"evil.example.com:{server.port}")) == 403
    assert asyncio.run(_status(server.url, Origin="http://evil.example.com")) == 403
    assert asyncio.run(_status(server.url, Origin=f"http://127.0.0.1:{server.port}")) == 200


@pytest.mark.slow
def test_the_socket_needs_the_token_and_the_served_origin(server: Served) -> None:
    origin = f"http://127.0.0.1:{server.port}"
    ws = f"ws://127.0.0.1:{server.port}/ws"
    token = _token(server)
    assert asyncio.run(_socket_status(ws, origin=origin)) == 403
    assert asyncio.run(_socket_status(f"{ws}/wrong", origin=origin)) == 403
    assert asyncio.run(_socket_status(f"{ws}/{token}", origin="http://evil.example.com")) == 403
    assert asyncio.run(_socket_status(f"{ws}/{token}", origin=f"http://localhost:{server.port}")) == 403
    assert asyncio.run(_socket_status(f"{ws}/{token}", origin=origin,
                                      headers={"Host": f"evil.example.com:{server.port}"})) == 403


async def _dashboard_text(server: Served, timeout_s: float) -> str:
    """Open the page as a browser would, then its socket; return what the dashboard sent
    once it shows its header (or when ``timeout_s`` ran out)."""
    origin = f"http://127.0.0.1:{server.port}"
    async with aiohttp.ClientSession() as http:
        async with http.get(server.url) as resp:
            assert resp.status == 200
            page = await resp.text()
        # Relative to the page (its script makes it ws: on the page's host), as is everything it loads.
        relative = page.split('data-session-websocket-url="', 1)[1].split('"', 1)[0]
        assert relative == f"ws/{_token(server)}"
        assert "127.0.0.1" not in page and 'href="static/' in page
        socket_url = f"ws://127.0.0.1:{server.port}/{relative}"
        text = ""
        async with http.ws_connect(socket_url + "?width=120&height=40", origin=origin) as ws:
            await ws.send_json(["resize", {"width": 120, "height": 40}])
            loop = asyncio.get_running_loop()
            end = loop.time() + timeout_s
            while "sample:tiny" not in text and loop.time() < end:
                try:
                    msg = await ws.receive(timeout=end - loop.time())
                except asyncio.TimeoutError:
                    break
                if msg.type == aiohttp.WSMsgType.BINARY:
                    text += msg.data.decode("utf-8", errors="replace")
                elif msg.type == aiohttp.WSMsgType.TEXT:
                    text += msg.data
                else:
                    break
        return text


@pytest.mark.slow
def test_the_token_and_served_origin_stream_the_dashboard(server: Served) -> None:
    # A bound on the whole exchange too: a socket that never closes fails here, never hangs.
    text = asyncio.run(asyncio.wait_for(_dashboard_text(server, 90), 120))
    assert "kvtrace" in text and "sample:tiny" in text, f"the dashboard never showed its header: {text[-500:]!r}"


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.8.0.1", True), ("localhost", True), ("::1", True), ("[::1]", True),
    ("0.0.0.0", False), ("evil.example.com", False), ("192.168.1.5", False),
])
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


@pytest.mark.slow
def test_a_busy_port_is_one_clear_line() -> None:
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "kvtrace", "replay", "sample:tiny", "--tui", "--serve", str(port)],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done
    assert done.stderr.strip().splitlines() == [
        f"kvtrace: error: port {port} on 127.0.0.1 is in use (another server?): pick another with --serve PORT"]
    assert "serving" not in done.stdout


@pytest.mark.parametrize(("host", "unspecified"), [
    ("0.0.0.0", True), ("::", True), ("[::]", True), ("", True), ("127.0.0.1", False), ("localhost", False),
])
def test_is_unspecified(host: str, unspecified: bool) -> None:
    assert is_unspecified(host) is unspecified
