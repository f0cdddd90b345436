"""What ``kvtrace diff`` costs against one replay of the same trace, measured in one run.

Usage:
    python bench/diff.py [TRACE] [--repeats N] [--lockstep]

TRACE defaults to the bundled one-hour Mooncake sample. Each repeat runs, one after
the other, each in a fresh process through the real CLI:
  * ``kvtrace replay TRACE`` (one replay: the reference);
  * ``kvtrace diff TRACE --a builtin --b builtin --jobs 2`` (the two sides replay in
    two child processes, in parallel, and stream their records to the parent);
  * the same with ``--exact`` (per-step state digests of both allocators compared);
  * with ``--lockstep``, also ``--jobs 1`` (both sides in one process, for reference).
Prints every repeat's wall and CPU seconds (the command and all its descendants), the
median and the spread, and the ratios to the replay of the same repeat. The diffs
must say "identical". The machine may be shared: the CPU seconds are the steadier
figure, the wall ratio is the target (at most 1.2x with two cores).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = "sample:mooncake-conversation"


def run(args: list[str]) -> tuple[float, float, dict]:
    """Run ``kvtrace ARGS --json`` in a fresh process: (wall s, CPU s of it and its
    descendants, the JSON it printed)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "kvtrace", *args, "--json"], cwd=ROOT, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"kvtrace {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, json.loads(proc.stdout)


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):7.2f}  min {min(values):7.2f}  max {max(values):7.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="?", default=DEFAULT_TRACE)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lockstep", action="store_true", help="also time --jobs 1 (both sides in one process)")
    args = ap.parse_args()

    cases = {
        "replay": ["replay", args.trace],
        "diff": ["diff", args.trace, "--a", "builtin", "--b", "builtin", "--jobs", "2"],
        "diff --exact": ["diff", args.trace, "--a", "builtin", "--b", "builtin", "--jobs", "2", "--exact"],
    }
    if args.lockstep:
        cases["diff --jobs 1"] = ["diff", args.trace, "--a", "builtin", "--b", "builtin", "--jobs", "1"]
    walls: dict[str, list[float]] = {k: [] for k in cases}
    cpus: dict[str, list[float]] = {k: [] for k in cases}
    steps = None
    print(f"trace {args.trace}; {os.cpu_count()} CPUs visible, {len(os.sched_getaffinity(0))} usable; "
          f"load average {os.getloadavg()[0]:.1f} at the start")
    for r in range(args.repeats):
        for name, cmd in cases.items():
            wall, cpu, out = run(cmd)
            if name != "replay":
                if not out["identical"]:
                    raise SystemExit(f"{name}: not identical: {out['first_divergence']}")
                steps = out["steps_compared"]
            walls[name].append(wall)
            cpus[name].append(cpu)
            print(f"  repeat {r + 1}  {name:<14} wall {wall:7.2f} s  cpu {cpu:7.2f} s")
    print(f"\n{steps:,} steps compared (identical every time); load average {os.getloadavg()[0]:.1f} at the end")
    print(f"{'':<16}{'wall s':<44}{'cpu s (with descendants)'}")
    for name in cases:
        print(f"{name:<16}{spread(walls[name]):<44}{spread(cpus[name])}")
    print("\nratio to the replay of the same repeat (wall; cpu):")
    for name in cases:
        if name == "replay":
            continue
        wr = [d / b for d, b in zip(walls[name], walls["replay"])]
        cr = [d / b for d, b in zip(cpus[name], cpus["replay"])]
        print(f"  {name:<14} wall {spread(wr)}   cpu {spread(cr)}")
    exact = [e / d for e, d in zip(walls["diff --exact"], walls["diff"])]
    print(f"  --exact overhead (wall, exact / plain diff): {spread(exact)}")


if __name__ == "__main__":
    main()
