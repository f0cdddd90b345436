"""``allocator.mamba``: properties against a reference model, and injected faults.

The state machine drives ``HybridReqToTokenPool`` in every buffer mode through
admissions (new, copy-on-write and continuing requests, inside and outside admission
groups), rejections, releases, checkpointed finishes, donations, tree evictions and
lazy tracking, beside ``RefModel``: a set per owner. After every step: the pool's
slots are where the model says (conservation, no slot held twice), an out-of-memory
changed nothing, and ``check_mamba`` finds nothing. The fault tests break one thing
each (a leaked slot, a slot freed twice, a slot shared, a stale mapping) and need
``check_mamba`` to name it with ``pool == "mamba"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from allocator.base import MambaConfig
from allocator.check.mamba_invariants import check_mamba
from allocator.mamba import HybridReqToTokenPool, MambaReqKv, MambaSlotAllocator, MambaSlotsExhausted

MODES = [("no_buffer", False), ("extra_buffer", False), ("extra_buffer", True), ("extra_buffer_lazy", True)]


@dataclass
class RefModel:
    """Which slots are unheld (free list or open group), each request's, the tree's."""

    size: int
    unheld: set[int] = field(default_factory=set)
    held: dict[int, set[int]] = field(default_factory=dict)
    tree: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.unheld = set(range(1, self.size + 1))

    def take(self, rid: int, slots: set[int]) -> None:
        assert slots <= self.unheld, f"rid={rid} took slots not free: {sorted(slots - self.unheld)}"
        self.unheld -= slots
        self.held.setdefault(rid, set()).update(slots)

    def give_back(self, slots: set[int]) -> None:
        assert not slots & self.unheld, f"freed twice: {sorted(slots & self.unheld)}"
        self.unheld |= slots


def _snapshot(pool: HybridReqToTokenPool, reqs: dict[int, MambaReqKv]) -> tuple:
    pp = pool.req_index_to_mamba_ping_pong_track_buffer_mapping
    return (
        pool.mamba_allocator.free_slots.tolist(),
        pool.mamba_allocator.group_remaining(),
        list(pool.free_slots),
        pool.req_index_to_mamba_index_mapping.tolist(),
        None if pp is None else pp.tolist(),
        {rid: (q.req_pool_idx, tuple(q.held_slots()), q.next_track_idx, q.last_track_idx) for rid, q in reqs.items()},
    )


class MambaPoolMachine(RuleBasedStateMachine):
    pool: HybridReqToTokenPool
    ref: RefModel

    @initialize(mode=st.sampled_from(MODES), rows=st.integers(1, 6), size=st.integers(1, 16))
    def setup(self, mode: tuple[str, bool], rows: int, size: int) -> None:
        strategy, overlap = mode
        self.pool = HybridReqToTokenPool(rows, 4, MambaConfig(size, strategy, overlap))  # type: ignore[arg-type]
        self.ref = RefModel(size)
        self.reqs: dict[int, MambaReqKv] = {}
        self.tree: list[int] = []
        self.next_rid = 0
        self.extra = strategy != "no_buffer"
        self.lazy = strategy == "extra_buffer_lazy"

    def _new(self) -> MambaReqKv:
        req = MambaReqKv(self.next_rid)
        self.next_rid += 1
        return req

    def _sync(self, req: MambaReqKv) -> None:
        """The model takes what the request now holds beyond what it held."""
        now = set(req.held_slots())
        before = self.ref.held.get(req.rid, set())
        self.ref.give_back(before - now)
        self.ref.held[req.rid] = before & now
        self.ref.take(req.rid, now - before)

    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        old = [q for q in self.reqs.values()]
        chosen = data.draw(st.lists(st.sampled_from(old), unique_by=lambda q: q.rid, max_size=2)) if old else []
        batch = chosen + [self._new() for _ in range(data.draw(st.integers(0, 3)))]
        if not batch:
            return
        before = _snapshot(self.pool, self.reqs)
        rows_needed = sum(not q.holds_kv for q in batch)
        slots_needed = self.pool.mamba_slots_needed(batch)
        try:
            rows = self.pool.alloc_reqs(batch)
        except MambaSlotsExhausted:
            assert slots_needed > len(self.ref.unheld) or slots_needed > self.pool.mamba_available_size()
            assert _snapshot(self.pool, self.reqs) == before
            return
        if rows is None:
            assert rows_needed > self.pool.available_size()
            assert _snapshot(self.pool, self.reqs) == before
            return
        assert len(set(rows)) == len(rows) == len(batch)
        for q in batch:
            self.reqs[q.rid] = q
            had = len(self.ref.held.get(q.rid, ()))
            self._sync(q)
            assert q.holds_kv and q.holds_mamba
            assert len(self.ref.held[q.rid]) - had <= 1 + self.pool.mamba_initial_tracking_slots

    @rule()
    def cow(self) -> None:
        req = self._new()
        before = _snapshot(self.pool, self.reqs)
        if self.pool.alloc_state_slot(req):
            self.reqs[req.rid] = req
            self._sync(req)
        else:
            assert not self.ref.unheld
            assert _snapshot(self.pool, self.reqs) == before

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if not self.reqs:
            return
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        req = self.reqs.pop(rid)
        self.pool.release(req)
        assert not req.holds_kv and not req.holds_mamba and not req.held_slots()
        self._sync(req)

    @rule(data=st.data())
    def finish_checkpointed(self, data: st.DataObject) -> None:
        cands = [q for q in self.reqs.values() if q.holds_kv and q.holds_mamba]
        if self.extra:
            cands = [q for q in cands if not all(q.ping_pong_empty)]  # type: ignore[arg-type]
        if not cands:
            return
        req = data.draw(st.sampled_from(cands))
        keep = None
        if self.extra:
            keep = data.draw(st.sampled_from([i for i, e in enumerate(req.ping_pong_empty) if not e]))  # type: ignore[arg-type]
        held = set(req.held_slots())
        slot = self.pool.release_checkpointed(req, keep)
        del self.reqs[req.rid]
        assert slot in held and not req.held_slots()
        self.ref.held[req.rid] = set()
        self.ref.give_back(held - {slot})
        self.ref.tree.add(slot)
        self.tree.append(slot)

    @precondition(lambda self: self.extra)
    @rule(data=st.data())
    def donate(self, data: st.DataObject) -> None:
        cands = [q for q in self.reqs.values() if q.ping_pong is not None and not q.ping_pong_empty[q.last_track_idx]]  # type: ignore[index]
        if not cands:
            return
        req = data.draw(st.sampled_from(cands))
        new = self.pool.mamba_allocator.alloc(1)
        if new is None:
            assert not self.pool.mamba_available_size()
            return
        self.ref.unheld.discard(int(new[0]))
        self.ref.held[req.rid].add(int(new[0]))
        donated = self.pool.donate_mamba_ping_pong_slot(req, int(new[0]))
        self.ref.held[req.rid].discard(donated)
        self.ref.tree.add(donated)
        self.tree.append(donated)
        assert set(req.held_slots()) == self.ref.held[req.rid]

    @rule(data=st.data())
    def tree_evict(self, data: st.DataObject) -> None:
        if not self.tree:
            return
        slot = self.tree.pop(data.draw(st.integers(0, len(self.tree) - 1)))
        self.pool.mamba_allocator.free(np.asarray([slot]))
        self.ref.tree.discard(slot)
        self.ref.give_back({slot})

    @precondition(lambda self: self.lazy)
    @rule(data=st.data(), step=st.sampled_from(["pre", "post", "undo"]))
    def lazy_track(self, data: st.DataObject, step: str) -> None:
        cands = [q for q in self.reqs.values() if q.ping_pong is not None]
        if step == "undo":
            cands = [q for q in cands if not any(q.ping_pong_empty)]  # type: ignore[arg-type]
        if step == "post":
            cands = [q for q in cands if not all(q.ping_pong_empty)]  # type: ignore[arg-type]
        if not cands:
            return
        req = data.draw(st.sampled_from(cands))
        if step == "pre":
            self.pool.lazy_prealloc_at_boundary(req)
        elif step == "post":
            track = data.draw(st.sampled_from([i for i, e in enumerate(req.ping_pong_empty) if not e]))  # type: ignore[arg-type]
            self.pool.lazy_post_decode_at_boundary(req, track)
        else:
            self.pool.lazy_undo_prealloc_at_boundary(req)
        self._sync(req)
        assert 1 <= len(req.held_slots()) <= 3

    @rule(n=st.integers(0, 5))
    def group(self, n: int) -> None:
        if self.pool.mamba_allocator.is_group_open():
            self.pool.mamba_allocator.alloc_group_end()
        else:
            self.pool.mamba_allocator.alloc_group_begin(n)

    @invariant()
    def slots_where_the_model_says(self) -> None:
        if not hasattr(self, "pool"):
            return
        a = self.pool.mamba_allocator
        free = a.free_slots.tolist() + a.group_remaining()
        assert len(free) == len(set(free)), "a slot free twice"
        assert set(free) == self.ref.unheld
        for rid, q in self.reqs.items():
            assert set(q.held_slots()) == self.ref.held.get(rid, set()), rid
        assert set(self.tree) == self.ref.tree
        # conservation, and no slot in two places
        owned = [s for q in self.reqs.values() for s in q.held_slots()] + self.tree + free
        assert sorted(owned) == list(range(1, self.ref.size + 1))
        assert check_mamba(self.pool, self.reqs.values(), self.tree) == []


MambaPoolMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None, derandomize=True, database=None
)
TestMambaPool = MambaPoolMachine.TestCase


# ---------------------------------------------------------------------------- unit


def test_slot_allocator_order_and_group() -> None:
    """Head-first alloc, tail-append free; a group pre-takes, hands out to alloc(1)
    only, and gives the rest back appended."""
    a = MambaSlotAllocator(6)
    assert a.alloc(2).tolist() == [1, 2]
    a.free(np.asarray([1]))
    assert a.free_slots.tolist() == [3, 4, 5, 6, 1]
    a.alloc_group_begin(3)
    assert a.available_size() == 2 and a.group_remaining() == [3, 4, 5]
    assert a.alloc(1).tolist() == [3]
    assert a.alloc(2).tolist() == [6, 1]  # alloc(n > 1) takes the free list
    a.alloc_group_end()
    assert a.free_slots.tolist() == [4, 5] and not a.is_group_open()
    a.alloc_group_begin(5)  # more than free: no group, alloc falls through
    assert a.group_remaining() == [] and not a.is_group_open()
    assert a.alloc(3) is None and a.free_slots.tolist() == [4, 5]


@pytest.mark.parametrize(("strategy", "overlap", "tracking", "pp_size"), [
    ("no_buffer", False, 0, 1),
    ("extra_buffer", False, 1, 1),
    ("extra_buffer", True, 2, 2),
    ("extra_buffer_lazy", True, 1, 2),
])
def test_admission_takes_state_and_tracking_slots(strategy: str, overlap: bool, tracking: int, pp_size: int) -> None:
    pool = HybridReqToTokenPool(4, 4, MambaConfig(12, strategy, overlap))  # type: ignore[arg-type]
    a, b = MambaReqKv(0), MambaReqKv(1)
    assert pool.alloc_state_slot(b)  # b's slot came from the radix match
    assert pool.alloc_reqs([a, b]) == [3, 4]
    assert a.mamba_pool_idx == 2 and b.mamba_pool_idx == 1
    assert pool.mamba_available_size() == 12 - 2 - 2 * tracking
    assert pool.req_index_to_mamba_index_mapping[[3, 4]].tolist() == [2, 1]
    if tracking:
        assert a.ping_pong is not None and a.ping_pong.shape == (pp_size,)
        assert a.ping_pong_empty == [False] * tracking + [True] * (pp_size - tracking)
    # a continuing chunk keeps row and slots
    held = a.held_slots()
    assert pool.alloc_reqs([a]) == [3] and a.held_slots() == held
    pool.release(a)
    pool.release(b)
    assert pool.mamba_available_size() == 12 and sorted(pool.free_slots) == [1, 2, 3, 4]


def test_out_of_memory_changes_nothing() -> None:
    pool = HybridReqToTokenPool(2, 4, MambaConfig(5, "extra_buffer", True))
    a = MambaReqKv(0)
    pool.alloc_reqs([a])  # 3 slots
    before = _snapshot(pool, {0: a})
    with pytest.raises(MambaSlotsExhausted, match="3 slots needed"):
        pool.alloc_reqs([MambaReqKv(1)])
    assert _snapshot(pool, {0: a}) == before
    assert pool.alloc_reqs([MambaReqKv(2), MambaReqKv(3)]) is None  # one row left
    assert _snapshot(pool, {0: a}) == before


def test_config_sizing_matches_sglang() -> None:
    """Tracking slots and the slots-per-request ratio of SGLang's sizing."""
    assert MambaConfig(30).slots_per_request() == 3
    assert MambaConfig(30).slots_per_request(radix_cache=False) == 1
    assert MambaConfig(30, "extra_buffer", True).slots_per_request() == 5
    assert MambaConfig(30, "extra_buffer", False).slots_per_request() == 4
    assert MambaConfig(30, "extra_buffer_lazy", True).slots_per_request() == 4
    assert MambaConfig(30, skip_decode_lock=True).slots_per_request() == 3
    assert MambaConfig(30, "extra_buffer", True, skip_decode_lock=True).slots_per_request() == 4
    assert MambaConfig(30, "extra_buffer", True).max_running_cap() == 6
    for bad, msg in [
        (MambaConfig(0), "slots"),
        (MambaConfig(4, "extra_buffer_lazy", False), "overlap"),
        (MambaConfig(4, "no_buffer", True), "overlap"),
    ]:
        with pytest.raises(ValueError, match=msg):
            bad.check()
    with pytest.raises(ValueError, match="page size 1"):
        MambaConfig(4).check(page_size=16)


