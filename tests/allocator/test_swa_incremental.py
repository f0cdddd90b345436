"""The incremental checker on an SWA allocator (radix cache off and on) agrees with the full walk.

After every call, ``check_integrity(touched)`` (incremental, ``allocator.check.incremental_swa``
for the SWA pool) and ``check_integrity()`` (the full walk) must report the same
violations (check, pool, request) up to the first one, on seeded random op sequences
(admit with a shared prefix, decode, PD prealloc, finish, retract, abort) into which an
SWA fault is injected at a random call: the shapes of ``test_swa_faults`` plus a
mapping left behind and an SWA leak on release, and with the radix cache a tombstone
that frees its SWA slots but keeps them, and an SWA lock past the window.
"""

from __future__ import annotations

import numpy as np
import pytest

from allocator.base import AllocatorConfig, OutOfMemory, SwaConfig, Violation
from allocator.check.invariants import check_integrity
from allocator.manager import KvAllocator
from allocator.radix_cache import TreeNode
from allocator.swa import SWATokenToKVPoolAllocator
from allocator.swa_radix import SwaRadixCache, SwaTreeNode


class _SkipsWindowFrees(SWATokenToKVPoolAllocator):
    def free_swa_segment(self, free_index: np.ndarray, *, start_pos: int) -> None:
        return None


class _KeepsMappings(SWATokenToKVPoolAllocator):
    def clear_full_to_swa_mapping(self, full_indices: np.ndarray) -> None:
        return None


class _LeaksSwaOnRelease(SWATokenToKVPoolAllocator):
    def free_segment(self, free_index: np.ndarray, *, start_pos: int) -> None:
        self.full_attn_allocator.free_segment(free_index, start_pos)


def _as(cls: type) -> object:
    def inject(a: KvAllocator) -> bool:
        a.token_to_kv_pool_allocator.__class__ = cls
        return True

    return inject


def _double_free(a: KvAllocator) -> bool:
    """A page a live request still maps goes back onto the SWA free list."""
    tok = a.token_to_kv_pool_allocator
    for rid in a.live_rids().tolist():
        slots = tok.full_to_swa_index_mapping[a.row_slots(int(rid))]  # type: ignore[attr-defined]
        slots = slots[slots > 0]
        if slots.shape[0]:
            page = int(slots[-1]) // a.page_size
            tok.swa_attn_allocator.free_page_ids(np.array([page], dtype=np.int32))  # type: ignore[attr-defined]
            return True
    return False


def _wrong_cursor(a: KvAllocator) -> bool:
    """A cursor says less was freed than was (a path forgot to store it)."""
    kv = a.req_kv
    for row in kv.rows_in_use().tolist():
        if kv.swa_evicted_seqlen[row] >= 2 * a.page_size and kv.swa_evicted_seqlen[row] > kv.swa_dead_lo(
                np.array([row]))[0]:
            kv.swa_evicted_seqlen[row] -= a.page_size
            return True
    return False


FAULTS = {
    "missed_window_free": _as(_SkipsWindowFrees),
    "mapping_left_behind": _as(_KeepsMappings),
    "swa_leak_on_release": _as(_LeaksSwaOnRelease),
    "swa_double_free": _double_free,
    "wrong_cursor": _wrong_cursor,
}


class _TombstoneKeepsItsValue(SwaRadixCache):
    """A tombstone that frees the node's SWA slots but leaves the node holding them."""

    def _tombstone(self, node: SwaTreeNode) -> int:
        self._alloc.free_swa_segment(node.value, start_pos=0)
        return len(node.swa_value)  # type: ignore[arg-type]


class _LocksPastTheWindow(SwaRadixCache):
    """An SWA lock that also takes the node above the window boundary."""

    def inc_lock_ref(self, node: TreeNode) -> int:
        delta = super().inc_lock_ref(node)
        covered, cur = 0, node
        while cur is not self.root_node and covered < self.window:
            covered += len(cur)
            cur = cur.parent  # type: ignore[assignment]
        if cur is not self.root_node:
            cur.swa_lock_ref += 1  # type: ignore[attr-defined]
        return delta


def _tree_as(cls: type) -> object:
    def inject(a: KvAllocator) -> bool:
        a.tree_cache.__class__ = cls
        return True

    return inject


TREE_FAULTS = {
    "tombstone_keeps_its_value": _tree_as(_TombstoneKeepsItsValue),
    "swa_lock_past_the_window": _tree_as(_LocksPastTheWindow),
}
_BASE = np.random.default_rng(3).integers(0, 1000, 600)


def _allocator(ps: int, radix: bool) -> KvAllocator:
    return KvAllocator(
        AllocatorConfig(
            pool_tokens=4096 if radix else 2048,
            page_size=ps,
            max_running=8,
            max_context_len=2048,
            radix_cache=radix,
            swa=SwaConfig(window=64 if radix else 32, swa_pool_tokens=1024, eviction_interval=16 if radix else 4),
        )
    )


def _blame(found: list[Violation]) -> list[tuple[str, str, int | None]]:
    return [(v.check, v.pool, v.rid) for v in found]


