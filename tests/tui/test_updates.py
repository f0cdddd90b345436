"""Updates: the blocks a replay session makes of the steps it returns
(``ReplaySession.take_block``), folded by a screen as they arrive, give the replay's own
fold; and they survive a pipe."""

from __future__ import annotations

import os
import struct
from multiprocessing.connection import Connection

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtrace.replay.engine import ReplayOptions
from kvtrace.replay.session import ReplaySession
from kvtrace.replay.snapshot import PoolCounters, RequestDelta, SnapshotBlock
from kvtrace.replay.state import ReplayState
from kvtrace.proc.channel import connection
from kvtrace.tui.remote.updates import decode_update, encode_update, read_update, write_update


def _screen_fold(trace: str, batch_sizes: list[int], options: ReplayOptions | None = None,
                 ) -> tuple[ReplayState, ReplayState, int]:
    """(the replay's fold, the screen's fold of the session's blocks, rows left out of
    them) after replaying ``trace`` in batches of ``batch_sizes`` steps (cycled), the
    replay's state read now and then between them as a dashboard's replay does."""
    with ReplaySession(trace, track_state=True, checker="inline", options=options or ReplayOptions()) as s:
        screen = ReplayState(s.config.page_size)
        i = left_out = 0
        while not s.done:
            snaps = [snap for _ in range(batch_sizes[i % len(batch_sizes)]) if (snap := s.step()) is not None]
            i += 1
            if not snaps:
                continue
            block = s.take_block()
            assert block is not None and block.steps.tolist() == [snap.step for snap in snaps]
            left_out += sum(snap.requests.num_requests for snap in snaps) - block.requests.num_requests
            screen.apply_block(block)
            if i % 3 == 0:
                assert s.state is not None  # the replay folds what it has made blocks of
        replay = s.state
        assert replay is not None
        return replay, screen, left_out


def _assert_same(replay: ReplayState, screen: ReplayState) -> None:
    n = int(replay.seen_rids()[-1]) + 1
    assert n > 10
    for name in ("phase", "allocated", "committed", "protected", "prefix_hit", "admitted_step", "ended_step",
                 "last_step", "admissions"):
        np.testing.assert_array_equal(screen.column(name)[:n], replay.column(name)[:n], err_msg=name)
    assert screen.step == replay.step and screen.pool == replay.pool
    assert screen.timeline.size == replay.timeline.size
    np.testing.assert_array_equal(screen.timeline.counters[: screen.timeline.size],
                                  replay.timeline.counters[: replay.timeline.size])
    assert screen.timeline.events == replay.timeline.events


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, 40), min_size=1, max_size=5))
def test_the_screen_fold_of_updates_is_the_replay_fold(batch_sizes: list[int]) -> None:
    replay, screen, _ = _screen_fold("sample:tiny", batch_sizes)
    _assert_same(replay, screen)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(2, 300), min_size=1, max_size=4))
def test_blocks_that_leave_out_the_rows_of_decode_runs_fold_to_the_replay_fold(batch_sizes: list[int]) -> None:
    # mooncake-tiny has runs of decode steps, which the replay returns a step at a time:
    # a batch may end inside a run, whose next steps come in the next block
    replay, screen, left_out = _screen_fold("sample:mooncake-tiny", batch_sizes)
    assert left_out > 0
    _assert_same(replay, screen)


def test_a_window_starting_with_a_keyframe() -> None:
    # the first snapshot of a --steps window is a keyframe: every request seen is sent
    replay, screen, _ = _screen_fold("sample:tiny", [7], ReplayOptions(start_step=40))
    _assert_same(replay, screen)


def _assert_same_block(got: SnapshotBlock, sent: SnapshotBlock) -> None:
    for name in SnapshotBlock._fields:
        a, b = getattr(got, name), getattr(sent, name)
        if name == "requests":
            for field, x, y in zip(RequestDelta._fields, a, b, strict=True):
                assert x.dtype == y.dtype, field
                np.testing.assert_array_equal(x, y, err_msg=field)
        elif isinstance(b, np.ndarray):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            np.testing.assert_array_equal(a, b, err_msg=name)
        else:
            assert a == b, name


def _pipe() -> tuple[Connection, Connection]:
    read_fd, write_fd = os.pipe()
    return connection(read_fd, writable=False), connection(write_fd, readable=False)


