"""The built-in allocator with a Mamba pool and the radix cache on (``MambaRadixCache``,
no_buffer at page 1): a prompt's state is checkpointed into the tree at its publish (a
copy in a fresh slot) and at the finish (the request's own slot), a new request resumes
only where a state sits and copies it into a slot of its own, checkpoints are evicted
when admissions need their slots, a retraction frees the slot, and the counters, checks
and checkpoints see the cached states."""

from __future__ import annotations

import numpy as np

from allocator.base import AllocatorConfig, MambaConfig, SpecConfig
from allocator.check.checkpoint import restore_allocator_state, save_allocator_state
from allocator.manager import KvAllocator
from allocator.mamba_radix import MambaRadixCache


def make(slots: int = 12, max_running: int = 4, pool: int = 4000, spec: SpecConfig | None = None) -> KvAllocator:
    return KvAllocator(AllocatorConfig(pool_tokens=pool, page_size=1, max_running=max_running, max_context_len=1000,
                                       radix_cache=True, mamba=MambaConfig(slots=slots), spec=spec))


def ids(*ranges: tuple[int, int]) -> np.ndarray:
    return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in ranges])


def one(rid: int) -> np.ndarray:
    return np.array([rid], dtype=np.int64)


def prefill(a: KvAllocator, rid: int, toks: np.ndarray) -> int:
    res = a.extend(one(rid), np.array([toks.shape[0]]), [toks])
    a.end_step()
    return int(res.prefix_lens[0])  # type: ignore[union-attr]


def finish(a: KvAllocator, rid: int, toks: np.ndarray) -> None:
    a.release(one(rid), np.array([toks.shape[0]]), [toks], kind="finish")


def own_slot(a: KvAllocator, rid: int) -> int | None:
    return next((r.mamba_pool_idx for r in a.mamba_reqs() if r.rid == rid), None)


def test_the_tree_is_the_mamba_radix_cache_and_a_publish_copies_the_state() -> None:
    a = make()
    assert isinstance(a.tree_cache, MambaRadixCache)
    prefill(a, 1, ids((1, 101)))
    tree = a.tree_cache
    # the prompt's state: a copy in a slot of the tree's own, beside the request's
    assert len(tree.cached_states()) == 1 and tree.cached_states() != [own_slot(a, 1)]
    mamba = a.pool_counters()["mamba"]
    assert (mamba.available, mamba.evictable, mamba.protected, mamba.committed) == (10, 0, 1, 1)
    assert a.check_integrity() == []


def test_a_new_request_resumes_at_a_checkpoint_and_copies_its_state() -> None:
    a = make()
    t1 = ids((1, 101))
    prefill(a, 1, t1)
    a.decode(one(1))
    finish(a, 1, ids((1, 102)))
    tree = a.tree_cache
    assert isinstance(tree, MambaRadixCache)
    # prompt end (100) and finish end (101) both hold a state; none is the request's now
    assert len(tree.cached_states()) == 2 and a.mamba_reqs() == []
    assert prefill(a, 2, ids((1, 101), (500, 550))) == 100
    req = a.mamba_reqs()[0]
    assert req.mamba_cow_src in tree.cached_states() and req.mamba_pool_idx not in tree.cached_states()
    mamba = a.pool_counters()["mamba"]
    # two cached (one locked by rid 2's match, and its own publish at 150: 3), one held
    assert mamba.evictable + mamba.protected == 3 and mamba.committed == 1
    assert mamba.available + mamba.evictable + mamba.protected + mamba.committed == 12
    assert a.check_integrity() == []


def test_a_shared_prefix_without_a_state_is_not_reused() -> None:
    a = make()
    prefill(a, 1, ids((1, 101)))
    # the first 50 tokens are cached but hold no state: SGLang's match stops at the root
    assert prefill(a, 2, ids((1, 51), (700, 760))) == 0
    assert a.check_integrity() == []


def test_checkpoints_are_evicted_when_admissions_need_their_slots() -> None:
    a = make(slots=3, max_running=1)
    tree = a.tree_cache
    assert isinstance(tree, MambaRadixCache)
    for rid in range(1, 6):
        toks = ids((rid * 1000, rid * 1000 + 40))
        prefill(a, rid, toks)
        finish(a, rid, toks)
        assert a.check_integrity() == [], rid
    assert tree.mamba_evicted_total > 0
    mamba = a.pool_counters()["mamba"]
    assert mamba.available + mamba.evictable + mamba.protected == 3 and mamba.committed == 0


def test_a_retraction_frees_the_slot_and_keeps_the_checkpoint() -> None:
    a = make()
    prefill(a, 1, ids((1, 101)))
    slot = own_slot(a, 1)
    a.release(one(1), np.array([100]), None, kind="retract")
    pool = a.req_to_token_pool
    assert slot in pool.mamba_free_slots_np().tolist()  # type: ignore[attr-defined]
    assert len(a.tree_cache.cached_states()) == 1  # type: ignore[attr-defined]
    assert a.pool_counters()["mamba"].committed == 0 and a.check_integrity() == []


def test_a_checkpoint_round_trips_the_tree_with_its_states() -> None:
    a = make()
    prefill(a, 1, ids((1, 101)))
    finish(a, 1, ids((1, 101)))
    prefill(a, 2, ids((1, 101), (300, 320)))
    saved = save_allocator_state(a)
    digest = a.state_digest()
    prefill(a, 3, ids((1, 101), (900, 950)))
    finish(a, 2, ids((1, 101), (300, 320)))
    assert a.state_digest() != digest
    restore_allocator_state(a, saved)
    assert a.state_digest() == digest and save_allocator_state(a).digest() == saved.digest()
    # the restored tree still gates and copies: rid 3 resumes at the checkpoint as before
    assert prefill(a, 3, ids((1, 101), (900, 950))) == 100
    assert a.check_integrity() == []


def test_under_eagle_the_tree_is_keyed_by_tokens_not_bigrams() -> None:
    # SGLang turns the bigram keys off in a tree with a MAMBA component: the whole
    # prompt is cached and protected, not one unit less
    a = make(spec=SpecConfig())
    assert not a.tree_cache.is_eagle
    prefill(a, 1, ids((1, 101)))
    assert a.request_lens(one(1)).protected.tolist() == [100]
    assert a.pool_counters()["full"].protected == 100 and a.check_integrity() == []
