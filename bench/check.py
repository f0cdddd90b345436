"""What invariant checking costs a replay: --check end, every (incremental) and full.

Usage:
    python bench/check.py [TRACE] [--window A:B] [--skip-window] [--skip-hour]

TRACE defaults to the bundled one-hour Mooncake sample. Each replay runs in a fresh
process through the real CLI (``python -m kvtrace replay --json``). Prints, wall
seconds (the replay's own ``wall_s``) and CPU seconds (the replay process and its
step-checker child):
  * a window of steps (default 0:2000) with --check end, every and full, and what the
    checks add per step; ``every`` checks what each allocator call changed, ``full``
    walks the whole state after every call;
  * the whole trace with --check end and every, and the ratio every / end (the design
    target is at most 2).
"""

from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from replay import run_replay  # noqa: E402  (bench/replay.py)
from traces.samples import resolve_trace  # noqa: E402

DEFAULT_TRACE = "sample:mooncake-conversation"


def timed(trace: str, *args: str) -> tuple[dict, float]:
    """One replay; its JSON summary and the CPU seconds it and its children used."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    summary, _ = run_replay(trace, *args)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return summary, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _row(name: str, s: dict, cpu: float, base: tuple[float, float] | None = None) -> None:
    ratio = f"{s['wall_s'] / base[0]:>7.2f}x {cpu / base[1]:>6.2f}x" if base else f"{'':>8} {'':>7}"
    steps = s.get("steps_reported", s["steps"])
    print(f"{name:<34} {steps:>8,} {s['wall_s']:>8.2f} {cpu:>8.2f} {ratio} {s['num_violations']:>10}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="?", default=DEFAULT_TRACE)
    ap.add_argument("--window", default="0:2000", metavar="A:B", help="steps for the three-mode comparison")
    ap.add_argument("--skip-window", action="store_true", help="skip the three-mode window comparison")
    ap.add_argument("--skip-hour", action="store_true", help="skip the whole-trace end / every comparison")
    args = ap.parse_args()
    path = str(resolve_trace(args.trace))
    print(f"trace {args.trace}")
    print(f"{'mode':<34} {'steps':>8} {'wall s':>8} {'cpu s':>8} {'wall':>8} {'cpu':>7} {'violations':>10}")
    base = None
    for mode in () if args.skip_window else ("end", "every", "full"):
        s, cpu = timed(path, "--check", mode, "--steps", args.window)
        _row(f"--check {mode}, steps {args.window}", s, cpu, base)
        if base is None:
            base = (s["wall_s"], cpu)
        else:
            extra = (s["wall_s"] - base[0]) / max(s["steps_reported"], 1) * 1e3
            print(f"{'':<4}--check {mode} adds {extra:.3f} ms per step of wall time over --check end")
    if not args.skip_hour:
        end, end_cpu = timed(path, "--check", "end")
        _row("--check end, whole trace", end, end_cpu)
        every, every_cpu = timed(path, "--check", "every")
        _row("--check every, whole trace", every, every_cpu, (end["wall_s"], end_cpu))
        print(f"--check every / --check end on the whole trace: {every['wall_s'] / end['wall_s']:.2f}x wall, "
              f"{every_cpu / end_cpu:.2f}x CPU (target <= 2x)")


if __name__ == "__main__":
    main()
