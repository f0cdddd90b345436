"""A trace as a workload: its requests, to be scheduled again under other options.

A trace holds every request it served: when it arrived (the ``arrival_s`` column on
its first row; traces recorded before that column fall back to the time of the
request's first row, its admission), its prompt (``prompt_len``), its content
(``block_hashes`` with the trace's ``block_size``, explicit ``token_ids``, or tokens
unique to it) and how much it generated, read off its lengths::

    output_len = finish seq_len - prompt_len        when the finish owned less than the
                                                    request's longest length (a stop that
                                                    landed inside a speculative step)
               = longest seq_len - prompt_len + 1   otherwise (the last token sampled
                                                    has no KV yet)

A request that never finished (aborted, or live when the trace ends) keeps what it
generated so far. ``read_trace_workload`` turns a trace into ``WorkloadRequest``s in
arrival order, so the scheduler model (``kvtrace record TRACE``) serves the same
requests with the same content under new options.

Content: a trace whose prompts are block hashes keeps them (and its block size).
Where any prompt carries explicit token ids, every prompt becomes one "block" per
token (block size 1, the token id as its hash): ``traces.tokens`` maps equal ids to
equal tokens and different ids to different ones, so the same prompts share the same
prefixes. Tokens a request generated are unique to it, as the scheduler model
generates them.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np

from traces.batches import StepBatch
from traces.errors import TraceFormatError
from traces.metadata import TraceMeta
from traces.schema import ABORT, DECODE, EXTEND, FINISH, PREALLOC, SPEC
from traces.tokens import TokenStore, block_token_ids
from traces.workload_request import WorkloadRequest

__all__ = ["TraceWorkload", "arrival_note", "read_trace_workload"]

_ALLOC_OPS = np.array([EXTEND, DECODE, SPEC, PREALLOC], np.int8)
_END_OPS = np.array([FINISH, ABORT], np.int8)


class TraceWorkload(NamedTuple):
    """A trace's requests as a workload.

    Attributes:
        requests: one per request of the trace, in arrival order (ties: trace order).
        meta: the trace's metadata (its serving configuration, source, settings).
        arrivals_recorded: the trace carries arrival times; False: each request's
            arrival is the time of its first row (its admission, not its arrival).
        block_size: tokens per block of the requests' ``block_hashes`` (None: none).
        unfinished: requests that never finished (aborted or live at the end); their
            output length is what they had generated.
    """

    requests: list[WorkloadRequest]
    meta: TraceMeta
    arrivals_recorded: bool
    block_size: int | None
    unfinished: int


def read_trace_workload(path: str | os.PathLike[str]) -> TraceWorkload:
    """Read a trace's requests (cached by path, size and modification time).

    Raises:
        TraceError: the file is not a readable trace, or a request's first row lacks
            its prompt length or carries an arrival time that is not a finite
            number >= 0 (one line naming the step and request).
    """
    target = Path(path)
    try:
        stat = target.stat()
    except OSError:
        stat = None
    key = (str(target.resolve()), stat.st_size if stat else -1, stat.st_mtime_ns if stat else -1)
    return _read_cached(key, target)


@functools.lru_cache(maxsize=4)
def _read_cached(key: tuple[str, int, int], path: Path) -> TraceWorkload:
    from traces.reader import TraceReader

    reader = TraceReader(path)
    collect = _Collector(reader.meta.block_size, TokenStore(reader.meta.block_size), str(path))
    for batch in reader.steps():
        collect.add(batch)
    return collect.finish(reader.meta)


class _Collector:
    """Per-request facts gathered step by step (struct of arrays indexed by rid)."""

    def __init__(self, block_size: int | None, store: TokenStore, path: str) -> None:
        self.block_size = block_size
        self.store = store
        self.path = path
        cap = 1024
        self.prompt = np.full(cap, -1, np.int64)
        self.arrival = np.full(cap, np.nan)
        self.longest = np.zeros(cap, np.int64)
        self.owned = np.full(cap, -1, np.int64)  # seq_len of the request's finish
        self.ended = np.zeros(cap, np.bool_)
        self.explicit = np.zeros(cap, np.bool_)  # explicit ids inside the prompt
        self.hashes: dict[int, np.ndarray] = {}
        self.prompt_ids: dict[int, np.ndarray] = {}
        self.order: list[int] = []  # rids in order of first appearance
        self.recorded = False

    def _grow(self, top: int) -> None:
        size = self.prompt.shape[0]
        if top < size:
            return
        new = max(top + 1, 2 * size)
        for name, fill in (("prompt", -1), ("arrival", np.nan), ("longest", 0), ("owned", -1),
                           ("ended", False), ("explicit", False)):  # fmt: skip
            old = getattr(self, name)
            setattr(self, name, np.concatenate([old, np.full(new - size, fill, old.dtype)]))

    def add(self, batch: StepBatch) -> None:
        if len(batch) == 0:
            return
        rid = batch.rid
        self._grow(int(rid.max()))
        self.store.ingest(batch)
        new = np.flatnonzero(self.prompt[rid] < 0)
        if new.size:
            # A request's first row (a later row of the same step is not its first).
            _, first = np.unique(rid[new], return_index=True)
            self._first_rows(batch, new[np.sort(first)])
        alloc = np.isin(batch.op, _ALLOC_OPS)
        np.maximum.at(self.longest, rid[alloc], batch.seq_len[alloc])
        tokens = batch.token_ids
        if tokens.values.shape[0]:
            starts = batch.seq_len - batch.append_len
            self.explicit[rid[tokens.valid & (starts < self.prompt[rid])]] = True
        ending = np.flatnonzero(np.isin(batch.op, _END_OPS) & ~self.ended[rid])
        if ending.size:
            self._end(batch, ending)

    def _first_rows(self, batch: StepBatch, rows: np.ndarray) -> None:
        rid, prompt = batch.rid[rows], batch.prompt_len[rows]
        missing = np.flatnonzero(prompt < 0)
        if missing.size:
            r = int(rid[missing[0]])
            raise TraceFormatError(
                f"{self.path}: request {r}'s first row (step {batch.step}) has no prompt_len; "
                "the trace cannot be re-scheduled (kvtrace validate shows what else is wrong)"
            )
        arrival = batch.arrivals()[rows]
        bad = np.flatnonzero(~np.isnan(arrival) & ~(np.isfinite(arrival) & (arrival >= 0)))
        if bad.size:
            j = int(bad[0])
            raise TraceFormatError(
                f"{self.path}: request {int(rid[j])} (step {batch.step}) has arrival_s {float(arrival[j])!r}; "
                "arrival times are finite seconds >= 0"
            )
        if not np.isnan(arrival).all():
            self.recorded = True
        self.prompt[rid] = prompt
        self.arrival[rid] = np.where(np.isnan(arrival), batch.time_s, arrival)
        hashes = batch.block_hashes
        for i, r, p in zip(rows.tolist(), rid.tolist(), prompt.tolist()):
            if self.block_size and hashes.valid[i]:
                row = hashes.values[hashes.offsets[i] : hashes.offsets[i + 1]].copy()
                if row.shape[0] * self.block_size < p:
                    raise TraceFormatError(
                        f"{self.path}: request {r} (step {batch.step}) has {row.shape[0]} block_hashes of "
                        f"{self.block_size} tokens for a {p}-token prompt; the trace cannot be re-scheduled"
                    )
                self.hashes[r] = row
        self.order.extend(rid.tolist())

    def _end(self, batch: StepBatch, rows: np.ndarray) -> None:
        rid = batch.rid[rows]
        finish = batch.op[rows] == FINISH
        self.owned[rid[finish]] = batch.seq_len[rows][finish]
        self.ended[rid] = True
        for r in rid[self.explicit[rid]].tolist():
            self.prompt_ids[r] = self.store.ids(r, int(self.prompt[r])).copy()
        self.store.drop(rid)

    def finish(self, meta: TraceMeta) -> TraceWorkload:
        rids = np.array(self.order, np.int64)
        for r in rids[self.explicit[rids] & ~self.ended[rids]].tolist():
            self.prompt_ids[r] = self.store.ids(r, int(self.prompt[r])).copy()
        prompt, longest, owned = self.prompt[rids], self.longest[rids], self.owned[rids]
        generated = np.where((owned >= 0) & (owned < longest), owned - prompt, longest - prompt + 1)
        output = np.maximum(generated, 0)
        per_token = bool(self.prompt_ids)
        block_size = 1 if per_token else self.block_size
        order = np.argsort(self.arrival[rids], kind="stable")
        requests = []
        for j in order.tolist():
            r = int(rids[j])
            hashes = self._content(r, int(prompt[j])) if per_token else self.hashes.get(r)
            requests.append(
                WorkloadRequest(
                    arrival_s=float(self.arrival[r]),
                    input_len=int(prompt[j]),
                    output_len=int(output[j]),
                    block_hashes=hashes,
                    block_size=block_size if hashes is not None else None,
                    line=r,
                    namespace=None if meta.namespaces is None else meta.namespaces.name_of(r),
                )
            )
        unfinished = int(np.count_nonzero(owned < 0))
        return TraceWorkload(requests, meta, self.recorded, block_size, unfinished)

    def _content(self, rid: int, prompt_len: int) -> np.ndarray | None:
        """The prompt as one hash per token (block size 1)."""
        ids = self.prompt_ids.get(rid)
        if ids is None:
            hashes = self.hashes.get(rid)
            if hashes is None or not self.block_size:
                return None  # unique tokens: related to nothing, in either trace
            ids = block_token_ids(hashes, self.block_size, 0, min(prompt_len, hashes.shape[0] * self.block_size))
        return ids.view(np.uint64).copy()


def arrival_note(workload: TraceWorkload) -> str | None:
    """The warning to give when a trace carries no arrival times (None when it does)."""
    if workload.arrivals_recorded or not workload.requests:
        return None
    return (
        "the trace has no arrival times (recorded before the arrival_s column); each request "
        "arrives when the trace first admitted it, so queueing before that is not modelled"
    )

