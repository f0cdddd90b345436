"""The search: delta debugging over requests, steps, rows, lengths and the pool.

Starting from the trace cut after the failing step, each phase proposes smaller
candidates and keeps the first that still fails the same way:

1. requests: the blamed request alone, the requests alive at the failure, then
   delta debugging over whole requests (each with all of its rows);
2. steps: delta debugging over the steps (every removable row of a step goes);
3. rows: delta debugging over single units (a decode, a prefill chunk, a release,
   a retraction with its re-admission): shorter outputs, fewer chunks;
4. lengths: shorter prefill chunks and pre-allocations, first by whole pages (so
   every later op crosses page boundaries where it did), then by single tokens;
   speculative rows keep their drafts and acceptances;
5. pool: the fewest request rows and the narrowest rows the trace needs, then the
   smallest KV pool that still fails.

An out-of-memory candidate with fewer requests is judged at the pool that just
fails to hold it (``kvtrace.shrink.oracle``), so removing requests and shrinking
the pool go together. The phases repeat until none makes progress, the deadline
passes, or Ctrl-C.

Delta debugging here removes one of n chunks of the units at a time, from n = 2,
and doubles n when no removal reproduces (Zeller's ddmin on complements).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import numpy as np

from allocator.pages import ceil_align
from kvtrace.shrink.oracle import Failure, Outcome
from kvtrace.shrink.runner import Runner
from kvtrace.shrink.table import Candidate, Size, TraceTable, build
from traces.schema import ABORT, FINISH

__all__ = ["PHASES", "Search"]

PHASES = ("requests", "steps", "rows", "lengths", "pool")


@dataclass
class Search:
    """Shrinks ``best`` (a candidate of ``table`` known to fail) in place.

    Args:
        table: the rows of the input up to the failure.
        runner: judges candidates.
        failure: the failure found on the input (its request guides the first guesses).
        page_size: the page size the versions replay with.
        best: the candidate to start from (it must fail).
        on_change: called with the phase name whenever the best candidate or phase changes.
    """

    table: TraceTable
    runner: Runner
    failure: Failure
    page_size: int
    best: Candidate
    on_change: Callable[[str], None] | None = None
    phase: str = "start"

    def __post_init__(self) -> None:
        self.size = self.table.size(self.best)

    # ------------------------------------------------------------------ driving
    def run(self) -> None:
        """Run the phases until none makes progress (``OutOfTime`` and Ctrl-C propagate;
        ``best`` is always a candidate known to fail)."""
        phases = {"requests": self._requests, "steps": self._steps, "rows": self._rows,
                  "lengths": self._lengths, "pool": self._pool}
        self._enter("pool")
        self._tighten()  # narrow rows and few of them: every later candidate starts faster
        while True:
            progressed = False
            for name in PHASES:
                self._enter(name)
                progressed |= phases[name]()
            if not progressed:
                return

    def _enter(self, phase: str) -> None:
        self.phase = phase
        if self.on_change is not None:
            self.on_change(phase)

    def _try(self, candidates: Iterator[Candidate]) -> bool:
        """Judge candidates smaller than the best, keep the first that reproduces."""
        hit = self.runner.first_success(c for c in candidates if self.table.size(c) < self.size)
        if hit is None:
            return False
        self._accept(*hit)
        return True

    def _accept(self, cand: Candidate, outcome: Outcome) -> None:
        if outcome.pool_tokens is not None:
            cand = replace(cand, pool_tokens=outcome.pool_tokens)
        self.best, self.size = cand, self.table.size(cand)
        if outcome.step is not None:
            # the failure came earlier than the candidate's end: try without what follows it
            steps = self.table.steps_of(cand)
            if 0 <= outcome.step < steps.shape[0] - 1:
                trimmed = self.table.up_to_step(cand, int(steps[outcome.step]))
                hit = self.runner.first_success([trimmed])
                if hit is not None:
                    trimmed = replace(trimmed, pool_tokens=hit[1].pool_tokens or trimmed.pool_tokens)
                    self.best, self.size = trimmed, self.table.size(trimmed)
        if self.on_change is not None:
            self.on_change(self.phase)

    def _ddmin(self, units_of: Callable[[Candidate], np.ndarray],
               remove: Callable[[Candidate, np.ndarray], Candidate]) -> bool:
        """Delta debugging: remove chunks of 1/n of the units, n from 2 up to one unit a chunk."""
        progressed = False
        n = 2
        while True:
            units = units_of(self.best)
            if units.shape[0] == 0:
                return progressed
            n = min(n, units.shape[0])
            base = self.best
            if self._try(remove(base, chunk) for chunk in np.array_split(units, n)):
                progressed = True
                n = max(n - 1, 2)
                continue
            if n >= units.shape[0]:
                return progressed
            n = min(2 * n, units.shape[0])

    # ------------------------------------------------------------------ phases
    def _requests(self) -> bool:
        t = self.table
        rids = np.unique(t.rid[self.best.rows])
        if rids.shape[0] <= 1:
            return False
        guesses = []
        if self.failure.rid is not None and self.failure.rid in rids:
            guesses.append(np.array([self.failure.rid]))
        guesses.append(self._alive_at_end(self.best))
        progressed = self._try(t.without_requests(self.best, np.setdiff1d(rids, keep)) for keep in guesses)
        return self._ddmin(lambda c: np.unique(t.rid[c.rows]), t.without_requests) or progressed

    def _alive_at_end(self, cand: Candidate) -> np.ndarray:
        """Requests holding KV after the candidate's last step, or touched by it."""
        t = self.table
        rows = cand.rows
        rid = t.rid[rows]
        uniq, from_end = np.unique(rid[::-1], return_index=True)
        last = rows[rows.shape[0] - 1 - from_end]
        ended = np.isin(t.op[last], (FINISH, ABORT)) & (t.step[last] < t.step[rows[-1]])
        return uniq[~ended]

    def _steps(self) -> bool:
        t = self.table

        def units(c: Candidate) -> np.ndarray:
            return np.unique(t.step[c.rows][t.unit[c.rows] >= 0])

        def remove(c: Candidate, steps: np.ndarray) -> Candidate:
            rows = c.rows[np.isin(t.step[c.rows], steps)]
            return t.without_units(c, np.unique(t.unit[rows][t.unit[rows] >= 0]))

        return self._ddmin(units, remove)

    def _rows(self) -> bool:
        t = self.table
        return self._ddmin(lambda c: np.unique(t.unit[c.rows][t.unit[c.rows] >= 0]), t.without_units)

    def _lengths(self) -> bool:
        t = self.table
        ps = self.page_size
        progressed = False
        a = t.appends(self.best)
        shrinkable = t.shortenable[self.best.rows] & (a > 1)
        rows = self.best.rows[shrinkable]
        lengths = a[shrinkable]
        # every chunk at once, by whole pages
        least = (lengths - 1) % ps + 1
        if (least < lengths).any():
            at_once = replace(self.best, append={**self.best.append, **dict(zip(rows.tolist(), least.tolist()))})
            progressed |= self._try(iter([at_once]))
        for row in rows[np.argsort(-lengths, kind="stable")].tolist():
            while True:
                at = int(np.searchsorted(self.best.rows, row))
                if at >= self.best.rows.shape[0] or self.best.rows[at] != row:
                    break  # the row went with an earlier cut
                now = int(t.appends(self.best)[at])
                tries = (replace(self.best, append={**self.best.append, row: v}) for v in _shorter(now, ps))
                if not self._try(tries):
                    break
                progressed = True
        return progressed

    def _pool(self) -> bool:
        progressed = self._tighten()
        cfg = self.table.meta.config
        ps = self.page_size
        hi = self.best.pool_tokens or cfg.pool_tokens
        lo = ps  # a pool below two pages is refused: never reproduces
        while hi - lo > ps:
            step = (hi - lo) / (self.runner.jobs + 1)
            probes = sorted({int(ceil_align(int(lo + step * (i + 1)), ps)) for i in range(self.runner.jobs)})
            probes = [p for p in probes if lo < p < hi]
            if not probes:
                break
            cands = [replace(self.best, pool_tokens=p) for p in probes]
            outcomes = self.runner.each(cands)
            hit = next((i for i, o in enumerate(outcomes) if o.reproduced), None)
            if hit is None:
                lo = probes[-1]
                continue
            lo = probes[hit - 1] if hit > 0 else lo
            self._accept(cands[hit], outcomes[hit])
            hi = self.best.pool_tokens or probes[hit]  # an out-of-memory may have failed lower still
            progressed = True
        return progressed

    def _tighten(self) -> bool:
        """Try the fewest request rows and the narrowest rows the trace needs."""
        meta, steps = build(self.table, self.best)
        longest = max((int(b.seq_len.max()) for b in steps if len(b)), default=1)
        tight = replace(
            self.best,
            max_running=min(self.table.peak_running(self.best), meta.config.max_running),
            max_context_len=min(int(ceil_align(max(longest, 1), self.page_size)), meta.config.max_context_len),
        )
        if self.table.size(tight) >= self.size:
            return False
        return self._try(iter([tight]))


def _shorter(length: int, page_size: int) -> Iterator[int]:
    """Shorter lengths to try for a chunk of ``length`` tokens, boldest first: whole
    pages less (page crossings kept), then any length."""
    seen: set[int] = set()
    pages = (length - 1) // page_size
    k = pages
    while k >= 1:
        seen.add(length - k * page_size)
        yield length - k * page_size
        k //= 2
    for v in (1, length // 4, length // 2, length - 1):
        if 1 <= v < length and v not in seen:
            seen.add(v)
            yield v
