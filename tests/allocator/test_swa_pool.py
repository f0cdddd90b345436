"""The SWA pool allocator (``allocator.swa``) against a simple reference model.

The model (``Model``) knows only page counts per pool and, per request, its length
and the range ``[swa_lo, swa_hi)`` whose SWA side is gone. From them it predicts
whether each allocation fits and how many pages every call takes or returns;
hypothesis drives random op sequences at pages 1, 16 and 64, with and without
``need_sort``, and after every op ``check`` asserts:

* conservation per pool: free (and staged) + held (+ pages an out-of-memory
  ``alloc_decode`` left taken, see below) == total, outside free groups;
* the mapping: every held full slot maps to a held SWA slot, or to 0 where its
  SWA side was freed; no SWA slot is mapped twice; nothing else is mapped; paged,
  a slot's in-page offset is the same in both pools and a full page maps into one
  SWA page;
* an out-of-memory ``alloc`` / ``alloc_extend`` / ``alloc_extend_swa_tail`` changes
  nothing (free lists and mapping compared whole).

SGLang's ``alloc_decode`` has no capacity check: when one pool is short the other's
new pages stay taken. ``test_alloc_decode_oom_keeps_the_other_pools_pages`` pins that
behaviour; the model counts those pages as leaked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from allocator.swa import SWATokenToKVPoolAllocator


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Req:
    row: list[int] = field(default_factory=list)
    swa_lo: int = 0
    swa_hi: int = 0


@dataclass
class Model:
    """Page counts per pool; frees inside a group are pending until its end."""

    full_free: int
    swa_free: int
    leaked_full: int = 0
    leaked_swa: int = 0
    pending_full: int = 0
    pending_swa: int = 0
    in_group: bool = False

    def give(self, full: int, swa: int) -> None:
        if self.in_group:
            self.pending_full += full
            self.pending_swa += swa
        else:
            self.full_free += full
            self.swa_free += swa


def _snapshot(a: SWATokenToKVPoolAllocator) -> tuple:
    full, swa = a.get_all_free_pages()
    return (
        a.full_free_pages_np().tolist(),
        a.swa_free_pages_np().tolist(),
        full.tolist(),
        swa.tolist(),
        a.full_to_swa_index_mapping.tolist(),
    )


def check(a: SWATokenToKVPoolAllocator, m: Model, reqs: dict[int, Req]) -> None:
    ps = a.page_size
    mapping = a.full_to_swa_index_mapping
    assert mapping[-1] == -1
    full_free, swa_free = a.get_all_free_pages()
    assert len(set(full_free.tolist())) == len(full_free), "a full page is free twice"
    assert len(set(swa_free.tolist())) == len(swa_free), "an SWA page is free twice"
    # What the model predicts of the allocator's counters.
    assert len(full_free) == m.full_free and len(swa_free) == m.swa_free
    assert a.full_available_size() == m.full_free * ps and a.swa_available_size() == m.swa_free * ps
    assert a.available_size() == min(m.full_free, m.swa_free) * ps

    held_full: set[int] = set()
    mapped_full: list[int] = []
    for q in reqs.values():
        row = np.array(q.row, dtype=np.int64)
        held_full.update((row // ps).tolist())
        dead = np.zeros(len(row), dtype=bool)
        dead[q.swa_lo : q.swa_hi] = True
        assert (mapping[row[dead]] == 0).all(), "an SWA-freed slot is still mapped"
        assert (mapping[row[~dead]] > 0).all(), "a held slot with live SWA is unmapped"
        mapped_full += row[~dead].tolist()
    assert sorted(mapped_full) == a.mapped_full_slots().tolist(), "a slot outside every row is mapped"
    swa_slots = mapping[np.array(mapped_full, dtype=np.int64)]
    assert len(set(swa_slots.tolist())) == len(swa_slots), "an SWA slot is mapped twice"
    if ps > 1 and mapped_full:
        full_arr = np.array(mapped_full, dtype=np.int64)
        assert ((swa_slots % ps) == (full_arr % ps)).all(), "in-page offsets differ between the pools"
        pairs = set(zip((full_arr // ps).tolist(), (swa_slots // ps).tolist()))
        assert len(pairs) == len({f for f, _ in pairs}), "a full page maps into two SWA pages"
    held_swa = set((swa_slots // ps).tolist())
    assert not held_full & set(full_free.tolist()), "a held full page is on the free list"
    assert not held_swa & set(swa_free.tolist()), "a held SWA page is on the free list"
    if not m.in_group:
        num_full, num_swa = a.size_full // ps, a.size_swa // ps
        assert len(full_free) + len(held_full) + m.leaked_full == num_full, "full pool: free + held != total"
        assert len(swa_free) + len(held_swa) + m.leaked_swa == num_swa, "SWA pool: free + held != total"


OPS = st.lists(
    st.tuples(
        st.sampled_from(["extend", "decode", "tail", "window", "release", "free", "group"]),
        st.integers(0, 10**6),
        st.integers(1, 200),
        st.booleans(),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ps=st.sampled_from([1, 16, 64]),
    need_sort=st.booleans(),
    full_pages=st.integers(2, 24),
    swa_pages=st.integers(2, 24),
    ops=OPS,
)
def test_swa_pool_matches_the_reference_model(
    ps: int, need_sort: bool, full_pages: int, swa_pages: int, ops: list[tuple[str, int, int, bool]]
) -> None:
    a = SWATokenToKVPoolAllocator(full_pages * ps, swa_pages * ps, ps, need_sort)
    m = Model(full_pages, swa_pages)
    reqs: dict[int, Req] = {}
    next_rid = 0
    for kind, pick, n, flag in ops:
        live = sorted(reqs)
        growable = [r for r in live if reqs[r].swa_hi < len(reqs[r].row)]
        before = _snapshot(a)
        if kind == "extend":
            if flag and growable:
                rid = growable[pick % len(growable)]
            else:
                rid, next_rid = next_rid, next_rid + 1
            q = reqs.get(rid, Req())
            length = len(q.row)
            need = _cdiv(length + n, ps) - _cdiv(length, ps)
            fits = need <= m.full_free and need <= m.swa_free
            if ps == 1:
                out = a.alloc(n)
            else:
                last = q.row[-1] if q.row else -1
                out = a.alloc_extend(np.array([length]), np.array([length + n]), np.array([last]))
            assert (out is not None) == fits
            if out is None:
                assert _snapshot(a) == before, "an out-of-memory extend changed the state"
            else:
                q.row += out.tolist()
                reqs[rid] = q
                m.full_free -= need
                m.swa_free -= need
        elif kind == "decode" and growable:
            rids = [r for i, r in enumerate(growable) if (pick >> i) & 1] or growable[:1]
            need = sum(len(reqs[r].row) % ps == 0 for r in rids)
            if ps == 1:
                out = a.alloc(len(rids))
                fits = need <= m.full_free and need <= m.swa_free
                assert (out is not None) == fits
                if out is None:
                    assert _snapshot(a) == before, "an out-of-memory alloc changed the state"
            else:
                seq = np.array([len(reqs[r].row) + 1 for r in rids])
                last = np.array([reqs[r].row[-1] for r in rids])
                out = a.alloc_decode(seq, last)
                full_fits, swa_fits = need <= m.full_free, need <= m.swa_free
                assert (out is not None) == (full_fits and swa_fits)
                if out is None:  # the pool that fitted keeps its new pages taken
                    m.full_free -= need if full_fits else 0
                    m.leaked_full += need if full_fits else 0
                    m.swa_free -= need if swa_fits else 0
                    m.leaked_swa += need if swa_fits else 0
            if out is not None:
                for r, x in zip(rids, out.tolist()):
                    reqs[r].row.append(x)
                m.full_free -= need
                m.swa_free -= need
        elif kind == "tail" and ps > 1:
            head = (pick % (n + 1)) // ps * ps
            tail = n - head
            full_need, swa_need = _cdiv(n, ps), _cdiv(tail, ps)
            out = a.alloc_extend_swa_tail(np.array([0]), np.array([n]), np.array([-1]), n, tail)
            assert (out is not None) == (full_need <= m.full_free and swa_need <= m.swa_free)
            if out is None:
                assert _snapshot(a) == before, "an out-of-memory SWA-tail allocation changed the state"
            else:
                reqs[next_rid] = Req(out.tolist(), 0, head)
                next_rid += 1
                m.full_free -= full_need
                m.swa_free -= swa_need
        elif kind == "window" and live:
            q = reqs[live[pick % len(live)]]
            top = (len(q.row) - 1) // ps * ps  # never the page of the last token
            lo = q.swa_hi if q.swa_hi > q.swa_lo else (pick // 7 % (top + 1)) // ps * ps
            if lo < top:
                hi = lo + ps * (1 + pick // 3 % ((top - lo) // ps))
                slots = np.array(q.row[lo:hi], dtype=np.int64)
                if flag:
                    a.free_swa_segment(slots, start_pos=lo)
                else:
                    a.free_swa(slots)
                q.swa_lo, q.swa_hi = (q.swa_lo, hi) if q.swa_hi > q.swa_lo else (lo, hi)
                m.give(0, (hi - lo) // ps)
        elif kind in ("release", "free") and live:
            rid = live[pick % len(live)]
            q = reqs[rid]
            if kind == "free" and q.swa_hi > q.swa_lo:
                continue  # a plain free needs the whole row mapped
            del reqs[rid]
            row = np.array(q.row, dtype=np.int64)
            pages = _cdiv(len(row), ps)
            if kind == "free":
                a.free(row)
            else:
                a.free_full_segments([(row[q.swa_lo : q.swa_hi], q.swa_lo)])
                a.free_segments([(row[: q.swa_lo], 0), (row[q.swa_hi :], q.swa_hi)])
            m.give(pages, pages - (q.swa_hi - q.swa_lo) // ps)
        elif kind == "group":
            if m.in_group:
                a.free_group_end()
                m.in_group = False
                m.give(m.pending_full, m.pending_swa)
                m.pending_full = m.pending_swa = 0
            else:
                a.free_group_begin()
                m.in_group = True
        check(a, m, reqs)
    if m.in_group:
        a.free_group_end()
        m.in_group = False
        m.give(m.pending_full, m.pending_swa)
        check(a, m, reqs)


def test_alloc_decode_oom_keeps_the_other_pools_pages() -> None:
    """SGLang's alloc_decode allocates each pool on its own: the SWA pool short, the
    full pool's new page stays taken and nothing is mapped."""
    ps = 16
    a = SWATokenToKVPoolAllocator(4 * ps, 1 * ps, ps)
    out = a.alloc_extend(np.array([0]), np.array([ps]), np.array([-1]))
    assert out is not None and a.swa_available_size() == 0
    assert a.alloc_decode(np.array([ps + 1]), out[-1:].astype(np.int64)) is None
    assert a.full_free_pages_np().tolist() == [3, 4]  # page 2 taken by the failed decode
    assert a.mapped_full_slots().tolist() == out.tolist()


