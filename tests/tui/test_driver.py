"""The screen's driver and the replayer, without a screen (the replayer in a thread):
commands in, frames out, errors reported."""

from __future__ import annotations

import dataclasses
import queue
import threading
import time

import pytest

from kvtrace.errors import TraceError
from kvtrace.proc.contracts import Busy, Cells, Status
from kvtrace.replay.session import ReplaySession
from kvtrace.tui.driver import CellInfo, Driver, Failure, Frame, RequestHistory
from kvtrace.tui.remote.link import ThreadReplay
from kvtrace.tui.remote.replayer import FILLING, Replayer
from kvtrace.tui.remote.sources import LiveSource
from kvtrace.tui.widgets.header import ReplayHeader


class _Run:
    """A driver running in a thread over a paused replayer in another, what it posts
    collected in a queue."""

    def __init__(self, source: object, **kw: object) -> None:
        self.items: queue.Queue[object] = queue.Queue()
        self.driver = Driver(ThreadReplay(source, play=False), self.items.put, **kw)  # type: ignore[arg-type]
        self.thread = threading.Thread(target=self.driver.run, daemon=True)
        self.thread.start()

    def wait(self, pred, timeout_s: float = 30.0) -> object:  # noqa: ANN001
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            try:
                item = self.items.get(timeout=0.2)
            except queue.Empty:
                continue
            if isinstance(item, Frame):
                self.driver.ack(item.seq)
            if pred(item):
                return item
        raise AssertionError("the driver did not post what was expected")

    def stop(self) -> None:
        self.driver.stop()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()


def _live() -> LiveSource:
    return LiveSource(ReplaySession("sample:tiny", track_state=True, checker="inline", checkpoint_every=16, allocator_in_step=True))


def test_commands_move_the_replay_and_frames_follow() -> None:
    run = _Run(_live())
    try:
        run.driver.command("cells", 50)
        run.driver.command("step", 30)
        # the page map follows the records that moved the replay (a message of its own)
        frame = run.wait(lambda f: isinstance(f, Frame) and f.step == 29 and f.page_map_step == 29)
        assert frame.page_cells is not None and frame.page_cells.tokens.shape[0] == 50
        assert frame.requests.size > 0 and frame.timeline_size == 30
        run.driver.command("seek", 5)
        run.wait(lambda f: isinstance(f, Frame) and f.step == 5 and f.timeline_size == 30)
        run.driver.command("cell", 0)
        info = run.wait(lambda i: isinstance(i, CellInfo))
        assert info.detail is not None and info.step == 5
        run.driver.command("history", 1)
        history = run.wait(lambda h: isinstance(h, RequestHistory))
        assert history.rid == 1 and history.steps.shape[0] > 0
        assert (history.committed <= history.allocated).all()
        run.driver.command("step", 1)  # the replay came back to step 5 after the history
        run.wait(lambda f: isinstance(f, Frame) and f.step == 6 and f.timeline_size == 30)
        run.driver.command("play")
        last = run.wait(lambda f: isinstance(f, Frame) and f.done)
        assert last.step == 138 and not last.playing
    finally:
        run.stop()


def test_paced_play_follows_simulated_time() -> None:
    run = _Run(_live())
    try:
        run.driver.command("speed", -5)  # 1x real time: the tiny sample spans ~3 s
        run.driver.command("play")
        t0 = time.monotonic()
        run.wait(lambda f: isinstance(f, Frame) and f.time_s >= 0.5, timeout_s=30)
        assert time.monotonic() - t0 >= 0.4
    finally:
        run.stop()


class _Broken:
    """A source whose step raises (a damaged file, or a bug)."""

    def __init__(self, inner: LiveSource, exc: Exception) -> None:
        self.inner, self.exc = inner, exc
        self.info, self.state = inner.info, inner.state
        self.last, self.done = None, False
        self.allocator_step = None

    def set_exact(self, exact: bool) -> None:
        pass

    def step(self):  # noqa: ANN201
        raise self.exc

    seek = step

    def page_map(self, n: int, rid: int | None, pool: int = 0) -> None:
        return None

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("exc", [TraceError("trace x: damaged after step 3"), RuntimeError("boom")])
def test_errors_in_the_replay_are_posted_not_raised(exc: Exception) -> None:
    run = _Run(_Broken(_live(), exc))
    try:
        run.driver.command("step", 1)
        failure = run.wait(lambda f: isinstance(f, Failure))
        assert str(exc) in failure.message
        assert ("internal error" in failure.message) == isinstance(exc, RuntimeError)
        run.wait(lambda f: isinstance(f, Frame) and not f.playing)  # still alive, paused
    finally:
        run.stop()


