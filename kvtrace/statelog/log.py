"""The state log: an Arrow IPC file of step snapshots (``kvtrace replay --out``).

One row per replayed step; ``STATE_LOG_SCHEMA`` is the single definition. Any
Arrow reader opens it (``pyarrow.ipc.open_file``, ``pandas.read_feather``,
``polars.scan_ipc``); the dashboard and diff read it back as ``StepSnapshot``s with
``read_state_log`` (a log cut short reads up to its last complete batch).

Columns: the step and its time, the pool counters (``allocator.base.PoolCounters``),
the requests the step changed (list columns aligned by position: id, lengths, the
op that changed it, its phase, the prefix it reused), the step's events (list of
structs), the op count, the allocator time, whether the row is a keyframe (its
request lists hold every live request: the first step of a ``--steps`` window), and
the allocator's state digest (null unless the replay asked for it: ``diff --exact``).
A hybrid model's log has every other pool's counters too, named ``POOL_FIELD``
prefixed by the pool (``swa_available``, ``mamba_available``, ...: ``state_log_schema``), a
sliding-window model's each listed request's SWA cursor (``req_swa_evicted``, its
``swa_evicted_seqlen``), a Mamba model's each listed request's state slot
(``req_mamba_slot``, -1: none); a
log without them (a full-attention model's, or one written before them) has one pool.
The ``session_held`` counter (and ``{pool}_session_held``) is a column only in the log
of a trace with streaming sessions, so that any other log is what it was before
sessions existed; a log without it reads as 0.

The same records, as an uncompressed IPC *stream*, are the per-step record stream a
``kvtrace diff`` side sends its parent over a pipe (``kvtrace.proc.child``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa

from kvtrace.errors import TraceError
from kvtrace.statelog.format import STATE_LOG_METADATA_KEY, STATE_LOG_VERSION
from kvtrace.replay.snapshot import (
    POOL_NAMES,
    Event,
    PoolCounters,
    RequestDelta,
    SnapshotBlock,
    StepSnapshot,
    other_pool_names,
)
from traces.ipc import IpcReader


_POOL_FIELDS = PoolCounters._fields
# The counter a log holds only for a trace with streaming sessions.
SESSION_HELD = "session_held"
_LOGGED_FIELDS = tuple(name for name in _POOL_FIELDS if name != SESSION_HELD)
# RequestDelta fields -> list columns (name, Arrow type, numpy dtype)
_REQUEST_COLUMNS = (
    ("req_rid", pa.int64(), np.int64),
    ("req_allocated", pa.int64(), np.int64),
    ("req_committed", pa.int64(), np.int64),
    ("req_protected", pa.int64(), np.int64),
    ("req_op", pa.int8(), np.int8),
    ("req_phase", pa.int8(), np.int8),
    ("req_prefix", pa.int64(), np.int64),
)
EVENT_TYPE = pa.struct(
    [
        pa.field("kind", pa.utf8()),
        pa.field("rid", pa.int64()),
        pa.field("tokens", pa.int64()),
        pa.field("detail", pa.utf8()),
    ]
)
STATE_LOG_SCHEMA = pa.schema(
    [pa.field("step", pa.int64(), nullable=False), pa.field("time_s", pa.float64(), nullable=False)]
    + [pa.field(name, pa.int64(), nullable=False) for name in _LOGGED_FIELDS]
    + [
        pa.field("num_ops", pa.int32(), nullable=False),
        pa.field("allocator_s", pa.float64(), nullable=False),
        pa.field("keyframe", pa.bool_(), nullable=False),
    ]
    + [pa.field(name, pa.list_(arrow_type)) for name, arrow_type, _ in _REQUEST_COLUMNS]
    + [pa.field("events", pa.list_(EVENT_TYPE)), pa.field("digest", pa.utf8())]
)


# The SWA cursor of each listed request (``StepSnapshot.swa_evicted``): logs with an SWA pool only.
SWA_EVICTED_COLUMN = "req_swa_evicted"
# The Mamba state slot of each listed request (``StepSnapshot.mamba_slot``, -1: none): logs
# with a Mamba pool only.
MAMBA_SLOT_COLUMN = "req_mamba_slot"


def state_log_schema(other_pools: tuple[str, ...] = (), sessions: bool = False) -> pa.Schema:
    """The state log's schema for an allocator whose pools after the full one are
    ``other_pools`` (``POOL_NAMES[1:]``, in order): ``STATE_LOG_SCHEMA`` plus, per
    pool, one column per counter named ``{pool}_{field}``, and with an SWA pool the
    requests' SWA cursors (``SWA_EVICTED_COLUMN``, a list column like ``req_rid``), with a
    Mamba pool their state slots (``MAMBA_SLOT_COLUMN``, the same). With ``sessions`` (a
    trace with streaming sessions), each pool's ``session_held`` counter too, after its
    other counters."""
    if not other_pools and not sessions:
        return STATE_LOG_SCHEMA
    fields = _POOL_FIELDS if sessions else _LOGGED_FIELDS
    base = list(STATE_LOG_SCHEMA)
    if sessions:
        at = base.index(STATE_LOG_SCHEMA.field(_LOGGED_FIELDS[-1])) + 1
        base.insert(at, pa.field(SESSION_HELD, pa.int64(), nullable=False))
    cursors = [pa.field(SWA_EVICTED_COLUMN, pa.list_(pa.int64()))] if "swa" in other_pools else []
    if "mamba" in other_pools:
        cursors.append(pa.field(MAMBA_SLOT_COLUMN, pa.list_(pa.int64())))
    return pa.schema(
        base
        + [pa.field(f"{pool}_{name}", pa.int64(), nullable=False) for pool in other_pools for name in fields]
        + cursors
    )


def other_pools_of(schema: pa.Schema) -> tuple[str, ...]:
    """The pools after the full one whose counters a state log's schema holds (in order)."""
    names = set(schema.names)
    return tuple(pool for pool in POOL_NAMES[1:] if f"{pool}_{_POOL_FIELDS[0]}" in names)


