"""A trace in memory as one table of rows, and the smaller traces cut from it.

``TraceTable`` holds the rows of the trace being shrunk (up to the failing step)
as flat columns in file order, and what the cuts need to know about each row:
which request it belongs to, whether it is the request's first row, and which
*unit* removes it. A ``Candidate`` is a smaller trace described against that
table: the rows it keeps, new lengths for some rows, and a smaller serving
configuration. ``build`` turns a candidate into steps a ``TraceWriter`` takes,
recomputing every request's lengths so the op sequences stay legal.

Units: a row can be removed only with its unit, so what remains is still a legal
op sequence (``traces.checker``):

* a request's first row (its admission: ``extend`` or ``prealloc``) is never
  removed alone: the request goes as a whole;
* a prefill chunk, a ``decode``, a ``spec``, a ``finish`` or an ``abort`` is its own unit;
* a ``retract`` takes with it the rows that re-admit the request (the ``extend``
  chunks from 0 or the ``prealloc`` right after it): without the retraction the
  request simply carries on.

Lengths: each kept row appends what it appended in the recording (or the shorter
length a candidate gives it: only the rows of the first prefill and pre-allocations
may be shorter, ``shortenable``); a request's length is the running sum of its rows'
appends, restarting at its admission and at each re-admission. A ``finish`` owns
what it owned in the recording minus the tokens the request no longer has; the
prompt shrinks by what was cut out of the first prefill (its block hashes and
explicit token ids are cut to fit).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np

from allocator.pages import ceil_align
from traces.batches import Ragged, StepBatch
from traces.metadata import TraceMeta
from traces.namespaces import NamespaceTable
from traces.schema import ABORT, DECODE, EXTEND, FINISH, PREALLOC, RETRACT, SPEC

__all__ = ["Candidate", "Size", "TraceTable", "build"]

_COLUMNS = ("step", "op", "rid", "seq_len", "append_len", "draft_len", "accepted_len", "prefix_len", "prompt_len")


class Size(NamedTuple):
    """How big a trace is; smaller compares lower (requests first, then steps, ...)."""

    requests: int
    steps: int
    ops: int
    tokens: int  # tokens the ops append
    pool_tokens: int
    max_running: int
    max_context_len: int

    def to_dict(self) -> dict[str, int]:
        return {"requests": self.requests, "steps": self.steps, "ops": self.ops, "tokens": self.tokens,
                "pool_tokens": self.pool_tokens}


@dataclass(frozen=True)
class Candidate:
    """A smaller trace, described against a ``TraceTable``.

    Attributes:
        rows: int64 sorted indices of the table's rows kept.
        append: new (shorter) append lengths of some kept ``extend`` / ``prealloc``
            rows, by table row.
        pool_tokens, max_running, max_context_len: the serving configuration (None: the table's).
    """

    rows: np.ndarray
    append: dict[int, int] = field(default_factory=dict)
    pool_tokens: int | None = None
    max_running: int | None = None
    max_context_len: int | None = None

    def keeping(self, rows: np.ndarray) -> Candidate:
        """This candidate with only ``rows`` (a subset of its rows) kept."""
        if not self.append:
            return replace(self, rows=rows)
        changed = np.fromiter(self.append, np.int64)
        still = set(changed[np.isin(changed, rows)].tolist())
        return replace(self, rows=rows, append={r: n for r, n in self.append.items() if r in still})


class TraceTable:
    """The rows of a trace (in file order) and the units that remove them.

    Args:
        meta: the trace's metadata (what-if page size and pool already applied).
        steps: its steps, in order.

    Attributes:
        step, op, rid, seq_len, append_len, draft_len, accepted_len, prefix_len,
            prompt_len, block_hashes, token_ids: the trace's columns, one entry per row.
        arrival_s: float64 per row, NaN where none (None: no row has one; a
            request's arrival is on its first row, which goes only with the request).
        first: bool per row: the request's first row (its admission).
        readmit: bool per row: a row that re-admits a retracted request.
        first_prefill: bool per row: the admission and the prefill chunks right after it.
        shortenable: bool per row: a row a candidate may give a shorter length.
        finish_tail: int64 per row: tokens a ``finish`` leaves unowned (an early stop).
        unit: int64 per row: the row that heads its unit (itself, or the ``retract``
            that re-admits it), -1 for a request's first row (never removed alone).
        prompt: int64 per request id: its prompt length (-1: no such request).
    """

    op: np.ndarray  # int8 [n]
    rid: np.ndarray  # int64 [n]
    seq_len: np.ndarray  # int64 [n]
    append_len: np.ndarray  # int32 [n]
    draft_len: np.ndarray  # int32 [n]
    accepted_len: np.ndarray  # int32 [n]
    prefix_len: np.ndarray  # int64 [n]
    prompt_len: np.ndarray  # int64 [n], -1 = null
    arrival_s: np.ndarray | None  # float64 [n], NaN = null

    def __init__(self, meta: TraceMeta, steps: list[StepBatch]) -> None:
        self.meta = meta
        counts = np.array([len(b) for b in steps], np.int64)
        self.num_rows = int(counts.sum())
        self.step = np.repeat(np.array([b.step for b in steps], np.int64), counts)
        self.step_time = {b.step: b.time_s for b in steps}
        for name in _COLUMNS[1:]:
            parts = [getattr(b, name) for b in steps]
            setattr(self, name, np.concatenate(parts) if parts else np.zeros(0, np.int64))
        self.block_hashes = Ragged.concat([b.block_hashes for b in steps]) if steps else Ragged.empty(0, np.uint64)
        self.token_ids = Ragged.concat([b.token_ids for b in steps]) if steps else Ragged.empty(0, np.int64)
        has_arrival = any(b.arrival_s is not None for b in steps)
        self.arrival_s = np.concatenate([b.arrivals() for b in steps]) if has_arrival else None
        self._derive()

    # ------------------------------------------------------------------ per-row facts
    def _derive(self) -> None:
        n = self.num_rows
        op, rid = self.op, self.rid
        by_request = np.lexsort((np.arange(n), rid))  # each request's rows, in file order
        r, o = rid[by_request], op[by_request]
        starts = np.ones(n, np.bool_)
        starts[1:] = r[1:] != r[:-1]
        prev = np.full(n, -1, np.int64)  # the request's previous row (-1: none)
        prev[by_request[1:]] = np.where(starts[1:], -1, by_request[:-1])
        self.first = np.zeros(n, np.bool_)
        self.first[by_request[starts]] = True
        prev_op = np.where(prev >= 0, op[np.maximum(prev, 0)], -1)
        # tokens a finish leaves unowned (a stop that landed early): kept as recorded
        prev_len = np.where(prev >= 0, self.seq_len[np.maximum(prev, 0)], 0)
        self.finish_tail = np.where(op == FINISH, prev_len - self.seq_len, 0)
        # re-admission: the rows that bring a retracted request back (after its retract)
        self.readmit = (prev_op == RETRACT) & ((op == EXTEND) | (op == PREALLOC))
        unit = np.arange(n, dtype=np.int64)
        unit[self.readmit] = prev[self.readmit]
        # runs of extend rows: each run is headed by an admission, a re-admission, or
        # nothing else (a valid trace extends only those); its chunks follow the head
        is_ext = o == EXTEND
        run_start = is_ext.copy()
        run_start[1:] &= ~(is_ext[:-1] & ~starts[1:])
        ext_rows = by_request[is_ext]
        ext_head = by_request[run_start][(np.cumsum(run_start) - 1)[is_ext]]  # the head of each one's run
        in_readmit = self.readmit[ext_head]
        unit[ext_rows[in_readmit]] = prev[ext_head[in_readmit]]
        self.first_prefill = self.first.copy()
        self.first_prefill[ext_rows[self.first[ext_head]]] = True
        unit[self.first] = -1
        self.unit = unit
        # rows a candidate may shorten: the first prefill (the prompt shrinks with it) and
        # pre-allocations; a re-admission must rebuild at least the prompt
        self.shortenable = self.first_prefill | (op == PREALLOC)
        rid_max = int(rid.max()) + 1 if n else 0
        self.prompt = np.full(rid_max, -1, np.int64)
        self.prompt[rid[self.first]] = self.prompt_len[self.first]

    # ------------------------------------------------------------------ views
    def all_rows(self) -> Candidate:
        """The whole table as a candidate."""
        return Candidate(np.arange(self.num_rows, dtype=np.int64))

    def size(self, cand: Candidate) -> Size:
        """The size of a candidate."""
        rows = cand.rows
        cfg = self.meta.config
        tokens = int(self.append_len[rows].sum()) - sum(int(self.append_len[r]) - n for r, n in cand.append.items())
        return Size(
            requests=int(np.unique(self.rid[rows]).shape[0]),
            steps=int(np.unique(self.step[rows]).shape[0]),
            ops=int(rows.shape[0]),
            tokens=tokens,
            pool_tokens=cand.pool_tokens or cfg.pool_tokens,
            max_running=cand.max_running or cfg.max_running,
            max_context_len=cand.max_context_len or cfg.max_context_len,
        )

    def steps_of(self, cand: Candidate) -> np.ndarray:
        """The table's step numbers a candidate keeps, in order (its step ``i`` is entry ``i``)."""
        return np.unique(self.step[cand.rows])

    def without_units(self, cand: Candidate, heads: np.ndarray) -> Candidate:
        """``cand`` without the units headed by ``heads`` (every row of each)."""
        keep = ~np.isin(self.unit[cand.rows], heads)
        return cand.keeping(cand.rows[keep])

    def without_requests(self, cand: Candidate, rids: np.ndarray) -> Candidate:
        """``cand`` without every row of the requests ``rids``."""
        return cand.keeping(cand.rows[~np.isin(self.rid[cand.rows], rids)])

    def up_to_step(self, cand: Candidate, step: int) -> Candidate:
        """``cand`` without the rows after table step ``step``."""
        return cand.keeping(cand.rows[self.step[cand.rows] <= step])

    def appends(self, cand: Candidate) -> np.ndarray:
        """int64 per kept row: what it appends in the candidate."""
        a = self.append_len[cand.rows].astype(np.int64)
        if cand.append:
            where = np.searchsorted(cand.rows, np.fromiter(cand.append, np.int64))
            a[where] = np.fromiter(cand.append.values(), np.int64)
        return a

    def peak_running(self, cand: Candidate) -> int:
        """The most requests of a candidate alive in one step (from their first row to
        their finish or abort; a request that never ends lives to the last step)."""
        rows = cand.rows
        rid, op = self.rid[rows], self.op[rows]
        steps, at = np.unique(self.step[rows], return_inverse=True)
        _, first = np.unique(rid, return_index=True)
        _, from_end = np.unique(rid[::-1], return_index=True)
        last = rows.shape[0] - 1 - from_end
        end = np.where(np.isin(op[last], (FINISH, ABORT)), at[last] + 1, steps.shape[0])
        alive = np.zeros(steps.shape[0] + 1, np.int64)
        np.add.at(alive, at[first], 1)
        np.add.at(alive, end, -1)
        return max(1, int(np.cumsum(alive).max()))


def build(table: TraceTable, cand: Candidate, extra: dict[str, Any] | None = None) -> tuple[TraceMeta, list[StepBatch]]:
    """The trace a candidate describes: its metadata and its steps (requests numbered
    from 0 in order of arrival, steps numbered from 0).

    Args:
        table: the table the candidate is described against.
        cand: the candidate.
        extra: entries added to the metadata's ``extra``.
    """
    rows = cand.rows
    n = rows.shape[0]
    op = table.op[rows]
    rid = table.rid[rows]
    a = table.appends(cand)
    seq_len = _lengths(table, rows, op, rid, a)
    clipped = _readmissions(table, rows, op, a, seq_len)
    changed = clipped is not a
    if changed:
        a, seq_len = clipped, _lengths(table, rows, op, rid, clipped)
    prompt = _prompts(table, cand, a)
    prompt_len = np.where(table.prompt_len[rows] >= 0, prompt[rid], -1)
    hashes = table.block_hashes.take(rows)
    bs = table.meta.block_size
    if bs and hashes.valid.any():
        hashes = _cut(hashes, np.where(prompt_len >= 0, ceil_align(np.maximum(prompt_len, 0), bs) // bs, 0))
    tokens = table.token_ids.take(rows)
    if tokens.valid.any() and (cand.append or changed):
        tokens = _cut(tokens, a)
    # the recorded prefix (informative) never longer than the prompt it matched, nor than
    # the sequence it is part of
    prefix_len = table.prefix_len[rows]
    prefix_len = np.where(prompt[rid] >= 0, np.minimum(prefix_len, prompt[rid]), prefix_len)
    prefix_len = np.minimum(prefix_len, np.maximum(seq_len, 0))
    # requests numbered by arrival, steps from 0
    uniq, first_at = np.unique(rid, return_index=True)
    new_id = np.empty(uniq.shape[0], np.int64)
    new_id[np.argsort(first_at, kind="stable")] = np.arange(uniq.shape[0])
    rid = new_id[np.searchsorted(uniq, rid)]
    step = table.step[rows]
    bounds = np.flatnonzero(step[1:] != step[:-1]) + 1
    starts = np.concatenate(([0], bounds)).tolist() if n else []
    stops = np.concatenate((bounds, [n])).tolist() if n else []
    columns = {
        "op": op, "rid": rid, "seq_len": seq_len, "append_len": a.astype(np.int32),
        "draft_len": table.draft_len[rows], "accepted_len": table.accepted_len[rows],
        "prefix_len": prefix_len, "prompt_len": prompt_len,
    }
    arrival = None if table.arrival_s is None else table.arrival_s[rows]
    steps = [
        StepBatch(
            number, table.step_time[int(step[lo])],
            *(columns[name][lo:hi] for name in _COLUMNS[1:]),
            hashes.slice(lo, hi), tokens.slice(lo, hi),
            None if arrival is None else arrival[lo:hi],
        )
        for number, (lo, hi) in enumerate(zip(starts, stops))
    ]
    cfg = table.meta.config
    meta = with_config(
        table.meta,
        pool_tokens=cand.pool_tokens or cfg.pool_tokens,
        max_running=cand.max_running or cfg.max_running,
        max_context_len=cand.max_context_len or cfg.max_context_len,
    )
    meta = replace(meta, extra={**table.meta.extra, **(extra or {})})
    if table.meta.namespaces is not None:  # the kept requests' namespaces, under their new ids
        known = table.meta.namespaces
        kept = NamespaceTable.of({n: known.name_of(o) for o, n in zip(uniq.tolist(), new_id.tolist())})
        meta = replace(meta, namespaces=kept, format_version=None)
    return meta, steps


def with_config(meta: TraceMeta, **changes: Any) -> TraceMeta:
    """``meta`` with its serving configuration changed; a hybrid (SWA) model's SWA pool
    follows a new full pool or page size by its SWA/full ratio (``AttentionLayout.for_pool``),
    as a what-if replay sizes it (``kvtrace.replay.config.swa_config_for``): a candidate
    with a smaller pool replays as ``--pool-tokens`` would, and its metadata says so."""
    new = meta.with_config(**changes)
    old, cfg = meta.config, new.config
    if meta.attention is not None and (cfg.pool_tokens, cfg.page_size) != (old.pool_tokens, old.page_size):
        new = replace(new, attention=meta.attention.for_pool(cfg.pool_tokens, cfg.page_size))
    return new


def _lengths(table: TraceTable, rows: np.ndarray, op: np.ndarray, rid: np.ndarray, a: np.ndarray) -> np.ndarray:
    """Each kept row's ``seq_len``: the running sum of its request's appends, restarting
    at the admission and at each re-admission."""
    n = rows.shape[0]
    grow = np.where((op == EXTEND) | (op == PREALLOC) | (op == DECODE) | (op == SPEC), a, 0)
    restart = table.first[rows] | table.readmit[rows] | (op == PREALLOC)
    order = np.lexsort((np.arange(n), rid))
    g, rs = grow[order], restart[order]
    total = np.cumsum(g)
    base = (total - g)[rs]  # the running sum before each restart
    length = np.empty(n, np.int64)
    length[order] = total - base[np.cumsum(rs) - 1]
    return np.where(op == FINISH, np.maximum(0, length - table.finish_tail[rows]), length)


def _readmissions(table: TraceTable, rows: np.ndarray, op: np.ndarray, a: np.ndarray, seq_len: np.ndarray) -> np.ndarray:
    """The appends with each re-admission's ``extend`` chunks clipped so the request
    rebuilds no more than the length it was retracted at (less, when a cut removed
    some of its decodes), each chunk keeping at least one token; ``a`` itself when
    nothing changes."""
    head = table.unit[rows]
    again = (op == EXTEND) & (head >= 0) & (head != rows)
    again &= table.op[np.maximum(head, 0)] == RETRACT
    if not again.any():
        return a
    out = a.copy()
    at = np.searchsorted(rows, head)  # the retraction heads the unit and is kept with it
    members = np.flatnonzero(again)
    for h in np.unique(head[members]).tolist():
        chunks = members[head[members] == h]
        left = int(seq_len[at[chunks[0]]])  # its length when it was retracted
        for j, i in enumerate(chunks.tolist()):
            out[i] = max(1, min(int(out[i]), left - (chunks.shape[0] - 1 - j)))
            left -= int(out[i])
    return out if not np.array_equal(out, a) else a


def _prompts(table: TraceTable, cand: Candidate, a: np.ndarray) -> np.ndarray:
    """Per request id: its prompt, less what the candidate cut out of its first prefill."""
    first_prefill = np.flatnonzero(table.first_prefill)
    kept = np.zeros(table.num_rows, np.bool_)
    kept[cand.rows] = True
    new_a = np.zeros(table.num_rows, np.int64)
    new_a[cand.rows] = a
    rec = table.append_len[first_prefill].astype(np.int64)
    cut = np.where(kept[first_prefill], rec - new_a[first_prefill], rec)
    reduction = np.bincount(table.rid[first_prefill], weights=cut, minlength=table.prompt.shape[0]).astype(np.int64)
    prompt = np.maximum(1, table.prompt - reduction)
    # a request that arrives by prealloc brings its prompt with it: at most what it brings
    admitted = np.flatnonzero(table.first & (table.op == PREALLOC))
    prompt[table.rid[admitted]] = np.minimum(table.prompt[table.rid[admitted]], new_a[admitted])
    return np.where(table.prompt >= 0, prompt, -1)


def _cut(lists: Ragged, lengths: np.ndarray) -> Ragged:
    """Each valid row of ``lists`` cut to at most ``lengths[i]`` entries."""
    old = lists.lengths
    new = np.where(lists.valid, np.minimum(old, np.maximum(lengths, 0)), 0)
    if np.array_equal(new, old):
        return lists
    position = np.arange(lists.values.shape[0], dtype=np.int64) - np.repeat(lists.offsets[:-1], old)
    keep = position < np.repeat(new, old)
    offsets = np.zeros(new.shape[0] + 1, np.int64)
    np.cumsum(new, out=offsets[1:])
    return Ragged(offsets, lists.values[keep], lists.valid)
