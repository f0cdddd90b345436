"""``ReplayState.apply_block`` folds to exactly the state ``apply`` reaches step by step, in
any chunking, from snapshots and from a state log's record batches (``block_of``); the
timeline's peak, asked every frame, scans only the rows appended since."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrace.replay import ReplayOptions
from kvtrace.session import ReplaySession
from kvtrace.snapshot import SnapshotBlock, StepSnapshot
from kvtrace.state import ReplayState, Timeline
from kvtrace.statelog import block_of, to_record_batch

_SNAPS: dict[str, list[StepSnapshot]] = {}


def _snaps(trace: str, start: int | None = None) -> list[StepSnapshot]:
    key = f"{trace}@{start}"
    if key not in _SNAPS:
        with ReplaySession(trace, screen="inline", options=ReplayOptions(start_step=start)) as s:
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


def _reference(snaps: list[StepSnapshot], page_size: int) -> ReplayState:
    ref = ReplayState(page_size)
    for snap in snaps:
        ref.apply(snap)
    return ref


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([("sample:tiny", None), ("sample:tiny", 40), ("sample:mooncake-eagle", None)]),
       st.lists(st.integers(1, 300), min_size=1, max_size=40))
def test_a_block_fold_equals_the_step_by_step_fold(case: tuple[str, int | None], cuts: list[int]) -> None:
    trace, start = case
    snaps = _snaps(trace, start)
    ref = _reference(snaps, 16)
    state = ReplayState(16)
    i = 0
    for n in cuts * (len(snaps) // max(sum(cuts), 1) + 1):
        if i >= len(snaps):
            break
        state.apply_block(SnapshotBlock.of(snaps[i : i + n]))
        i += n
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