# Columns that differ between two runs of the same replay (timings): not compared.
TIMING_COLUMNS = ("allocator_s",)


class StateLogWriter:
    """Writes snapshots, one record batch per ``steps_per_batch``: to a file as an Arrow
    IPC file (the footer is written by ``close``), to a binary stream as an IPC stream.

    Args:
        path: output file (overwritten; ``kvtrace.outputs`` decides whether it may be),
            or a writable binary stream (a pipe: the per-step record stream of a
            ``kvtrace diff`` side, ``kvtrace.proc.child``).
        info: JSON-able description stored in the schema metadata (trace, allocator, options).
        steps_per_batch: snapshots buffered per record batch (each batch is flushed).
        compression: ``zstd`` (files), or None (pipes: no CPU spent on it).
        sessions: the trace has streaming sessions: the log has ``session_held`` columns.
        step_columns: the names of int64 columns of the caller's, one value per step
            each (``write``'s ``values``), after the others (``replay --explain``: the
            missed tokens by cause, ``kvtrace.explain.attribution.STEP_COLUMNS``). None
            by default: the log has the plain schema.

    Raises:
        TraceError: the file cannot be created.
    """

    def __init__(
        self,
        path: str | Path | BinaryIO,
        info: dict[str, Any],
        steps_per_batch: int = 256,
        compression: str | None = "zstd",
        sessions: bool = False,
        step_columns: tuple[str, ...] = (),
    ) -> None:
        meta = {"version": STATE_LOG_VERSION, **info}
        self._metadata = {STATE_LOG_METADATA_KEY: json.dumps(meta).encode()}
        self._options = pa.ipc.IpcWriteOptions(compression=compression)
        if isinstance(path, (str, Path)):
            self.path: Path | None = Path(path)
            try:
                self._sink: Any = pa.OSFile(str(self.path), "wb")
            except OSError as exc:
                raise TraceError(f"{self.path}: cannot write the state log ({exc.strerror or exc})") from None
        else:
            self.path = None
            self._sink = pa.PythonFile(path, mode="w")
        # NOTE: the schema depends on the allocator's pools, which the first step says:
        # the IPC writer starts with the first batch (or at close, for no step).
        self._writer: Any = None
        self._schema = STATE_LOG_SCHEMA
        self._steps_per_batch = steps_per_batch
        self._sessions = sessions
        self._buf: list[StepSnapshot] = []
        self._step_columns = step_columns
        self._values: list[tuple[int, ...]] = []  # per buffered step: its step_columns' values
        self.steps_written = 0

    def write(self, snap: StepSnapshot, values: tuple[int, ...] = ()) -> None:
        """Buffer one step (``values``: its ``step_columns``' values, in order)."""
        if len(values) != len(self._step_columns):
            raise ValueError(f"step {snap.step}: {len(values)} values for the columns {self._step_columns}")
        self._buf.append(snap)
        if values:
            self._values.append(values)
        if len(self._buf) >= self._steps_per_batch:
            self.flush()

    def write_block(self, block: SnapshotBlock) -> None:
        """Write the steps of ``block`` as one record batch now (after any buffered; a log
        of no ``step_columns``)."""
        if self._step_columns:
            raise ValueError(f"a block has no values for the columns {self._step_columns}: write its steps one by one")
        self.flush()
        if block.num_steps:
            self._write(block)

    def flush(self) -> None:
        if not self._buf:
            return
        extra = None
        if self._step_columns:
            values = np.array(self._values, np.int64).reshape(len(self._buf), len(self._step_columns))
            extra = {name: values[:, i] for i, name in enumerate(self._step_columns)}
        self._write(SnapshotBlock.of(self._buf), extra)
        self._buf = []
        self._values = []

    def _write(self, block: SnapshotBlock, extra: dict[str, np.ndarray] | None = None) -> None:
        if self._writer is None:
            n = 0 if block.other_pools is None else block.other_pools.shape[1]
            self._start(other_pool_names(block.other_pool_names, n))
        self._writer.write_batch(record_batch_of(block, self._schema, extra))
        self._sink.flush()
        self.steps_written += block.num_steps

    def _start(self, other_pools: tuple[str, ...]) -> None:
        schema = state_log_schema(other_pools, self._sessions)
        for name in self._step_columns:
            schema = schema.append(pa.field(name, pa.int64(), nullable=False))
        self._schema = schema.with_metadata(self._metadata)
        if self.path is not None:
            self._writer = pa.ipc.new_file(self._sink, self._schema, options=self._options)
        else:
            self._writer = pa.ipc.new_stream(self._sink, self._schema, options=self._options)

    def close(self) -> None:
        self.flush()
        if self._writer is None:
            self._start(())
        self._writer.close()
        self._sink.close()

    def __enter__(self) -> StateLogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def to_record_batch(snaps: list[StepSnapshot], schema: pa.Schema = STATE_LOG_SCHEMA) -> pa.RecordBatch:
    """Snapshots -> one record batch of the state log schema (one row per snapshot)."""
    return record_batch_of(SnapshotBlock.of(snaps), schema)


