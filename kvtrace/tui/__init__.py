"""The live dashboard: a Textual app over a replay session or a saved state log.

Imported only when a dashboard is asked for (``kvtrace replay --tui``, ``kvtrace view``):
the CLI never imports Textual otherwise. ``kvtrace.tui.run`` holds the entries the
commands use; ``app.KvtraceApp`` is the app; the replay runs in a process of its own
(``remote.replayer.Replayer`` behind ``remote.link.ChildReplay``) and ``driver.Driver``, in a thread
worker of the app, folds what it sends into frames; ``widgets/`` are the panels.
"""
