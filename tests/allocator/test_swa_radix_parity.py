"""Regressions of ``SwaRadixCache`` inside ``KvAllocator`` found by the differential
parity with SGLang 0.5.23's ``UnifiedRadixCache(FULL, SWA)``
(``tests/differential/test_sglang_swa_parity.py``); each test pins SGLang's behaviour
on a small hand-built tree."""

from __future__ import annotations

import numpy as np

from allocator.base import AllocatorConfig, OutOfMemory, SwaConfig
from allocator.manager import KvAllocator
from allocator.swa_radix import SwaRadixCache


def _allocator(
    pool_tokens: int, swa_pool_tokens: int, window: int, ps: int = 1
) -> tuple[KvAllocator, SwaRadixCache]:
    a = KvAllocator(AllocatorConfig(
        page_size=ps, pool_tokens=pool_tokens, max_running=8, max_context_len=256, radix_cache=True,
        swa=SwaConfig(window=window, swa_pool_tokens=swa_pool_tokens, eviction_interval=4),
    ))
    assert isinstance(a.tree_cache, SwaRadixCache)
    return a, a.tree_cache


def _cache(a: KvAllocator, rid: int, prompt: np.ndarray) -> None:
    """Prefill ``prompt`` and finish at once: the prompt is cached, nothing locked."""
    assert not isinstance(a.extend(np.array([rid]), np.array([prompt.shape[0]]), [prompt]), OutOfMemory)
    a.release(np.array([rid]), np.array([prompt.shape[0]]), [prompt], "finish")
    a.end_step()


def test_full_eviction_walk_takes_the_parent_a_deletion_leaves_a_leaf() -> None:
    """SGLang's FULL walk (``components/full.py`` ``_evict_device_next_node``) pushes
    the parent of the leaf it just deleted when that left the parent an evictable
    leaf, so an old shared prefix goes before a newer unrelated prompt."""
    a, tree = _allocator(512, 512, window=4)
    shared = np.arange(1, 7)
    _cache(a, 0, np.concatenate([shared, np.arange(101, 107)]))
    _cache(a, 1, np.concatenate([shared, np.arange(201, 207)]))
    newer = np.arange(301, 313)
    _cache(a, 2, newer)
    assert tree.evictable_size() == 30
    # the two 6-token leaves, then their 6-token parent: 18 tokens, the newer prompt kept
    assert tree.evict_pools(18, 0, targets=False) == 18
    assert a.match_prefix(np.concatenate([newer, [9]])) == 12
    assert a.match_prefix(np.concatenate([shared, [9]])) == 0
    assert not a.check_integrity()


def test_an_extend_short_of_swa_slots_evicts_swa_only_cache() -> None:
    """SGLang's ``SWATokenToKVPoolAllocator.evict_to_free_tokens`` asks the tree for
    each pool's own shortfall: an extend that fits the full pool's free slots and the
    SWA pool's free + SWA-evictable slots succeeds even when every cached full token
    is locked (the fit is per pool, not the smaller pool against FULL's evictable)."""
    a, tree = _allocator(256, 64, window=8)
    prompt = np.arange(1, 41)
    _cache(a, 0, prompt)
    # r1 matches the whole prompt: FULL locks all 40, SWA only its trailing window
    follow = np.concatenate([prompt, np.arange(500, 510)])
    assert not isinstance(a.extend(np.array([1]), np.array([50]), [follow]), OutOfMemory)
    a.end_step()
    assert tree.evictable_size() == 0
    swa_evictable = tree.swa_evictable_size()
    swa_free = a.token_to_kv_pool_allocator.swa_available_size()
    assert swa_evictable > 0 and swa_free > 0
    # more than the SWA pool has free, within its free + SWA-evictable slots
    fresh = np.arange(1000, 1000 + swa_free + swa_evictable)
    assert fresh.shape[0] < a.token_to_kv_pool_allocator.full_available_size()
    res = a.extend(np.array([2]), np.array([fresh.shape[0]]), [fresh])
    assert not isinstance(res, OutOfMemory), res
    a.end_step()
    assert tree.swa_evictable_size() < swa_evictable
    assert not a.check_integrity()


def test_pd_prealloc_at_page_1_evicts_full_only() -> None:
    """SGLang's ``_pre_alloc`` at page 1 asks the tree for the full pool's shortfall
    only, then ``alloc`` takes the rest in both pools: a fill the SWA pool can hold
    only by evicting SWA cache is out of memory (and changes nothing), although an
    extend of the same length, which evicts per pool, fits."""
    a, tree = _allocator(256, 64, window=8)
    _cache(a, 0, np.arange(1, 41))
    swa_free = a.token_to_kv_pool_allocator.swa_available_size()
    swa_evictable = tree.swa_evictable_size()
    assert swa_evictable > 0
    fill = swa_free + 1
    assert fill < a.token_to_kv_pool_allocator.full_available_size()
    before = a.pool_counters()
    res = a.prealloc(np.array([1]), np.array([fill]), [np.arange(5000, 5000 + fill)])
    assert isinstance(res, OutOfMemory), res
    assert a.pool_counters() == before and tree.swa_evictable_size() == swa_evictable
    assert not isinstance(a.extend(np.array([2]), np.array([fill]), [np.arange(7000, 7000 + fill)]), OutOfMemory)
    assert not a.check_integrity()


def test_pd_prealloc_with_radix_keeps_a_window_before_the_insert_boundary() -> None:
    """With the decode radix cache, SGLang's ``_swa_tail_len`` starts the SWA tail a
    window (at least a page) before the last committed position, page floored, so the
    cached key keeps a whole window: fill 104, window 24, page 16 -> tail from 64
    (80 without the radix cache)."""
    a, _tree = _allocator(1024, 512, window=24, ps=16)
    prompt = np.arange(1, 105)
    res = a.prealloc(np.array([0]), np.array([104]), [prompt])
    assert not isinstance(res, OutOfMemory), res
    a.end_step()
    row = a.row_of(0)
    assert int(a.req_kv.swa_evicted_seqlen[row]) == 64
    slots = np.asarray(a.row_slots(0), dtype=np.int64)
    mapped = a.token_to_kv_pool_allocator.full_to_swa_index_mapping[slots] > 0
    assert not mapped[:64].any() and mapped[64:].all()
    assert not a.check_integrity()


def test_a_trial_copy_shares_nothing_with_the_live_tree() -> None:
    """The PD fit check runs a batch on ``trial_copy``: evicting, matching and locking
    there leaves the live tree, its pools and its invariants as they were."""
    a, tree = _allocator(256, 64, window=8)
    _cache(a, 0, np.arange(1, 41))
    _cache(a, 1, np.concatenate([np.arange(1, 21), np.arange(900, 920)]))
    before = (a.pool_counters(), tree.evictable_size(), tree.swa_evictable_size(), tree.stats.copy())
    trial = tree.trial_copy()
    trial.lock(trial.match_prefix_swa(np.arange(1, 41)).last_node)
    trial.evict_pools(1 << 20, 1 << 20)
    assert trial.evictable_size() == 0 and trial._alloc.full_available_size() > a.token_to_kv_pool_allocator.full_available_size()
    assert (a.pool_counters(), tree.evictable_size(), tree.swa_evictable_size(), tree.stats) == before
    assert not a.check_integrity()