@pytest.mark.parametrize("exact", [False, True])
def test_updates_round_trip_through_a_pipe_and_a_cut_stream_is_an_error(exact: bool) -> None:
    # (exact: the steps carry the allocator's state digests, which travel with the events)
    with ReplaySession("sample:tiny", track_state=True, checker="inline", options=ReplayOptions(state_digest=exact)) as s:
        snaps = [s.step() for _ in range(20)]
        update = SnapshotBlock.of(snaps)  # type: ignore[arg-type]
        quiet = SnapshotBlock.of([snap for snap in snaps if not snap.events][:3])  # type: ignore[misc]
    assert update.events and (all(d is not None for d in update.digests) if exact else update.digests == [None] * 20)
    reader, writer = _pipe()
    for block in (update, quiet, update):
        write_update(writer, block)
    writer.close()
    for block in (update, quiet, update):
        got = read_update(reader)
        assert got is not None
        _assert_same_block(got, block)
    got.requests.allocated[:] = 0  # the columns are the reader's own (writable)
    assert read_update(reader) is None
    reader.close()
    # the same bytes cut short: the last update ends inside its message
    raw_read, raw_write = os.pipe()
    framed = connection(raw_write, readable=False)
    framed.send_bytes(encode_update(quiet))
    framed.close()
    data = os.read(raw_read, 1 << 20)
    os.close(raw_read)
    cut_read, cut_write = os.pipe()
    os.write(cut_write, data[:-3])
    os.close(cut_write)
    with pytest.raises(OSError, match="end of file during message"):
        read_update(connection(cut_read, writable=False))


def test_a_damaged_update_is_an_error() -> None:
    with ReplaySession("sample:tiny", track_state=True, checker="inline") as s:
        update = SnapshotBlock.of([s.step() for _ in range(5)])  # type: ignore[misc]
    data = bytearray(encode_update(update))
    data[8] += 1  # (after the magic and the pool counters) one more step than the update holds
    with pytest.raises(ValueError, match="a damaged update frame .* 6 steps"):
        decode_update(data)
    junk = bytearray(b"not an update, and longer than a header")
    with pytest.raises(ValueError, match="not an update frame .it begins b'not an u'"):
        decode_update(junk)
    with pytest.raises(ValueError, match="shorter than its header"):
        decode_update(bytearray(b"KVU1"))


@given(st.lists(st.tuples(st.sampled_from(["evict", "finish", "overalloc_release", "oom"]),
                          st.none() | st.integers(0, 2**40), st.integers(-(2**40), 2**40), st.text(max_size=12)),
                max_size=20))
def test_events_travel_in_updates_unchanged(fields: list[tuple[str, int | None, int, str]]) -> None:
    """Events pickle as their constructor's arguments (``Event.__reduce__``): what arrives
    equals what left, field by field and type by type."""
    import pickle

    from kvtrace.replay.snapshot import Event

    events = [Event(kind, rid, tokens, detail) for kind, rid, tokens, detail in fields]  # type: ignore[arg-type]
    back = pickle.loads(pickle.dumps(events, protocol=pickle.HIGHEST_PROTOCOL))
    assert back == events
    assert all(type(e) is Event for e in back)
    assert [(e.kind, e.rid, e.tokens, e.detail) for e in back] == fields


def test_every_pool_of_a_hybrid_replay_travels_and_full_attention_frames_keep_their_size() -> None:
    # A hybrid SWA replay: the sliding-window pool's counters reach the screen's fold.
    with ReplaySession("sample:mooncake-gpt-oss", track_state=True, checker="inline",
                       options=ReplayOptions(stop_step=400)) as s:
        screen = ReplayState(s.config.page_size)
        while not s.done:
            if not [snap for _ in range(37) if (snap := s.step()) is not None]:
                continue
            block = s.take_block()
            assert block is not None and block.other_pools is not None
            got = decode_update(bytearray(encode_update(block)))
            _assert_same_block(got, block)
            screen.apply_block(got)
        replay = s.state
        assert replay is not None and len(replay.other_pools) == 1
        assert screen.other_pools == replay.other_pools == s.last.other_pools
        assert screen.timeline.num_pools == 2
        n = screen.timeline.size
        np.testing.assert_array_equal(screen.timeline.other[:n], replay.timeline.other[:n])
        assert screen.timeline.peak(pool=1) == replay.timeline.peak(pool=1)
        assert screen.timeline.peak(pool=1) != screen.timeline.peak()
    # A full-attention block: one pool's counters a step, as before.
    with ReplaySession("sample:tiny", track_state=True, checker="inline") as s:
        for _ in range(20):
            s.step()
        block = s.take_block()
        assert block is not None and block.other_pools is None
        body = encode_update(block)
        k, r = block.num_steps, block.requests.num_requests
        _, num_pool, _, _, tail = struct.unpack_from("<4sIQQQ", body)
        nf = len(PoolCounters._fields)
        assert num_pool == nf
        assert len(body) == 32 + 8 * k * nf + k * (4 * 8 + 4 + 1) + r * (5 * 8 + 2) + tail
        got = decode_update(bytearray(body))
        assert got.other_pools is None
        _assert_same_block(got, block)
