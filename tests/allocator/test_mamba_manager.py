"""The built-in allocator with a Mamba state pool (``AllocatorConfig.mamba``, radix cache
off): a slot taken with each new request's row in batch order, kept across prefill
chunks, given back at finish / abort / retraction, an OutOfMemory of pool "mamba" that
takes nothing, and the pool in the counters, checks, checkpoints and digest."""

from __future__ import annotations

import numpy as np
import pytest

from allocator.base import AllocatorConfig, MambaConfig, OutOfMemory
from allocator.check.digest import full_digest
from allocator.manager import KvAllocator


def make(slots: int = 3, page_size: int = 16, **kw: object) -> KvAllocator:
    config = AllocatorConfig(pool_tokens=512, page_size=page_size, max_running=4, max_context_len=256,
                             radix_cache=False, mamba=MambaConfig(slots=slots), **kw)  # type: ignore[arg-type]
    return KvAllocator(config)


def ids(*rids: int) -> np.ndarray:
    return np.array(rids, dtype=np.int64)


def extend(a: KvAllocator, rids: list[int], lens: list[int], done: bool = True) -> object:
    return a.extend(ids(*rids), ids(*lens), [np.arange(n) for n in lens], np.full(len(rids), done))


def slot_of(a: KvAllocator, rid: int) -> int | None:
    return next((r.mamba_pool_idx for r in a.mamba_reqs() if r.rid == rid), None)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_admission_takes_a_slot_per_request_in_batch_order(page_size: int) -> None:
    a = make(page_size=page_size)
    extend(a, [7, 3], [10, 20])
    assert (slot_of(a, 7), slot_of(a, 3)) == (1, 2)
    row = a.row_of(7)
    assert a.req_to_token_pool.req_index_to_mamba_index_mapping[row] == 1  # type: ignore[attr-defined]
    mamba = a.pool_counters()["mamba"]
    assert (mamba.pool_tokens, mamba.available, mamba.committed, mamba.running_requests) == (3, 1, 2, 2)
    assert a.check_integrity() == []


def test_a_continuing_chunk_keeps_its_slot() -> None:
    a = make()
    extend(a, [1], [10], done=False)
    extend(a, [1, 2], [20, 5])
    assert (slot_of(a, 1), slot_of(a, 2)) == (1, 2)
    assert a.pool_counters()["mamba"].available == 1


@pytest.mark.parametrize("kind", ["finish", "abort", "retract"])
def test_release_gives_the_slot_back_to_the_tail(kind: str) -> None:
    a = make()
    extend(a, [1, 2], [10, 10])
    a.release(ids(1), ids(10), [np.arange(10)], kind)  # type: ignore[arg-type]
    assert a.req_to_token_pool.mamba_free_slots_np().tolist() == [3, 1]  # type: ignore[attr-defined]
    assert slot_of(a, 1) is None and a.check_integrity() == []
    extend(a, [1], [10])  # re-admitted (a retraction's request comes back): a fresh slot
    assert slot_of(a, 1) == 3


def test_too_few_slots_is_an_oom_of_the_mamba_pool_that_takes_nothing() -> None:
    a = make(slots=2)
    extend(a, [1], [10])
    before = a.state_digest()
    out = extend(a, [2, 3], [10, 10])
    assert out == OutOfMemory("extend", 3, 2, 1, 0, "mamba")
    assert a.state_digest() == before and a.row_of(2) == -1


def test_checkpoints_and_digests_carry_the_pool() -> None:
    a = make()
    extend(a, [1, 2], [10, 10])
    state = a.save_state()
    digest = a.state_digest()
    a.release(ids(1), ids(10), None, "abort")
    extend(a, [3], [10])
    assert a.state_digest() != digest and full_digest(a) == a.state_digest()
    a.restore_state(state)
    assert a.state_digest() == digest == full_digest(a)
    assert (slot_of(a, 1), slot_of(a, 2), slot_of(a, 3)) == (1, 2, None)
    assert a.save_state().digest() == state.digest()
    # only the Mamba free list differs: the digest sees it
    b = make()
    extend(b, [1, 2], [10, 10])
    assert b.state_digest() == digest
    b.req_to_token_pool.mamba_allocator.free_slots = np.array([3, 3])  # type: ignore[attr-defined]
    assert full_digest(b) != digest


def test_the_checks_see_a_leaked_and_a_twice_freed_slot() -> None:
    a = make()
    extend(a, [1, 2], [10, 10])
    pool = a.req_to_token_pool
    pool.mamba_allocator.free(np.array([2]))  # type: ignore[attr-defined]  # rid 2 still holds slot 2
    found = {(v.check, v.rid, v.pool) for v in a.check_integrity()}
    assert ("ownership", 2, "mamba") in found
    b = make()
    extend(b, [1, 2], [10, 10])
    b.ctx.mamba_reqs[b.row_of(2)].mamba_pool_idx = None  # type: ignore[index]  # slot 2 held by no one
    found = {(v.check, v.rid, v.pool) for v in b.check_integrity()}
    assert ("leak", 2, "mamba") in found  # blamed on the request the slot was last handed to


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"radix_cache": True}, "no_buffer runs at page size 1 only"),
        ({"radix_cache": True, "page_size": 1,
          "mamba": MambaConfig(slots=3, strategy="extra_buffer", overlap_schedule=True)},
         "a Mamba radix cache with extra_buffer under the overlap scheduler is not implemented"),
        ({"need_sort": True}, "a Mamba pool with PD decode"),
    ],
)
def test_a_configuration_the_pool_does_not_serve_is_refused(edit: dict[str, object], message: str) -> None:
    base = dict(pool_tokens=512, page_size=16, max_running=4, max_context_len=256, radix_cache=False,
                mamba=MambaConfig(slots=3))
    with pytest.raises(ValueError, match=message):
        AllocatorConfig(**{**base, **edit}).check()  # type: ignore[arg-type]
