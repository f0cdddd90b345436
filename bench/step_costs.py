"""Where a replay step's time goes on short-request chat traffic (issue #42).

Usage:
    python bench/step_costs.py [TRACE] [--page-size N] [--profile]

Replays TRACE (default: the short-request trace ``bench/replay_speed.py`` records) in
this process as ``kvtrace replay --check end`` does (the step checker in its child
process) and prints, per kind of step, how many there were, their wall time per step
and the allocator's share of it:

* ``admit``: steps with extend rows (admissions, prefill chunks), finishes or not;
* ``finish``: decode steps in which requests finish;
* ``decode``: a plain decode step by itself (between admissions and finishes);
* ``run``: the call that applies a run of plain decode steps (its first step), and
  ``run, rest``: the run's later steps, returned from memory.

``--profile`` adds a cProfile of the same loop, its own time summed by where the code
lives (allocator, engine, session, trace reading, token store, checker, snapshots),
and the functions of most own time.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from replay_speed import short_trace  # noqa: E402

from kvtrace.replay.session import ReplaySession  # noqa: E402
from traces.schema import DECODE, EXTEND, FINISH  # noqa: E402

# Where code lives -> its bucket in the profile (first match; the rest is "other").
_BUCKETS = (
    ("allocator/", "allocator"),
    ("kvtrace/replay/engine.py", "engine"),
    ("kvtrace/replay/session.py", "session"),
    ("kvtrace/replay/checkpoints.py", "session"),
    ("kvtrace/replay/step_checker.py", "checker (this process)"),
    ("traces/checker", "checker (this process)"),
    ("kvtrace/replay/snapshot.py", "snapshots"),
    ("traces/tokens.py", "token store"),
    ("traces/", "trace reading"),
)


def kind_of(snap: object, pending_before: int, pending_after: int) -> str:
    if pending_before:
        return "run, rest"
    if pending_after:
        return "run"
    ops = set(snap.requests.op.tolist())  # type: ignore[attr-defined]
    if EXTEND in ops:
        return "admit"
    if FINISH in ops:
        return "finish"
    return "decode" if ops == {DECODE} else "other"


def costs(trace: Path, page_size: int | None, profile: cProfile.Profile | None) -> None:
    wall: dict[str, float] = collections.defaultdict(float)
    alloc: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter[str] = collections.Counter()
    clock = time.perf_counter
    with ReplaySession(trace, page_size=page_size) as session:
        start = clock()
        if profile is not None:
            profile.enable()
        while True:
            before = len(session._pending)
            t0 = clock()
            snap = session.step()
            dt = clock() - t0
            if snap is None:
                break
            kind = kind_of(snap, before, len(session._pending))
            wall[kind] += dt
            alloc[kind] += snap.allocator_s
            count[kind] += 1
        if profile is not None:
            profile.disable()
        total = clock() - start
    steps = sum(count.values())
    print(f"{trace.name}: {steps:,} steps in {total:.2f} s, {total / steps * 1e6:.1f} µs per step")
    print(f"{'kind':<10} {'steps':>7} {'µs each':>9} {'alloc µs':>9} {'µs/step of all':>15}")
    for kind in sorted(wall, key=lambda k: -wall[k]):
        n = count[kind]
        print(f"{kind:<10} {n:>7,} {wall[kind] / n * 1e6:>9.1f} {alloc[kind] / n * 1e6:>9.1f} "
              f"{wall[kind] / steps * 1e6:>15.1f}")


def report_profile(profile: cProfile.Profile, top: int = 25) -> None:
    stats = pstats.Stats(profile)
    own: dict[str, float] = collections.defaultdict(float)
    rows = []
    for (file, line, name), (_cc, calls, tottime, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        bucket = next((b for where, b in _BUCKETS if where in file), "numpy and other")
        own[bucket] += tottime
        rows.append((tottime, calls, f"{Path(file).name}:{line}({name})"))
    total = sum(own.values())
    print(f"\ncProfile, own time by where the code lives (profiled: {total:.2f} s)")
    for bucket, t in sorted(own.items(), key=lambda kv: -kv[1]):
        print(f"  {bucket:<24} {t:>7.2f} s {t / total:>6.1%}")
    print(f"\nfunctions of most own time (top {top})")
    for tottime, calls, where in sorted(rows, reverse=True)[:top]:
        print(f"  {tottime:>7.3f} s {calls:>9,} calls  {where}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="?", type=Path, help="default: the short-request trace, recorded here")
    ap.add_argument("--page-size", type=int)
    ap.add_argument("--profile", action="store_true", help="also a cProfile of the loop")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        trace = args.trace or short_trace(Path(tmp) / "short-requests.kvtrace")
        if trace is None:
            raise SystemExit("the Azure code workload is not in this checkout: give a TRACE")
        costs(trace, args.page_size, None)
        if args.profile:
            profile = cProfile.Profile()
            costs(trace, args.page_size, profile)
            report_profile(profile)


if __name__ == "__main__":
    main()
