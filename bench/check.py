"""What invariant checking costs a replay: --check end, every (incremental) and full.

Usage:
    python bench/check.py [TRACE] [--window A:B] [--skip-window] [--skip-hour] [--breakdown]

TRACE defaults to the bundled one-hour Mooncake sample. Each replay runs in a fresh
process through the real CLI (``python -m kvtrace replay --json``). Prints, wall
seconds (the replay's own ``wall_s``) and CPU seconds (the replay process and its
step-checker child):
  * a window of steps (default 0:2000) with --check end, every and full, and what the
    checks add per step; ``every`` checks what each allocator call changed, ``full``
    walks the whole state after every call;
  * the whole trace with --check end and every, and the ratio every / end (the design
    target is at most 2);
  * with --breakdown, one in-process replay of the whole trace with --check every: per
    allocator call kind, the main thread's CPU time in the calls and in their checks.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from collections import Counter
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


def breakdown(trace: str) -> None:
    """Main-thread CPU of each allocator call kind and of its checks, one replay in this process."""
    from allocator import create_allocator
    from allocator.manager import KvAllocator
    from kvtrace.replay import ReplayEngine, ReplayOptions, allocator_config_for
    from traces.io import TraceReader
    from traces.validate import BackgroundChecker

    reader = TraceReader(trace)
    alloc = create_allocator(allocator_config_for(reader.meta))
    checker = BackgroundChecker(reader.path)
    engine = ReplayEngine(reader.steps(), reader.meta, alloc, ReplayOptions(check="every"), checker=checker)
    seconds: Counter[str] = Counter()
    calls: Counter[str] = Counter()

    def timed_method(name: str, label: object) -> None:
        method = getattr(KvAllocator, name)

        def wrapper(self: KvAllocator, *a: object, **k: object) -> object:
            t0 = time.thread_time()
            out = method(self, *a, **k)
            key = label() if callable(label) else str(label)
            seconds[key] += time.thread_time() - t0
            calls[key] += 1
            return out

        setattr(alloc, name, wrapper.__get__(alloc))

    timed_method("check_integrity", lambda: f"check after {engine._op_name}")
    for name in ("extend", "decode", "release"):
        timed_method(name, name)
    t0 = time.thread_time()
    engine.run()
    checker.close()
    total = time.thread_time() - t0
    print(f"in-process replay with --check every: main thread {total:.2f} s CPU")
    print(f"{'':<22} {'calls':>8} {'cpu s':>8} {'us each':>9}")
    for key in sorted(seconds):
        print(f"{key:<22} {calls[key]:>8,} {seconds[key]:>8.2f} {seconds[key] / calls[key] * 1e6:>9.1f}")
    checks = sum(v for k, v in seconds.items() if k.startswith("check"))
    print(f"checks {checks:.2f} s of {total:.2f} s: every / end ~ {total / (total - checks):.2f}x in main-thread CPU")


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
    ap.add_argument("--breakdown", action="store_true", help="CPU of the calls and of their checks, per call kind")
    args = ap.parse_args()
    path = str(resolve_trace(args.trace))
    print(f"trace {args.trace}")
    if not (args.skip_window and args.skip_hour):
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
    if args.breakdown:
        breakdown(path)


if __name__ == "__main__":
    main()
