"""decode_run: a run of plain decode steps in one call equals the steps one by one."""

from __future__ import annotations

from typing import Any

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from allocator import AllocatorConfig, create_allocator
from allocator.base import OutOfMemory, PoolCounters
from kvtrace.replay.session import ReplaySession
from traces.schema import DECODE
from traces.synth import generate


def decode_points(path: Path) -> list[tuple[int, np.ndarray]]:
    """(step before which, rids) of every all-decode step of a trace."""
    from traces.reader import TraceReader

    out = []
    for batch in TraceReader(path).steps():
        if len(batch) and np.all(batch.op == DECODE):
            out.append((batch.step, batch.rid.copy()))
    return out


def state_at(path: Path, step: int) -> ReplaySession:
    """A session whose allocator holds the state just before ``step``."""
    s = ReplaySession(path, checker="inline")
    for snap in s.snapshots():
        if snap.step == step - 1:
            break
    return s


def run_both(session: ReplaySession, rids: np.ndarray, num_steps: int) -> tuple[np.ndarray | None, bool]:
    alloc = session.allocator
    saved = alloc.save_state()  # type: ignore[attr-defined]
    stepwise = []
    for _ in range(num_steps):
        alloc.decode(rids)
        alloc.end_step()
        stepwise.append(np.array(alloc.counters(), np.int64))
    want = alloc.save_state().digest()  # type: ignore[attr-defined]
    alloc.restore_state(saved)  # type: ignore[attr-defined]
    got = alloc.decode_run(rids, num_steps)  # type: ignore[attr-defined]
    counters = None if got is None else got.counters
    if counters is None:
        assert alloc.save_state().digest() == saved.digest(), "a refused run changed the state"  # type: ignore[attr-defined]
        return None, True
    np.testing.assert_array_equal(counters, np.array(stepwise))
    return counters, alloc.save_state().digest() == want  # type: ignore[attr-defined]


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("pd", [False, True])
def test_a_run_equals_the_steps_one_by_one(tmp_path: Path, page_size: int, pd: bool) -> None:
    path = tmp_path / f"t{page_size}{pd}.kvtrace"
    generate(path, num_requests=30, seed=page_size + pd, page_size=page_size, pd_decode=pd,
             chunk_size=max(3 * page_size - 5, 24), output_len=(20, 60), retract_prob=0.02)
    points = decode_points(path)
    assert points
    done = 0
    for step, rids in points[:: max(len(points) // 6, 1)]:
        with state_at(path, step) as s:
            for num_steps in (1, 3, 17):
                counters, same = run_both(s, rids, num_steps)
                assert same, (step, num_steps)
                done += counters is not None
    assert done > 0, "no run was done in one block"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    page_size=st.sampled_from([1, 2, 4, 16]),
    lens=st.lists(st.integers(1, 70), min_size=1, max_size=12),
    num_steps=st.integers(1, 40),
    pool_pages=st.integers(4, 120),
    churn=st.integers(0, 8),
)
def test_random_states_and_tight_pools(page_size: int, lens: list[int], num_steps: int, pool_pages: int, churn: int) -> None:
    """Hand-built states, pools from roomy to short (a refused run changes nothing)."""
    config = AllocatorConfig(pool_tokens=max(pool_pages, 2) * page_size * 8, page_size=page_size, max_running=16,
                             max_context_len=512, radix_cache=False)
    alloc = create_allocator(config)
    rids = np.arange(len(lens), dtype=np.int64)
    need = sum(-(-n // page_size) * page_size for n in lens)
    if need + len(lens) * page_size > config.pool_tokens:
        return
    alloc.extend(rids, np.array(lens), [np.arange(n) for n in lens])
    alloc.end_step()
    # churn the free list: finish and re-admit some requests so it is not in order
    for k in range(churn):
        victim = rids[k % len(rids) : k % len(rids) + 1]
        alloc.release(victim, alloc.request_lens(victim).committed, None, "abort")
        alloc.extend(victim, np.array([lens[k % len(lens)]]), [np.arange(lens[k % len(lens)])])
        alloc.end_step()
    saved = alloc.save_state()
    stepwise = []
    ran_out = False
    for _ in range(num_steps):
        if isinstance(alloc.decode(rids), OutOfMemory):
            ran_out = True
            break
        stepwise.append(np.array(alloc.counters(), np.int64))
    want = alloc.save_state().digest()
    alloc.restore_state(saved)
    counters = _run_matches_steps(alloc, alloc.decode_run(rids, num_steps), saved, stepwise, want, ran_out)
    if counters is not None:
        assert counters.shape == (num_steps, len(PoolCounters._fields))


def _run_matches_steps(
    alloc: Any, got: Any, saved: Any, stepwise: list[np.ndarray], want: str, failed: bool
) -> np.ndarray | None:
    """A run's result against the steps one by one: refused, it changed nothing; done,
    no step failed and the counters and the final state are the steps'. Its counters."""
    counters = None if got is None else got.counters
    if counters is None:
        assert alloc.save_state().digest() == saved.digest()
        return None
    assert not failed, "a run was done in one block although a step fails"
    np.testing.assert_array_equal(counters, np.array(stepwise))
    assert alloc.save_state().digest() == want
    return counters


def spec_points(path: Path) -> list[tuple[int, np.ndarray, list[np.ndarray]]]:
    """(step, rids, accepted of it and the next steps over the same batch) of spec steps."""
    from traces.reader import TraceReader
    from traces.schema import SPEC

    batches = [b for b in TraceReader(path).steps()]
    out = []
    for k, b in enumerate(batches):
        if not (len(b) and np.all(b.op == SPEC)):
            continue
        accepted = [b.accepted_len.astype(np.int64)]
        for nxt in batches[k + 1 : k + 40]:
            if len(nxt) != len(b) or not np.all(nxt.op == SPEC) or not np.array_equal(nxt.rid, b.rid):
                break
            accepted.append(nxt.accepted_len.astype(np.int64))
        out.append((b.step, b.rid.copy(), accepted))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("pd", [False, True])
def test_a_spec_run_equals_the_steps_one_by_one(tmp_path: Path, page_size: int, pd: bool) -> None:
    path = tmp_path / f"s{page_size}{pd}.kvtrace"
    generate(path, num_requests=24, seed=7 + page_size + pd, page_size=page_size, pd_decode=pd, spec=True,
             spec_fraction=1.0, chunk_size=max(3 * page_size - 5, 24), output_len=(20, 60))
    points = spec_points(path)
    assert points
    done = 0
    for step, rids, accepted in points[:: max(len(points) // 6, 1)]:
        with state_at(path, step) as s:
            alloc = s.allocator
            acc = np.array(accepted)
            saved = alloc.save_state()  # type: ignore[attr-defined]
            stepwise = []
            for row in acc:
                alloc.spec_decode(rids, row)
                alloc.end_step()
                stepwise.append(np.array(alloc.counters(), np.int64))
            want = alloc.save_state().digest()  # type: ignore[attr-defined]
            alloc.restore_state(saved)  # type: ignore[attr-defined]
            got = alloc.spec_decode_run(rids, acc)  # type: ignore[attr-defined]
            counters = None if got is None else got.counters
            if counters is None:
                assert alloc.save_state().digest() == saved.digest()  # type: ignore[attr-defined]
                continue
            np.testing.assert_array_equal(counters, np.array(stepwise))
            assert alloc.save_state().digest() == want, (step, len(acc))  # type: ignore[attr-defined]
            done += 1
    assert done > 0, "no spec run was done in one block"


@settings(max_examples=40, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4, 16]),
    lens=st.lists(st.integers(1, 70), min_size=1, max_size=8),
    accepted=st.lists(st.lists(st.integers(0, 9), min_size=8, max_size=8), min_size=1, max_size=12),
    pool_pages=st.integers(8, 200),
    topk=st.sampled_from([1, 4]),
)
def test_random_spec_runs(page_size: int, lens: list[int], accepted: list[list[int]], pool_pages: int, topk: int) -> None:
    from allocator.base import SpecConfig

    config = AllocatorConfig(pool_tokens=pool_pages * page_size * 8, page_size=page_size, max_running=16,
                             max_context_len=512, radix_cache=False, spec=SpecConfig(num_steps=3, topk=topk, num_draft_tokens=4))
    alloc = create_allocator(config)
    rids = np.arange(len(lens), dtype=np.int64)
    need = sum(-(-n // page_size) * page_size for n in lens)
    if need > config.pool_tokens // 2:
        return
    alloc.extend(rids, np.array(lens), [np.arange(n) for n in lens])
    alloc.end_step()
    acc = np.array(accepted, np.int64)[:, : len(lens)]
    saved = alloc.save_state()
    stepwise = []
    failed = False
    for row in acc:
        try:
            out = alloc.spec_decode(rids, row)
        except ValueError:  # a commit past the reserve: refused by both paths
            failed = True
            break
        if isinstance(out, OutOfMemory) or out.row_overflow:
            failed = True
            break
        stepwise.append(np.array(alloc.counters(), np.int64))
    want = alloc.save_state().digest()
    alloc.restore_state(saved)
    _run_matches_steps(alloc, alloc.spec_decode_run(rids, acc), saved, stepwise, want, failed)


# ---------------------------------------------------------------------------- SWA


def _swa_stepwise(alloc: Any, rids: np.ndarray, num_steps: int) -> tuple[list[np.ndarray], list[np.ndarray], bool]:
    """Both pools' counters after each of ``num_steps`` decode steps (until one fails)."""
    full, swa = [], []
    for _ in range(num_steps):
        if isinstance(alloc.decode(rids), OutOfMemory):
            return full, swa, True
        alloc.end_step()
        pools = alloc.pool_counters()
        full.append(np.array(pools["full"], np.int64))
        swa.append(np.array(pools["swa"], np.int64))
    return full, swa, False


def _swa_run_matches_steps(alloc: Any, rids: np.ndarray, num_steps: int) -> bool:
    """decode_run against the steps one by one on an SWA allocator (both pools'
    counters, the whole state: free-list order of each pool, the mapping, the cursors).
    Whether the run was done in one call."""
    saved = alloc.save_state()
    full, swa, failed = _swa_stepwise(alloc, rids, num_steps)
    want = alloc.save_state().digest()
    alloc.restore_state(saved)
    got = alloc.decode_run(rids, num_steps)
    if _run_matches_steps(alloc, got, saved, full, want, failed) is None:
        return False
    assert len(got.other_pools) == 1
    np.testing.assert_array_equal(got.other_pools[0], np.array(swa))
    return True


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4, 16, 64]),
    lens=st.lists(st.integers(1, 200), min_size=1, max_size=8),
    num_steps=st.integers(1, 150),
    window=st.sampled_from([1, 4, 16, 40]),
    draft_window=st.sampled_from([0, 0, 24]),
    interval=st.sampled_from([1, 3, 8, 32]),
    warm=st.integers(0, 40),
    pool_pages=st.integers(6, 80),
    swa_ratio=st.sampled_from([0.3, 0.8, 1.0]),
    radix=st.booleans(),
    churn=st.integers(0, 4),
)
def test_random_swa_runs_equal_the_steps(
    page_size: int, lens: list[int], num_steps: int, window: int, draft_window: int, interval: int, warm: int,
    pool_pages: int, swa_ratio: float, radix: bool, churn: int,
) -> None:
    """SWA decode runs with windows small enough that out-of-window frees fall inside
    the run (a draft window wider than the model's too), pools from roomy to short,
    cursors and first-decode flags at any point."""
    from allocator.base import SwaConfig

    pool_tokens = pool_pages * page_size * 4
    swa = SwaConfig(window=window, eviction_interval=interval, swa_full_tokens_ratio=swa_ratio, draft_window=draft_window)
    if swa.pool_tokens(pool_tokens, page_size) <= 2 * (swa.retain_window + page_size):
        return  # an SWA pool that cannot hold a request: refused by the config check
    config = AllocatorConfig(pool_tokens=pool_tokens, page_size=page_size, max_running=16, max_context_len=1024,
                             radix_cache=radix, swa=swa)
    alloc = create_allocator(config)
    rids = np.arange(len(lens), dtype=np.int64)
    need = sum(-(-n // page_size) * page_size for n in lens) + len(lens) * page_size
    if need > alloc.pool_counters()["swa"].pool_tokens:
        return
    alloc.extend(rids, np.array(lens), [np.arange(n) + 1000 * i for i, n in enumerate(lens)])
    alloc.end_step()
    for _ in range(warm):
        if isinstance(alloc.decode(rids), OutOfMemory):
            return
        alloc.end_step()
    # churn: finish and re-admit some requests (fresh ones have not decoded yet)
    for k in range(churn):
        victim = rids[k % len(rids) : k % len(rids) + 1]
        alloc.release(victim, alloc.request_lens(victim).committed, None, "abort")
        n = lens[k % len(lens)]
        if isinstance(alloc.extend(victim, np.array([n]), [np.arange(n) + 7]), OutOfMemory):
            return
        alloc.end_step()
    _swa_run_matches_steps(alloc, rids, num_steps)


@pytest.mark.parametrize("page_size", [1, 16])
def test_an_swa_run_keeps_a_draft_window_wider_than_the_models(page_size: int) -> None:
    """With ``draft_window`` past the window the frees keep the larger
    (``retain_window``): a run's steps free when the steps one by one do."""
    from allocator.base import SwaConfig

    config = AllocatorConfig(pool_tokens=64 * 1024, page_size=page_size, max_running=16, max_context_len=4096,
                             radix_cache=False, swa=SwaConfig(window=16, eviction_interval=8, draft_window=48))
    alloc = create_allocator(config)
    lens = [40, 75, 130, 3]
    rids = np.arange(len(lens), dtype=np.int64)
    alloc.extend(rids, np.array(lens), [np.arange(n) for n in lens])
    alloc.end_step()
    assert _swa_run_matches_steps(alloc, rids, 200)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_an_swa_run_frees_out_of_the_window_inside_it(page_size: int) -> None:
    """A long run over requests whose window frees fall at different steps inside it
    is done in one call and equals the steps one by one."""
    from allocator.base import SwaConfig

    config = AllocatorConfig(pool_tokens=64 * 1024, page_size=page_size, max_running=16, max_context_len=4096,
                             radix_cache=False, swa=SwaConfig(window=32, eviction_interval=8))
    alloc = create_allocator(config)
    lens = [40, 75, 130, 3, 64]
    rids = np.arange(len(lens), dtype=np.int64)
    alloc.extend(rids, np.array(lens), [np.arange(n) for n in lens])
    alloc.end_step()
    freed_before = alloc.pool_counters()["swa"].available
    assert _swa_run_matches_steps(alloc, rids, 300)
    got = alloc.pool_counters()["swa"]
    # the window freed SWA slots during the run: far fewer held than allocated
    assert freed_before - got.available < 300 * len(lens) // 2


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("check", ["end", "every"])
def test_an_swa_replay_with_runs_equals_it_step_by_step(page_size: int, check: str) -> None:
    """The hybrid SWA sample replayed with decode runs: every snapshot (both pools'
    counters, the requests, their SWA cursors) and the stats (both pools' peaks, the checks) as step by step."""
    import dataclasses

    from kvtrace.replay.engine import ReplayOptions
    from traces.samples import resolve_trace

    trace = resolve_trace("sample:mooncake-gpt-oss")
    seen = []
    for runs in (True, False):
        options = ReplayOptions(check=check, decode_runs=runs, stop_step=1500)  # type: ignore[arg-type]
        with ReplaySession(trace, page_size=page_size, options=options, checker="inline") as s:
            snaps = [
                (x.step, x.pool, x.other_pools, tuple(map(np.ndarray.tolist, x.requests)), x.swa_evicted.tolist())
                for x in s.snapshots()
            ]
            stats = dataclasses.replace(s.result().stats, allocator_s=0.0)
            seen.append((snaps, stats, s.allocator.save_state().digest()))  # type: ignore[attr-defined]
    (runs_snaps, runs_stats, runs_digest), (steps_snaps, steps_stats, steps_digest) = seen
    assert len(runs_snaps) == 1500 and runs_snaps[-1][2], "no SWA pool counters"
    assert runs_snaps == steps_snaps
    assert runs_stats == steps_stats
    assert runs_digest == steps_digest


# ---------------------------------------------------------------------------- SWA spec


def _swa_spec_stepwise(alloc: Any, rids: np.ndarray, acc: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray], bool]:
    """Both pools' counters after each speculative step of ``acc`` (until one fails)."""
    full, swa = [], []
    for row in acc:
        try:
            out = alloc.spec_decode(rids, row)
        except ValueError:  # a commit past the reserve: refused by both paths
            return full, swa, True
        if isinstance(out, OutOfMemory) or out.row_overflow:
            return full, swa, True
        alloc.end_step()
        pools = alloc.pool_counters()
        full.append(np.array(pools["full"], np.int64))
        swa.append(np.array(pools["swa"], np.int64))
    return full, swa, False


def _swa_spec_run_matches_steps(alloc: Any, rids: np.ndarray, acc: np.ndarray) -> bool:
    """spec_decode_run against the steps one by one on an SWA allocator (both pools'
    counters, the whole state). Whether the run was done in one call."""
    saved = alloc.save_state()
    full, swa, failed = _swa_spec_stepwise(alloc, rids, acc)
    want = alloc.save_state().digest()
    alloc.restore_state(saved)
    got = alloc.spec_decode_run(rids, acc)
    if _run_matches_steps(alloc, got, saved, full, want, failed) is None:
        return False
    assert len(got.other_pools) == 1
    np.testing.assert_array_equal(got.other_pools[0], np.array(swa))
    return True


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    page_size=st.sampled_from([1, 2, 4, 16, 64]),
    lens=st.lists(st.integers(1, 200), min_size=1, max_size=6),
    accepted=st.lists(st.lists(st.integers(1, 4), min_size=6, max_size=6), min_size=1, max_size=40),
    algorithm=st.sampled_from(["eagle", "dflash"]),
    window=st.sampled_from([4, 16, 40]),
    draft_window=st.sampled_from([0, 24]),
    interval=st.sampled_from([1, 3, 8, 32]),
    warm=st.integers(0, 6),
    pool_pages=st.integers(8, 120),
    swa_ratio=st.sampled_from([0.3, 0.8, 1.0]),
    radix=st.booleans(),
)
def test_random_swa_spec_runs_equal_the_steps(
    page_size: int, lens: list[int], accepted: list[list[int]], algorithm: str, window: int, draft_window: int,
    interval: int, warm: int, pool_pages: int, swa_ratio: float, radix: bool,
) -> None:
    """SWA speculative runs (EAGLE, DFlash) with windows small enough that
    out-of-window frees fall inside the run, pools from roomy to short."""
    from allocator.base import SpecConfig, SwaConfig

    pool_tokens = pool_pages * page_size * 4
    swa = SwaConfig(window=window, eviction_interval=interval, swa_full_tokens_ratio=swa_ratio, draft_window=draft_window)
    if swa.pool_tokens(pool_tokens, page_size) <= 2 * (swa.retain_window + page_size):
        return  # an SWA pool that cannot hold a request: refused by the config check
    spec = SpecConfig(algorithm, num_steps=3, topk=1, num_draft_tokens=4)  # type: ignore[arg-type]
    config = AllocatorConfig(pool_tokens=pool_tokens, page_size=page_size, max_running=16, max_context_len=2048,
                             radix_cache=radix, swa=swa, spec=spec)
    alloc = create_allocator(config)
    rids = np.arange(len(lens), dtype=np.int64)
    need = sum(-(-(n + 16) // page_size) * page_size for n in lens) + len(lens) * page_size
    if need > alloc.pool_counters()["swa"].pool_tokens:
        return
    alloc.extend(rids, np.array(lens), [np.arange(n) + 1000 * i for i, n in enumerate(lens)])
    alloc.end_step()
    acc = np.array(accepted, np.int64)[:, : len(lens)]
    for k in range(warm):  # first spec steps one by one (the first never frees)
        out = alloc.spec_decode(rids, acc[k % acc.shape[0]])
        if isinstance(out, OutOfMemory):
            return
        alloc.end_step()
    _swa_spec_run_matches_steps(alloc, rids, acc)


@pytest.mark.parametrize("algorithm", ["eagle", "dflash"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_an_swa_spec_run_frees_out_of_the_window_inside_it(page_size: int, algorithm: str) -> None:
    """A long speculative run whose window frees fall at different steps inside it is
    done in one call and equals the steps one by one."""
    from allocator.base import SpecConfig, SwaConfig

    spec = SpecConfig(algorithm, num_steps=3, topk=1, num_draft_tokens=4)  # type: ignore[arg-type]
    config = AllocatorConfig(pool_tokens=64 * 1024, page_size=page_size, max_running=16, max_context_len=4096,
                             radix_cache=False, swa=SwaConfig(window=32, eviction_interval=8), spec=spec)
    alloc = create_allocator(config)
    lens = [40, 75, 130, 3, 64]
    rids = np.arange(len(lens), dtype=np.int64)
    alloc.extend(rids, np.array(lens), [np.arange(n) for n in lens])
    alloc.end_step()
    acc = np.random.default_rng(page_size).integers(1, 5, size=(120, len(lens)))
    freed_before = alloc.pool_counters()["swa"].available
    assert _swa_spec_run_matches_steps(alloc, rids, acc)
    got = alloc.pool_counters()["swa"]
    assert freed_before - got.available < int(acc.sum()) // 2  # the window freed SWA slots during the run
