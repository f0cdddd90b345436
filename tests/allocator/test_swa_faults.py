"""Injected SWA faults, each caught by the per-pool invariants with its pool and request.

The faults are the SWA leak reports' shapes: an out-of-window free that never
happened, a double free into the SWA pool, a wrong ``swa_evicted_seqlen``. Each is
injected into a real ``KvAllocator`` (a subclass whose one step is broken, or a
state edit that a buggy path would make) and must come back as a ``Violation`` with
``pool == "swa"`` naming the request at fault.
"""

from __future__ import annotations

import numpy as np
import pytest

from allocator.base import AllocatorConfig, SwaConfig, Violation
from allocator.manager import KvAllocator
from allocator.swa import SWATokenToKVPoolAllocator


def _allocator(ps: int) -> KvAllocator:
    return KvAllocator(
        AllocatorConfig(
            pool_tokens=4096,
            page_size=ps,
            max_running=4,
            max_context_len=2048,
            radix_cache=False,
            swa=SwaConfig(window=64, eviction_interval=8),
        )
    )


def _two_decoding(a: KvAllocator, steps: int) -> None:
    """rid 0 and rid 1 prefilled, then ``steps`` decode steps of both."""
    rids = np.array([0, 1])
    a.extend(rids, np.array([200, 100]), [np.arange(200), np.arange(100)])
    for _ in range(steps):
        a.decode(rids)


def _swa_violations(found: list[Violation], rid: int) -> list[Violation]:
    return [v for v in found if v.pool == "swa" and v.rid == rid]


@pytest.mark.parametrize("ps", [1, 16])
def test_a_missed_out_of_window_free_is_caught_with_its_request(ps: int) -> None:
    """The cursor moves but the SWA slots stay taken (the free was skipped)."""

    class SkipsWindowFrees(SWATokenToKVPoolAllocator):
        def free_swa_segment(self, free_index: np.ndarray, *, start_pos: int) -> None:
            return None

    a = _allocator(ps)
    a.token_to_kv_pool_allocator.__class__ = SkipsWindowFrees
    _two_decoding(a, 3)
    assert a.kv_info(0).swa_evicted_seqlen > 0
    found = a.check_integrity()
    caught = _swa_violations(found, 0)
    assert any(v.check == "window" and "still hold SWA slots" in v.detail for v in caught), found
    assert any(v.check == "conservation" and v.pool == "swa" for v in found)
    assert all(v.pool == "swa" for v in found)  # the full pool is sound


@pytest.mark.parametrize("ps", [1, 16])
def test_a_double_free_into_the_swa_pool_is_caught_with_its_request(ps: int) -> None:
    """A page rid 1 still holds goes back onto the SWA free list."""
    a = _allocator(ps)
    _two_decoding(a, 3)
    assert a.check_integrity() == []
    tok = a.token_to_kv_pool_allocator
    slot = int(tok.full_to_swa_index_mapping[a.row_slots(1)[-1]])
    tok.swa_attn_allocator.free_page_ids(np.array([slot // ps], dtype=np.int32))
    found = a.check_integrity()
    caught = _swa_violations(found, 1)
    assert any(v.check == "ownership" and "free list x1" in v.detail for v in caught), found


@pytest.mark.parametrize("ps", [1, 16])
def test_a_wrong_swa_evicted_seqlen_is_caught_with_its_request(ps: int) -> None:
    """The cursor says less was freed than was: live-looking positions have no SWA slot."""
    a = _allocator(ps)
    _two_decoding(a, 3)
    row = a.row_of(0)
    assert a.req_kv.swa_evicted_seqlen[row] >= 2 * ps
    a.req_kv.swa_evicted_seqlen[row] -= ps  # as a path that forgot to store the cursor
    found = a.check_integrity()
    caught = _swa_violations(found, 0)
    assert any(v.check == "window" and "hold no SWA slot" in v.detail for v in caught), found
    assert any(v.check == "counters" and v.pool == "swa" for v in found)