def record_batch_of(block: SnapshotBlock, schema: pa.Schema = STATE_LOG_SCHEMA,
                    extra: dict[str, np.ndarray] | None = None) -> pa.RecordBatch:
    """A block of snapshots -> one record batch of the state log schema (one row per step;
    ``extra``: the values of the schema's caller columns, ``StateLogWriter``'s ``step_columns``)."""
    n = block.num_steps
    cols: dict[str, Any] = {"step": pa.array(block.steps), "time_s": pa.array(block.times)}
    for i, name in enumerate(_POOL_FIELDS):  # session_held: only where the schema has it
        cols[name] = pa.array(block.pools[:, i])
    cols["num_ops"] = pa.array(block.num_ops)
    cols["allocator_s"] = pa.array(block.allocator_s)
    cols["keyframe"] = pa.array(block.keyframes, pa.bool_())
    offsets = np.zeros(n + 1, np.int32)
    np.cumsum(block.row_counts, out=offsets[1:])
    off = pa.array(offsets)
    for values, (name, arrow_type, dtype) in zip(block.requests, _REQUEST_COLUMNS):
        cols[name] = pa.ListArray.from_arrays(off, pa.array(values.astype(dtype, copy=False), arrow_type))
    cols["events"] = _events_column(block)
    cols["digest"] = pa.array(block.digests, pa.utf8())
    if block.other_pools is not None:
        for p, pool in enumerate(other_pool_names(block.other_pool_names, block.other_pools.shape[1])):
            for i, name in enumerate(_POOL_FIELDS):
                cols[f"{pool}_{name}"] = pa.array(block.other_pools[:, p, i])
    if SWA_EVICTED_COLUMN in schema.names:
        cursors = block.swa_evicted if block.swa_evicted is not None else np.zeros(int(offsets[-1]), np.int64)
        cols[SWA_EVICTED_COLUMN] = pa.ListArray.from_arrays(off, pa.array(cursors.astype(np.int64, copy=False)))
    if MAMBA_SLOT_COLUMN in schema.names:
        slots = block.mamba_slot if block.mamba_slot is not None else np.full(int(offsets[-1]), -1, np.int64)
        cols[MAMBA_SLOT_COLUMN] = pa.ListArray.from_arrays(off, pa.array(slots.astype(np.int64, copy=False)))
    for name, values in (extra or {}).items():
        cols[name] = pa.array(values, pa.int64())
    return pa.record_batch([cols[f.name] for f in schema], schema=schema)


