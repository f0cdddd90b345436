"""Export the README's dashboard screenshots as SVG (re-runnable).

Usage:
    python tools/screenshots.py [--out docs/screenshots]

Runs the real app headless over bundled samples, goes to a step with the keys a user
would press, waits for the replay thread, and saves what the screen shows:
  * dashboard.svg: the one-hour Mooncake sample at its peak occupancy, one request selected
    (its pages highlighted on the page map);
  * detail.svg: a speculative-decoding request's lengths over its life (sample:mooncake-eagle);
  * help.svg: the key reference;
  * diff.svg: ``kvtrace diff sample:mooncake-eagle --b pre-encapsulation --tui`` at the first
    divergence.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvtrace.diff.diff import DiffOptions, diff_trace  # noqa: E402
from kvtrace.versions.registry import resolve_version  # noqa: E402
from kvtrace.replay.engine import ReplayOptions  # noqa: E402
from kvtrace.tui.app import KvtraceApp  # noqa: E402
from kvtrace.tui.remote.link import ChildReplay  # noqa: E402
from kvtrace.tui.remote.replayer import dashboard_job  # noqa: E402
from traces.samples import resolve_trace  # noqa: E402

SIZE = (170, 48)


async def _settle(pilot, until, timeout_s: float = 600.0) -> None:  # noqa: ANN001
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not (pilot.app.frame is not None and until(pilot.app) and pilot.app.frame.busy is None):
        if loop.time() > end:
            raise SystemExit("the dashboard did not settle")
        await pilot.pause(0.05)
    await pilot.pause(1.5)  # row flashes fade


def _link(trace: str, version: str = "builtin") -> ChildReplay:
    """The replay in its own process, paused, as ``kvtrace replay --tui`` starts it."""
    job = dashboard_job(resolve_version(version), str(resolve_trace(trace)), trace_label=trace, page_size=None,
                        pool_tokens=None, device="cpu", options=dataclasses.asdict(ReplayOptions()),
                        play=False)
    link = ChildReplay(job)
    link.wait_started()
    return link


def _app(trace: str) -> KvtraceApp:
    return KvtraceApp(_link(trace))


async def dashboard(out: Path) -> None:
    app = _app("sample:mooncake-conversation")
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("space")  # play to the end, then jump to the peak
        await _settle(pilot, lambda a: a.frame.done)
        await pilot.press("P")
        peak = app.frame.peak()
        await _settle(pilot, lambda a: a.frame.step == peak[0] and not a.frame.playing)
        table = app.main.query_one("#table")
        table.set_sort("allocated", descending=True)
        table.select_rid(int(table.shown_rids[0]))
        await _settle(pilot, lambda a: a.frame.selected_rid is not None and a.frame.page_cells is not None
                      and bool(a.frame.page_cells.highlight.any()))
        app.save_screenshot(str(out / "dashboard.svg"))
        await pilot.press("question_mark")
        await pilot.pause(0.5)
        app.save_screenshot(str(out / "help.svg"))
        await pilot.press("escape", "q")


async def detail(out: Path) -> None:
    app = _app("sample:mooncake-eagle")
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("g", *"400", "enter")
        await _settle(pilot, lambda a: a.frame.step == 400)
        table = app.main.query_one("#table")
        table.set_filter("spec")
        table.set_sort("over")
        table.select_rid(int(table.shown_rids[0]))
        await pilot.press("enter")
        screen = app.screen
        await _settle(pilot, lambda a: "steps changed it" in str(screen.query_one("#detail-events").content))
        app.save_screenshot(str(out / "detail.svg"))
        await pilot.press("escape", "q")


async def diff(out: Path) -> None:
    trace, b = "sample:mooncake-eagle", "pre-encapsulation"
    report = diff_trace(trace, "builtin", b, jobs=1, options=DiffOptions(max_divergences=3))
    app = KvtraceApp([_link(trace), _link(trace, b)], diff=report)
    step = report.divergences[0].divergence.step
    async with app.run_test(size=SIZE) as pilot:
        await _settle(pilot, lambda a: all(f is not None and f.step == step for f in a.frames)
                      and all(f.page_cells is not None for f in a.frames))
        app.save_screenshot(str(out / "diff.svg"))
        await pilot.press("q")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    asyncio.run(detail(args.out))
    asyncio.run(diff(args.out))
    asyncio.run(dashboard(args.out))
    print(f"wrote {', '.join(sorted(p.name for p in args.out.glob('*.svg')))} to {args.out}")


if __name__ == "__main__":
    main()
