"""The dashboard's web server: textual-serve's, guarded.

A trace reveals a service's traffic, and any web page open in the user's browser can reach a
port on 127.0.0.1. So the page and its web socket answer only a request that

- carries this run's random token (``/?token=T`` for the page, ``/ws/T`` for the socket: the
  page's script appends its own ``?width=…`` to the socket's URL, so the token is a path
  segment there);
- comes from a page of the served host, when the browser says where it comes from (a
  cross-site page's ``Origin`` differs from the ``Host`` it talks to);
- names a loopback host when the server listens on one (a DNS-rebound name such as
  ``evil.example.com`` resolving to 127.0.0.1 is refused).

Anything else is 403. The static files (the terminal's script, stylesheet and font) are public;
a download (``/download/KEY``) is reached by its own random key, which only the socket tells.

The page names what it loads by URLs relative to its own (``static/…``, ``ws/T``; its script
turns the latter into ``ws:``/``wss:`` on the page's host), never by the address the server
listens on: behind ``ssh -L 9123:127.0.0.1:8123``, a reverse proxy on another port or path,
or ``--host 0.0.0.0``, the browser reaches everything where it reached the page. A proxy that
rewrites ``Host`` keeps the browser's in ``X-Forwarded-Host``, which the ``Origin`` check
accepts too (a page's script cannot set that header on a socket, and the token is still needed).
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import ipaddress
import secrets
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import aiohttp_jinja2
import jinja2
from aiohttp import web
from textual_serve.server import Server, to_int

from kvtrace.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

__all__ = ["DashboardServer", "is_loopback", "is_unspecified"]

_TEMPLATES = Path(__file__).parent


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 with or without brackets) is this machine
    only: ``localhost`` or a loopback address."""
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_unspecified(host: str) -> bool:
    """Whether ``host`` means every address of this machine (``0.0.0.0``, ``::``, or empty)."""
    host = host.strip("[]")
    if not host:
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def _netloc(url_or_host: str, scheme: str) -> str:
    """``host:port`` of a URL or a ``Host`` value, lower case, the scheme's default port
    filled in (``http://a`` and ``a:80`` name the same place)."""
    parts = urlsplit(url_or_host if "//" in url_or_host else f"//{url_or_host}")
    default = 443 if (parts.scheme or scheme) in ("https", "wss") else 80
    try:
        port = parts.port or default
    except ValueError:
        port = -1
    return f"{(parts.hostname or '').lower()}:{port}"


class DashboardServer(Server):
    """Serve the dashboard (``command``, run once per browser connection) on ``host:port``
    to the holders of ``token`` (a new random one by default).

    Args:
        command: the shell command each connection runs (``kvtrace.tui.run.serve_command``).
        host: the address to listen on.
        port: the port to listen on.
        token: the run's secret; the URL printed at start-up carries it.
    """

    def __init__(self, command: str, *, host: str, port: int, token: str | None = None) -> None:
        super().__init__(command, host=host, port=port, title="kvtrace", templates_path=str(_TEMPLATES))
        self.token = token or secrets.token_urlsafe(24)

    @property
    def page_url(self) -> str:
        """The URL to open on this machine: the page, with the token (the loopback address
        where the server listens on every address: ``http://0.0.0.0:…`` opens nothing)."""
        base = f"http://127.0.0.1:{self.port}" if is_unspecified(self.host) else self.public_url
        return f"{base}/?token={self.token}"

    def serve(self, debug: bool = False) -> None:
        """Serve until SIGINT or SIGTERM; the URL is printed once the port is bound.

        Raises:
            ConfigError: the port is taken or the address is not this machine's.
        """
        self.debug = debug
        self.initialize_logging()
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self.request_exit)
        try:
            web.run_app(self._make_app(), host=self.host, port=self.port, handle_signals=False, loop=loop,
                        print=lambda *_: self._announce())
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise ConfigError(f"port {self.port} on {self.host} is in use (another server?): "
                                  "pick another with --serve PORT") from None
            if error.errno in (errno.EADDRNOTAVAIL, errno.EACCES):
                raise ConfigError(f"cannot listen on {self.host} port {self.port}: {error.strerror}") from None
            raise

    async def _make_app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard])
        aiohttp_jinja2.setup(app, loader=jinja2.FileSystemLoader(self.templates_path))
        app.add_routes([
            web.get("/", self.handle_index, name="index"),
            web.get("/ws/{token}", self.handle_websocket, name="websocket"),
            web.get("/download/{key}", self.handle_download, name="download"),
            web.static("/static", self.statics_path, name="static"),
        ])
        app.on_startup.append(self.on_startup)
        return app

    def _refusal(self, request: web.Request) -> str | None:
        """Why ``request`` is refused, or None to let it through."""
        host = request.host
        hostname = urlsplit(f"//{host}").hostname or ""
        if is_loopback(self.host) and not is_loopback(hostname):
            return f"the dashboard listens on {self.host}: Host {host!r} is not this machine"
        origin = request.headers.get("Origin")
        if origin is not None:
            served = {_netloc(host, request.scheme)}
            forwarded = request.headers.get("X-Forwarded-Host", "").split(",")[0].strip()
            if forwarded:
                served.add(_netloc(forwarded, request.headers.get("X-Forwarded-Proto", request.scheme)))
            if _netloc(origin, request.scheme) not in served:
                return f"a page of {origin} may not open the dashboard of {host}"
        if request.path == "/":
            given = request.query.get("token", "")
        elif request.path == "/ws" or request.path.startswith("/ws/"):
            given = request.match_info.get("token", "")
        else:
            return None
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            return "a wrong or missing token: open the URL kvtrace printed"
        return None

    @web.middleware
    async def _guard(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        why = self._refusal(request)
        if why is not None:
            raise web.HTTPForbidden(text=f"kvtrace: {why}\n")
        return await handler(request)

    async def handle_index(self, request: web.Request) -> web.Response:  # type: ignore[override]
        """The page: the terminal, pointed at this run's socket, every URL relative to the
        page's own (the page is ``/``: ``static/…`` and ``ws/T`` sit beside it, behind a
        proxy's path prefix too)."""
        context: dict[str, Any] = {
            "font_size": to_int(request.query.get("fontsize", "16"), 16),
            "app_websocket_url": f"ws/{self.token}",
            "config": {"static": {"url": "static/"}},
            "application": {"name": self.title},
        }
        response = aiohttp_jinja2.render_template("app_index.html", request, context)
        # The page holds the token in its URL: keep it out of the Referer of what it loads.
        response.headers["Referrer-Policy"] = "no-referrer"
        return response

    async def on_startup(self, app: web.Application) -> None:
        """Nothing to say yet: the port is not bound (``_announce`` speaks once it is)."""

    def _announce(self) -> None:
        say = self.console.print
        say(f"kvtrace: serving the dashboard on {self.page_url}", markup=False, highlight=False, soft_wrap=True)
        if is_unspecified(self.host):
            say("(listening on every address of this machine: from elsewhere, put its name in place of 127.0.0.1)",
                markup=False, highlight=False)
        say("(the token in this URL is the key to the dashboard; Ctrl+C to stop)", markup=False, highlight=False)