def _events_column(block: SnapshotBlock) -> pa.Array:
    offsets = np.zeros(block.num_steps + 1, np.int32)
    if block.events:
        np.cumsum(np.bincount(np.searchsorted(block.steps, block.event_steps), minlength=block.num_steps), out=offsets[1:])
    events = block.events
    values = pa.StructArray.from_arrays(
        [
            pa.array([e.kind for e in events], pa.utf8()),
            pa.array([e.rid for e in events], pa.int64()),
            pa.array([e.tokens for e in events], pa.int64()),
            pa.array([e.detail for e in events], pa.utf8()),
        ],
        fields=list(EVENT_TYPE),
    )
    return pa.ListArray.from_arrays(pa.array(offsets), values)


class _PipeBatches:
    """The record batches of an IPC stream read from a pipe (``IpcReader``'s interface)."""

    def __init__(self, reader: pa.ipc.RecordBatchStreamReader) -> None:
        self.schema = reader.schema
        self.truncated = False
        self._reader = reader

    def iter_batches(self) -> Iterator[pa.RecordBatch]:
        return iter(self._reader)

    def close(self) -> None:
        self._reader.close()


def open_state_log(source: str | Path | BinaryIO) -> tuple[dict[str, Any], IpcReader | _PipeBatches]:
    """Open a state log (a file, or a readable binary stream): its stored info and a
    reader of its record batches (``reader.iter_batches()``; ``snapshots_of`` turns a
    batch into snapshots; after an iteration ``reader.truncated`` says whether a file
    was cut short).

    Raises:
        TraceError: the file is missing, not Arrow IPC, or not a kvtrace state log of a
            version this kvtrace reads.
    """
    if isinstance(source, (str, Path)):
        reader: IpcReader | _PipeBatches = IpcReader(source, what="state log")
        name = str(reader.path)
    else:
        name = "the record stream"
        try:
            reader = _PipeBatches(pa.ipc.open_stream(source))
        except (OSError, pa.ArrowInvalid) as exc:
            raise TraceError(f"{name}: not an Arrow state log stream ({exc})") from None
    raw = (reader.schema.metadata or {}).get(STATE_LOG_METADATA_KEY)
    if raw is None:
        raise TraceError(f"{name}: Arrow IPC, but not a kvtrace state log (no '{STATE_LOG_METADATA_KEY.decode()}' metadata)")
    try:
        info = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceError(f"state log {name}: its metadata is not valid JSON ({exc})") from None
    if not isinstance(info, dict) or info.get("version") != STATE_LOG_VERSION:
        version = info.get("version") if isinstance(info, dict) else None
        raise TraceError(
            f"{name}: state log version {version} is not supported (this kvtrace reads version "
            f"{STATE_LOG_VERSION}); write it again with 'kvtrace replay TRACE --out LOG'"
        )
    return info, reader


