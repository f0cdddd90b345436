"""Checkpoints of an SWA allocator (``allocator.check.checkpoint``), radix cache off and on.

A restore must give back every piece of a hybrid sliding-window allocator's state:
both pools' free lists, the full -> SWA mapping, the SWA columns of ``ReqKvTable``
and, with the SWA radix tree, tombstones, the SWA LRU order and the window-lock
receipts. The property test replays the same operations from a restored checkpoint
and asks for the same state at every step; the digest tests change one piece at a
time and ask for a different checkpoint digest.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from allocator.base import AllocatorConfig, OutOfMemory, SwaConfig
from allocator.manager import KvAllocator
from allocator.swa_radix import SwaRadixCache

_BASE = np.random.default_rng(7).integers(0, 500, 400)


def _allocator(ps: int, radix: bool) -> KvAllocator:
    return KvAllocator(
        AllocatorConfig(
            pool_tokens=1024,
            page_size=ps,
            max_running=6,
            max_context_len=512,
            radix_cache=radix,
            swa=SwaConfig(window=32, swa_pool_tokens=512, eviction_interval=4),
        )
    )


def _tokens(rid: int, shared: int, n: int) -> np.ndarray:
    """Request ``rid``'s first ``n`` tokens: ``shared`` tokens of one base prompt, then its own."""
    own = np.random.default_rng(1000 + rid).integers(500, 1000, max(n - shared, 0))
    return np.concatenate([_BASE[:shared], own])[:n].astype(np.int64)


# An op: (kind, a, b). kind 0: admit a new request (``a``: shared prefix, ``b``: its
# length); 1: decode every live request (``a`` steps); 2: finish live request ``a``
# (mod the live count); 3: retract it; 4: PD prealloc with an SWA tail (paged, radix off).
_OPS = st.lists(
    st.tuples(st.integers(0, 4), st.integers(0, 300), st.integers(20, 300)), min_size=4, max_size=40
)


def _apply(a: KvAllocator, index: int, op: tuple[int, int, int], shared: dict[int, int]) -> None:
    kind, x, y = op
    live = sorted(int(r) for r in a.live_rids())
    if kind == 0:
        shared[index] = min(x, y)
        a.extend(np.array([index]), np.array([y]), [_tokens(index, min(x, y), y)])
    elif kind == 1 and live:
        for _ in range(1 + x % 8):
            if isinstance(a.decode(np.array(live)), OutOfMemory):
                break
    elif kind == 4 and a.page_size > 1 and a.tree_cache.disable:
        shared[index] = 0
        a.prealloc(np.array([index]), np.array([y]), [_tokens(index, 0, y)])
    elif kind in (2, 3) and live:
        rid = live[x % len(live)]
        committed = int(a.request_lens(np.array([rid])).committed[0])
        tokens = [_tokens(rid, shared[rid], committed)] if kind == 2 else None
        a.release(np.array([rid]), np.array([committed]), tokens, "finish" if kind == 2 else "retract")
    a.end_step()


def _observe(a: KvAllocator) -> tuple[str, dict[str, object], str]:
    return a.state_digest(), a.pool_counters(), a.save_state().digest()


@pytest.mark.parametrize("radix", [False, True], ids=["radix-off", "radix-on"])
@pytest.mark.parametrize("ps", [1, 16])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_OPS, cut=st.integers(0, 40))
def test_a_restored_checkpoint_replays_the_same_states(ps: int, radix: bool, ops: list, cut: int) -> None:
    a = _allocator(ps, radix)
    shared: dict[int, int] = {}
    cut = min(cut, len(ops))
    for i, op in enumerate(ops[:cut]):
        _apply(a, i, op, shared)
    saved = a.save_state()
    at_save = _observe(a)
    seen = []
    for i, op in enumerate(ops[cut:], start=cut):
        _apply(a, i, op, shared)
        seen.append(_observe(a))
    a.restore_state(saved)
    assert _observe(a) == at_save
    for step, (i, op) in enumerate(enumerate(ops[cut:], start=cut)):
        _apply(a, i, op, shared)
        assert _observe(a) == seen[step], f"op {i} {op} after the restore"
    assert a.check_integrity() == []


def _busy(ps: int, radix: bool) -> KvAllocator:
    """Two requests sharing a prefix, one finished into the tree, decoded past the window."""
    a = _allocator(ps, radix)
    shared = {}
    _apply(a, 0, (0, 96, 160), shared)
    _apply(a, 1, (0, 96, 140), shared)
    _apply(a, 2, (1, 7, 0), shared)
    _apply(a, 3, (2, 1, 0), shared)  # finish rid 1
    _apply(a, 4, (0, 128, 200), shared)
    _apply(a, 5, (1, 7, 0), shared)
    if radix:
        tree = a.tree_cache
        tree.match_prefix_swa(tree.make_key(_tokens(1, 96, 140)))  # type: ignore[attr-defined]  # fractional times
    return a


