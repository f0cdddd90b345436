"""The replay session: effective configuration, seek through checkpoints, windows,
the over-allocation ledger, and the per-request state fold."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.errors import ConfigError
from kvtrace.replay.engine import ReplayOptions
from kvtrace.replay.session import ReplaySession
from kvtrace.replay.snapshot import PHASES, UNCHANGED_OP, StepSnapshot
from kvtrace.replay.state import ReplayState
from kvtrace.statelog.log import StateLogWriter, read_state_log
from tests.helpers import make_meta, write_steps
from traces.batches import StepBatch
from traces.metadata import SpecSettings
from traces.synth import generate

runner = CliRunner()


@pytest.fixture(scope="module")
def busy_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every op kind: chunked prefill, spec and plain decode, PD prealloc, retract, abort."""
    path = tmp_path_factory.mktemp("session") / "busy.kvtrace"
    generate(
        path, num_requests=50, seed=5, page_size=16, spec=True, pd_decode=True,
        retract_prob=0.05, abort_prob=0.03, prefix_groups=2, continue_prob=0.5, steps_per_batch=3,
    )
    return path


def session(path: Path | str, **kwargs: object) -> ReplaySession:
    options = kwargs.pop("options", None) or ReplayOptions()
    return ReplaySession(path, checker="inline", options=options, **kwargs)  # type: ignore[arg-type]


def same_snapshot(a: StepSnapshot, b: StepSnapshot) -> None:
    assert a.step == b.step and a.time_s == b.time_s
    assert a.pool == b.pool
    for x, y in zip(a.requests, b.requests):
        np.testing.assert_array_equal(x, y)
    assert a.events == b.events and a.num_ops == b.num_ops


# -- one place decides the configuration -----------------------------------------------