def trace_identity(path: str | Path) -> dict[str, Any]:
    """What a state log's info records of the trace replayed (its ``"trace_file"`` entry),
    so that ``kvtrace diff LOG_A LOG_B`` can tell replays of different traces apart.

    Returns:
        ``path`` (resolved), ``file_bytes`` and ``digest`` (the hash of the file's bytes,
        ``traces.identity.trace_digest``); both None for a pipe, which reads once.
    """
    from traces.identity import trace_digest

    resolved = Path(path).resolve()
    if not resolved.is_file():
        return {"path": str(resolved), "file_bytes": None, "digest": None}
    return {"path": str(resolved), "file_bytes": resolved.stat().st_size, "digest": trace_digest(resolved)}


def replay_log_writer(path: str | Path, session: Any, trace: str, step_columns: tuple[str, ...] = ()) -> StateLogWriter:
    """The state log writer for a replay session (``kvtrace.replay.session.ReplaySession``)
    of ``trace`` (as the user named it): its info names the trace, its file, the allocator,
    the configuration and the namespaces (for ``kvtrace view``'s header), and its columns
    follow the trace (``session_held`` for streaming sessions), then ``step_columns``
    (``StateLogWriter``'s)."""
    from kvtrace.replay.config import config_dict

    info: dict[str, Any] = {"trace": trace, "trace_file": trace_identity(session.reader.path),
                            "allocator": session.version.spec, "config": config_dict(session.config)}
    if session.meta.namespaces is not None:
        info["namespaces"] = len(session.meta.namespaces.names)
    return StateLogWriter(path, info, sessions=session.meta.config.sessions, step_columns=step_columns)


def read_state_log(path: str | Path) -> tuple[dict[str, Any], Iterator[StepSnapshot]]:
    """Open a state log: its stored info and a lazy iterator of snapshots.

    Raises:
        TraceError: as ``open_state_log``; a damaged batch while iterating.
    """
    info, reader = open_state_log(path)

    def snapshots() -> Iterator[StepSnapshot]:
        for batch in reader.iter_batches():
            yield from snapshots_of(batch)

    return info, snapshots()


def _pool_column(col: dict[str, pa.Array], name: str) -> np.ndarray:
    """A pool counter's column; zeros for ``session_held`` in a log without it (a trace
    without sessions, or a log written before them)."""
    if name not in col and name.endswith(SESSION_HELD):
        return np.zeros(len(col["step"]), np.int64)
    return col[name].to_numpy()


def block_of(batch: pa.RecordBatch) -> SnapshotBlock:
    """The steps of one record batch of a state log as a ``SnapshotBlock`` (columns, no
    per-step objects: what a dashboard folds at thousands of steps a second)."""
    col = {name: batch.column(name) for name in batch.schema.names}
    steps = col["step"].to_numpy()
    lists = []
    counts = np.zeros(batch.num_rows, np.int64)
    for name, _, dtype in _REQUEST_COLUMNS:
        offsets = col[name].offsets.to_numpy()
        values = col[name].values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]
        lists.append(values.astype(dtype, copy=False))
        counts = np.diff(offsets).astype(np.int64)
    events_col = col["events"]
    flat = events_col.flatten()
    event_steps = np.repeat(steps, np.diff(events_col.offsets.to_numpy())).tolist() if len(flat) else []
    events = [Event(k, r, t, d) for k, r, t, d in zip(flat.field("kind").to_pylist(), flat.field("rid").to_pylist(),
                                                      flat.field("tokens").to_pylist(), flat.field("detail").to_pylist())]
    return SnapshotBlock(
        steps=steps.astype(np.int64, copy=False),
        times=col["time_s"].to_numpy(),
        pools=np.stack([_pool_column(col, name) for name in _POOL_FIELDS], axis=1).astype(np.int64, copy=False),
        keyframes=col["keyframe"].to_numpy(zero_copy_only=False),
        num_ops=col["num_ops"].to_numpy(),
        allocator_s=col["allocator_s"].to_numpy(),
        row_counts=counts,
        requests=RequestDelta(*lists),
        event_steps=event_steps,
        events=events,
        digests=col["digest"].to_pylist() if "digest" in col else [None] * batch.num_rows,
        other_pools=_other_pools_of(batch),
        other_pool_names=other_pools_of(batch.schema),
        swa_evicted=_swa_evicted_of(batch),
        mamba_slot=_row_values_of(batch, MAMBA_SLOT_COLUMN),
    )


