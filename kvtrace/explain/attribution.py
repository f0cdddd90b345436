"""Attribution: every admission's missed prefix tokens, split into causes that sum exactly.

An admission is a request's first extend (or its first after a retraction); it misses
``prefill_target - prefix_hit`` tokens (the replay's ``admitted_tokens - reused_tokens``).
They split, in prompt order::

    0        hit         infinite ceiling A    other N       seen U      target T
    |--------|==========================|------------|-----------|------------|
      reused   evicted / out_of_window /  namespace     floor        cold
               uncached

- ``evicted``: cached once, evicted since: each token names the eviction (step, trigger,
  the request whose call evicted it);
- ``out_of_window``: the full KV is cached but the SWA KV is not (a sliding-window tree's
  tombstones);
- ``uncached``: computed before but never put in the cache, or not yet (a prefill
  still in flight, a request aborted or retracted before its tokens were cached);
- ``namespace``: computed before, but only in another cache namespace (another LoRA
  adapter, ``cache_salt`` or extra key: ``traces.namespaces``), which SGLang never
  shares: an infinite cache would miss them too;
- ``floor``: computed before, but in a partial last page or past the match cap (SGLang
  matches at most ``len - 1`` tokens): no page size ``page_size`` cache can hold it;
- ``cold``: never computed before (or past the first chunk of a chunked prefill);
- ``retraction``: a retracted request's re-admission: everything it misses is
  recomputation (its per-request cost is kept too).

What was ever computed is a ``Shadow`` per namespace keyed by the replay's pages (the same
keying as the replay's cache: the namespace, then token ids or EAGLE bigram units, one
digest per page), never evicted; a trace with namespaces keeps one more, blind to them
(what was computed in any namespace: the ``namespace`` cause). It
keeps, per page, the id of the eviction that last removed it from the replay's cache (0:
none), so its memory is bounded by the distinct pages computed.
The replay's cache reports stores and evictions through its ``TreeListener``; the
trigger and the request of an eviction come from the allocator call the engine is making
(the engine's ``ReplayObserver`` API: ``ReplaySession.observers``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from allocator.base import AllocResult
from kvtrace.replay.engine import AllocCall
from allocator.pages import floor_align
from allocator.radix_cache import RadixCache, TreeNode
from kvtrace.errors import ConfigError
from kvtrace.explain.shadow import Shadow
from traces.namespaces import in_namespace, key_prefix, namespace_of

if TYPE_CHECKING:
    from kvtrace.explain.oracle import OracleStream
    from kvtrace.replay.session import ReplaySession

__all__ = ["CAUSES", "STEP_COLUMNS", "Attribution", "EvictionRecord", "Trigger"]

Cause = Literal["cold", "floor", "uncached", "evicted", "namespace", "out_of_window", "retraction"]
CAUSES: tuple[Cause, ...] = ("cold", "floor", "uncached", "evicted", "namespace", "out_of_window", "retraction")
# The state log's columns of ``replay --explain --out``: each step's missed tokens by cause.
STEP_COLUMNS: tuple[str, ...] = tuple(f"explain_{cause}" for cause in CAUSES)
Trigger = Literal["admission", "decode", "spec_reserve", "retraction", "prealloc", "other"]


# The trigger of an eviction made by each kind of allocator call.
_TRIGGER_OF_OP: dict[str, Trigger] = {
    "extend": "admission", "decode": "decode", "spec": "spec_reserve", "prealloc": "prealloc",
    "retract": "retraction", "finish": "other", "abort": "other",
}


@dataclass(frozen=True, slots=True)
class EvictionRecord:
    """One allocator call's eviction: when, why, whose call."""

    step: int
    trigger: Trigger
    rid: int  # the request whose call evicted (the first of its batch)
    batch_size: int  # requests in that call


@dataclass(slots=True)
class _Pending:
    step: int
    trigger: Trigger
    rid: int
    batch_size: int
    record_id: int = 0  # assigned at the call's first eviction


