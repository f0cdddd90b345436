"""The dashboard's cost: replay wall time with and without it, frames a second, memory.

Usage:
    python bench/tui.py [TRACE] [--repeat N] [--size WxH]

TRACE defaults to the bundled one-hour Mooncake sample (12,031 requests). Prints, in
one run:
  * the replay wall time without the dashboard (``ReplaySession.run()``, what
    ``kvtrace replay`` does) and with it (``KvtraceApp`` headless, playing at full
    speed from the first step to the last, with its checkpoints and per-request
    state), best of N each, and the overhead in percent (target: at most 10%);
  * frames a second: frames the driver posted and the screen showed, over the
    replay's wall time (target: at least 20), and the median time the UI took to draw
    one (the UI and the replay share the interpreter: what the UI draws, the replay waits);
  * memory: peak RSS of the process after the dashboard run, the per-request state,
    the timeline and the checkpoints the session holds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvtrace.session import ReplaySession  # noqa: E402
from kvtrace.tui.app import KvtraceApp  # noqa: E402
from kvtrace.tui.run import DASHBOARD_CHECKPOINT_EVERY  # noqa: E402
from kvtrace.tui.sources import LiveSource  # noqa: E402

DEFAULT_TRACE = "sample:mooncake-conversation"


def plain(trace: str) -> tuple[float, int]:
    with ReplaySession(trace) as s:
        t0 = time.perf_counter()
        result = s.run()
        return time.perf_counter() - t0, result.stats.steps


async def dashboard(trace: str, size: tuple[int, int]) -> dict[str, float]:
    session = ReplaySession(trace, track_state=True, checkpoint_every=DASHBOARD_CHECKPOINT_EVERY)
    app = KvtraceApp(LiveSource(session), play=True)
    async with app.run_test(size=size) as pilot:
        while app.frame is None:
            await pilot.pause(0.01)
        t0 = time.perf_counter()
        shown0, posted0 = app.frames_shown, app.driver.frames_posted
        while app.frame is None or not app.frame.done:
            await pilot.pause(0.05)
        wall = time.perf_counter() - t0
        out = {
            "wall_s": wall,
            "steps": float(session.state.timeline.size if session.state is not None else 0),
            "frames_shown": float(app.frames_shown - shown0),
            "frames_posted": float(app.driver.frames_posted - posted0),
            "state_mb": (session.state.nbytes() if session.state is not None else 0) / 2**20,
            "checkpoint_mb": session.checkpoint_bytes / 2**20,
            "requests": float(app.frame.requests.size),
            "draw_ms": 1000 * statistics.median(app.draw_s) if app.draw_s else float("nan"),
        }
        await pilot.press("q")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="?", default=DEFAULT_TRACE)
    ap.add_argument("--repeat", type=int, default=1, metavar="N", help="runs of each (the best is kept)")
    ap.add_argument("--size", default="180x50", metavar="WxH", help="terminal size of the headless dashboard")
    args = ap.parse_args()
    w, h = (int(v) for v in args.size.split("x"))
    print(f"trace {args.trace}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, terminal {w}x{h}")
    plain_runs, dash_runs = [], []
    for i in range(args.repeat):
        plain_runs.append(plain(args.trace))
        dash_runs.append(asyncio.run(dashboard(args.trace, (w, h))))
        print(f"run {i + 1}: without {plain_runs[-1][0]:.2f} s, with the dashboard {dash_runs[-1]['wall_s']:.2f} s")
    base, steps = min(plain_runs)
    best = min(dash_runs, key=lambda d: d["wall_s"])
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    over = 100 * (best["wall_s"] / base - 1)
    print(f"replay {steps:,} steps without the dashboard: {base:.2f} s")
    print(f"replay with the dashboard (playing at full speed): {best['wall_s']:.2f} s "
          f"(+{over:.1f}%; target <= 10%: {'ok' if over <= 10 else 'MISSED'})")
    fps = best["frames_shown"] / best["wall_s"]
    print(f"frames: {best['frames_posted']:.0f} posted, {best['frames_shown']:.0f} shown, {fps:.1f} a second "
          f"(target >= 20: {'ok' if fps >= 20 else 'MISSED'}); median {best['draw_ms']:.1f} ms from a frame's "
          f"arrival to its screen update")
    print(f"memory with {best['requests']:,.0f} requests: peak RSS {rss_mb:.0f} MB; per-request state and "
          f"timeline {best['state_mb']:.1f} MB; checkpoints {best['checkpoint_mb']:.1f} MB")


if __name__ == "__main__":
    main()