def _swa_evicted_of(batch: pa.RecordBatch) -> np.ndarray | None:
    """int64 [rows]: the SWA cursor of every listed request of the batch's steps (None:
    the log has no SWA cursors)."""
    return _row_values_of(batch, SWA_EVICTED_COLUMN)


def _row_values_of(batch: pa.RecordBatch, name: str) -> np.ndarray | None:
    """int64 [rows]: list column ``name`` of every listed request of the batch's steps
    (None: the log has no such column, as one written before it)."""
    if name not in batch.schema.names:
        return None
    column = batch.column(name)
    offsets = column.offsets.to_numpy()
    values = column.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]
    return values.astype(np.int64, copy=False)


def _other_pools_of(batch: pa.RecordBatch) -> np.ndarray | None:
    """int64 ``[k, n, fields]``: the counters of the ``n`` pools after the full one (None: one pool)."""
    pools = other_pools_of(batch.schema)
    if not pools:
        return None
    col = {name: batch.column(name) for name in batch.schema.names}
    cols = [[_pool_column(col, f"{pool}_{name}") for name in _POOL_FIELDS] for pool in pools]
    return np.stack([np.stack(c, axis=1) for c in cols], axis=1).astype(np.int64, copy=False)


def snapshots_of(batch: pa.RecordBatch) -> list[StepSnapshot]:
    """The snapshots of one record batch of a state log (a log without the ``digest``
    column, written before it existed, reads with ``digest=None``)."""
    n = batch.num_rows
    col = {name: batch.column(name) for name in batch.schema.names}
    pools = [_pool_column(col, name) for name in _POOL_FIELDS]
    steps = col["step"].to_numpy()
    times = col["time_s"].to_numpy()
    num_ops = col["num_ops"].to_numpy()
    alloc_s = col["allocator_s"].to_numpy()
    keyframes = col["keyframe"].to_numpy(zero_copy_only=False)
    digests = col["digest"].to_pylist() if "digest" in col else [None] * n
    lists = []
    for name, _, dtype in _REQUEST_COLUMNS:
        arr = col[name]
        lists.append((arr.offsets.to_numpy(), arr.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)))
    events = col["events"].to_pylist()
    others = _other_pools_of(batch)
    cursors = _swa_evicted_of(batch)
    slots = _row_values_of(batch, MAMBA_SLOT_COLUMN)
    offsets = lists[0][0] - lists[0][0][0]
    out = []
    for i in range(n):
        parts = [values[offs[i] : offs[i + 1]] for offs, values in lists]
        out.append(StepSnapshot(
            step=int(steps[i]),
            time_s=float(times[i]),
            pool=PoolCounters(*(int(p[i]) for p in pools)),
            requests=RequestDelta(*parts),
            events=tuple(Event(e["kind"], e["rid"], e["tokens"], e["detail"]) for e in events[i]),
            num_ops=int(num_ops[i]),
            allocator_s=float(alloc_s[i]),
            keyframe=bool(keyframes[i]),
            digest=digests[i],
            other_pools=() if others is None else tuple(PoolCounters(*(int(v) for v in row)) for row in others[i]),
            other_pool_names=other_pools_of(batch.schema),
            swa_evicted=None if cursors is None else cursors[offsets[i] : offsets[i + 1]],
            mamba_slot=None if slots is None else slots[offsets[i] : offsets[i + 1]],
        ))
    return out
