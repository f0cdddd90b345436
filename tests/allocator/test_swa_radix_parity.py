"""Regressions of ``SwaRadixCache`` inside ``KvAllocator`` found by the differential
parity with SGLang 0.5.23's ``UnifiedRadixCache(FULL, SWA)``
(``tests/differential/test_sglang_swa_parity.py``); each test pins SGLang's behaviour
on a small hand-built tree."""

from __future__ import annotations

import numpy as np

from allocator.base import AllocatorConfig, OutOfMemory, SwaConfig
from allocator.manager import KvAllocator
from allocator.swa_radix import SwaRadixCache


def _allocator(pool_tokens: int, swa_pool_tokens: int, window: int) -> tuple[KvAllocator, SwaRadixCache]:
    a = KvAllocator(AllocatorConfig(
        page_size=1, pool_tokens=pool_tokens, max_running=8, max_context_len=256, radix_cache=True,
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
