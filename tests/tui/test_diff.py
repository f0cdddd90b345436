"""``kvtrace diff ... --tui``: the dashboards of A and B side by side at the first divergence
(its step marked on both charts, its request selected on both tables), keys moving both
sides together, ``d`` / ``D`` to the divergences (Pilot and a snapshot; the injected
difference is the ``pre-encapsulation`` version on the tiny sample)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from typer.testing import CliRunner

from kvtrace.cli import app as cli
from kvtrace.diff.diff import DiffOptions, DiffReport, diff_trace
from kvtrace.replay.session import ReplaySession
from kvtrace.tui.app import DIVERGENCE_COLOUR, KvtraceApp
from kvtrace.tui.remote.link import ThreadReplay
from kvtrace.tui.remote.sources import LiveSource
from kvtrace.tui.widgets.request_table import RequestTable
from tests.helpers import SIZE, TINY, text_of

B = "pre-encapsulation"
_REPORT: list[DiffReport] = []


def _report() -> DiffReport:
    if not _REPORT:
        _REPORT.append(diff_trace(TINY, "builtin", B, jobs=1, options=DiffOptions(max_divergences=2)))
    return _REPORT[0]


def diff_app(**kw: object) -> KvtraceApp:
    links = [ThreadReplay(LiveSource(ReplaySession(TINY, version=v, track_state=True, checker="inline",
                                                   checkpoint_every=20)), play=False) for v in ("builtin", B)]
    return KvtraceApp(links, diff=_report(), **kw)  # type: ignore[arg-type]


def both_at(step: int) -> Callable[[KvtraceApp], bool]:
    return lambda app: all(f is not None and f.step == step and not f.playing for f in app.frames)


async def settle_both(pilot, until: Callable[[KvtraceApp], bool], timeout_s: float = 20.0) -> None:  # noqa: ANN001
    import time

    t0 = time.monotonic()
    while not until(pilot.app):
        if time.monotonic() - t0 > timeout_s:
            state = [(f.step if f else None, d.info is not None, d.steps_folded, d._held, d.frames_posted, d.frames_acked)
                     for f, d in zip(pilot.app.frames, pilot.app.drivers)]
            raise AssertionError(f"the sides did not settle: {state}")
        await pilot.pause(0.02)
    await pilot.pause()


@pytest.mark.slow
async def test_the_sides_open_at_the_divergence_and_move_together() -> None:
    report = _report()
    first, second = (d.divergence for d in report.divergences)
    assert (first.step, first.op, first.rid, first.field) == (1, "spec", 0, "kv_allocated_len")
    app = diff_app()
    async with app.run_test(size=SIZE) as pilot:
        await settle_both(pilot, both_at(first.step))
        banner = text_of(app.main.query_one("#divergence"))
        assert "FIRST DIVERGENCE at step 1 (spec), request 0: kv_allocated_len" in banner
        assert f"A builtin {first.a}" in banner and f"B {B} {first.b}" in banner
        a, b = app.frames
        # each side replays its own version: the diverging field differs as the diff said
        assert (int(a.requests.allocated[0]), int(b.requests.allocated[0])) == (first.a, first.b)
        assert [d.side for d in app.dashboards] == [0, 1]  # by side, found once, the screen's own
        assert app.dashboards == list(app.main.query("Dashboard"))
        for dash in app.dashboards:
            assert dash.query_one(RequestTable).selected_rid == 0
            assert dash.query_one("#chart").marks["divergence"] == (first.step, DIVERGENCE_COLOUR)
        await pilot.press("right")
        await settle_both(pilot, both_at(first.step + 1))
        await pilot.press("g", *"50", "enter")
        await settle_both(pilot, both_at(50))
        await pilot.press("d")
        await settle_both(pilot, both_at(first.step))
        await pilot.press("D")  # the next divergence
        await settle_both(pilot, both_at(second.step))
        assert "DIVERGENCE 2 of 2" in text_of(app.main.query_one("#divergence"))
        assert all(d.query_one("#chart").marks["divergence"][0] == second.step for d in app.dashboards)
        assert second.rid is None  # a pool counter: the request stays selected
        assert [d.query_one(RequestTable).selected_rid for d in app.dashboards] == [0, 0]
        await pilot.press("question_mark")
        await pilot.pause()
        assert "both sides to the first divergence" in text_of(app.screen.query_one("#help-body"))
        await pilot.press("escape", "q")


@pytest.mark.slow
def test_diff_screen(snap_compare) -> None:  # noqa: ANN001
    async def run_before(pilot) -> None:  # noqa: ANN001
        await settle_both(pilot, both_at(1))
        await pilot.pause(0.3)

    assert snap_compare(diff_app(clock=lambda: 0.0), terminal_size=SIZE, run_before=run_before)


@pytest.mark.parametrize("extra", [["--json"]])
def test_tui_with_json_is_one_line(extra: list[str]) -> None:
    result = CliRunner().invoke(cli, ["diff", TINY, "--b", B, "--jobs", "1", "--tui", *extra])
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "drop --json" in lines[0], result.output
