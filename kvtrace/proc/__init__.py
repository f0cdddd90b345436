"""Child processes kvtrace runs itself: ``child`` is ``python -m kvtrace.proc.child``, one
version replaying one trace (a diff side, or the dashboard's replay) and streaming its
records to the parent over a pipe (``pipe_writer``: whole writes). Importing this package
imports nothing.
"""