def _changes(a: KvAllocator) -> list[tuple[str, object]]:
    """One edit per piece of the SWA state (each a closure applied to a fresh copy)."""
    tok = a.token_to_kv_pool_allocator
    kv = a.req_kv
    row = int(np.flatnonzero(kv.rid >= 0)[0])

    def swap_swa_free() -> None:
        free = tok.swa_attn_allocator._free  # type: ignore[attr-defined]
        pages = free.view().copy()
        pages[[0, 1]] = pages[[1, 0]]
        free.drop(pages.shape[0])
        free.append(pages)

    def mapping() -> None:
        mapped = tok.mapped_full_slots()  # type: ignore[attr-defined]
        tok.full_to_swa_index_mapping[mapped[0]] += 1  # type: ignore[attr-defined]

    edits = [
        ("the SWA free list's order", swap_swa_free),
        ("the full -> SWA mapping", mapping),
        ("swa_evicted_seqlen", lambda: kv.swa_evicted_seqlen.__setitem__(row, kv.swa_evicted_seqlen[row] + 1)),
        ("swa_evict_floor", lambda: kv.swa_evict_floor.__setitem__(row, kv.swa_evict_floor[row] + 1)),
        ("decode_batch_idx", lambda: kv.decode_batch_idx.__setitem__(row, kv.decode_batch_idx[row] + 1)),
        ("swa_branching_seqlen", lambda: kv.swa_branching_seqlen.__setitem__(row, 48)),
        ("sum_swa_freed", lambda: setattr(kv, "sum_swa_freed", kv.sum_swa_freed + 1)),
    ]
    tree = a.tree_cache
    if isinstance(tree, SwaRadixCache):
        nodes = list(tree.iter_nodes())
        live = next(n for n in nodes if n.swa_value is not None)  # type: ignore[attr-defined]
        tomb = next(n for n in nodes if n.swa_value is None)  # type: ignore[attr-defined]
        lru = list(tree.swa_lru)

        def reorder_lru() -> None:
            tree.swa_lru.remove(lru[-1])
            tree.swa_lru.insert_mru(lru[-1])

        def next_uuid() -> None:
            next(tree._uuids)

        edits += [
            ("a tombstone", lambda: setattr(live, "swa_value", None)),
            ("a tombstone's revival", lambda: setattr(tomb, "swa_value", np.zeros(len(tomb), np.int64))),
            ("a node's SWA slots", lambda: setattr(live, "swa_value", live.swa_value + 1)),  # type: ignore[attr-defined]
            ("a node's SWA lock count", lambda: setattr(live, "swa_lock_ref", live.swa_lock_ref + 1)),  # type: ignore[attr-defined]
            ("a node's window uuid", lambda: setattr(live, "swa_uuid", 99)),
            ("the SWA LRU order", reorder_lru),
            ("a row's window-lock receipt", lambda: kv.lock_swa_uuid.__setitem__(row, 77)),
            ("the SWA evictable ledger", lambda: setattr(tree, "swa_evictable_size_", tree.swa_evictable_size_ + 1)),
            ("the SWA evicted total", lambda: setattr(tree, "swa_evicted_tokens_total", tree.swa_evicted_tokens_total + 1)),
            ("the uuid counter", next_uuid),
            ("the last lock receipt", lambda: setattr(tree, "last_lock_uuid", 1234)),
            ("a float access time", lambda: setattr(live, "last_access_time", live.last_access_time + 0.5)),
        ]
        assert len(lru) >= 2
    return edits


@pytest.mark.parametrize("radix", [False, True], ids=["radix-off", "radix-on"])
@pytest.mark.parametrize("ps", [1, 16])
def test_the_checkpoint_digest_covers_every_piece_of_swa_state(ps: int, radix: bool) -> None:
    a = _busy(ps, radix)
    saved = a.save_state()
    before = saved.digest()
    count = len(_changes(a))
    for k in range(count):
        a.restore_state(saved)
        assert a.save_state().digest() == before
        what, edit = _changes(a)[k]
        edit()
        assert a.save_state().digest() != before, what
    a.restore_state(saved)
    assert a.save_state().digest() == before and a.check_integrity() == []


@pytest.mark.parametrize("ps", [1, 16])
def test_a_restore_gives_back_the_swa_tree_side(ps: int) -> None:
    """Tombstones, LRU order, uuids, locks and float access times come back as they were
    (a restore used to rebuild plain nodes with integer access times)."""
    a = _busy(ps, True)
    tree = a.tree_cache
    assert isinstance(tree, SwaRadixCache)

    def side() -> list[object]:
        nodes = sorted(tree.iter_nodes(), key=lambda n: n.id)
        return [
            [(n.id, type(n).__name__, None if n.swa_value is None else n.swa_value.tolist(),  # type: ignore[attr-defined]
              n.swa_lock_ref, n.swa_uuid, n.last_access_time) for n in nodes],  # type: ignore[attr-defined]
            [n.id for n in tree.swa_lru], sorted(tree.swa_lru.members),
            [a.req_kv.lock_swa_uuid[r] for r in range(a.req_kv.num_rows)],
            (tree.swa_evictable_size_, tree.swa_protected_size_, tree.last_lock_uuid, dict(tree.stats)),
        ]

    want = side()
    assert any(n.swa_value is None for n in tree.iter_nodes())  # type: ignore[attr-defined]
    assert any(n.last_access_time != int(n.last_access_time) for n in tree.iter_nodes())
    saved = a.save_state()
    uuid = next(tree._uuids)
    tree._uuids = itertools.count(uuid)
    shared: dict[int, int] = {0: 96, 1: 96, 4: 128}
    _apply(a, 6, (2, 0, 0), shared)
    _apply(a, 7, (0, 64, 200), shared)
    a.restore_state(saved)
    assert side() == want
    assert next(tree._uuids) == uuid
