"""The dashboard's replay process: ``python -m kvtrace.tui.remote.process JOB_JSON CONTROL_FD``.

``kvtrace.proc.child``'s process (the job's ``allocator`` installed first, the records on
stdout, messages on ``CONTROL_FD``, errors reported as one line) running a dashboard job
(``replayer.dashboard_job`` / ``log_job``): a ``Replayer`` that also takes the screen's
commands on stdin. Started by ``link.ChildReplay``; the child module is handed this body
rather than importing the dashboard, which sits above it. Like the child's own body,
this imports nothing that imports ``allocator`` before ``main`` has installed the job's.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import IO, Any, BinaryIO

from kvtrace.proc.child import main

__all__ = ["run", "run_dashboard_job"]


def run(job: dict[str, Any], out: BinaryIO, control: IO[str]) -> None:
    """``kvtrace.proc.child.main``'s body for a dashboard job: its commands come on stdin."""
    run_dashboard_job(job, out, control, sys.stdin.buffer)


def run_dashboard_job(job: dict[str, Any], out: BinaryIO, control: IO[str], commands: BinaryIO) -> None:
    """The body of a dashboard's replay process: set the source up, then ``Replayer.run``.

    Raises:
        KvtraceError, TraceError: bad input (``kvtrace.proc.child.main`` reports it as one line).
    """
    import signal

    from kvtrace.tui.remote.link import PipeEnd
    from kvtrace.tui.remote.replayer import Replayer, job_source

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the screen decides when this process ends
    settings = job["dashboard"]
    source = job_source(job)
    try:
        end = PipeEnd(out, control, commands)
        replayer = Replayer(source, end, play=bool(settings.get("play", True)))
        try:
            if settings.get("profile"):
                _profiled(replayer.run, settings["profile"])
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