@pytest.mark.parametrize("ps", [16, 64])
def test_alloc_decode_continues_the_swa_page_through_the_mapping(ps: int) -> None:
    """last_loc is a full slot; the SWA side continues from its mapped SWA slot."""
    a = SWATokenToKVPoolAllocator(8 * ps, 8 * ps, ps)
    a.swa_attn_allocator.alloc(2 * ps)  # the pools' page ids now differ
    out = a.alloc_extend(np.array([0]), np.array([3]), np.array([-1]))
    assert out is not None
    nxt = a.alloc_decode(np.array([4]), out[-1:].astype(np.int64))
    assert nxt is not None
    assert int(nxt[0]) == int(out[-1]) + 1
    assert int(a.full_to_swa_index_mapping[nxt[0]]) == int(a.full_to_swa_index_mapping[out[-1]]) + 1 == 3 * ps + 3


def test_swa_tail_maps_only_the_tail() -> None:
    ps = 16
    a = SWATokenToKVPoolAllocator(8 * ps, 8 * ps, ps)
    out = a.alloc_extend_swa_tail(np.array([0]), np.array([40]), np.array([-1]), 40, 8)
    assert out is not None
    mapping = a.full_to_swa_index_mapping
    assert (mapping[out[:32]] == 0).all()
    assert mapping[out[32:]].tolist() == list(range(ps, ps + 8))  # a fresh SWA page, from its first slot
    assert a.full_available_size() == 5 * ps and a.swa_available_size() == 7 * ps


