"""Run sweep cells in local worker processes, as many at once as ``jobs``.

A ``multiprocessing`` pool of ``jobs`` spawned processes (spawned, not forked: a
worker imports torch and the allocator itself), each running one cell at a time;
rows come back as cells finish, in any order. Workers ignore Ctrl-C: the parent
takes it, terminates the pool and keeps what finished.
"""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvtrace.sweep.cells import run_cell
from kvtrace.sweep.grid import Cell

__all__ = ["run_local"]


def _ignore_interrupts() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def run_local(cells: Sequence[Cell], jobs: int, on_row: Callable[[dict[str, Any]], None]) -> None:
    """Run ``cells`` on ``jobs`` worker processes, calling ``on_row`` (in this process)
    with each row as its cell finishes.

    ``jobs`` 1 still runs the cells in a worker process: every cell sees the same
    fresh interpreter state whatever the number of workers.
    """
    if not cells:
        return
    context = multiprocessing.get_context("spawn")
    pool = context.Pool(processes=min(jobs, len(cells)), initializer=_ignore_interrupts)
    try:
        rows: Iterator[dict[str, Any]] = pool.imap_unordered(run_cell, cells, chunksize=1)
        for row in rows:
            on_row(row)
        pool.close()
    except BaseException:
        pool.terminate()
        raise
    finally:
        pool.join()