def test_playing_replays_runs_and_a_pause_lands_where_the_allocator_is() -> None:
    """Playing lets runs of decode steps replay in one call (the allocator ahead of the
    steps sent); once paused, the page map is the allocator's at the step shown."""
    from allocator.ownership import SlotState

    session = ReplaySession("sample:mooncake-tiny", track_state=True, checker="inline", checkpoint_every=500,
                            allocator_in_step=True)
    run = _Run(LiveSource(session))
    try:
        run.driver.command("cells", 64)
        run.driver.command("play")
        run.wait(lambda f: isinstance(f, Frame) and f.step is not None and f.step > 200 and f.playing)
        assert not session.allocator_in_step  # runs allowed while playing
        run.driver.command("pause")
        frame = run.wait(lambda f: isinstance(f, Frame) and not f.playing and f.page_map_step == f.step)
        assert session.allocator_in_step and session.allocator_step == frame.step
        by_state = frame.page_cells.tokens.sum(axis=0)
        assert by_state[SlotState.COMMITTED] == frame.pool.committed
        assert by_state[SlotState.FREE] == frame.pool.available
        assert by_state[SlotState.OVERALLOCATED] + by_state[SlotState.PAGE_TAIL] == frame.pool.overallocated
    finally:
        run.stop()


def test_once_the_replay_stops_playing_it_fills_in_checkpoints_where_it_stopped() -> None:
    """Played with a sparse first pass (a checkpoint every 32 steps, every 8 once filled
    in): at the end, the replayer fills in the checkpoints before the last step, so that
    going back from there replays at most 8 steps; the steps it played stay sparse."""
    session = ReplaySession("sample:tiny", track_state=True, checker="inline", checkpoint_every=8, first_pass_every=32,
                            allocator_in_step=True)
    run = _Run(LiveSource(session))
    try:
        run.driver.command("play")
        frame = run.wait(lambda f: isinstance(f, Frame) and f.done)
        num_steps = frame.timeline_size
        assert num_steps % 32 > 8 and num_steps > 3 * 32  # the last stretch needs filling in
        end = time.monotonic() + 20
        while time.monotonic() < end and num_steps - session._checkpoint_ordinals[-1] > 8:
            time.sleep(0.05)
        ordinals = list(session._checkpoint_ordinals)
        assert num_steps - ordinals[-1] <= 8
        filled = [o for o in ordinals if o % 32]
        assert filled and min(filled) > (num_steps - 1) // 32 * 32  # only in the last stretch
        assert set(range(0, num_steps, 32)) <= set(ordinals)
        run.driver.command("step", -1)
        back = run.wait(lambda f: isinstance(f, Frame) and f.step == frame.step - 1)
        assert back.pool is not None
    finally:
        run.stop()


class _RecordingEnd:
    """A replayer's end that keeps what is sent and says quit once the replay is done and
    has been told nothing for a turn."""

    def __init__(self) -> None:
        self.sent: list[object] = []

    def records(self, update: object) -> None:
        pass

    def send(self, message: object) -> None:
        self.sent.append(message)

    def commands(self, timeout: float) -> list[object] | None:
        done = any(isinstance(m, Status) and m.done for m in self.sent)
        return None if done and self.sent[-1] == Busy(None) else []


def test_the_replayer_says_it_is_busy_while_it_fills_in_checkpoints_and_the_header_shows_it() -> None:
    """The fill where the replay stopped answers no command for a while: the screen is told
    before it starts and after it ends, and the header says so meanwhile."""
    session = ReplaySession("sample:tiny", track_state=True, checker="inline", checkpoint_every=8, first_pass_every=32,
                            allocator_in_step=True)
    end = _RecordingEnd()
    replayer = Replayer(LiveSource(session), end, play=True)  # type: ignore[arg-type]
    filled: list[int] = []
    fill = session.fill_checkpoints

    def counted_fill() -> bool:
        filled.append(len(end.sent))
        return fill()

    session.fill_checkpoints = counted_fill  # type: ignore[method-assign]
    try:
        replayer.run()
    finally:
        session.close()
    assert len(filled) == 1
    busy = [(i, m.what) for i, m in enumerate(end.sent) if isinstance(m, Busy)]
    assert busy == [(filled[0] - 1, FILLING), (len(end.sent) - 1, None)]
    run = _Run(LiveSource(ReplaySession("sample:tiny", track_state=True, checker="inline", allocator_in_step=True)))
    try:
        frame = run.wait(lambda f: isinstance(f, Frame) and f.step is None)
    finally:
        run.stop()
    header = ReplayHeader()
    info = run.driver.info
    assert info is not None
    header.show(info, dataclasses.replace(frame, busy=FILLING))
    assert f"paused · {FILLING}…" in header.content.plain
    header.show(info, frame)
    assert FILLING not in header.content.plain


