"""Seek in a replay session: time per seek to random steps, checkpoint memory and cost.

Usage:
    python bench/seek.py [TRACE] [--every K] [--seeks N] [--seed S] [--budget MB]

TRACE defaults to the bundled one-hour Mooncake sample. Prints:
  * the replay wall time without checkpoints and with one every K steps (the cost of
    taking them), the number of checkpoints and the memory they hold;
  * N seeks to random steps (forwards and backwards, in random order): median and
    worst seconds per seek, and how many steps each seek replayed at most.
Each seek lands on exactly the state a straight replay has at that step (the tests
prove it on small traces: tests/kvtrace/test_session.py).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvtrace.replay.session import ReplaySession  # noqa: E402

DEFAULT_TRACE = "sample:mooncake-conversation"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="?", default=DEFAULT_TRACE)
    ap.add_argument("--every", type=int, default=1500, metavar="K", help="steps between checkpoints")
    ap.add_argument("--seeks", type=int, default=50, metavar="N")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget", type=int, default=1024, metavar="MB", help="checkpoint memory budget")
    args = ap.parse_args()
    print(f"trace {args.trace}, checkpoint every {args.every} steps, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")

    with ReplaySession(args.trace) as plain:
        t0 = time.perf_counter()
        plain.run()
        wall_plain = time.perf_counter() - t0
    with ReplaySession(args.trace, checkpoint_every=args.every, checkpoint_budget=args.budget << 20) as s:
        t0 = time.perf_counter()
        result = s.run()
        wall_ckpt = time.perf_counter() - t0
        steps = result.stats.steps
        first, last = result.stats.first_step or 0, result.stats.last_step or 0
        mb = s.checkpoint_bytes / 2**20
        print(f"replay {steps:,} steps: {wall_plain:.2f} s without checkpoints, {wall_ckpt:.2f} s with "
              f"{s.num_checkpoints} checkpoints (+{100 * (wall_ckpt / wall_plain - 1):.1f}%), "
              f"{mb:.1f} MiB held ({mb / max(s.num_checkpoints, 1):.2f} MiB each), interval now {s.checkpoint_every}")
        rng = random.Random(args.seed)
        times = []
        for _ in range(args.seeks):
            target = rng.randint(first, last)
            t0 = time.perf_counter()
            snap = s.seek(target)
            times.append(time.perf_counter() - t0)
            assert snap is not None and snap.step <= max(target, first)
        times.sort()
        print(f"{args.seeks} seeks to random steps: median {statistics.median(times):.3f} s, "
              f"worst {times[-1]:.3f} s, best {times[0]:.3f} s (at most {s.checkpoint_every} steps replayed per seek)")


if __name__ == "__main__":
    main()
