"""The replay engine: one trace step -> batched allocator calls -> one ``StepSnapshot``.

Per step, in the trace's op order (``traces.schema.OP_ORDER``), the engine makes
one batched allocator call per op kind: releases (finish, abort, retract), then
prealloc, extend, decode, spec, then ``end_step``. It never trusts the trace: every
step is first checked (``traces.checker.OpSequenceChecker``, possibly in a child
process); impossible ops stop the replay (default) or are skipped and reported.
Running out of KV slots is an outcome: the first OOM is recorded with its step,
request, need, free and evictable, and the replay stops (``on_oom="stop"``) or
drops the request that did not fit and carries on (``on_oom="skip"``).

The radix cache is the replay's own: prefix hits are recomputed for the replay's
pool and page size, and admissions whose hit differs from the recorded one are
counted.

The engine is driven one step at a time (``replay_step``) by a
``kvtrace.replay.session.ReplaySession``, which owns the trace reader, the checker, the
checkpoints and the summary. Steps before ``ReplayOptions.start_step`` run quietly
(state only: no snapshot, no check, no statistics), so the statistics describe the
window and its first snapshot is a keyframe holding the whole state.

Over-allocation ledger: a request's speculative slack is ``kv_allocated_len -
kv_committed_len``. ``overalloc_allocated`` is the slack the window's allocation
calls created (net of what accepted tokens then filled), ``overalloc_released`` the
slack its releases gave back, so ``held_at_start + allocated - released ==
held_at_end`` always holds. Page-tail padding (``ceil_align(allocated) -
allocated``) is counted apart.

One concept, read top to bottom: the replay of one step, from the trace's rows to the
allocator's batched calls (one handler per op kind), their checks and the step's
snapshot; the handlers share the per-request arrays, the statistics and the step's
events, so splitting them from the step would scatter one step's path over modules.
The options it replays under sit here too; what it counts is ``kvtrace.replay.result``.
"""

from __future__ import annotations

import copy
import inspect
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import numpy as np

from allocator.base import AllocResult, DecodeRuns, OutOfMemory, PoolCounters
from allocator.reduce import imax, isum
from kvtrace.errors import TraceError
from kvtrace.replay.result import MAX_VIOLATIONS_KEPT, OomRecord, PoolPeak, ReplayStats, ViolationRecord
from kvtrace.replay.snapshot import (
    ABORTED,
    DECODE_PHASE,
    DROPPED,
    DROPPED_OP,
    FINISHED,
    UNCHANGED_OP,
    PREFILL,
    RETRACTED,
    SPEC_PHASE,
    WAITING,
    POOL_NAMES,
    Event,
    RequestDelta,
    StepSnapshot,
)
from traces.batches import StepBatch
from traces.metadata import TraceMeta
from traces.schema import ABORT, CLOSE, DECODE, EXTEND, FINISH, HOLD, MAX_RID, OP_ORDER, OPS, PREALLOC, RETRACT, SPEC
from traces.tokens import TokenStore

if TYPE_CHECKING:
    from allocator.base import Allocator, ReleaseKind, ReleaseResult, Violation
    from traces.checker import Problem

CheckMode = Literal["every", "full", "end", "never"]
OomMode = Literal["stop", "skip"]
BadOpMode = Literal["stop", "skip"]
CHECK_MODES: tuple[CheckMode, ...] = ("every", "full", "end", "never")

_RELEASE_PHASE = {FINISH: FINISHED, RETRACT: RETRACTED, ABORT: ABORTED}
# The detail of a release's event, by its kind (none for the others).
_RELEASE_DETAIL = {"finish": "finished", "hold": "held by its session", "close": "session closed"}
_USED_FROM, _AVAILABLE, _EVICTABLE = (PoolCounters._fields.index(f) for f in ("pool_tokens", "available", "evictable"))


@dataclass(frozen=True, slots=True)
class AllocCall:
    """One batched allocator call the engine makes, as its observers see it.

    Attributes:
        step: the trace step (a run of decode steps: its first).
        op: the op kind's name (``traces.schema.OPS``): finish, abort, retract,
            prealloc, extend, decode or spec.
        rids: the requests of the call, int64 ``[n]``.
        seq_lens: extend: lengths after the call; prealloc: fill lengths; a
            release: the lengths owned. None for decode and spec.
        token_ids: extend, prealloc, finish: each request's token ids up to ``seq_lens``.
        admitted: extend: bool ``[n]``, the requests holding no KV before the call
            (admissions, as the replay counts them).
        prefill_done: extend: bool ``[n]``, the requests whose prefill this call completes.
        prefill_targets: extend: int64 ``[n]``, each request's prefill target (what an
            admission counts as admitted).
    """

    step: int
    op: str
    rids: np.ndarray
    seq_lens: np.ndarray | None = None
    token_ids: Sequence[np.ndarray] | None = None
    admitted: np.ndarray | None = None
    prefill_done: np.ndarray | None = None
    prefill_targets: np.ndarray | None = None


class ReplayObserver(Protocol):
    """What watches a replay's allocator calls (``ReplaySession.observers``; ``kvtrace
    explain``). The engine builds no ``AllocCall`` while it has no observer, so a plain
    replay pays one list test per call. Observers read, never change, the state."""

    def step_started(self, step: int) -> None:
        """A step (or a run of decode steps) begins; its calls follow."""

    def call_started(self, call: AllocCall) -> None:
        """``call`` is about to run (its evictions, if any, happen before ``call_ended``)."""

    def call_ended(self, call: AllocCall, result: object) -> None:
        """``call`` ran: ``result`` is the allocator's (``AllocResult``, ``OutOfMemory``,
        ``ReleaseResult``, or a run's result)."""


class StepChecker(Protocol):
    """What checks a step for impossible ops before it is applied (the checker)."""

    def check(self, batch: StepBatch) -> list[Problem]: ...


