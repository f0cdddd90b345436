"""Radix eviction policies: each policy's order on a hand-built tree, the node fields
they read (hit counts, priorities), and a hypothesis check against a reference that
sorts every evictable leaf by SGLang's ``get_priority`` key."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allocator.base import AllocatorConfig
from allocator.evict_policy import EVICTION_POLICIES, check_eviction_policy
from allocator.radix_cache import RadixCache, TreeNode, restore_tree_state, save_tree_state
from allocator.token_to_kv import TokenToKVPoolAllocator


def _a(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


class _Removed:
    """Listener keeping the first unit of each evicted node's key, in eviction order."""

    def __init__(self) -> None:
        self.order: list[int] = []

    def stored(self, leaf: TreeNode) -> None:
        pass

    def split(self, upper: TreeNode, child: TreeNode) -> None:
        pass

    def removed(self, node: TreeNode) -> None:
        self.order.append(int(node.key_units()[0]))


def _tree(policy: str) -> tuple[RadixCache, _Removed]:
    tree = RadixCache(1, TokenToKVPoolAllocator(256), eviction_policy=policy)
    tree.listener = _Removed()
    return tree, tree.listener


def _evict_all(tree: RadixCache) -> None:
    while tree.evict(1):
        pass


# Four leaves under the root; the operations, in clock order:
#   insert A=[1 1 1], B=[2 2], C=[3 3 3 3]      creation order A B C
#   insert A, insert A (priority 1)             A: 3 hits, priority 1
#   insert B                                    B: 2 hits
#   insert D=[4] (priority 5)                   D: 1 hit, newest
# access times: C < A < B < D
EXPECTED = {
    "lru": [3, 1, 2, 4],
    "mru": [4, 2, 1, 3],
    "fifo": [1, 2, 3, 4],
    "filo": [4, 3, 2, 1],
    "lfu": [3, 4, 2, 1],  # hits 1, 1, 2, 3; equal hits by access time
    "slru": [3, 4, 1, 2],  # probationary (< 2 hits) C D, then protected A B, each by access time
    "priority": [3, 2, 1, 4],  # priorities 0 0 1 5; equal priority by access time
}


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_policy_order_on_hand_built_tree(policy: str) -> None:
    tree, removed = _tree(policy)
    tree.insert(_a(1, 1, 1), _a(10, 11, 12))
    tree.insert(_a(2, 2), _a(20, 21))
    tree.insert(_a(3, 3, 3, 3), _a(30, 31, 32, 33))
    tree.insert(_a(1, 1, 1), _a(13, 14, 15))
    tree.insert(_a(1, 1, 1), _a(16, 17, 18), priority=1)
    tree.insert(_a(2, 2), _a(22, 23))
    tree.insert(_a(4), _a(40), priority=5)
    _evict_all(tree)
    assert removed.order == EXPECTED[policy]


def test_hit_counts_follow_sglang_insert() -> None:
    tree, _ = _tree("lfu")
    tree.insert(_a(1, 2, 3, 4), _a(1, 2, 3, 4))
    # root - [1 2] - [3 4]
    #              \ [5]      the upper part keeps the old count, then counts this insert's hit
    tree.insert(_a(1, 2, 5), _a(5, 6, 7))
    nodes = {tuple(n.key_units().tolist()): n for n in tree.iter_nodes()}
    assert {k: n.hit_count for k, n in nodes.items()} == {(1, 2): 2, (3, 4): 1, (5,): 1}
    # A request that already inserted [1 2] counts no hit there, only past it.
    tree.insert(_a(1, 2, 6), _a(5, 6, 8), inserted_len=2)
    nodes = {tuple(n.key_units().tolist()): n for n in tree.iter_nodes()}
    assert nodes[(1, 2)].hit_count == 2 and nodes[(6,)].hit_count == 1
    # Re-inserting what it already inserted counts nothing; a match never counts.
    tree.insert(_a(1, 2, 6), _a(5, 6, 8), inserted_len=3)
    tree.match_prefix(_a(1, 2, 6))
    assert nodes[(1, 2)].hit_count == 2 and nodes[(6,)].hit_count == 1


