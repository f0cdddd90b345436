"""The incremental checker agrees with the full walk.

After every allocator call, ``check_integrity(touched)`` (incremental) and
``check_integrity()`` (the full walk) must find a violation on the same calls, with
the same check names, up to the first violation (after one, the two may see the
broken state differently). Driven by the hypothesis state machine of
``test_state_machine`` (every op kind, PD prealloc, chunked prefill; a sound
allocator) and by the seeded random scheduler of ``sim`` on the deliberately broken
allocators of ``tests/kvtrace/faulty_allocators.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, run_state_machine_as_test

from allocator import AllocatorConfig, KvAllocator, SpecConfig, create_allocator
from allocator.base import AllocOutcome, ReleaseKind, ReleaseResult
from tests.allocator.sim import RandomScheduler
from tests.allocator.test_state_machine import _machine
from tests.kvtrace import faulty_allocators as faulty

EAGLE = SpecConfig("eagle", 3, 1, 4)
FAULTS = {
    "leaky_overalloc": faulty.LeakyOveralloc,
    "double_free": faulty.DoubleFree,
    "stale_row": faulty.StaleRow,
    "leak_on_retract": faulty.LeakOnRetract,
    "overwritten_row": faulty.OverwrittenRow,
    "lock_leak": faulty.LockLeak,
    "counters_off": faulty.CountersOff,
}


class _Violated(Exception):
    """Raised at the first call after which a checker reports something."""


class DualChecked:
    """Mixin: after every batched call, check incrementally (the call's rids) and fully.

    Records ``(incremental check names, full check names)`` per call in ``log``; with
    ``stop_at_violation`` the run ends (``_Violated``) at the first call either finds
    something.
    """

    log: list[tuple[list[str], list[str]]]
    stop_at_violation = True
    pending: list[int]

    def _checked(self, rids: np.ndarray | Sequence[int]) -> None:
        self.pending.extend(np.asarray(rids, dtype=np.int64).tolist())
        inc = self.check_integrity(np.array(self.pending, dtype=np.int64))  # type: ignore[attr-defined]
        self.pending = []
        full = self.check_integrity()  # type: ignore[attr-defined]
        self.log.append((sorted({v.check for v in inc}), sorted({v.check for v in full})))
        if (inc or full) and self.stop_at_violation:
            raise _Violated

    def extend(self, rids: np.ndarray, *args: object, **kwargs: object) -> AllocOutcome:
        out = super().extend(rids, *args, **kwargs)  # type: ignore[misc]
        self._checked(rids)
        return out

    def decode(self, rids: np.ndarray) -> AllocOutcome:
        out = super().decode(rids)  # type: ignore[misc]
        self._checked(rids)
        return out

    def spec_decode(self, rids: np.ndarray, accepted: np.ndarray) -> AllocOutcome:
        out = super().spec_decode(rids, accepted)  # type: ignore[misc]
        self._checked(rids)
        return out

    def prealloc(self, rids: np.ndarray, *args: object) -> AllocOutcome:
        out = super().prealloc(rids, *args)  # type: ignore[misc]
        self._checked(rids)
        return out

    def release(self, rids: np.ndarray, owned: np.ndarray, tokens: Sequence[np.ndarray] | None,
                kind: ReleaseKind) -> ReleaseResult:
        out = super().release(rids, owned, tokens, kind)  # type: ignore[misc]
        self._checked(rids)
        return out

    def evict(self, num_tokens: int) -> int:
        out = super().evict(num_tokens)  # type: ignore[misc]
        self._checked([])
        return out

    def stash_chunked(self, rids: np.ndarray, token_ids: Sequence[np.ndarray]) -> None:
        super().stash_chunked(rids, token_ids)  # type: ignore[misc]
        self.pending.extend(np.asarray(rids, dtype=np.int64).tolist())  # checked with the next call


def dual(base: type[KvAllocator], config: AllocatorConfig, stop_at_violation: bool = True) -> KvAllocator:
    """An allocator of class ``base`` checked both ways after every call."""
    alloc = type(f"DualChecked{base.__name__}", (DualChecked, base), {})(config)
    alloc.log = []  # type: ignore[attr-defined]
    alloc.pending = []  # type: ignore[attr-defined]
    alloc.stop_at_violation = stop_at_violation  # type: ignore[attr-defined]
    return alloc


def run_sim(alloc: KvAllocator, config: AllocatorConfig, seed: int, steps: int) -> None:
    sim = RandomScheduler(config, seed)
    sim.alloc = alloc
    try:
        for _ in range(steps):
            sim.step()
    except _Violated:
        pass


def assert_agree(alloc: KvAllocator) -> None:
    for i, (inc, full) in enumerate(alloc.log):  # type: ignore[attr-defined]
        assert inc == full, f"call {i}: incremental found {inc}, the full walk {full}"
    assert alloc._checker is None or alloc._checker.unconfirmed == 0, alloc._checker.last_unconfirmed


def _config(page_size: int, spec: bool, pool: int, need_sort: bool) -> AllocatorConfig:
    return AllocatorConfig(pool_tokens=pool * (2 if page_size == 64 else 1), page_size=page_size, max_running=12,
                           max_context_len=600, spec=EAGLE if spec else None, need_sort=need_sort)


# ---------------------------------------------------------------------------- sound allocator


@pytest.mark.parametrize(
    ("page_size", "spec"),
    [pytest.param(1, None, id="page1"), pytest.param(16, EAGLE, id="page16-eagle"),
     pytest.param(64, None, id="page64")],
)
def test_agrees_on_the_state_machine(page_size: int, spec: SpecConfig | None) -> None:
    config = AllocatorConfig(pool_tokens={1: 400, 16: 384, 64: 640}[page_size], page_size=page_size,
                             max_running=5, extra_rows=1, max_context_len=320, spec=spec)

    class Machine(_machine(config)):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.alloc = dual(KvAllocator, config, stop_at_violation=False)

        @invariant()
        def checkers_agree(self) -> None:
            assert_agree(self.alloc)
            assert all(inc == [] for inc, _ in self.alloc.log)

    run_state_machine_as_test(
        Machine,
        settings=settings(max_examples=10, stateful_step_count=40, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]),
    )


# ---------------------------------------------------------------------------- broken allocators


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    fault=st.sampled_from(sorted(FAULTS)),
    seed=st.integers(0, 10_000),
    page_size=st.sampled_from([1, 16, 64]),
    spec=st.booleans(),
    pool=st.sampled_from([1024, 4096]),
    need_sort=st.booleans(),
)
@pytest.mark.slow
def test_agrees_on_random_traces_of_broken_allocators(
    fault: str, seed: int, page_size: int, spec: bool, pool: int, need_sort: bool
) -> None:
    config = _config(page_size, spec, pool, need_sort)
    alloc = dual(FAULTS[fault], config)
    run_sim(alloc, config, seed, 120)
    assert_agree(alloc)
    if alloc.fault_rid is not None:  # type: ignore[attr-defined]
        assert alloc.log[-1][1], f"{fault} fired but the full walk found nothing"  # type: ignore[attr-defined]


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_every_fault_fires_and_both_checkers_name_it_alike(fault: str) -> None:
    """Each broken allocator, on a run where its fault fires, is caught by both checkers
    at the very call, with the same check names (so the property above is not vacuous)."""
    spec = fault == "leaky_overalloc"
    for seed in range(40):
        config = _config(16, spec, 1024, False)
        alloc = dual(FAULTS[fault], config)
        run_sim(alloc, config, seed, 150)
        if alloc.fault_rid is None:  # type: ignore[attr-defined]
            continue
        inc, full = alloc.log[-1]  # type: ignore[attr-defined]
        assert full and inc == full, (fault, seed, inc, full)
        assert all(i == [] and f == [] for i, f in alloc.log[:-1])  # type: ignore[attr-defined]
        return
    pytest.fail(f"{fault} never fired in 40 seeded runs")


# ---------------------------------------------------------------------------- the journal


def test_no_journal_unless_an_incremental_check_runs() -> None:
    alloc = create_allocator(AllocatorConfig(pool_tokens=256, page_size=16, max_running=4, max_context_len=128))
    parts = [alloc.token_to_kv_pool_allocator, alloc.token_to_kv_pool_allocator._free, alloc.tree_cache,
             alloc.writer, alloc.req_to_token_pool, alloc]
    toks = np.arange(40, dtype=np.int64)
    alloc.extend(np.array([0]), np.array([40]), [toks])
    assert alloc.check_integrity() == []  # the full walk attaches nothing
    assert all(part.journal is None for part in parts)
    assert alloc.check_integrity(np.array([0])) == []  # the first incremental check walks and attaches
    assert all(part.journal is alloc._checker.journal for part in parts)
    alloc.decode(np.array([0]))
    assert alloc._checker.journal.events  # recorded, waiting for the next check
    assert alloc.check_integrity(np.array([0])) == [] and not alloc._checker.journal.events
    alloc._checker.detach()
    assert all(part.journal is None for part in parts)


def test_a_page_freed_behind_a_requests_back_is_caught_at_once() -> None:
    alloc = create_allocator(AllocatorConfig(pool_tokens=128, page_size=4, max_running=4, max_context_len=64))
    toks = np.arange(20, dtype=np.int64)
    alloc.extend(np.array([0]), np.array([10]), [toks[:10]])
    assert alloc.check_integrity(np.array([0])) == []
    alloc.decode(np.array([0]))
    assert alloc.check_integrity(np.array([0])) == []
    alloc.token_to_kv_pool_allocator.free(alloc.row_slots(0)[8:9])  # its own page, freed by someone else
    inc = alloc.check_integrity(np.array([], dtype=np.int64))
    assert {v.check for v in inc} == {v.check for v in alloc.check_integrity()} == {"conservation", "ownership", "row"}
    assert {v.rid for v in inc if v.check == "row"} == {0}


def test_agrees_on_hisparse_prealloc_and_release() -> None:
    """HiSparse PD decode: logical slots are journaled, the device side is checked whole."""
    config = AllocatorConfig(pool_tokens=256, page_size=4, max_running=4, max_context_len=128, hisparse=True,
                             radix_cache=False)
    alloc = dual(KvAllocator, config, stop_at_violation=False)
    toks = np.arange(100, dtype=np.int64)
    alloc.prealloc(np.array([0, 1]), np.array([30, 17]), [toks, toks])
    alloc.decode(np.array([0, 1]))
    alloc.release(np.array([0]), np.array([31]), None, "finish")
    alloc.extend(np.array([2]), np.array([9]), [toks])
    assert_agree(alloc)
    assert all(inc == [] for inc, _ in alloc.log)
    tok = alloc.token_to_kv_pool_allocator
    tok.full_to_hisparse_device_index_mapping[alloc.row_slots(2)[:4]] = 0  # a device page lost
    alloc.decode(np.array([1, 2]))
    assert alloc.log[-1] == (["hisparse"], ["hisparse"])


def test_device_table_entries_written_are_compared() -> None:
    """The device check compares every entry a call wrote with the host copy (a CPU
    tensor stands in for the device table here; on a GPU it is the real one)."""
    import torch

    alloc = create_allocator(AllocatorConfig(pool_tokens=128, page_size=4, max_running=4, max_context_len=64))
    toks = np.arange(20, dtype=np.int64)
    alloc.extend(np.array([0]), np.array([10]), [toks[:10]])
    assert alloc.check_integrity(np.array([0])) == []
    pool = alloc.req_to_token_pool
    pool.device_req_to_token = torch.from_numpy(pool.req_to_token_np.copy())  # in step so far
    alloc._checker._device = True
    alloc.decode(np.array([0]))  # written on the host only: the stand-in is not mirrored
    inc = alloc.check_integrity(np.array([0]))
    assert [(v.check, v.rid) for v in inc] == [("device", 0)] == [(v.check, v.rid) for v in alloc.check_integrity()]
    pool.device_req_to_token.copy_(torch.from_numpy(pool.req_to_token_np))
    alloc.decode(np.array([0]))
    pool.device_req_to_token.copy_(torch.from_numpy(pool.req_to_token_np))
    assert alloc.check_integrity(np.array([0])) == [] == alloc.check_integrity()


# ---------------------------------------------------------------------------- runs in one call


def _break_after_run(alloc: KvAllocator, rids: np.ndarray, how: str) -> bool:
    """Break the state a run left as the faulty allocators break a step's; whether it broke."""
    if how == "stale_slot":  # the last slot a run wrote goes back to the free list
        alloc.token_to_kv_pool_allocator.free(alloc.row_slots(int(rids[-1]))[-1:])
    elif how == "counters":
        alloc.req_kv.sum_committed -= 1
    elif how == "overwrite" and rids.shape[0] > 1:  # another row's slot over an earlier own position
        lens = alloc.request_lens(rids[-1:])
        pos = int(lens.allocated[0]) - 2
        if pos < int(lens.protected[0]):
            return False
        alloc.writer.assign_row(alloc.row_of(int(rids[-1])), pos, alloc.row_slots(int(rids[0]))[-1:].astype(np.int32))
    else:
        return False
    return True


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    page_size=st.sampled_from([1, 4, 16]),
    spec=st.booleans(),
    warmup=st.integers(4, 40),
    num_steps=st.integers(2, 12),
    broken=st.sampled_from(["sound", "stale_slot", "counters", "overwrite"]),
)
def test_a_run_checked_in_one_call_agrees_with_the_full_walk(
    seed: int, page_size: int, spec: bool, warmup: int, num_steps: int, broken: str
) -> None:
    """``decode_run`` / ``spec_decode_run`` (several steps in one call, as ``--check every``
    replays them) checked incrementally once: clean after a sound run, and after a run
    whose result was then broken the same check names as the full walk."""
    config = _config(page_size, spec, 4096, False)
    sim = RandomScheduler(config, seed)
    alloc = sim.alloc
    for _ in range(warmup):
        sim.step()
    rids = np.array([r.rid for r in sim.running.values() if r.state == "decode"], dtype=np.int64)
    if rids.shape[0] == 0:
        return
    assert alloc.check_integrity(np.zeros(0, np.int64)) == []  # the full walk, then the checker attaches
    if spec:
        rng = np.random.default_rng(seed)
        accepted = rng.integers(1, EAGLE.num_draft_tokens + 1, (num_steps, rids.shape[0]))
        done = alloc.spec_decode_run(rids, accepted)
    else:
        done = alloc.decode_run(rids, num_steps)
    if done is None:
        return  # refused: nothing changed
    fired = _break_after_run(alloc, rids, broken)
    inc = sorted({v.check for v in alloc.check_integrity(rids)})
    full = sorted({v.check for v in alloc.check_integrity()})
    assert inc == full
    assert bool(full) == fired, (broken, full)
    assert alloc._checker is not None and alloc._checker.unconfirmed == 0, alloc._checker.last_unconfirmed
