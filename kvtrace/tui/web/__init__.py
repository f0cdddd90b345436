"""The dashboard as a web page: a textual-serve server that only streams the dashboard to
a browser holding this run's token, from a page of the served host (``server``), and the
page's template (``app_index.html``)."""

from __future__ import annotations

from kvtrace.tui.web.server import DashboardServer

__all__ = ["DashboardServer"]
