"""``ReplayState.apply_block`` folds to exactly the state ``apply`` reaches step by step, in
any chunking, from snapshots and from a state log's record batches (``block_of``); the
timeline's peak, asked every frame, scans only the rows appended since."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrace.replay.engine import ReplayOptions
from kvtrace.replay.session import ReplaySession
from kvtrace.replay.snapshot import SnapshotBlock, StepSnapshot
from kvtrace.replay.state import ReplayState, Timeline
from kvtrace.statelog.log import block_of, to_record_batch

_SNAPS: dict[str, list[StepSnapshot]] = {}


def _snaps(trace: str, start: int | None = None) -> list[StepSnapshot]:
    key = f"{trace}@{start}"
    if key not in _SNAPS:
        with ReplaySession(trace, checker="inline", options=ReplayOptions(start_step=start)) as s:
            _SNAPS[key] = list(s.snapshots())
    return _SNAPS[key]


def _same(a: ReplayState, b: ReplayState) -> None:
    assert a.step == b.step and a.pool == b.pool
    n = int(a.seen_rids()[-1]) + 1
    assert np.array_equal(a.seen_rids(), b.seen_rids())
    for name in ("phase", "allocated", "committed", "protected", "prefix_hit", "admitted_step", "ended_step",
                 "last_step", "admissions"):
        assert np.array_equal(a.column(name)[:n], b.column(name)[:n]), name
    ta, tb = a.timeline, b.timeline
    assert ta.size == tb.size
    assert np.array_equal(ta.steps[: ta.size], tb.steps[: tb.size])
    assert np.array_equal(ta.counters[: ta.size], tb.counters[: tb.size])
    assert ta.events == tb.events


def _blocks(snaps: list[StepSnapshot], cuts: list[int]) -> list[SnapshotBlock]:
    """``snaps`` in blocks of ``cuts`` steps (cycled), in order."""
    blocks, i = [], 0
    for n in cuts * (len(snaps) // max(sum(cuts), 1) + 1):
        if i >= len(snaps):
            break
        blocks.append(SnapshotBlock.of(snaps[i : i + n]))
        i += n
    return blocks


_CASES = st.sampled_from([("sample:tiny", None), ("sample:tiny", 40), ("sample:mooncake-eagle", None)])


def _reference(snaps: list[StepSnapshot], page_size: int) -> ReplayState:
    ref = ReplayState(page_size)
    for snap in snaps:
        ref.apply(snap)
    return ref


@settings(max_examples=30, deadline=None)
@given(_CASES, st.lists(st.integers(1, 300), min_size=1, max_size=40))
@pytest.mark.slow
def test_a_block_fold_equals_the_step_by_step_fold(case: tuple[str, int | None], cuts: list[int]) -> None:
    trace, start = case
    snaps = _snaps(trace, start)
    ref = _reference(snaps, 16)
    state = ReplayState(16)
    for block in _blocks(snaps, cuts):
        state.apply_block(block)
    _same(state, ref)


@pytest.mark.parametrize("start", [None, 40])
def test_a_record_batch_folds_like_its_snapshots(start: int | None) -> None:
    snaps = _snaps("sample:tiny", start)  # a window: its first step is a keyframe
    assert snaps[0].keyframe == (start is not None)
    state = ReplayState(16)
    for i in range(0, len(snaps), 25):
        state.apply_block(block_of(to_record_batch(snaps[i : i + 25])))
    _same(state, _reference(snaps, 16))


def test_steps_already_known_extend_nothing_twice() -> None:
    snaps = _snaps("sample:tiny")
    state = ReplayState(16)
    state.apply_block(SnapshotBlock.of(snaps[:60]))
    state.apply_block(SnapshotBlock.of(snaps[30:90]))  # replayed again after a seek back
    assert state.timeline.size == 90
    assert [e.step for e in state.timeline.events] == sorted(e.step for e in state.timeline.events)
    assert state.timeline.events == _reference(snaps[:90], 16).timeline.events


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 60)), min_size=1, max_size=300), st.data())
def test_the_peak_asked_as_the_timeline_grows_is_the_first_highest_use(rows: list[tuple[int, int]], data: st.DataObject) -> None:
    timeline = Timeline()
    n = len(rows)
    timeline.steps = np.arange(n, dtype=np.int64) * 3
    timeline.counters = np.zeros((n, len(Timeline._FIELDS)), np.int64)
    timeline.counters[:, 0] = 128  # pool_tokens; available, evictable below
    timeline.counters[:, 1:3] = rows
    timeline.size = n
    sizes = data.draw(st.lists(st.integers(1, n), min_size=1, max_size=8))  # growing, then any
    for size in sorted(sizes) + sizes:
        used = 128 - timeline.counters[:size, 1] - timeline.counters[:size, 2]
        k = int(np.argmax(used))
        assert timeline.peak(size) == (int(timeline.steps[k]), int(used[k]))


@settings(max_examples=10, deadline=None)
@given(fold_at=st.lists(st.integers(1, 1452), max_size=12))
@pytest.mark.slow
def test_a_session_folds_a_runs_last_step_only_to_the_same_state(fold_at: list[int]) -> None:
    # The dashboard's replay makes a block whenever it sends an update: a run's steps may
    # fall on either side of a block. Folding only each run's last step in a block must reach
    # the state that folding every step of every run reaches.
    stops = set(fold_at)
    with ReplaySession("sample:mooncake-tiny", checker="inline", track_state=True) as runs:
        ref = ReplayState(runs.config.page_size)
        n = in_runs = 0
        while (snap := runs.step()) is not None:
            ref.apply(snap)
            n += 1
            in_runs += bool(runs._pending)  # a step of a run with more steps to return
            if n in stops:
                assert runs.take_block() is not None
                assert runs.state is not None
                _same(runs.state, ref)
        assert in_runs > 10  # the trace has runs to fold
        assert runs.state is not None
        _same(runs.state, ref)


def test_a_fold_leaves_out_the_rows_a_run_overwrites() -> None:
    with ReplaySession("sample:mooncake-tiny", checker="inline", track_state=True) as s:
        while len(s._pending) < 2:  # the first step of a run of three or more
            assert s.step() is not None
        s.take_block()  # the run's first step, and what came before it
        shown = []
        while s._pending:
            shown.append(s.step())
        block = s.take_block()
        assert block is not None and block.num_steps == len(shown) >= 2
        assert block.row_counts[:-1].tolist() == [0] * (len(shown) - 1)  # overwritten by the last
        assert block.row_counts[-1] == shown[-1].requests.num_requests > 0


def test_a_block_leaves_out_the_rows_asked() -> None:
    snaps = _snaps("sample:tiny")[:20]
    rows = [i % 3 != 1 for i in range(20)]
    block = SnapshotBlock.of(snaps, rows)
    assert block.num_steps == 20 and block.steps.tolist() == [s.step for s in snaps]
    for i, s in enumerate(snaps):
        assert block.row_counts[i] == (s.requests.num_requests if rows[i] else 0)
    kept = SnapshotBlock.of([s for s, r in zip(snaps, rows) if r])
    assert np.array_equal(block.requests.rids, kept.requests.rids)


@settings(max_examples=15, deadline=None)
@given(_CASES, st.lists(st.integers(1, 120), min_size=1, max_size=12))
@pytest.mark.slow
def test_blocks_joined_fold_to_the_step_by_step_fold(case: tuple[str, int | None], cuts: list[int]) -> None:
    # a replay session folds the blocks it hands out joined (SnapshotBlock.concat)
    trace, start = case
    snaps = _snaps(trace, start)
    blocks = _blocks(snaps, cuts)
    joined = SnapshotBlock.concat(blocks)
    assert joined.num_steps == len(snaps) and joined.requests.num_requests == sum(s.requests.num_requests for s in snaps)
    assert joined.steps.tolist() == [s.step for s in snaps]
    state = ReplayState(16)
    state.apply_block(joined)
    _same(state, _reference(snaps, 16))
    assert SnapshotBlock.concat(blocks[:1]) is blocks[0]
    assert SnapshotBlock.concat([]).num_steps == 0
