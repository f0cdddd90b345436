"""HiRadixCache (``allocator.hiradix``) and its host pool: properties and injected faults.

Properties run the parity generator's seeded op lists (ours only) with
``check_hicache`` after every op: both tiers conserved, each node's residency agrees with
the slots that hold it, no host slot owned twice. Faults are injected into a real tree
and must be caught by ``allocator.check.hicache_invariants`` with the tier named.
"""

from __future__ import annotations

import numpy as np
import pytest

from allocator.base import HiCacheConfig
from allocator.check.hicache_invariants import check_hicache
from allocator.hiradix import HiRadixCache, HiTreeNode
from allocator.host_pool import HostDoubleFree, HostKVPool
from allocator.token_to_kv import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from tests.allocator.test_hiradix_parity import generate
from tests.differential.hiradix_driver import OursAdapter, apply_op

POLICIES = ("write_through", "write_through_selective", "write_back")


def _tree(ps: int = 1, policy: str = "write_through", pool: int = 64, host: int = 32) -> HiRadixCache:
    alloc = TokenToKVPoolAllocator(pool) if ps == 1 else PagedTokenToKVPoolAllocator(pool * ps, ps)
    return HiRadixCache(ps, alloc, HostKVPool(host * ps, ps), policy)


def _demoted(ps: int = 1, policy: str = "write_through") -> tuple[HiRadixCache, HiTreeNode]:
    """A tree holding one 16-page prefix, backed up and then evicted from device."""
    t = _tree(ps, policy)
    key = np.arange(1, 16 * ps + 1, dtype=np.int64)
    r = t.insert(key, t.token_to_kv_pool_allocator.alloc(16 * ps))
    t.ack()
    if policy == "write_through_selective":  # a second hit reaches its threshold
        t.insert(key, t.path_device_indices(r.last_node), prev_prefix_len=16 * ps)
        t.ack()
    t.evict(ps)
    assert r.last_node.evicted and r.last_node.backuped
    return t, r.last_node


def _kinds(violations: list) -> set[tuple[str, str]]:
    return {(v.check, v.pool) for v in violations}


# ---------------------------------------------------------------------- config and pool


def test_config_sizes_host_pool_as_sglang() -> None:
    """``int(device * ratio)`` rounded down to a page plus one padding page; an explicit
    size is used as is; bad values are refused naming the field."""
    assert HiCacheConfig(host_ratio=2.0, page_size=16).pool_tokens(1000) == (2000 // 16 + 1) * 16
    assert HiCacheConfig(host_ratio=0.5).pool_tokens(11) == 6
    assert HiCacheConfig(host_pool_tokens=64, page_size=16).pool_tokens(10_000) == 64
    for bad in (HiCacheConfig(host_pool_tokens=10, page_size=16), HiCacheConfig(host_ratio=0.0),
                HiCacheConfig(write_policy="write_around")):  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="HiCacheConfig"):
            bad.check()
    t = HiRadixCache.from_config(HiCacheConfig(host_ratio=1.0, write_policy="write_back"), TokenToKVPoolAllocator(8), 8)
    assert t.host_pool.size == 9 and t.is_write_back


def test_host_pool_reuses_freed_chunks_last() -> None:
    h = HostKVPool(8, 2)
    a, b = h.alloc(4), h.alloc(2)
    assert a.tolist() == [0, 1, 2, 3] and b.tolist() == [4, 5]
    h.free(a[:2])
    assert h.alloc(2).tolist() == [6, 7]  # the free list first, freed chunks only when short
    assert h.alloc(2).tolist() == [0, 1]
    assert h.alloc(2) is None and h.available_size() == 0
    with pytest.raises(ValueError, match="multiple of the page"):
        h.alloc(1)


def test_host_pool_refuses_a_double_free() -> None:
    h = HostKVPool(4)
    s = h.alloc(2)
    h.free(s)
    with pytest.raises(HostDoubleFree, match="double free"):
        h.free(s)
    assert h.available_size() == 4


# ---------------------------------------------------------------------- behaviour


@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("policy", POLICIES)
def test_demote_then_load_back_keeps_host_copy(ps: int, policy: str) -> None:
    t, node = _demoted(ps, policy)
    host_slots = node.host_value.tolist()
    assert t.path_len(node) == 16 * ps and t.path_device_indices(node).shape[0] == 0
    m = t.match_prefix_hi(np.arange(1, 16 * ps + 1, dtype=np.int64))
    assert (m.device_prefix_len, m.host_hit_len, m.best_match_node) == (0, 16 * ps, node)
    loaded, anchor = t.init_load_back(m)
    assert (loaded, anchor) == (16 * ps, node)
    assert node.value is not None and node.host_value.tolist() == host_slots
    assert node.lock_ref == 1 and node.host_lock_ref == 1  # in flight until the ack
    assert check_hicache(t, held_device=0) == []
    t.ack()
    assert node.lock_ref == 0 and node.host_lock_ref == 0 and t.protected_size_ == 0
    assert check_hicache(t, held_device=0) == []


