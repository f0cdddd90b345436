"""``KvAllocator`` with a sliding-window pool (``AllocatorConfig.swa``), radix cache off.

What SGLang 0.5.23 does for a hybrid SWA model without the radix cache
(``UnifiedRadixCache(FULL, SWA)`` disabled; reference §11.2, 4, 5, 7, 14): the
allocations go through ``SWATokenToKVPoolAllocator``, ``maybe_evict_swa`` frees
out-of-window SWA slots before each decode / spec / extend allocation (interval,
first-decode rule, page floor), release frees the window-freed range full-side only,
PD prealloc takes an SWA tail. SGLang parity of whole scenarios lives in
``tests/differential/``; here are the facts one by one on small pools.
"""

from __future__ import annotations

import numpy as np
import pytest

from allocator.base import AllocatorConfig, OutOfMemory, SpecConfig, SwaConfig
from allocator.manager import KvAllocator


def _swa(ps: int, window: int = 64, interval: int = 8, pool: int = 4096, swa_pool: int | None = None,
         spec: SpecConfig | None = None) -> KvAllocator:
    return KvAllocator(
        AllocatorConfig(
            pool_tokens=pool,
            page_size=ps,
            max_running=8,
            max_context_len=4096,
            radix_cache=False,
            spec=spec,
            swa=SwaConfig(window=window, eviction_interval=interval, swa_pool_tokens=swa_pool),
        )
    )


def _ids(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int64)


def _conserved(a: KvAllocator) -> None:
    for name, c in a.pool_counters().items():
        total = c.available + c.evictable + c.protected + c.committed + c.overallocated
        assert total == c.pool_tokens, (name, c)


# ---------------------------------------------------------------------------- configuration


def test_swa_pool_size_follows_the_ratio_floored_to_a_page() -> None:
    """pool_configurator._solve_pool_sizes: swa = align(int(full * ratio))."""
    assert SwaConfig(window=128).pool_tokens(1000, 16) == 800
    assert SwaConfig(window=128, swa_full_tokens_ratio=0.5).pool_tokens(1000, 16) == 496
    assert SwaConfig(window=128, swa_pool_tokens=300).pool_tokens(1000, 16) == 288
    a = KvAllocator(AllocatorConfig(pool_tokens=1000, page_size=16, radix_cache=False, swa=SwaConfig(window=128)))
    assert a.pool_counters()["swa"].pool_tokens == int(992 * 0.8) // 16 * 16
    assert a.pool_counters()["full"].pool_tokens == 992


def test_swa_with_the_radix_cache_gets_the_swa_radix_tree() -> None:
    from allocator.swa_radix import SwaRadixCache

    a = KvAllocator(AllocatorConfig(pool_tokens=4096, swa=SwaConfig(window=64)))
    assert isinstance(a.tree_cache, SwaRadixCache)


