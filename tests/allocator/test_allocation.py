"""Allocation functions and the built-in allocator: SGLang's test vectors (reference §9),
observed behaviour (§10), and regressions for the bug classes of §6.

Free lists are drawn head first (the leftmost entry is handed out next).
"""

from __future__ import annotations

import numpy as np
import pytest

from allocator import (
    AllocatorConfig,
    AllocResult,
    KvAllocator,
    OutOfMemory,
    SpecConfig,
    alloc_for_extend,
    check_integrity,
    create_allocator,
)

STANDALONE = SpecConfig("standalone", 3, 1, 4)  # reserve 8, plain radix keys
EAGLE = SpecConfig("eagle", 3, 1, 4)


def _a(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _toks(n: int, base: int = 1000) -> np.ndarray:
    return np.arange(base, base + n, dtype=np.int64)


def _make(page_size: int = 4, pool: int = 128, **kwargs) -> KvAllocator:
    kwargs.setdefault("max_running", 8)
    kwargs.setdefault("max_context_len", 64)
    return create_allocator(AllocatorConfig(pool_tokens=pool, page_size=page_size, **kwargs))


def _clean(alloc: KvAllocator) -> None:
    violations = alloc.check_integrity()
    assert violations == [], violations


def _lens(alloc: KvAllocator, rid: int) -> tuple[int, int, int]:
    """(protected, committed, allocated) after the step's publish (reads apply it)."""
    lens = alloc.request_lens(_a(rid))
    return int(lens.protected[0]), int(lens.committed[0]), int(lens.allocated[0])


def _raw_lens(alloc: KvAllocator, rid: int) -> tuple[int, int, int]:
    """(protected, committed, allocated) as they are now, before any queued publish."""
    row = alloc.row_of(rid)
    kv = alloc.req_kv
    return int(kv.cache_protected_len[row]), int(kv.kv_committed_len[row]), int(kv.kv_allocated_len[row])


def _snapshot(alloc: KvAllocator) -> tuple:
    """Everything an allocation may change, for before/after comparisons."""
    alloc.end_step()
    tok = alloc.token_to_kv_pool_allocator
    kv = alloc.req_kv
    return (
        tok.get_all_free_pages().tolist(),
        list(alloc.req_to_token_pool.free_slots),
        [alloc.req_to_token_pool.req_to_token_np[row, : kv.kv_allocated_len[row]].tolist()
         for row in np.flatnonzero(kv.rid >= 0).tolist()],
        kv.kv_allocated_len.tolist(),
        kv.kv_committed_len.tolist(),
        kv.cache_protected_len.tolist(),
        kv.rid.tolist(),
        [None if n is None else n.id for n in kv.lock_node],
        (kv.sum_committed, kv.sum_protected, kv.sum_allocated_ceil),
        (alloc.tree_cache.evictable_size(), alloc.tree_cache.protected_size()),
        sorted((n.id, n.lock_ref, len(n), n.last_access_time) for n in alloc.tree_cache.iter_nodes()),
    )


# ---------------------------------------------------------------------------- §9 vectors


def test_vector_3_paged_prefill_decode_finish_with_prompt_publish() -> None:
    """§9.3 / §10: ps 4, pool 128, prompt 10 -> slots 4..13; the prompt publish after
    prefill leaves protected 8 + uncached 4 (available 116)."""
    alloc = _make()
    toks = _toks(20)
    assert alloc.extend(_a(0), _a(10), [toks[:10]]).num_tokens == 10
    assert alloc.row_slots(0).tolist() == list(range(4, 14))
    c = alloc.counters()
    assert (c.available, c.protected, c.evictable, c.committed + c.overallocated) == (116, 8, 0, 4)
    # decodes at len 10, 11 continue page 3; at 12 a new page (4 fewer available)
    expected = [(14, 116), (15, 116), (16, 112)]
    for slot, available in expected:
        assert alloc.decode(_a(0)).num_tokens == 1
        assert alloc.row_slots(0)[-1] == slot
        assert alloc.counters().available == available
    _clean(alloc)
    # finish with committed 13: the tree keeps 12, the page of position 12 is freed
    res = alloc.release(_a(0), _a(13), [toks[:13]], "finish")
    c = alloc.counters()
    assert (c.available, c.evictable, c.protected) == (116, 12, 0)
    assert res.freed_tokens == 4 and res.cached_tokens == 4
    # prompt + those 3 outputs + 2 new tokens -> prefix 12
    assert alloc.match_prefix(np.concatenate([toks[:13], _a(7, 8)])) == 12
    _clean(alloc)


def test_vector_3_page1_prefix_is_13() -> None:
    alloc = _make(page_size=1)
    toks = _toks(20)
    alloc.extend(_a(0), _a(10), [toks[:10]])
    for _ in range(3):
        alloc.decode(_a(0))
    alloc.release(_a(0), _a(13), [toks[:13]], "finish")
    assert alloc.match_prefix(np.concatenate([toks[:13], _a(7, 8)])) == 13
    _clean(alloc)


def test_vector_3_without_publish_leaves_12_uncached() -> None:
    """The allocation function alone (no publish): uncached 12 after the prefill."""
    alloc = _make()
    res = alloc_for_extend(alloc.ctx, _a(0), _a(-1), _a(0), _a(10), [None], [None])
    assert res.out_cache_loc.tolist() == list(range(4, 14))
    assert alloc.req_kv.sum_allocated_ceil - alloc.req_kv.sum_protected == 12
    assert alloc.token_to_kv_pool_allocator.available_size() == 116


@pytest.mark.parametrize(("page_size", "nxts"), [(4, [20, 20, 24]), (1, [18, 20, 22])])
def test_vector_4_spec_reserve_monotone_and_release(page_size: int, nxts: list[int]) -> None:
    """§9.4: reserve 8, committed 10 / allocated 10; commits 2 per step."""
    alloc = _make(page_size=page_size, spec=STANDALONE)
    toks = _toks(30)
    alloc.extend(_a(0), _a(10), [toks[:10]])
    for nxt in nxts:
        alloc.spec_decode(_a(0), _a(2))
        assert alloc.request_lens(_a(0)).allocated[0] == nxt
    assert _lens(alloc, 0)[1] == 16
    _clean(alloc)
    res = alloc.release(_a(0), _a(16), [toks[:16]], "finish")
    c = alloc.counters()
    assert (c.evictable, c.available) == (16, 112)
    assert res.overalloc_released.tolist() == [nxts[-1] - 16]
    _clean(alloc)


def test_vector_4_first_spec_takes_two_pages() -> None:
    alloc = _make(spec=STANDALONE)
    alloc.extend(_a(0), _a(10), [_toks(10)])
    before = alloc.counters().available
    res = alloc.spec_decode(_a(0), _a(2))
    assert res.num_tokens == 10  # [10, 20): 2 to end page 3, pages 4..5 new
    assert before - alloc.counters().available == 8
    assert alloc.row_slots(0)[10:].tolist() == [14, 15, *range(16, 24)]


def test_vector_2_batch_extend_through_the_allocator() -> None:
    """§9.2 via the facade, no radix cache: r1 0 -> 5 (a chunk), then r0 0 -> 6 and r1 5 -> 11."""
    alloc = _make(pool=64, radix_cache=False)
    alloc.extend(_a(1), _a(5), [_toks(11)], np.array([False]))
    assert alloc.row_slots(1).tolist() == [4, 5, 6, 7, 8]
    alloc.extend(_a(0, 1), _a(6, 11), [_toks(6, 50), _toks(11)])
    assert alloc.row_slots(0).tolist() == [12, 13, 14, 15, 16, 17]
    assert alloc.row_slots(1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 20, 21, 22]
    alloc.decode(_a(0, 1))
    assert (alloc.row_slots(0)[-1], alloc.row_slots(1)[-1]) == (18, 23)
    _clean(alloc)


def test_rows_are_handed_out_from_the_end_in_batch_order() -> None:
    alloc = _make(max_running=4)
    alloc.extend(_a(7, 8), _a(3, 3), [_toks(3), _toks(3, 90)])
    assert (alloc.row_of(7), alloc.row_of(8)) == (3, 4)
    alloc.release(_a(7), _a(3), [_toks(3)], "finish")
    alloc.extend(_a(9), _a(2), [_toks(2, 400)])
    assert alloc.row_of(9) == 3  # the row just freed
    assert alloc.req_to_token_pool.free_slots == [1, 2]
    rows = alloc.rows_by_rid()
    assert (rows[7], rows[8], rows[9]) == (-1, 4, 3)
    assert np.flatnonzero(rows >= 0).tolist() == [8, 9]
    with pytest.raises(ValueError):
        rows[7] = 1  # a read-only view


# ---------------------------------------------------------------------------- radix behaviour (§10)


def test_second_request_reuses_published_prompt_and_locks_it() -> None:
    alloc = _make(page_size=4, pool=256)
    toks = _toks(40)
    alloc.extend(_a(0), _a(18), [toks[:18]])
    alloc.end_step()
    assert alloc.counters().protected == 16
    # same 16-token prefix, then different: match capped at len - 1, page aligned
    other = np.concatenate([toks[:17], _a(1, 2, 3)])
    res = alloc.extend(_a(1), _a(20), [other])
    assert res.prefix_lens.tolist() == [16]
    # before this step's publish the request protects just its match
    assert alloc.req_kv.cache_protected_len[alloc.row_of(1)] == 16
    assert alloc.row_slots(1)[:16].tolist() == alloc.row_slots(0)[:16].tolist()
    assert _lens(alloc, 1)[0] == 20  # the read applies the publish of its 20 tokens
    _clean(alloc)


def test_match_is_capped_so_one_token_is_computed() -> None:
    alloc = _make(page_size=1)
    toks = _toks(8)
    alloc.extend(_a(0), _a(8), [toks])
    alloc.end_step()
    res = alloc.extend(_a(1), _a(8), [toks])
    assert res.prefix_lens.tolist() == [7]
    assert res.num_tokens == 1
    _clean(alloc)


def test_retract_caches_nothing_but_the_published_prompt_stays() -> None:
    alloc = _make(page_size=4, pool=128)
    toks = _toks(30)
    alloc.extend(_a(0), _a(10), [toks[:10]])
    for _ in range(5):
        alloc.decode(_a(0))
    alloc.end_step()
    res = alloc.release(_a(0), _a(15), None, "retract")
    assert res.cached_tokens == 0
    c = alloc.counters()
    # the prompt's 8 published tokens are evictable cache now; everything else is free
    assert (c.evictable, c.protected, c.available) == (8, 0, 120)
    _clean(alloc)
    # SGLang's post-retract eviction asks only for the shortfall: nothing to do here
    assert alloc.evict_to_fit(100) == 0
    assert alloc.evict_to_fit(121) == 8
    assert alloc.counters().available == 128


def test_eagle_bigram_publish_keeps_one_page_less_per_aligned_chunk() -> None:
    alloc = _make(page_size=4, pool=256, spec=EAGLE)
    toks = _toks(40)
    alloc.extend(_a(0), _a(8), [toks[:12]], np.array([False]))
    # the next chunk checkpoints [0, 8): bigram key of 7 units -> one page
    alloc.extend(_a(0), _a(12), [toks[:12]])
    assert _raw_lens(alloc, 0)[0] == 4
    alloc.end_step()
    assert _lens(alloc, 0)[0] == 8  # publish of 12 tokens: 11 bigrams -> 8
    _clean(alloc)


def test_chunked_prefill_checkpoints_between_chunks() -> None:
    alloc = _make(page_size=4, pool=256)
    toks = _toks(30)
    alloc.extend(_a(0), _a(8), [toks], np.array([False]))
    assert _lens(alloc, 0) == (0, 8, 8)
    alloc.extend(_a(0), _a(16), [toks], np.array([False]))
    assert _lens(alloc, 0) == (8, 16, 16)
    assert alloc.counters().protected == 8
    alloc.extend(_a(0), _a(30), [toks])
    assert _raw_lens(alloc, 0) == (16, 30, 30)
    alloc.end_step()
    assert _lens(alloc, 0) == (28, 30, 30)
    _clean(alloc)


def test_finish_splits_the_leaf_at_the_prompt_boundary() -> None:
    alloc = _make(page_size=4, pool=256)
    toks = _toks(40)
    alloc.extend(_a(0), _a(12), [toks[:12]])
    for _ in range(12):
        alloc.decode(_a(0))
    alloc.release(_a(0), _a(24), [toks[:24]], "finish")
    lengths = sorted(len(node) for node in alloc.tree_cache.iter_nodes())
    assert lengths == [12, 12]  # prompt node + output node
    # evicting one token drops the (older-touched? no: leaf) output part only
    assert alloc.evict(1) == 12
    assert alloc.match_prefix(toks[:13]) == 12
    _clean(alloc)


def test_duplicates_are_freed_and_the_row_rewritten_with_tree_slots() -> None:
    alloc = _make(page_size=4, pool=256)
    toks = _toks(20)
    # two requests with the same prompt prefilled in the same batch: no sharing yet
    alloc.extend(_a(0, 1), _a(12, 12), [toks[:12], toks[:12]])
    table = alloc.req_to_token_pool.req_to_token_np
    own0 = table[alloc.row_of(0), :12].tolist()
    own1 = table[alloc.row_of(1), :12].tolist()
    assert own0 != own1
    available = alloc.token_to_kv_pool_allocator.available_size()
    alloc.end_step()  # publish: r1 finds r0's 12 tokens already in the tree
    assert alloc.counters().available == available + 12
    assert alloc.row_slots(1).tolist() == alloc.row_slots(0).tolist()
    _clean(alloc)


# ---------------------------------------------------------------------------- free order


def test_finish_batch_frees_as_one_group_in_request_order() -> None:
    alloc = _make(page_size=4, pool=128, radix_cache=False)
    alloc.extend(_a(0, 1), _a(6, 5), [_toks(6), _toks(5, 50)])
    # r0 pages 1, 2; r1 pages 3, 4; free_pages [5 6 ... 32]
    alloc.release(_a(0, 1), _a(6, 5), None, "finish")
    # one group: [r0 pages, r1 pages] prepended as a block
    assert alloc.token_to_kv_pool_allocator.free_pages.tolist()[:5] == [1, 2, 3, 4, 5]


def test_retract_batch_frees_request_by_request() -> None:
    alloc = _make(page_size=4, pool=128, radix_cache=False)
    alloc.extend(_a(0, 1), _a(6, 5), [_toks(6), _toks(5, 50)])
    alloc.release(_a(0, 1), _a(6, 5), None, "retract")
    # no group: r1's pages are prepended after r0's, so they come first
    assert alloc.token_to_kv_pool_allocator.free_pages.tolist()[:5] == [3, 4, 1, 2, 5]


def test_page1_frees_are_fifo() -> None:
    alloc = _make(page_size=1, pool=16, radix_cache=False)
    alloc.extend(_a(0), _a(3), [_toks(3)])
    alloc.release(_a(0), _a(3), None, "finish")
    # free_pages [4 ... 16 1 2 3]
    assert alloc.token_to_kv_pool_allocator.free_pages.tolist() == [*range(4, 17), 1, 2, 3]


# ---------------------------------------------------------------------------- §6 regressions


def test_regression_no_double_free_at_page16_with_chunked_prefill() -> None:
    """#6888: available > total after chunked prefill at page 16 (a page freed twice)."""
    alloc = _make(page_size=16, pool=1024, max_context_len=200)
    toks = _toks(120)
    alloc.extend(_a(0), _a(32), [toks[:70]], np.array([False]))
    alloc.extend(_a(0, 1), _a(64, 40), [toks[:70], toks[:40]], np.array([False, True]))
    alloc.extend(_a(0), _a(70), [toks[:70]])
    for _ in range(5):
        alloc.decode(_a(0, 1))
    _clean(alloc)
    alloc.release(_a(0, 1), _a(75, 45), [toks[:75], toks[:45]], "finish")
    _clean(alloc)
    c = alloc.counters()
    assert c.available + c.evictable == c.pool_tokens
    alloc.evict(10_000)
    assert alloc.counters().available == 1024


def test_regression_spec_overallocation_is_released() -> None:
    """#13741 / #19518: the speculative slack [ceil_align(owned), allocated) must come back."""
    alloc = _make(page_size=16, pool=1024, max_context_len=200, spec=STANDALONE)
    toks = _toks(100)
    alloc.extend(_a(0), _a(20), [toks[:20]])
    for _ in range(4):
        alloc.spec_decode(_a(0), _a(1))
    p, c, a = _lens(alloc, 0)
    assert a > c
    res = alloc.release(_a(0), _a(c), [toks[:c]], "finish")
    assert res.overalloc_released[0] == a - 32
    counters = alloc.counters()
    assert counters.available + counters.evictable == 1024
    _clean(alloc)


def test_regression_spec_nxt_is_page_aligned() -> None:
    """#31616: an unaligned nxt strands a page tail; nxt is ceil_align(committed + reserve)."""
    alloc = _make(page_size=16, pool=1024, max_context_len=200, spec=STANDALONE)
    alloc.extend(_a(0), _a(21), [_toks(21)])
    alloc.spec_decode(_a(0), _a(3))
    assert _lens(alloc, 0)[1:] == (24, 32)  # ceil_align(21 + 8, 16)
    res = alloc.spec_decode(_a(0), _a(4))
    assert res.num_tokens == 0 and _lens(alloc, 0)[1:] == (28, 32)  # ceil_align(24 + 8) == 32
    alloc.spec_decode(_a(0), _a(1))
    assert _lens(alloc, 0)[1:] == (29, 48)  # ceil_align(28 + 8, 16)
    c = alloc.counters()
    assert c.overallocated == 48 - 29
    _clean(alloc)


def test_regression_retraction_at_page16_leaks_no_page() -> None:
    """#4913 / #6731 / #9989: retraction with an unaligned length must free whole pages."""
    alloc = _make(page_size=16, pool=512, max_context_len=200)
    toks = _toks(100)
    alloc.extend(_a(0), _a(37), [toks[:37]])
    for _ in range(6):
        alloc.decode(_a(0))
    alloc.release(_a(0), _a(43), None, "retract")
    c = alloc.counters()
    assert c.committed == 0 and c.overallocated == 0
    assert c.available + c.evictable == 512
    _clean(alloc)
    # it comes back from 0 and reuses its published prompt
    res = alloc.extend(_a(0), _a(43), [toks[:43]])
    assert res.prefix_lens.tolist() == [32]
    _clean(alloc)


@pytest.mark.parametrize("page_size", [1, 16])
def test_regression_failed_allocations_change_nothing(page_size: int) -> None:
    """#29432: bookkeeping updated before the allocation drifted on OOM. Every failed
    call here leaves rows, slots, lengths, locks and the tree exactly as they were."""
    pool = 256
    alloc = _make(page_size=page_size, pool=pool, max_context_len=400, spec=STANDALONE, radix_cache=False)
    alloc.extend(_a(0, 1), _a(96, 96), [_toks(96), _toks(96, 500)])
    fill = alloc.counters().available - (page_size if page_size > 1 else 1)
    alloc.extend(_a(2), _a(fill), [_toks(fill, 900)])
    before = _snapshot(alloc)
    res = alloc.extend(_a(3), _a(50), [_toks(50, 5000)])
    assert isinstance(res, OutOfMemory) and res.op == "extend" and res.rid == 3
    assert _snapshot(alloc) == before
    res = alloc.spec_decode(_a(0, 1), _a(1, 1))
    assert isinstance(res, OutOfMemory) and res.op == "spec"
    assert _snapshot(alloc) == before
    if page_size == 1:
        alloc.decode(_a(0))  # takes the last slot
        before = _snapshot(alloc)
    res = alloc.decode(_a(0, 1, 2)) if page_size == 1 else None
    if page_size == 1:
        assert isinstance(res, OutOfMemory) and res.op == "decode"
        assert _snapshot(alloc) == before
    _clean(alloc)


def test_failed_extend_unlocks_its_matches_and_evicts_nothing() -> None:
    alloc = _make(page_size=4, pool=64)
    toks = _toks(40)
    alloc.extend(_a(0), _a(24), [toks[:24]])
    alloc.end_step()
    alloc.release(_a(0), _a(24), [toks[:24]], "finish")
    alloc.extend(_a(1), _a(36), [np.concatenate([toks[:24], _toks(12, 700)])])
    alloc.end_step()
    alloc.extend(_a(3), _a(8), [_toks(8, 3000)])
    alloc.end_step()
    alloc.release(_a(3), _a(8), [_toks(8, 3000)], "finish")  # 8 evictable tokens of cache
    before = _snapshot(alloc)
    c = alloc.counters()
    assert c.evictable == 8 and c.available == 20
    # new request matches the cached 24 tokens, then needs 40 more: free 20 + evictable 8
    # cannot make it, so the call must not evict the 8 (SGLang would evict, then fail).
    res = alloc.extend(_a(2), _a(64), [np.concatenate([toks[:24], _toks(40, 900)])])
    assert isinstance(res, OutOfMemory)
    assert (res.rid, res.needed, res.available, res.evictable) == (2, 40, 20, 8)
    assert _snapshot(alloc) == before
    assert not alloc.holds_kv(_a(2))[0]
    _clean(alloc)
    # the same need minus one page fits: then eviction happens and the call succeeds
    res = alloc.extend(_a(2), _a(52), [np.concatenate([toks[:24], _toks(28, 900)])])
    assert isinstance(res, AllocResult) and res.evicted_tokens == 8
    _clean(alloc)


def test_failed_extend_neither_splits_nor_touches_the_tree() -> None:
    """A match that ends inside a cached node splits it and refreshes access times;
    an extend that cannot fit must do neither (the LRU order decides later evictions)."""
    alloc = _make(page_size=4, pool=64)
    old, hot = _toks(24, 100), _toks(16, 300)
    for rid, toks in ((0, old), (1, hot)):
        alloc.extend(_a(rid), _a(len(toks)), [toks])
        alloc.end_step()
        alloc.release(_a(rid), _a(len(toks)), [toks], "finish")
    alloc.extend(_a(2), _a(20), [_toks(20, 900)])  # 20 of the 24 free slots
    before = _snapshot(alloc)
    c = alloc.counters()
    assert (c.available, c.evictable) == (4, 40)
    # matches 8 of the 24 cached tokens (inside the node) and needs 40 more: 4 + 32 short
    probe = np.concatenate([old[:8], _toks(40, 5000)])
    res = alloc.extend(_a(3), _a(48), [probe])
    assert isinstance(res, OutOfMemory) and res.op == "extend"
    assert (res.needed, res.available, res.evictable) == (40, 4, 32)
    assert _snapshot(alloc) == before
    # the old prompt is still the least recently used leaf: it goes first
    assert alloc.evict(1) == 24
    assert alloc.counters().evictable == 16
    _clean(alloc)


def test_extend_matches_only_up_to_its_chunk() -> None:
    """SGLang caps the match key at min(len(fill), seq_len) - 1 tokens: a first chunk
    shorter than the cached prefix locks (and splits at) the chunk's page, no deeper."""
    alloc = _make(page_size=4, pool=128)
    toks = _toks(40)
    alloc.extend(_a(0), _a(24), [toks[:24]])
    alloc.end_step()
    alloc.release(_a(0), _a(24), [toks[:24]], "finish")
    assert alloc.counters().evictable == 24
    # all 40 fill ids known, the first chunk ends at 13 (no publish yet: prefill not done)
    res = alloc.extend(_a(1), _a(13), [toks], np.array([False]))
    assert res.prefix_lens.tolist() == [12]
    c = alloc.counters()
    assert (c.protected, c.evictable) == (12, 12)
    assert _raw_lens(alloc, 1) == (12, 13, 13)
    _clean(alloc)


def test_retract_evicts_room_for_the_requests_still_decoding() -> None:
    """SGLang's release_req: after each retracted request, evict the shortfall below
    ``remaining * 20`` free slots, ``remaining`` = requests still decoding."""
    alloc = _make(page_size=1, pool=128, max_context_len=100)
    cached = _toks(40, 7000)
    alloc.extend(_a(9), _a(40), [cached])
    alloc.end_step()
    alloc.release(_a(9), _a(40), [cached], "finish")  # 40 tokens of evictable cache
    alloc.extend(_a(0, 1, 2), _a(20, 20, 20), [_toks(20, 100), _toks(20, 200), _toks(20, 300)])
    alloc.end_step()
    c = alloc.counters()
    assert (c.available, c.evictable) == (128 - 40 - 60, 40)  # 28 free
    # retract 0 then 1: after 0, 2 remain -> keep 40 free (evict 12 + page... whole leaf);
    # after 1 only 2 remains -> 20 free, already there
    res = alloc.release(_a(0, 1), _a(20, 20), None, "retract")
    assert res.evicted_tokens > 0
    c = alloc.counters()
    assert c.available >= 40 and c.running_requests == 1
    _clean(alloc)


def test_rows_exhausted_is_an_outcome() -> None:
    alloc = _make(max_running=2)
    alloc.extend(_a(0, 1), _a(3, 3), [_toks(3), _toks(3, 50)])
    before = _snapshot(alloc)
    res = alloc.extend(_a(2), _a(3), [_toks(3, 90)])
    assert isinstance(res, OutOfMemory) and res.op == "extend_rows" and res.rid == 2
    assert _snapshot(alloc) == before


# ---------------------------------------------------------------------------- eviction before allocation


def test_decode_evicts_lru_cache_when_short() -> None:
    alloc = _make(page_size=4, pool=32)  # 8 pages
    a, b = _toks(8, 100), _toks(8, 200)
    alloc.extend(_a(0), _a(8), [a])
    alloc.end_step()
    alloc.release(_a(0), _a(8), [a], "finish")  # tree: [a] 8 tokens
    alloc.extend(_a(1), _a(8), [b])
    alloc.end_step()
    alloc.release(_a(1), _a(8), [b], "finish")  # tree: [a], [b]
    # 3 pages; SGLang's extend estimate (12 + one page) still fits: nothing evicted
    res = alloc.extend(_a(2), _a(12), [_toks(12, 300)])
    assert res.evicted_tokens == 0
    c = alloc.counters()
    assert (c.available, c.evictable) == (4, 16)
    # the decode at length 12 takes the last free page
    assert alloc.decode(_a(2)).evicted_tokens == 0
    assert alloc.counters().available == 0
    # no page needed at 13, but paged decode evicts for bs * ps anyway: the LRU leaf (a)
    res = alloc.decode(_a(2))
    assert isinstance(res, AllocResult) and res.evicted_tokens == 8
    assert alloc.counters().available == 8
    assert alloc.match_prefix(np.concatenate([a, _a(1)])) == 0
    assert alloc.match_prefix(np.concatenate([b, _a(1)])) == 8
    _clean(alloc)


# ---------------------------------------------------------------------------- row overflow (§10)


def test_spec_reserve_past_the_row_is_clipped_and_reported() -> None:
    """Page 1, EAGLE 5/4/8: reserve 40 but only 12 positions of row headroom."""
    spec = SpecConfig("eagle", 5, 4, 8)
    alloc = _make(page_size=1, pool=512, max_context_len=64, spec=spec)
    width = alloc.req_to_token_pool.max_context_len
    assert width == 64 + 12
    alloc.extend(_a(5), _a(50), [_toks(50)])
    res = alloc.spec_decode(_a(5), _a(4))
    assert res.row_overflow == ((5, 90, width),)
    assert _lens(alloc, 5)[2] == width
    assert not alloc.req_to_token_pool.req_to_token_np[alloc.row_of(5) + 1 :].any()
    _clean(alloc)
    # commits past the clipped reserve are clipped too and reported
    for _ in range(8):
        res = alloc.spec_decode(_a(5), _a(4))
    assert _lens(alloc, 5)[1] == width
    assert res.row_overflow and res.row_overflow[0][0] == 5
    _clean(alloc)


def test_extend_past_the_row_width_is_refused_untouched() -> None:
    alloc = _make(page_size=1, max_context_len=16)
    before = _snapshot(alloc)
    with pytest.raises(ValueError, match="rid=3"):
        alloc.extend(_a(3), _a(40), [_toks(40)])
    assert _snapshot(alloc) == before


# ---------------------------------------------------------------------------- PD decode prealloc


def test_prealloc_reuses_local_radix_prefix_and_publishes() -> None:
    alloc = _make(page_size=4, pool=256, extra_rows=2)
    toks = _toks(30)
    res = alloc.prealloc(_a(0), _a(18), [toks[:18]])
    assert res.num_tokens == 18 and res.prefix_lens.tolist() == [0]
    # published in the call (SGLang's process_prebuilt runs before the step's decode)
    assert _raw_lens(alloc, 0) == (16, 18, 18)
    # PD decode matches the whole prompt (no len - 1 cap)
    res = alloc.prealloc(_a(1), _a(16), [toks[:16]])
    assert res.prefix_lens.tolist() == [16] and res.num_tokens == 0
    assert alloc.row_slots(1).tolist() == alloc.row_slots(0)[:16].tolist()
    alloc.decode(_a(0, 1))
    _clean(alloc)


def test_prealloc_batch_is_all_or_nothing() -> None:
    alloc = _make(page_size=4, pool=64, radix_cache=False)
    before = _snapshot(alloc)
    res = alloc.prealloc(_a(0, 1, 2), _a(20, 20, 40), [_toks(20), _toks(20, 50), _toks(40, 90)])
    assert isinstance(res, OutOfMemory) and res.op == "prealloc" and res.rid == 2
    assert _snapshot(alloc) == before
    res = alloc.prealloc(_a(0, 1), _a(20, 20), [_toks(20), _toks(20, 50)])
    assert isinstance(res, AllocResult)
    # one request at a time: each takes the last free row
    assert (alloc.row_of(0), alloc.row_of(1)) == (8, 7)
    _clean(alloc)


def test_prealloc_batch_with_radix_fails_before_any_match_or_eviction() -> None:
    """With the decode radix cache, the first request of a batch would evict cache and
    the second would match (and split) a cached node; the batch does not fit, so
    neither happens. The same total minus one page fits, whichever request evicts."""
    alloc = _make(page_size=4, pool=64, extra_rows=2)
    cached = _toks(24, 100)
    alloc.prealloc(_a(9), _a(24), [cached])
    alloc.release(_a(9), _a(24), [cached], "finish")
    alloc.prealloc(_a(8), _a(20), [_toks(20, 700)])
    before = _snapshot(alloc)
    c = alloc.counters()
    assert (c.available, c.evictable) == (20, 24)
    # r0 needs 16 (evicts), r1 matches 8 of the cached 24 and needs 24 more: 16 + 24 > 20 + 24 - 8
    probe = np.concatenate([cached[:8], _toks(24, 5000)])
    res = alloc.prealloc(_a(0, 1), _a(16, 32), [_toks(16, 300), probe])
    assert isinstance(res, OutOfMemory) and res.op == "prealloc" and res.rid == 1
    assert _snapshot(alloc) == before
    res = alloc.prealloc(_a(0, 1), _a(16, 28), [_toks(16, 300), probe[:28]])
    assert isinstance(res, AllocResult) and res.prefix_lens.tolist() == [0, 8]
    assert alloc.counters().available == 0
    _clean(alloc)


def test_prealloc_after_retraction_matches_the_prompt_only() -> None:
    """SGLang's PD queue matches ``origin_input_ids``: a request pre-allocated again after
    a retraction reuses at most its prompt (its first fill), not its outputs."""
    alloc = _make(page_size=4, pool=256, extra_rows=2)
    toks = _toks(40)
    alloc.prealloc(_a(0), _a(16), [toks[:16]])
    for n in range(17, 27):
        alloc.decode(_a(0))
    alloc.release(_a(0), _a(26), [toks[:26]], "finish")  # the tree holds 24 tokens of r0
    alloc.prealloc(_a(1), _a(16), [toks[:16]])
    alloc.release(_a(1), _a(16), None, "retract")
    res = alloc.prealloc(_a(1), _a(26), [toks[:26]])
    assert res.prefix_lens.tolist() == [16]
    _clean(alloc)


def test_hisparse_prealloc_is_logical_only() -> None:
    alloc = create_allocator(
        AllocatorConfig(pool_tokens=64, page_size=4, max_running=4, max_context_len=64, hisparse=True,
                        radix_cache=False)
    )
    tok = alloc.token_to_kv_pool_allocator
    alloc.prealloc(_a(0), _a(10), [_toks(10)])
    assert tok.logical_attn_allocator.available_size() == 128 - 12
    assert tok.hisparse_attn_allocator.available_size() == 64
    assert not tok.full_to_hisparse_device_index_mapping[alloc.row_slots(0)].any()
    alloc.decode(_a(0))
    _clean(alloc)
    alloc.release(_a(0), _a(11), None, "finish")
    assert tok.logical_attn_allocator.available_size() == 128
    _clean(alloc)


def test_hisparse_extend_maps_device_slots() -> None:
    alloc = create_allocator(
        AllocatorConfig(pool_tokens=64, page_size=4, max_running=4, max_context_len=64, hisparse=True,
                        radix_cache=False)
    )
    tok = alloc.token_to_kv_pool_allocator
    alloc.extend(_a(0), _a(10), [_toks(10)])
    mapping = tok.full_to_hisparse_device_index_mapping
    assert (mapping[alloc.row_slots(0)] > 0).all()
    alloc.release(_a(0), _a(10), None, "finish")
    assert tok.hisparse_attn_allocator.available_size() == 64
    _clean(alloc)


# ---------------------------------------------------------------------------- the checker can fail


def test_checker_reports_double_free() -> None:
    alloc = _make(page_size=4, pool=128)
    alloc.extend(_a(0), _a(10), [_toks(10)])
    alloc.end_step()
    live = alloc.row_slots(0)
    alloc.token_to_kv_pool_allocator.free(live[8:9])  # the request's own page, freed behind its back
    checks = {v.check for v in alloc.check_integrity()}
    assert {"conservation", "ownership", "row"} <= checks
    rids = {v.rid for v in alloc.check_integrity() if v.check == "row"}
    assert rids == {0}


def test_checker_reports_leak_and_bad_lengths() -> None:
    alloc = _make(page_size=1, pool=64, radix_cache=False)
    alloc.extend(_a(0), _a(10), [_toks(10)])
    alloc.token_to_kv_pool_allocator.alloc(3)  # taken, owned by nobody
    alloc.req_kv.kv_committed_len[alloc.row_of(0)] = 12  # committed > allocated
    violations = alloc.check_integrity()
    checks = {v.check for v in violations}
    assert {"conservation", "ownership", "lengths", "counters"} <= checks
    lengths = [v for v in violations if v.check == "lengths"]
    assert lengths[0].rid == 0 and lengths[0].values["committed"] == 12


def test_checker_reports_wrong_row_and_lock_counts() -> None:
    alloc = _make(page_size=4, pool=128)
    toks = _toks(20)
    alloc.extend(_a(0), _a(12), [toks[:12]])
    alloc.end_step()
    row = alloc.row_of(0)
    alloc.req_to_token_pool.req_to_token_np[row, 1] = 9  # breaks paged alignment and the prefix
    node = alloc.req_kv.lock_node[row]
    node.lock_ref += 1
    checks = {v.check for v in check_integrity(alloc)}
    assert {"row", "tree"} <= checks


def test_counters_are_conserved_after_each_op() -> None:
    alloc = _make(page_size=16, pool=2048, max_context_len=300, spec=STANDALONE)
    toks = _toks(200)
    steps = [
        lambda: alloc.extend(_a(0, 1), _a(40, 70), [toks[:90], toks[:70]], np.array([False, True])),
        lambda: alloc.extend(_a(0, 2), _a(90, 33), [toks[:90], toks[:33]]),
        lambda: alloc.spec_decode(_a(1), _a(3)),
        lambda: alloc.spec_decode(_a(0, 1, 2), _a(1, 4, 2)),
        lambda: alloc.release(_a(1), _a(74), [toks[:74]], "finish"),
        lambda: alloc.release(_a(2), _a(35), None, "abort"),
        lambda: alloc.evict(5),
    ]
    for step in steps:
        step()
        c = alloc.counters()
        assert c.available + c.evictable + c.protected + c.committed + c.overallocated == c.pool_tokens
        _clean(alloc)


def test_bad_calls_raise_value_errors() -> None:
    alloc = _make(page_size=4)
    with pytest.raises(ValueError, match="holds no KV"):
        alloc.decode(_a(5))
    with pytest.raises(ValueError, match="speculative"):
        alloc.spec_decode(_a(5), _a(1))
    alloc.extend(_a(0), _a(4), [_toks(4)])
    with pytest.raises(ValueError, match="already finished its prefill"):
        alloc.extend(_a(0), _a(8), [_toks(8)])
    with pytest.raises(ValueError, match="kind"):
        alloc.release(_a(0), _a(4), None, "drop")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="token ids"):
        alloc.extend(_a(1), _a(8), [_toks(4)])
    with pytest.raises(ValueError):
        create_allocator(AllocatorConfig(pool_tokens=4, page_size=16))


