"""Incremental, vectorised checking of a trace's op sequence.

``OpSequenceChecker(meta).check(step)`` checks one step against the state the
previous steps left (per request: phase, length, prompt length; numpy arrays
indexed by request id) and returns its problems; ``finish()`` summarises the
end of the trace. ``kvtrace validate`` runs it over a whole file; the replay
engine may run it per step before applying the step.

Request phases::

    NEW ──extend──► PREFILL ──decode/spec──► DECODE
     │                 ▲  │                    │
     └──prealloc───────┼──┼────────────────────┤ (prealloc enters DECODE)
                       │  └──retract──► RETRACTED ◄──retract── DECODE
            extend ────┘ (from 0)            │
    PREFILL/DECODE ──finish/abort──► ENDED ◄─┘ abort
    PREFILL/DECODE ──hold──► HELD ──close──► ENDED;  HELD ──extend (from the held
    length: the session's next turn)──► PREFILL

A request held once is a session's until it ends: a later turn ends with ``hold`` or
``abort``, never ``finish`` (SGLang keeps a finished turn in its session slot, where the
built-in allocator would free it; the two would part).

A row that breaks a rule is reported, then applied as recorded (its
``seq_len`` becomes the request's length), so one mistake is reported once
rather than at every later step.

One concept, read top to bottom: the op-sequence rules (the tables below) and the one
class that applies them, its vectorised fast paths first, then the explanation of each
broken rule; split, a rule and its explanation would live apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from traces.batches import StepBatch
from traces.metadata import TraceMeta
from traces.schema import (
    ABORT,
    CLOSE,
    DECODE,
    EXTEND,
    FINISH,
    HOLD,
    MAX_RID,
    MAX_SPEC_TOKENS,
    MAX_STEP,
    OP_RANK,
    OPS,
    PREALLOC,
    RETRACT,
    SPEC,
)

if TYPE_CHECKING:
    from traces.chunks import StepChunk

# Request phases (values of the per-request state array).
NEW, PREFILL, DECODING, RETRACTED, ENDED, HELD = range(6)
PHASE_NAMES = ("new", "prefill", "decode", "retracted", "ended", "held")

# Ids are dense from 0 (``traces.schema.MAX_RID``); per-request state costs this many
# bytes per id up to the largest (phase, length, prompt, prefill end, scratch, session).
CHECKER_BYTES_PER_RID = 34
MAX_EXPLICIT_TOKEN = 1 << 62  # larger ids are reserved for synthetic content (traces.tokens)

_OP_RANK = np.array(OP_RANK, np.int8)
_IS_ALLOC = np.array([True, True, True, True, False, False, False, False, False])
_IS_DECODING_OP = np.array([False, True, True, False, False, False, False, False, False])
# Ops whose rows carry the recording engine's matched prefix (others hold prefix_len 0).
_HAS_PREFIX = np.array([True, False, False, True, False, False, False, False, False])
# Tokens an op may append, indexed by op code.
_MIN_APPEND = np.array([1, 1, 0, 1, 0, 0, 0, 0, 0], np.int32)
_MAX_APPEND = np.array([2**31 - 1, 1, 2**31 - 1, 2**31 - 1, 0, 0, 0, 0, 0], np.int32)
# Which op may apply to which phase: _ALLOWED[op, phase].
_ALLOWED = np.zeros((len(OPS), len(PHASE_NAMES)), np.bool_)
for _op, _phases in (
    (EXTEND, (NEW, PREFILL, RETRACTED, HELD)),
    (DECODE, (PREFILL, DECODING)),
    (SPEC, (PREFILL, DECODING)),
    (PREALLOC, (NEW, RETRACTED)),
    (FINISH, (PREFILL, DECODING)),
    (RETRACT, (PREFILL, DECODING)),
    (ABORT, (PREFILL, DECODING, RETRACTED)),
    (HOLD, (PREFILL, DECODING)),
    (CLOSE, (HELD,)),
):
    _ALLOWED[_op, list(_phases)] = True
_HOLDS_KV = np.array([False, True, True, False, False, True])
# Phase a request enters with each op, indexed by op code.
_NEXT_PHASE = np.array(
    [PREFILL, DECODING, DECODING, DECODING, ENDED, RETRACTED, ENDED, HELD, ENDED], np.int8
)


@dataclass(frozen=True, slots=True)
class Problem:
    """One broken rule: where (step, request; None for the whole step) and what."""

    step: int
    rid: int | None
    problem: str

    def __str__(self) -> str:
        if self.rid is None:
            return f"step {self.step}: {self.problem}"
        return f"step {self.step}, request {self.rid}: {self.problem}"

    def to_dict(self) -> dict[str, object]:
        return {"step": self.step, "rid": self.rid, "problem": self.problem}


class CheckSummary(NamedTuple):
    """The end of a trace, as ``OpSequenceChecker.finish()`` sees it.

    ``holding_kv`` requests were never released: not a problem (a trace may be a
    window of a longer recording), but worth a line in a report.
    """

    steps: int
    rows: int
    requests: int
    ended: int
    holding_kv: int
    retracted: int
    problems: int


class OpSequenceChecker:
    """Checks op sequences step by step; vectorised over a step's rows.

    Args:
        meta: the trace metadata (``max_context_len``, spec settings, PD decode,
            ``block_size``).
        rid_bound: request ids must lie below this (``TraceReader.rid_bound``: the
            trace's row count, at most ``MAX_RID``); None: ``MAX_RID``.
    """

    def __init__(self, meta: TraceMeta, rid_bound: int | None = None) -> None:
        self.meta = meta
        self.max_context_len = meta.config.max_context_len
        self.block_size = meta.block_size
        self.spec_enabled = meta.config.spec is not None
        # Without spec settings, spec rows are reported once; their drafts stay bounded.
        self.max_draft_len = meta.config.spec.num_draft_tokens if meta.config.spec else MAX_SPEC_TOKENS
        self.pd_decode = meta.config.pd_decode
        self.rid_bound = MAX_RID if rid_bound is None else max(0, min(int(rid_bound), MAX_RID))
        bound = "2**24" if self.rid_bound == MAX_RID else f"{self.rid_bound:,}"
        rows = "" if self.rid_bound == MAX_RID else f", fewer than the trace's {self.rid_bound:,} rows"
        self._rid_message = f"request id outside [0, {bound}) (ids are dense, from 0{rows})"
        self._phase = np.zeros(1024, np.int8)
        self._length = np.zeros(1024, np.int64)
        self._prompt = np.full(1024, -1, np.int64)
        # Where the request's prefill ends: its prompt, or its length when it was retracted.
        self._target = np.full(1024, -1, np.int64)
        self._scratch = np.zeros(1024, np.int64)  # per rid, for the duplicate test
        self._session = np.zeros(1024, np.bool_)  # held once, not ended: a session's request
        self._last_step: int | None = None
        self._last_time: float | None = None
        self._steps = 0
        self._rows = 0
        self._problems = 0
        self._reported_once: set[str] = set()

    # -- public ----------------------------------------------------------------------

    def check(self, batch: StepBatch) -> list[Problem]:
        """Check one step and advance the state; returns its problems in row order."""
        found: list[tuple[int, str, int | None]] = []  # (row, message, rid); row -1: the step
        self._check_step(batch, found)
        n = len(batch)
        if n and not found and self._plain_step(batch):
            self._steps += 1
            self._rows += n
            return []
        if n:
            rid = batch.rid
            in_range = (rid >= 0) & (rid < self.rid_bound)
            if not in_range.all():
                for i in np.flatnonzero(~in_range).tolist():
                    found.append((i, self._rid_message, int(rid[i])))
            rows = np.flatnonzero(in_range)
            if rows.size:
                self._grow(int(rid[rows].max()))
                self._check_rows(batch, self._distinct_rows(batch, rows, found), found)
        self._steps += 1
        self._rows += n
        if not found:
            return []
        found.sort(key=lambda item: item[0])
        self._problems += len(found)
        return [Problem(batch.step, r, message) for _, message, r in found]

    def _distinct_rows(self, batch: StepBatch, rows: np.ndarray, found: list[tuple[int, str, int | None]]) -> np.ndarray:
        """``rows`` less those of a request that appears more than once in the step.

        A request has at most one op per step. One that has more is refused at once:
        one problem at its first row, none of its rows checked or applied. Which of its
        rows was meant is unknown, and the work stays bounded by the number of requests
        whatever the number of rows (a step of millions of copies of one row is one
        problem, found in a sort).
        """
        if rows.size < 2:
            return rows
        rid = batch.rid[rows]
        order = np.argsort(rid, kind="stable")
        ordered = rid[order]
        repeat = ordered[1:] == ordered[:-1]
        if not np.count_nonzero(repeat):
            return rows
        starts = np.flatnonzero(np.concatenate(([True], ~repeat)))  # each request's first, in sorted order
        counts = np.diff(np.append(starts, ordered.shape[0]))
        first = order[starts]  # the stable sort keeps a request's rows in row order
        many = counts > 1
        for j, count in zip(first[many].tolist(), counts[many].tolist()):
            found.append((int(rows[j]), f"the request appears {count:,} times in this step (once at most; "
                          "none of them is applied)", int(rid[j])))
        return rows[np.sort(first[~many])]

    def _plain_step(self, batch: StepBatch) -> bool:
        """Fast path for the commonest steps: only ``decode`` rows (or only ``spec`` rows)
        of distinct requests that are decoding, each as long as it was plus what it
        appends, and nothing else set (no prompt, prefix, hashes or explicit ids).
        Applies the step and returns True when every row is fine; returns False
        (nothing applied) when any row needs the general checks."""
        op, rid = batch.op, batch.rid
        kind = int(op[0])
        if kind not in (DECODE, SPEC) or np.count_nonzero(op != kind) or (kind == SPEC and not self.spec_enabled):
            return False
        lo, hi = int(rid.min()), int(rid.max())
        if lo < 0 or hi >= self.rid_bound:
            return False
        if not self._plain_columns(batch.append_len, batch.draft_len, batch.accepted_len, batch.prefix_len,
                                   batch.prompt_len, batch.block_hashes.valid, batch.token_ids.valid, kind):
            return False
        self._grow(hi)
        seq_len = batch.seq_len
        added = 1 if kind == DECODE else batch.accepted_len
        if (
            np.count_nonzero(self._phase[rid] != DECODING)
            or np.count_nonzero(seq_len != self._length[rid] + added)
            or int(seq_len.max()) > self.max_context_len
        ):
            return False
        # Distinct rids: scatter row numbers, read them back (no sort).
        order = np.arange(rid.shape[0])
        self._scratch_grow(hi)
        self._scratch[rid] = order
        if np.count_nonzero(self._scratch[rid] != order):
            return False
        self._length[rid] = seq_len
        return True

    def _plain_columns(
        self,
        append_len: np.ndarray,
        draft_len: np.ndarray,
        accepted_len: np.ndarray,
        prefix_len: np.ndarray,
        prompt_len: np.ndarray,
        hashes_valid: np.ndarray,
        tokens_valid: np.ndarray,
        kind: int,
    ) -> bool:
        """Rows of ``kind`` (decode or spec) whose other columns pass every column rule
        as they stand: what a plain step's rows hold. (count_nonzero: a fraction of the
        cost of .any() / .all().)"""
        if (
            np.count_nonzero(prefix_len)
            or np.count_nonzero(prompt_len >= 0)
            or np.count_nonzero(hashes_valid)
            or np.count_nonzero(tokens_valid)
        ):
            return False
        if kind == DECODE:
            return not (np.count_nonzero(append_len != 1) or np.count_nonzero(draft_len) or np.count_nonzero(accepted_len))
        draft = draft_len.astype(np.int64)
        accepted = accepted_len.astype(np.int64)
        return not (
            np.count_nonzero(accepted != append_len)
            or np.count_nonzero(accepted > draft + 1)
            or int(accepted.min()) < 0
            or int(draft.min()) < 0
            or int(draft.max()) > self.max_draft_len
        )

    def check_run(self, chunk: StepChunk, i: int, m: int) -> bool:
        """Check and apply steps ``i`` to ``i + m - 1`` of ``chunk`` at once, a run of plain
        decode (or spec) steps over one batch (``traces.runs.run_lengths``), when every
        row passes the fast path's tests (``_plain_step``) and the steps and times go on;
        returns False (nothing applied) when any step needs the per-step checks.
        """
        cols = chunk.columns
        first, last = int(chunk.starts[i]), int(chunk.stops[i + m - 1])
        last_first = int(chunk.starts[i + m - 1])
        steps = cols.step[chunk.starts[i : i + m]]
        times = cols.time_s[chunk.starts[i : i + m]]
        kind = int(cols.op[first])
        if (
            kind not in (DECODE, SPEC)
            or int(steps[0]) < 0
            or int(steps[-1]) >= MAX_STEP
            or np.count_nonzero(steps[1:] < steps[:-1])
            or (self._last_step is not None and int(steps[0]) < self._last_step)
            or not np.isfinite(times).all()
            or np.count_nonzero(times[1:] < times[:-1])
            or (self._last_time is not None and float(times[0]) < self._last_time)
            or np.count_nonzero(cols.op[first:last] != kind)
            or not self._plain_columns(
                cols.append_len[first:last], cols.draft_len[first:last], cols.accepted_len[first:last],
                cols.prefix_len[first:last], cols.prompt_len[first:last],
                cols.block_hashes.valid[first:last], cols.token_ids.valid[first:last], kind,
            )
            or int(cols.seq_len[last_first:last].max()) > self.max_context_len
            or not self._plain_step(chunk.step_batch(i))
        ):
            return False
        # run_lengths holds every later step to the first one's requests, each one longer.
        rid = cols.rid[last_first:last]
        self._length[rid] = cols.seq_len[last_first:last]
        self._last_step = int(steps[-1]) if self._last_step is None else max(int(steps[-1]), self._last_step)
        self._last_time = float(times[-1]) if self._last_time is None else max(float(times[-1]), self._last_time)
        self._steps += m
        self._rows += last - first
        return True

    def _scratch_grow(self, max_rid: int) -> None:
        if max_rid >= self._scratch.shape[0]:
            self._scratch = np.zeros(max(max_rid + 1, 2 * self._scratch.shape[0]), np.int64)

    def finish(self) -> CheckSummary:
        """The end-of-trace summary (requests still holding KV are not problems)."""
        phase = self._phase
        return CheckSummary(
            steps=self._steps,
            rows=self._rows,
            requests=int(np.count_nonzero(phase != NEW)),
            ended=int(np.count_nonzero(phase == ENDED)),
            holding_kv=int(np.count_nonzero(_HOLDS_KV[phase])),
            retracted=int(np.count_nonzero(phase == RETRACTED)),
            problems=self._problems,
        )

    def phase_of(self, rid: int) -> str:
        """The phase of a request (``new``, ``prefill``, ``decode``, ``retracted``, ``ended``)."""
        return PHASE_NAMES[int(self._phase[rid])] if 0 <= rid < self._phase.shape[0] else "new"

    def length_of(self, rid: int) -> int:
        """The length the trace gave a request so far (0 when it holds no KV)."""
        return int(self._length[rid]) if 0 <= rid < self._length.shape[0] else 0

    # -- internals -------------------------------------------------------------------

    def _grow(self, max_rid: int) -> None:
        size = self._phase.shape[0]
        if max_rid < size:
            return
        new = max(max_rid + 1, min(2 * size, self.rid_bound))
        self._phase = np.concatenate([self._phase, np.zeros(new - size, np.int8)])
        self._length = np.concatenate([self._length, np.zeros(new - size, np.int64)])
        self._prompt = np.concatenate([self._prompt, np.full(new - size, -1, np.int64)])
        self._target = np.concatenate([self._target, np.full(new - size, -1, np.int64)])
        self._session = np.concatenate([self._session, np.zeros(new - size, np.bool_)])

    def _once(self, key: str) -> bool:
        if key in self._reported_once:
            return False
        self._reported_once.add(key)
        return True

    def _check_step(self, batch: StepBatch, found: list[tuple[int, str, int | None]]) -> None:
        step, time_s = batch.step, batch.time_s
        # Equal steps are one step fed in parts (a reader merges them); only a decrease is wrong.
        if not 0 <= step < MAX_STEP:
            found.append((-1, f"step {step} outside [0, 2**53)", None))
        if self._last_step is not None and step < self._last_step:
            found.append(
                (-1, f"step {step} comes after step {self._last_step}: steps must not decrease", None)
            )
        if not np.isfinite(time_s):
            found.append((-1, f"time_s is {time_s}, not a finite number", None))
        elif self._last_time is not None and time_s < self._last_time:
            found.append(
                (-1, f"time goes backwards: {time_s:g} s after {self._last_time:g} s", None)
            )
        self._last_step = step if self._last_step is None else max(step, self._last_step)
        if np.isfinite(time_s):
            self._last_time = time_s if self._last_time is None else max(time_s, self._last_time)
        op = batch.op
        if len(batch) > 1 and int(op.min()) != int(op.max()):  # one op kind throughout is in order
            bad_code = (op < 0) | (op >= len(OPS))
            if bad_code.any():
                return  # reported per row below
            rank = _OP_RANK[op]
            out_of_order = np.flatnonzero(rank[1:] < rank[:-1]) + 1
            for i in out_of_order[:1].tolist():
                found.append(
                    (
                        i,
                        f"rows not in OP_ORDER: a {OPS[op[i]]} row after a {OPS[op[i - 1]]} row "
                        "(releases come first: finish, abort, retract, prealloc, extend, decode, spec)",
                        int(batch.rid[i]),
                    )
                )

    def _check_rows(
        self, batch: StepBatch, rows: np.ndarray, found: list[tuple[int, str, int | None]]
    ) -> None:
        """Check ``rows`` of ``batch`` (distinct, valid request ids) and apply them.

        A few combined vectorised tests decide which rows are fine; only the rows
        that fail are explained, one message per broken rule (``_explain``).
        """
        every = rows.shape[0] == len(batch)
        op = batch.op if every else batch.op[rows]
        bad_code = (op < 0) | (op >= len(OPS))
        if bad_code.any():
            for j in np.flatnonzero(bad_code).tolist():
                found.append(
                    (int(rows[j]), f"unknown op code {int(op[j])} (valid: 0..{len(OPS) - 1})", int(batch.rid[rows[j]]))
                )
            rows = rows[~bad_code]
            if rows.size == 0:
                return
            every = False
            op = batch.op[rows]

        def take(array: np.ndarray) -> np.ndarray:
            return array if every else array[rows]

        rid = take(batch.rid)
        seq_len = take(batch.seq_len)
        append_len = take(batch.append_len)
        prompt_len = take(batch.prompt_len)
        phase = self._phase[rid]
        length = self._length[rid]
        known_prompt = self._prompt[rid]
        is_new = phase == NEW
        # Where the prefill ends: this row's prompt for a new request or a session's next
        # turn (its prompt: the conversation so far), else the one recorded.
        turn = (op == EXTEND) & (phase == HELD)
        target = np.where((is_new | turn) & (prompt_len >= 0), prompt_len, self._target[rid])
        counts = np.bincount(op, minlength=len(OPS))

        if counts[PREALLOC] and not self.pd_decode and self._once("prealloc"):
            first = int(np.flatnonzero(op == PREALLOC)[0])
            found.append(
                (int(rows[first]), "prealloc rows but the metadata says config.pd_decode is false "
                 "(reported once)", int(rid[first]))
            )

        alloc = _IS_ALLOC[op]
        ok = _ALLOWED[op, phase]
        ok &= (append_len >= _MIN_APPEND[op]) & (append_len <= _MAX_APPEND[op])
        ok &= (seq_len >= 0) & (~alloc | (seq_len <= self.max_context_len))
        ok &= prompt_len <= self.max_context_len
        is_spec = op == SPEC
        if counts[SPEC] and not self.spec_enabled:
            ok &= ~is_spec  # no allocator can verify drafts it has no settings for
        # Columns an op kind does not use hold 0; the matched prefix is part of the sequence.
        # (Whole-batch counts first: most steps hold no draft and no prefix at all.)
        if counts[SPEC] or np.count_nonzero(batch.draft_len) or np.count_nonzero(batch.accepted_len):
            draft_len = take(batch.draft_len).astype(np.int64)
            accepted_len = take(batch.accepted_len).astype(np.int64)
            ok &= np.where(is_spec, draft_len <= self.max_draft_len, (draft_len == 0) & (accepted_len == 0))
        if np.count_nonzero(batch.prefix_len):
            prefix_len = take(batch.prefix_len)
            ok &= np.where(_HAS_PREFIX[op], (prefix_len >= 0) & (prefix_len <= seq_len), prefix_len == 0)
        added = append_len
        if counts[SPEC]:
            added = np.where(is_spec, accepted_len, append_len)
            ok &= ~is_spec | (
                (accepted_len == append_len) & (accepted_len <= draft_len + 1)
                & (draft_len >= 0) & (accepted_len >= 0)
            )
        ok &= np.where(
            alloc, seq_len == length + added, np.where((op == FINISH) | (op == HOLD), seq_len <= length, seq_len == length)
        )
        if counts[DECODE] or counts[SPEC]:
            ok &= ~(_IS_DECODING_OP[op] & (phase == PREFILL) & (target >= 0) & (length < target))
        if counts[EXTEND]:  # a new request prefills its prompt; once a prefill is done, it decodes
            is_extend = op == EXTEND
            ok &= ~(is_extend & (is_new | turn) & (prompt_len >= 0) & (seq_len > prompt_len))
            ok &= ~(is_extend & (phase == PREFILL) & (target >= 0) & (length >= target))
        ok &= ~is_new | (prompt_len >= 0)
        ok &= (prompt_len < 0) | is_new | turn | (known_prompt < 0) | (prompt_len == known_prompt)
        if counts[FINISH]:
            ok &= ~((op == FINISH) & self._session[rid])
        if not ok.all():
            self._explain(batch, rows[~ok], found)
        self._check_lists(batch, rows, every, prompt_len, take(batch.append_len), rid, found)

        # Apply, as recorded.
        self._phase[rid] = _NEXT_PHASE[op]
        self._length[rid] = np.where(alloc | (op == HOLD), seq_len, 0)
        sets_prompt = is_new & (prompt_len >= 0)
        if sets_prompt.any():
            self._prompt[rid[sets_prompt]] = prompt_len[sets_prompt]
            self._target[rid[sets_prompt]] = prompt_len[sets_prompt]
        if counts[RETRACT]:
            retracted = op == RETRACT
            self._target[rid[retracted]] = seq_len[retracted]
        if counts[EXTEND]:  # a session's next turn: its prompt_len, when given, ends its prefill
            if turn.any():
                self._target[rid[turn]] = np.where(prompt_len[turn] >= 0, prompt_len[turn], -1)
        if counts[HOLD] or counts[FINISH] or counts[ABORT] or counts[CLOSE]:
            self._session[rid] = np.where(op == HOLD, True, self._session[rid] & (_NEXT_PHASE[op] != ENDED))

    def _explain(self, batch: StepBatch, rows: np.ndarray, found: list[tuple[int, str, int | None]]) -> None:
        """One message per broken rule for ``rows`` (each known to break at least one)."""
        rid = batch.rid[rows]
        op = batch.op[rows]
        seq_len = batch.seq_len[rows]
        append_len = batch.append_len[rows].astype(np.int64)
        draft_len = batch.draft_len[rows].astype(np.int64)
        accepted_len = batch.accepted_len[rows].astype(np.int64)
        prefix_len = batch.prefix_len[rows]
        prompt_len = batch.prompt_len[rows]
        phase = self._phase[rid]
        length = self._length[rid]
        known_prompt = self._prompt[rid]
        turn = (op == EXTEND) & (phase == HELD)  # a session's next turn
        target = np.where(((phase == NEW) | turn) & (prompt_len >= 0), prompt_len, self._target[rid])
        explained = np.zeros(rows.shape[0], np.bool_)

        def report(mask: np.ndarray, message: object) -> None:
            """Report ``message(j)`` (or the string) for every row ``j`` where ``mask``."""
            if not mask.any():
                return
            explained[mask] = True
            for j in np.flatnonzero(mask).tolist():
                text = message(j) if callable(message) else message
                found.append((int(rows[j]), str(text), int(rid[j])))

        is_extend, is_decode, is_spec = op == EXTEND, op == DECODE, op == SPEC
        is_prealloc, is_finish, is_retract, is_abort = op == PREALLOC, op == FINISH, op == RETRACT, op == ABORT
        is_hold, is_close = op == HOLD, op == CLOSE
        is_alloc = is_extend | is_decode | is_spec | is_prealloc
        is_release = ~is_alloc
        is_new, is_prefill, is_decoding = phase == NEW, phase == PREFILL, phase == DECODING
        is_retracted, is_ended, is_held = phase == RETRACTED, phase == ENDED, phase == HELD
        holds_kv = is_prefill | is_decoding

        # Negative counts.
        for name, values, where in (
            ("seq_len", seq_len, True), ("append_len", append_len, True),
            ("draft_len", draft_len, is_spec), ("accepted_len", accepted_len, is_spec),
            ("prefix_len", prefix_len, is_extend | is_prealloc),
        ):
            report(
                where & (values < 0),
                lambda j, name=name, values=values: f"{name} is negative ({int(values[j])})",
            )
        # Columns an op kind does not use must hold 0.
        for name, values, where in (
            ("draft_len", draft_len, ~is_spec), ("accepted_len", accepted_len, ~is_spec),
            ("prefix_len", prefix_len, ~(is_extend | is_prealloc)),
        ):
            users = "spec rows" if name != "prefix_len" else "extend and prealloc rows"
            report(
                where & (values != 0),
                lambda j, name=name, values=values, users=users: f"{name} {int(values[j])} on a "
                f"{OPS[op[j]]} row (only {users} carry it; it must be 0)",
            )
        report(
            (is_extend | is_prealloc) & (prefix_len > seq_len) & (seq_len >= 0),
            lambda j: f"prefix_len {int(prefix_len[j])} exceeds seq_len {int(seq_len[j])} "
            "(the matched prefix is part of the sequence)",
        )
        if not self.spec_enabled:
            report(is_spec, "spec row but the metadata has no spec settings (config.spec is null)")
        report(
            is_spec & (draft_len > self.max_draft_len),
            lambda j: f"draft_len {int(draft_len[j])} exceeds config.spec.num_draft_tokens {self.max_draft_len}",
        )
        report(  # a prompt as long as the row's seq_len is reported once, below
            (prompt_len > self.max_context_len) & ~(is_alloc & (seq_len > self.max_context_len)),
            lambda j: f"prompt_len {int(prompt_len[j])} exceeds config.max_context_len {self.max_context_len}",
        )

        # Ops on requests in the wrong phase.
        wrong_phase = {
            "ended": is_ended,
            "missing": is_new & ~is_extend & ~is_prealloc,
            "mid-decode": is_extend & is_decoding,
            "prealloc-held": is_prealloc & holds_kv,
            "alloc-retracted": (is_decode | is_spec) & is_retracted,
            "release-retracted": (is_finish | is_retract | is_hold) & is_retracted,
            "held": is_held & ~is_extend & ~is_close,
            "close-running": is_close & ~is_held & ~is_ended & ~is_new & ~is_retracted,
            "close-retracted": is_close & is_retracted,
        }
        report(
            wrong_phase["ended"],
            lambda j: f"{OPS[op[j]]} of a request that already ended (finish or abort earlier)",
        )
        report(
            wrong_phase["missing"],
            lambda j: f"{OPS[op[j]]} of a request that does not exist (no extend or prealloc before it)",
        )
        report(wrong_phase["mid-decode"], "extend of a request that is mid-decode")
        report(
            wrong_phase["held"],
            lambda j: f"{OPS[op[j]]} of a request its session holds (extend it for the next turn, "
            "or close it)",
        )
        report(wrong_phase["close-running"], "close of a running request (hold its turn first)")
        report(
            is_finish & self._session[rid] & holds_kv,
            "finish of a streaming session's turn: SGLang keeps it in the session slot, the built-in "
            "allocator frees it (hold the turn, or abort it)",
        )
        report(wrong_phase["close-retracted"], "close of a retracted request, which holds no KV")
        report(wrong_phase["prealloc-held"], "prealloc of a request that already holds KV")
        report(
            wrong_phase["alloc-retracted"],
            lambda j: f"{OPS[op[j]]} of a retracted request (it must be extended again first)",
        )
        report(
            wrong_phase["release-retracted"],
            lambda j: f"{OPS[op[j]]} of a retracted request, which holds no KV (abort ends it)",
        )
        report(
            (is_decode | is_spec) & is_prefill & (target >= 0) & (length < target),
            lambda j: f"{OPS[op[j]]} before the prefill is complete (length {int(length[j])} < "
            + (f"prompt_len {int(target[j])})" if target[j] == known_prompt[j] else
               f"{int(target[j])}, its length when it was retracted)"),
        )
        # Lengths are checked only where the phase made sense (one report per mistake).
        sane = ~np.logical_or.reduce(list(wrong_phase.values()))

        # Lengths. ``before`` is the length the op starts from.
        before = np.where(is_new | is_retracted | is_prealloc, 0, length)  # held: the held length
        expected = before + np.where(is_spec, accepted_len, append_len)
        shrinks = is_alloc & sane & (seq_len < before)
        report(
            shrinks,
            lambda j: f"length shrinks from {int(before[j])} to {int(seq_len[j])} on {OPS[op[j]]}",
        )
        report(
            is_alloc & sane & ~shrinks & (seq_len != expected),
            lambda j: f"seq_len {int(seq_len[j])} inconsistent with {OPS[op[j]]}: length before "
            f"{int(before[j])} + {int(expected[j]) - int(before[j])} appended = {int(expected[j])}",
        )
        report(is_extend & (append_len <= 0), "extend appends no tokens")
        report(
            is_extend & is_new & (prompt_len >= 0) & (seq_len > prompt_len),
            lambda j: f"extend to seq_len {int(seq_len[j])} beyond the prompt_len {int(prompt_len[j])} of a "
            "new request (it prefills its prompt, then decodes)",
        )
        report(
            turn & sane & (prompt_len >= 0) & (seq_len > prompt_len),
            lambda j: f"extend to seq_len {int(seq_len[j])} beyond the prompt_len {int(prompt_len[j])} of a "
            "session's turn (it prefills its prompt, then decodes)",
        )
        report(
            is_extend & is_prefill & (target >= 0) & (length >= target),
            lambda j: f"extend of a request whose prefill is complete (length {int(length[j])} >= "
            + (f"prompt_len {int(target[j])}" if target[j] == known_prompt[j] else
               f"{int(target[j])}, its length when it was retracted")
            + "); after its prefill a request decodes",
        )
        report(is_prealloc & (seq_len <= 0), "prealloc of no tokens")
        report(
            is_decode & (append_len != 1),
            lambda j: f"decode appends {int(append_len[j])} tokens, not 1",
        )
        report(
            is_alloc & (seq_len > self.max_context_len),
            lambda j: f"seq_len {int(seq_len[j])} exceeds config.max_context_len {self.max_context_len}",
        )
        report(
            is_release & (append_len != 0),
            lambda j: f"{OPS[op[j]]} appends {int(append_len[j])} tokens (a release appends none)",
        )
        report(
            (is_finish | is_hold) & sane & (seq_len > length),
            lambda j: f"{OPS[op[j]]} seq_len {int(seq_len[j])} > current length {int(length[j])}",
        )
        report(
            (is_retract | is_abort | is_close) & sane & (seq_len != length),
            lambda j: f"{OPS[op[j]]} seq_len {int(seq_len[j])} != current length {int(length[j])}",
        )

        # Speculative rows.
        if is_spec.any():
            report(
                is_spec & (accepted_len != append_len),
                lambda j: f"spec accepted_len {int(accepted_len[j])} != append_len {int(append_len[j])}",
            )
            report(
                is_spec & (accepted_len > draft_len + 1),
                lambda j: f"accepted_len {int(accepted_len[j])} > draft_len {int(draft_len[j])} + 1",
            )
        # Prompt.
        report(is_new & sane & (prompt_len < 0), "the request's first row has no prompt_len")
        report(
            ~is_new & ~turn & sane & (prompt_len >= 0) & (known_prompt >= 0) & (prompt_len != known_prompt),
            lambda j: f"prompt_len {int(prompt_len[j])} differs from the request's first row "
            f"({int(known_prompt[j])})",
        )
        if not explained.all():  # a safety net: a failing row never goes unreported
            report(~explained, lambda j: f"{OPS[op[j]]} row breaks the op-sequence rules")

    def _check_lists(
        self,
        batch: StepBatch,
        rows: np.ndarray,
        every: bool,
        prompt_len: np.ndarray,
        append_len: np.ndarray,
        rid: np.ndarray,
        found: list[tuple[int, str, int | None]],
    ) -> None:
        """Block hashes and explicit token ids (only rows that carry them cost anything)."""

        def report(mask: np.ndarray, message: object) -> None:
            for j in np.flatnonzero(mask).tolist():
                text = message(j) if callable(message) else message
                found.append((int(rows[j]), str(text), int(rid[j])))

        hashes = batch.block_hashes
        if hashes.valid.any():
            valid = hashes.valid if every else hashes.valid[rows]
            count = hashes.lengths if every else hashes.lengths[rows]
            if not self.block_size:
                if valid.any() and self._once("block_size"):
                    first_only = np.zeros(valid.shape[0], np.bool_)
                    first_only[np.flatnonzero(valid)[0]] = True
                    report(first_only, "block_hashes but the metadata has no block_size (reported once)")
            else:
                bs = self.block_size
                report(valid & (prompt_len < 0), "block_hashes on a row without prompt_len")
                expected = -(-np.maximum(prompt_len, 0) // bs)
                report(
                    valid & (prompt_len >= 0) & (count != expected),
                    lambda j: f"{int(count[j])} block_hashes for prompt_len {int(prompt_len[j])} "
                    f"(expected ceil({int(prompt_len[j])} / {bs}) = {int(expected[j])})",
                )
        tokens = batch.token_ids
        if tokens.valid.any():
            valid = tokens.valid if every else tokens.valid[rows]
            count = tokens.lengths if every else tokens.lengths[rows]
            report(
                valid & (count != append_len),
                lambda j: f"token_ids has {int(count[j])} ids but append_len is {int(append_len[j])}",
            )
            values = tokens.values
            bad_value = (values < 0) | (values >= MAX_EXPLICIT_TOKEN)
            if bad_value.any():
                row_of_value = np.repeat(np.arange(len(batch)), tokens.lengths)
                row_bad = np.zeros(len(batch), np.bool_)
                row_bad[row_of_value[bad_value]] = True
                report(
                    valid & (row_bad if every else row_bad[rows]),
                    "explicit token id outside [0, 2**62) (larger ids are reserved for synthetic content)",
                )
