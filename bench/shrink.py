"""Time to shrink each deliberately broken allocator's failure (and the pre-encapsulation
variant's) from a bundled trace to a small regression test, measured in one run.

Usage:
    python bench/shrink.py [TRACE ...] [--jobs N] [--max-time S] [--no-tests] [--only CASE ...]

TRACE defaults to the bundled one-hour Mooncake sample, the EAGLE one and the pressure
one (the hour has page size 1 and no speculative decoding, retraction or abort, so the
failures that need those show only on the others: speculative steps on both, retractions
and an abort on the pressure sample). Each case runs ``kvtrace shrink TRACE ... --json``
in a fresh process through the real CLI, timed from start to exit (the failure is found
on the whole trace first):

  * ``violation`` with each broken allocator of ``tests/kvtrace/faulty_allocators.py``
    (``--baseline builtin``);
  * ``divergence`` of ``builtin`` and ``pre-encapsulation``;
  * ``oom`` of ``pre-encapsulation`` with ``--baseline builtin``.

For each it prints the wall and CPU seconds, the signature, the sizes before and
after, and checks the acceptance: at most 5 requests and 50 steps, the result fails
the same way (the shrink confirms it), and, unless ``--no-tests``, the emitted test
run by pytest fails against the broken version and passes against builtin. A case
whose failure does not show on a trace is listed as such (exit 1 of kvtrace shrink).
The machine may be shared: the load average is printed at the start and the end.
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
FAULTY = "tests/kvtrace/faulty_allocators.py"
DEFAULT_TRACES = ["sample:mooncake-conversation", "sample:mooncake-eagle", "sample:mooncake-pressure"]
ENV_VERSION = "KVTRACE_REGRESS_ALLOCATOR"  # kvtrace.shrink.emit.ENV_VERSION
CASES: dict[str, tuple[list[str], str]] = {  # name -> (kvtrace shrink options, the failing version)
    **{
        fault: (["--until", "violation", "--allocator", f"{FAULTY}:{fault}", "--baseline", "builtin"], f"{FAULTY}:{fault}")
        for fault in ("leaky_overalloc", "double_free", "stale_row", "leak_on_retract", "overwritten_row",
                      "lock_leak", "counters_off")
    },
    "pre-encapsulation divergence": (["--until", "divergence", "--a", "builtin", "--b", "pre-encapsulation"],
                                     "pre-encapsulation"),
    "pre-encapsulation oom": (["--until", "oom", "--allocator", "pre-encapsulation", "--baseline", "builtin"],
                              "pre-encapsulation"),
}


def run(args: list[str], env: dict[str, str] | None = None) -> tuple[float, float, subprocess.CompletedProcess[str]]:
    """Run a command in a fresh process: (wall s, CPU s of it and its descendants, the process)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), proc


def emitted_test_passes(test: Path, version: str | None) -> bool:
    env = {} if version is None else {ENV_VERSION: version}
    _, _, proc = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)], env)
    return proc.returncode == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="*", default=DEFAULT_TRACES)
    ap.add_argument("--jobs", type=int, default=None, help="kvtrace shrink --jobs (default: its own)")
    ap.add_argument("--max-time", type=float, default=None)
    ap.add_argument("--no-tests", action="store_true", help="do not run the emitted tests")
    ap.add_argument("--only", nargs="*", default=None, help="case names to run (default: all)")
    args = ap.parse_args()

    usable = len(os.sched_getaffinity(0))
    print(f"{os.cpu_count()} CPUs visible, {usable} usable; load average {os.getloadavg()[0]:.1f} at the start")
    header = f"{'trace':<30}{'case':<30}{'wall s':>8}{'cpu s':>8}  {'signature':<32}{'before':>30}  {'after':>16}  ok"
    print(header)
    failures = 0
    with tempfile.TemporaryDirectory(prefix="bench-shrink-") as tmp:
        for trace in args.traces:
            for name, (options, failing) in CASES.items():
                if args.only and name not in args.only:
                    continue
                slug = "".join(c if c.isalnum() else "_" for c in f"{trace}_{name}")
                test = Path(tmp) / f"test_{slug}.py"
                cmd = [sys.executable, "-m", "kvtrace", "shrink", trace, *options, "--emit-test", str(test), "--json", "-q"]
                if args.jobs is not None:
                    cmd += ["--jobs", str(args.jobs)]
                if args.max_time is not None:
                    cmd += ["--max-time", str(args.max_time)]
                wall, cpu, proc = run(cmd)
                if proc.returncode not in (0, 1):
                    print(f"{trace:<30}{name:<30} kvtrace shrink exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
                    failures += 1
                    continue
                out = json.loads(proc.stdout)
                if not out["reproduced"]:
                    print(f"{trace:<30}{name:<30}{wall:8.1f}{cpu:8.1f}  (does not fail on this trace: {out['reason']})")
                    continue
                b, a = out["before"], out["after"]
                small = a["requests"] <= 5 and a["steps"] <= 50 and out["confirmed"]
                tests = "" if args.no_tests else (
                    "tests ok" if (not emitted_test_passes(test, failing) and emitted_test_passes(test, None))
                    else "TESTS WRONG"
                )
                ok = small and tests != "TESTS WRONG"
                failures += not ok
                print(f"{trace:<30}{name:<30}{wall:8.1f}{cpu:8.1f}  {out['signature']:<32}"
                      f"{b['requests']:>7,} r {b['steps']:>6,} s {b['ops']:>9,} o"
                      f"  {a['requests']:>2} r {a['steps']:>3} s {a['ops']:>3} o"
                      f"  {'yes' if ok else 'NO'} ({out['candidates']} candidates, {out['jobs']} jobs, {out['stopped']}"
                      f"{', ' + tests if tests else ''})")
    print(f"load average {os.getloadavg()[0]:.1f} at the end"
          + ("" if not failures else f"; {failures} case(s) missed the acceptance"))
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
