"""StepsUpdate: folding a replay's batches of steps as the screen receives them gives the
replay's own fold, and the frames survive a pipe."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtrace.replay import ReplayOptions
from kvtrace.session import ReplaySession
from kvtrace.snapshot import SnapshotBlock
from kvtrace.state import ReplayState
from kvtrace.tui.updates import StepsUpdate, read_update, write_update


def _screen_fold(batch_sizes: list[int], options: ReplayOptions | None = None) -> tuple[ReplayState, ReplayState]:
    """(the replay's fold, the screen's fold of the updates) after replaying sample:tiny
    in batches of ``batch_sizes`` steps (cycled)."""
    with ReplaySession("sample:tiny", track_state=True, screen="inline", options=options or ReplayOptions()) as s:
        screen = ReplayState(s.config.page_size)
        i = 0
        while not s.done:
            snaps = [snap for _ in range(batch_sizes[i % len(batch_sizes)]) if (snap := s.step()) is not None]
            i += 1
            if snaps:
                state = s.state
                assert state is not None
                StepsUpdate.of(SnapshotBlock.of(snaps), state).apply(screen)
        replay = s.state
        assert replay is not None
        return replay, screen


def _assert_same(replay: ReplayState, screen: ReplayState) -> None:
    n = int(replay.seen_rids()[-1]) + 1
    assert n > 10
    for name in replay.rows(np.arange(n)):
        np.testing.assert_array_equal(screen.column(name)[:n], replay.column(name)[:n], err_msg=name)
    assert screen.step == replay.step and screen.pool == replay.pool
    assert screen.timeline.size == replay.timeline.size
    np.testing.assert_array_equal(screen.timeline.counters[: screen.timeline.size],
                                  replay.timeline.counters[: replay.timeline.size])
    assert screen.timeline.events == replay.timeline.events


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, 40), min_size=1, max_size=5))
def test_the_screen_fold_of_updates_is_the_replay_fold(batch_sizes: list[int]) -> None:
    _assert_same(*_screen_fold(batch_sizes))


def test_a_window_starting_with_a_keyframe() -> None:
    # the first snapshot of a --steps window is a keyframe: every request seen is sent
    _assert_same(*_screen_fold([7], ReplayOptions(start_step=40)))


def test_frames_round_trip_and_a_cut_stream_is_an_error() -> None:
    with ReplaySession("sample:tiny", track_state=True, screen="inline") as s:
        snaps = [s.step() for _ in range(20)]
        state = s.state
        assert state is not None
        update = StepsUpdate.of(SnapshotBlock.of(snaps), state)  # type: ignore[arg-type]
    buf = io.BytesIO()
    write_update(buf, update)
    write_update(buf, update)
    data = buf.getvalue()
    stream = io.BytesIO(data)
    for _ in range(2):
        got = read_update(stream)
        assert got is not None and got.num_steps == 20
        np.testing.assert_array_equal(got.rids, update.rids)
        np.testing.assert_array_equal(got.timeline.pools, update.timeline.pools)
        assert got.timeline.events == update.timeline.events
    assert read_update(stream) is None
    cut = io.BytesIO(data[:-3])
    assert read_update(cut) is not None
    with pytest.raises(EOFError, match="inside a frame"):
        read_update(cut)
    with pytest.raises(EOFError, match="length"):
        read_update(io.BytesIO(data[:3]))


@given(st.lists(st.tuples(st.sampled_from(["evict", "finish", "overalloc_release", "oom"]),
                          st.none() | st.integers(0, 2**40), st.integers(-(2**40), 2**40), st.text(max_size=12)),
                max_size=20))
def test_events_travel_in_updates_unchanged(fields: list[tuple[str, int | None, int, str]]) -> None:
    """Events pickle as their constructor's arguments (``Event.__reduce__``): what arrives
    equals what left, field by field and type by type."""
    import pickle

    from kvtrace.snapshot import Event

    events = [Event(kind, rid, tokens, detail) for kind, rid, tokens, detail in fields]  # type: ignore[arg-type]
    back = pickle.loads(pickle.dumps(events, protocol=pickle.HIGHEST_PROTOCOL))
    assert back == events
    assert all(type(e) is Event for e in back)
    assert [(e.kind, e.rid, e.tokens, e.detail) for e in back] == fields