@dataclass(frozen=True, slots=True)
class ReplayOptions:
    """How to replay.

    Args:
        check: invariant checks after every allocator call (``every``: incremental,
            what the call touched; ``full``: the whole state), at the ``end`` only, or
            ``never``.
        on_oom: stop at the first out-of-memory, or drop the request and go on.
        on_bad_op: stop at the first impossible op in the trace, or skip its rows.
        start_step: steps before this one are replayed (their state is needed) but
            produce no snapshots, checks or statistics.
        stop_step: stop before this step (exclusive); None replays to the end.
        max_violations: stop once this many invariant violations were found
            (None: never stop for violations).
        state_digest: put the allocator's ``state_digest()`` in every snapshot (the
            allocator must be ``Digestible``; ``kvtrace diff --exact``).
        decode_runs: apply runs of plain decode steps over one batch in one allocator
            call where the allocator supports it (``traces.runs``; same results). The
            session's allocator then runs ahead of the snapshot being returned within
            a run; False keeps it in step after every snapshot.
        session_hold_bound: streaming sessions: a violation (``session_hold_bound``,
            blamed on the request) for each turn whose session keeps more than this many
            tokens of KV (None: no bound).
    """

    check: CheckMode = "end"
    on_oom: OomMode = "stop"
    on_bad_op: BadOpMode = "stop"
    start_step: int | None = None
    stop_step: int | None = None
    max_violations: int | None = None
    state_digest: bool = False
    decode_runs: bool = True
    session_hold_bound: int | None = None


class BadTraceOp(TraceError):
    """An op the trace cannot legally contain (stop mode)."""


class _Grow:
    """A numpy array indexed by request id that grows on demand."""

    __slots__ = ("fill", "a")

    def __init__(self, dtype: type, fill: int | bool) -> None:
        self.fill = fill
        self.a = np.full(1024, fill, dtype)

    def ensure(self, max_rid: int) -> None:
        if max_rid >= self.a.shape[0]:
            grown = np.full(max(max_rid + 1, 2 * self.a.shape[0]), self.fill, self.a.dtype)
            grown[: self.a.shape[0]] = self.a
            self.a = grown


# Per-request arrays of the engine (all checkpointed together).
_PER_REQUEST = (
    ("seen", np.bool_, False),
    ("dropped", np.bool_, False),
    ("prefill_target", np.int64, 0),  # length at which prefill is done
    ("phase", np.int8, 0),  # index into snapshot.PHASES
    ("prefix", np.int64, 0),  # prefix reused by the request's last extend / prealloc
    ("allocated", np.int64, 0),  # kv_allocated_len as of the last snapshot
    ("committed", np.int64, 0),  # kv_committed_len as of the last snapshot
)


@dataclass
class EngineState:
    """A checkpoint of the engine's own state (the allocator's is saved separately)."""

    stats: ReplayStats
    arrays: dict[str, np.ndarray]
    tokens: TokenStore
    stopped_early: bool
    in_window: bool
    any_dropped: bool


