"""What the dashboard reads of a hybrid SWA model's requests and SWA pool: each request's
SWA cursor (``swa_evicted_seqlen``) in the snapshots, their blocks, the screen's update
frames and the per-request fold; and the SWA pool's slot map (``swa_slot_ownership``),
whose counts are the pool's counters."""

from __future__ import annotations

import numpy as np
import pytest

from allocator.base import AllocatorConfig, OutOfMemory, SwaConfig
from allocator.manager import KvAllocator
from allocator.ownership import SlotState
from kvtrace.replay.engine import ReplayOptions
from kvtrace.replay.session import ReplaySession
from kvtrace.replay.snapshot import SnapshotBlock
from kvtrace.replay.state import ReplayState
from kvtrace.tui.remote.updates import decode_update, encode_update

SWA = "sample:mooncake-gpt-oss"
STEPS = 60  # the window has slid past some requests' first tokens by then


def _snaps(trace: str, n: int, runs: bool = True) -> tuple[list, ReplaySession]:  # noqa: ANN401
    session = ReplaySession(trace, track_state=True, options=ReplayOptions(decode_runs=runs))
    snaps = []
    for _ in range(n):
        snap = session.step()
        assert snap is not None
        snaps.append(snap)
    return snaps, session


def test_snapshots_of_an_swa_replay_carry_each_requests_swa_cursor() -> None:
    # step by step, so that the allocator is at the last snapshot's step
    snaps, session = _snaps(SWA, STEPS, runs=False)
    with session:
        alloc = session.allocator
        last = snaps[-1]
        assert last.swa_evicted is not None and last.swa_evicted.shape == last.requests.rids.shape
        rows = alloc._rows_of(last.requests.rids)
        want = np.where(rows >= 0, alloc.req_kv.swa_evicted_seqlen[np.maximum(rows, 0)], 0)
        assert np.array_equal(last.swa_evicted, want)
        assert np.array_equal(alloc.swa_evicted_lens(last.requests.rids), want)
        assert any(int(s.swa_evicted.max(initial=0)) > 0 for s in snaps), "the window never slid"
        # the fold keeps it per request, step by step and block by block alike
        one, blocked = ReplayState(16), ReplayState(16)
        for s in snaps:
            one.apply(s)
        blocked.apply_block(SnapshotBlock.of(snaps[:25]))
        blocked.apply_block(SnapshotBlock.of(snaps[25:]))
        assert one.swa_lengths and blocked.swa_lengths
        assert np.array_equal(one.column("swa_evicted"), blocked.column("swa_evicted"))
        rid = int(np.argmax(one.column("swa_evicted")))
        row = one.row(rid)
        assert row.swa_evicted == int(one.column("swa_evicted")[rid]) > 0
        assert row.swa_len == row.allocated - row.swa_evicted


def test_runs_of_decode_steps_carry_the_swa_cursors_of_each_step() -> None:
    """A run's snapshots have each step's cursors, as the steps one by one have them
    (the window slides inside the sample's runs)."""
    stepwise, session = _snaps(SWA, STEPS, runs=False)
    session.close()
    with_runs, session = _snaps(SWA, STEPS)
    session.close()
    assert [s.step for s in with_runs] == [s.step for s in stepwise]
    for a, b in zip(with_runs, stepwise):
        assert a.swa_evicted is not None and b.swa_evicted is not None
        assert np.array_equal(a.swa_evicted, b.swa_evicted), a.step


def test_an_update_frame_carries_the_swa_cursors_and_a_full_attention_one_does_not() -> None:
    snaps, session = _snaps(SWA, 20)
    session.close()
    block = SnapshotBlock.of(snaps)
    assert block.swa_evicted is not None and block.swa_evicted.shape == block.requests.rids.shape
    back = decode_update(bytearray(encode_update(block)))
    assert np.array_equal(back.swa_evicted, block.swa_evicted)
    assert np.array_equal(back.requests.rids, block.requests.rids)
    full, session = _snaps("sample:tiny", 5)
    session.close()
    assert all(s.swa_evicted is None for s in full)
    plain = SnapshotBlock.of(full)
    body = encode_update(plain)
    assert plain.swa_evicted is None and body[:4] == b"KVU1"  # the frame a full-attention replay always sent
    assert decode_update(bytearray(body)).swa_evicted is None
    state = ReplayState(1)
    state.apply_block(plain)
    assert not state.swa_lengths and state.row(int(plain.requests.rids[0])).swa_evicted is None


