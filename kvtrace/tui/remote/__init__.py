"""The dashboard's replay side, and how the screen talks to it; none of it imports Textual.

``replayer`` runs a source (``sources``: a live replay session or a saved state log),
obeys the screen's commands and streams the steps it replays (``updates``: how they
travel) with the page map (``pagemap``); ``link`` connects the screen to it, in a
process of its own (``process``: ``python -m kvtrace.tui.remote.process``) or in a
thread. An import-linter contract (``pyproject.toml``) keeps Textual out of this package.
Importing this package imports none of them.
"""
