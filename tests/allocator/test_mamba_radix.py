"""Properties of ``allocator.mamba_radix.MambaRadixCache`` and the checks that guard it
(``allocator.check.mamba_invariants.check_mamba_tree``): both pools conserved after every
op of random runs, no state cached twice, a copied state always from the request's own
prefix, and the injected faults each check exists for."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from allocator.check.mamba_invariants import check_mamba_tree
from allocator.mamba import MambaReqKv, MambaSlotAllocator
from allocator.mamba_radix import MambaRadixCache, restore_mamba_tree, save_mamba_tree
from allocator.token_to_kv import TokenToKVPoolAllocator
from tests.allocator.test_mamba_radix_parity import generate
from tests.differential.mamba_radix_driver import OursAdapter, apply_op


def _tree(pool: int = 64, states: int = 6) -> MambaRadixCache:
    return MambaRadixCache(1, TokenToKVPoolAllocator(pool), MambaSlotAllocator(states), chunk_size=4)


def _cache(tree: MambaRadixCache, tokens: list[int]) -> int:
    """A request that computed ``tokens`` from scratch finishes: the tree keeps its KV and
    its state (or frees the duplicates); returns the state slot offered."""
    key = np.asarray(tokens, dtype=np.int64)
    value = tree.token_to_kv_pool_allocator.alloc(len(tokens))
    state = int(tree.mamba_allocator.alloc(1)[0])
    if tree.insert_mamba(key, value, state).mamba_exist:
        tree.mamba_allocator.free(np.asarray([state]))
    return state


def _reference_prefix(tree: MambaRadixCache, tokens: list[int]) -> int:
    """The reference model of a gated match: the longest path key holding a state that
    the page-aligned key starts with (by brute force over every node)."""
    key = np.asarray(tokens[: len(tokens) // tree.page_size * tree.page_size], dtype=np.int64)
    best = 0
    for node in tree.mamba_nodes():
        path = tree.path_key(node)
        if node.mamba_value is not None and path.shape[0] <= key.shape[0] and (key[: path.shape[0]] == path).all():
            best = max(best, path.shape[0])
    assert tree.peek_prefix_len(key) == best
    return best


def _checks(side: OursAdapter, reqs: dict[int, dict[str, Any]], just_matched: list[Any]) -> list:
    held_full = sum(len(r["own"]) for r in reqs.values())
    held_states = [side.own_state(r["req"]) for r in reqs.values()]
    return check_mamba_tree(side.tree, held_full, held_states, just_matched)


@pytest.mark.parametrize(("ps", "chunk", "cap"), [(1, 4, -1), (1, 4, 2), (16, 16, -1)])
def test_random_runs_conserve_both_pools_and_copy_only_own_prefixes(ps: int, chunk: int, cap: int) -> None:
    """After every op of random runs: both pools conserved, no state twice, ledgers and
    LRU in step, a just-copied state from the request's own prefix; every match (and
    ``peek_prefix_len``) equal to the brute-force reference."""
    cows = 0
    for seed in range(2):
        case, _ = generate(seed, ps, chunk, cap, num_ops=80)
        side = OursAdapter(case)
        reqs: dict[int, dict[str, Any]] = {}
        for i, op in enumerate(case["ops"]):
            expected = None if "tokens" not in op else _reference_prefix(side.tree, op["tokens"])
            try:
                result = apply_op(side, reqs, op)
            except Exception:  # the generator ends a case where SGLang asserts
                assert i == len(case["ops"]) - 1
                break
            started = reqs.get(op.get("rid")) if op["op"] == "start" else None
            just = [] if started is None else [(started["req"], np.asarray(started["tokens"], dtype=np.int64))]
            assert _checks(side, reqs, just) == [], (seed, i, op)
            if expected is not None and result != "oom":
                assert result[0] == expected, (seed, i, op)
        cows += side.tree.stats["cow"]
    assert cows > 0


def test_a_tombstoned_state_keeps_its_kv_and_gates_the_match() -> None:
    """The Mamba walk tombstones an interior state (its full KV stays cached); a match
    through it then stops at the deepest node that still has a state, and reports the
    full hit past it, floored to the checkpoint grid, as the branching point."""
    tree = _tree()
    s8 = _cache(tree, list(range(1, 9)))
    _cache(tree, list(range(1, 13)))
    full_before = tree.evictable_size()
    assert tree.evict_pools(0, 1, targets=False) == 0  # the oldest state: interior, tombstoned
    assert tree.stats["tombstoned"] == 1 and s8 in tree.mamba_allocator.free_slots.tolist()
    assert tree.evictable_size() == full_before
    m = tree.match_prefix_mamba(np.arange(1, 11))
    assert (m.prefix_len, m.full_hit, m.branching_seqlen) == (0, 10, 8)
    m = tree.match_prefix_mamba(np.arange(1, 14))
    assert (m.prefix_len, m.branching_seqlen) == (12, None)
    assert check_mamba_tree(tree, 0) == []


def test_the_mamba_walk_deletes_an_evictable_leaf_whole() -> None:
    tree = _tree()
    _cache(tree, [5, 6, 7])
    free_full = tree.token_to_kv_pool_allocator.available_size()
    assert tree.evict_pools(0, 1, targets=False) == 3
    assert tree.num_nodes() == 0 and tree.token_to_kv_pool_allocator.available_size() == free_full + 3
    assert tree.stats["mamba_leaf_deleted"] == 1 and check_mamba_tree(tree, 0) == []


def test_a_locked_match_end_keeps_its_state_through_eviction() -> None:
    tree = _tree()
    _cache(tree, [1, 2, 3, 4])
    m = tree.match_prefix_mamba(np.asarray([1, 2, 3, 4, 9]))
    tree.inc_lock_ref(m.last_node)
    assert (tree.mamba_evictable_size(), tree.mamba_protected_size()) == (0, 1)
    tree.evict_pools(100, 5, targets=False)
    assert m.last_node.mamba_value is not None and tree.num_nodes() == 1
    tree.dec_lock_ref(m.last_node)
    assert (tree.mamba_evictable_size(), tree.mamba_protected_size()) == (1, 0)


def test_copy_on_write_of_an_own_prefix_passes_the_check() -> None:
    tree = _tree()
    _cache(tree, [1, 2, 3, 4])
    key = np.asarray([1, 2, 3, 4, 5, 6])
    req = MambaReqKv(7)
    m = tree.match_prefix_mamba(key)
    src = tree.cow_state(m.last_node, req)
    assert src == m.last_node.mamba_value and req.mamba_pool_idx not in (None, src)
    assert check_mamba_tree(tree, 0, [req.mamba_pool_idx], [(req, key)]) == []


def test_a_state_handed_to_a_request_sharing_no_prefix_is_caught() -> None:
    """Injected fault: request 9 gets a copy of the state cached for another prompt."""
    tree = _tree()
    _cache(tree, [1, 2, 3, 4])
    other = tree.match_prefix_mamba(np.asarray([1, 2, 3, 4])).last_node
    key = np.asarray([40, 41, 42, 43, 44])
    assert tree.match_prefix_mamba(key).prefix_len == 0
    req = MambaReqKv(9)
    tree.cow_state(other, req)  # the fault: the match found nothing for this key
    found = check_mamba_tree(tree, 0, [req.mamba_pool_idx], [(req, key)])
    assert [(v.check, v.rid, v.pool) for v in found] == [("state_reuse", 9, "mamba")]


def test_a_state_cached_on_two_nodes_is_caught() -> None:
    """Injected fault: a second node takes the first one's state slot; the slot it
    had is lost (a leak) and the first one's is cached twice."""
    tree = _tree()
    _cache(tree, [1, 2, 3])
    _cache(tree, [7, 8, 9])
    a, b = sorted(tree.mamba_nodes(), key=lambda n: n.id)
    b.mamba_value = a.mamba_value
    checks = {(v.check, v.pool) for v in check_mamba_tree(tree, 0)}
    assert checks == {("ownership", "mamba"), ("leak", "mamba")}


