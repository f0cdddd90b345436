"""The step runner of the differential scenarios: both drivers replay a scenario
(``kvtrace.sglang.scenario``) through an engine with ``run_scenario``.

Imported by ``driver.py`` (inside SGLang's own virtual environment) and by
``ours_driver.py``; like ``scenario`` it needs only the standard library and its
sibling ``scenario``, and imports nothing from kvtrace, allocator or traces.

Step runner (``run_scenario``) — the replay semantics both drivers follow:

* Within a step ops run by kind in ``OP_ORDER`` (finish, abort, retract, prealloc,
  extend, decode, spec), one batched engine call per kind, requests in the
  order the step lists them.
* Out of memory (``--on-oom skip``): a batched allocation that does not fit is
  all-or-nothing; the engine leaves its state exactly as before the call and
  the runner records ``oom`` for that call. Every request of that call becomes
  *stalled*: its later allocation ops are skipped (recorded as ``skipped``)
  until it is retracted (after which it may extend from 0 again) or ends. A
  release of a stalled request uses ``min(seq_len, kv_committed_len)`` as the
  owned length. A release of a request that holds no KV is skipped.
* The prompt length given to the engines (``prompt_lens``: where a
  checkpoint splits the prompt from the output) is where the request's
  prefill first completed (its ``prealloc`` fill, or the extend reaching its
  target), kept across retractions: the only prompt a protocol-driven
  allocator can know (``Allocator.extend`` / ``prealloc`` take no prompt
  length). It equals the op's ``prompt_len`` except for a request stalled
  before its first prefill completed and then retracted (its re-prefill also
  covers the skipped outputs), and a ``prealloc`` whose fill runs past its
  ``prompt_len``.
* ``retract`` passes ``remaining`` to the engine: the requests that still hold
  KV and have completed their prefill once the step's finish and abort ops and
  this and the earlier retractions of the step are applied (SGLang's
  ``retract_decode``: the running batch not retracted yet). A retracted request
  that never completed its prefill (stalled mid-prefill) was not running and
  does not lower it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .scenario import OP_ORDER, CallResult, Engine, Op, Scenario, ScenarioError, Step, TokenBook

__all__ = ["RunStats", "run_scenario"]


@dataclass
class _ReqTrack:
    length: int = 0  # the scenario's L (== kv_committed_len while the engines agree)
    target: int = -1  # where the current prefill ends: the prompt, or the length at retraction
    holds: bool = False
    stalled: bool = False
    prefill_done: bool = False
    ended: bool = False
    prompt: int = -1  # the length at which the prefill first completed (the engines' prompt)

    def engine_prompt_len(self) -> int:
        """The prompt length the engines see: where the prefill first completed, or
        (not completed yet) where the current prefill will complete."""
        return self.prompt if self.prompt >= 0 else self.target


@dataclass
class RunStats:
    steps: int = 0
    ops: int = 0
    oom_calls: int = 0
    skipped_ops: int = 0
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def run_scenario(scenario: Scenario, engine: Engine, emit: Any, fine: bool = False) -> RunStats:
    """Drive ``engine`` through ``scenario``; call ``emit(dump_dict)`` after every step
    (``fine``: also after every batched call, with ``"phase"`` naming the call).

    The runner reads no engine state inside a step (a read could make an engine
    apply deferred work, such as the end-of-step prompt publish, early): which
    request holds KV and how long it is follow from the call outcomes. The
    engine's state is read once per step, by ``dump``.

    Raises ``ScenarioError`` for an impossible op sequence (extend of a request
    holding KV to a shorter length, decode of a request without KV, ...).
    """
    book = TokenBook()
    track: dict[int, _ReqTrack] = {}
    stats = RunStats()
    t0 = time.perf_counter()

    def where(step: Step, op: Op) -> str:
        return f"scenario {scenario.name!r} step {step.step} {op.op} r{op.rid}"

    for step in scenario.steps:
        events: list[dict[str, Any]] = []
        mids: list[dict[str, Any]] = []  # --fine dumps between the calls of this step
        by_kind: dict[str, list[Op]] = {k: [] for k in OP_ORDER}
        for op in step.ops:
            by_kind[op.op].append(op)
        stats.ops += len(step.ops)

        def record(kind: str, rids: list[int], res: CallResult | None, skipped: list[int]) -> None:
            ev: dict[str, Any] = {"op": kind}
            if rids:
                ev["rids"] = rids
                ev["outcome"] = res.outcome if res else "ok"
                if res and res.row_overflow:
                    ev["row_overflow"] = [list(x) for x in res.row_overflow]
            if skipped:
                ev["skipped"] = skipped
                stats.skipped_ops += len(skipped)
            events.append(ev)
            if fine and rids:
                mid = engine.dump(sorted(r for r, t in track.items() if t.holds), final=False)
                mid.update(step=step.step, phase=kind, events=[ev])
                mids.append(mid)

        # --- releases: finish and abort, then retract --------------------------------
        for kind in ("finish", "abort"):
            ops = by_kind[kind]
            if not ops:
                continue
            rids, owned, toks, plens, skipped = [], [], [], [], []
            for op in ops:
                t = track.get(op.rid)
                if t is None or not t.holds:
                    skipped.append(op.rid)
                else:
                    n = op.seq_len if not t.stalled else min(op.seq_len, t.length)
                    rids.append(op.rid)
                    owned.append(n)
                    toks.append(book.tokens(op.rid, max(n, t.length)))
                    plens.append(t.engine_prompt_len())
                    t.holds = False
                if t is not None:
                    t.ended = True
            res = engine.release(kind, rids, owned, toks, plens, [0] * len(rids)) if rids else None
            record(kind, rids, res, skipped)

        if by_kind["retract"]:
            running = sum(1 for t in track.values() if t.holds and t.prefill_done and not t.ended)
            rids, owned, toks, plens, remaining, skipped = [], [], [], [], [], []
            for op in by_kind["retract"]:
                t = track.get(op.rid)
                if t is None or not t.holds:
                    skipped.append(op.rid)
                else:
                    rids.append(op.rid)
                    owned.append(min(op.seq_len, t.length))
                    toks.append(book.tokens(op.rid, max(op.seq_len, t.length)))
                    plens.append(t.engine_prompt_len())
                    if t.prefill_done:  # (a request stalled mid-prefill was not running)
                        running -= 1
                    remaining.append(running)
                if t is not None:
                    # A retracted request re-prefills everything the scenario says it had
                    # (prompt and outputs): the op's length, also for a stalled request
                    # whose KV stopped short of it (the skipped ops' tokens are recomputed).
                    t.target = op.seq_len
                    t.length, t.holds, t.stalled, t.prefill_done = 0, False, False, False
            res = engine.release("retract", rids, owned, toks, plens, remaining) if rids else None
            record("retract", rids, res, skipped)

        # --- prealloc ---------------------------------------------------------------
        if by_kind["prealloc"]:
            rids, fills, toks, plens, skipped = [], [], [], [], []
            for op in by_kind["prealloc"]:
                t = track.setdefault(op.rid, _ReqTrack())
                book.note_first(op)
                if t.stalled or t.holds:
                    skipped.append(op.rid)
                    continue
                book.append(op, 0)
                rids.append(op.rid)
                fills.append(op.seq_len)
                toks.append(book.tokens(op.rid, op.seq_len))
                plens.append(t.prompt if t.prompt >= 0 else op.seq_len)
            res = engine.prealloc(rids, fills, toks, plens) if rids else None
            _settle(res, rids, track, [("len", n) for n in fills], done=[True] * len(rids))
            record("prealloc", rids, res, skipped)

        # --- extend ------------------------------------------------------------------
        if by_kind["extend"]:
            rids, lens, toks, plens, done, skipped = [], [], [], [], [], []
            for op in by_kind["extend"]:
                t = track.setdefault(op.rid, _ReqTrack())
                book.note_first(op)
                if t.stalled:
                    skipped.append(op.rid)
                    continue
                start = t.length if t.holds else 0
                if op.seq_len <= start:
                    raise ScenarioError(f"{where(step, op)}: extend to {op.seq_len} but the request holds {start}")
                if t.holds and t.prefill_done:
                    raise ScenarioError(f"{where(step, op)}: extend of a request that already decodes")
                book.append(op, start)
                if t.target < 0:
                    t.target = book.prompt_len[op.rid]
                rids.append(op.rid)
                lens.append(op.seq_len)
                toks.append(book.tokens(op.rid, op.seq_len))
                plens.append(t.engine_prompt_len())
                done.append(op.seq_len >= t.target)
            res = engine.extend(rids, lens, toks, plens, done) if rids else None
            _settle(res, rids, track, [("len", n) for n in lens], done=done)
            record("extend", rids, res, skipped)

        # --- decode / spec -----------------------------------------------------------
        for kind in ("decode", "spec"):
            if not by_kind[kind]:
                continue
            rids, adds, skipped = [], [], []
            for op in by_kind[kind]:
                t = track.get(op.rid)
                if t is None or t.stalled or not t.holds:
                    if t is None or not t.stalled:
                        raise ScenarioError(f"{where(step, op)}: {kind} of a request that holds no KV")
                    skipped.append(op.rid)
                    continue
                if not t.prefill_done:
                    raise ScenarioError(f"{where(step, op)}: {kind} before the prefill completed")
                book.append(op, t.length)
                rids.append(op.rid)
                adds.append(1 if kind == "decode" else op.accepted)
            if kind == "decode":
                res = engine.decode(rids) if rids else None
            else:
                res = engine.spec(rids, adds) if rids else None
            _settle(res, rids, track, [("add", a) for a in adds])
            record(kind, rids, res, skipped)

        live = sorted(rid for rid, t in track.items() if t.holds)
        # The last call's own dump is dropped: an engine may finish the step's deferred
        # work (the prompt publish) inside that call, and the final dump covers it.
        for mid in mids[:-1]:
            emit(mid)
        state = engine.dump(live, final=True)
        state["step"] = step.step
        state["events"] = events
        if fine:
            state["phase"] = "end"
        stats.oom_calls += sum(1 for e in events if e.get("outcome") == "oom")
        emit(state)
        stats.steps += 1
    stats.wall_s = time.perf_counter() - t0
    return stats


def _settle(
    res: CallResult | None, rids: list[int], track: dict[int, _ReqTrack],
    lens: list[tuple[str, int]], done: list[bool] | None = None,
) -> None:
    if res is None:
        return
    if res.outcome != "ok":
        for rid in rids:
            track[rid].stalled = True
        return
    for i, (rid, (how, n)) in enumerate(zip(rids, lens)):
        t = track[rid]
        t.length = n if how == "len" else t.length + n
        t.holds = True
        if done is not None and done[i]:
            t.prefill_done = True
            if t.prompt < 0:
                t.prompt = t.length
