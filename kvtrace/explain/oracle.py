"""Oracles: the same admissions under an infinite cache, LRU and Belady's optimal eviction.

A page model of the prefix cache: every admission looks up the pages of its match key
(counted: its hit is the run of leading pages present) and then holds them all; every
published prompt and finished sequence inserts its pages (not counted). A page is the
prefix hash of its key up to its end, so a page present means its whole prefix is.
The model's capacity is the whole pool (``pool_tokens // page_tokens`` pages: the
requests' own pages are not subtracted), the same for each policy, so the figures
compare policies, not the replay's exact schedule:

- ``infinite``: nothing is ever evicted;
- ``lru``: the least recently used page goes first;
- ``belady``: the page whose next use lies farthest in the future goes first (offline,
  over the trace's future); for paging this is optimal, so it is never below LRU.

Ties go to the deeper page (a page's prefix is used whenever it is), which keeps every
policy's cache closed under prefixes. ``page_tokens`` may be a multiple of the replay's
page size (one-token pages would cost one Python step per token); the report says which.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from kvtrace.explain.distributions import Histogram
from traces.namespaces import key_prefix

__all__ = ["OracleResult", "OracleStream", "simulate"]

_LEN_MIX = np.uint64(0xD6E8FEB86659FD93)


class OracleResult(NamedTuple):
    """Tokens reused by each policy over the stream's admissions (``admitted_tokens`` the denominator)."""

    page_tokens: int
    capacity_pages: int
    admitted_tokens: int
    infinite_tokens: int
    lru_tokens: int
    belady_tokens: int | None  # None: not computed


@dataclass
class OracleStream:
    """The admissions and inserts of one replay, as page ids, in order.

    Args:
        page_tokens: units per model page.
    """

    page_tokens: int
    steps: list[int] = field(default_factory=list)
    pages: list[np.ndarray] = field(default_factory=list)  # uint64 [n] prefix hashes per event
    targets: list[int] = field(default_factory=list)  # admitted tokens; -1: an insert
    _weights: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))

    def _page_ids(self, key: np.ndarray) -> np.ndarray:
        g = self.page_tokens
        n = (key.shape[0] // g) * g
        if n == 0:
            return np.zeros(0, np.uint64)
        if self._weights.shape[0] < n:
            rng = np.random.default_rng(0x6B76)
            size = max(n, 2 * self._weights.shape[0], 4096)
            self._weights = rng.integers(0, 2**63, size=size, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        units = np.ascontiguousarray(key[:n], np.int64).view(np.uint64)
        sums = np.cumsum(units * self._weights[:n], dtype=np.uint64)[g - 1 :: g]
        ids = sums ^ (np.arange(1, sums.shape[0] + 1, dtype=np.uint64) * _LEN_MIX)
        ns = key_prefix(key)
        if ns:  # a cache namespace's pages are its own (as the replay's radix keys)
            ids ^= np.uint64(int.from_bytes(hashlib.blake2b(ns, digest_size=8).digest(), "little"))
        return ids

    def access(self, step: int, key_full: np.ndarray, seq_len: int, target: int, hit: int, is_eagle: bool) -> None:
        """An admission: look up its match key (SGLang's cap: ``seq_len - 1`` tokens)."""
        del hit
        units = max(min(key_full.shape[0], seq_len - 1 - (1 if is_eagle else 0)), 0)
        self.steps.append(step)
        self.pages.append(self._page_ids(key_full[:units]))
        self.targets.append(target)

    def insert(self, key: np.ndarray) -> None:
        """A prompt or a finished sequence enters the cache."""
        self.steps.append(self.steps[-1] if self.steps else 0)
        self.pages.append(self._page_ids(key))
        self.targets.append(-1)


def _leading(cache: dict[int, object] | OrderedDict[int, None], ids: list[int]) -> int:
    """Leading pages of ``ids`` present in ``cache`` (the admission's hit, in pages)."""
    n = 0
    for p in ids:
        if p not in cache:
            break
        n += 1
    return n


def simulate(stream: OracleStream, pool_tokens: int, belady: bool = True) -> tuple[OracleResult, dict[str, Histogram]]:
    """Run the stream under each policy; return the tokens each reuses, and the infinite
    cache's distributions (age at hit, reuse distance in steps; reuse count per page)."""
    g = stream.page_tokens
    cap = max(pool_tokens // g, 0)
    admitted = sum(t for t in stream.targets if t > 0)
    pages = [p.tolist() for p in stream.pages]

    # infinite, with the distributions
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    reuse: dict[int, int] = {}
    age_at_hit = Histogram("age at hit", "steps")
    distance = Histogram("reuse distance", "steps")
    inf_tokens = 0
    for step, ids, target in zip(stream.steps, pages, stream.targets):
        if target >= 0:
            n = 0
            for p in ids:
                if p not in first:
                    break
                n += 1
                age_at_hit.add(step - first[p])
                distance.add(step - last[p])
                reuse[p] = reuse.get(p, 0) + 1
            inf_tokens += n * g
        for p in ids:
            first.setdefault(p, step)
            last[p] = step
    reuse_count = Histogram("reuse count", "hits per page")
    for p in first:
        reuse_count.add(reuse.get(p, 0))

    # LRU: touch deepest first, so a page's prefix is always more recent than it
    lru: OrderedDict[int, None] = OrderedDict()
    lru_tokens = 0
    for ids, target in zip(pages, stream.targets):
        if target >= 0:
            lru_tokens += _leading(lru, ids) * g
        for p in reversed(ids):
            lru[p] = None
            lru.move_to_end(p)
        while len(lru) > cap:
            lru.popitem(last=False)

    belady_tokens = _belady(pages, stream.targets, cap) * g if belady else None
    result = OracleResult(g, cap, admitted, inf_tokens, lru_tokens, belady_tokens)
    return result, {"age_at_hit": age_at_hit, "reuse_distance": distance, "reuse_count": reuse_count}


def _belady(pages: list[list[int]], targets: list[int], cap: int) -> int:
    """Pages reused under Belady's MIN: evict the page used again farthest ahead
    (the deeper of two used by the same event)."""
    never = len(pages) + 1
    next_use: list[list[int]] = [[] for _ in pages]
    upcoming: dict[int, int] = {}
    for e in range(len(pages) - 1, -1, -1):
        ids = pages[e]
        next_use[e] = [upcoming.get(p, never) for p in ids]
        for p in ids:
            upcoming[p] = e
    cache: dict[int, tuple[int, int]] = {}  # page -> (next use, depth)
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, page), lazily invalidated
    hits = 0
    for e, (ids, target) in enumerate(zip(pages, targets)):
        if target >= 0:
            hits += _leading(cache, ids)
        for depth, (p, nxt) in enumerate(zip(ids, next_use[e])):
            key = (nxt, depth)
            cache[p] = key
            heapq.heappush(heap, (-nxt, -depth, p))
        while len(cache) > cap:
            neg_next, neg_depth, p = heapq.heappop(heap)
            if cache.get(p) == (-neg_next, -neg_depth):
                del cache[p]
    return hits
