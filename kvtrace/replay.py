"""The replay engine: trace steps -> batched allocator calls -> one ``StepSnapshot`` per step.

Per step, in the trace's op order (``traces.schema.OP_ORDER``), the engine makes
one batched allocator call per op kind: releases (finish, abort, retract), then
prealloc, extend, decode, spec. It never trusts the trace: every step first goes
through ``traces.validate.OpSequenceChecker``; impossible ops stop the replay
(default) or are skipped and reported. Running out of KV slots is an outcome:
the first OOM is recorded with its step, request, need, free and evictable, and
the replay stops (``on_oom="stop"``) or drops the request that did not fit and
carries on (``on_oom="skip"``).

The radix cache is the replay's own: prefix hits are recomputed for the replay's
pool and page size, and admissions whose hit differs from the recorded one are
counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

from allocator.base import AllocResult, OutOfMemory
from kvtrace.config import allocator_config_for  # noqa: F401  (part of this module's API)
from kvtrace.errors import TraceError
from kvtrace.snapshot import Event, PoolSnapshot, RequestDelta, StepSnapshot
from traces.schema import (
    ABORT,
    DECODE,
    EXTEND,
    FINISH,
    OP_ORDER,
    OPS,
    PREALLOC,
    RETRACT,
    SPEC,
    StepBatch,
    TraceMeta,
)
from traces.tokens import TokenStore
from traces.validate import BackgroundChecker, OpSequenceChecker

if TYPE_CHECKING:
    from allocator.base import Allocator, ReleaseKind, ReleaseResult, Violation

CheckMode = Literal["every", "end", "never"]
OomMode = Literal["stop", "skip"]
BadOpMode = Literal["stop", "skip"]

MAX_VIOLATIONS_KEPT = 1000


@dataclass(frozen=True, slots=True)
class ReplayOptions:
    """How to replay.

    Args:
        check: run the invariant checker after every allocator call, at the end, or never.
        on_oom: stop at the first out-of-memory, or drop the request and go on.
        on_bad_op: stop at the first impossible op in the trace, or skip its rows.
        start_step: steps before this one are replayed (their state is needed) but
            produce no snapshots and no checks.
        stop_step: stop before this step (exclusive); None replays to the end.
    """

    check: CheckMode = "end"
    on_oom: OomMode = "stop"
    on_bad_op: BadOpMode = "stop"
    start_step: int | None = None
    stop_step: int | None = None


@dataclass(frozen=True, slots=True)
class OomRecord:
    step: int
    op: str
    rid: int
    needed: int
    free: int
    evictable: int


@dataclass(frozen=True, slots=True)
class ViolationRecord:
    step: int
    rid: int | None
    op: str
    check: str
    detail: str


@dataclass
class ReplayStats:
    """Running totals of a replay; ``ReplaySummary`` is built from them at the end."""

    steps: int = 0
    steps_reported: int = 0  # steps inside the --steps window (all steps without one)
    ops: int = 0
    first_time_s: float | None = None
    last_time_s: float = 0.0
    allocator_s: float = 0.0
    prefill_tokens: int = 0  # tokens computed by extend ops (after the replay's prefix hits)
    reused_tokens: int = 0  # prefix tokens the replay's radix cache supplied
    admitted_tokens: int = 0  # prompt tokens of admissions (the hit-rate denominator)
    admissions: int = 0
    prefix_differs: int = 0  # admissions whose replay hit differs from the recorded one
    decode_tokens: int = 0
    spec_accepted: int = 0
    evicted_tokens: int = 0
    overalloc_allocated: int = 0
    overalloc_released: int = 0
    peak_used_tokens: int = 0
    peak_step: int | None = None
    dropped_requests: int = 0
    skipped_ops: int = 0
    bad_ops: int = 0
    retractions: int = 0
    aborts: int = 0
    finishes: int = 0
    oom: OomRecord | None = None
    num_ooms: int = 0
    violations: list[ViolationRecord] = field(default_factory=list)
    num_violations: int = 0
    row_overflows: int = 0


class BadTraceOp(TraceError):
    """An op the trace cannot legally contain (stop mode)."""


class _Grow:
    """A numpy array indexed by request id that grows on demand."""

    def __init__(self, dtype: type, fill: int | bool) -> None:
        self.fill = fill
        self.a = np.full(1024, fill, dtype)

    def ensure(self, max_rid: int) -> None:
        if max_rid >= self.a.shape[0]:
            grown = np.full(max(max_rid + 1, 2 * self.a.shape[0]), self.fill, self.a.dtype)
            grown[: self.a.shape[0]] = self.a
            self.a = grown


class ReplayEngine:
    """Replays a trace through one allocator, one batched call per op kind per step.

    Args:
        steps: the trace's steps (``TraceReader.steps()``), consumed lazily.
        meta: the trace's metadata (checked op semantics, prompt lengths).
        allocator: the allocator version to drive.
        options: see ``ReplayOptions``.
        clock: the timer for allocator time (``time.perf_counter``; the cuda path
            synchronises inside the allocator where it must).
        checker: what screens each step (default: an ``OpSequenceChecker`` in this
            process; the CLI passes a ``BackgroundChecker`` running on another core).
    """

    def __init__(
        self,
        steps: Iterator[StepBatch],
        meta: TraceMeta,
        allocator: Allocator,
        options: ReplayOptions | None = None,
        clock: Callable[[], float] = time.perf_counter,
        checker: OpSequenceChecker | BackgroundChecker | None = None,
    ) -> None:
        self.meta = meta
        self.allocator = allocator
        self.options = options or ReplayOptions()
        self.stats = ReplayStats()
        self.stopped_early = False
        self._steps = steps
        self._clock = clock
        self._checker = checker if checker is not None else OpSequenceChecker(meta)
        self._tokens = TokenStore(meta.block_size)
        self._page_size = allocator.config.page_size
        # Per-request state of the replay (indexed by rid).
        self._seen = _Grow(np.bool_, False)
        self._dropped = _Grow(np.bool_, False)
        self._prefill_target = _Grow(np.int64, 0)  # length at which prefill is done
        self._events: list[Event] = []
        self._step = -1
        self._op_name = ""
        self._quiet = False  # fast-forward before start_step: no snapshots, no checks

    @property
    def num_requests(self) -> int:
        """Distinct requests seen so far."""
        return int(self._seen.a.sum())

    # ------------------------------------------------------------------ driving
    def snapshots(self) -> Iterator[StepSnapshot]:
        """Replay step by step, yielding a snapshot after each (from ``start_step``)."""
        opts = self.options
        for batch in self._steps:
            if opts.stop_step is not None and batch.step >= opts.stop_step:
                break
            self._quiet = opts.start_step is not None and batch.step < opts.start_step
            snap = self._replay_step(batch)
            if snap is not None and not self._quiet:
                self.stats.steps_reported += 1
                yield snap
            if self.stopped_early:
                return
        if opts.check != "never":
            self._check("end", None)

    def run(self, on_snapshot: Callable[[StepSnapshot], None] | None = None) -> ReplayStats:
        """Replay to the end (or the first stop) and return the totals."""
        for snap in self.snapshots():
            if on_snapshot is not None:
                on_snapshot(snap)
        return self.stats

    # ------------------------------------------------------------------ one step
    def _replay_step(self, batch: StepBatch) -> StepSnapshot | None:
        st = self.stats
        self._step = batch.step
        self._events = []
        alloc_s_before = st.allocator_s
        n = len(batch)
        ok = self._screen(batch)
        if ok is not None:  # skip mode: rows the checker refused never reach the replay
            batch, ok = batch.take(np.flatnonzero(ok)), None
        if len(batch):  # request ids are screened: below the trace's bound
            max_rid = int(batch.rid.max())
            for arr in (self._seen, self._dropped, self._prefill_target):
                arr.ensure(max_rid)
        present = np.bincount(batch.op, minlength=len(OPS)) if len(batch) else np.zeros(len(OPS), np.int64)
        if present[EXTEND] or present[PREALLOC]:
            self._tokens.ingest(batch)
            self._remember_prompts(batch, ok)
        elif batch.token_ids.values.shape[0]:
            self._tokens.ingest(batch)  # explicit ids of decoded tokens
        # Most steps hold one op kind and no bad row: then every row is that kind's.
        whole = ok is None and int(np.count_nonzero(present)) == 1
        touched: list[np.ndarray] = []
        for op in OP_ORDER:
            if not present[op]:
                continue
            if whole:
                rows = np.arange(len(batch))
            else:
                mask = batch.op == op
                rows = np.flatnonzero(mask if ok is None else mask & ok)
                if rows.size == 0:
                    continue
            if self.stats.dropped_requests:
                rows = rows[~self._dropped.a[batch.rid[rows]]]
                if rows.size == 0:
                    continue
            self._op_name = OPS[op]
            self._apply(op, batch, rows)
            touched.append(batch.rid[rows])
            if self.stopped_early:
                break
        end_step = getattr(self.allocator, "end_step", None)
        if end_step is not None and not self.stopped_early:
            t0 = self._clock()
            end_step()
            st.allocator_s += self._clock() - t0
        st.steps += 1
        st.ops += n
        if np.isfinite(batch.time_s):  # a NaN or infinite time is a problem the checker reported
            if st.first_time_s is None:
                st.first_time_s = batch.time_s
            st.last_time_s = batch.time_s
        counters = self.allocator.counters()
        pool = PoolSnapshot(*counters)
        used = pool.used_tokens
        if used > st.peak_used_tokens or st.peak_step is None:
            st.peak_used_tokens = used
            st.peak_step = batch.step
        # A request has one row per step (the checker skips duplicates), so no unique().
        rids = (touched[0] if len(touched) == 1 else np.concatenate(touched)) if touched else None
        if rids is not None:
            lens = self.allocator.request_lens(rids)
            delta = RequestDelta(rids, lens.allocated, lens.committed, lens.protected)
        else:
            delta = RequestDelta.empty()
        return StepSnapshot(
            step=batch.step,
            time_s=batch.time_s,
            pool=pool,
            requests=delta,
            events=tuple(self._events),
            num_ops=n,
            allocator_s=st.allocator_s - alloc_s_before,
        )

    def _screen(self, batch: StepBatch) -> np.ndarray | None:
        """Run the op-sequence checker; return the mask of rows safe to apply (None: all)."""
        problems = self._checker.check(batch)
        if not problems:
            return None
        ok = np.ones(len(batch), np.bool_)
        self.stats.bad_ops += len(problems)
        if self.options.on_bad_op == "stop":
            first = problems[0]
            where = f"step {first.step}" + (f", request {first.rid}" if first.rid is not None else "")
            more = f" (and {len(problems) - 1} more in this step)" if len(problems) > 1 else ""
            raise BadTraceOp(
                f"{where}: {first.problem}{more}; run 'kvtrace validate' for every problem, "
                "or replay with --on-bad-op skip to skip such ops"
            )
        bad_rids = {p.rid for p in problems if p.rid is not None}
        for p in problems:
            self._events.append(Event("bad_op", p.rid, 0, p.problem))
        if bad_rids:
            bad = np.fromiter(bad_rids, np.int64)
            ok &= ~np.isin(batch.rid, bad)
            # The checker adopts a bad row as recorded; the replay cannot, so the request
            # leaves the replay (ids outside the trace's bound never entered it).
            bad = bad[(bad >= 0) & (bad < self._checker.rid_bound)]
            if bad.size:
                self._dropped.ensure(int(bad.max()))
                for rid in bad[~self._dropped.a[bad]].tolist():
                    self._drop(rid, "dropped after a bad op")
        self.stats.skipped_ops += int((~ok).sum())
        return ok

    def _remember_prompts(self, batch: StepBatch, ok: np.ndarray | None) -> None:
        new = ~self._seen.a[batch.rid] & ((batch.op == EXTEND) | (batch.op == PREALLOC))
        if ok is not None:
            new &= ok
        if not new.any():
            return
        rids = batch.rid[new]
        self._seen.a[rids] = True
        target = np.where(batch.prompt_len[new] >= 0, batch.prompt_len[new], batch.seq_len[new])
        self._prefill_target.a[rids] = target

    # ------------------------------------------------------------------ op kinds
    def _apply(self, op: int, batch: StepBatch, rows: np.ndarray) -> None:
        if op in (FINISH, ABORT, RETRACT):
            self._release(op, batch, rows)
        elif op == EXTEND:
            self._extend(batch, rows)
        elif op == DECODE:
            self._alloc_loop(batch, rows, lambda r, idx: self.allocator.decode(r))
            self.stats.decode_tokens += int(rows.size)
        elif op == SPEC:
            accepted = batch.accepted_len.astype(np.int64)
            self._alloc_loop(batch, rows, lambda r, idx: self.allocator.spec_decode(r, accepted[idx]))
        elif op == PREALLOC:
            self._prealloc(batch, rows)

    def _release(self, op: int, batch: StepBatch, rows: np.ndarray) -> None:
        alloc = self.allocator
        ended = batch.rid[rows]
        holds = alloc.holds_kv(ended)
        rows, rids = rows[holds], ended[holds]
        kind: ReleaseKind = "finish" if op == FINISH else ("abort" if op == ABORT else "retract")
        st = self.stats
        if kind == "finish":
            st.finishes += int(rids.size)
        elif kind == "abort":
            st.aborts += int(rids.size)
        else:
            st.retractions += int(rids.size)
            # A retracted request is prefilled again up to its length at retraction.
            self._prefill_target.a[rids] = batch.seq_len[rows]
        if rids.size:
            owned = batch.seq_len[rows]
            per_call = 1 if self.options.check == "every" and not self._quiet else rids.size
            for lo in range(0, rids.size, per_call):
                r = rids[lo : lo + per_call]
                o = owned[lo : lo + per_call]
                tokens = self._tokens.ids_many(r, o) if kind == "finish" else None
                t0 = self._clock()
                res = alloc.release(r, o, tokens, kind)
                st.allocator_s += self._clock() - t0
                self._after_release(r, res, kind)
                self._note_evicted(res.evicted_tokens)
                self._check_call(r)
        if kind != "retract":
            self._tokens.drop(ended)  # a retracted request comes back with the same tokens

    def _after_release(self, rids: np.ndarray, res: ReleaseResult, kind: str) -> None:
        released = res.overalloc_released
        self.stats.overalloc_released += int(released.sum())
        for rid, n in zip(rids[released > 0].tolist(), released[released > 0].tolist()):
            self._events.append(Event("overalloc_release", rid, n, f"{n} over-allocated slots freed on {kind}"))
        if kind != "finish":
            for rid in rids.tolist():
                self._events.append(Event(kind, rid, 0))  # type: ignore[arg-type]

    def _extend(self, batch: StepBatch, rows: np.ndarray) -> None:
        alloc = self.allocator
        st = self.stats

        def call(r: np.ndarray, idx: np.ndarray) -> AllocResult | OutOfMemory:
            seq = batch.seq_len[idx]
            tokens = self._tokens.ids_many(r, seq)
            done = seq >= self._prefill_target.a[r]
            admitted = ~alloc.holds_kv(r)
            res = alloc.extend(r, seq, tokens, done)
            if isinstance(res, AllocResult):
                prefix = res.prefix_lens if res.prefix_lens is not None else np.zeros(r.size, np.int64)
                st.prefill_tokens += int((seq - prefix).sum())
                if admitted.any():
                    hit = prefix[admitted]
                    st.admissions += int(admitted.sum())
                    st.reused_tokens += int(hit.sum())
                    st.admitted_tokens += int(self._prefill_target.a[r[admitted]].sum())
                    st.prefix_differs += int((hit != batch.prefix_len[idx][admitted]).sum())
            return res

        self._alloc_loop(batch, rows, call)

    def _prealloc(self, batch: StepBatch, rows: np.ndarray) -> None:
        def call(r: np.ndarray, idx: np.ndarray) -> AllocResult | OutOfMemory:
            fill = batch.seq_len[idx]
            tokens = self._tokens.ids_many(r, fill)
            return self.allocator.prealloc(r, fill, tokens)

        self._alloc_loop(batch, rows, call)

    def _alloc_loop(
        self,
        batch: StepBatch,
        rows: np.ndarray,
        call: Callable[[np.ndarray, np.ndarray], AllocResult | OutOfMemory],
    ) -> None:
        """Call ``call(rids, rows)``; on OOM stop, or drop the failing request and retry."""
        st = self.stats
        while rows.size:
            rids = batch.rid[rows]
            t0 = self._clock()
            res = call(rids, rows)
            st.allocator_s += self._clock() - t0
            if isinstance(res, AllocResult):
                self._note_evicted(res.evicted_tokens)
                if self._op_name == "spec":
                    st.overalloc_allocated += res.num_tokens
                    st.spec_accepted += int(batch.accepted_len[rows].sum())
                for rid, asked, width in res.row_overflow:
                    st.row_overflows += 1
                    self._violation(
                        rid,
                        "row_width",
                        f"speculative reserve asks row positions up to {asked} but the row holds {width}",
                    )
                    self._events.append(Event("row_overflow", rid, asked - width, f"asked {asked}, row {width}"))
                self._check_call(rids)
                return
            self._oom(res)
            if self.options.on_oom == "stop":
                self.stopped_early = True
                return
            self._drop(res.rid)
            rows = rows[batch.rid[rows] != res.rid]

    def _drop(self, rid: int, detail: str = "dropped after out of memory") -> None:
        """Skip mode: the request leaves the replay; whatever it holds is released."""
        st = self.stats
        self._dropped.ensure(rid)
        self._dropped.a[rid] = True
        st.dropped_requests += 1
        self._events.append(Event("dropped", rid, 0, detail))
        r = np.array([rid], np.int64)
        if self.allocator.holds_kv(r)[0]:
            lens = self.allocator.request_lens(r)
            t0 = self._clock()
            self.allocator.release(r, lens.committed, None, "abort")
            st.allocator_s += self._clock() - t0
        self._tokens.drop(rid)

    def _oom(self, res: OutOfMemory) -> None:
        st = self.stats
        st.num_ooms += 1
        self._events.append(
            Event("oom", res.rid, res.needed, f"needed {res.needed}, free {res.available}, evictable {res.evictable}")
        )
        if st.oom is None:
            st.oom = OomRecord(self._step, res.op, res.rid, res.needed, res.available, res.evictable)

    def _note_evicted(self, evicted: int) -> None:
        if evicted:
            self.stats.evicted_tokens += evicted
            self._events.append(Event("evict", None, evicted, f"{evicted} cached tokens evicted"))

    # ------------------------------------------------------------------ checks
    def _check_call(self, rids: np.ndarray) -> None:
        if self.options.check == "every" and not self._quiet:
            self._check(self._op_name, rids)

    def _check(self, op: str, rids: np.ndarray | None) -> None:
        violations: Sequence[Violation] = self.allocator.check_integrity()
        if not violations:
            return
        # A pool-wide break (conservation, ...) names no request. Blame the one request
        # the same check named, else the one request whose op just ran.
        named = {v.rid for v in violations if v.rid is not None}
        blame = None
        if len(named) == 1:
            blame = named.pop()
        elif rids is not None and rids.size == 1:
            blame = int(rids[0])
        for v in violations:
            self._violation(v.rid if v.rid is not None else blame, v.check, v.detail, op=op)

    def _violation(self, rid: int | None, check: str, detail: str, op: str | None = None) -> None:
        st = self.stats
        st.num_violations += 1
        self._events.append(Event("violation", rid, 0, f"{check}: {detail}"))
        if len(st.violations) < MAX_VIOLATIONS_KEPT:
            st.violations.append(ViolationRecord(self._step, rid, op or self._op_name, check, detail))
