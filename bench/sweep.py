"""Sweep throughput: cells per minute with 1 and 2 local workers, and through a local Ray.

Run: ``python bench/sweep.py [--cells N] [--duration 20s] [--jobs 1,2] [--no-ray]``

One grid of simulated cells (the Mooncake conversation trace's first ``--duration``
of arrivals, through the scheduler model, at ``--cells`` pool sizes from 60k tokens
up, page 16) is run into fresh outputs with each ``--jobs`` count (1 and 2 by
default), and as Ray tasks on a Ray instance started here (all cores). Each run's wall time covers
everything a user waits for: starting the workers (or Ray), the cells, the durable
parts and the merge. Printed: cells per minute of each, the scaling ratios against
the first count, Ray's cells per minute against the last count of plain processes,
and the load average before and after each run (other work on the machine slows
every figure).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MOONCAKE = ROOT / "traces" / "workloads_data" / "mooncake-fast25" / "conversation_trace.jsonl"


def _grid(cells: int, duration_s: float) -> object:
    from kvtrace.sweep import Grid, SweepInput, SweepSettings

    stat = MOONCAKE.stat()
    source = SweepInput(str(MOONCAKE), str(MOONCAKE), "mooncake", "simulate", f"{stat.st_size}-{stat.st_mtime_ns}")
    pools = tuple(60_000 + 20_000 * i for i in range(cells))
    return Grid(inputs=(source,), pool_tokens=pools, page_sizes=(16,), settings=SweepSettings(duration_s=duration_s))


def _run(label: str, grid: object, directory: Path, *, jobs: int = 1, ray: str | None = None) -> dict[str, float]:
    from kvtrace.outputs import OutputFile
    from kvtrace.sweep import run_sweep

    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    outcome = run_sweep(grid, OutputFile(directory / f"{label}.parquet"), jobs=jobs, ray=ray)  # type: ignore[arg-type]
    wall = time.perf_counter() - t0
    assert outcome.failed == 0 and outcome.done == outcome.cells, outcome
    cell_s = outcome.table.column("cell_wall_s").to_pylist()
    figures = {
        "cells": outcome.cells,
        "wall_s": wall,
        "cells_per_min": 60.0 * outcome.cells / wall,
        "mean_cell_s": sum(cell_s) / len(cell_s),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }
    print(
        f"{label:>10}: {outcome.cells} cells in {wall:6.1f} s = {figures['cells_per_min']:5.1f} cells/min "
        f"(a cell {figures['mean_cell_s']:.1f} s inside its worker)  load average {load_before:.1f} -> "
        f"{figures['load_after']:.1f}",
        flush=True,
    )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=8, help="cells in the grid (pool sizes)")
    parser.add_argument("--duration", default="20s", help="arrivals of each cell's simulation")
    parser.add_argument("--jobs", default="1,2", help="local worker counts to run, comma-separated (the first is the base)")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray run")
    args = parser.parse_args()
    from traces.workloads import parse_duration

    grid = _grid(args.cells, parse_duration(args.duration))
    print(f"{os.cpu_count()} cores; grid: {args.cells} simulated cells, Mooncake first {args.duration}, page 16")
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        counts = [int(j) for j in args.jobs.split(",")]
        runs = {j: _run(f"{j} worker{'s' if j > 1 else ''}", grid, directory, jobs=j) for j in counts}
        base = runs[counts[0]]
        for j in counts[1:]:
            print(f"scaling {counts[0]} -> {j} workers: {runs[j]['cells_per_min'] / base['cells_per_min']:.2f}x")
        two = runs[counts[-1]]
        if not args.no_ray:
            try:
                import ray  # noqa: F401
            except ImportError:
                print("Ray is not installed (pip install 'kvtrace[ray]'): no Ray figure")
                return
            ray_figures = _run("local Ray", grid, directory, ray="local")
            print(
                f"local Ray (all cores, start-up included) against {counts[-1]} worker processes: "
                f"{ray_figures['cells_per_min'] / two['cells_per_min']:.2f}x the cells per minute "
                f"({ray_figures['wall_s'] - two['wall_s']:+.1f} s)"
            )


if __name__ == "__main__":
    main()
