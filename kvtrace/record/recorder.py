"""The recorder API: what a serving engine calls once per scheduler step to write a trace.

An engine hooks it in where its scheduler applies a step's KV operations::

    from kvtrace.record.recorder import Recorder
    from traces.schema import TraceConfig, TraceMeta

    meta = TraceMeta(config=TraceConfig(page_size=16, pool_tokens=900_000,
                                         max_running=256, max_context_len=131_072))
    with Recorder("run.kvtrace", meta) as rec:
        while serving:
            rec.begin_step(time.monotonic() - t0)
            rec.finish(finished_ids, owned_lens)          # released, prefix cached
            rec.extend(prefill_ids, seq_lens, prefix_lens=hits, prompt_lens=prompt_lens,
                       arrival_s=arrivals)                 # arrivals: a request's first row
            rec.decode(decode_ids, seq_lens)              # one token each
            rec.end_step()                                # the step is on disk

Streaming sessions (a trace whose ``meta.config.sessions`` is set): one request id
per session. ``hold`` ends a turn and keeps its KV in the session (the first hold opens
it); the next turn is an ``extend`` of the same id from the held length;
``close_session`` (the ``close`` op) releases the held KV. ``abort`` of a running turn releases everything.

Request ids may be any hashable (engine strings such as ``"req-8f3a"`` or ints); the
recorder maps them to dense int ids in order of first appearance (``rid_map``).
Ops may be added in any order within a step: ``end_step`` writes them in the
trace's ``OP_ORDER`` (releases, then prealloc, extend, decode, spec).

Durability: with ``steps_per_batch=1`` (the default) every completed step is
written and flushed at ``end_step``, so a process killed at any instant leaves a
trace holding every completed step. A larger ``steps_per_batch`` writes fewer,
better-compressed batches and may lose the last ``steps_per_batch - 1`` completed
steps on a hard kill; ``flush_interval_s`` bounds that loss in time. Leaving the
``with`` block by an exception (Ctrl-C included) flushes every completed step,
drops the step in progress and marks the trace interrupted, saying why
(``TraceMeta.recording``); a process killed outright leaves a trace that reads as
interrupted too (its writer never closed it). The metadata also records the
kvtrace version, the command line and the creation time.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from collections.abc import Hashable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NamedTuple

import numpy as np

from traces.metadata import Recording, TraceMeta, timestamp
from traces.namespaces import NamespaceTable, check_name
from kvtrace.record.step_rows import FloatsLike, IdsLike, IntsLike, Part, floats, ints
from traces.schema import ABORT, CLOSE, DECODE, EXTEND, FINISH, HOLD, OP_ORDER, OPS, PREALLOC, RETRACT, SPEC

if TYPE_CHECKING:
    from types import TracebackType

__all__ = ["Recorder", "RecorderStats"]

class RecorderStats(NamedTuple):
    """What a recorder has written so far."""

    steps: int
    rows: int
    requests: int


class Recorder:
    """Writes a trace, one scheduler step at a time (see the module docstring).

    Args:
        path: the ``.kvtrace`` file to write.
        meta: trace metadata (serving config, source, model shape).
        steps_per_batch: steps per Arrow record batch (1: every step flushed).
        compression: ``"zstd"`` or ``"lz4"``.
        overwrite: replace an existing file (else the writer refuses).
        flush_interval_s: also flush when this much wall time passed since the last
            flush (bounds what a hard kill loses when ``steps_per_batch > 1``).
        dense_ids: the caller's ids already are dense non-negative ints (0, 1, 2, …);
            skip the id map (the scheduler model uses this).
        compact_steps_per_batch: write every step durably (lz4) while recording and, on
            a clean close, rewrite the trace with this many steps per batch in
            ``compression`` (a killed recorder leaves the durable per-step file).
        rid_map_path: append ``{"id": engine_id, "rid": dense}`` JSON lines here as
            ids are first seen (flushed with the trace).
        command: the command line stored in the metadata (default: this process's).

    The metadata written gets ``created_at`` (now, unless set) and a ``recording``
    (status, kvtrace version, command line; unless set).

    Raises:
        traces.errors.TraceWriteError (through the writer): the file exists without
            ``overwrite`` or cannot be written.
    """

    def __init__(
        self,
        path: str | Path,
        meta: TraceMeta,
        *,
        steps_per_batch: int = 1,
        compression: str = "zstd",
        overwrite: bool = False,
        flush_interval_s: float | None = None,
        dense_ids: bool = False,
        rid_map_path: str | Path | None = None,
        compact_steps_per_batch: int | None = None,
        command: str | None = None,
    ) -> None:
        from kvtrace import __version__
        from traces.writer import TraceWriter

        if meta.recording is None:
            command = shlex.join(sys.argv) if command is None else command
            meta = replace(meta, recording=Recording(kvtrace_version=__version__, command=command))
        if meta.created_at is None:
            meta = replace(meta, created_at=timestamp())
        self.path = Path(path)
        self.meta = meta
        # Compacting: write every step durably with the fast codec, rewrite at close.
        live_compression = "lz4" if compact_steps_per_batch else compression
        self._writer = TraceWriter(
            self.path,
            meta,
            compression=live_compression,  # type: ignore[arg-type]
            steps_per_batch=steps_per_batch,
            overwrite=overwrite,
            compact_steps_per_batch=compact_steps_per_batch,
            compact_compression=compression,  # type: ignore[arg-type]
        )
        self._steps_per_batch = steps_per_batch
        self._flush_interval_s = flush_interval_s
        self._last_flush = time.monotonic()
        self._dense = dense_ids
        self._ids: dict[Hashable, int] = {}
        self._num_ids = 0
        self._lens = np.zeros(1024, np.int64)  # current length per dense id (append_len)
        self._seen = np.zeros(1024, np.bool_)  # has the request had a row (first-row columns)
        self._held = np.zeros(1024, np.bool_)  # held by its session (its next extend may give prompt_len)
        self._step = -1
        self._time_s = 0.0
        self._open_step = False
        self._parts: dict[int, list[Part]] = {}
        self._rows = 0
        self._steps_written = 0
        self._closed = False
        self._rid_map_file: IO[str] | None = None
        if rid_map_path is not None:
            self._rid_map_file = Path(rid_map_path).open("w", encoding="utf-8")
        self._pending_map: list[tuple[Hashable, int]] = []
        self._namespaces: dict[int, str] = {}  # dense id -> cache namespace (given to extend / prealloc)

    # ------------------------------------------------------------------ ids

    @property
    def rid_map(self) -> dict[Hashable, int]:
        """Engine id -> dense trace id (empty with ``dense_ids``)."""
        return dict(self._ids)

    def _grow(self, top: int) -> None:
        if top >= self._lens.shape[0]:
            size = max(top + 1, 2 * self._lens.shape[0])
            self._lens = np.concatenate([self._lens, np.zeros(size - self._lens.shape[0], np.int64)])
            self._seen = np.concatenate([self._seen, np.zeros(size - self._seen.shape[0], np.bool_)])
            self._held = np.concatenate([self._held, np.zeros(size - self._held.shape[0], np.bool_)])

    def _map(self, rids: IdsLike) -> np.ndarray:
        if self._dense:
            ids = np.asarray(rids, dtype=np.int64)
            if ids.ndim != 1:
                ids = ids.reshape(-1)
            if ids.size:
                if int(ids.min()) < 0:
                    raise ValueError(f"dense request ids must be >= 0, found {int(ids.min())}")
                self._grow(int(ids.max()))
            return ids
        table = self._ids
        out = np.empty(len(rids), np.int64)
        for i, key in enumerate(rids.tolist() if isinstance(rids, np.ndarray) else rids):
            rid = table.get(key)
            if rid is None:
                rid = self._num_ids
                table[key] = rid
                self._num_ids += 1
                if self._rid_map_file is not None:
                    self._pending_map.append((key, rid))
            out[i] = rid
        self._grow(self._num_ids)
        return out

    # ------------------------------------------------------------------ steps

    def begin_step(self, time_s: float) -> int:
        """Open the next step, starting at ``time_s`` seconds since the trace start.

        Returns:
            The step number.

        Raises:
            RuntimeError: a step is already open, or the recorder is closed.
        """
        if self._closed:
            raise RuntimeError("the recorder is closed")
        if self._open_step:
            raise RuntimeError(f"step {self._step} is still open; call end_step() first")
        self._step += 1
        self._time_s = float(time_s)
        self._open_step = True
        self._parts = {}
        return self._step

    def _add(self, op: int, part: Part) -> None:
        if not self._open_step:
            raise RuntimeError(f"no open step; call begin_step() before recording {OPS[op]} ops")
        if part.ids.shape[0]:
            self._parts.setdefault(op, []).append(part)

    def extend(
        self,
        rids: IdsLike,
        seq_lens: IntsLike,
        *,
        prefix_lens: IntsLike | None = None,
        prompt_lens: IntsLike | None = None,
        block_hashes: Sequence[np.ndarray | None] | None = None,
        token_ids: Sequence[np.ndarray | None] | None = None,
        arrival_s: FloatsLike | None = None,
        namespaces: Sequence[str | None] | None = None,
    ) -> None:
        """Prefill (or a prefill chunk) of each request up to ``seq_lens[i]`` tokens.

        Args:
            rids: request ids.
            seq_lens: length after the op (positions ``[previous length, seq_len)``
                are appended; a new or re-admitted request starts from 0).
            prefix_lens: prefix the engine's radix cache matched (informative).
            prompt_lens: prompt length, kept on the request's first row only, and on
                the extend of a session's next turn (its prompt: the conversation so far).
            block_hashes: per request, content-addressed prompt blocks (uint64) or None.
            token_ids: per request, explicit ids of the appended positions, or None.
            arrival_s: when each request arrived (seconds, the clock of ``begin_step``;
                NaN: unknown), kept on the request's first row only: re-scheduling the
                trace (``kvtrace record TRACE``) replays the arrivals.
            namespaces: per request, its cache namespace (a LoRA adapter id, a
                ``cache_salt``, an ``extra_key``: SGLang's ``Req.extra_key``) or None;
                a request's first one counts. They are stored in the metadata when the
                recorder closes (``traces.namespaces``): a recording stopped before
                its end has none.
        """
        self._add_prompted(
            EXTEND, rids, seq_lens, prefix_lens, prompt_lens, block_hashes, token_ids, arrival_s, namespaces
        )

    def prealloc(
        self,
        rids: IdsLike,
        seq_lens: IntsLike,
        *,
        prefix_lens: IntsLike | None = None,
        prompt_lens: IntsLike | None = None,
        block_hashes: Sequence[np.ndarray | None] | None = None,
        token_ids: Sequence[np.ndarray | None] | None = None,
        arrival_s: FloatsLike | None = None,
        namespaces: Sequence[str | None] | None = None,
    ) -> None:
        """PD-disaggregated decode: each request arrives with ``seq_lens[i]`` tokens of KV
        (the keyword arguments as for ``extend``)."""
        self._add_prompted(
            PREALLOC, rids, seq_lens, prefix_lens, prompt_lens, block_hashes, token_ids, arrival_s, namespaces
        )

    def _add_prompted(
        self,
        op: int,
        rids: IdsLike,
        seq_lens: IntsLike,
        prefix_lens: IntsLike | None,
        prompt_lens: IntsLike | None,
        block_hashes: Sequence[np.ndarray | None] | None,
        token_ids: Sequence[np.ndarray | None] | None,
        arrival_s: FloatsLike | None = None,
        namespaces: Sequence[str | None] | None = None,
    ) -> None:
        """The rows of the ops that may bring a request's first row (extend, prealloc)."""
        ids = self._map(rids)
        n = ids.shape[0]
        if namespaces is not None:
            if len(namespaces) != n:
                raise ValueError(f"namespaces has {len(namespaces)} entries, expected {n}")
            for rid, name in zip(ids.tolist(), namespaces):
                if name is not None:
                    self._namespaces.setdefault(rid, check_name(name, f"namespace of request {rid}"))
        self._add(
            op,
            Part(
                ids,
                ints(seq_lens, n, "seq_lens"),
                None,
                None,
                None if prefix_lens is None else ints(prefix_lens, n, "prefix_lens"),
                None if prompt_lens is None else ints(prompt_lens, n, "prompt_lens"),
                block_hashes,
                token_ids,
                None if arrival_s is None else floats(arrival_s, n, "arrival_s"),
            ),
        )

    def decode(
        self, rids: IdsLike, seq_lens: IntsLike | None = None, *, token_ids: Sequence[np.ndarray | None] | None = None,
    ) -> None:
        """One decode token per request; ``seq_lens`` (after the op) default to length + 1;
        ``token_ids``: per request, the id of the decoded position (one-element array) or None."""
        ids = self._map(rids)
        n = ids.shape[0]
        lens = self._lens[ids] + 1 if seq_lens is None else ints(seq_lens, n, "seq_lens")
        self._add(DECODE, Part(ids, lens, None, None, None, None, None, token_ids))

    def spec(
        self,
        rids: IdsLike,
        accepted_lens: IntsLike,
        draft_lens: IntsLike,
        seq_lens: IntsLike | None = None,
        *,
        token_ids: Sequence[np.ndarray | None] | None = None,
    ) -> None:
        """One speculative step: ``draft_lens`` drafts verified, ``accepted_lens`` tokens
        committed; ``seq_lens`` (after the op) default to length + accepted; ``token_ids``:
        per request, the ids of the accepted positions or None."""
        ids = self._map(rids)
        n = ids.shape[0]
        accepted = ints(accepted_lens, n, "accepted_lens", np.int32)
        lens = self._lens[ids] + accepted if seq_lens is None else ints(seq_lens, n, "seq_lens")
        draft = ints(draft_lens, n, "draft_lens", np.int32)
        self._add(SPEC, Part(ids, lens, draft, accepted, None, None, None, token_ids))

    def finish(self, rids: IdsLike, owned_lens: IntsLike | None = None) -> None:
        """Release; the owned prefix is kept in the radix cache. ``owned_lens``: tokens
        whose KV each request owns (default its length; less when a stop landed early)."""
        ids = self._map(rids)
        n = ids.shape[0]
        lens = self._lens[ids].copy() if owned_lens is None else ints(owned_lens, n, "owned_lens")
        self._add(FINISH, Part(ids, lens, None, None, None, None, None, None))

    def retract(self, rids: IdsLike) -> None:
        """Release under memory pressure (nothing cached); the request may come back."""
        ids = self._map(rids)
        self._add(RETRACT, Part(ids, self._lens[ids].copy(), None, None, None, None, None, None))

    def abort(self, rids: IdsLike) -> None:
        """Release; nothing cached; the request ends."""
        ids = self._map(rids)
        self._add(ABORT, Part(ids, self._lens[ids].copy(), None, None, None, None, None, None))

    def hold(self, rids: IdsLike, held_lens: IntsLike | None = None) -> None:
        """Streaming session: the turn ends and its session keeps the KV of its first
        ``held_lens`` tokens (default its length), neither cached nor freed; the first
        hold opens the session. The next turn is an ``extend`` of the same id from the
        held length; ``close_session`` ends the session."""
        ids = self._map(rids)
        n = ids.shape[0]
        lens = self._lens[ids].copy() if held_lens is None else ints(held_lens, n, "held_lens")
        self._add(HOLD, Part(ids, lens, None, None, None, None, None, None))

    def close_session(self, rids: IdsLike) -> None:
        """The ``close`` op (``close()`` closes the recorder). Streaming session: release the KV the session holds (nothing cached); the
        request ends. Each id must be held (``hold`` earlier, no turn since)."""
        ids = self._map(rids)
        self._add(CLOSE, Part(ids, self._lens[ids].copy(), None, None, None, None, None, None))

    def end_step(self) -> None:
        """Close the step and write its rows (in ``OP_ORDER``); flushed per the batching policy.

        Raises:
            RuntimeError: no step is open.
        """
        if not self._open_step:
            raise RuntimeError("no open step to end")
        self._open_step = False
        parts = self._parts
        if not parts:
            # Nothing happened: nothing is written and the step number is reused.
            self._step -= 1
            return
        ops: list[np.ndarray] = []
        rid_cols: list[np.ndarray] = []
        seq_cols: list[np.ndarray] = []
        append_cols: list[np.ndarray] = []
        draft_cols: list[np.ndarray] = []
        accepted_cols: list[np.ndarray] = []
        prefix_cols: list[np.ndarray] = []
        prompt_cols: list[np.ndarray] = []
        arrival_cols: list[np.ndarray] = []
        hashes: list[np.ndarray | None] = []
        tokens: list[np.ndarray | None] = []
        any_hashes = any_tokens = False
        lens = self._lens
        seen = self._seen
        for op in OP_ORDER:
            for part in parts.get(op, ()):
                ids = part.ids
                n = ids.shape[0]
                seq = part.seq_len
                if op == DECODE:
                    append = np.ones(n, np.int32)
                elif op == SPEC:
                    append = part.accepted_len
                elif op in (EXTEND, PREALLOC):
                    before = np.zeros(n, np.int64) if op == PREALLOC else lens[ids]
                    append = (seq - before).astype(np.int32)
                else:
                    append = np.zeros(n, np.int32)
                # Lengths after the op; a release leaves the request holding nothing.
                # Lengths after the op; a release leaves the request holding nothing (a
                # hold: the session keeps the held length, the next turn's start).
                lens[ids] = 0 if op in (FINISH, ABORT, RETRACT, CLOSE) else seq
                first = ~seen[ids]
                seen[ids] = True
                turn = self._held[ids] & (op == EXTEND)  # a session's next turn
                self._held[ids] = op == HOLD
                ops.append(np.full(n, op, np.int8))
                rid_cols.append(ids)
                seq_cols.append(seq)
                append_cols.append(append)
                zeros32 = np.zeros(n, np.int32)
                draft_cols.append(part.draft_len if part.draft_len is not None else zeros32)
                accepted_cols.append(part.accepted_len if part.accepted_len is not None else zeros32)
                prefix_cols.append(part.prefix_len if part.prefix_len is not None else np.zeros(n, np.int64))
                if part.prompt_len is not None:
                    prompt_cols.append(np.where(first | turn, part.prompt_len, -1))
                else:
                    prompt_cols.append(np.full(n, -1, np.int64))
                if part.arrival_s is not None:
                    arrival_cols.append(np.where(first, part.arrival_s, np.nan))
                else:
                    arrival_cols.append(np.full(n, np.nan))
                if part.block_hashes is not None:
                    any_hashes = True
                    hashes.extend(h if f else None for h, f in zip(part.block_hashes, first.tolist()))
                else:
                    hashes.extend([None] * n)
                if part.token_ids is not None:
                    any_tokens = True
                    tokens.extend(part.token_ids)
                else:
                    tokens.extend([None] * n)
        one = len(ops) == 1
        op_col = ops[0] if one else np.concatenate(ops)
        prompt = prompt_cols[0] if one else np.concatenate(prompt_cols)
        arrival = arrival_cols[0] if one else np.concatenate(arrival_cols)
        self._writer.write_step(
            self._step,
            self._time_s,
            op=op_col,
            rid=rid_cols[0] if one else np.concatenate(rid_cols),
            seq_len=seq_cols[0] if one else np.concatenate(seq_cols),
            append_len=append_cols[0] if one else np.concatenate(append_cols),
            draft_len=draft_cols[0] if one else np.concatenate(draft_cols),
            accepted_len=accepted_cols[0] if one else np.concatenate(accepted_cols),
            prefix_len=prefix_cols[0] if one else np.concatenate(prefix_cols),
            prompt_len=prompt if (prompt >= 0).any() else None,
            block_hashes=hashes if any_hashes else None,
            token_ids=tokens if any_tokens else None,
            arrival_s=None if np.isnan(arrival).all() else arrival,
        )
        self._rows += int(op_col.shape[0])
        self._steps_written += 1
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        now = time.monotonic()
        due = self._steps_per_batch <= 1
        if not due and self._flush_interval_s is not None and now - self._last_flush >= self._flush_interval_s:
            self._writer.flush()
            due = True
        if due:
            self._last_flush = now
            self._flush_rid_map()

    def _flush_rid_map(self) -> None:
        if self._rid_map_file is not None and self._pending_map:
            for key, rid in self._pending_map:
                self._rid_map_file.write(json.dumps({"id": key, "rid": rid}, default=str) + "\n")
            self._pending_map.clear()
            self._rid_map_file.flush()

    def record_step(
        self,
        time_s: float,
        *,
        finish: tuple[IdsLike, IntsLike] | IdsLike | None = None,
        abort: IdsLike | None = None,
        retract: IdsLike | None = None,
        prealloc: tuple[IdsLike, IntsLike] | None = None,
        extend: tuple[IdsLike, IntsLike] | dict[str, Any] | None = None,
        decode: tuple[IdsLike, IntsLike] | IdsLike | None = None,
        spec: tuple[IdsLike, IntsLike, IntsLike] | None = None,
    ) -> int:
        """One whole step in one call: ``begin_step``, the given ops, ``end_step``.

        ``extend`` is ``(rids, seq_lens)`` or a dict of :meth:`extend` keyword
        arguments; ``finish`` is ``rids`` or ``(rids, owned_lens)``; ``decode`` is
        ``rids`` or ``(rids, seq_lens)``; ``spec`` is ``(rids, accepted_lens, draft_lens)``.

        Returns:
            The step number.
        """
        step = self.begin_step(time_s)
        if finish is not None:
            self.finish(*finish) if isinstance(finish, tuple) else self.finish(finish)
        if abort is not None:
            self.abort(abort)
        if retract is not None:
            self.retract(retract)
        if prealloc is not None:
            self.prealloc(*prealloc)
        if extend is not None:
            self.extend(**extend) if isinstance(extend, dict) else self.extend(*extend)
        if decode is not None:
            self.decode(*decode) if isinstance(decode, tuple) else self.decode(decode)
        if spec is not None:
            self.spec(*spec)
        self.end_step()
        return step

    # ------------------------------------------------------------------ lifetime

    def stats(self) -> RecorderStats:
        """Steps and rows written, requests seen."""
        requests = self._num_ids if not self._dense else int(np.count_nonzero(self._seen))
        return RecorderStats(steps=self._steps_written, rows=self._rows, requests=requests)

    def flush(self) -> None:
        """Write every completed step now."""
        self._writer.flush()
        self._last_flush = time.monotonic()
        self._flush_rid_map()

    def close(self, *, interrupted: str | None = None) -> None:
        """Flush the completed steps and close the file (a step left open is dropped).

        Args:
            interrupted: why the recording stops before its end: the trace is marked
                interrupted (``TraceMeta.recording``) and not compacted.

        Raises:
            traces.errors.TraceWriteError: the file cannot be written.
        """
        if self._closed:
            return
        self._closed = True
        self._open_step = False
        self._parts = {}
        namespaces = None
        if self._namespaces:
            known = self.meta.namespaces
            by_rid = {} if known is None else {r: known.name_of(r) for r in range(len(known.of_rid))}
            namespaces = NamespaceTable.of({**by_rid, **self._namespaces})
        try:
            self._writer.close(interrupted=interrupted, namespaces=namespaces)
        finally:
            self._flush_rid_map()
            if self._rid_map_file is not None:
                self._rid_map_file.close()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        from traces.writer import describe_stop

        self.close(interrupted=None if exc is None else describe_stop(exc))

    @property
    def recording(self) -> Recording | None:
        """The recording status written (the final one once closed)."""
        return self._writer.recording
