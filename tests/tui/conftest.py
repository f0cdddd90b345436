"""Shared set-up of the dashboard tests: apps over the tiny sample, paused, and a helper
that waits until the replay thread has shown a given step."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kvtrace.replay.session import ReplaySession
from kvtrace.statelog.log import StateLogWriter
from kvtrace.tui.app import KvtraceApp
from kvtrace.tui.remote.link import ThreadReplay
from kvtrace.tui.remote.sources import LiveSource, LogSource

if TYPE_CHECKING:
    from kvtrace.tui.driver import Frame

TINY = "sample:tiny"
SIZE = (160, 48)


def live_app(trace: str = TINY, *, play: bool = False, fixed_clock: bool = False, **session_kw: object) -> KvtraceApp:
    """A dashboard over a live session of ``trace``, replayed in a thread (screened inline:
    no child process; ``test_process.py`` runs the replay in its own process)."""
    session_kw.setdefault("checkpoint_every", 20)
    session = ReplaySession(trace, track_state=True, screen="inline", allocator_in_step=True, **session_kw)  # type: ignore[arg-type]
    link = ThreadReplay(LiveSource(session), play=play)
    if fixed_clock:
        return KvtraceApp(link, clock=lambda: 0.0)
    return KvtraceApp(link)


async def settle(pilot, until: Callable[[KvtraceApp], bool], timeout_s: float = 20.0) -> None:  # noqa: ANN001
    """Let the replay thread work until ``until(app)`` holds (fails after ``timeout_s``)."""
    import time

    app = pilot.app
    t0 = time.monotonic()
    while not (app.frame is not None and until(app)):
        if time.monotonic() - t0 > timeout_s:
            step = app.frame.step if app.frame is not None else None
            raise AssertionError(f"the dashboard did not settle in {timeout_s} s (frame step {step})")
        await pilot.pause(0.02)
    await pilot.pause()


async def play_to_end(pilot) -> Frame:  # noqa: ANN001
    """Once the dashboard shows its first frame (paused), play (space) to the last step;
    the frame shown there."""
    await settle(pilot, lambda a: not a.frame.playing)
    await pilot.press("space")
    await settle(pilot, lambda a: a.frame.done)
    return pilot.app.frame


def at_step(step: int) -> Callable[[KvtraceApp], bool]:
    return lambda app: app.frame.step == step and not app.frame.playing


@pytest.fixture(scope="session")
def tiny_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A state log of the tiny sample (small batches, so seeks cross several)."""
    path = tmp_path_factory.mktemp("logs") / "tiny.log"
    with ReplaySession(TINY, screen="inline") as s:
        info = {"trace": TINY, "allocator": s.version.spec, "config": {"page_size": s.config.page_size,
                                                                       "pool_tokens": s.config.pool_tokens}}
        with StateLogWriter(path, info, steps_per_batch=16) as log:
            for snap in s.snapshots():
                log.write(snap)
    return path


def log_app(path: Path, **kw: object) -> KvtraceApp:
    from kvtrace.statelog.session import StateLogSession

    return KvtraceApp(ThreadReplay(LogSource(StateLogSession(path), label=path.name), play=False), **kw)  # type: ignore[arg-type]


def text_of(widget: object) -> str:
    """The plain text a Static shows (strings, Rich Text or tables)."""
    import io

    from rich.console import Console

    console = Console(width=300, file=io.StringIO(), color_system=None)
    with console.capture() as cap:
        console.print(getattr(widget, "content"))
    return cap.get()