def test_a_page_size_that_conflicts_with_the_version_is_one_error_naming_both() -> None:
    result = runner.invoke(app, ["replay", "sample:tiny", "--page-size", "4", "--allocator", "paged:16"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--page-size 4" in lines[0] and "paged:16" in lines[0]
    with pytest.raises(ConfigError, match="conflicts"):
        session("sample:tiny", version="token", page_size=16)


def test_the_summary_reports_the_configuration_the_allocator_ran_with() -> None:
    with session("sample:tiny", version="paged:32", pool_tokens=4010) as s:
        result = s.run()
        assert s.allocator.config.page_size == 32
        assert s.allocator.counters().pool_tokens == 4000  # 4010 rounded down to whole pages
    summary = result.to_dict()
    assert summary["page_size"] == 32 and summary["pool_tokens"] == 4000
    # the same page size asked twice is no conflict
    with session("sample:tiny", version="paged:32", page_size=32) as s:
        assert s.config.page_size == 32


# -- seek ------------------------------------------------------------------------------


def straight_run(path: Path, **kwargs: object) -> tuple[list[StepSnapshot], dict[int, str]]:
    """Every snapshot, and the allocator's state digest after every step (runs of decode
    steps replayed one by one, so the allocator is in step with every snapshot)."""
    snaps, digests = [], {}
    options = kwargs.pop("options", None) or ReplayOptions()
    with session(path, options=dataclasses.replace(options, decode_runs=False), **kwargs) as s:
        for snap in s.snapshots():
            snaps.append(snap)
            digests[snap.step] = s.allocator.save_state().digest()
    return snaps, digests


@pytest.mark.slow
@pytest.mark.parametrize(("first_pass_every", "in_step"), [(None, False), (27, False), (27, True)])
def test_seek_forwards_and_backwards_gives_the_straight_run_state(
    busy_trace: Path, first_pass_every: int | None, in_step: bool
) -> None:
    """Also with a sparse first pass (seeks fill checkpoints in) and with the allocator
    kept at the step shown (a dashboard's: a seek replays decode runs up to its target)."""
    snaps, digests = straight_run(busy_trace)
    by_step = {snap.step: snap for snap in snaps}
    rng = random.Random(7)
    targets = [rng.choice(snaps).step for _ in range(25)] + [snaps[0].step, snaps[-1].step, snaps[3].step]
    with session(busy_trace, checkpoint_every=9, first_pass_every=first_pass_every, allocator_in_step=in_step) as s:
        s.run()
        assert s.num_checkpoints >= len(snaps) // (first_pass_every or 9)
        for target in targets:
            snap = s.seek(target)
            assert snap is not None and snap.step == target
            assert s.allocator_step == target
            same_snapshot(snap, by_step[target])
            assert s.allocator.save_state().digest() == digests[target], f"state differs after seek({target})"
        # going on from a seek replays the rest exactly
        s.seek(snaps[10].step)
        rest = list(s.snapshots())
        assert [x.step for x in rest] == [x.step for x in snaps[11:]]
        for a, b in zip(rest, snaps[11:]):
            same_snapshot(a, b)
        assert s.result().to_dict()["evicted_tokens"] == straight_summary(busy_trace)["evicted_tokens"]


def straight_summary(path: Path) -> dict:
    with session(path) as s:
        return s.run().to_dict()


def test_seek_without_checkpoints_replays_from_the_start(busy_trace: Path) -> None:
    snaps, digests = straight_run(busy_trace)
    with session(busy_trace) as s:
        assert not s.checkpointable
        s.seek(snaps[40].step)
        s.seek(snaps[5].step)
        assert s.last is not None and s.last.step == snaps[5].step
        assert s.allocator.save_state().digest() == digests[snaps[5].step]


def test_seek_between_steps_lands_on_the_step_before(tmp_path: Path) -> None:
    meta = make_meta(page_size=1, pool_tokens=512)
    steps = [
        StepBatch.from_columns(0, 0.0, op=["extend"], rid=[0], seq_len=[10], append_len=[10], prompt_len=[10]),
        StepBatch.from_columns(5, 0.5, op=["decode"], rid=[0], seq_len=[11], append_len=[1]),
        StepBatch.from_columns(9, 0.9, op=["finish"], rid=[0], seq_len=[11], append_len=[0]),
    ]
    path = write_steps(tmp_path / "gaps.kvtrace", steps, meta=meta)
    with session(path, checkpoint_every=1) as s:
        s.run()
        assert s.seek(7).step == 5  # type: ignore[union-attr]
        assert s.seek(-3).step == 0  # before the first step: the first step  # type: ignore[union-attr]
        assert s.seek(100).step == 9  # type: ignore[union-attr]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), every=st.integers(1, 20), picks=st.lists(st.floats(0, 1), min_size=3, max_size=8))
@pytest.mark.slow
def test_random_traces_seek_to_the_straight_run_state(tmp_path: Path, seed: int, every: int, picks: list[float]) -> None:
    path = tmp_path / f"r{seed}.kvtrace"
    page_size = [1, 16, 64][seed % 3]
    generate(path, num_requests=12, seed=seed, page_size=page_size, spec=bool(seed % 2), chunk_size=max(3 * page_size - 5, 24),
             retract_prob=0.05, abort_prob=0.05, steps_per_batch=1 + seed % 5, overwrite=True)
    snaps, digests = straight_run(path)
    with session(path, checkpoint_every=every) as s:
        for p in picks:
            target = snaps[min(int(p * len(snaps)), len(snaps) - 1)].step
            snap = s.seek(target)
            assert snap is not None and snap.step == target
            assert s.allocator.save_state().digest() == digests[target]


def _counting_steps(s: ReplaySession) -> list[int]:
    """``[steps, one by one]``: the steps ``s``'s engine replays from now on, and how many
    of them it replays by themselves (not in a run of decode steps)."""
    count = [0, 0]
    engine = s.engine
    one, run = engine.replay_step, engine.replay_run

    def replay_step(batch: StepBatch) -> StepSnapshot | None:
        count[0] += 1
        count[1] += 1
        return one(batch)

    def replay_run(op: int, steps: np.ndarray, *args: object) -> list[StepSnapshot] | None:
        count[0] += int(steps.shape[0])
        return run(op, steps, *args)  # type: ignore[arg-type]

    engine.replay_step, engine.replay_run = replay_step, replay_run  # type: ignore[method-assign]
    return count


def test_a_sparse_first_pass_is_filled_in_by_seeks_back_and_where_the_replay_is(busy_trace: Path) -> None:
    """``first_pass_every=15`` (checkpoints every 5): the first pass takes one every 15
    steps; a seek into a stretch replays at most 15 steps and leaves one every 5 on its
    way, so a seek just before its target replays at most 5; ``fill_checkpoints`` does
    the same up to the step shown and changes nothing else."""
    with session(busy_trace, checkpoint_every=5) as dense:
        dense.run()
        step_of = {c.ordinal: c.next_step for c in dense._checkpoints}  # every 5th step
        num_dense = dense.num_checkpoints
    with session(busy_trace, checkpoint_every=5, first_pass_every=15, track_state=True) as s:
        s.run()
        ordinals = [c.ordinal for c in s._checkpoints]
        assert np.diff(ordinals).max() <= 15 and np.diff(ordinals)[:-1].min() >= 15
        assert len(ordinals) <= num_dense // 2
        # a target in the middle of a stretch, far from the end
        lo = ordinals[len(ordinals) // 2]
        count = _counting_steps(s)
        s.seek(step_of[lo + 10] - 1)  # the step before the dense checkpoint at lo + 10
        assert 5 < count[0] <= 15
        assert lo + 5 in [c.ordinal for c in s._checkpoints]  # filled in on the way
        count[0] = 0
        s.seek(step_of[lo + 5] + 1)
        assert count[0] <= 5


def test_a_first_pass_paced_in_seconds_takes_one_once_that_much_work_has_passed(busy_trace: Path) -> None:
    """``first_pass_seconds=10`` with a work clock that advances a second a step shown
    (checkpoints every 3 once filled in): the first pass takes one every 10 steps, not
    every 3; seeks back still land exactly on the straight run's state and fill in one
    every 3 steps on their way; the interval doubles with the steps' when the budget
    thins them out."""
    snaps, digests = straight_run(busy_trace)
    ticks = [0.0]
    with session(busy_trace, checkpoint_every=3, first_pass_seconds=10.0, work_clock=lambda: ticks[0],
                 allocator_in_step=True) as s:
        while s.step() is not None:
            ticks[0] += 1.0
        ordinals = [c.ordinal for c in s._checkpoints]
        assert len(ordinals) >= 4 and set(np.diff(ordinals).tolist()) == {10}
        lo = ordinals[len(ordinals) // 2]
        count = _counting_steps(s)
        target = snaps[lo + 8].step
        snap = s.seek(target)
        assert snap is not None and snap.step == target and count[0] == 9
        assert s.allocator.save_state().digest() == digests[target]
        assert {lo + 3, lo + 6} <= {c.ordinal for c in s._checkpoints}  # filled in on the way
        count[0] = 0
        s.seek(snaps[lo + 7].step)
        assert count[0] == 2  # from the one at lo + 6
    with session(busy_trace, checkpoint_every=3, first_pass_seconds=10.0, work_clock=lambda: ticks[0],
                 checkpoint_budget=1) as thin:
        for _ in range(40):
            thin.step()
            ticks[0] += 1.0
        assert thin.checkpoint_every > 3 and thin.first_pass_seconds == 10.0 * thin.checkpoint_every / 3


@pytest.mark.slow
def test_a_first_pass_paced_in_seconds_does_not_cut_runs_of_decode_steps_where_it_reads_the_clock() -> None:
    """Its probes (every step from the third after a checkpoint, none of them due) leave
    the runs of decode steps as a session without checkpoints replays them: as many
    allocator calls (on a sample with runs of them)."""
    def run_calls(**kwargs: object) -> int:
        with session("sample:mooncake-tiny", **kwargs) as s:
            calls = [0]
            run = s.engine.replay_run

            def counted(*args: object) -> object:
                calls[0] += 1
                return run(*args)  # type: ignore[arg-type]

            s.engine.replay_run = counted  # type: ignore[method-assign]
            s.run()
            return calls[0]

    plain = run_calls()
    assert plain > 20
    assert run_calls(checkpoint_every=3, first_pass_seconds=1e9) == plain
    assert run_calls(checkpoint_every=3) > plain  # (dense checkpoints do cut them)


def test_a_first_pass_interval_in_steps_and_in_seconds_are_refused_together(busy_trace: Path) -> None:
    with pytest.raises(ConfigError, match="not both"):
        session(busy_trace, checkpoint_every=3, first_pass_every=9, first_pass_seconds=1.0)
    with pytest.raises(ConfigError, match="> 0 seconds"):
        session(busy_trace, checkpoint_every=3, first_pass_seconds=0.0)


def test_fill_checkpoints_where_a_sparse_first_pass_stopped(busy_trace: Path) -> None:
    """Paused 12 steps past a first-pass checkpoint (every 15; 5 after a fill):
    ``fill_checkpoints`` replays those 12 steps again, leaves checkpoints 5 and 10 steps
    past it, and changes nothing: the state and the steps that follow are the straight
    run's."""
    snaps, digests = straight_run(busy_trace)
    with session(busy_trace, checkpoint_every=5, first_pass_every=15, track_state=True) as s:
        for _ in range(15 * 3 + 12):
            s.step()
        last = s.last
        assert last is not None and last.step == snaps[15 * 3 + 11].step
        assert [c.ordinal for c in s._checkpoints] == [0, 15, 30, 45]
        assert s.state is not None
        table = s.state.table()
        count = _counting_steps(s)
        assert s.fill_checkpoints()
        assert count[0] == 12
        assert [c.ordinal for c in s._checkpoints] == [0, 15, 30, 45, 50, 55]
        assert s.last is not None
        same_snapshot(s.last, last)
        assert s.allocator.save_state().digest() == digests[last.step]
        assert s.state.table() == table
        assert not s.fill_checkpoints()  # nothing left to fill here
        count[0] = 0
        assert s.seek(snaps[15 * 3 + 9].step) is not None
        assert count[0] == 5  # from the checkpoint at 55 (before the 56th step)
        s.seek(last.step)
        rest = list(s.snapshots())
        assert [x.step for x in rest] == [x.step for x in snaps[15 * 3 + 12:]]
        for a, b in zip(rest, snaps[15 * 3 + 12:]):
            same_snapshot(a, b)


@pytest.mark.slow
def test_a_window_that_starts_inside_a_decode_run_starts_at_its_first_step() -> None:
    """``--steps S:`` with S inside a run of decode steps: the window's first snapshot is
    step S (a keyframe), and it holds every step from S (a run replayed in one call
    before the window was entered dropped its steps: 1089: began at 1093)."""
    trace = "sample:mooncake-tiny"  # long decode runs
    with session(trace) as s:
        steps = [snap.step for snap in s.snapshots()]
    k = len(steps) * 3 // 4
    for start in steps[k : k + 6]:
        with session(trace, options=ReplayOptions(start_step=start)) as s:
            got = [snap.step for snap in s.snapshots()]
        assert got == [x for x in steps if x >= start], f"window from {start}"


def test_checkpoints_do_not_split_the_decode_runs_before_the_window() -> None:
    """No checkpoint is taken before a ``--steps`` window's start, so none cuts the runs
    of decode steps replayed there short: reaching the window's first step replays as
    many steps one by one with checkpoints as without."""
    trace = "sample:mooncake-tiny"  # long decode runs
    with session(trace) as s:
        snaps = list(s.snapshots())
    start = snaps[len(snaps) * 3 // 4].step
    one_by_one = []
    for every in (None, 5):
        with session(trace, checkpoint_every=every, options=ReplayOptions(start_step=start)) as s:
            count = _counting_steps(s)
            first = s.step()
            assert first is not None and first.step == start
            one_by_one.append(count[1])
    assert one_by_one[0] < len(snaps) * 3 // 4  # runs replayed some of the steps before the window
    assert one_by_one[1] == one_by_one[0]


def test_checkpoints_stay_within_their_budget(busy_trace: Path) -> None:
    with session(busy_trace, checkpoint_every=1, checkpoint_budget=300_000) as s:
        s.run()
        assert s.checkpoint_bytes <= 300_000 + max(c.nbytes for c in s._checkpoints)
        assert s.checkpoint_every > 1  # thinned out and doubled
        last = s.last
        assert last is not None
        assert s.seek(last.step // 2) is not None


def test_the_checkpoints_memory_counts_what_they_share_once(busy_trace: Path) -> None:
    """``checkpoint_bytes``, kept as checkpoints come and are thinned out, equals the sum
    over the checkpoints held, with the memory they share (the tree's keys and slot
    arrays) counted once."""

    def counted_afresh(s: ReplaySession) -> int:
        shared: dict[int, int] = {}
        for c in s._checkpoints:
            shared.update(c.allocator.shared())
        return sum(c.nbytes for c in s._checkpoints) + sum(shared.values())

    with session(busy_trace, checkpoint_every=1, checkpoint_budget=300_000) as s:
        seen, thinned = 0, False
        while s.step() is not None:
            assert s.checkpoint_bytes == counted_afresh(s)
            thinned |= s.num_checkpoints < seen
            seen = s.num_checkpoints
        assert thinned and seen > 2
        assert any(c.shared for c in s._checkpoints)


# -- windows and the over-allocation ledger -------------------------------------------


def ledger_balances(summary: dict) -> None:
    oa = summary["overalloc"]
    assert oa["held_at_start"] + oa["allocated"] - oa["released"] == oa["held_at_end"], oa


def test_the_overalloc_ledger_balances_over_the_whole_trace_and_a_window(busy_trace: Path) -> None:
    whole = straight_summary(busy_trace)
    ledger_balances(whole)
    assert whole["overalloc"]["allocated"] > 0 and whole["overalloc"]["held_at_start"] == 0
    steps = whole["steps"]
    with session(busy_trace, options=ReplayOptions(start_step=steps // 3, stop_step=2 * steps // 3)) as s:
        window = s.run().to_dict()
    ledger_balances(window)
    assert window["overalloc"]["held_at_start"] > 0 or window["overalloc"]["allocated"] > 0
    assert window["first_step"] >= steps // 3 and window["last_step"] < 2 * steps // 3
    assert window["peak_step"] is not None and steps // 3 <= window["peak_step"] < 2 * steps // 3


def test_a_window_summary_covers_the_window_only(busy_trace: Path) -> None:
    whole = straight_summary(busy_trace)
    with session(busy_trace, options=ReplayOptions(start_step=30, stop_step=60)) as s:
        window = s.run().to_dict()
    assert window["steps"] == 30 and window["tokens"]["decode"] < whole["tokens"]["decode"]
    assert window["ops"] < whole["ops"]


def test_a_window_starts_with_a_keyframe_holding_the_whole_state(busy_trace: Path, tmp_path: Path) -> None:
    start = 40
    with session(busy_trace, track_state=True) as s:
        for snap in s.snapshots():
            if snap.step == start:
                break
        full = s.state
        assert full is not None
        live_full = full.live_rids()
    log = tmp_path / "window.arrow"
    with session(busy_trace, options=ReplayOptions(start_step=start)) as s, StateLogWriter(log, {}) as writer:
        for snap in s.snapshots():
            writer.write(snap)
    _, snaps = read_state_log(log)
    first = next(snaps)
    assert first.keyframe and first.step == start
    state = ReplayState(16)
    state.apply(first)
    np.testing.assert_array_equal(state.live_rids(), live_full)
    for name in ("allocated", "committed", "protected"):
        np.testing.assert_array_equal(state.column(name)[live_full], full.column(name)[live_full])
    assert set(live_full.tolist()) <= set(first.requests.rids.tolist())
    assert not any(snap.keyframe for snap in snaps)  # only the first


# -- the per-request state fold --------------------------------------------------------


def test_the_fold_of_a_live_session_equals_the_fold_of_its_state_log(busy_trace: Path, tmp_path: Path) -> None:
    log = tmp_path / "state.arrow"
    with session(busy_trace, track_state=True) as s, StateLogWriter(log, {}) as writer:
        for snap in s.snapshots():
            writer.write(snap)
        live = s.state
    assert live is not None
    _, snaps = read_state_log(log)
    back = ReplayState(16)
    for snap in snaps:
        back.apply(snap)
    for name in ("phase", "allocated", "committed", "protected", "prefix_hit", "admitted_step", "ended_step"):
        np.testing.assert_array_equal(back.column(name), live.column(name), err_msg=name)
    assert back.timeline.events == live.timeline.events
    np.testing.assert_array_equal(back.timeline.used_tokens(), live.timeline.used_tokens())


def test_phases_admissions_and_ends_follow_the_ops(tmp_path: Path) -> None:
    meta = make_meta(page_size=1, pool_tokens=4096, chunk_size=8)
    b = StepBatch.from_columns
    steps = [
        b(0, 0.0, op=["extend"], rid=[0], seq_len=[8], append_len=[8], prompt_len=[12]),  # chunk 1 of 2
        b(1, 0.1, op=["extend"], rid=[0], seq_len=[12], append_len=[4]),  # prefill done
        b(2, 0.2, op=["decode"], rid=[0], seq_len=[13], append_len=[1]),
        b(3, 0.3, op=["retract"], rid=[0], seq_len=[13], append_len=[0]),
        b(4, 0.4, op=["extend"], rid=[0], seq_len=[13], append_len=[13]),  # admitted again
        b(5, 0.5, op=["decode"], rid=[0], seq_len=[14], append_len=[1]),
        b(6, 0.6, op=["finish"], rid=[0], seq_len=[14], append_len=[0]),
    ]
    path = write_steps(tmp_path / "life.kvtrace", steps, meta=meta)
    phases, rows = [], []
    with session(path, track_state=True) as s:
        for _ in s.snapshots():
            assert s.state is not None
            row = s.state.row(0)
            phases.append(row.phase)
            rows.append(row)
    assert phases == ["prefill", "decode", "decode", "retracted", "decode", "decode", "finished"]
    assert rows[0].admitted_step == 0 and rows[-1].ended_step == 6
    assert rows[3].allocated == 0 and rows[2].used == 13 and rows[2].pages == 13
    assert s.state.column("admissions")[0] == 2  # type: ignore[union-attr]
    history = s.state.history(0)  # type: ignore[union-attr]
    assert [e.kind for e in history] == ["retract", "finish"]


def test_a_spec_request_shows_its_overallocation_and_its_release(busy_trace: Path) -> None:
    with session(busy_trace, track_state=True) as s:
        seen_over = False
        for snap in s.snapshots():
            state = s.state
            assert state is not None
            live = state.live_rids()
            over = state.column("allocated")[live] - state.column("committed")[live]
            seen_over |= bool((over > 0).any())
        assert seen_over
        releases = [e for e in s.state.timeline.events if e.kind == "overalloc_release"]  # type: ignore[union-attr]
        assert releases and all(e.rid is not None and e.tokens > 0 for e in releases)
        assert sum(e.tokens for e in releases) == s.result().stats.overalloc_released
    assert set(s.state.phase_counts()) == set(PHASES)  # type: ignore[union-attr]


def test_cli_json_of_a_window_names_it(busy_trace: Path) -> None:
    result = runner.invoke(app, ["replay", str(busy_trace), "--steps", "10:30", "--json"])
    s = json.loads(result.stdout)
    assert s["window"] == {"start": 10, "stop": 30} and s["first_step"] == 10 and s["last_step"] == 29
    ledger_balances(s)


def test_a_keyframe_lists_live_requests_no_op_touched(tmp_path: Path) -> None:
    meta = make_meta(page_size=1, pool_tokens=4096)
    b = StepBatch.from_columns
    steps = [
        b(0, 0.0, op=["extend", "extend"], rid=[0, 1], seq_len=[8, 5], append_len=[8, 5], prompt_len=[8, 5]),
        b(1, 0.1, op=["decode"], rid=[0], seq_len=[9], append_len=[1]),  # request 1 waits this step
        b(2, 0.2, op=["decode", "decode"], rid=[0, 1], seq_len=[10, 6], append_len=[1, 1]),
    ]
    path = write_steps(tmp_path / "idle.kvtrace", steps, meta=meta)
    with session(path, options=ReplayOptions(start_step=1), track_state=True) as s:
        first = s.step()
        assert first is not None and first.keyframe
        assert first.requests.rids.tolist() == [0, 1]
        assert first.requests.op.tolist() == [1, UNCHANGED_OP]  # decode, and no op
        assert s.state is not None and s.state.row(1).allocated == 5 and s.state.row(1).phase == "decode"
        second = s.step()
        assert second is not None and not second.keyframe


# -- state digests in the snapshots; a screen shared by two sessions -------------------


def test_snapshots_carry_the_state_digest_and_the_state_log_keeps_it(busy_trace: Path, tmp_path: Path) -> None:
    log = tmp_path / "digests.arrow"
    with session(busy_trace, options=ReplayOptions(state_digest=True)) as s, StateLogWriter(log, {}) as writer:
        snaps = list(s.snapshots())
        for snap in snaps:
            writer.write(snap)
    assert all(snap.digest is not None and len(snap.digest) == 32 for snap in snaps)
    assert len({snap.digest for snap in snaps}) > len(snaps) // 2
    _, back = read_state_log(log)
    assert [b.digest for b in back] == [snap.digest for snap in snaps]
    with session(busy_trace) as s:
        assert all(snap.digest is None for snap in s.snapshots())


def test_asking_digests_of_a_version_without_them_is_one_error() -> None:
    from kvtrace.errors import VersionSpecError

    spec = f"{Path(__file__).with_name('faulty_allocators.py')}:without_digest"
    with pytest.raises(VersionSpecError, match=r"--exact: allocator '.*:without_digest' \(WithoutDigest\) has no state_digest\(\)"):
        session("sample:tiny", version=spec, options=ReplayOptions(state_digest=True))
    with session("sample:tiny", version=spec) as s:  # without digests it replays
        assert s.run().stats.steps == 139


def test_a_session_behind_another_shares_its_screen(busy_trace: Path) -> None:
    """Lockstep: the second session screens each step from the first one's memory."""
    ahead = ReplaySession(busy_trace, options=ReplayOptions(), checker="background")
    behind = ReplaySession(busy_trace, options=ReplayOptions(), checker=ahead.checker)
    try:
        for a in ahead.snapshots():
            b = behind.step()
            assert b is not None
            same_snapshot(a, b)
        assert behind.step() is None
    finally:
        behind.close()
        assert not ahead.checker.inner._conn.closed  # closing the second left the screen alone
        ahead.close()
    assert straight_summary(busy_trace)["steps"] == ahead.result().stats.steps


@pytest.mark.parametrize("mode", ["every", "full"])
def test_checking_after_every_call_changes_no_result(busy_trace: Path, mode: str) -> None:
    """The checks only read: the state after every step equals an unchecked replay's."""
    _, plain = straight_run(busy_trace)
    checked: dict[int, str] = {}
    options = ReplayOptions(check=mode, decode_runs=False)  # type: ignore[arg-type]
    with session(busy_trace, options=options) as s:
        for snap in s.snapshots():
            checked[snap.step] = s.allocator.save_state().digest()
        assert s.result().stats.num_violations == 0
    assert checked == plain


def _without_timing(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k not in ("wall_s", "allocator_s", "speedup_vs_realtime")}


@pytest.mark.parametrize("trace", ["sample:tiny", "sample:mooncake-tiny", pytest.param("sample:mooncake-eagle", marks=pytest.mark.slow)])
def test_runs_of_decode_steps_in_one_call_change_no_snapshot(trace: str, busy_trace: Path) -> None:
    """Runs replayed in one allocator call (the default) against every step by itself."""
    results = []
    for runs in (True, False):
        with session(trace, options=ReplayOptions(decode_runs=runs), track_state=True) as s:
            snaps = list(s.snapshots())
            results.append((snaps, _without_timing(s.result().to_dict()), s.allocator.save_state().digest()))
    (fast, fast_summary, fast_digest), (slow, slow_summary, slow_digest) = results
    assert len(fast) == len(slow)
    for a, b in zip(fast, slow):
        same_snapshot(a, b)
    assert fast_summary == slow_summary and fast_digest == slow_digest


@pytest.mark.parametrize("trace", ["sample:mooncake-tiny", pytest.param("sample:mooncake-eagle", marks=pytest.mark.slow), "busy"])
def test_checking_every_call_in_runs_changes_no_snapshot(trace: str, busy_trace: Path) -> None:
    """--check every replays runs in one call, checked once: the same snapshots, summary and
    end state as every step by itself, checked after each call."""
    path = busy_trace if trace == "busy" else trace
    results = []
    for runs in (True, False):
        with session(path, options=ReplayOptions(check="every", decode_runs=runs)) as s:
            calls = 0
            check = s.allocator.check_integrity

            def counted(touched: np.ndarray | None = None) -> list:
                nonlocal calls
                calls += 1
                return check(touched)

            s.allocator.check_integrity = counted  # type: ignore[method-assign]
            snaps = list(s.snapshots())
            results.append((snaps, _without_timing(s.result().to_dict()), s.allocator.save_state().digest(), calls))
            assert s.allocator._checker.unconfirmed == 0  # type: ignore[attr-defined]
    (fast, fast_summary, fast_digest, fast_calls), (slow, slow_summary, slow_digest, slow_calls) = results
    assert len(fast) == len(slow)
    for a, b in zip(fast, slow):
        same_snapshot(a, b)
    assert fast_summary == slow_summary and fast_digest == slow_digest
    assert fast_summary["num_violations"] == 0
    assert fast_calls < slow_calls  # runs were replayed, and checked, in one call each


def test_runs_are_used_on_decode_heavy_traces() -> None:
    from traces.reader import TraceReader
    from traces.runs import run_lengths
    from traces.schema import DECODE, SPEC

    for name, op in (("sample:mooncake-tiny", DECODE), ("sample:mooncake-eagle", SPEC)):
        from traces.samples import resolve_trace

        lengths = np.concatenate([run_lengths(c, op) for c in TraceReader(resolve_trace(name)).chunks()])
        assert (lengths >= 2).mean() > 0.3, name
