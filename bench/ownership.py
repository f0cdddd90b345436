"""The page ownership query on a busy pool: time of the slot map, the screen cells, one
cell's pages and one request's slots, next to the full invariant walk.

Usage:
    python bench/ownership.py [TRACE] [--step N] [--cells N] [--repeat N]

Replays TRACE (default: the bundled one-hour Mooncake sample, a 920,000-slot pool) up to
step N (default 74,020, the hour's peak occupancy) with no checks, then times, median of
``--repeat`` runs (default 20): ``KvAllocator.slot_ownership()``, ``reduce_cells`` to
``--cells`` cells (default 400), ``cell_pages`` of the cell holding the most owners,
``request_slots`` of the longest live request, and ``check_integrity()`` (the full walk).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from allocator import create_allocator  # noqa: E402
from allocator.ownership import SlotState, cell_pages, reduce_cells, request_slots  # noqa: E402
from kvtrace.replay.config import allocator_config_for  # noqa: E402
from kvtrace.replay.engine import ReplayEngine, ReplayOptions  # noqa: E402
from traces.reader import TraceReader  # noqa: E402
from traces.samples import resolve_trace  # noqa: E402


def median_us(fn: object, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="?", default="sample:mooncake-conversation")
    ap.add_argument("--step", type=int, default=74_020)
    ap.add_argument("--cells", type=int, default=400)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    reader = TraceReader(resolve_trace(args.trace))
    alloc = create_allocator(allocator_config_for(reader.meta))
    t0 = time.perf_counter()
    engine = ReplayEngine(reader.steps(), reader.meta, alloc, ReplayOptions(check="never", stop_step=args.step + 1))
    engine.run()
    alloc.end_step()
    c = alloc.counters()
    print(f"trace {args.trace}: replayed to step {args.step} in {time.perf_counter() - t0:.1f} s; pool "
          f"{c.pool_tokens:,} slots (page {alloc.page_size}), {c.running_requests} requests, "
          f"{alloc.tree_cache.num_nodes():,} radix nodes")
    own = alloc.slot_ownership()
    counts = own.token_counts()
    print("slots per state: " + ", ".join(f"{SlotState(s).name.lower()} {int(n):,}" for s, n in enumerate(counts)))
    cells = reduce_cells(own, args.cells)
    owners_per_cell = [np.unique(own.owner[lo:hi][own.owner[lo:hi] >= 0]).shape[0]
                       for lo, hi in zip(cells.edges[:-1].tolist(), cells.edges[1:].tolist())]
    busiest = int(np.argmax(owners_per_cell))
    rids = alloc.live_rids()
    longest = int(rids[np.argmax(alloc.request_lens(rids).allocated)]) if rids.shape[0] else 0
    rows = [
        ("slot_ownership()", lambda: alloc.slot_ownership()),
        (f"reduce_cells(own, {args.cells})", lambda: reduce_cells(own, args.cells)),
        (f"cell_pages (cell {busiest}, {owners_per_cell[busiest]} owners)", lambda: cell_pages(own, cells, busiest)),
        (f"request_slots (rid {longest})", lambda: request_slots(alloc, longest)),
        ("check_integrity() (full walk)", lambda: alloc.check_integrity()),
    ]
    print(f"{'call':<44} {'median us':>12}")
    for name, fn in rows:
        print(f"{name:<44} {median_us(fn, args.repeat):>12,.0f}")


if __name__ == "__main__":
    main()
