"""What ``kvtrace explain`` costs against a plain replay of the same trace.

Usage:
    python bench/explain.py [TRACE] [--repeats N] [--stop-step S] [--modes plain,attribution,...]
    python bench/explain.py [TRACE] --rss [--modes ...]

TRACE defaults to the bundled one-hour Mooncake sample. Each repeat replays the trace in
this process, one mode after the other (interleaved, so a shared machine's load falls on
every mode alike), and records the process CPU seconds and the wall seconds of each:

  * ``plain``: the replay alone (the reference);
  * ``attribution``: with the causes gathered (``Explainer(oracles=False)``), the part
    meant to be cheap enough to leave on (target at most 1.3x);
  * ``oracles``: also the page model's stream, then infinite / LRU without Belady;
  * ``full``: everything ``kvtrace explain`` does, Belady included.

Prints each repeat, then the medians and their ratios to ``plain``, and the peak RSS of
the process (the shadow of every token ever computed grows with the trace). ``--rss``
runs each mode once in a process of its own instead and prints each one's peak RSS
after the replay and after the report (the oracles' runs come with the report).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODES = ("plain", "attribution", "oracles", "full")


def once(trace: str, mode: str, stop_step: int | None) -> tuple[float, float]:
    """(wall s, CPU s) of one replay in ``mode``, the report included."""
    from kvtrace.explain.report import Explainer
    from kvtrace.replay.engine import ReplayOptions
    from kvtrace.replay.session import ReplaySession

    t0, c0 = time.perf_counter(), time.process_time()
    with ReplaySession(trace, options=ReplayOptions(stop_step=stop_step)) as session:
        explainer = None
        if mode != "plain":
            explainer = Explainer(session, oracles=mode != "attribution", belady=mode == "full")
        for _ in session.snapshots():
            pass
    if explainer is not None:
        explainer.report().to_dict()
    return time.perf_counter() - t0, time.process_time() - c0


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_child(trace: str, mode: str, stop_step: int | None) -> None:
    """One mode in this process: its peak RSS after the replay and after the report."""
    from kvtrace.explain.report import Explainer
    from kvtrace.replay.engine import ReplayOptions
    from kvtrace.replay.session import ReplaySession

    with ReplaySession(trace, options=ReplayOptions(stop_step=stop_step)) as session:
        explainer = None
        if mode != "plain":
            explainer = Explainer(session, oracles=mode != "attribution", belady=mode == "full")
        for _ in session.snapshots():
            pass
        replayed = _peak_mb()
        if explainer is not None:
            explainer.report().to_dict()
    print(f"  {mode:<12} peak RSS {replayed:7,.0f} MB after the replay, {_peak_mb():7,.0f} MB after the report",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", nargs="?", default="sample:mooncake-conversation")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stop-step", type=int, default=None)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, plain first")
    parser.add_argument("--rss", action="store_true", help="each mode's peak RSS, in a process of its own")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # --rss: the mode this process runs
    args = parser.parse_args()
    if args.child is not None:
        rss_child(args.trace, args.child, args.stop_step)
        return
    modes = tuple(args.modes.split(","))
    if args.rss:
        print(f"peak RSS, one process per mode ({args.trace})", flush=True)
        for mode in modes:
            cmd = [sys.executable, __file__, args.trace, "--child", mode]
            if args.stop_step is not None:
                cmd += ["--stop-step", str(args.stop_step)]
            subprocess.run(cmd, check=True)
        return
    walls: dict[str, list[float]] = {m: [] for m in modes}
    cpus: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.repeats):
        for mode in modes:
            wall, cpu = once(args.trace, mode, args.stop_step)
            walls[mode].append(wall)
            cpus[mode].append(cpu)
            print(f"repeat {r}  {mode:<12} wall {wall:7.2f} s  cpu {cpu:7.2f} s", flush=True)
    base_wall, base_cpu = statistics.median(walls["plain"]), statistics.median(cpus["plain"])
    print(f"\nmedians over {args.repeats} repeats ({args.trace}"
          + (f", steps :{args.stop_step}" if args.stop_step else "") + ")")
    for mode in modes:
        w, c = statistics.median(walls[mode]), statistics.median(cpus[mode])
        print(f"  {mode:<12} wall {w:7.2f} s ({w / base_wall:.2f}x)  cpu {c:7.2f} s ({c / base_cpu:.2f}x)")
    print(f"peak RSS of the process {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MB")


if __name__ == "__main__":
    main()
