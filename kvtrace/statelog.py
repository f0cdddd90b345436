"""The state log: an Arrow IPC stream of step snapshots (``kvtrace replay --out``).

One row per replayed step; ``STATE_LOG_SCHEMA`` is the single definition. Any
Arrow reader opens it (``pyarrow.ipc.open_stream``, ``pandas``, ``polars``); the
dashboard and diff read it back as ``StepSnapshot``s with ``read_state_log``.

Columns: the step and its time, the pool counters (``allocator.base.PoolCounters``),
the requests the step changed (list columns aligned by position: id, lengths, the
op that changed it, its phase, the prefix it reused), the step's events (list of
structs), the op count, the allocator time, and whether the row is a keyframe
(its request lists hold every live request: the first step of a ``--steps`` window).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from kvtrace.errors import TraceError
from kvtrace.snapshot import Event, PoolCounters, RequestDelta, StepSnapshot

STATE_LOG_VERSION = 2
STATE_LOG_METADATA_KEY = b"kvtrace.statelog"

_POOL_FIELDS = PoolCounters._fields
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
    + [pa.field(name, pa.int64(), nullable=False) for name in _POOL_FIELDS]
    + [
        pa.field("num_ops", pa.int32(), nullable=False),
        pa.field("allocator_s", pa.float64(), nullable=False),
        pa.field("keyframe", pa.bool_(), nullable=False),
    ]
    + [pa.field(name, pa.list_(arrow_type)) for name, arrow_type, _ in _REQUEST_COLUMNS]
    + [pa.field("events", pa.list_(EVENT_TYPE))]
)


class StateLogWriter:
    """Streams snapshots to an Arrow IPC file, one record batch per ``steps_per_batch``.

    Args:
        path: output file (overwritten).
        info: JSON-able description stored in the schema metadata (trace, allocator, options).
        steps_per_batch: snapshots buffered per record batch (each batch is flushed).

    Raises:
        TraceError: the file cannot be created.
    """

    def __init__(self, path: str | Path, info: dict[str, Any], steps_per_batch: int = 256) -> None:
        self.path = Path(path)
        meta = {"version": STATE_LOG_VERSION, **info}
        self._schema = STATE_LOG_SCHEMA.with_metadata({STATE_LOG_METADATA_KEY: json.dumps(meta).encode()})
        try:
            self._sink = pa.OSFile(str(self.path), "wb")
        except OSError as exc:
            raise TraceError(f"{self.path}: cannot write the state log ({exc.strerror or exc})") from None
        self._writer = pa.ipc.new_stream(
            self._sink, self._schema, options=pa.ipc.IpcWriteOptions(compression="zstd")
        )
        self._steps_per_batch = steps_per_batch
        self._buf: list[StepSnapshot] = []
        self.steps_written = 0

    def write(self, snap: StepSnapshot) -> None:
        self._buf.append(snap)
        if len(self._buf) >= self._steps_per_batch:
            self.flush()

    def flush(self) -> None:
        if not self._buf:
            return
        self._writer.write_batch(_to_batch(self._buf, self._schema))
        self._sink.flush()
        self.steps_written += len(self._buf)
        self._buf = []

    def close(self) -> None:
        self.flush()
        self._writer.close()
        self._sink.close()

    def __enter__(self) -> StateLogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _to_batch(snaps: list[StepSnapshot], schema: pa.Schema) -> pa.RecordBatch:
    cols: dict[str, Any] = {
        "step": pa.array([s.step for s in snaps], pa.int64()),
        "time_s": pa.array([s.time_s for s in snaps], pa.float64()),
    }
    for i, name in enumerate(_POOL_FIELDS):
        cols[name] = pa.array([s.pool[i] for s in snaps], pa.int64())
    cols["num_ops"] = pa.array([s.num_ops for s in snaps], pa.int32())
    cols["allocator_s"] = pa.array([s.allocator_s for s in snaps], pa.float64())
    cols["keyframe"] = pa.array([s.keyframe for s in snaps], pa.bool_())
    offsets = np.zeros(len(snaps) + 1, np.int32)
    offsets[1:] = np.cumsum([s.requests.rids.shape[0] for s in snaps])
    off = pa.array(offsets, pa.int32())
    for attr, (name, arrow_type, dtype) in enumerate(_REQUEST_COLUMNS):
        parts = [s.requests[attr] for s in snaps]
        values = np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)
        cols[name] = pa.ListArray.from_arrays(off, pa.array(values, arrow_type))
    cols["events"] = pa.array(
        [[{"kind": e.kind, "rid": e.rid, "tokens": e.tokens, "detail": e.detail} for e in s.events] for s in snaps],
        pa.list_(EVENT_TYPE),
    )
    return pa.record_batch([cols[f.name] for f in schema], schema=schema)


def read_state_log(path: str | Path) -> tuple[dict[str, Any], Iterator[StepSnapshot]]:
    """Open a state log: its stored info and a lazy iterator of snapshots.

    Raises:
        TraceError: the file is missing, not an Arrow stream, or not a kvtrace state log.
    """
    p = Path(path)
    try:
        reader = pa.ipc.open_stream(pa.OSFile(str(p), "rb"))
    except FileNotFoundError:
        raise TraceError(f"{p}: no such state log") from None
    except (OSError, pa.ArrowInvalid) as exc:
        raise TraceError(f"{p}: not an Arrow state log ({exc})") from None
    info = state_log_info(p, reader.schema)

    def snapshots() -> Iterator[StepSnapshot]:
        for batch in reader:
            yield from batch_snapshots(batch)

    return info, snapshots()


def state_log_info(path: Path, schema: pa.Schema) -> dict[str, Any]:
    """The info stored in a state log's schema, its version checked.

    Raises:
        TraceError: not a kvtrace state log, or a version this kvtrace does not read.
    """
    raw = (schema.metadata or {}).get(STATE_LOG_METADATA_KEY)
    if raw is None:
        raise TraceError(f"{path}: an Arrow stream, but not a kvtrace state log (no '{STATE_LOG_METADATA_KEY.decode()}' metadata)")
    info = json.loads(raw)
    if info.get("version") != STATE_LOG_VERSION:
        raise TraceError(
            f"{path}: state log version {info.get('version')} is not supported (this kvtrace reads version "
            f"{STATE_LOG_VERSION}); write it again with 'kvtrace replay TRACE --out LOG'"
        )
    return info


def batch_snapshots(batch: pa.RecordBatch) -> Iterator[StepSnapshot]:
    """The snapshots of one record batch of a state log, in order."""
    n = batch.num_rows
    col = {name: batch.column(name) for name in batch.schema.names}
    pools = [col[name].to_numpy() for name in _POOL_FIELDS]
    steps = col["step"].to_numpy()
    times = col["time_s"].to_numpy()
    num_ops = col["num_ops"].to_numpy()
    alloc_s = col["allocator_s"].to_numpy()
    keyframes = col["keyframe"].to_numpy(zero_copy_only=False)
    lists = []
    for name, _, dtype in _REQUEST_COLUMNS:
        arr = col[name]
        lists.append((arr.offsets.to_numpy(), arr.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)))
    events = col["events"].to_pylist()
    for i in range(n):
        parts = [values[offs[i] : offs[i + 1]] for offs, values in lists]
        yield StepSnapshot(
            step=int(steps[i]),
            time_s=float(times[i]),
            pool=PoolCounters(*(int(p[i]) for p in pools)),
            requests=RequestDelta(*parts),
            events=tuple(Event(e["kind"], e["rid"], e["tokens"], e["detail"]) for e in events[i]),
            num_ops=int(num_ops[i]),
            allocator_s=float(alloc_s[i]),
            keyframe=bool(keyframes[i]),
        )
