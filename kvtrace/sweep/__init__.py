"""What-if grids: many simulations or replays, one Parquet row each.

``run_sweep(grid, target, jobs=…, ray=…)`` runs every cell of a ``Grid`` (local
worker processes, or Ray tasks on a cluster), writes each finished cell durably
(``ResultStore``: a rerun skips what finished) and merges them into one Parquet
file; ``kvtrace.sweep.report`` reads it back as a table and plots.

Modules: ``grid`` (cells and the options that make them), ``cells`` (one cell ->
one row), ``store`` (durable parts, the merge), ``claim`` (one sweep at a time per
output), ``local`` and ``ray_runner`` (the two engines), ``report`` (table and plots).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtrace.errors import OutputError
from kvtrace.sweep.cells import FOUND
from kvtrace.sweep.claim import claim
from kvtrace.sweep.grid import (
    Cell,
    Grid,
    SweepInput,
    SweepSettings,
    parse_counts,
    parse_hicache_ratios,
    parse_ratios,
    parse_specs,
)
from kvtrace.sweep.store import ResultStore, parts_dir

if TYPE_CHECKING:
    import pyarrow as pa

    from kvtrace.outputs import OutputFile

__all__ = [
    "Cell",
    "Grid",
    "ResultStore",
    "SweepInput",
    "SweepOutcome",
    "SweepSettings",
    "parse_counts",
    "parse_hicache_ratios",
    "parse_ratios",
    "parse_specs",
    "parts_dir",
    "run_sweep",
]


@dataclass(frozen=True)
class SweepOutcome:
    """What a sweep did.

    Attributes:
        cells: cells in the grid.
        done: cells finished ``ok``, clean (this run or an earlier one).
        found: cells that ran and whose check found something: violations, an
            out-of-memory that stopped the replay, bad ops (their rows say what).
        failed: cells that could not run (their rows say why).
        resumed: cells an earlier, interrupted run had finished (not run again).
        wall_s: this run's wall time.
        table: the rows written, in grid order.
    """

    cells: int
    done: int
    found: int
    failed: int
    resumed: int
    wall_s: float
    table: pa.Table

    def to_dict(self, out: str) -> dict[str, Any]:
        """The ``kvtrace sweep --json`` object."""
        return {
            "out": out,
            "cells": self.cells,
            "done": self.done,
            "found": self.found,
            "failed": self.failed,
            "resumed": self.resumed,
            "wall_s": self.wall_s,
            "cells_per_min": 60.0 * (self.cells - self.resumed) / self.wall_s if self.wall_s > 0 else None,
        }


def run_sweep(
    grid: Grid,
    target: OutputFile,
    *,
    jobs: int = 1,
    ray: str | None = None,
    on_start: Callable[[int, int], None] | None = None,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> SweepOutcome:
    """Run every cell of ``grid`` not finished yet and write the results to ``target``.

    Args:
        grid: the cells.
        target: the Parquet output (checked against the inputs already).
        jobs: local worker processes (ignored with ``ray``).
        ray: a Ray cluster address (``auto``, ``HOST:PORT``, ``local``), or None.
        on_start: called with (cells to run, cells already done) before any runs.
        on_row: called with each row as its cell finishes (after it is on disk).

    Raises:
        OutputError: a result cannot be written, another process is writing it
            (``kvtrace.sweep.claim``), or it appeared meanwhile (without ``force``).
        ConfigError: Ray is asked for and cannot be had.
    """
    from kvtrace.sweep.local import run_local

    if ray is not None:
        from kvtrace.sweep.ray_runner import check_reachable, require_ray

        require_ray()  # before anything is written
        check_reachable(ray)
    t0 = time.perf_counter()
    cells = grid.cells()
    keys = [cell.key for cell in cells]
    with claim(target.path, option=target.option):
        # Checked again now that this process owns the output: a sweep that held it
        # may have finished it since ``target`` was checked.
        if target.path.exists() and not target.force:
            raise OutputError(f"{target.option} {target.path} already exists; pass --force to overwrite it")
        store = ResultStore(target.path)
        finished = store.finished(keys)
        todo = [cell for cell in cells if cell.key not in finished]
        if on_start is not None:
            on_start(len(todo), len(finished))

        def record(row: dict[str, Any]) -> None:
            store.write(row)
            if on_row is not None:
                on_row(row)

        if ray is not None:
            from kvtrace.sweep.ray_runner import run_ray

            run_ray(todo, ray, record)
        else:
            run_local(todo, jobs, record)
        table = store.merge(keys, target)
    statuses = table.column("status").to_pylist() if table.num_rows else []
    return SweepOutcome(
        cells=len(cells),
        done=statuses.count("ok"),
        found=sum(statuses.count(s) for s in FOUND),
        failed=statuses.count("failed"),
        resumed=len(finished),
        wall_s=time.perf_counter() - t0,
        table=table,
    )
