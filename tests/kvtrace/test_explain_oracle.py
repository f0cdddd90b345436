"""The explain oracles (``kvtrace.explain.oracle``): Belady's MIN is never below LRU and
the infinite cache never below Belady, on random small streams of prefix lookups."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrace.explain.oracle import OracleStream, simulate

# a few shared prompt stems; a request takes a stem's first tokens then its own
STEMS = [np.arange(1000 * s, 1000 * s + 64, dtype=np.int64) for s in range(4)]

events = st.lists(
    st.tuples(st.booleans(), st.integers(0, 3), st.integers(0, 64), st.integers(0, 8), st.integers(0, 10**6)),
    min_size=1, max_size=40,
)


def _stream(page_tokens: int, evs: list[tuple[bool, int, int, int, int]]) -> OracleStream:
    stream = OracleStream(page_tokens)
    for step, (lookup, stem, shared, own, salt) in enumerate(evs):
        key = np.concatenate([STEMS[stem][:shared], np.arange(salt, salt + own, dtype=np.int64) + 10**7])
        if lookup:
            stream.access(step, key, key.shape[0] + 1, key.shape[0] + 1, 0, False)
        else:
            stream.insert(key)
    return stream


@settings(max_examples=150, deadline=None)
@given(evs=events, page_tokens=st.sampled_from([1, 4, 16]), pool_pages=st.integers(0, 24))
def test_belady_is_at_least_lru_and_infinite_at_least_belady(
    evs: list[tuple[bool, int, int, int, int]], page_tokens: int, pool_pages: int
) -> None:
    result, _ = simulate(_stream(page_tokens, evs), pool_pages * page_tokens)
    assert result.belady_tokens is not None
    assert result.infinite_tokens >= result.belady_tokens >= result.lru_tokens, result


def test_a_pool_holding_everything_makes_every_policy_infinite() -> None:
    evs = [(i % 2 == 0, i % 4, 40, 3, i) for i in range(30)]
    result, hists = simulate(_stream(4, evs), 10**6)
    assert result.lru_tokens == result.belady_tokens == result.infinite_tokens > 0
    assert hists["age_at_hit"].total == hists["reuse_distance"].total > 0


def test_belady_beats_lru_on_a_loop_one_page_too_long() -> None:
    # Three one-page prompts looked up in a loop through a two-page cache: LRU always
    # evicts the one needed next (no hit); MIN keeps one of them.
    keys = [np.arange(10 * k, 10 * k + 4, dtype=np.int64) for k in range(3)]
    stream = OracleStream(4)
    for step in range(12):
        key = keys[step % 3]
        stream.access(step, key, 5, 5, 0, False)
    result, _ = simulate(stream, 8)
    assert result.lru_tokens == 0 and result.belady_tokens > 0
