"""KV events: a replay writing SGLang's events to a file against a plain replay of the same trace.

Usage:
    python bench/kv_events.py [TRACE ...] [--page-size N ...] [--repeat R]

Each trace (default: the one-hour Mooncake sample, page size 1 as recorded, and the
bundled Mooncake tiny sample at page sizes 1 and 16) is replayed ``R`` times plainly and
``R`` times with its events written to a file (what ``kvtrace replay --kv-events FILE``
does), taking turns, in this process. Prints the median wall time of each, their ratio
(target <= 1.5x), the batches, blocks stored and removed, and the file's size.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvtrace.events.emit import Emitter  # noqa: E402
from kvtrace.events.wire import EventFileWriter  # noqa: E402
from kvtrace.replay.session import ReplaySession  # noqa: E402

DEFAULT_CASES = [("sample:mooncake-conversation", None), ("sample:mooncake-tiny", 1), ("sample:mooncake-tiny", 16)]


def _plain(trace: str, page_size: int | None) -> float:
    with ReplaySession(trace, page_size=page_size) as session:
        t0 = time.perf_counter()
        for _ in session.snapshots():
            pass
        return time.perf_counter() - t0


def _with_events(trace: str, page_size: int | None, path: Path) -> tuple[float, dict[str, int]]:
    with ReplaySession(trace, page_size=page_size) as session, open(path, "wb") as f:
        t0 = time.perf_counter()
        emitter = Emitter(session, EventFileWriter(f).write)
        for snap in session.snapshots():
            emitter.after(snap)
        f.flush()
        return time.perf_counter() - t0, emitter.summary()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="*", help="traces (default: see above)")
    ap.add_argument("--page-size", type=int, action="append", help="what-if page size (repeatable)")
    ap.add_argument("--repeat", type=int, default=3, metavar="R")
    args = ap.parse_args()
    cases = [(t, p) for t in args.traces for p in (args.page_size or [None])] if args.traces else DEFAULT_CASES
    print(f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, {args.repeat} runs of each, medians")
    print(f"{'trace':<30} {'page':>4} {'plain s':>8} {'events s':>9} {'ratio':>6} {'batches':>8} "
          f"{'stored':>10} {'removed':>10} {'file MB':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "events.kvev"
        for trace, page_size in cases:
            plain, events = [], []
            summary: dict[str, int] = {}
            for _ in range(args.repeat):
                plain.append(_plain(trace, page_size))
                wall, summary = _with_events(trace, page_size, path)
                events.append(wall)
            p, e = statistics.median(plain), statistics.median(events)
            with ReplaySession(trace, page_size=page_size) as s:
                ps = s.config.page_size
            print(f"{trace:<30} {ps:>4} {p:>8.2f} {e:>9.2f} {e / p:>5.2f}x {summary['batches']:>8,} "
                  f"{summary['blocks_stored']:>10,} {summary['blocks_removed']:>10,} "
                  f"{path.stat().st_size / 2**20:>8.1f}")


if __name__ == "__main__":
    main()
