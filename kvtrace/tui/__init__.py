"""The live dashboard: a Textual app over a replay session or a saved state log.

Imported only when a dashboard is asked for (``kvtrace replay --tui``, ``kvtrace view``):
the CLI never imports Textual otherwise. ``kvtrace.tui.run`` holds the entries the
commands use; ``app.KvtraceApp`` is the app; ``driver.ReplayDriver`` runs the replay
in the app's thread worker; ``widgets/`` are the panels.
"""
