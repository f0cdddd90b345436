"""The SWA radix tree (``allocator.swa_radix``) inside ``KvAllocator``: shared-prefix
traffic reaches tombstones, SWA-only leaf deletions, gated matches and insert-overlap
recoveries with every invariant of both pools holding, and injected tree faults come
back with ``pool == "swa"`` and the request to blame."""

from __future__ import annotations

import numpy as np
import pytest

from allocator.base import AllocatorConfig, SwaConfig
from allocator.manager import KvAllocator
from allocator.swa_radix import SwaRadixCache


def _allocator(ps: int) -> KvAllocator:
    return KvAllocator(
        AllocatorConfig(
            page_size=ps,
            pool_tokens=4096,
            max_running=8,
            max_context_len=2048,
            radix_cache=True,
            swa=SwaConfig(window=64, swa_pool_tokens=1024, eviction_interval=16),
        )
    )


def _drive(a: KvAllocator, steps: int, seed: int = 0) -> None:
    """Requests sharing prefixes of one base prompt: admit, decode, finish; integrity
    checked after every step (an assertion error names the first violation)."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 1000, 600)
    rid = 0
    live: dict[int, list[int]] = {}
    for step in range(steps):
        if len(live) < 4 and rng.random() < 0.5:
            n = int(rng.integers(100, 400))
            toks = np.concatenate([base[: int(rng.integers(0, 500))], rng.integers(0, 1000, n)])[:700]
            res = a.extend(np.array([rid]), np.array([len(toks)]), [toks])
            if type(res).__name__ != "OutOfMemory":
                live[rid] = toks.tolist()
            rid += 1
        elif live:
            rs = np.array(sorted(live))
            if type(a.decode(rs)).__name__ != "OutOfMemory":
                for r in rs.tolist():
                    live[r].append(int(rng.integers(0, 1000)))
        for r in list(live):
            if len(live[r]) > 500 and rng.random() < 0.1:
                a.release(np.array([r]), np.array([len(live[r]) - 1]), [np.array(live[r])], "finish")
                del live[r]
        a.end_step()
        found = a.check_integrity()
        assert not found, f"step {step}: {found[:3]}"


@pytest.mark.parametrize("ps", [1, 16, 64])
def test_shared_prefix_traffic_reaches_every_swa_tree_path_and_stays_sound(ps: int) -> None:
    a = _allocator(ps)
    _drive(a, 300)
    stats = a.tree_cache.stats  # type: ignore[attr-defined]
    # not vacuous: the SWA-specific paths all ran
    assert stats["tombstoned"] > 0
    assert stats["swa_leaf_deleted"] > 0
    assert stats["gated_match"] > 0
    assert stats["recovered"] + stats["recovered_locked"] > 0
    swa = a.pool_counters()["swa"]
    assert swa.evictable + swa.protected > 0
    assert swa.available + swa.evictable + swa.protected + swa.committed + swa.overallocated == swa.pool_tokens


def test_a_shared_prefix_is_matched_only_with_a_live_window() -> None:
    a = _allocator(16)
    tree = a.tree_cache
    assert isinstance(tree, SwaRadixCache)
    prompt = np.arange(1000, 1400)
    a.extend(np.array([0]), np.array([400]), [prompt])
    a.release(np.array([0]), np.array([400]), [prompt], "finish")
    # the finished request kept its whole window live: a full hit
    follow = np.concatenate([prompt, np.arange(5000, 5100)])
    assert a.match_prefix(follow) == 400
    # tombstone the tail's SWA: the hit falls back past the tombstones (here: nothing)
    tree.evict_pools(0, 1024)
    assert tree.swa_evictable_size() == 0
    assert a.match_prefix(follow) == 0
    assert not a.check_integrity()


def _one_cached_one_locked(ps: int) -> tuple[KvAllocator, SwaRadixCache]:
    a = _allocator(ps)
    tree = a.tree_cache
    assert isinstance(tree, SwaRadixCache)
    prompt = np.arange(2000, 2300)
    a.extend(np.array([0]), np.array([300]), [prompt])
    a.release(np.array([0]), np.array([300]), [prompt], "finish")
    a.extend(np.array([1]), np.array([340]), [np.concatenate([prompt, np.arange(40)])])
    a.end_step()
    assert not a.check_integrity()
    return a, tree


@pytest.mark.parametrize("ps", [1, 16])
def test_a_tombstone_still_holding_swa_is_caught(ps: int) -> None:
    a, tree = _one_cached_one_locked(ps)
    row = a.row_of(1)
    node = a.req_kv.lock_node[row]
    assert node is not None and node.swa_value is not None  # type: ignore[attr-defined]
    # a buggy tombstone: the value dropped, the SWA slots never freed
    node.swa_value = None  # type: ignore[attr-defined]
    found = [v for v in a.check_integrity() if v.check == "tree"]
    assert found and all(v.pool == "swa" for v in found)
    assert any("tombstone" in v.detail and v.rid == 1 for v in found)


@pytest.mark.parametrize("ps", [1, 16])
def test_an_swa_lock_past_the_window_is_caught(ps: int) -> None:
    a, tree = _one_cached_one_locked(ps)
    row = a.row_of(1)
    node = a.req_kv.lock_node[row]
    uuid = a.req_kv.lock_swa_uuid[row]
    while node.swa_uuid != uuid:  # type: ignore[union-attr]
        node = node.parent  # type: ignore[union-attr]
    above = node.parent  # type: ignore[union-attr]
    assert above is not None and above is not tree.root_node
    above.swa_lock_ref += 1  # type: ignore[attr-defined]
    found = [v for v in a.check_integrity() if v.check == "tree"]
    assert found and all(v.pool == "swa" for v in found)
    assert any("past the window" in v.detail and v.rid == 1 for v in found)
