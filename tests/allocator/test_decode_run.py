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