def test_frames_not_drawn_pass_their_alerts_and_releases_on() -> None:
    """A newer frame replaces an undrawn one in the UI's queue: until the UI acknowledges a
    frame, each new one repeats what the undrawn ones announced (the app notifies once)."""
    items: queue.Queue[object] = queue.Queue()
    session = ReplaySession("sample:tiny", track_state=True, checker="inline", pool_tokens=640, allocator_in_step=True)
    driver = Driver(ThreadReplay(LiveSource(session), play=False), items.put)
    thread = threading.Thread(target=driver.run, daemon=True)
    thread.start()
    try:
        driver.command("play")  # the OOM stops the replay; no frame is acknowledged
        frames: list[Frame] = []
        end = time.monotonic() + 30
        while time.monotonic() < end and not (frames and frames[-1].done and len(frames) >= 2):
            try:
                item = items.get(timeout=0.2)
            except queue.Empty:
                continue
            if isinstance(item, Frame):
                frames.append(item)
        oom = [i for i, f in enumerate(frames) if any(e.kind == "oom" for e in f.alerts)]
        assert oom and oom == list(range(oom[0], len(frames)))  # every later frame repeats it
        released = [f.released for f in frames]
        assert all(a <= b for a, b in zip(released, released[1:]))  # releases accumulate until drawn
        driver.ack(frames[-1].seq)
        driver.command("step", -1)
        later = next(f for f in iter(lambda: items.get(timeout=30), None) if isinstance(f, Frame))
        assert later.alerts == () and later.released == frozenset()
    finally:
        driver.stop()
        thread.join(timeout=10)


def test_the_achieved_speed_is_measured_over_the_last_second_of_frames() -> None:
    from kvtrace.tui.driver import AchievedSpeed

    speed = AchievedSpeed(window_s=1.0)
    assert speed.mark(0.0, 0.0) is None  # one frame: no speed yet
    got = [speed.mark(0.05 * i, 10.0 * i if i != 7 else 60.0) for i in range(1, 41)]  # frame 7 brought no step
    assert all(g is not None and g > 100 for g in got)  # 200x, and never 0x for the frame with no step
    assert got[-1] == pytest.approx(200.0)
    for i in range(41, 61):  # the replay slows to 100x: within a second the speed says so
        last = speed.mark(0.05 * i, 400.0 + 5.0 * (i - 40))
    assert last == pytest.approx(100.0)
    speed.reset()
    assert speed.mark(10.0, 0.0) is None and speed.mark(10.5, 50.0) == pytest.approx(100.0)


class _SlowMap:
    """A source playing forever whose page map takes ``cost_s`` of a fake clock."""

    def __init__(self, clock: list[float], cost_s: float) -> None:
        from types import SimpleNamespace

        from allocator.base import PoolCounters

        self.clock, self.cost_s = clock, cost_s
        self.pool = PoolCounters(1000, 400, 100, 100, 300, 100, 3, 5)
        self.last = SimpleNamespace(step=0)
        self.done = False
        self.allocator_step = 0
        self.maps = 0

    def page_map(self, n: int, rid: int | None, pool: int = 0) -> tuple[None, object]:
        from kvtrace.tui.remote.pagemap import composition_cells

        self.clock[0] += self.cost_s
        self.maps += 1
        return None, composition_cells(self.pool, n)


@pytest.mark.parametrize(("cost_s", "interval_s", "waiting_s"), [(0.01, 5.0, 0.0), (0.2, 20.0, 0.0), (0.01, 5.0, 0.25)])
def test_page_maps_at_full_speed_take_at_most_their_share_of_the_time(cost_s: float, interval_s: float,
                                                                      waiting_s: float) -> None:
    """The share is of the replay's own time: one that also waits for a CPU (``waiting_s``
    of the wall clock each turn, a busy machine) maps no more often per second of its work."""
    from kvtrace.tui.remote.replayer import MAP_SHARE, Replayer

    assert MAP_SHARE == 0.01
    work = [0.0]  # the replay's own seconds: the map's cost goes there
    wall = [0.0]
    source = _SlowMap(work, cost_s)
    sent: list[object] = []
    end = type("End", (), {"send": lambda self, m: sent.append(m)})()
    replayer = Replayer(source, end, play=True, map_interval_s=5.0, clock=lambda: wall[0],  # type: ignore[arg-type]
                        work_clock=lambda: work[0])
    replayer.num_cells = 20
    assert replayer.speed is None and replayer.moving  # as fast as it goes
    at = []
    for step in range(1, 400):
        source.last.step = source.allocator_step = step
        before = source.maps
        replayer._refresh_map(wall[0])
        if source.maps > before:
            at.append(work[0] - cost_s)  # when it began
        work[0] += 0.25
        wall[0] += 0.25 + waiting_s
    gaps = [b - a for a, b in zip(at, at[1:])]
    assert len(gaps) >= 3 and all(interval_s <= g < interval_s + 0.5 for g in gaps), gaps
    assert [type(m) for m in sent] == [Cells] * len(at)