class _Found(Exception):
    pass


def _run(ps: int, seed: int, fault: str | None, radix: bool = False,
         steps: int = 150) -> tuple[bool, list[Violation]]:
    """Random calls (admit with a shared prefix, decode, PD prealloc, finish, retract,
    abort), both checks after each, the fault injected at a random call; returns
    (fault injected, the violations of the first call that has any)."""
    a = _allocator(ps, radix)
    rng = np.random.default_rng(seed)
    fire_at = int(rng.integers(10, 40))
    fired = False
    rid = 0
    live: dict[int, list[int]] = {}
    assert a.check_integrity(np.zeros(0, np.int64)) == []  # the full walk, then the checker attaches

    def checked(touched: list[int]) -> None:
        inc = a.check_integrity(np.array(touched, dtype=np.int64))
        full = check_integrity(a)
        assert _blame(inc) == _blame(full), f"incremental {inc}, full {full}"
        assert a._checker is not None and a._checker.swa is not None
        assert a._checker.swa.unconfirmed == 0 and a._checker.unconfirmed == 0
        if full:
            raise _Found(full)

    try:
        for step in range(steps):
            if fault is not None and step >= fire_at and not fired:
                fired = {**FAULTS, **TREE_FAULTS}[fault](a)  # type: ignore[operator]
            kind = int(rng.integers(0, 5))
            if kind == 0 or not live:
                n = int(rng.integers(60, 300))
                toks = np.concatenate([_BASE[: int(rng.integers(0, 400))], rng.integers(0, 1000, n)])[:500]
                if not isinstance(a.extend(np.array([rid]), np.array([len(toks)]), [toks]), OutOfMemory):
                    live[rid] = toks.tolist()
                checked([rid])
                rid += 1
            elif kind in (1, 2):
                rids = sorted(live)
                for _ in range(int(rng.integers(1, 6))):
                    if isinstance(a.decode(np.array(rids)), OutOfMemory):
                        break
                    for r in rids:
                        live[r].append(int(rng.integers(0, 1000)))
                    checked(rids)
            elif kind == 3 and ps > 1 and not radix:
                n = int(rng.integers(20, 200))
                if not isinstance(a.prealloc(np.array([rid]), np.array([n]), [np.arange(n) + rid]), OutOfMemory):
                    live[rid] = (np.arange(n) + rid).tolist()
                checked([rid])
                rid += 1
            else:
                r = sorted(live)[int(rng.integers(0, len(live)))]
                committed = int(a.request_lens(np.array([r])).committed[0])
                how = ("finish", "retract", "abort")[int(rng.integers(0, 3))] if radix else ("retract", "abort")[kind % 2]
                tokens = [np.array(live[r][:committed], dtype=np.int64)] if how == "finish" else None
                a.release(np.array([r]), np.array([committed]), tokens, how)  # type: ignore[arg-type]
                del live[r]
                checked([r])
            a.end_step()
    except _Found as found:
        return fired, found.args[0]
    return fired, []


@pytest.mark.parametrize("radix", [False, True], ids=["radix-off", "radix-on"])
@pytest.mark.parametrize("ps", [1, 16, 64])
@pytest.mark.parametrize("seed", range(3))
def test_a_sound_swa_allocator_passes_both_checks_alike(ps: int, seed: int, radix: bool) -> None:
    assert _run(ps, seed, None, radix) == (False, [])


@pytest.mark.parametrize("radix", [False, True], ids=["radix-off", "radix-on"])
@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("seed", range(3))
def test_an_swa_fault_is_named_alike_by_both_checks(fault: str, ps: int, seed: int, radix: bool) -> None:
    fired, found = _run(ps, seed, fault, radix)
    assert fired, "the fault never found a state to break"
    assert found, f"{fault} fired but neither check found anything"
    assert any(v.pool == "swa" for v in found), found


@pytest.mark.parametrize("fault", sorted(TREE_FAULTS))
@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("seed", range(3))
def test_an_swa_tree_fault_is_named_alike_by_both_checks(fault: str, ps: int, seed: int) -> None:
    fired, found = _run(ps, seed, fault, radix=True, steps=300)
    assert fired and found, f"{fault} fired but neither check found anything"
    assert any(v.pool == "swa" and v.check in ("tree", "counters", "conservation") for v in found), found


def test_the_swa_pool_journal_is_attached_only_while_checking() -> None:
    a = _allocator(16, True)
    swa = a.token_to_kv_pool_allocator.swa_attn_allocator  # type: ignore[attr-defined]
    a.extend(np.array([0]), np.array([100]), [np.arange(100)])
    assert a.check_integrity() == [] and swa._free.journal is None
    assert a.check_integrity(np.array([0])) == []
    checker = a._checker
    assert checker is not None and swa._free.journal is checker.swa.journal  # type: ignore[union-attr]
    assert a.tree_cache.swa_journal is checker.swa.journal  # type: ignore[attr-defined, union-attr]
    a.restore_state(a.save_state())  # a restore detaches the checker
    assert swa._free.journal is None and swa.journal is None and a.tree_cache.swa_journal is None  # type: ignore[attr-defined]
