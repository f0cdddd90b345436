"""Page ownership: hand-built maps drawn slot by slot, the screen reduction, one
request's slots, and the per-state counts equal to counters() on random sequences.

Maps are drawn one letter per slot, pages separated by spaces, page 0 first::

    R reserved   F free   C committed   O over-allocated   T page tail
    E cached, evictable   L cached, locked   U held by nobody (leaked)
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant, run_state_machine_as_test

from allocator import AllocatorConfig, SpecConfig, create_allocator
from allocator.ownership import NUM_STATES, SlotState, cell_pages, reduce_cells, request_slots
from tests.allocator.test_state_machine import _machine, machine_config

_LETTER = {
    SlotState.FREE: "F",
    SlotState.COMMITTED: "C",
    SlotState.OVERALLOCATED: "O",
    SlotState.PAGE_TAIL: "T",
    SlotState.CACHED_EVICTABLE: "E",
    SlotState.CACHED_LOCKED: "L",
    SlotState.RESERVED: "R",
    SlotState.UNOWNED: "U",
}
EAGLE = SpecConfig("eagle", 3, 1, 4)  # reserves 8 positions past the committed length at page 4


def _a(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _draw(state: np.ndarray, page_size: int) -> str:
    letters = "".join(_LETTER[SlotState(int(s))] for s in state)
    return " ".join(letters[i : i + page_size] for i in range(0, len(letters), page_size))


def _paged() -> object:
    return create_allocator(AllocatorConfig(pool_tokens=32, page_size=4, max_running=4, max_context_len=64, spec=EAGLE))


TOKENS = np.arange(100, 200, dtype=np.int64)


def test_paged_request_prefix_own_kv_and_page_tail() -> None:
    alloc = _paged()
    alloc.extend(_a(0), _a(10), [TOKENS[:10]])  # pages 1, 2, 3; the prompt is published at once
    own = alloc.slot_ownership()
    # [0, 8) went to the tree (locked by rid 0), [8, 10) is its own, page 3's last two slots pad
    assert _draw(own.state, 4) == "RRRR LLLL LLLL CCTT FFFF FFFF FFFF FFFF FFFF"
    assert own.owner.tolist() == [-1] * 12 + [0] * 4 + [-1] * 20
    assert own.holders.tolist() == [0] + [1] * 8


def test_paged_speculative_slack() -> None:
    alloc = _paged()
    alloc.extend(_a(0), _a(10), [TOKENS[:10]])
    alloc.spec_decode(_a(0), _a(2))  # committed 12, reserved up to ceil_align(12 + 8) = 20
    own = alloc.slot_ownership()
    assert _draw(own.state, 4) == "RRRR LLLL LLLL CCCC OOOO OOOO FFFF FFFF FFFF"
    assert set(own.owner[12:24].tolist()) == {0}


def test_paged_finish_leaves_evictable_cache_and_a_new_request_locks_it() -> None:
    alloc = create_allocator(AllocatorConfig(pool_tokens=32, page_size=4, max_running=4, max_context_len=64))
    alloc.extend(_a(0), _a(10), [TOKENS[:10]])
    alloc.release(_a(0), _a(10), [TOKENS[:10]], "finish")  # [0, 8) stays cached, page 3 is freed
    own = alloc.slot_ownership()
    assert _draw(own.state, 4) == "RRRR EEEE EEEE FFFF FFFF FFFF FFFF FFFF FFFF"
    # rid 1 shares the first 8 tokens: it locks them and takes page 3 (freed last, reused first)
    alloc.extend(_a(1), _a(9), [np.concatenate([TOKENS[:8], _a(7)])])
    own = alloc.slot_ownership()
    assert _draw(own.state, 4) == "RRRR LLLL LLLL CTTT FFFF FFFF FFFF FFFF FFFF"
    assert own.owner[12:16].tolist() == [1, 1, 1, 1]
    slots = request_slots(alloc, 1)
    assert slots.prefix.tolist() == list(range(4, 12))
    assert slots.own.tolist() == [12, 13, 14, 15]  # position 8 and its page's tail


def test_page1_map_and_a_leak() -> None:
    alloc = create_allocator(AllocatorConfig(pool_tokens=8, page_size=1, max_running=2, max_context_len=16,
                                             radix_cache=False))
    alloc.extend(_a(5), _a(3), [TOKENS[:3]])
    alloc.decode(_a(5))
    own = alloc.slot_ownership()
    assert _draw(own.state, 1) == "R C C C C F F F F"
    assert own.owner.tolist() == [-1, 5, 5, 5, 5, -1, -1, -1, -1]
    alloc.token_to_kv_pool_allocator.alloc(2)  # taken behind everyone's back
    own = alloc.slot_ownership()
    assert _draw(own.state, 1) == "R C C C C U U F F"
    assert own.holders.tolist() == [0, 1, 1, 1, 1, 0, 0, 1, 1]


def test_cells_shrink_the_pool_and_list_their_pages() -> None:
    alloc = _paged()
    alloc.extend(_a(0), _a(10), [TOKENS[:10]])
    alloc.spec_decode(_a(0), _a(2))
    own = alloc.slot_ownership()
    # RRRR LLLL LLLL | CCCC OOOO OOOO | FFFF FFFF FFFF
    cells = reduce_cells(own, 3)
    assert cells.edges.tolist() == [0, 12, 24, 36]
    counts = {SlotState(s).name: int(n) for s, n in enumerate(cells.tokens[0]) if n}
    assert counts == {"RESERVED": 4, "CACHED_LOCKED": 8}
    assert [SlotState(int(s)).name for s in cells.dominant] == ["CACHED_LOCKED", "OVERALLOCATED", "FREE"]
    assert cells.tokens.sum() == 36 and cells.tokens.shape == (3, NUM_STATES)
    pages = cell_pages(own, cells, 1)
    assert pages.pages.tolist() == [3, 4, 5] and pages.owner.tolist() == [0, 0, 0]
    assert [SlotState(int(s)).name for s in pages.state] == ["COMMITTED", "OVERALLOCATED", "OVERALLOCATED"]
    # more cells than pages: one cell per page
    assert reduce_cells(own, 1000).edges.tolist() == list(range(0, 37, 4))
    with pytest.raises(IndexError):
        cell_pages(own, cells, 3)
    with pytest.raises(ValueError):
        reduce_cells(own, 0)


def test_a_request_holding_nothing_has_no_slots() -> None:
    alloc = _paged()
    slots = request_slots(alloc, 42)
    assert slots.prefix.tolist() == [] and slots.own.tolist() == []


# ---------------------------------------------------------------------------- property


@pytest.mark.parametrize(
    ("page_size", "spec"),
    [pytest.param(1, None, id="page1"), pytest.param(16, EAGLE, id="page16-eagle"),
     pytest.param(64, SpecConfig("standalone", 3, 1, 4), id="page64-standalone")],
)
def test_state_counts_equal_counters_on_random_sequences(page_size: int, spec: SpecConfig | None) -> None:
    config = machine_config(page_size, spec)

    class Machine(_machine(config)):  # type: ignore[misc]
        @invariant()
        def ownership_counts_are_the_counters(self) -> None:
            own = self.alloc.slot_ownership()
            n = own.token_counts()
            c = self.alloc.counters()
            assert n[SlotState.FREE] == c.available
            assert n[SlotState.CACHED_EVICTABLE] == c.evictable
            assert n[SlotState.CACHED_LOCKED] == c.protected
            assert n[SlotState.COMMITTED] == c.committed
            assert n[SlotState.OVERALLOCATED] + n[SlotState.PAGE_TAIL] == c.overallocated
            assert n[SlotState.UNOWNED] == 0 and n[SlotState.RESERVED] == page_size
            assert (own.holders[1:] == 1).all()
            live = set(self.alloc.live_rids().tolist())
            assert set(np.unique(own.owner[own.owner >= 0]).tolist()) <= live

    run_state_machine_as_test(
        Machine,
        settings=settings(
            max_examples=12,
            stateful_step_count=40,
            deadline=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
