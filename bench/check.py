"""What invariant checking costs a replay: --check end, every (incremental) and full.

Usage:
    python bench/check.py [TRACE] [--repeat N] [--before REV | --before-tree DIR]
                          [--window A:B] [--skip-window] [--skip-hour] [--breakdown]

TRACE defaults to the bundled one-hour Mooncake sample. Each replay runs in a fresh
process through the real CLI (``python -m kvtrace replay --json``); wall seconds are
the replay's own ``wall_s`` (start-up excluded), CPU seconds those of the replay
process and its step-screening child. Prints, with the load average before and after:

  * a window of steps (default 0:2000) with --check end, every and full, and what the
    checks add per step; ``every`` checks what each allocator call changed, ``full``
    walks the whole state after every call;
  * the whole trace with --check end and every, ``--repeat`` times, the two modes run
    back to back (and each code version in turn, with ``--before``), so that each
    ratio every / end compares runs made seconds apart: the median ratio, wall and
    CPU, and the spread (lowest and highest ratio). The design target is at most 2;
  * with ``--before REV`` (checked out into a temporary git worktree) or
    ``--before-tree DIR`` (that code already extracted), the same for that code,
    interleaved with this tree's runs;
  * with --breakdown, one in-process replay of the whole trace with --check every: per
    allocator call kind, the main thread's CPU time in the calls and in their checks.
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
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from beforecode import code_at  # noqa: E402  (bench/, beside this script)
from traces.samples import resolve_trace  # noqa: E402

DEFAULT_TRACE = "sample:mooncake-conversation"


def replay(code: Path, trace: str, *args: str) -> tuple[dict, float]:
    """``kvtrace replay TRACE --json ARGS`` with the code at ``code`` in a fresh process;
    its JSON summary and the CPU seconds it and its children used."""
    cmd = [sys.executable, "-m", "kvtrace", "replay", trace, "--json", *args]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, cwd=code, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(code)})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode not in (0, 1) or not proc.stdout.strip():
        raise SystemExit(f"replay of {trace} with {code} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout), (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def window(trace: str, steps: str) -> None:
    """--check end, every and full on a window of steps (this tree)."""
    print(f"{'mode':<34} {'steps':>8} {'wall s':>8} {'cpu s':>8} {'wall':>8} {'cpu':>7} {'violations':>10}")
    base = None
    for mode in ("end", "every", "full"):
        s, cpu = replay(ROOT, trace, "--check", mode, "--steps", steps)
        ratio = f"{s['wall_s'] / base[0]:>7.2f}x {cpu / base[1]:>6.2f}x" if base else f"{'':>8} {'':>7}"
        print(f"{f'--check {mode}, steps {steps}':<34} {s['steps_reported']:>8,} {s['wall_s']:>8.2f} {cpu:>8.2f} "
              f"{ratio} {s['num_violations']:>10}", flush=True)
        if base is None:
            base = (s["wall_s"], cpu)
        else:
            extra = (s["wall_s"] - base[0]) / max(s["steps_reported"], 1) * 1e3
            print(f"{'':<4}--check {mode} adds {extra:.3f} ms per step of wall time over --check end")


def whole(trace: str, codes: dict[str, Path], repeat: int) -> None:
    """--check end and every on the whole trace, ``repeat`` times, interleaved."""
    runs: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in codes}
    steps = violations = 0
    for k in range(repeat):
        for name, code in codes.items():
            end, end_cpu = replay(code, trace, "--check", "end")
            every, every_cpu = replay(code, trace, "--check", "every")
            runs[name].append((end["wall_s"], every["wall_s"], end_cpu, every_cpu))
            steps, violations = every["steps"], violations + every["num_violations"] + end["num_violations"]
            print(f"  {k + 1}/{repeat} {name:<7} end {end['wall_s']:6.2f} s ({end_cpu:6.2f} s CPU), every "
                  f"{every['wall_s']:6.2f} s ({every_cpu:6.2f} s CPU): {every['wall_s'] / end['wall_s']:.2f}x wall, "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    print(f"{'code':<8} {'steps':>8} {'end wall s':>11} {'every wall s':>13} {'wall ratio':>11} "
          f"{'spread':>13} {'cpu ratio':>10} {'spread':>13}")
    for name, rows in runs.items():
        wall = [e / b for b, e, _, _ in rows]
        cpu = [e / b for _, _, b, e in rows]
        print(f"{name:<8} {steps:>8,} {statistics.median(r[0] for r in rows):>11.2f} "
              f"{statistics.median(r[1] for r in rows):>13.2f} {statistics.median(wall):>10.2f}x "
              f"{min(wall):>6.2f}-{max(wall):.2f}x {statistics.median(cpu):>9.2f}x {min(cpu):>6.2f}-{max(cpu):.2f}x")
    print(f"--check every / --check end on the whole trace (median of {repeat}; target <= 2x); violations {violations}")


def breakdown(trace: str) -> None:
    """Main-thread CPU of each allocator call kind and of its checks, one replay in this process."""
    from allocator.manager import KvAllocator
    from kvtrace.replay.engine import ReplayOptions
    from kvtrace.replay.session import ReplaySession

    seconds: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    session = ReplaySession(trace, options=ReplayOptions(check="every"))
    engine = session.engine
    alloc = session.allocator
    check = alloc.check_integrity

    def checked(touched: object = None) -> object:  # (the engine looks for a ``touched`` parameter)
        t0 = time.thread_time()
        out = check(touched)  # type: ignore[arg-type]
        seconds[f"check after {engine._op_name}"] += time.thread_time() - t0
        calls[f"check after {engine._op_name}"] += 1
        return out

    def timed(name: str) -> None:
        method = getattr(alloc, name)

        def wrapper(*a: object, **k: object) -> object:
            t0 = time.thread_time()
            out = method(*a, **k)
            seconds[name] += time.thread_time() - t0
            calls[name] += 1
            return out

        setattr(alloc, name, wrapper)

    alloc.check_integrity = checked  # type: ignore[method-assign]
    for name in ("extend", "decode", "decode_run", "release"):
        timed(name)
    t0 = time.thread_time()
    session.run()
    session.close()
    total = time.thread_time() - t0
    print(f"in-process replay with --check every: main thread {total:.2f} s CPU")
    print(f"{'':<22} {'calls':>8} {'cpu s':>8} {'us each':>9}")
    for key in sorted(seconds):
        print(f"{key:<22} {calls[key]:>8,} {seconds[key]:>8.2f} {seconds[key] / calls[key] * 1e6:>9.1f}")
    checks = sum(v for k, v in seconds.items() if k.startswith("check"))
    print(f"checks {checks:.2f} s of {total:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="?", default=DEFAULT_TRACE)
    ap.add_argument("--repeat", type=int, default=3, help="whole-trace end / every pairs per code version")
    ap.add_argument("--before", metavar="REV", help="also time this revision, interleaved (a temporary worktree)")
    ap.add_argument("--before-tree", type=Path, metavar="DIR", help="also time the code extracted in DIR")
    ap.add_argument("--window", default="0:2000", metavar="A:B", help="steps for the three-mode comparison")
    ap.add_argument("--skip-window", action="store_true", help="skip the three-mode window comparison")
    ap.add_argument("--skip-hour", action="store_true", help="skip the whole-trace end / every comparison")
    ap.add_argument("--breakdown", action="store_true", help="CPU of the calls and of their checks, per call kind")
    args = ap.parse_args()
    path = str(resolve_trace(args.trace))
    print(f"trace {args.trace}; {len(os.sched_getaffinity(0))} CPUs usable (of {os.cpu_count()}); "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    if not args.skip_window:
        window(path, args.window)
    if not args.skip_hour:
        with code_at(args.before, args.before_tree) as before:
            codes = {"before": before, "after": ROOT} if before is not None else {"this": ROOT}
            if before is not None:
                print(f"before: {args.before or before}; after: the working tree {ROOT}")
            whole(path, codes, args.repeat)
    if args.breakdown:
        breakdown(path)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
