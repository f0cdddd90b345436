"""The incremental checker on an SWA allocator (radix cache off) agrees with the full walk.

After every call, ``check_integrity(touched)`` (incremental, ``allocator.check.incremental_swa``
for the SWA pool) and ``check_integrity()`` (the full walk) must report the same
violations (check, pool, request) up to the first one, on seeded random op sequences
(admit, decode, PD prealloc, finish, retract) into which an SWA fault is injected at
a random call: the shapes of ``test_swa_faults`` plus a mapping left behind and an
SWA leak on release.
"""

from __future__ import annotations

import numpy as np
import pytest

from allocator.base import AllocatorConfig, OutOfMemory, SwaConfig, Violation
from allocator.check.invariants import check_integrity
from allocator.manager import KvAllocator
from allocator.swa import SWATokenToKVPoolAllocator


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


def _allocator(ps: int) -> KvAllocator:
    return KvAllocator(
        AllocatorConfig(
            pool_tokens=2048,
            page_size=ps,
            max_running=6,
            max_context_len=512,
            radix_cache=False,
            swa=SwaConfig(window=32, swa_pool_tokens=1024, eviction_interval=4),
        )
    )


def _blame(found: list[Violation]) -> list[tuple[str, str, int | None]]:
    return [(v.check, v.pool, v.rid) for v in found]


def _run(ps: int, seed: int, fault: str | None, steps: int = 120) -> tuple[bool, list[Violation]]:
    """Random calls, both checks after each, the fault injected at a random call;
    returns (fault injected, the violations of the first call that has any)."""
    a = _allocator(ps)
    rng = np.random.default_rng(seed)
    fire_at = int(rng.integers(10, 60))
    fired = False
    rid = 0
    assert a.check_integrity(np.zeros(0, np.int64)) == []  # the full walk, then the checker attaches
    for step in range(steps):
        if fault is not None and step >= fire_at and not fired:
            fired = FAULTS[fault](a)  # type: ignore[operator]
        live = sorted(int(r) for r in a.live_rids())
        kind = int(rng.integers(0, 5))
        touched = []
        if kind == 0 or not live:
            n = int(rng.integers(20, 200))
            a.extend(np.array([rid]), np.array([n]), [np.arange(n) + rid])
            touched, rid = [rid], rid + 1
        elif kind in (1, 2):
            for _ in range(int(rng.integers(1, 6))):
                if isinstance(a.decode(np.array(live)), OutOfMemory):
                    break
            touched = live
        elif kind == 3 and ps > 1:
            n = int(rng.integers(20, 200))
            a.prealloc(np.array([rid]), np.array([n]), [np.arange(n) + rid])
            touched, rid = [rid], rid + 1
        else:
            r = live[int(rng.integers(0, len(live)))]
            committed = int(a.request_lens(np.array([r])).committed[0])
            a.release(np.array([r]), np.array([committed]), None, "retract" if kind == 3 else "abort")
            touched = [r]
        a.end_step()
        inc = a.check_integrity(np.array(touched, dtype=np.int64))
        full = check_integrity(a)
        assert _blame(inc) == _blame(full), f"step {step}: incremental {inc}, full {full}"
        assert a._checker is not None and a._checker.swa is not None
        assert a._checker.swa.unconfirmed == 0 and a._checker.unconfirmed == 0
        if full:
            return fired, full
    return fired, []


@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("seed", range(4))
def test_a_sound_swa_allocator_passes_both_checks_alike(ps: int, seed: int) -> None:
    assert _run(ps, seed, None) == (False, [])


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("seed", range(3))
def test_an_swa_fault_is_named_alike_by_both_checks(fault: str, ps: int, seed: int) -> None:
    fired, found = _run(ps, seed, fault)
    assert fired, "the fault never found a state to break"
    assert found, f"{fault} fired but neither check found anything"
    assert any(v.pool == "swa" for v in found), found


def test_the_swa_pool_journal_is_attached_only_while_checking() -> None:
    a = _allocator(16)
    swa = a.token_to_kv_pool_allocator.swa_attn_allocator  # type: ignore[attr-defined]
    a.extend(np.array([0]), np.array([100]), [np.arange(100)])
    assert a.check_integrity() == [] and swa._free.journal is None
    assert a.check_integrity(np.array([0])) == []
    checker = a._checker
    assert checker is not None and swa._free.journal is checker.swa.journal  # type: ignore[union-attr]
    a.restore_state(a.save_state())  # a restore detaches the checker
    assert swa._free.journal is None and swa.journal is None