# ---------------------------------------------------------------------------- faults


def _running(strategy: str = "extra_buffer", overlap: bool = True) -> tuple[HybridReqToTokenPool, list[MambaReqKv]]:
    pool = HybridReqToTokenPool(4, 4, MambaConfig(16, strategy, overlap))  # type: ignore[arg-type]
    reqs = [MambaReqKv(0), MambaReqKv(1), MambaReqKv(2)]
    pool.alloc_reqs(reqs)
    assert check_mamba(pool, reqs) == []
    return pool, reqs


def _checks(violations: list) -> set[str]:
    assert all(v.pool == "mamba" for v in violations)
    return {v.check for v in violations}


def test_fault_leaked_slot() -> None:
    """A release that forgets the tracking slots: they are nobody's and not free."""
    pool, reqs = _running()
    gone = reqs.pop(1)
    leaked = gone.held_slots()[1:]
    pool.mamba_allocator.free(np.asarray([gone.mamba_pool_idx]))  # the state slot only
    pool.free_req(gone)
    violations = check_mamba(pool, reqs)
    assert _checks(violations) == {"conservation", "leak"}
    leak = next(v for v in violations if v.check == "leak")
    assert leak.values["count"] == len(leaked) and str(leaked[0]) in leak.detail


def test_fault_slot_freed_twice() -> None:
    pool, reqs = _running("no_buffer", False)
    gone = reqs.pop(0)
    slot = gone.mamba_pool_idx
    pool.release(gone)
    pool.mamba_allocator.free(np.asarray([slot]))  # a second path frees it again
    violations = check_mamba(pool, reqs)
    assert _checks(violations) == {"conservation", "double_free"}
    assert next(v for v in violations if v.check == "double_free").values["slot"] == slot
    with pytest.raises(ValueError, match="double free"):
        pool.free_mamba_cache(gone)


