"""The dashboard's explain panel (``replay --tui --explain``, the ``e`` key): the selected
request's missed prefix tokens by cause, and ``j`` to the step and request that evicted
them; its snapshots at 80x24 and 120x40."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import settle
from tests.kvtrace.test_explain import _prefill, _trace

P = list(range(200, 208))
BIG = list(range(300, 328))


def _evicting_trace(path: Path) -> Path:
    # 8 pages of 4. rid 0 caches P (8 tokens); rid 1's 28-token prompt at step 3 needs 7
    # pages with 6 free: its admission evicts P. rid 2 (P + 1 token, step 5) misses P:
    # 8 evicted (step 3, admission, request 1) + 1 cold. Decodes after, to step 9.
    steps = [
        [_prefill(0, P)], [("decode", 0, 9, 1)], [("finish", 0, 9, 0)],
        [_prefill(1, BIG)], [("finish", 1, 28, 0)],
        [_prefill(2, [*P, 5])], [("decode", 2, 10, 1)], [("decode", 2, 11, 1)], [("decode", 2, 12, 1)],
        [("finish", 2, 12, 0)],
    ]
    return _trace(path, steps, pool_tokens=32)


def _app(trace: Path, *, explain: bool = True, **kw: Any) -> Any:
    from kvtrace.replay.session import ReplaySession
    from kvtrace.tui.app import KvtraceApp
    from kvtrace.tui.remote.link import ThreadReplay
    from kvtrace.tui.remote.sources import LiveSource

    session = ReplaySession(trace, track_state=True, checker="inline", allocator_in_step=True, checkpoint_every=100,
                            label="evicting.kvtrace")  # a fixed header: the snapshots
    return KvtraceApp(ThreadReplay(LiveSource(session, explain=explain), play=False), **kw)


async def _explain_rid_2(pilot: Any) -> Any:
    """Play to the end, go back to step 1 then to step 6 (no checkpoint that early: the
    replay starts again and replays the admissions of steps 3 and 5 again, which must
    not count twice), select request 2, press e."""
    app = pilot.app
    await settle(pilot, lambda a: not a.frame.playing)
    await pilot.press("space")
    await settle(pilot, lambda a: a.frame.done)
    await pilot.press("g", "1", "enter")
    await settle(pilot, lambda a: a.frame.step == 1)
    await pilot.press("g", "6", "enter")
    await settle(pilot, lambda a: a.frame.step == 6)
    app.main.query_one("#table").select_rid(2)
    await pilot.pause()
    await pilot.press("e")
    screen = app.screen
    await settle(pilot, lambda a: screen.query_one("#explain-panel").explanation is not None)
    return screen


async def test_panel_shows_the_causes_and_jumps_to_the_evicting_step(tmp_path: Path) -> None:
    from kvtrace.tui.screens import ExplainScreen
    from kvtrace.tui.widgets.keybar import KeyBar

    app = _app(_evicting_trace(tmp_path / "t.kvtrace"))
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(pilot, lambda a: True)
        assert "explain" in [h.action for h in app.main.query_one(KeyBar).shown()]
        screen = await _explain_rid_2(pilot)
        assert isinstance(screen, ExplainScreen)
        e = screen.query_one("#explain-panel").explanation
        assert e.rid == 2 and e.missed == 9
        assert {k: v for k, v in e.causes.items() if v} == {"evicted": 8, "cold": 1}
        assert sum(e.causes.values()) == e.missed
        assert e.evictions == [(3, "admission", 1, 1, 8)]
        await pilot.press("j")
        await settle(pilot, lambda a: a.frame.step == 3 and not a.frame.playing)
        assert app.screen is app.main
        assert app.main.query_one("#table").selected_rid == 1


async def test_without_explain_the_key_is_hidden_and_the_replay_unwatched(tmp_path: Path) -> None:
    from kvtrace.tui.widgets.keybar import KeyBar

    app = _app(_evicting_trace(tmp_path / "t.kvtrace"), explain=False)
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(pilot, lambda a: True)
        assert "explain" not in [h.action for h in app.main.query_one(KeyBar).shown()]
        source = app.driver.link.replayer.source
        assert source.explain is None and source.session.observers == []
        assert source.session.allocator.tree_cache.listener is None


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
def test_snapshot(snap_compare: Any, tmp_path: Path, size: tuple[int, int]) -> None:
    trace = _evicting_trace(tmp_path / "t.kvtrace")

    async def run_before(pilot: Any) -> None:
        await _explain_rid_2(pilot)

    assert snap_compare(_app(trace, clock=lambda: 0.0), terminal_size=size, run_before=run_before)


def _child_job(trace: str, **kw: Any) -> Any:
    import dataclasses

    from kvtrace.replay.engine import ReplayOptions
    from kvtrace.tui.remote.replayer import dashboard_job
    from kvtrace.versions.registry import resolve_version

    job = dashboard_job(resolve_version("builtin"), trace, trace_label=trace, page_size=None, pool_tokens=None,
                        device="cpu", options=dataclasses.asdict(ReplayOptions()), play=False, explain=True, **kw)
    return dataclasses.replace(job, side=dataclasses.replace(job.side, checker="inline"))


def test_the_replay_process_answers_explain(tmp_path: Path) -> None:
    # The dashboard's own path: the replay in a process of its own, asked over the link.
    from kvtrace.proc.contracts import Command, Explained, Info
    from kvtrace.tui.remote.link import ChildReplay

    link = ChildReplay(_child_job(str(_evicting_trace(tmp_path / "t.kvtrace"))))
    try:
        link.wait_started()
        link.command(Command("seek", 9))
        link.command(Command("explain", 2))
        got: list[Any] = []
        deadline = 60.0
        import time

        t0 = time.monotonic()
        while not any(isinstance(m, Explained) for m in got) and time.monotonic() - t0 < deadline:
            item = link.get(0.1)
            if item is not None and item[0] == "msg":
                got.append(item[1][1])
        info = next(m for m in got if isinstance(m, Info))
        (answer,) = [m for m in got if isinstance(m, Explained)]
        assert info.explain
        assert answer == Explained(2, 9, {**answer.causes, "cold": 1, "evicted": 8}, [(3, "admission", 1, 1, 8)])
        assert sum(answer.causes.values()) == 9
    finally:
        link.close()


def test_explain_without_a_radix_cache_is_one_line() -> None:
    from kvtrace.tui.remote.link import ChildReplay, ReplayProcessError
    from traces.samples import resolve_trace

    with pytest.raises(ReplayProcessError, match="^the radix cache is off") as info:
        ChildReplay(_child_job(str(resolve_trace("sample:mooncake-gemma-3")))).wait_started(timeout=60)
    assert "\n" not in str(info.value)