def _swa_allocator(ps: int, radix: bool) -> KvAllocator:
    return KvAllocator(AllocatorConfig(
        pool_tokens=4096, page_size=ps, max_running=8, max_context_len=2048, radix_cache=radix,
        swa=SwaConfig(window=64, swa_pool_tokens=1024, eviction_interval=4),
    ))


def _assert_map_is_the_counters(a: KvAllocator) -> None:
    own = a.swa_slot_ownership()
    assert own is not None
    n = own.token_counts()
    swa = a.pool_counters()["swa"]
    assert n[SlotState.UNOWNED] == 0 and int(own.holders.max()) <= 1
    assert n[SlotState.FREE] == swa.available
    assert n[SlotState.CACHED_EVICTABLE] == swa.evictable and n[SlotState.CACHED_LOCKED] == swa.protected
    assert n[SlotState.COMMITTED] == swa.committed
    assert own.state.shape[0] == (a.swa_pool_tokens // a.page_size + 1) * a.page_size
    live = a.live_rids()
    owned = set(np.unique(own.owner[own.owner >= 0]).tolist())
    assert owned <= set(live.tolist())


@pytest.mark.parametrize("radix", [False, True], ids=["radix-off", "radix-on"])
@pytest.mark.parametrize("ps", [1, 16])
def test_the_swa_pool_map_counts_what_the_swa_pool_counters_say(ps: int, radix: bool) -> None:
    #   admit (a shared prefix when the radix cache is on), decode past the window, finish:
    #   free, the requests' own slots and the tree's slots add up to the SWA pool.
    a = _swa_allocator(ps, radix)
    rng = np.random.default_rng(ps)
    base = rng.integers(0, 1000, 300)
    live: dict[int, list[int]] = {}
    saw_cached = saw_freed = False
    for rid in range(12):
        toks = np.concatenate([base[: int(rng.integers(0, 200))], rng.integers(0, 1000, int(rng.integers(20, 120)))])
        if not isinstance(a.extend(np.array([rid]), np.array([len(toks)]), [toks]), OutOfMemory):
            live[rid] = toks.tolist()
        a.end_step()
        _assert_map_is_the_counters(a)
        for _ in range(int(rng.integers(5, 40))):
            if isinstance(a.decode(np.array(sorted(live))), OutOfMemory):
                break
            for r in live:
                live[r].append(int(rng.integers(0, 1000)))
            a.end_step()
        _assert_map_is_the_counters(a)
        saw_freed |= int(a.swa_evicted_lens(np.array(sorted(live))).max(initial=0)) > 0
        if len(live) > 3:
            r = sorted(live)[0]
            committed = int(a.request_lens(np.array([r])).committed[0])
            how = "finish" if radix else "abort"
            a.release(np.array([r]), np.array([committed]),
                      [np.array(live[r][:committed], np.int64)] if radix else None, how)  # type: ignore[arg-type]
            del live[r]
            a.end_step()
            _assert_map_is_the_counters(a)
        saw_cached |= a.pool_counters()["swa"].evictable > 0
    assert saw_freed, "no request's window ever slid"
    assert saw_cached == radix


def test_a_full_attention_allocator_has_no_swa_map_and_no_swa_cursors() -> None:
    a = KvAllocator(AllocatorConfig(pool_tokens=1024, page_size=1))
    a.extend(np.array([0]), np.array([10]), [np.arange(10)])
    assert a.swa_slot_ownership() is None
    assert a.swa_evicted_lens(np.array([0, 5])).tolist() == [0, 0]