def test_write_through_unbacked_leaf_is_deleted_and_host_leaf_evicted() -> None:
    t = _tree(policy="write_through_selective")
    r = t.insert(np.arange(1, 9), t.token_to_kv_pool_allocator.alloc(8))  # one hit: below threshold 2
    assert r.last_node.host_value is None
    assert t.evict(1) == 8 and not t.root_node.children  # nothing on host: deleted
    t2, node = _demoted()
    assert t2.evict_host(1) == 16 and not t2.root_node.children
    assert t2.host_pool.available_size() == t2.host_pool.size
    assert check_hicache(t2, held_device=0) == []


def test_write_back_reclaims_host_duplicates_before_leaves() -> None:
    t, node = _demoted(policy="write_back")
    t.init_load_back(t.match_prefix_hi(np.arange(1, 17)))
    t.ack()
    assert node.value is not None and node.host_value is not None  # on both tiers
    assert t.evict_host(1) == 16 and node.host_value is None and node.value is not None
    assert t.stats["host_reclaimed"] == 16
    assert check_hicache(t, held_device=0) == []


def test_load_back_below_threshold_is_refused_and_unlocked() -> None:
    t = _tree(host=8)
    r = t.insert(np.arange(1, 5), t.token_to_kv_pool_allocator.alloc(4))
    t.ack()
    t.evict(4)
    m = t.match_prefix_hi(np.arange(1, 5))
    assert m.host_hit_len == 4
    assert t.init_load_back(m) == (0, t.root_node)
    assert r.last_node.lock_ref == 0 and r.last_node.host_lock_ref == 0 and r.last_node.evicted
    assert check_hicache(t, held_device=0) == []


# ---------------------------------------------------------------------- properties


@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("policy", POLICIES)
def test_random_ops_keep_every_invariant(ps: int, policy: str) -> None:
    for seed in range(3):
        case, _ = generate(seed, ps, policy, num_ops=100)
        side = OursAdapter(case)
        reqs: dict = {}
        for i, op in enumerate(case["ops"]):
            apply_op(side, reqs, op)
            held = sum(len(r["own"]) for r in reqs.values())
            v = check_hicache(side.tree, held_device=held)
            assert v == [], (seed, i, op, v)


# ---------------------------------------------------------------------- injected faults


def test_fault_host_slot_freed_twice_is_caught() -> None:
    t, node = _demoted()
    h = t.host_pool
    # A buggy free that bypasses the pool's bitmap: the node's slots go back while it keeps them.
    h.release_slots.append(node.host_value[:4].copy())
    h.num_release_slots += 4
    assert {("ownership", "host"), ("conservation", "host")} <= _kinds(check_hicache(t))
    # The same chunk freed a second time: on the free list twice.
    h.release_slots.append(node.host_value[:4].copy())
    h.num_release_slots += 4
    assert ("double_free", "host") in _kinds(check_hicache(t))


def test_fault_host_resident_node_without_host_slots_is_caught() -> None:
    t, node = _demoted()
    node.host_value = np.empty(0, dtype=np.int64)  # marked host-resident, holds nothing
    kinds = _kinds(check_hicache(t, held_device=0))
    assert ("residency", "host") in kinds and ("leak", "host") in kinds


class _LeakyLoadBack(HiRadixCache):
    """A load-back that takes one page more than it loads and drops it."""

    def load_back(self, node: HiTreeNode, mem_quota: int | None = None) -> bool:
        spare = self.token_to_kv_pool_allocator.alloc(self.page_size)
        assert spare is not None
        return super().load_back(node, mem_quota)


def test_fault_load_back_leaking_device_slots_is_caught() -> None:
    alloc = TokenToKVPoolAllocator(64)
    t = _LeakyLoadBack(1, alloc, HostKVPool(32), "write_through")
    t.insert(np.arange(1, 17), alloc.alloc(16))
    t.ack()
    t.evict(1)
    assert check_hicache(t, held_device=0) == []
    t.init_load_back(t.match_prefix_hi(np.arange(1, 17)))
    t.ack()
    v = check_hicache(t, held_device=0)
    assert [(x.check, x.pool) for x in v] == [("conservation", "full")], v


def test_fault_device_value_under_evicted_parent_is_caught() -> None:
    t = _tree()
    r = t.insert(np.arange(1, 17), t.token_to_kv_pool_allocator.alloc(16))
    t.ack()
    t.insert(np.arange(1, 25), np.concatenate([r.last_node.value, t.token_to_kv_pool_allocator.alloc(8)]),
             prev_prefix_len=16)
    t.ack()
    parent = r.last_node
    t.token_to_kv_pool_allocator.free_segment(parent.value, 0)
    t.evictable_size_ -= 16
    parent.value = None  # evicted while its child stays on device
    assert ("residency", "full") in _kinds(check_hicache(t, held_device=0))
