"""Run sweep cells in local worker processes, as many at once as ``jobs``.

A ``multiprocessing`` pool of ``jobs`` spawned processes (spawned, not forked: a
worker imports torch and the allocator itself), each running one cell at a time;
rows come back as cells finish, in any order. A worker runs one thread (numpy,
torch): the cells are the parallelism. Workers ignore Ctrl-C: the parent takes it,
terminates the pool and keeps what finished.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvtrace.sweep.cells import run_cell
from kvtrace.sweep.grid import Cell
from traces import lifeline

__all__ = ["run_local"]


# One thread per worker: the sweep's parallelism is across cells (Ray sets the same
# for its one-CPU tasks); set before the worker imports numpy or torch.
_THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def _init_worker(tie: tuple[int, bool]) -> None:
    # Ctrl-C is the parent's; the worker dies with the parent (traces.lifeline).
    parent = multiprocessing.parent_process()
    lifeline.settle(tie[0], parent.sentinel if parent is not None else None, tie[1])
    for name in _THREAD_VARIABLES:
        os.environ.setdefault(name, "1")


def run_local(cells: Sequence[Cell], jobs: int, on_row: Callable[[dict[str, Any]], None]) -> None:
    """Run ``cells`` on ``jobs`` worker processes, calling ``on_row`` (in this process)
    with each row as its cell finishes.

    ``jobs`` 1 still runs the cells in a worker process: every cell sees the same
    fresh interpreter state whatever the number of workers.
    """
    if not cells:
        return
    context = multiprocessing.get_context("spawn")
    with lifeline.quiet_start():
        pool = context.Pool(processes=min(jobs, len(cells)), initializer=_init_worker, initargs=(lifeline.parent_tie(),))
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