def test_swa_tail_clears_a_stale_head_mapping() -> None:
    """The head's mapping is cleared, not assumed clear: a full-only free leaves the
    mapping as it was (SGLang only warns), and the tail allocation then reuses the page."""
    ps = 16
    a = SWATokenToKVPoolAllocator(1 * ps, 4 * ps, ps)
    out = a.alloc_extend(np.array([0]), np.array([ps]), np.array([-1]))
    assert out is not None
    a.free_full(out.astype(np.int64))  # SWA side left mapped
    assert a.mapped_full_slots().tolist() == out.tolist()
    again = a.alloc_extend_swa_tail(np.array([0]), np.array([ps]), np.array([-1]), ps, 4)
    assert again is not None and again.tolist() == out.tolist()
    assert a.mapped_full_slots().tolist() == out[-4:].tolist()


def test_free_group_releases_swa_segments_then_swa_sets_then_full() -> None:
    """§11.8: at group end, SWA pages of segment frees (in call order) come before
    those of set-shaped free_swa calls; paged lists prepend each release."""
    ps = 16
    a = SWATokenToKVPoolAllocator(8 * ps, 8 * ps, ps)
    out = a.alloc_extend(np.array([0, 0]), np.array([3 * ps, 2 * ps]), np.array([-1, -1]))
    assert out is not None
    r0, r1 = out[: 3 * ps].astype(np.int64), out[3 * ps :].astype(np.int64)
    a.free_group_begin()
    a.free_swa(r1[:ps])  # SWA page 4
    a.free_swa_segment(r0[ps : 2 * ps], start_pos=ps)  # SWA page 2
    a.free_swa_segment(r0[:ps], start_pos=0)  # SWA page 1
    a.free(r1[ps:])  # SWA page 5, full page 5
    assert a.swa_free_pages_np().tolist() == [6, 7, 8]
    a.free_group_end()
    # segments [2, 1] prepended as one list, then the sets {4, 5} prepended before them
    assert a.swa_free_pages_np().tolist() == [4, 5, 2, 1, 6, 7, 8]
    assert a.full_free_pages_np().tolist() == [5, 6, 7, 8]


def test_clear_keeps_the_trailing_minus_one() -> None:
    a = SWATokenToKVPoolAllocator(8, 8, 1)
    out = a.alloc(5)
    assert out is not None
    a.clear()
    assert a.available_size() == 8 and a.mapped_full_slots().size == 0
    assert a.full_to_swa_index_mapping[-1] == -1