def test_fault_slot_held_by_two_requests() -> None:
    """A state reused across requests: the second request is given the first's slot."""
    pool, reqs = _running("no_buffer", False)
    pool.mamba_allocator.free(np.asarray([reqs[1].mamba_pool_idx]))
    reqs[1].mamba_pool_idx = reqs[0].mamba_pool_idx
    pool.req_index_to_mamba_index_mapping[reqs[1].req_pool_idx] = reqs[0].mamba_pool_idx
    violations = check_mamba(pool, reqs)
    assert _checks(violations) == {"conservation", "ownership"}  # counted twice among the held
    owned = next(v for v in violations if v.check == "ownership")
    assert owned.rid == 0 and "[0, 1]" in owned.detail


def test_fault_slot_both_free_and_tree() -> None:
    pool, reqs = _running()
    slot = pool.release_checkpointed(reqs.pop(0), keep=1)
    pool.mamba_allocator.free(np.asarray([slot]))  # evicted without leaving the tree
    assert "ownership" in _checks(check_mamba(pool, reqs, [slot]))


def test_reopened_group_leaks_as_sglang_and_is_caught() -> None:
    """SGLang's alloc_group_begin drops a group still open, with its unused slots;
    ours mirrors it, and check_mamba reports those slots as leaked."""
    pool, reqs = _running("no_buffer", False)
    pool.mamba_allocator.alloc_group_begin(2)
    dropped = pool.mamba_allocator.group_remaining()
    pool.mamba_allocator.alloc_group_begin(1)
    violations = check_mamba(pool, reqs)
    assert _checks(violations) == {"conservation", "leak"}
    assert next(v for v in violations if v.check == "leak").values == {"slot": dropped[0], "count": 2}


def test_fault_stale_mapping_and_tracking_flag() -> None:
    pool, reqs = _running()
    pool.req_index_to_mamba_index_mapping[reqs[2].req_pool_idx] = 0
    assert reqs[0].ping_pong_empty is not None
    reqs[0].ping_pong_empty[1] = True
    violations = check_mamba(pool, reqs)
    assert {(v.check, v.rid) for v in violations} >= {("mapping", 2), ("tracking", 0)}