class ReplayEngine:
    """Replays trace steps through one allocator, one batched call per op kind per step.

    Args:
        meta: the trace's metadata (checked op semantics, prompt lengths).
        allocator: the allocator version to drive.
        options: see ``ReplayOptions``.
        checker: the checker of each step (default: an ``OpSequenceChecker`` in this process).
        clock: the timer for allocator time.
    """

    def __init__(
        self,
        meta: TraceMeta,
        allocator: Allocator,
        options: ReplayOptions | None = None,
        checker: StepChecker | None = None,
        clock: Callable[[], float] = time.perf_counter,
        rid_bound: int = MAX_RID,
    ) -> None:
        if checker is None:
            from traces.checker import OpSequenceChecker

            checker = OpSequenceChecker(meta, rid_bound=rid_bound)
        self.rid_bound = rid_bound  # request ids below this (the trace's TraceReader.rid_bound)
        self.meta = meta
        self.allocator = allocator
        if meta.config.sessions and callable(getattr(allocator, "enable_sessions", None)):
            allocator.enable_sessions()  # type: ignore[attr-defined]  # SGLang: sessions need its unified tree
        self.options = options or ReplayOptions()
        self.stats = ReplayStats()
        self.stopped_early = False
        self._step_checker = checker
        self._clock = clock
        self._tokens = TokenStore(meta.block_size, meta.namespaces)
        self._decoding_phase = SPEC_PHASE if allocator.config.spec is not None else DECODE_PHASE
        self._req = {name: _Grow(dtype, fill) for name, dtype, fill in _PER_REQUEST}
        self._req_rows = 0  # every per-request array holds at least this many ids
        self._in_window = self.options.start_step is None
        # a version written before incremental checks takes no ``touched`` argument
        self._checks_incrementally = "touched" in inspect.signature(allocator.check_integrity).parameters
        self._decode_runs = isinstance(allocator, DecodeRuns)
        # Whether a run's result carries every pool's counters (``RunResult.other_pools``).
        self._runs_report_pools = bool(getattr(allocator, "runs_report_pools", False))
        self.pool_names = pool_names_of(allocator)
        # the requests' SWA cursors, for the snapshots of a model with a sliding-window pool
        # (an optional read: a version without it shows no SWA lengths)
        self._swa_evicted_lens = getattr(allocator, "swa_evicted_lens", None) if "swa" in self.pool_names else None
        # the requests' Mamba state slots, for the snapshots of a model with a Mamba pool
        # (an optional read, as above: a version without it shows no slots)
        self._mamba_slots = getattr(allocator, "mamba_slots", None) if "mamba" in self.pool_names else None
        self._any_dropped = False  # some request was dropped (skip mode): filter its ops
        self._events: list[Event] = []
        self._step = -1
        self._op_name = ""
        # Told of every allocator call (``ReplayObserver``); empty for a plain replay.
        self.observers: list[ReplayObserver] = []

    @property
    def num_requests(self) -> int:
        """Distinct requests seen so far."""
        return int(np.count_nonzero(self._req["seen"].a))

    @property
    def in_window(self) -> bool:
        """Whether the steps replayed now produce snapshots (past ``start_step``)."""
        return self._in_window

    def prefill_targets(self, rids: np.ndarray) -> np.ndarray:
        """Each request's prefill target now (the length at which its prefill is done;
        after a retraction, its length at retraction), int64 ``[n]``."""
        target = self._req["prefill_target"]
        target.ensure(int(rids.max()) if rids.shape[0] else 0)
        return target.a[rids].copy()

    def overalloc_held(self) -> int:
        """Speculative slack held by live requests now (``sum(allocated - committed)``)."""
        return int((self._req["allocated"].a - self._req["committed"].a).sum())

    # ------------------------------------------------------------------ checkpoints
    def save_state(self) -> EngineState:
        """A deep copy of the engine's state (call between steps)."""
        return EngineState(
            stats=copy.deepcopy(self.stats),
            arrays={name: grow.a.copy() for name, grow in self._req.items()},
            tokens=copy.deepcopy(self._tokens),
            stopped_early=self.stopped_early,
            in_window=self._in_window,
            any_dropped=self._any_dropped,
        )

    def restore_state(self, state: EngineState) -> None:
        """Go back to ``state`` (which stays reusable)."""
        self.stats = copy.deepcopy(state.stats)
        for name, saved in state.arrays.items():
            self._req[name].a = saved.copy()
        self._req_rows = 0  # (the arrays may be shorter now)
        self._tokens = copy.deepcopy(state.tokens)
        self.stopped_early = state.stopped_early
        self._in_window = state.in_window
        self._any_dropped = state.any_dropped

    # ------------------------------------------------------------------ one step
    def replay_step(self, batch: StepBatch) -> StepSnapshot | None:
        """Apply one step; return its snapshot (None before the window, or when the
        step's check stopped the replay).

        Raises:
            BadTraceOp: an impossible op with ``on_bad_op="stop"``.
        """
        opts = self.options
        if not self._in_window and (opts.start_step is None or batch.step >= opts.start_step):
            self._enter_window()
        st = self.stats
        quiet = not self._in_window
        self._step = batch.step
        self._events = []
        if self.observers:
            for o in self.observers:
                o.step_started(batch.step)
        alloc_s_before = st.allocator_s
        n = len(batch)
        ok = self._check_ops(batch)
        if ok is not None:  # skip mode: rows the checker refused never reach the replay
            batch, ok = batch.take(np.flatnonzero(ok)), None
        if len(batch):  # request ids are checked: below the trace's bound
            max_rid = imax(batch.rid)
            if max_rid >= self._req_rows:
                for arr in self._req.values():
                    arr.ensure(max_rid)
                self._req_rows = min(arr.a.shape[0] for arr in self._req.values())
        present = np.bincount(batch.op, minlength=len(OPS)) if len(batch) else np.zeros(len(OPS), np.int64)
        if present[EXTEND] or present[PREALLOC]:
            self._tokens.ingest(batch)
            self._remember_prompts(batch, ok)
        elif batch.token_ids.values.shape[0]:
            self._tokens.ingest(batch)  # explicit ids of decoded tokens
        # Most steps hold one op kind and no bad row: then every row is that kind's.
        whole = ok is None and int(np.count_nonzero(present)) == 1
        touched: list[np.ndarray] = []
        touched_ops: list[int] = []
        for op in OP_ORDER:
            if not present[op]:
                continue
            if whole:
                rows = np.arange(len(batch))
            else:
                mask = batch.op == op
                rows = (mask if ok is None else mask & ok).nonzero()[0]
                if rows.size == 0:
                    continue
            if self._any_dropped:
                rows = rows[~self._req["dropped"].a[batch.rid[rows]]]
                if rows.size == 0:
                    continue
            self._op_name = OPS[op]
            self._apply(op, batch, rows, quiet)
            touched.append(batch.rid[rows])
            touched_ops.append(op)
            if self.stopped_early:
                break
        if not self.stopped_early:
            t0 = self._clock()
            self.allocator.end_step()
            st.allocator_s += self._clock() - t0
        delta = self._request_delta(touched, touched_ops)
        if quiet:
            return None
        st.steps += 1
        st.steps_reported += 1
        st.ops += n
        if math.isfinite(batch.time_s):  # a NaN or infinite time is a problem the checker reported
            if st.first_time_s is None:
                st.first_time_s = batch.time_s
                st.first_step = batch.step
            st.last_time_s = batch.time_s
        st.last_step = batch.step
        others: tuple[PoolCounters, ...] = ()
        if len(self.pool_names) > 1:
            pools = self.allocator.pool_counters()  # type: ignore[attr-defined]
            pool = pools["full"]
            others = tuple(pools[name] for name in self.pool_names[1:])
            self._note_pool_peaks(batch.step, pools)
        else:
            pool = self.allocator.counters()
        used = pool.used_tokens
        if pool.session_held > st.peak_session_held:
            st.peak_session_held = pool.session_held
        if used > st.peak_used_tokens or st.peak_step is None:
            st.peak_used_tokens = used
            st.peak_step = batch.step
        keyframe = st.steps == 1 and self.options.start_step is not None
        if keyframe:
            delta = self._with_live_requests(delta)
        return StepSnapshot(
            step=batch.step,
            time_s=batch.time_s,
            pool=pool,
            requests=delta,
            events=tuple(self._events),
            num_ops=n,
            allocator_s=st.allocator_s - alloc_s_before,
            keyframe=keyframe,
            digest=self.allocator.state_digest() if self.options.state_digest else None,  # type: ignore[attr-defined]
            other_pools=others,
            other_pool_names=self.pool_names[1:],
            swa_evicted=None if self._swa_evicted_lens is None else self._swa_evicted_lens(delta.rids),
            mamba_slot=None if self._mamba_slots is None else self._mamba_slots(delta.rids),
        )

    def pools_now(self) -> dict[str, PoolCounters]:
        """Every KV pool's counters now, by name (one ``"full"`` pool for most allocators)."""
        if len(self.pool_names) > 1:
            return self.allocator.pool_counters()  # type: ignore[attr-defined,no-any-return]
        return {"full": self.allocator.counters()}

    def _note_pool_peaks(self, step: int, pools: dict[str, PoolCounters]) -> None:
        peaks = self.stats.pool_peaks
        for name, counters in pools.items():
            peak = peaks.setdefault(name, PoolPeak())
            if counters.used_tokens > peak.used_tokens or peak.step is None:
                peak.used_tokens, peak.step = counters.used_tokens, step

    def can_run_decodes(self) -> bool:
        """Whether ``replay_decode_run`` may apply runs of plain decode steps in one
        call: the allocator supports it and nothing needs the state after every step
        (full per-call checks, per-step state digests) or filters rows (dropped
        requests). Under ``--check every`` a run is one allocator call, checked once
        incrementally after it, while no violation has been found: after one, steps go
        one by one, so that a lasting break is reported at each step as without runs."""
        opts = self.options
        checks_fit = opts.check in ("end", "never") or (
            opts.check == "every" and self._checks_incrementally and not self.stats.num_violations
        )
        return (
            opts.decode_runs
            and self._decode_runs
            and (len(self.pool_names) == 1 or self._runs_report_pools)
            and checks_fit
            and not opts.state_digest
            and not self._any_dropped
        )

    def replay_run(
        self, op: int, steps: np.ndarray, times: np.ndarray, rids: np.ndarray, accepted: np.ndarray | None = None
    ) -> list[StepSnapshot] | None:
        """Apply ``len(steps)`` plain steps of ``op`` (``DECODE``, or ``SPEC`` with the
        int ``[num_steps, len(rids)]`` ``accepted`` counts) over the batch ``rids``,
        checked clean (``traces.runs``), in one allocator call; return their snapshots
        ([] before the window). None when the allocator refuses the run: nothing
        changed, replay the steps one by one. A lone decode step (``MIN_RUN_STEPS`` of
        the session aside) goes through ``_decode_steps``: the path of ``replay_step``
        without its op dispatch, for the steps between admissions and finishes."""
        num_steps = int(steps.shape[0])
        if num_steps == 1 and op == DECODE and self._takes_lone_decode_steps():
            return self._decode_steps(steps, times, rids) or None
        st = self.stats
        alloc = self.allocator
        before = alloc.request_lens(rids)
        observed = None
        if self.observers:
            observed = AllocCall(int(steps[0]), OPS[op], rids)
            for o in self.observers:
                o.step_started(observed.step)
                o.call_started(observed)
        t0 = self._clock()
        if op == SPEC:
            assert accepted is not None
            accepted = accepted.astype(np.int64)
            res = alloc.spec_decode_run(rids, accepted)  # type: ignore[attr-defined]
        else:
            res = alloc.decode_run(rids, num_steps)  # type: ignore[attr-defined]
        if observed is not None:
            for o in self.observers:
                o.call_ended(observed, res)
        if res is None:
            st.allocator_s += self._clock() - t0
            # Evicting steps ahead of the snapshot returned: only while nothing reads the
            # state step by step (observers, a tree listener such as the KV events').
            if op == DECODE and self._takes_lone_decode_steps():
                return self._decode_steps(steps, times, rids) or None
            return None
        alloc.end_step()
        elapsed = self._clock() - t0
        st.allocator_s += elapsed
        bs = int(rids.shape[0])
        if op == SPEC:
            committed = before.committed[None, :] + np.cumsum(accepted, axis=0)
        else:
            committed = before.committed[None, :] + np.arange(1, num_steps + 1, dtype=np.int64)[:, None]
        allocated = res.allocated
        req = self._req
        slack = (allocated[-1] - committed[-1]) - (before.allocated - before.committed)
        req["allocated"].a[rids] = allocated[-1]
        req["committed"].a[rids] = committed[-1]
        phase_code = SPEC_PHASE if op == SPEC else DECODE_PHASE
        req["phase"].a[rids] = phase_code
        if op == SPEC:
            st.spec_accepted += int(accepted.sum())
        else:
            st.decode_tokens += bs * num_steps
        if not self._in_window:
            return []
        st.overalloc_allocated += isum(slack)
        st.steps += num_steps
        st.steps_reported += num_steps
        st.ops += bs * num_steps
        finite = np.isfinite(times)
        if finite.any():
            if st.first_time_s is None:
                st.first_time_s = float(times[finite][0])
            st.last_time_s = float(times[finite][-1])
        if st.first_step is None:
            st.first_step = int(steps[0])
        st.last_step = int(steps[-1])
        events: tuple[Event, ...] = ()
        if self.options.check == "every":  # the run's one call, checked as one call
            self._step, self._op_name, self._events = st.last_step, OPS[op], []
            self._check(self._op_name, rids, touched=rids)
            events = tuple(self._events)
        counters = res.counters
        used = counters[:, _USED_FROM] - counters[:, _AVAILABLE] - counters[:, _EVICTABLE]
        top = int(np.argmax(used))
        if int(used[top]) > st.peak_used_tokens or st.peak_step is None:
            st.peak_used_tokens = int(used[top])
            st.peak_step = int(steps[top])
        others: list[tuple[PoolCounters, ...]] = [()] * num_steps
        if len(self.pool_names) > 1:
            pool_rows = (counters, *res.other_pools)
            assert len(pool_rows) == len(self.pool_names), "a run did not report every pool"
            self._note_run_pool_peaks(steps, pool_rows)
            others = list(zip(*([PoolCounters(*row) for row in rows.tolist()] for rows in res.other_pools)))
        op_codes = np.full(bs, op, np.int8)
        phase = np.full(bs, phase_code, np.int8)
        prefix = req["prefix"].a[rids]
        per_step = elapsed / num_steps
        # the requests' SWA cursors after each step, as a step's snapshot has them
        swa_evicted = res.swa_evicted if self._swa_evicted_lens is not None else None
        # a run of decode steps admits and releases nobody: its requests keep their Mamba slots
        mamba_slot = None if self._mamba_slots is None else self._mamba_slots(rids)
        return [
            StepSnapshot(
                step=step,
                time_s=t,
                pool=PoolCounters(*row),
                requests=RequestDelta(rids, allocated[j], committed[j], before.protected, op_codes, phase, prefix),
                events=events if j == num_steps - 1 else (),
                num_ops=bs,
                allocator_s=per_step,
                other_pools=others[j],
                other_pool_names=self.pool_names[1:],
                swa_evicted=None if swa_evicted is None else swa_evicted[j],
                mamba_slot=mamba_slot,
            )
            for j, (step, t, row) in enumerate(zip(steps.tolist(), times.tolist(), counters.tolist()))
        ]

    def _takes_lone_decode_steps(self) -> bool:
        """Whether ``_decode_steps`` may apply plain decode steps ahead of the snapshot
        returned: only while nothing reads the state step by step (observers, a tree
        listener such as the KV events'), in the window, with one pool."""
        if self.observers or not self._in_window or len(self.pool_names) != 1:
            return False
        return getattr(getattr(self.allocator, "tree_cache", None), "listener", None) is None

    def _note_run_pool_peaks(self, steps: np.ndarray, pool_rows: tuple[np.ndarray, ...]) -> None:
        """``_note_pool_peaks`` of every step of a run (each pool's counters ``[num_steps, fields]``)."""
        peaks = self.stats.pool_peaks
        for name, rows in zip(self.pool_names, pool_rows):
            used = rows[:, _USED_FROM] - rows[:, _AVAILABLE] - rows[:, _EVICTABLE]
            top = int(np.argmax(used))
            peak = peaks.setdefault(name, PoolPeak())
            if int(used[top]) > peak.used_tokens or peak.step is None:
                peak.used_tokens, peak.step = int(used[top]), int(steps[top])

    def _decode_steps(self, steps: np.ndarray, times: np.ndarray, rids: np.ndarray) -> list[StepSnapshot]:
        """Plain decode steps of one batch that the allocator would not take as one run
        (a step evicts cached tokens, or merges deferred frees): one ``decode`` call a
        step, as ``replay_step`` makes, without re-reading the step's rows. The same
        calls, checks, events, statistics and snapshots as ``replay_step``; stops before
        a step that runs out of memory (nothing changed; ``replay_step`` replays it),
        and after one whose check found a violation or stopped the replay."""
        st = self.stats
        alloc = self.allocator
        clock = self._clock
        req = self._req
        phase_a, allocated_a, committed_a = req["phase"].a, req["allocated"].a, req["committed"].a
        bs = int(rids.shape[0])
        op_codes = np.full(bs, DECODE, np.int8)
        prefix = req["prefix"].a[rids]
        check = self.options.check in ("every", "full")
        snaps: list[StepSnapshot] = []
        for step, t in zip(steps.tolist(), times.tolist()):
            self._step, self._op_name, self._events = step, "decode", []
            violations = st.num_violations
            t0 = clock()
            res = alloc.decode(rids)
            elapsed = clock() - t0
            st.allocator_s += elapsed
            if not isinstance(res, AllocResult):
                break  # out of memory (nothing changed): replay_step reports it
            self._note_evicted(res.evicted_tokens)
            if check:
                self._check("decode", rids, touched=rids if self.options.check == "every" else None)
            st.decode_tokens += bs
            phase_a[rids] = DECODE_PHASE
            if not self.stopped_early:
                t0 = clock()
                alloc.end_step()
                t1 = clock()
                st.allocator_s += t1 - t0
                elapsed += t1 - t0
            lens = alloc.request_lens(rids)
            change = (lens.allocated - lens.committed) - (allocated_a[rids] - committed_a[rids])
            self._note_slack_change(change, lens.allocated == 0)
            allocated_a[rids] = lens.allocated
            committed_a[rids] = lens.committed
            st.steps += 1
            st.steps_reported += 1
            st.ops += bs
            if np.isfinite(t):
                if st.first_time_s is None:
                    st.first_time_s = t
                    st.first_step = step
                st.last_time_s = t
            st.last_step = step
            pool = alloc.counters()
            if pool.used_tokens > st.peak_used_tokens or st.peak_step is None:
                st.peak_used_tokens = pool.used_tokens
                st.peak_step = step
            delta = RequestDelta(rids, lens.allocated, lens.committed, lens.protected, op_codes, phase_a[rids], prefix)
            snaps.append(StepSnapshot(step, t, pool, delta, tuple(self._events), bs, elapsed))
            if self.stopped_early or st.num_violations != violations:
                break
        return snaps

    def finish(self) -> None:
        """The replay is over: the end-of-replay invariant check (unless ``never``)."""
        if self.options.check != "never" and self._in_window:
            self._check("end", None, touched=None)

    def _enter_window(self) -> None:
        """The first step of the window: statistics start here."""
        self._in_window = True
        held = self.overalloc_held()
        self.stats = ReplayStats(overalloc_held_at_start=held)

    def _request_delta(self, touched: list[np.ndarray], ops: list[int]) -> RequestDelta:
        """The touched requests' lengths after the step, and the ledger of the
        speculative slack they changed."""
        if not touched:
            return RequestDelta.empty()
        req = self._req
        # A request has one row per step (the checker skips duplicates), so no unique().
        if len(touched) == 1:
            rids = touched[0]
            op = np.full(rids.shape[0], ops[0], np.int8)
        else:
            rids = np.concatenate(touched)
            op = np.repeat(np.array(ops, np.int8), [t.shape[0] for t in touched])
        lens = self.allocator.request_lens(rids)
        slack = lens.allocated - lens.committed
        change = slack - (req["allocated"].a[rids] - req["committed"].a[rids])
        if self._in_window:
            self._note_slack_change(change, lens.allocated == 0)
        req["allocated"].a[rids] = lens.allocated
        req["committed"].a[rids] = lens.committed
        phase = req["phase"].a[rids]
        if self._any_dropped:
            op = np.where(phase == DROPPED, DROPPED_OP, op).astype(np.int8)
        return RequestDelta(rids, lens.allocated, lens.committed, lens.protected, op, phase, req["prefix"].a[rids])

    def _note_slack_change(self, change: np.ndarray, released: np.ndarray) -> None:
        """The ledger of the speculative slack: what requests still holding KV changed,
        and what the ``released`` ones gave back."""
        total = isum(change)
        given_back = isum(change[released]) if np.count_nonzero(released) else 0
        self.stats.overalloc_allocated += total - given_back
        self.stats.overalloc_released -= given_back

    def _with_live_requests(self, delta: RequestDelta) -> RequestDelta:
        """``delta`` plus every other request holding KV (op ``UNCHANGED_OP``): a keyframe."""
        req = self._req
        live = np.flatnonzero(req["allocated"].a > 0)
        extra = live[~np.isin(live, delta.rids)]
        if extra.shape[0] == 0:
            return delta
        lens = self.allocator.request_lens(extra)
        more = RequestDelta(
            extra, lens.allocated, lens.committed, lens.protected,
            np.full(extra.shape[0], UNCHANGED_OP, np.int8), req["phase"].a[extra], req["prefix"].a[extra],
        )
        return RequestDelta(*(np.concatenate([a, b]) for a, b in zip(delta, more)))

    def _check_ops(self, batch: StepBatch) -> np.ndarray | None:
        """Check the step for impossible ops; return the mask of rows safe to apply (None: all)."""
        problems = self._step_checker.check(batch)
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
            bad = bad[(bad >= 0) & (bad < self.rid_bound)]
            if bad.size:
                dropped = self._req["dropped"]
                dropped.ensure(int(bad.max()))
                for rid in bad[~dropped.a[bad]].tolist():
                    self._drop(rid, "dropped after a bad op")
        self.stats.skipped_ops += int((~ok).sum())
        return ok

    def _remember_prompts(self, batch: StepBatch, ok: np.ndarray | None) -> None:
        seen = self._req["seen"].a
        # A session's next turn (an extend of a held request) may give its prompt's end.
        held = self._req["phase"].a[batch.rid] == FINISHED
        turn = seen[batch.rid] & held & (batch.op == EXTEND) & (batch.prompt_len >= 0)
        if ok is not None:
            turn &= ok
        if turn.any():
            self._req["prefill_target"].a[batch.rid[turn]] = batch.prompt_len[turn]
        new = ~seen[batch.rid] & ((batch.op == EXTEND) | (batch.op == PREALLOC))
        if ok is not None:
            new &= ok
        if not np.count_nonzero(new):
            return
        rids = batch.rid[new]
        seen[rids] = True
        # the prompt's length where the trace gives it, else the first extend's length
        target = batch.prompt_len[new]
        unknown = target < 0
        target[unknown] = batch.seq_len[new][unknown]
        self._req["prefill_target"].a[rids] = target

    # ------------------------------------------------------------------ op kinds
    def _apply(self, op: int, batch: StepBatch, rows: np.ndarray, quiet: bool) -> None:
        phase = self._req["phase"].a
        if op in (FINISH, ABORT, RETRACT):
            self._release(op, batch, rows, quiet)
            phase[batch.rid[rows]] = _RELEASE_PHASE[op]
        elif op == EXTEND:
            self._extend(batch, rows)
        elif op == DECODE:
            self._alloc_loop(batch, rows, lambda r, idx: self.allocator.decode(r))
            self.stats.decode_tokens += int(rows.size)
            phase[batch.rid[rows]] = DECODE_PHASE
        elif op == SPEC:
            accepted = batch.accepted_len.astype(np.int64)
            self._alloc_loop(batch, rows, lambda r, idx: self.allocator.spec_decode(r, accepted[idx]))
            phase[batch.rid[rows]] = SPEC_PHASE
        elif op == PREALLOC:
            self._prealloc(batch, rows)
        elif op in (HOLD, CLOSE):
            self._session_op(op, batch, rows)
            phase[batch.rid[rows]] = FINISHED  # the turn (hold) or the session (close) ended

    def _session_op(self, op: int, batch: StepBatch, rows: np.ndarray) -> None:
        """A streaming session's ``hold`` (the turn's KV stays) or ``close`` (it goes)."""
        alloc = self.allocator
        config = getattr(alloc, "config", None)
        if not hasattr(alloc, "hold"):
            raise BadTraceOp(
                f"step {batch.step}: {OPS[op]} op, but the {type(alloc).__name__} allocator has no streaming sessions"
            )
        if getattr(config, "swa", None) is not None or getattr(config, "hisparse", False):
            raise BadTraceOp(
                f"step {batch.step}: {OPS[op]} op, but streaming sessions are modelled for full-attention, "
                "non-HiSparse pools only"
            )
        rids = batch.rid[rows]
        t0 = self._clock()
        if op == HOLD:
            res = alloc.hold(rids, batch.seq_len[rows])  # type: ignore[attr-defined]
            self.stats.session_holds += int(rids.size)
            bound = self.options.session_hold_bound
            if bound is not None and self._in_window:
                # The allocator's own record where it offers one (``kv_info``), else
                # what the trace says the session holds.
                kv_info = getattr(alloc, "kv_info", None)
                for rid, traced in zip(rids.tolist(), batch.seq_len[rows].tolist()):
                    info = kv_info(rid) if kv_info is not None else None
                    held = traced if kv_info is None else 0 if info is None else info.kv_committed_len
                    if held > bound:
                        self._violation(
                            rid, "session_hold_bound",
                            f"its session holds {held} tokens of KV between turns, past the bound {bound}",
                        )
        else:
            res = alloc.close_session(rids)  # type: ignore[attr-defined]
            self.stats.session_closes += int(rids.size)
        self.stats.allocator_s += self._clock() - t0
        self._after_release(rids, res, "hold" if op == HOLD else "close")
        self._check_call(rids)
        if op == CLOSE:
            self._tokens.drop(rids)

    def _release(self, op: int, batch: StepBatch, rows: np.ndarray, quiet: bool) -> None:
        alloc = self.allocator
        ended = batch.rid[rows]
        holds = alloc.holds_kv(ended)
        if np.count_nonzero(holds) == holds.shape[0]:
            rids = ended
        else:
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
            self._req["prefill_target"].a[rids] = batch.seq_len[rows]
        if rids.size:
            owned = batch.seq_len[rows]
            # One call for the step's releases of this kind, checks or not: SGLang frees a
            # batch's finished requests in one free group, so splitting the call would
            # change the free list's order.
            tokens = self._tokens.ids_many(rids, owned) if kind == "finish" else None
            observed = None
            if self.observers:
                observed = AllocCall(self._step, kind, rids, owned, tokens)
                for o in self.observers:
                    o.call_started(observed)
            t0 = self._clock()
            res = alloc.release(rids, owned, tokens, kind)
            st.allocator_s += self._clock() - t0
            if observed is not None:
                for o in self.observers:
                    o.call_ended(observed, res)
            self._after_release(rids, res, kind)
            self._note_evicted(res.evicted_tokens)
            self._check_call(rids)
        if kind != "retract":
            self._tokens.drop(ended)  # a retracted request comes back with the same tokens

    def _after_release(self, rids: np.ndarray, res: ReleaseResult, kind: str) -> None:
        # The slack each request gave back: its allocated - committed before the release.
        slack = self._req["allocated"].a[rids] - self._req["committed"].a[rids]
        held = slack > 0
        if np.count_nonzero(held):
            for rid, n in zip(rids[held].tolist(), slack[held].tolist()):
                self._events.append(Event("overalloc_release", rid, n, f"{n} over-allocated slots freed on {kind}"))
        # every release is an event of its kind (the dashboard's "finish" filter lists them);
        # a session's hold and close are their own kinds, not a finish and an abort
        detail = _RELEASE_DETAIL.get(kind, "")
        for rid in rids.tolist():
            self._events.append(Event(kind, rid, 0, detail))  # type: ignore[arg-type]

    def _extend(self, batch: StepBatch, rows: np.ndarray) -> None:
        alloc = self.allocator
        st = self.stats
        req = self._req

        def call(r: np.ndarray, idx: np.ndarray) -> AllocResult | OutOfMemory:
            seq = batch.seq_len[idx]
            tokens = self._tokens.ids_many(r, seq)
            target = req["prefill_target"].a[r]
            done = seq >= target
            admitted = ~alloc.holds_kv(r)
            observed = None
            if self.observers:
                observed = AllocCall(self._step, "extend", r, seq, tokens, admitted, done, target)
                for o in self.observers:
                    o.call_started(observed)
            res = alloc.extend(r, seq, tokens, done)
            if observed is not None:
                for o in self.observers:
                    o.call_ended(observed, res)
            if isinstance(res, AllocResult):
                prefix = res.prefix_lens if res.prefix_lens is not None else np.zeros(r.size, np.int64)
                req["prefix"].a[r] = prefix
                req["phase"].a[r] = np.where(done, self._decoding_phase, PREFILL)
                st.prefill_tokens += isum(seq - prefix)
                num_admitted = int(np.count_nonzero(admitted))
                if num_admitted:
                    hit = prefix[admitted]
                    st.admissions += num_admitted
                    st.reused_tokens += isum(hit)
                    if res.host_hit_lens is not None:
                        st.host_reused_tokens += isum(res.host_hit_lens[admitted])
                    st.admitted_tokens += isum(target[admitted])
                    st.prefix_differs += int(np.count_nonzero(hit != batch.prefix_len[idx][admitted]))
            return res

        self._alloc_loop(batch, rows, call)

    def _prealloc(self, batch: StepBatch, rows: np.ndarray) -> None:
        req = self._req

        def call(r: np.ndarray, idx: np.ndarray) -> AllocResult | OutOfMemory:
            fill = batch.seq_len[idx]
            tokens = self._tokens.ids_many(r, fill)
            observed = None
            if self.observers:
                observed = AllocCall(self._step, "prealloc", r, fill, tokens)
                for o in self.observers:
                    o.call_started(observed)
            res = self.allocator.prealloc(r, fill, tokens)
            if observed is not None:
                for o in self.observers:
                    o.call_ended(observed, res)
            if isinstance(res, AllocResult):
                req["prefix"].a[r] = res.prefix_lens if res.prefix_lens is not None else 0
                req["phase"].a[r] = WAITING
            return res

        self._alloc_loop(batch, rows, call)

    def _alloc_loop(
        self,
        batch: StepBatch,
        rows: np.ndarray,
        call: Callable[[np.ndarray, np.ndarray], AllocResult | OutOfMemory],
    ) -> None:
        """Call ``call(rids, rows)``; on OOM stop, or drop the failing request and retry."""
        st = self.stats
        if self.observers and self._op_name in ("decode", "spec"):  # extend, prealloc tell their own
            call = self._observed(call)
        while rows.size:
            rids = batch.rid[rows]
            t0 = self._clock()
            res = call(rids, rows)
            st.allocator_s += self._clock() - t0
            if isinstance(res, AllocResult):
                self._note_evicted(res.evicted_tokens)
                if self._op_name == "spec":
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

    def _observed(
        self, call: Callable[[np.ndarray, np.ndarray], AllocResult | OutOfMemory]
    ) -> Callable[[np.ndarray, np.ndarray], AllocResult | OutOfMemory]:
        """``call`` (a decode or spec call) telling the observers before and after it."""
        op = self._op_name

        def observed(r: np.ndarray, idx: np.ndarray) -> AllocResult | OutOfMemory:
            c = AllocCall(self._step, op, r)
            for o in self.observers:
                o.call_started(c)
            res = call(r, idx)
            for o in self.observers:
                o.call_ended(c, res)
            return res

        return observed

    def _drop(self, rid: int, detail: str = "dropped after out of memory") -> None:
        """Skip mode: the request leaves the replay; whatever it holds is released."""
        st = self.stats
        for arr in self._req.values():
            arr.ensure(rid)
        self._req["dropped"].a[rid] = True
        self._req["phase"].a[rid] = DROPPED
        self._any_dropped = True
        st.dropped_requests += 1
        self._events.append(Event("dropped", rid, 0, detail))
        r = np.array([rid], np.int64)
        if self.allocator.holds_kv(r)[0]:
            lens = self.allocator.request_lens(r)
            observed = AllocCall(self._step, "abort", r, lens.committed) if self.observers else None
            for o in self.observers:
                o.call_started(observed)  # type: ignore[arg-type]
            t0 = self._clock()
            res = self.allocator.release(r, lens.committed, None, "abort")
            st.allocator_s += self._clock() - t0
            for o in self.observers:
                o.call_ended(observed, res)  # type: ignore[arg-type]
        self._tokens.drop(rid)

    def _oom(self, res: OutOfMemory) -> None:
        st = self.stats
        st.num_ooms += 1
        pool = getattr(res, "pool", "full")  # (a version older than the SWA pool names none)
        st.ooms_by_pool[pool] = st.ooms_by_pool.get(pool, 0) + 1
        self._events.append(
            Event(
                "oom", res.rid, res.needed,
                f"needed {res.needed}, free {res.available}, evictable {res.evictable}{_in_pool(pool)}",
            )
        )
        if st.oom is None:
            st.oom = OomRecord(self._step, res.op, res.rid, res.needed, res.available, res.evictable, pool)

    def _note_evicted(self, evicted: int) -> None:
        if evicted:
            self.stats.evicted_tokens += evicted
            self._events.append(Event("evict", None, evicted, f"{evicted} cached tokens evicted"))

    # ------------------------------------------------------------------ checks
    def _check_call(self, rids: np.ndarray) -> None:
        mode = self.options.check
        if mode in ("every", "full") and self._in_window:
            self._check(self._op_name, rids, touched=rids if mode == "every" else None)

    def _check(self, op: str, rids: np.ndarray | None, *, touched: np.ndarray | None) -> None:
        if touched is not None and self._checks_incrementally:
            violations: list[Violation] = self.allocator.check_integrity(touched)  # type: ignore[call-arg]
        else:
            violations = self.allocator.check_integrity()
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
            pool = getattr(v, "pool", "full")
            self._violation(v.rid if v.rid is not None else blame, v.check, v.detail, op=op, pool=pool)

    def _violation(self, rid: int | None, check: str, detail: str, op: str | None = None, pool: str = "full") -> None:
        st = self.stats
        st.num_violations += 1
        self._events.append(Event("violation", rid, 0, f"{check}: {detail}{_in_pool(pool)}"))
        if len(st.violations) < MAX_VIOLATIONS_KEPT:
            st.violations.append(ViolationRecord(self._step, rid, op or self._op_name, check, detail, pool))
        limit = self.options.max_violations
        if limit is not None and st.num_violations >= limit:
            self.stopped_early = True