def test_priority_is_the_max_inserted_and_split_inherits() -> None:
    tree, _ = _tree("priority")
    tree.insert(_a(1, 2, 3), _a(1, 2, 3), priority=4)
    tree.insert(_a(1, 2), _a(1, 2), priority=1)  # splits [1 2 3]: the upper part keeps 4
    nodes = {tuple(n.key_units().tolist()): n for n in tree.iter_nodes()}
    assert nodes[(1, 2)].priority == 4 and nodes[(3,)].priority == 4
    tree.insert(_a(1, 2, 9), _a(1, 2, 9), priority=7)
    nodes = {tuple(n.key_units().tolist()): n for n in tree.iter_nodes()}
    assert nodes[(1, 2)].priority == 7 and nodes[(3,)].priority == 4 and nodes[(9,)].priority == 7


def test_unknown_policy_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="valid: lru, lfu, fifo, mru, filo, priority, slru"):
        check_eviction_policy("lifo")
    with pytest.raises(ValueError, match="unified tree"):
        check_eviction_policy("tlru")
    with pytest.raises(ValueError, match="eviction_policy"):
        AllocatorConfig(pool_tokens=64, eviction_policy="lifo").check()  # type: ignore[arg-type]
    assert check_eviction_policy("LFU") == "lfu"


def _reference_key(policy: str, node: TreeNode) -> object:
    """SGLang 0.5.23's ``get_priority`` (``mem_cache/evict_policy.py``), creation time
    being the node id (issued in creation order)."""
    t = node.last_access_time
    return {
        "lru": t,
        "lfu": (node.hit_count, t),
        "fifo": node.id,
        "mru": -t,
        "filo": -node.id,
        "priority": (node.priority, t),
        "slru": (1 if node.hit_count >= 2 else 0, t),
    }[policy]


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.lists(st.integers(0, 2), min_size=1, max_size=6),
                  st.integers(0, 6), st.integers(0, 2)),
        st.tuples(st.just("match"), st.lists(st.integers(0, 2), min_size=1, max_size=6)),
        st.tuples(st.just("lock"), st.lists(st.integers(0, 2), min_size=1, max_size=6)),
        st.tuples(st.just("evict"), st.integers(1, 4)),
        st.tuples(st.just("checkpoint")),
    ),
    max_size=40,
)


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
@settings(max_examples=60, deadline=None)
@given(ops=_OPS)
def test_policy_matches_reference_sort(policy: str, ops: list[tuple]) -> None:
    tree, removed = _tree(policy)
    slots = itertools.count(1000)
    locked: list[TreeNode] = []
    for op in ops:
        if op[0] == "insert":
            key = np.array(op[1], dtype=np.int64)
            tree.insert(key, np.fromiter(itertools.islice(slots, len(key)), np.int64), inserted_len=op[2],
                        priority=op[3])
        elif op[0] == "match":
            tree.match_prefix(np.array(op[1], dtype=np.int64))
        elif op[0] == "lock":
            node = tree.match_prefix(np.array(op[1], dtype=np.int64)).last_node
            if locked:
                tree.unlock(locked.pop())
            locked.append(tree.lock(node))
        elif op[0] == "checkpoint":
            # A restored tree evicts in the same order as the one saved.
            by_id = restore_tree_state(tree, save_tree_state(tree))
            locked = [by_id[n.id] for n in locked]
        else:
            for _ in range(op[1]):
                leaves = [n for n in tree.iter_nodes() if not n.children and n.lock_ref == 0]
                keys = [_reference_key(policy, n) for n in leaves]
                assert len(set(keys)) == len(keys), "two evictable leaves share a key"
                removed.order.clear()
                tree.evict(1)
                if not leaves:
                    assert removed.order == []
                    break
                best = min(zip(keys, leaves), key=lambda kn: kn[0])[1]
                assert removed.order == [int(best.key_units()[0])]
                assert best.parent is None  # that very node left the tree
