"""The manager (``KvAllocator``) with HiCache's host tier (``AllocatorConfig.hicache``):
a prefix evicted from the device is demoted to the host pool and loaded back when a
later request matches it; the host pool is a second pool in ``pool_counters()``; the
tier's transfers are acked at the next step; every check (``check_hicache`` beside the
other invariants) stays clean."""

from __future__ import annotations

import numpy as np
import pytest

from allocator.base import AllocatorConfig, AllocResult, HiCacheConfig
from allocator.hiradix import HiRadixCache
from allocator.manager import KvAllocator

POLICIES = ("write_through", "write_through_selective", "write_back")


def _alloc(ps: int, policy: str, pool: int = 256, ratio: float = 4.0) -> KvAllocator:
    return KvAllocator(AllocatorConfig(
        pool_tokens=pool, page_size=ps, max_running=8, max_context_len=1024,
        hicache=HiCacheConfig(host_ratio=ratio, write_policy=policy, page_size=ps),
    ))  # fmt: skip


def _serve(a: KvAllocator, rid: int, toks: np.ndarray) -> AllocResult:
    """Admit, prefill and finish one request (one step each), as a replay does."""
    res = a.extend(np.array([rid]), np.array([toks.shape[0]]), [toks])
    assert isinstance(res, AllocResult), res
    a.end_step()
    a.release(np.array([rid]), np.array([toks.shape[0]]), [toks], "finish")
    a.end_step()
    assert a.check_integrity() == []
    return res


@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("policy", POLICIES)
def test_an_evicted_prefix_is_loaded_back_from_host(ps: int, policy: str) -> None:
    a = _alloc(ps, policy)
    assert isinstance(a.tree_cache, HiRadixCache)
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, 50_000, 160, dtype=np.int64)
    _serve(a, 0, prompt)
    if policy == "write_through_selective":  # the second hit backs it up
        res = _serve(a, 1, np.concatenate([prompt, [7]]))
        assert res.host_hit_lens is not None and res.host_hit_lens[0] == 0
    # Other prompts push the first one off the device (demoted under every policy:
    # write_back backs it up on eviction).
    for rid in range(2, 6):
        _serve(a, rid, rng.integers(1, 50_000, 200, dtype=np.int64))
    tree = a.tree_cache
    assert tree.stats["demoted"] > 0
    res = _serve(a, 9, np.concatenate([prompt, rng.integers(1, 50_000, 20, dtype=np.int64)]))
    host = int(res.host_hit_lens[0])  # type: ignore[index]
    assert host >= 100 and tree.stats["loaded_back"] >= host
    assert int(res.prefix_lens[0]) >= host  # type: ignore[index]
    pools = a.pool_counters()
    assert set(pools) == {"full", "host"}
    host_pool = pools["host"]
    assert host_pool.pool_tokens == HiCacheConfig(4.0, page_size=ps).pool_tokens(a.pool_tokens)
    assert host_pool.available + host_pool.evictable + host_pool.protected == host_pool.pool_tokens


def test_the_load_back_lock_is_released_at_the_next_step() -> None:
    a = _alloc(1, "write_through")
    rng = np.random.default_rng(1)
    prompt = rng.integers(1, 50_000, 160, dtype=np.int64)
    _serve(a, 0, prompt)
    for rid in range(1, 5):
        _serve(a, rid, rng.integers(1, 50_000, 200, dtype=np.int64))
    tree = a.tree_cache
    res = a.extend(np.array([9]), np.array([170]), [np.concatenate([prompt, np.arange(1, 11)])])
    assert isinstance(res, AllocResult) and res.host_hit_lens[0] > 0  # type: ignore[index]
    assert tree.ongoing_load_back  # the load is in flight until SGLang's next poll
    a.end_step()
    assert tree.ongoing_load_back and a.check_integrity() == []
    a.decode(np.array([9]))  # the next step's first allocation polls
    assert not tree.ongoing_load_back and a.check_integrity() == []


def test_without_the_tier_the_tree_is_the_plain_one() -> None:
    a = KvAllocator(AllocatorConfig(pool_tokens=256, max_running=8, max_context_len=1024))
    assert not isinstance(a.tree_cache, HiRadixCache)
    assert set(a.pool_counters()) == {"full"}


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [({"radix_cache": False}, "needs the radix cache"), ({"eviction_policy": "lfu"}, "LRU only")],
)
def test_a_tier_the_manager_cannot_serve_is_refused(extra: dict, fragment: str) -> None:
    cfg = AllocatorConfig(pool_tokens=256, max_running=8, max_context_len=1024, hicache=HiCacheConfig(), **extra)
    with pytest.raises(ValueError, match=fragment):
        cfg.check()
