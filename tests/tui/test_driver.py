"""The replay driver without a screen: commands in, frames out, errors reported."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from kvtrace.errors import TraceError
from kvtrace.session import ReplaySession
from kvtrace.tui.driver import CellInfo, Failure, Frame, ReplayDriver, RequestHistory
from kvtrace.tui.sources import LiveSource


class _Run:
    """A driver running in a thread, what it posts collected in a queue."""

    def __init__(self, source: object, **kw: object) -> None:
        self.items: queue.Queue[object] = queue.Queue()
        self.driver = ReplayDriver(source, self.items.put, play=False, **kw)  # type: ignore[arg-type]
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
    return LiveSource(ReplaySession("sample:tiny", track_state=True, screen="inline", checkpoint_every=16, allocator_in_step=True))


def test_commands_move_the_replay_and_frames_follow() -> None:
    run = _Run(_live())
    try:
        run.driver.command("cells", 50)
        run.driver.command("step", 30)
        frame = run.wait(lambda f: isinstance(f, Frame) and f.step == 29)
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
        run.wait(lambda f: isinstance(f, Frame) and f.step == 5)  # back where it was
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

    def step(self):  # noqa: ANN201
        raise self.exc

    seek = step

    def page_map(self, n: int, rid: int | None) -> None:
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
