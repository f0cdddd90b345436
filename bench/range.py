"""What ``kvtrace diff --range`` costs on a real series, cold and cached, measured in one run.

Usage:
    python bench/range.py [TRACE ...] [--range BASE..HEAD] [--jobs N]

Defaults: the tiny sample and the EAGLE trace, and this repository's own history on the
first-parent path from f42b549 to 4a6c5f2 (the diff merge): 13 commits, 3 of them touching
``allocator/`` (a merge of main, the tidy-up merge, the diff merge). Each case runs, one after the
other, in a fresh process through the real CLI, each cold case with an empty cache
directory of its own (``KVTRACE_CACHE_DIR``):
  * the table with one replay at a time (``--jobs 1``);
  * the table with ``--jobs N`` (default: every usable core) replays at once;
  * the same again on that cache (nothing to replay);
  * ``--bisect`` with ``--jobs N``.
Prints each case's wall and CPU seconds (the command and all its descendants), how
many replays it ran and how many came from the cache, the sum of those replays' own wall
times (above the command's wall when they overlapped), and checks that every case
gives the same verdict per commit (a bisection: on the commits it replayed).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RANGE = "f42b549..4a6c5f2"


def run(args: list[str], cache: Path) -> tuple[float, float, dict]:
    """Run ``kvtrace ARGS --json -q`` in a fresh process: (wall s, CPU s of it and its
    descendants, the JSON it printed)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "kvtrace", *args, "--json", "-q"], cwd=ROOT, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "KVTRACE_CACHE_DIR": str(cache)},
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"kvtrace {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, json.loads(proc.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="*", default=["sample:tiny", "sample:mooncake-eagle"])
    ap.add_argument("--range", dest="rev_range", default=DEFAULT_RANGE)
    ap.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)))
    args = ap.parse_args()

    base = ["diff", *args.traces, "--range", args.rev_range]
    print(f"{' '.join(base)}; {os.cpu_count()} CPUs visible, {len(os.sched_getaffinity(0))} usable; "
          f"load average {os.getloadavg()[0]:.1f} at the start")
    with tempfile.TemporaryDirectory(prefix="kvtrace-bench-range-") as tmp:
        caches = {name: Path(tmp) / name for name in ("serial", "parallel", "bisect")}
        cases = [
            ("table, --jobs 1, cold", [*base, "--jobs", "1"], caches["serial"]),
            (f"table, --jobs {args.jobs}, cold", [*base, "--jobs", str(args.jobs)], caches["parallel"]),
            (f"table, --jobs {args.jobs}, cached", [*base, "--jobs", str(args.jobs)], caches["parallel"]),
            (f"--bisect, --jobs {args.jobs}, cold", [*base, "--bisect", "--jobs", str(args.jobs)], caches["bisect"]),
        ]
        verdicts: dict[str, str] = {}
        first = None
        rows = []
        for name, cmd, cache in cases:
            wall, cpu, out = run(cmd, cache)
            for c in out["commits"]:
                if c["status"] in ("identical", "diverged", "error"):
                    if verdicts.setdefault(c["commit"], c["status"]) != c["status"]:
                        raise SystemExit(f"{name}: {c['short']} is {c['status']}, earlier {verdicts[c['commit']]}")
            if first is None:
                first = out["first_diverging_commit"]
            elif out["first_diverging_commit"] != first:
                raise SystemExit(f"{name}: first diverging commit {out['first_diverging_commit']}, earlier {first}")
            touched = sum(1 for c in out["commits"] if c["status"] != "skipped")
            ran = [t for c in out["commits"] for t in c["traces"]] + out["base_replays"]
            replay_sum = sum(t["replay_s"] or 0.0 for t in ran if not t["cached"])
            rows.append((name, wall, cpu, out["replays"], out["cached"], touched))
            print(f"  {name:<28} wall {wall:7.2f} s  cpu {cpu:7.2f} s  replays {out['replays']:>3} "
                  f"(their walls add up to {replay_sum:6.1f} s)  cached {out['cached']:>3}  "
                  f"({touched} commits touch the paths, {len(args.traces)} traces)")
    serial, parallel, cached = rows[0][1], rows[1][1], rows[2][1]
    print(f"\nverdicts: {', '.join(f'{h[:10]} {v}' for h, v in verdicts.items())}; first diverging: {first}")
    print(f"--jobs {args.jobs} against --jobs 1 (wall): {serial / parallel:.2f}x faster; "
          f"the cached re-run: {cached:.2f} s ({serial / cached:.1f}x faster than cold, one replay at a time)")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
