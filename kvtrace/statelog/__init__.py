"""The state log: a replay's step snapshots saved as an Arrow IPC file (``kvtrace replay --out``).

``log`` writes and reads it (``STATE_LOG_SCHEMA``, ``StateLogWriter``, the reader);
``format`` says whether a file is one, importable without numpy (``kvtrace info``);
``session`` reads a saved log back like a replay session (step, seek, fold) for the
dashboard and diff. Importing this package imports none of them.
"""