def test_a_leaked_full_slot_is_caught_per_pool() -> None:
    tree = _tree()
    _cache(tree, [1, 2, 3])
    tree.token_to_kv_pool_allocator.alloc(2)  # taken, held by no request
    found = check_mamba_tree(tree, 0)
    assert [(v.check, v.pool) for v in found] == [("conservation", "full")]


def test_the_path_cap_tombstones_the_shallowest_interior_state() -> None:
    tree = MambaRadixCache(1, TokenToKVPoolAllocator(64), MambaSlotAllocator(6), chunk_size=4, max_states_per_path=2)
    s1 = _cache(tree, [1, 2])
    _cache(tree, [1, 2, 3, 4])
    assert tree.stats["path_capped"] == 0
    _cache(tree, [1, 2, 3, 4, 5, 6])
    assert tree.stats["path_capped"] == 1 and sorted(tree.cached_states()) == sorted(set(tree.cached_states()))
    assert s1 not in tree.cached_states() and len(tree.cached_states()) == 2
    assert check_mamba_tree(tree, 0) == []


def test_save_and_restore_round_trip() -> None:
    tree = _tree()
    _cache(tree, [1, 2, 3, 4])
    _cache(tree, [1, 2, 9])
    node = tree.match_prefix_mamba(np.asarray([1, 2, 3, 4])).last_node
    tree.inc_lock_ref(node)
    saved = save_mamba_tree(tree)
    dump = _dump(tree)
    tree.dec_lock_ref(node)
    tree.evict_pools(100, 6, targets=False)
    _cache(tree, [5, 5, 5])
    restore_mamba_tree(tree, saved)
    assert _dump(tree) == dump


def _dump(tree: MambaRadixCache) -> tuple:
    nodes = sorted((tuple(tree.path_key(n).tolist()), tuple(n.value.tolist()), n.mamba_value, n.lock_ref,
                    n.mamba_lock_ref, n.last_access_time) for n in tree.mamba_nodes())
    return (tuple(nodes), tuple(len(tree.path_key(n)) for n in tree.mamba_lru), tree.evictable_size_,
            tree.protected_size_, tree.mamba_evictable_size_, tree.mamba_protected_size_, tree._clock,
            len(tree.evictable_leaves))


def test_no_buffer_needs_page_one() -> None:
    with pytest.raises(ValueError, match="page size 1"):
        MambaRadixCache(16, TokenToKVPoolAllocator(64), MambaSlotAllocator(4))