def test_checker_reports_hisparse_device_page_leak() -> None:
    alloc = create_allocator(
        AllocatorConfig(pool_tokens=64, page_size=4, max_running=4, max_context_len=64, hisparse=True,
                        radix_cache=False)
    )
    alloc.extend(_a(0), _a(10), [_toks(10)])
    _clean(alloc)
    tok = alloc.token_to_kv_pool_allocator
    tok.full_to_hisparse_device_index_mapping[alloc.row_slots(0)[:4]] = 0  # device page lost
    assert {v.check for v in alloc.check_integrity()} == {"hisparse"}


def test_explicit_stash_is_the_same_as_the_one_extend_does() -> None:
    toks = _toks(60)
    states = []
    for explicit in (False, True):
        alloc = _make(page_size=4, pool=256)
        alloc.extend(_a(0), _a(24), [toks], np.array([False]))
        alloc.end_step()
        if explicit:
            alloc.stash_chunked(_a(0), [toks])
            assert _raw_lens(alloc, 0)[0] == 24
        alloc.extend(_a(0, 1), _a(48, 30), [toks, toks[:30]], np.array([False, True]))
        states.append(_snapshot(alloc))
        _clean(alloc)
    assert states[0] == states[1]
    with pytest.raises(ValueError, match="not in chunked prefill"):
        alloc.stash_chunked(_a(1), [toks[:30]])


