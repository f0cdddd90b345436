"""KV events: a replay writing SGLang's events to a file against a plain replay of the same trace.

Usage:
    python bench/kv_events.py [TRACE ...] [--page-size N ...] [--repeat R]

Each trace (default: the Azure code sample, page size 16 as recorded, and the Mooncake
tiny sample at page sizes 1 and 16) is replayed ``R`` times plainly and
``R`` times with its events written to a file (what ``kvtrace replay --kv-events FILE``
does: the replay records its tree's changes, a child process hashes, encodes and writes
them), taking turns. Prints the median wall time of each and their ratio (target <=
1.5x), the same for the replay process's CPU time (the step checker and the events'
child run in processes of their own), the batches, blocks stored and removed, and the
file's size.
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

from kvtrace.events.emit import BackgroundEmitter  # noqa: E402
from kvtrace.events.wire import FileTarget  # noqa: E402
from kvtrace.replay.session import ReplaySession  # noqa: E402

# The one-hour trace is left out: at its page size of 1 it stores 145 million blocks, whose
# events fill several GB.
DEFAULT_CASES = [("sample:azure-code", None), ("sample:mooncake-tiny", 1), ("sample:mooncake-tiny", 16)]


def _plain(trace: str, page_size: int | None) -> tuple[float, float]:
    with ReplaySession(trace, page_size=page_size) as session:
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in session.snapshots():
            pass
        return time.perf_counter() - t0, time.process_time() - c0


def _with_events(trace: str, page_size: int | None, path: Path) -> tuple[float, float, dict[str, int]]:
    with ReplaySession(trace, page_size=page_size) as session:
        t0, c0 = time.perf_counter(), time.process_time()
        emitter = BackgroundEmitter(session, FileTarget(str(path)))
        for snap in session.snapshots():
            emitter.after(snap)
        emitter.close()  # every event written
        return time.perf_counter() - t0, time.process_time() - c0, emitter.summary()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="*", help="traces (default: see above)")
    ap.add_argument("--page-size", type=int, action="append", help="what-if page size (repeatable)")
    ap.add_argument("--repeat", type=int, default=3, metavar="R")
    args = ap.parse_args()
    cases = [(t, p) for t in args.traces for p in (args.page_size or [None])] if args.traces else DEFAULT_CASES
    print(f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, {args.repeat} runs of each, medians")
    print(f"{'trace':<22} {'page':>4} {'plain s':>8} {'events s':>9} {'ratio':>6} {'plain cpu':>9} "
          f"{'events cpu':>10} {'ratio':>6} {'batches':>8} {'stored':>10} {'removed':>10} {'file MB':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "events.kvev"
        for trace, page_size in cases:
            plain, events, plain_cpu, events_cpu = [], [], [], []
            summary: dict[str, int] = {}
            for _ in range(args.repeat):
                wall, cpu = _plain(trace, page_size)
                plain.append(wall)
                plain_cpu.append(cpu)
                wall, cpu, summary = _with_events(trace, page_size, path)
                events.append(wall)
                events_cpu.append(cpu)
            p, e = statistics.median(plain), statistics.median(events)
            pc, ec = statistics.median(plain_cpu), statistics.median(events_cpu)
            with ReplaySession(trace, page_size=page_size) as s:
                ps = s.config.page_size
            print(f"{trace:<22} {ps:>4} {p:>8.2f} {e:>9.2f} {e / p:>5.2f}x {pc:>9.2f} {ec:>10.2f} {ec / pc:>5.2f}x "
                  f"{summary['batches']:>8,} "
                  f"{summary['blocks_stored']:>10,} {summary['blocks_removed']:>10,} "
                  f"{path.stat().st_size / 2**20:>8.1f}")


if __name__ == "__main__":
    main()
