"""Child processes kvtrace runs itself, and what crosses to them: ``contracts`` (the
jobs, messages and commands, typed, one serialisation each), ``channel`` (the one
framing: ``multiprocessing.connection.Connection`` over a pipe) and ``child``
(``python -m kvtrace.proc.child``: one version replaying one trace, a diff side or the
dashboard's replay). Importing this package imports nothing.
"""
