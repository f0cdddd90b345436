"""The dashboard's replay process: ``python -m kvtrace.tui.remote.process JOB_JSON CONTROL_FD``.

``kvtrace.proc.child``'s process (the job's ``allocator`` installed first, the records on
stdout, messages on ``CONTROL_FD``, errors reported as one line) running a dashboard job
(``kvtrace.proc.contracts.DashboardJob``: ``replayer.dashboard_job`` / ``log_job``): a
``Replayer`` that also takes the screen's commands (``Command``) on stdin, a
``Connection`` as the other two (``link.PipeEnd``). Started by ``link.ChildReplay``; the child module is handed this body
rather than importing the dashboard, which sits above it. Like the child's own body,
this imports nothing that imports ``allocator`` before ``main`` has installed the job's.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvtrace.proc.channel import connection
from kvtrace.proc.child import main

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from kvtrace.proc.contracts import DashboardJob

__all__ = ["run", "run_dashboard_job"]


def run(job: DashboardJob, out: Connection, control: Connection) -> None:
    """``kvtrace.proc.child.main``'s body for a dashboard job: its commands come on stdin."""
    run_dashboard_job(job, out, control, connection(os.dup(sys.stdin.fileno()), writable=False))


def run_dashboard_job(job: DashboardJob, out: Connection, control: Connection, commands: Connection) -> None:
    """The body of a dashboard's replay process: set the source up, then ``Replayer.run``.

    Raises:
        KvtraceError, TraceError: bad input (``kvtrace.proc.child.main`` reports it as one line).
    """
    import signal

    from kvtrace.tui.remote.link import PipeEnd
    from kvtrace.tui.remote.replayer import Replayer, job_source

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the screen decides when this process ends
    source = job_source(job)
    try:
        end = PipeEnd(out, control, commands)
        # a state log (kvtrace view) opens on its first step
        replayer = Replayer(source, end, play=job.play, open_at_first=job.state_log is not None)
        try:
            if job.profile:
                _profiled(replayer.run, job.profile)
            else:
                replayer.run()
        finally:
            end.close()
    finally:
        source.close()


def _profiled(body: Callable[[], None], path: str) -> None:
    """Run ``body`` under cProfile, timed in CPU seconds of this process (what the replay
    costs, not what it waits for), and save its statistics to ``path`` (bench/tui.py's
    ``--profile-replay``)."""
    import cProfile

    profile = cProfile.Profile(time.process_time)
    try:
        profile.runcall(body)
    finally:
        profile.dump_stats(path)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(run=run))
