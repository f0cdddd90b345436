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
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import aiohttp_jinja2
import jinja2
from aiohttp import web
from textual_serve.server import Server, to_int

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

__all__ = ["DashboardServer", "is_loopback"]

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
        """The URL to open: the page, with the token."""
        return f"{self.public_url}/?token={self.token}"

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
        if origin is not None and origin.rstrip("/").lower() != f"{request.scheme}://{host}".lower():
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
        """The page: the terminal, pointed at this run's socket."""
        router = request.app.router
        socket_url = f"{self.public_url}{router['websocket'].url_for(token=self.token)}"
        scheme = "wss:" if socket_url.startswith("https:") else "ws:"
        context: dict[str, Any] = {
            "font_size": to_int(request.query.get("fontsize", "16"), 16),
            "app_websocket_url": scheme + socket_url.split(":", 1)[1],
            "config": {"static": {"url": f"{self.public_url}{router['static'].url_for(filename='/')}".rstrip("/") + "/"}},
            "application": {"name": self.title},
        }
        response = aiohttp_jinja2.render_template("app_index.html", request, context)
        # The page holds the token in its URL: keep it out of the Referer of what it loads.
        response.headers["Referrer-Policy"] = "no-referrer"
        return response

    async def on_startup(self, app: web.Application) -> None:
        self.console.print(f"kvtrace: serving the dashboard on {self.page_url}", markup=False, highlight=False,
                           soft_wrap=True)
        self.console.print("(the token in this URL is the key to the dashboard; Ctrl+C to stop)", markup=False,
                           highlight=False)
