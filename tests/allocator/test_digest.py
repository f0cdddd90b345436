"""State digests (``KvAllocator.state_digest``, ``allocator.check.digest``): the incremental
digest equals the one computed from scratch after every step of random runs, equal
states digest equally, and a free-list reorder or a moved slot changes the digest."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allocator import AllocatorConfig, SpecConfig, create_allocator
from allocator.base import Digestible
from allocator.check.digest import SeqHash, full_digest
from allocator.pre_encapsulation import PreEncapsulationAllocator
from tests.allocator.sim import RandomScheduler

CONFIGS = {
    "page1": AllocatorConfig(pool_tokens=1536, page_size=1, max_running=16, max_context_len=600),
    "page16-eagle-need_sort": AllocatorConfig(
        pool_tokens=3072, page_size=16, max_running=16, max_context_len=600, spec=SpecConfig("eagle", 3, 1, 4),
        need_sort=True,
    ),
    "page1-eagle": AllocatorConfig(
        pool_tokens=1536, page_size=1, max_running=16, max_context_len=600, spec=SpecConfig("eagle", 3, 1, 4),
    ),
    "page64": AllocatorConfig(pool_tokens=8192, page_size=64, max_running=16, max_context_len=600),
    "hisparse-page16": AllocatorConfig(
        pool_tokens=2048, page_size=16, max_running=16, max_context_len=600, hisparse=True, radix_cache=False,
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_incremental_digest_equals_the_digest_from_scratch(name: str) -> None:
    sim = RandomScheduler(CONFIGS[name], seed=11)
    assert isinstance(sim.alloc, Digestible)
    seen = set()
    for step in range(300):
        sim.step()
        incremental = sim.alloc.state_digest()
        assert incremental == full_digest(sim.alloc), f"step {step}"
        seen.add(incremental)
    assert len(seen) > 250  # the state moves, and so does its digest


def test_equal_runs_digest_equally_and_different_runs_do_not() -> None:
    config = CONFIGS["page16-eagle-need_sort"]
    a, b, c = (RandomScheduler(config, seed=s) for s in (5, 5, 6))
    for _ in range(100):
        for sim in (a, b, c):
            sim.step()
        assert a.alloc.state_digest() == b.alloc.state_digest()
    assert a.alloc.state_digest() != c.alloc.state_digest()


def _twins(page_size: int) -> tuple[RandomScheduler, RandomScheduler]:
    config = AllocatorConfig(pool_tokens=2048, page_size=page_size, max_running=8, max_context_len=600)
    a, b = RandomScheduler(config, seed=3), RandomScheduler(config, seed=3)
    for _ in range(40):
        a.step()
        b.step()
    assert a.alloc.state_digest() == b.alloc.state_digest()
    return a, b


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_free_list_reorder_changes_the_digest_but_not_the_counters(page_size: int) -> None:
    a, b = _twins(page_size)
    free = b.alloc.token_to_kv_pool_allocator._free
    # free list [x y z ...] -> [y x z ...]: the same free slots, another reuse order
    head = free.take(2)
    free.prepend(head[::-1].copy())
    assert a.alloc.counters() == b.alloc.counters()
    assert a.alloc.state_digest() != b.alloc.state_digest()
    assert b.alloc.state_digest() == full_digest(b.alloc)


def test_a_moved_slot_in_a_row_changes_the_digest() -> None:
    a, b = _twins(1)
    rid = int(b.alloc.live_rids()[0])
    row = b.alloc.row_of(rid)
    slots = b.alloc.row_slots(rid)
    # row r: [s0 s1 ...] -> [s1 s0 ...] (same slots, positions swapped)
    b.alloc.writer.assign_row(row, 0, slots[:2][::-1].astype(np.int32))
    assert a.alloc.counters() == b.alloc.counters()
    assert a.alloc.state_digest() != b.alloc.state_digest()
    assert b.alloc.state_digest() == full_digest(b.alloc)


def test_restoring_a_checkpoint_restores_the_digest() -> None:
    sim = RandomScheduler(CONFIGS["page16-eagle-need_sort"], seed=8)
    for _ in range(50):
        sim.step()
    saved, digest = sim.alloc.save_state(), sim.alloc.state_digest()
    for _ in range(30):
        sim.step()
        sim.alloc.state_digest()
    assert sim.alloc.state_digest() != digest
    sim.alloc.restore_state(saved)
    assert sim.alloc.state_digest() == digest == full_digest(sim.alloc)


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("pop"), st.integers(0, 5)),
        st.tuples(st.sampled_from(["push_front", "push_back", "reset"]), st.lists(st.integers(0, 2**31 - 2), max_size=6)),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(start=st.lists(st.integers(0, 2**31 - 2), max_size=8), ops=_OPS)
def test_seq_hash_depends_on_the_sequence_only(start: list[int], ops: list[tuple]) -> None:
    """Reference model: a Python list. Whatever the history, the hash is that of the
    list now, and a different list hashes differently."""
    model = list(start)
    h = SeqHash(np.array(model, dtype=np.int32))
    for op, arg in ops:
        if op == "pop":
            k = min(arg, len(model))
            h.pop_front(np.array(model[:k], dtype=np.int32))
            model = model[k:]
        elif op == "push_front":
            h.push_front(np.array(arg, dtype=np.int32))
            model = arg + model
        elif op == "push_back":
            h.push_back(np.array(arg, dtype=np.int32))
            model = model + arg
        else:
            h.reset(np.array(arg, dtype=np.int32))
            model = list(arg)
        assert h.value() == SeqHash(np.array(model, dtype=np.int32)).value()
    if len(model) >= 2 and model[0] != model[1]:
        swapped = [model[1], model[0], *model[2:]]
        assert SeqHash(np.array(swapped, dtype=np.int32)).value() != h.value()


def _spec_config(page_size: int) -> AllocatorConfig:
    return AllocatorConfig(pool_tokens=4096, page_size=page_size, max_running=8, max_context_len=600,
                           spec=SpecConfig("eagle", 3, 1, 4))


def test_pre_encapsulation_is_the_builtin_allocator_at_page_1() -> None:
    config = _spec_config(1)
    ours, legacy = RandomScheduler(config, seed=4), RandomScheduler(config, seed=4)
    legacy.alloc = PreEncapsulationAllocator(config)
    for step in range(200):
        ours.step()
        legacy.step()
        assert ours.alloc.state_digest() == legacy.alloc.state_digest(), f"step {step}"


def test_pre_encapsulation_forgets_the_paged_reserve_in_the_bookkeeping() -> None:
    """Page 16, reserve 8: the reserve takes a page for row [32, 48) but the call site
    forgets ``kv_allocated_len = 48``; the builtin allocator records it."""
    tokens = np.arange(32, dtype=np.int64)
    for alloc, recorded in ((create_allocator(_spec_config(16)), 48), (PreEncapsulationAllocator(_spec_config(16)), 32)):
        alloc.extend(np.array([0]), np.array([32]), [tokens])
        alloc.end_step()
        before = alloc.counters().available
        alloc.spec_decode(np.array([0]), np.array([2]))
        lens = alloc.request_lens(np.array([0]))
        assert alloc.counters().available == before - 16  # the page is taken either way
        assert (int(lens.allocated[0]), int(lens.committed[0])) == (recorded, 34)