def test_built_in_allocator_satisfies_the_protocol() -> None:
    from allocator import Allocator

    alloc = _make()
    assert isinstance(alloc, Allocator)
    assert alloc.config.page_size == 4
    assert alloc.holds_kv(_a(0, 99)).tolist() == [False, False]
    assert alloc.request_lens(_a(3)).allocated.tolist() == [0]
    assert alloc.row_slots(3).tolist() == []
    alloc.extend(_a(3), _a(5), [_toks(5)])
    info = alloc.kv_info(3)
    assert (info.req_pool_idx, info.kv_allocated_len, info.kv_committed_len, info.cache_protected_len) == (8, 5, 5, 4)


def test_a_request_twice_in_one_extend_or_release_is_refused_and_lens_of_released_requests_read_zero() -> None:
    """The batch checks and reads that take the small-batch path (``allocator.reduce``):
    a duplicate id is still refused, and requests holding no KV read as zeros."""
    a = _make(page_size=1)
    with pytest.raises(ValueError, match="appears twice"):
        a.extend(_a(1, 2, 1), _a(5, 6, 5), [_toks(5), _toks(6, 2000), _toks(5)])
    assert isinstance(a.extend(_a(1, 2), _a(5, 6), [_toks(5), _toks(6, 2000)]), AllocResult)
    with pytest.raises(ValueError, match="appears twice"):
        a.release(_a(1, 1), _a(5, 5), [_toks(5), _toks(5)], "finish")
    a.release(_a(1), _a(5), [_toks(5)], "finish")
    lens = a.request_lens(_a(2, 1, 7))
    assert lens.allocated.tolist() == [6, 0, 0]
    assert lens.committed.tolist() == [6, 0, 0]
    assert all(x.dtype == np.int64 for x in lens)


def test_a_negative_request_id_is_refused_and_a_large_one_grows_the_map() -> None:
    a = _make(page_size=1)
    with pytest.raises(ValueError, match="request ids must be >= 0, found -3"):
        a.holds_kv(_a(1, -3, 2))
    assert a.holds_kv(np.array([5, 100_000], np.int32)).tolist() == [False, False]
    assert isinstance(a.extend(_a(100_000), _a(5), [_toks(5)]), AllocResult)
    assert a.holds_kv(_a(100_000, 3)).tolist() == [True, False]