@runtime_checkable
class PerPoolCounters(Protocol):
    """An allocator with several KV pools (a hybrid sliding-window model's full and SWA
    pools): ``pool_counters()`` gives each pool's counters by name (``POOL_NAMES``),
    ``"full"`` first and equal to ``counters()``. Optional: without it the allocator
    has one pool."""

    def pool_counters(self) -> dict[str, PoolCounters]: ...


def pool_names_of(allocator: object) -> tuple[str, ...]:
    """The pools of an allocator, in ``POOL_NAMES`` order: ``("full",)``, or
    ``("full", "swa")`` for a hybrid sliding-window model, ``("full", "mamba")`` for a
    hybrid linear-attention one (``PerPoolCounters``)."""
    if not isinstance(allocator, PerPoolCounters):
        return ("full",)
    names = tuple(allocator.pool_counters())
    unknown = [name for name in names if name not in POOL_NAMES]
    if unknown or "full" not in names:
        raise ValueError(f"allocator pools {names}: expected 'full' and some of {POOL_NAMES}")
    return tuple(name for name in POOL_NAMES if name in names)


def _in_pool(pool: str) -> str:
    """`` (swa pool)`` for an event of a pool other than the full one (whose wording
    stays that of a full-attention model)."""
    return "" if pool == "full" else f" ({pool} pool)"


def pool_counters_dict(pool: PoolCounters) -> dict[str, Any]:
    """The pool counters as a JSON-able dict (with ``used_tokens``)."""
    return {**pool._asdict(), "used_tokens": pool.used_tokens}