@dataclass
class Attribution:
    """Missed tokens by cause, gathered while a ``ReplaySession`` runs (``attach``).

    Attributes:
        causes: tokens missed by cause, over every admission.
        admissions: admissions seen; ``admitted_tokens`` / ``reused_tokens`` as the replay counts them.
        infinite_tokens: tokens an infinite cache would have reused (hit + evicted + out of window).
        records: every eviction (id ``i + 1`` is ``records[i]``), ``record_tokens`` its tokens
            evicted and ``record_missed`` the tokens later missed because of it.
        retraction_cost: per retracted request, tokens recomputed at its re-admissions.
        eviction_ages: (age in steps, tokens) of every evicted node since it was stored.
    """

    page_size: int = 1
    causes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0))
    admissions: int = 0
    admitted_tokens: int = 0
    reused_tokens: int = 0
    infinite_tokens: int = 0
    records: list[EvictionRecord] = field(default_factory=list)
    record_tokens: list[int] = field(default_factory=list)
    record_missed: dict[int, int] = field(default_factory=dict)
    unknown_evictor_tokens: int = 0
    retraction_cost: dict[int, int] = field(default_factory=dict)
    eviction_ages: list[tuple[int, int]] = field(default_factory=list)
    per_request: dict[int, dict[str, int]] = field(default_factory=dict)
    # Per request, its evicted missed tokens by eviction id (None: not kept; the
    # dashboard's panel keeps them, ``keep_request_evictions``).
    request_evictions: dict[int, dict[int, int]] | None = None
    # Called at each admission that missed evicted tokens: (rid, {eviction id: tokens});
    # ``kvtrace export --flows`` draws an arrow from each eviction to the admission.
    _last_causes: tuple[int, ...] | None = field(default=None, repr=False, compare=False)
    on_evicted_miss: Callable[[int, dict[int, int]], None] | None = field(default=None, repr=False, compare=False)

    # ------------------------------------------------------------------ wiring
    @classmethod
    def attach(cls, session: ReplaySession, oracle: OracleStream | None = None, *,
               keep_request_evictions: bool = False) -> Attribution:
        """Watch ``session`` (before its first step) and return what it gathers.

        A step replayed again (a dashboard's seek back, its checkpoints filled in) is
        not counted again: only steps past the highest one seen are watched, and the
        tree's listener follows the session to a fresh allocator (a restart).

        Args:
            session: the session, not yet stepped.
            oracle: the page model's stream, fed along (None: no oracle).
            keep_request_evictions: keep each request's evicted tokens by eviction
                (``request_evictions``, for ``evictions_of``).

        Raises:
            ConfigError: the session's allocator has no radix cache (``tree_cache``), or it is off.
        """
        tree = getattr(session.allocator, "tree_cache", None)
        if not isinstance(tree, RadixCache):
            raise ConfigError(f"allocator '{session.version.spec}' has no radix cache: no prefix hit to explain")
        if tree.disable:
            raise ConfigError(
                "the radix cache is off in this configuration (radix_cache false in the trace or the version): "
                "no prefix hit to explain"
            )
        self = cls(page_size=tree.page_size, request_evictions={} if keep_request_evictions else None)
        self._setup(session, tree, oracle)
        return self

    def _setup(self, session: ReplaySession, tree: RadixCache, oracle: OracleStream | None) -> None:
        from allocator.swa_radix import SwaRadixCache

        self._session = session
        self._engine = session.engine
        self._tree = tree
        self._swa = isinstance(tree, SwaRadixCache)
        self._oracle = oracle
        # what was computed, per namespace (its key prefix: b"" for none), and in any one
        self._seen: dict[bytes, Shadow] = {b"": Shadow(tree.page_size)}
        self._any = Shadow(tree.page_size) if session.meta.namespaces is not None else None
        self._inserted: dict[int, int] = {}  # per live request: key units in the shadow
        self._step = -1
        self._call: _Pending | None = None
        self._retracted: dict[int, int] = {}
        self._stored_step: dict[int, int] = {}
        self._current = -1  # the step the engine replays now
        self._done = -1  # every step up to this one was watched whole
        self._again = False  # the step now is one replayed before: ignored
        session.observers.append(self)  # kept across the session's restarts
        self._listen(tree)

    def _listen(self, tree: RadixCache) -> None:
        self._tree = tree
        if tree.listener is self or isinstance(tree.listener, _Tee) and tree.listener.second is self:
            return
        tree.listener = self if tree.listener is None else _Tee(tree.listener, self)

    # ------------------------------------------------------------------ the tree's listener
    def stored(self, leaf: TreeNode) -> None:
        if self._again:
            return
        # NOTE: the shadow is not told: its units were inserted when computed, and an old
        # eviction id on a unit stored again is never read (a unit in the cache is a hit;
        # evicted again, it takes the new id).
        self._stored_step[leaf.id] = self._step

    def split(self, upper: TreeNode, child: TreeNode) -> None:
        if self._again:
            return
        self._stored_step[upper.id] = self._stored_step.get(child.id, self._step)

    def removed(self, node: TreeNode) -> None:
        if self._again:
            return
        call = self._call
        if call is None:
            call = self._call = _Pending(self._step, "other", -1, 0)
        if call.record_id == 0:
            self.records.append(EvictionRecord(call.step, call.trigger, call.rid, call.batch_size))
            self.record_tokens.append(0)
            call.record_id = len(self.records)
        n = len(node)
        self.record_tokens[call.record_id - 1] += n
        path = _path_bytes(node)
        ps = self.page_size
        hi = len(path) // 8 // ps  # the tree's nodes are whole pages
        self._shadow(getattr(node, "ns", b"")).mark(path, hi - n // ps, hi, call.record_id)
        born = self._stored_step.pop(node.id, None)
        if born is not None:
            self.eviction_ages.append((self._step - born, n))

    # ------------------------------------------------------------------ the engine's calls (ReplayObserver)
    def step_started(self, step: int) -> None:
        # A step begins again after an allocator refused a run of it (the same step), and a
        # seek back starts an earlier one: every step up to the one then replayed is done.
        if step != self._current:
            self._done = max(self._done, self._current)
            self._current = step
        self._again = step <= self._done
        if self._again:
            return
        self._step = step
        session = self._session
        if session.engine is not self._engine:  # restarted: a fresh allocator
            self._engine = session.engine
            tree = getattr(session.allocator, "tree_cache", None)
            if isinstance(tree, RadixCache):
                self._listen(tree)

    def call_started(self, call: AllocCall) -> None:
        if self._again:
            return
        rids = call.rids
        rid = int(rids[0]) if rids.shape[0] else -1
        if call.admitted is not None and call.admitted.any():
            rid = int(rids[call.admitted][0])  # an admission's eviction names the admitted request
        self._call = _Pending(self._step, _TRIGGER_OF_OP[call.op], rid, int(rids.shape[0]))
        if call.op == "finish":
            self._finish(call.rids, call.token_ids)  # seen before the cache stores it
        elif call.op == "abort":
            for rid in call.rids.tolist():
                self._inserted.pop(rid, None)

    def call_ended(self, call: AllocCall, result: object) -> None:
        if self._again:
            return
        if call.op == "extend" and isinstance(result, AllocResult):
            assert call.seq_lens is not None and call.token_ids is not None and call.admitted is not None
            self._after_extend(call, result.prefix_lens)
            self._published(call.seq_lens, call.token_ids, call.prefill_done)
        elif call.op == "retract":
            assert call.seq_lens is not None
            self._retract(call.rids, call.seq_lens)
        self._call = None

    def _after_extend(self, call: AllocCall, prefix: np.ndarray | None) -> None:
        tree = self._tree
        rids, seq_lens, token_ids, admitted = call.rids, call.seq_lens, call.token_ids, call.admitted
        assert seq_lens is not None and token_ids is not None and admitted is not None
        keys = [self._key(token_ids[i], int(seq_lens[i])) for i in range(rids.shape[0])]
        raws: dict[int, bytes] = {}
        if prefix is not None and admitted.any():
            targets = call.prefill_targets  # what the replay counts as admitted
            assert targets is not None
            for i in np.flatnonzero(admitted).tolist():
                raws[i] = keys[i].tobytes()
                self._admit(int(rids[i]), int(targets[i]), int(prefix[i]), keys[i], raws[i], int(seq_lens[i]))
        # Computed now: seen by later calls (not by this batch's other requests).
        inserted = self._inserted
        for i, rid in enumerate(rids.tolist()):
            key = keys[i]
            if key.shape[0]:
                self._insert(key, inserted.get(rid, 0), raws.get(i))
                inserted[rid] = key.shape[0]

    def _admit(self, rid: int, target: int, hit: int, key_full: np.ndarray, raw: bytes, seq_len: int) -> None:
        """Split one admission's ``target - hit`` missed tokens into causes (counted in the
        replay's ``--steps`` window only, as the replay counts its admissions)."""
        retracted = self._retracted.pop(rid, None)
        if not self._engine.in_window:
            if self._oracle is not None:
                self._oracle.insert(key_full)
            return
        self.admissions += 1
        self.admitted_tokens += target
        self.reused_tokens += hit
        missed = target - hit
        got = dict.fromkeys(CAUSES, 0)
        if self._oracle is not None:
            self._oracle.access(self._step, key_full, seq_len, target, hit, self._tree.is_eagle)
        ps = self.page_size
        # SGLang's match key: capped at len - 1 tokens (``Kvallocator.extend``).
        match_units = max(min(key_full.shape[0], seq_len - 1 - (1 if self._tree.is_eagle else 0)), 0)
        shadow = self._shadow(key_prefix(key_full))
        seen = shadow.seen_len(raw)
        ceiling = max(floor_align(min(seen, match_units), ps), hit)
        if ceiling > hit:  # both whole pages
            recs = shadow.recs(raw, hit // ps, ceiling // ps)
            if ps > 1:
                recs = np.repeat(recs, ps)
            if self._swa:  # the full KV still cached, past the SWA-gated hit: out of the window
                full = RadixCache.peek_prefix_len(self._tree, key_full[:match_units])
                window = min(max(full - hit, 0), recs.shape[0])
                got["out_of_window"] = window
                recs = recs[window:]
            gone = recs[recs > 0]
            if gone.shape[0]:
                if retracted is None:
                    ids, counts = np.unique(gone, return_counts=True)
                    for rec, n in zip(ids.tolist(), counts.tolist()):
                        self.record_missed[rec] = self.record_missed.get(rec, 0) + n
                    if self.on_evicted_miss is not None:
                        self.on_evicted_miss(rid, dict(zip(ids.tolist(), counts.tolist())))
                    if self.request_evictions is not None:
                        mine = self.request_evictions.setdefault(rid, {})
                        for rec, n in zip(ids.tolist(), counts.tolist()):
                            mine[rec] = mine.get(rec, 0) + n
                got["evicted"] += int(gone.shape[0])
            got["uncached"] += int(recs.shape[0] - gone.shape[0])
        self.infinite_tokens += hit + got["evicted"] + got["out_of_window"]
        if self._any is not None:  # computed in another namespace only, up to where this one could hit
            seen_any = self._any.seen_len(raw)
            other = max(floor_align(min(seen_any, match_units), ps), ceiling)
            got["namespace"] = other - ceiling
            ceiling = other
            seen = max(seen, seen_any)
        got["floor"] = max(min(seen, target) - ceiling, 0)
        got["cold"] = missed - sum(got.values())
        assert got["cold"] >= 0, f"request {rid}: causes {got} exceed the {missed} missed tokens"
        if retracted is not None:  # whatever the reason, it is the retraction's recomputation
            got = dict.fromkeys(CAUSES, 0)
            got["retraction"] = missed
            self.retraction_cost[rid] = self.retraction_cost.get(rid, 0) + missed
        self._add(rid, got)

    def _add(self, rid: int, got: dict[str, int]) -> None:
        mine = self.per_request.setdefault(rid, dict.fromkeys(CAUSES, 0))
        for cause, n in got.items():
            self.causes[cause] += n
            mine[cause] += n

    def step_causes(self) -> tuple[int, ...]:
        """Tokens missed by cause (``CAUSES`` order) since the previous call: a step's,
        called once a step (the state log's ``STEP_COLUMNS``)."""
        now = tuple(self.causes[c] for c in CAUSES)
        last = self._last_causes if self._last_causes is not None else (0,) * len(CAUSES)
        self._last_causes = now
        return tuple(a - b for a, b in zip(now, last))

    def evictions_of(self, rid: int) -> list[tuple[EvictionRecord, int]]:
        """The evictions whose tokens request ``rid`` missed (``keep_request_evictions``),
        with the tokens of each it missed, most first (then the earliest)."""
        mine = (self.request_evictions or {}).get(rid, {})
        order = sorted(mine.items(), key=lambda kv: (-kv[1], kv[0]))
        return [(self.records[rec - 1], n) for rec, n in order]

    def _retract(self, rids: np.ndarray, owned: np.ndarray) -> None:
        for rid, n in zip(rids.tolist(), np.asarray(owned).tolist()):
            self._retracted[rid] = n

    def _finish(self, rids: np.ndarray, tokens: Sequence[np.ndarray] | None) -> None:
        if tokens is None:
            return
        inserted = self._inserted
        for rid, toks in zip(rids.tolist(), tokens):
            key = self._key(toks)
            if key.shape[0]:
                self._insert(key, inserted.pop(rid, 0))
            if self._oracle is not None:
                self._oracle.insert(key)

    def _published(self, seq_lens: np.ndarray, token_ids: Sequence[np.ndarray], done: np.ndarray | None) -> None:
        if self._oracle is None:
            return
        for i in range(len(token_ids)):
            if done is None or bool(done[i]):
                self._oracle.insert(self._key(token_ids[i], int(seq_lens[i])))

    def _key(self, token_ids: np.ndarray, n: int | None = None) -> np.ndarray:
        """The tree's key of a request's first ``n`` token ids, in its namespace."""
        return self._tree.make_key(in_namespace(np.asarray(token_ids)[:n], namespace_of(token_ids)))

    def _shadow(self, ns: bytes) -> Shadow:
        """What was computed in the namespace of key prefix ``ns``."""
        shadow = self._seen.get(ns)
        if shadow is None:
            shadow = self._seen[ns] = Shadow(self.page_size)
        return shadow

    def _insert(self, key: np.ndarray, known: int, raw: bytes | None = None) -> None:
        self._shadow(key_prefix(key)).insert(key, known, raw)
        if self._any is not None:
            self._any.insert(key, known, raw)


def _path_bytes(node: TreeNode) -> bytes:
    parts = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    parts.reverse()
    return b"".join(parts)


class _Tee:
    """Two tree listeners (the KV-event publisher and explain), told in order."""

    def __init__(self, first: Any, second: Any) -> None:
        self.first, self.second = first, second

    def stored(self, leaf: TreeNode) -> None:
        self.first.stored(leaf)
        self.second.stored(leaf)

    def split(self, upper: TreeNode, child: TreeNode) -> None:
        self.first.split(upper, child)
        self.second.split(upper, child)

    def removed(self, node: TreeNode) -> None:
        self.first.removed(node)
        self.second.removed(node)
