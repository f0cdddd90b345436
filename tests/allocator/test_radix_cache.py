"""RadixCache: page-aligned match, split, insert, lock sizes, LRU eviction, bigram keys."""

from __future__ import annotations

import numpy as np
import pytest

from allocator.radix_cache import RadixCache, bigram_units
from allocator.token_to_kv import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator


def _a(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _tree(page_size: int = 1, size: int = 64, is_eagle: bool = False) -> RadixCache:
    if page_size == 1:
        allocator = TokenToKVPoolAllocator(size)
    else:
        allocator = PagedTokenToKVPoolAllocator(size, page_size)
    return RadixCache(page_size, allocator, is_eagle=is_eagle)


def test_insert_match_split_page1() -> None:
    tree = _tree()
    # root - [1 2 3 4]
    assert tree.insert(_a(1, 2, 3, 4), _a(11, 12, 13, 14)).prefix_len == 0
    assert tree.evictable_size() == 4
    # root - [1 2] - [3 4]
    #              \ [5 6]
    res = tree.insert(_a(1, 2, 5, 6), _a(21, 22, 25, 26))
    assert res.prefix_len == 2
    assert tree.evictable_size() == 6 and tree.num_nodes() == 3
    m = tree.match_prefix(_a(1, 2, 3, 9))
    assert m.prefix_len == 3
    # the match split [3 4] into [3] - [4]
    assert tree.num_nodes() == 4
    assert tree.path_device_indices(m.last_node).tolist() == [11, 12, 13]
    assert tree.match_prefix(_a(7)).prefix_len == 0
    assert tree.match_prefix(_a()).prefix_len == 0


def test_page_aligned_match_and_insert() -> None:
    tree = _tree(page_size=4, size=128)
    key = np.arange(100, 110, dtype=np.int64)  # 10 tokens -> 8 stored
    value = np.arange(40, 50, dtype=np.int64)
    assert tree.insert(key, value).prefix_len == 0
    assert tree.total_size() == 8
    # a key sharing 6 tokens matches one page (4)
    probe = np.concatenate([key[:6], _a(7, 7, 7, 7)])
    m = tree.match_prefix(probe)
    assert m.prefix_len == 4
    assert tree.path_device_indices(m.last_node).tolist() == [40, 41, 42, 43]
    # a 7-token key is cut to one page before matching
    assert tree.match_prefix(key[:7]).prefix_len == 4
    assert tree.match_prefix(key[:3]).prefix_len == 0


def test_lock_moves_lengths_and_blocks_eviction() -> None:
    tree = _tree()
    tree.insert(_a(1, 2, 3, 4), _a(1, 2, 3, 4))
    node = tree.insert(_a(1, 2, 5), _a(1, 2, 5)).last_node
    # root - [1 2] - [3 4]
    #              \ [5]   <- locked
    tree.lock(node)
    assert (tree.evictable_size(), tree.protected_size()) == (2, 3)
    tree.lock(node)
    assert (tree.evictable_size(), tree.protected_size()) == (2, 3)
    assert tree.evict(100) == 2  # only [3 4]
    assert tree.total_size() == 3
    tree.unlock(node)
    assert tree.protected_size() == 3
    tree.unlock(node)
    assert (tree.evictable_size(), tree.protected_size()) == (3, 0)
    assert tree.evict(1) == 1 and tree.evict(1) == 2  # [5], then the parent [1 2]
    assert tree.total_size() == 0


def test_lru_order_and_overshoot_free_slots_fifo() -> None:
    allocator = TokenToKVPoolAllocator(32)
    tree = RadixCache(1, allocator)
    slots = allocator.alloc(9)
    tree.insert(_a(1, 1, 1), slots[0:3])  # oldest
    tree.insert(_a(2, 2, 2), slots[3:6])
    tree.insert(_a(3, 3, 3), slots[6:9])
    tree.match_prefix(_a(1, 1))  # touch: [1 1 1] split into [1 1] - [1]; both newest
    # leaves by age: [2 2 2], [3 3 3], [1]
    assert tree.evict(4) == 6  # two whole nodes: overshoot
    assert allocator.free_pages.tolist()[-6:] == slots[3:9].tolist()
    # the parent [1 1] becomes a leaf only after [1] goes
    assert tree.evict(1) == 1
    assert allocator.free_pages.tolist()[-1] == slots[2]
    assert tree.evict(10) == 2
    assert tree.total_size() == 0


def test_eviction_of_paged_leaves_prepends_pages() -> None:
    allocator = PagedTokenToKVPoolAllocator(64, 4)
    tree = RadixCache(4, allocator)
    slots = allocator.alloc(16)  # pages 1..4
    tree.insert(np.arange(8, dtype=np.int64), slots[:8])  # pages 1, 2
    tree.insert(np.arange(100, 108, dtype=np.int64), slots[8:])  # pages 3, 4
    assert tree.evict(1) == 8
    # free_pages [1 2 5 6 ...]: the oldest leaf's pages, in row order, in front
    assert allocator.free_pages.tolist()[:3] == [1, 2, 5]
    tree.evict(1)
    assert allocator.free_pages.tolist()[:5] == [3, 4, 1, 2, 5]


def test_parent_that_became_leaf_competes_by_its_own_time() -> None:
    tree = _tree()
    tree.insert(_a(1, 2, 3), _a(1, 2, 3))
    tree.insert(_a(1, 2, 4), _a(1, 2, 4))  # [1 2] split off: created now
    tree.insert(_a(9), _a(9))
    tree.match_prefix(_a(9))  # [9] newest
    # leaves [3] [4] [9]: evict [3] (oldest) and [4] -> [1 2] is a leaf, older than [9]
    assert tree.evict(2) == 2
    assert tree.evict(1) == 2  # [1 2]
    assert tree.total_size() == 1


def test_split_keeps_lock_count_on_both_parts() -> None:
    tree = _tree()
    node = tree.insert(_a(5, 6, 7, 8), _a(5, 6, 7, 8)).last_node
    tree.lock(node)
    m = tree.match_prefix(_a(5, 6, 0))  # splits the locked node
    assert m.last_node.lock_ref == 1 and node.lock_ref == 1
    tree.unlock(node)  # walks both parts
    assert (tree.evictable_size(), tree.protected_size()) == (4, 0)
    assert tree.evict(4) == 4


def test_bigram_keys_are_one_unit_shorter() -> None:
    tokens = _a(10, 11, 12, 13, 14)
    units = bigram_units(tokens)
    assert units.shape == (4,)
    assert bigram_units(_a(10, 11)).tolist() == units[:1].tolist()
    assert len(set(units.tolist())) == 4
    tree = _tree(is_eagle=True)
    assert tree.key_len(5) == 4
    key = tree.make_key(tokens)
    tree.insert(key, _a(1, 2, 3, 4))
    # same first four tokens, different fifth: three bigrams shared
    assert tree.match_prefix(tree.make_key(_a(10, 11, 12, 13, 99))).prefix_len == 3
    paged = _tree(page_size=4, size=64, is_eagle=True)
    assert paged.key_len(8) == 4 and paged.key_len(9) == 8


@pytest.mark.parametrize("page_size", [1, 4])
def test_random_inserts_keep_sizes_and_values(page_size: int) -> None:
    rng = np.random.default_rng(7)
    tree = _tree(page_size=page_size, size=1 << 16)
    stored: dict[tuple[int, ...], np.ndarray] = {}
    next_slot = 1
    for _ in range(200):
        base = rng.integers(0, 3, 1)[0]
        key = np.concatenate([np.full(int(rng.integers(0, 12)), base), rng.integers(0, 4, int(rng.integers(1, 20)))])
        key = key.astype(np.int64)
        value = np.arange(next_slot, next_slot + key.shape[0], dtype=np.int64)
        next_slot += key.shape[0]
        res = tree.insert(key, value)
        n = key.shape[0] // page_size * page_size
        stored[tuple(key[:n])] = value[:n]
        m = tree.match_prefix(key)
        assert m.prefix_len == n
        path = tree.path_device_indices(m.last_node)
        # the tree's slots for [0, prefix) are older values, the rest this insert's
        assert path[res.prefix_len : n].tolist() == value[res.prefix_len : n].tolist()
    total = sum(len(node) for node in tree.iter_nodes())
    assert total == tree.evictable_size()
    for node in tree.iter_nodes():
        assert len(node) % page_size == 0 and len(node) > 0
        assert node.key_units().shape[0] == len(node)


@pytest.mark.parametrize("page_size", [1, 4])
def test_peek_match_lock_predicts_match_and_lock(page_size: int) -> None:
    """``peek_match_lock`` gives the prefix lengths and the evictable tokens that
    matching and locking a batch would give, and changes nothing itself."""
    rng = np.random.default_rng(11)
    for trial in range(40):
        tree = _tree(page_size=page_size, size=1 << 16)
        slot = 1
        for _ in range(12):
            key = rng.integers(0, 3, int(rng.integers(1, 30))).astype(np.int64)
            tree.insert(key, np.arange(slot, slot + key.shape[0], dtype=np.int64))
            slot += key.shape[0]
        held = list(tree.iter_nodes())
        for node in held[: int(rng.integers(0, 3))]:
            tree.lock(node)  # some paths already protected
        keys = [rng.integers(0, 3, int(rng.integers(0, 30))).astype(np.int64) for _ in range(int(rng.integers(1, 5)))]
        shape = sorted((n.id, len(n), n.lock_ref, n.last_access_time) for n in tree.iter_nodes())
        evictable = tree.evictable_size()
        prefix, cost = tree.peek_match_lock(keys)
        assert sorted((n.id, len(n), n.lock_ref, n.last_access_time) for n in tree.iter_nodes()) == shape
        got = []
        for key in keys:
            m = tree.match_prefix(key)
            tree.lock(m.last_node)
            got.append(m.prefix_len)
        assert prefix.tolist() == got, trial
        assert evictable - tree.evictable_size() == cost, trial