@pytest.mark.parametrize(
    ("swa", "match"),
    [
        (SwaConfig(window=0), "window"),
        (SwaConfig(window=64, eviction_interval=0), "eviction_interval"),
        (SwaConfig(window=64, swa_full_tokens_ratio=1.5), "ratio"),
        (SwaConfig(window=64, swa_pool_tokens=72), "cannot hold one request"),
    ],
)
def test_bad_swa_configs_are_refused(swa: SwaConfig, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AllocatorConfig(pool_tokens=4096, page_size=8, radix_cache=False, swa=swa).check()


@pytest.mark.parametrize("radix_cache", [False, True])
def test_hisparse_with_swa_is_refused_as_sglang_never_serves_it(radix_cache: bool) -> None:
    """kv_cache_configurator builds SWATokenToKVPoolAllocator for a hybrid SWA model
    before it looks at --enable-hisparse (HiSparse wraps only DeepSeek V4's SWA pools);
    hisparse_hook admits DSA, DeepSeek V4 and MiniMax M3 models only."""
    from allocator.base import HISPARSE_SWA_REFUSAL

    config = AllocatorConfig(pool_tokens=4096, page_size=16, radix_cache=False, hisparse=True,
                             swa=SwaConfig(window=64))
    with pytest.raises(ValueError) as info:
        config.check()
    assert str(info.value) == HISPARSE_SWA_REFUSAL == "SGLang 0.5.23 does not serve HiSparse with sliding-window models"
    from kvtrace.replay.config import unsupported_swa

    config = AllocatorConfig(pool_tokens=4096, page_size=16, radix_cache=radix_cache, hisparse=True,
                             swa=SwaConfig(window=64))
    with pytest.raises(ValueError) as info:
        config.check()
    line = unsupported_swa(config, info.value)
    assert line is not None and line.startswith(HISPARSE_SWA_REFUSAL) and "\n" not in line


def test_full_attention_has_one_pool_and_no_swa_columns_kept() -> None:
    a = KvAllocator(AllocatorConfig(pool_tokens=1024, page_size=4))
    a.extend(_ids(1), np.array([10]), [_ids(10)])
    assert a.pool_counters() == {"full": a.counters()}
    assert not a.req_kv.swa


# ---------------------------------------------------------------------------- decode window frees


def _decode(a: KvAllocator, rids: np.ndarray, steps: int) -> None:
    for _ in range(steps):
        res = a.decode(rids)
        assert not isinstance(res, OutOfMemory), res


def test_no_window_free_on_the_first_decode_step() -> None:
    """schedule_batch.py 4087: decode_batch_idx >= 1 (ticked after the allocation)."""
    a = _swa(1, window=64, interval=8)
    a.extend(_ids(1), np.array([100]), [_ids(100)])
    _decode(a, _ids(1), 1)  # committed 100 - 64 >= 0 + 8, but it is the first decode
    assert a.kv_info(0).swa_evicted_seqlen == 0
    _decode(a, _ids(1), 1)  # committed 101: frees [0, 101 - 64)
    assert a.kv_info(0).swa_evicted_seqlen == 37
    assert a.pool_counters()["swa"].committed == 102 - 37
    _conserved(a)


def test_decode_frees_wait_for_the_interval_then_free_to_the_window() -> None:
    """committed - window >= evicted + interval; page 1 frees up to committed - window exactly."""
    a = _swa(1, window=64, interval=8)
    a.extend(_ids(1), np.array([100]), [_ids(100)])
    _decode(a, _ids(1), 2)  # cursor 37 (committed 101 at the free)
    cursors = []
    for _ in range(10):
        _decode(a, _ids(1), 1)
        cursors.append(a.kv_info(0).swa_evicted_seqlen)
    # committed before step k is 102 + k; due once 102 + k - 64 >= 45, i.e. k = 7
    assert cursors == [37] * 7 + [45, 45, 45]
    _conserved(a)


def test_paged_window_frees_are_floored_to_a_page() -> None:
    """common.py 127-128: the new cursor is floored to a page; the gate keeps firing
    while the floor does not move (the cursor stays)."""
    a = _swa(16, window=64, interval=8)
    a.extend(_ids(1), np.array([100]), [_ids(100)])
    _decode(a, _ids(1), 2)  # committed 101 -> 37 -> floored 32
    assert a.kv_info(0).swa_evicted_seqlen == 32
    _decode(a, _ids(1), 10)  # committed 102..111: threshold < 48, cursor stays 32
    assert a.kv_info(0).swa_evicted_seqlen == 32
    _decode(a, _ids(1), 1)  # committed 112: 112 - 64 = 48
    assert a.kv_info(0).swa_evicted_seqlen == 48
    c = a.pool_counters()
    assert c["swa"].available == c["swa"].pool_tokens - (ceil16(113) - 48)
    _conserved(a)


def ceil16(n: int) -> int:
    return -(-n // 16) * 16


def test_a_decode_that_fits_only_thanks_to_window_frees_succeeds() -> None:
    """The fit counts the SWA slots maybe_evict_swa frees before the allocation."""
    a = _swa(1, window=16, interval=1, pool=1024, swa_pool=120)
    a.extend(_ids(1), np.array([100]), [_ids(100)])
    _decode(a, _ids(1), 1)  # first decode: no free; SWA pool now 101 / 120
    _decode(a, _ids(1), 19)  # each step frees to committed - 16 first
    assert a.pool_counters()["swa"].available == 120 - 16 - 1
    _conserved(a)


# ---------------------------------------------------------------------------- out of memory


@pytest.mark.parametrize("ps", [1, 16])
def test_oom_names_the_swa_pool_and_changes_nothing(ps: int) -> None:
    a = _swa(ps, window=64, pool=4096, swa_pool=256)
    a.extend(_ids(1), np.array([160]), [_ids(160)])
    before = a.pool_counters()
    res = a.extend(np.array([1, 2]), np.array([64, 64]), [_ids(64), _ids(64)])
    assert isinstance(res, OutOfMemory)
    assert (res.pool, res.op, res.rid) == ("swa", "extend", 2)
    assert a.pool_counters() == before
    assert not a.holds_kv(np.array([1, 2])).any()


def test_oom_names_the_full_pool_when_it_runs_short() -> None:
    a = _swa(16, window=64, pool=256, swa_pool=240)
    res = a.extend(np.array([0]), np.array([300]), [_ids(300)])
    assert isinstance(res, OutOfMemory) and res.pool == "full"
    assert OutOfMemory("decode", 0, 1, 0, 0).pool == "full"  # the default: full attention


# ---------------------------------------------------------------------------- release, retraction


@pytest.mark.parametrize("ps", [1, 16, 64])
@pytest.mark.parametrize("kind", ["finish", "retract", "abort"])
def test_release_after_window_frees_returns_both_pools_whole(ps: int, kind: str) -> None:
    """common.py 152-190: [dead_lo, swa_evicted) goes back full-side only, the rest in both."""
    a = _swa(ps, window=64, interval=8, pool=8192)
    a.extend(np.array([0, 1]), np.array([300, 130]), [_ids(300), _ids(130)])
    _decode(a, np.array([0, 1]), 150)
    assert a.kv_info(0).swa_evicted_seqlen > 0
    _conserved(a)
    a.release(np.array([0, 1]), np.array([450, 280]), None, kind)  # type: ignore[arg-type]
    c = a.pool_counters()
    assert c["full"].available == c["full"].pool_tokens
    assert c["swa"].available == c["swa"].pool_tokens
    assert a.check_integrity() == []


def test_retracted_request_starts_over_with_a_fresh_cursor() -> None:
    a = _swa(16, window=64, interval=8)
    a.extend(_ids(1), np.array([200]), [_ids(200)])
    _decode(a, _ids(1), 20)
    a.release(_ids(1), np.array([220]), None, "retract")
    a.extend(_ids(1), np.array([220]), [_ids(220)])
    assert a.kv_info(0).swa_evicted_seqlen == 0
    _decode(a, _ids(1), 1)  # the first decode after the re-prefill: no free
    assert a.kv_info(0).swa_evicted_seqlen == 0
    _conserved(a)


# ---------------------------------------------------------------------------- chunked prefill


def test_a_continuing_chunk_frees_what_lies_a_window_behind_its_prefix() -> None:
    """maybe_evict_swa in extend mode without prefix sharing: pre_len = prefix_len."""
    a = _swa(16, window=64)
    a.extend(_ids(1), np.array([200]), [_ids(400)], prefill_done=np.array([False]))
    a.extend(_ids(1), np.array([400]), [_ids(400)])
    assert a.kv_info(0).swa_evicted_seqlen == (200 - 64) // 16 * 16
    _conserved(a)


def test_the_overlap_scheduler_lags_the_chunk_free_by_its_chunk_size() -> None:
    """schedule_batch.py 4109-4120: with overlap, pre_len = prefix - chunked_prefill_size."""
    a = KvAllocator(AllocatorConfig(pool_tokens=4096, page_size=16, max_running=4, max_context_len=1024,
                                    radix_cache=False,
                                    swa=SwaConfig(window=64, overlap_chunked_prefill=64)))
    a.extend(_ids(1), np.array([200]), [_ids(400)], prefill_done=np.array([False]))
    a.extend(_ids(1), np.array([400]), [_ids(400)])
    assert a.kv_info(0).swa_evicted_seqlen == (200 - 64 - 64) // 16 * 16
    _conserved(a)


# ---------------------------------------------------------------------------- PD prealloc, spec


@pytest.mark.parametrize(("ps", "tail"), [(16, 200 - 128), (64, 200 - 128), (1, 200)])
def test_prealloc_takes_an_swa_tail_at_page_above_one(ps: int, tail: int) -> None:
    """decode.py 563-580 and 2484-2494: tail = fill - floor(fill - window); cursor = fill - tail."""
    a = _swa(ps, window=64, pool=8192)
    res = a.prealloc(_ids(1), np.array([200]), [_ids(200)])
    assert not isinstance(res, OutOfMemory), res
    assert a.kv_info(0).swa_evicted_seqlen == 200 - tail
    c = a.pool_counters()
    assert c["swa"].pool_tokens - c["swa"].available == -(-tail // ps) * ps
    _conserved(a)
    _decode(a, _ids(1), 30)
    _conserved(a)
    a.release(_ids(1), np.array([230]), None, "finish")
    c = a.pool_counters()
    assert c["swa"].available == c["swa"].pool_tokens and c["full"].available == c["full"].pool_tokens


def test_prealloc_batch_that_does_not_fit_the_swa_pool_changes_nothing() -> None:
    a = _swa(16, window=64, pool=8192, swa_pool=144)  # tails of 80 tokens each
    before = a.pool_counters()
    res = a.prealloc(np.array([0, 1]), np.array([200, 200]), [_ids(200), _ids(200)])
    assert isinstance(res, OutOfMemory) and (res.pool, res.rid) == ("swa", 1)
    assert a.pool_counters() == before


@pytest.mark.parametrize("ps", [1, 16])
def test_spec_decode_frees_out_of_window_and_conserves_both_pools(ps: int) -> None:
    a = _swa(ps, window=64, interval=4, spec=SpecConfig(num_steps=3, num_draft_tokens=4))
    rids = np.array([0, 1])
    a.extend(rids, np.array([150, 90]), [_ids(150), _ids(90)])
    rng = np.random.default_rng(0)
    for _ in range(40):
        res = a.spec_decode(rids, rng.integers(1, 5, size=2))
        assert not isinstance(res, OutOfMemory), res
        _conserved(a)
    assert a.kv_info(0).swa_evicted_seqlen > 0
    assert a.check_integrity() == []
    a.release(rids, a.request_lens(rids).committed, None, "finish")
    c = a.pool_counters()
    assert c["swa"].available == c["swa"].pool_tokens and c["full"].available == c["full"].pool_tokens


@pytest.mark.parametrize("ps", [1, 16, 64])
def test_dflash_reserves_two_verify_blocks_on_the_swa_pool_too(ps: int) -> None:
    """DFlashDraftInputV2.prepare_for_decode: maybe_evict_swa, then nxt =
    ceil_page(committed + 2 * num_draft_tokens), allocated in both pools (the SWA
    slots through the full->SWA mapping)."""
    a = _swa(ps, window=64, interval=4, spec=SpecConfig("dflash", 1, 1, 8))
    a.extend(_ids(1), np.array([150]), [_ids(150)])
    res = a.spec_decode(_ids(1), np.array([3]))
    assert not isinstance(res, OutOfMemory), res
    assert a.request_lens(_ids(1)).allocated[0] == -(-(150 + 16) // ps) * ps
    for _ in range(20):
        assert not isinstance(a.spec_decode(_ids(1), np.array([5])), OutOfMemory)
        _conserved(a)
    assert a.kv_info(0).swa_evicted_seqlen > 0
    assert a.check_integrity() == []


@pytest.mark.parametrize("ps", [1, 16])
def test_a_draft_window_widens_what_decode_keeps_but_not_the_pd_tail(ps: int) -> None:
    """SGLang's swa_retain_window = max(sliding_window_size, draft_swa_window): the
    out-of-window frees keep the larger window; _swa_tail_len sizes the PD tail by the
    scheduler's sliding_window_size, the model's own."""
    def alloc(draft: int) -> KvAllocator:
        return KvAllocator(AllocatorConfig(
            pool_tokens=8192, page_size=ps, max_running=8, max_context_len=4096, radix_cache=False,
            swa=SwaConfig(window=64, eviction_interval=8, draft_window=draft),
        ))

    plain, drafted = alloc(0), alloc(112)
    for a in (plain, drafted):
        a.extend(_ids(1), np.array([300]), [_ids(300)])
        _decode(a, _ids(1), 40)
    # committed 340: the cursor is at most 340 - window (page-floored)
    assert 340 - 64 - 8 - ps < plain.kv_info(0).swa_evicted_seqlen <= 340 - 64
    assert 340 - 112 - 8 - ps < drafted.kv_info(0).swa_evicted_seqlen <= 340 - 112
    if ps > 1:
        for a in (plain, drafted):
            a.prealloc(np.array([1]), np.array([200]), [_ids(200)])
        assert plain.kv_info(1).swa_evicted_seqlen == drafted.kv_info(1).swa_evicted_seqlen == (200 - 64) // ps * ps
    with pytest.raises(ValueError, match="draft_window"):
        AllocatorConfig(pool_tokens=4096, radix_cache=False, swa=SwaConfig(window=64, draft_window=-1)).check()


@pytest.mark.parametrize("ps", [1, 16])
def test_release_prefill_swa_unlocks_the_prefix_swa_after_the_window(ps: int) -> None:
    """SGLANG_OPT_RELEASE_PREFILL_SWA: maybe_evict_swa releases the SWA part of a
    decoding request's tree lock once decode_batch_idx >= swa_retain_window; its
    prefix's SWA turns evictable while FULL stays protected; the final release then
    drops FULL only, and both pools account for every slot throughout."""
    def run(release: bool) -> tuple[KvAllocator, list[tuple[int, int]]]:
        a = KvAllocator(AllocatorConfig(
            pool_tokens=4096, page_size=ps, max_running=8, max_context_len=1024,
            swa=SwaConfig(window=32, eviction_interval=4, release_prefill_swa=release),
        ))
        a.extend(_ids(1), np.array([160]), [_ids(160)])
        a.end_step()  # the prompt's publish: the tree holds and locks it
        seen = []
        for _ in range(40):
            assert not isinstance(a.decode(_ids(1)), OutOfMemory)
            seen.append((a.tree_cache.swa_protected_size(), a.tree_cache.protected_size()))
            _conserved(a)
        assert a.check_integrity() == []
        a.release(_ids(1), a.request_lens(_ids(1)).committed, [_ids(200)], "finish")
        assert a.tree_cache.swa_protected_size() == a.tree_cache.protected_size() == 0
        assert a.check_integrity() == []
        _conserved(a)
        return a, seen

    _, kept = run(False)
    _, released = run(True)
    assert kept[0] == released[0] and kept[0][0] > 0
    # 32 decode steps in, the SWA lock goes; FULL stays locked to the end
    assert released[32][0] == 0 < kept[32][0] and released[32][1] == kept[32][1] > 0
    assert released[30] == kept[30]


def test_decode_runs_with_swa_report_the_swa_pool_too() -> None:
    """A decode run with an SWA pool is done in one call (``test_decode_run`` checks it
    against the steps); its result carries the SWA pool's counters after each step."""
    a = _swa(16)
    a.extend(_ids(1), np.array([100]), [_ids(100)])
    got = a.decode_run(_ids(1), 8)
    assert got is not None and len(got.other_pools) == 1
    assert tuple(got.other_pools[0][-1]) == tuple(a.pool_counters()["swa"])


def test_decode_runs_with_the_early_swa_release_go_step_by_step() -> None:
    """With SGLANG_OPT_RELEASE_PREFILL_SWA a lock's SWA part is released between decode
    steps, which a run does not model: the run is refused and nothing changes."""
    a = KvAllocator(AllocatorConfig(
        pool_tokens=4096, page_size=16, max_running=8, max_context_len=1024,
        swa=SwaConfig(window=32, eviction_interval=4, release_prefill_swa=True),
    ))
    a.extend(_ids(1), np.array([160]), [_ids(160)])
    a.end_step()
    before = a.pool_counters()
    assert a.decode_run(_ids(1), 8) is None
    assert a.pool_counters() == before


# ---------------------------------------------------------------------------- random walks


@pytest.mark.parametrize("ps", [1, 16, 64])
@pytest.mark.parametrize("spec", [None, SpecConfig(num_steps=3, num_draft_tokens=4)])
def test_random_ops_keep_both_pools_sound(ps: int, spec: SpecConfig | None) -> None:
    """Extends (chunked), decodes or spec steps, preallocs and releases of every kind, at
    random on small pools (OutOfMemory included): every invariant of both pools holds
    after each call."""
    rng = np.random.default_rng(ps)
    a = _swa(ps, window=48, interval=4, pool=3072, swa_pool=1536, spec=spec)
    live: dict[int, int] = {}  # rid -> prompt length (prefilled)
    prefilling: dict[int, int] = {}  # rid -> prompt length
    next_rid = 0
    for _ in range(120):
        op = rng.integers(0, 5)
        if op == 0 and len(live) + len(prefilling) < 6:
            n = int(rng.integers(20, 300))
            chunk = int(rng.integers(10, n + 1))
            done = chunk == n
            res = a.extend(np.array([next_rid]), np.array([chunk]), [_ids(n)], prefill_done=np.array([done]))
            if not isinstance(res, OutOfMemory):
                (live if done else prefilling)[next_rid] = n
            next_rid += 1
        elif op == 1 and prefilling:
            rid = next(iter(prefilling))
            n = prefilling[rid]
            res = a.extend(np.array([rid]), np.array([n]), [_ids(n)])
            if not isinstance(res, OutOfMemory):
                live[rid] = prefilling.pop(rid)
        elif op == 2 and live:
            rids = np.array(sorted(live))
            for _ in range(int(rng.integers(1, 30))):
                if spec is None:
                    res = a.decode(rids)
                else:
                    res = a.spec_decode(rids, rng.integers(1, 5, size=rids.shape[0]))
                if isinstance(res, OutOfMemory):
                    break
        elif op == 3 and len(live) + len(prefilling) < 6:
            n = int(rng.integers(20, 300))
            res = a.prealloc(np.array([next_rid]), np.array([n]), [_ids(n)])
            if not isinstance(res, OutOfMemory):
                live[next_rid] = n
            next_rid += 1
        elif op == 4 and live:
            rid = int(rng.choice(sorted(live)))
            kind = ("finish", "retract", "abort")[int(rng.integers(0, 3))]
            committed = int(a.request_lens(np.array([rid])).committed[0])
            a.release(np.array([rid]), np.array([committed]), None, kind)  # type: ignore[arg-type]
            del live[rid]
        a.end_step()
        assert a.check_integrity() == [], (op, a.check_integrity())
        _conserved(a)
    assert max(a.req_kv.swa_evicted_seqlen) > 0 or not live


def test_state_digest_and_checkpoints_cover_the_swa_pool() -> None:
    """Two states that differ only in the SWA pool digest differently; a checkpoint
    restores the SWA cursors and free list."""
    a = _swa(16, window=32, interval=4)
    a.extend(_ids(1), np.array([100]), [_ids(100)])
    _decode(a, _ids(1), 1)
    state = a.save_state()
    before = a.state_digest()
    counters = a.pool_counters()
    _decode(a, _ids(1), 40)
    a.restore_state(state)
    assert a.pool_counters() == counters and a.state_digest() == before
    a.token_to_kv_pool_allocator.swa_attn_allocator.alloc(16)  # the SWA pool alone changes
    assert a.state_digest() != before


def test_the_memory_estimate_counts_the_swa_pool() -> None:
    from allocator.sizing import pool_memory

    config = AllocatorConfig(pool_tokens=1 << 16, page_size=16, max_running=32, max_context_len=4096,
                             radix_cache=False)
    hybrid = AllocatorConfig(pool_tokens=1 << 16, page_size=16, max_running=32, max_context_len=4096,
                             radix_cache=False, swa=SwaConfig(window=128))
    a = KvAllocator(hybrid)
    tok = a.token_to_kv_pool_allocator
    built = (tok.full_attn_allocator._free._buf.nbytes + tok.swa_attn_allocator._free._buf.nbytes
             + tok.full_to_swa_index_mapping.nbytes)
    assert pool_memory(config).free_lists < built <= pool_memory(hybrid).free_lists
