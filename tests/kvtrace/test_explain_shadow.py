"""The explain shadow: exact seen lengths at any page size, memory by pages computed."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from kvtrace.explain.shadow import Shadow


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    k = min(a.shape[0], b.shape[0])
    neq = a[:k] != b[:k]
    return int(neq.argmax()) if neq.any() else k


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_seen_len_is_the_longest_common_prefix(page_size: int) -> None:
    # Random sequences over a tiny alphabet share prefixes of every length, ending
    # mid-page, at page boundaries and in partial last pages.
    rng = np.random.default_rng(page_size)
    shadow = Shadow(page_size)
    inserted: list[np.ndarray] = []
    for _ in range(300):
        j = int(rng.integers(len(inserted))) if inserted and rng.random() < 0.8 else -1
        base = inserted[j] if j >= 0 else np.zeros(0, np.int64)
        cut = int(rng.integers(0, base.shape[0] + 1))
        seq = np.concatenate([base[:cut], rng.integers(0, 3, int(rng.integers(0, 40)))]).astype(np.int64)
        want = max((_lcp(seq, s) for s in inserted), default=0)
        assert shadow.seen_len(seq.tobytes()) == want
        # a request's next chunk: the prefix it inserted before is followed on trust
        shadow.insert(seq, known=cut if j >= 0 and rng.random() < 0.5 else 0)
        inserted.append(seq)


def test_marks_and_reads_whole_pages() -> None:
    shadow = Shadow(4)
    a = np.arange(12, dtype=np.int64)
    shadow.insert(a)
    shadow.insert(np.concatenate([a[:8], [99, 98, 97, 96]]))  # splits after two pages
    shadow.mark(a.tobytes(), 1, 3, 7)
    assert shadow.recs(a.tobytes(), 0, 3).tolist() == [0, 7, 7]
    assert shadow.recs(np.concatenate([a[:8], [99, 98, 97, 96]]).tobytes(), 0, 3).tolist() == [0, 7, 0]
    assert shadow.recs(np.arange(100, 112, dtype=np.int64).tobytes(), 0, 3).tolist() == [0, 0, 0]


def test_memory_is_eight_bytes_a_unit_computed() -> None:
    # A RadixCache shadow held 12 bytes a unit (key and eviction id) plus its bookkeeping;
    # pages never evicted hold no eviction ids at all.
    seqs = [np.random.default_rng(i).integers(0, 1 << 40, 20_000).astype(np.int64) for i in range(20)]
    tracemalloc.start()
    shadow = Shadow(1)
    for s in seqs:
        shadow.insert(s)
    used, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    units = sum(s.shape[0] for s in seqs)
    assert shadow.num_units == units
    assert used < 8.5 * units


def test_eviction_ids_survive_marks_and_splits() -> None:
    # Run-length coded ids against a dense copy, through overlapping marks and splits.
    rng = np.random.default_rng(3)
    ps = 2
    base = rng.integers(0, 1 << 40, 400).astype(np.int64)
    shadow = Shadow(ps)
    shadow.insert(base)
    dense = np.zeros(200, np.int32)
    for rec in range(1, 200):
        if rng.random() < 0.3:  # a branch splits a node somewhere
            cut = int(rng.integers(1, 200)) * ps
            shadow.insert(np.concatenate([base[:cut], rng.integers(0, 1 << 40, 6)]).astype(np.int64))
        lo = int(rng.integers(0, 200))
        hi = int(rng.integers(lo + 1, 201))
        shadow.mark(base.tobytes(), lo, hi, rec)
        dense[lo:hi] = rec
        a = int(rng.integers(0, 200))
        b = int(rng.integers(a + 1, 201))
        assert shadow.recs(base.tobytes(), a, b).tolist() == dense[a:b].tolist()


def test_token_ids_take_four_bytes_a_unit() -> None:
    # Token ids fit an int32: the shadow stores them narrow (a page of units at page size
    # 1 is one token id, and the shadow holds every token computed).
    seqs = [np.random.default_rng(i).integers(0, 1 << 31, 20_000).astype(np.int64) for i in range(20)]
    tracemalloc.start()
    shadow = Shadow(1)
    for s in seqs:
        shadow.insert(s)
    used, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert shadow.unit_bytes == 4
    assert used < 4.5 * sum(s.shape[0] for s in seqs)


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_wide_unit_widens_the_tree_and_every_length_stays_exact(page_size: int) -> None:
    # Narrow sequences first (reads of wide keys match up to their first wide unit), then
    # one wide unit: the tree converts itself; seen lengths and eviction ids stay exact.
    rng = np.random.default_rng(7)
    shadow = Shadow(page_size)
    base = rng.integers(0, 50, 48).astype(np.int64)
    seqs = [np.concatenate([base[: 4 * k], rng.integers(0, 50, 9)]).astype(np.int64) for k in range(12)]
    for s in seqs[:6]:
        shadow.insert(s)
    shadow.mark(base.tobytes(), 1, 2, 5)
    wide = np.concatenate([base[:20], [1 << 40], base[21:30]]).astype(np.int64)
    assert shadow.seen_len(wide.tobytes()) == max(_lcp(wide, s) for s in seqs[:6])
    assert shadow.unit_bytes == 4
    for s in [*seqs[6:], wide]:
        shadow.insert(s)
    assert shadow.unit_bytes == 8
    for q in [*seqs, wide, base]:
        assert shadow.seen_len(q.tobytes()) == max(_lcp(q, s) for s in [*seqs, wide])
    assert shadow.recs(base.tobytes(), 0, 3).tolist() == [0, 5, 0]
