"""Out-of-window SWA frees and the release split (``allocator.swa_window``), §11.5 and §11.7.

SGLang parity for these lives in ``tests/differential/test_swa_pool_parity.py`` (window
mode); here are the facts one by one, on small pools.
"""

from __future__ import annotations

import numpy as np

from allocator.swa import SWATokenToKVPoolAllocator
from allocator.swa_window import (
    SwaKvInfo,
    free_swa_out_of_window_slots,
    kv_private_swa_tokens,
    release_kv_row,
)


def _request(ps: int, n: int, pages: int = 16) -> tuple[SWATokenToKVPoolAllocator, np.ndarray]:
    a = SWATokenToKVPoolAllocator(pages * ps, pages * ps, ps)
    if ps == 1:
        row = a.alloc(n)
    else:
        row = a.alloc_extend(np.array([0]), np.array([n]), np.array([-1]))
    assert row is not None
    return a, row.astype(np.int64)


def test_cursor_jumps_to_dead_lo_even_when_nothing_is_freed() -> None:
    """common.py 97-106: the cursor is stored at max(cursor, dead_lo) before the free."""
    ps = 16
    a, row = _request(ps, 100)
    kv = SwaKvInfo(cache_protected_len=32, swa_evict_floor=70)  # dead_lo = ceil(70) = 80
    free_swa_out_of_window_slots(kv, row, 100, sliding_window_size=8, allocator=a)
    # threshold = 100 - ceil(max(8, 16)) = 84 -> floored 80: nothing past the jump
    assert kv.swa_evicted_seqlen == 80
    assert a.swa_available_size() == 16 * ps - 7 * ps


def test_kept_tail_is_page_rounded_only_with_prefix_sharing() -> None:
    """With prefix sharing the kept tail is ceil_align(max(window, page)); without, the
    window itself; the new cursor is floored to a page either way."""
    ps = 16
    for sharing, cursor in ((True, 64), (False, 80)):  # floor(100 - 32), floor(100 - 20)
        a, row = _request(ps, 100)
        kv = SwaKvInfo()
        free_swa_out_of_window_slots(
            kv, row, 100, sliding_window_size=20, allocator=a, supports_prefix_sharing=sharing
        )
        assert kv.swa_evicted_seqlen == cursor
        assert a.swa_available_size() == (16 - 7 + cursor // ps) * ps
        assert (a.full_to_swa_index_mapping[row[:cursor]] == 0).all()
        assert (a.full_to_swa_index_mapping[row[cursor:]] > 0).all()


def test_interval_gates_the_free() -> None:
    a, row = _request(1, 50, pages=64)
    kv = SwaKvInfo()
    free_swa_out_of_window_slots(kv, row, 50, sliding_window_size=10, allocator=a, eviction_interval=41)
    assert kv.swa_evicted_seqlen == 0  # 50 - 10 < 0 + 41
    free_swa_out_of_window_slots(kv, row, 50, sliding_window_size=10, allocator=a, eviction_interval=40)
    assert kv.swa_evicted_seqlen == 40
    assert a.swa_available_size() == 64 - 50 + 40


def test_release_frees_the_window_freed_range_full_side_only() -> None:
    """[dead_lo, evicted) goes back to the full pool only; the rest to both; the
    protected prefix is the tree's and stays."""
    ps = 16
    a, row = _request(ps, 100)
    kv = SwaKvInfo(cache_protected_len=16)
    free_swa_out_of_window_slots(kv, row, 100, sliding_window_size=8, allocator=a)
    assert kv.swa_evicted_seqlen == 80
    assert kv_private_swa_tokens(kv, 100, ps) == 112 - 16 - 64
    swa_before = a.swa_available_size()
    release_kv_row(a, kv, row, owned_kv_len=100, kv_allocated_len=100)
    assert a.full_available_size() == (16 - 1) * ps  # only the protected page is held
    assert a.swa_available_size() == swa_before + (112 - 16 - 64)
    assert a.mapped_full_slots().tolist() == row[:16].tolist()
