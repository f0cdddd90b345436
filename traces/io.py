"""Writer and reader of kvtrace traces (Arrow IPC: a stream, or a file).

The writer buffers ``steps_per_batch`` whole steps, writes them as one record
batch and flushes the file, so a recording killed with SIGKILL leaves every
completed batch readable. Closing it records the final status of the recording
(complete, or interrupted and why) and, when asked to compact, rewrites the trace
as an Arrow IPC *file* (with a footer: random access, memory-mapping, lazy scans
in polars, pandas and DuckDB). The reader accepts both the stream and the file
layout, validates the schema and metadata once when it opens a file, then
streams record batches (memory flat in trace length) and yields one
``StepBatch`` per step.

Opening, framing and telling truncation from corruption are ``traces.ipc``'s
(``IpcReader``, which ``TraceReader`` extends with the trace's metadata, columns
and steps).
"""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, NamedTuple

import numpy as np
import pyarrow as pa

from traces.atomic import replacing
from traces.errors import (
    TraceError,
    TraceMetadataError,
    TraceReadError,
    TraceSchemaError,
    TraceVersionError,
    TraceWriteError,
)
from traces.ipc import (
    IpcFormat,
    IpcReader,
    ResumePoint,
    arrow_array,
    count_rows,
    numpy_filled,
    numpy_view,
    os_reason,
    string_array,
    validity,
)
from traces.schema import (
    COLUMN_BY_NAME,
    COLUMNS,
    MAX_RID,
    METADATA_KEY,
    OP_CODE,
    OPS,
    REQUIRED_COLUMNS,
    SCHEMA_VERSION,
    Ragged,
    Recording,
    StepBatch,
    TraceMeta,
    arrow_schema,
    parse_meta_json,
    timestamp,
)

Compression = Literal["zstd", "lz4"]
COMPRESSIONS: tuple[str, ...] = ("zstd", "lz4")

_OPS_DICTIONARY = string_array(OPS)
_LIST_TYPES = {name: COLUMN_BY_NAME[name].type for name in ("block_hashes", "token_ids")}
_LIST_DTYPES = {"block_hashes": np.uint64, "token_ids": np.int64}
_ROW_COLUMNS = (
    "op", "rid", "seq_len", "append_len", "draft_len", "accepted_len", "prefix_len", "prompt_len",
)
_NUMERIC = (
    ("seq_len", np.int64),
    ("append_len", np.int32),
    ("draft_len", np.int32),
    ("accepted_len", np.int32),
    ("prefix_len", np.int64),
)


# Record-batch custom metadata: CRC-32 of the batch's logical content (see ``_checksum``).
# Arrow IPC has no checksums of its own, and a damaged lz4 or zstd literal run
# decodes silently to wrong values.
CHECKSUM_KEY = b"kvtrace.crc32"
# CRC-32 of the ``arrival_s`` column (float64, nulls as NaN), kept apart so that readers
# from before the column still verify ``CHECKSUM_KEY``.
ARRIVAL_CHECKSUM_KEY = b"kvtrace.crc32.arrival_s"
# Custom metadata of a stream's last (empty) record batch: the final ``Recording`` as JSON.
RECORDING_KEY = b"kvtrace.recording"


def _checksum(arrays: Sequence[np.ndarray]) -> bytes:
    """CRC-32 of the arrays' bytes, in order, as 8 hex digits."""
    crc = 0
    for array in arrays:
        crc = zlib.crc32(np.ascontiguousarray(array), crc)
    return b"%08x" % crc


class _StepWrite:
    """Whether the main thread is writing a step, and an interruption held back meanwhile."""

    depth = 0
    held: BaseException | None = None


@contextmanager
def _writing_step() -> Iterator[None]:
    """A step is being written: an interruption (``interrupt_when_safe``) waits until it is
    on disk, so the trace and its recorded step count agree."""
    if threading.current_thread() is not threading.main_thread():  # signals run in the main thread
        yield
        return
    _StepWrite.depth += 1
    try:
        yield
    except BaseException:
        _StepWrite.depth -= 1
        if _StepWrite.depth == 0:
            _StepWrite.held = None  # the write failed: its error is what the caller sees
        raise
    _StepWrite.depth -= 1
    if _StepWrite.depth == 0 and _StepWrite.held is not None:
        held, _StepWrite.held = _StepWrite.held, None
        raise held


def interrupt_when_safe(exc: BaseException) -> None:
    """For a signal handler: raise ``exc`` now, or, while a trace writer is writing a
    step, as soon as that step is on disk (then its ``with`` block marks the trace
    interrupted after a whole step, never half of one).

    Raises:
        BaseException: ``exc``, unless held back.
    """
    if _StepWrite.depth:
        _StepWrite.held = exc
        return
    raise exc


_STOPPED_COMPACTING = "kvtrace_stopped_compacting"


def stopped_compacting(exc: BaseException) -> bool:
    """Whether ``exc`` stopped a writer while it compacted a complete recording (its
    trace is complete, marked so, and left as the stream it was written as)."""
    return bool(getattr(exc, "__dict__", {}).get(_STOPPED_COMPACTING))


def describe_stop(exc: BaseException) -> str:
    """Why a writer is being closed by ``exc``, in a few words (``Recording.detail``)."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted by Ctrl-C (SIGINT)"
    if isinstance(exc, Exception):
        return " ".join(f"stopped by an error: {type(exc).__name__}: {exc}".split())
    return str(exc) or type(exc).__name__  # e.g. a signal turned into an exception


# --------------------------------------------------------------------------------------
# Writer
# --------------------------------------------------------------------------------------


def compact_trace(
    path: str | os.PathLike[str],
    *,
    steps_per_batch: int,
    compression: Compression = "zstd",
    recording: Recording | None = None,
    out: str | os.PathLike[str] | None = None,
) -> int:
    """Rewrite a trace as an Arrow IPC file with ``steps_per_batch`` steps per batch: in
    place, or into ``out``.

    In place, the new file is written beside the old one and renamed over it, so a
    crash at any point leaves either the old or the new file, both complete. A
    stream cut short (a killed recording) keeps its complete steps and is marked
    interrupted.

    Args:
        path: the trace (a stream or a file).
        steps_per_batch: whole steps per record batch of the new file.
        compression: its codec.
        recording: the recording status to store (the writer passes the final one it
            knows at close); None: the trace's own final status (read first, when the
            trace records one).
        out: write the new file here instead (created or truncated: the caller makes
            that safe, e.g. ``kvtrace.outputs``); None: replace ``path``.

    Returns:
        The number of steps written.

    Raises:
        TraceWriteError: the new file cannot be written (the old one is kept).
        TraceError: the trace cannot be read.
    """
    src = Path(path)
    reader = TraceReader(src)
    if recording is None and reader.meta.recording is not None:
        for _ in reader.iter_batches():  # a stream's final status is in its last batch
            pass
        recording = reader.recording
    meta = reader.meta if recording is None else replace(reader.meta, recording=recording)

    def rewrite(dest: Path) -> int:
        with TraceWriter(
            dest, meta, compression=compression, steps_per_batch=steps_per_batch, ipc_format="file", overwrite=True
        ) as writer:
            for batch in reader.steps():
                writer.write(batch)
        return writer.steps_written

    try:
        if out is not None:
            return rewrite(Path(out))
        with replacing(src) as tmp:
            return rewrite(tmp)
    except OSError as exc:
        raise TraceWriteError(f"cannot rewrite trace {src}: {os_reason(exc)}", path=src) from None


class TraceWriter:
    """Write a trace step by step; a context manager.

    Args:
        path: the ``.kvtrace`` file to create.
        meta: the trace metadata (stored as JSON in the schema metadata).
        compression: ``"zstd"`` (smaller) or ``"lz4"`` (faster).
        steps_per_batch: whole steps buffered per record batch; the file is flushed
            after every batch, so at most this many steps are lost to a crash.
        overwrite: replace an existing file instead of refusing.
        compression_level: codec level (None: the codec's default).
        compact_steps_per_batch: on a clean ``close``, rewrite the file with this many
            steps per record batch and ``compact_compression`` (atomically: a rename
            over the original). Lets a recorder write every step durably as it goes
            (``steps_per_batch=1``, fast ``lz4``) and still leave a compact file; a
            writer killed before ``close`` leaves the durable per-step file.
        compact_compression: the codec of the compacted file.
        ipc_format: ``"stream"`` (durable batch by batch; what a recording writes) or
            ``"file"`` (the footer is written at ``close``; what compaction writes).

    When ``meta.recording`` is set, ``close`` stores the final status of the
    recording: in a stream, in the custom metadata (``RECORDING_KEY``) of a last,
    empty record batch; a compacted file carries it in its schema metadata.

    Raises:
        ValueError: a bad ``compression`` or ``steps_per_batch``.
        TraceWriteError: the file exists (without ``overwrite``), is a directory, or
            cannot be created or written (the message names the path and the reason).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        meta: TraceMeta,
        *,
        compression: Compression = "zstd",
        steps_per_batch: int = 1,
        overwrite: bool = False,
        compression_level: int | None = None,
        compact_steps_per_batch: int | None = None,
        compact_compression: Compression = "zstd",
        ipc_format: IpcFormat = "stream",
    ) -> None:
        if ipc_format not in ("stream", "file"):
            raise ValueError(f"ipc_format must be 'stream' or 'file', not {ipc_format!r}")
        self.ipc_format = ipc_format
        self.recording = meta.recording  # the final one after close
        if compact_compression not in COMPRESSIONS:
            raise ValueError(f"compact_compression must be one of {', '.join(COMPRESSIONS)}, not {compact_compression!r}")
        if compact_steps_per_batch is not None and (not isinstance(compact_steps_per_batch, int) or compact_steps_per_batch < 1):
            raise ValueError(f"compact_steps_per_batch must be a positive integer, not {compact_steps_per_batch!r}")
        self.compact_steps_per_batch = compact_steps_per_batch
        self.compact_compression = compact_compression
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {', '.join(COMPRESSIONS)}, not {compression!r}")
        if not isinstance(steps_per_batch, int) or steps_per_batch < 1:
            raise ValueError(f"steps_per_batch must be a positive integer, not {steps_per_batch!r}")
        self.path = Path(path)
        self.meta = meta
        self.steps_per_batch = steps_per_batch
        self._schema = arrow_schema(meta)
        self._pending: list[StepBatch] = []
        self._last_step: int | None = None
        self._steps_written = 0
        self._rows_written = 0
        self._closed = False
        if self.path.is_dir():
            raise TraceWriteError(f"cannot write trace {self.path}: it is a directory", path=self.path)
        if self.path.exists() and not overwrite:
            raise TraceWriteError(
                f"trace {self.path} already exists; remove it or overwrite it", path=self.path
            )
        codec = pa.Codec(compression, compression_level)
        try:
            if not overwrite:  # created exclusively: a writer that raced this one gets the error below
                os.close(os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            self._raw = pa.OSFile(str(self.path), "wb")
        except FileExistsError:
            raise TraceWriteError(
                f"trace {self.path} already exists; remove it or overwrite it", path=self.path
            ) from None
        except OSError as exc:
            raise TraceWriteError(
                f"cannot create trace {self.path}: {os_reason(exc)}", path=self.path
            ) from None
        try:
            # One write(2) per record batch: the buffer is flushed after each batch.
            self._sink = pa.BufferedOutputStream(self._raw, buffer_size=1 << 20)
            # Per-buffer thread hand-offs cost more than they save on batches this small.
            options = pa.ipc.IpcWriteOptions(compression=codec, use_threads=False)
            if ipc_format == "file":
                self._ipc = pa.ipc.new_file(self._sink, self._schema, options=options)
            else:
                self._ipc = pa.ipc.new_stream(self._sink, self._schema, options=options)
                # pyarrow writes the schema lazily; an empty first batch puts the schema
                # and the metadata on disk now, so a writer killed before its first step
                # still leaves a readable (empty, truncated) trace.
                self._write_empty({})
                self._sink.flush()
        except OSError as exc:
            self._abandon()
            raise TraceWriteError(
                f"cannot write trace {self.path}: {os_reason(exc)}", path=self.path
            ) from None

    # -- public API ------------------------------------------------------------------

    @property
    def steps_written(self) -> int:
        """Steps accepted so far (buffered ones included)."""
        return self._steps_written

    @property
    def rows_written(self) -> int:
        """Rows accepted so far (buffered ones included)."""
        return self._rows_written

    @property
    def closed(self) -> bool:
        return self._closed

    def write(self, batch: StepBatch) -> None:
        """Append one step. Its rows are put in ``OP_ORDER`` (stably) if they are not.

        A step without rows is accepted and not written (nothing happened in it).

        Raises:
            ValueError: the step number is not greater than the previous one, columns of
                different lengths, an op code outside ``OPS``, or a closed writer.
            TraceWriteError: the file cannot be written.
        """
        n = len(batch)
        for name in _ROW_COLUMNS:
            if getattr(batch, name).shape != (n,):
                raise ValueError(f"column '{name}' has shape {getattr(batch, name).shape}, expected ({n},)")
        for name in _LIST_TYPES:
            if getattr(batch, name).num_rows != n:
                raise ValueError(f"column '{name}' has {getattr(batch, name).num_rows} rows, expected {n}")
        if n and (int(batch.op.min()) < 0 or int(batch.op.max()) >= len(OPS)):
            raise ValueError(f"op codes must lie in [0, {len(OPS)}) (OPS = {OPS})")
        self._append(batch.in_op_order())

    def _append(self, batch: StepBatch) -> None:
        if self._closed:
            raise ValueError(f"trace writer for {self.path} is closed")
        step = batch.step
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(
                f"step {step} written after step {self._last_step}: steps must increase "
                "(write all of a step's rows in one call)"
            )
        n = len(batch)
        with _writing_step():
            self._last_step = step
            if n == 0:
                return
            self._pending.append(batch)
            self._steps_written += 1
            self._rows_written += n
            if len(self._pending) >= self.steps_per_batch:
                self._write_pending()

    def write_step(
        self,
        step: int,
        time_s: float,
        *,
        op: Any,
        rid: Any,
        seq_len: Any,
        append_len: Any,
        draft_len: Any = None,
        accepted_len: Any = None,
        prefix_len: Any = None,
        prompt_len: Any = None,
        block_hashes: Any = None,
        token_ids: Any = None,
        arrival_s: Any = None,
    ) -> None:
        """Append one step from array-likes, one entry per row (see ``StepBatch.from_columns``).

        Raises:
            ValueError: mismatched column lengths, an unknown op, a step that does not
                increase, or a closed writer.
            TraceWriteError: the file cannot be written.
        """
        self._append(
            StepBatch.from_columns(
                step,
                time_s,
                op=op,
                rid=rid,
                seq_len=seq_len,
                append_len=append_len,
                draft_len=draft_len,
                accepted_len=accepted_len,
                prefix_len=prefix_len,
                prompt_len=prompt_len,
                block_hashes=block_hashes,
                token_ids=token_ids,
                arrival_s=arrival_s,
            )
        )

    def flush(self) -> None:
        """Write the buffered steps as a record batch now and flush the file."""
        if self._closed:
            return
        if self._pending:
            self._write_pending()

    def close(self, *, interrupted: str | None = None) -> None:
        """Write the buffered steps, the recording's final status and the end of the
        file, close it, and compact it when asked to (a complete recording only).

        Args:
            interrupted: why the writing stops before its end (``describe_stop``): the
                recording is marked interrupted and the file is left uncompacted.

        Raises:
            TraceWriteError: the file cannot be written.
        """
        if self._closed:
            return
        final = self.recording
        if final is not None:
            final = replace(
                final,
                status="interrupted" if interrupted is not None else "complete",
                detail=interrupted,
                finished_at=timestamp(),
                steps=self._steps_written,
            )
        try:
            with _writing_step():  # the last steps, the status and the end, not a part of them
                if self._pending:
                    self._write_pending()
                if final is not None and self.ipc_format == "stream":
                    self._write_empty({RECORDING_KEY: final.to_json().encode()})
                self._ipc.close()
                self._sink.close()
        except OSError as exc:
            self._abandon()
            raise TraceWriteError(
                f"cannot write trace {self.path}: {os_reason(exc)}", path=self.path
            ) from None
        self._closed = True
        self.recording = final
        if self.compact_steps_per_batch is not None and interrupted is None:
            try:
                compact_trace(
                    self.path,
                    steps_per_batch=self.compact_steps_per_batch,
                    compression=self.compact_compression,
                    recording=final,
                )
            except BaseException as exc:
                # The stream is complete and closed: only its compaction stopped.
                exc.__dict__[_STOPPED_COMPACTING] = True
                raise

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
            return
        # Keep what is complete, marked interrupted (uncompacted: leave fast); never
        # mask the exception.
        try:
            self.close(interrupted=describe_stop(exc) if exc is not None else exc_type.__name__)
        except Exception:  # noqa: BLE001 - the original exception matters more
            self._abandon()

    # -- internals -------------------------------------------------------------------

    def _abandon(self) -> None:
        """Close the file after a failed write, discarding what is buffered. The buffered
        stream is closed first: left to its destructor, its failing flush would print a
        second error line from Arrow's C++ on stderr."""
        self._closed = True
        self._pending.clear()
        for stream in (getattr(self, "_sink", None), self._raw):
            if stream is None:
                continue
            try:
                stream.close()
            except OSError:
                pass

    def _write_empty(self, custom: dict[bytes, bytes]) -> None:
        empty, checksum = _to_record_batch([_EMPTY_STEP], self._schema)
        self._ipc.write_batch(empty, custom_metadata={**_batch_metadata(empty, checksum), **custom})

    def _write_pending(self) -> None:
        pending = self._pending
        self._pending = []
        record_batch, checksum = _to_record_batch(pending, self._schema)
        try:
            self._ipc.write_batch(record_batch, custom_metadata=_batch_metadata(record_batch, checksum))
            self._sink.flush()
        except OSError as exc:
            self._abandon()
            raise TraceWriteError(
                f"cannot write trace {self.path}: {os_reason(exc)}", path=self.path
            ) from None


_EMPTY_STEP = StepBatch.from_columns(0, 0.0, op=[], rid=[], seq_len=[], append_len=[])


def _concat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    if len(parts) == 1:
        return np.asarray(parts[0], dtype)
    return np.concatenate(parts).astype(dtype, copy=False)


def _list_array(ragged: Ragged, arrow_type: pa.DataType) -> pa.Array:
    n = ragged.num_rows
    if not ragged.valid.any():
        return pa.nulls(n, arrow_type)
    offsets = pa.py_buffer(ragged.offsets.astype(np.int32))
    values = arrow_array(ragged.values)  # already of the column's dtype (_LIST_DTYPES)
    if ragged.valid.all():
        bitmap, null_count = None, 0
    else:
        bitmap = pa.py_buffer(np.packbits(ragged.valid, bitorder="little"))
        null_count = n - int(np.count_nonzero(ragged.valid))
    return pa.Array.from_buffers(arrow_type, n, [bitmap, offsets], null_count=null_count, children=[values])


def _to_record_batch(steps: list[StepBatch], schema: pa.Schema) -> tuple[pa.RecordBatch, bytes]:
    """The steps as one record batch, and the checksum of its content."""
    counts = [len(s) for s in steps]
    if len(steps) == 1:
        n = counts[0]
        step_col = np.full(n, steps[0].step, np.int64)
        time_col = np.full(n, steps[0].time_s, np.float64)
    else:
        step_col = np.repeat(np.array([s.step for s in steps], np.int64), counts)
        time_col = np.repeat(np.array([s.time_s for s in steps], np.float64), counts)
    op = _concat([s.op for s in steps], np.int8)
    rid = _concat([s.rid for s in steps], np.int64)
    prompt = _concat([s.prompt_len for s in steps], np.int64)
    prompt_mask = prompt < 0
    arrival = _concat([s.arrivals() for s in steps], np.float64)
    arrays: dict[str, pa.Array] = {
        "step": arrow_array(step_col),
        "time_s": arrow_array(time_col),
        "op": pa.DictionaryArray.from_arrays(arrow_array(op), _OPS_DICTIONARY, safe=False),
        "rid": arrow_array(rid),
        "prompt_len": arrow_array(prompt, prompt_mask),
        "arrival_s": arrow_array(arrival, np.isnan(arrival)),
    }
    content = [step_col, time_col, op, rid]
    for name, dtype in _NUMERIC:
        column = _concat([getattr(s, name) for s in steps], dtype)
        arrays[name] = arrow_array(column)
        content.append(column)
    content.append(prompt)
    for name, arrow_type in _LIST_TYPES.items():
        ragged = Ragged.concat([getattr(s, name) for s in steps])
        ragged = Ragged(ragged.offsets, ragged.values.astype(_LIST_DTYPES[name], copy=False), ragged.valid)
        arrays[name] = _list_array(ragged, arrow_type)
        content.extend(ragged)
    batch = pa.RecordBatch.from_arrays([arrays[c.name] for c in COLUMNS], schema=schema)
    return batch, _checksum(content)


def _batch_metadata(batch: pa.RecordBatch, checksum: bytes) -> dict[bytes, bytes]:
    """A written record batch's custom metadata: its checksums."""
    arrival = numpy_view(batch.column("arrival_s"))  # nulls hold NaN (see _to_record_batch)
    return {CHECKSUM_KEY: checksum, ARRIVAL_CHECKSUM_KEY: _checksum([arrival])}


# --------------------------------------------------------------------------------------
# Reader
# --------------------------------------------------------------------------------------


class _Columns(NamedTuple):
    """One record batch as numpy columns (optional ones filled with defaults)."""

    step: np.ndarray
    time_s: np.ndarray
    op: np.ndarray
    rid: np.ndarray
    seq_len: np.ndarray
    append_len: np.ndarray
    draft_len: np.ndarray
    accepted_len: np.ndarray
    prefix_len: np.ndarray
    prompt_len: np.ndarray
    block_hashes: Ragged
    token_ids: Ragged
    arrival_s: np.ndarray | None  # None: the file has no arrival_s column

    def step_batch(self, start: int, stop: int) -> StepBatch:
        return StepBatch(
            int(self.step[start]),
            float(self.time_s[start]),
            self.op[start:stop],
            self.rid[start:stop],
            self.seq_len[start:stop],
            self.append_len[start:stop],
            self.draft_len[start:stop],
            self.accepted_len[start:stop],
            self.prefix_len[start:stop],
            self.prompt_len[start:stop],
            self.block_hashes.slice(start, stop),
            self.token_ids.slice(start, stop),
            None if self.arrival_s is None else self.arrival_s[start:stop],
        )


def _merge_steps(first: StepBatch, second: StepBatch) -> StepBatch:
    def cat(name: str) -> np.ndarray:
        return np.concatenate([getattr(first, name), getattr(second, name)])

    def cat_arrivals() -> np.ndarray:
        return np.concatenate([first.arrivals(), second.arrivals()])

    return StepBatch(
        first.step,
        first.time_s,
        cat("op"),
        cat("rid"),
        cat("seq_len"),
        cat("append_len"),
        cat("draft_len"),
        cat("accepted_len"),
        cat("prefix_len"),
        cat("prompt_len"),
        Ragged.concat([first.block_hashes, second.block_hashes]),
        Ragged.concat([first.token_ids, second.token_ids]),
        None if first.arrival_s is None and second.arrival_s is None else cat_arrivals(),
    )


class StepChunk(NamedTuple):
    """Whole consecutive steps of a trace, column-wise (``TraceReader.chunks``): step ``i``
    is rows ``[starts[i], stops[i])`` of ``columns``. ``position`` is where to resume
    reading to get its steps again (the record batch holding its first row)."""

    columns: _Columns
    starts: np.ndarray  # int64 [num_steps]
    stops: np.ndarray  # int64 [num_steps]
    position: ResumePoint | None

    @property
    def num_steps(self) -> int:
        return int(self.starts.shape[0])

    @property
    def last_step(self) -> int:
        return int(self.columns.step[self.starts[-1]])

    def step_numbers(self) -> np.ndarray:
        """int64 [num_steps] the step number of each step."""
        return self.columns.step[self.starts]

    def step_batch(self, i: int) -> StepBatch:
        """Step ``i`` as a ``StepBatch``."""
        return self.columns.step_batch(int(self.starts[i]), int(self.stops[i]))

    def window(self, start: int | None, stop: int | None) -> StepChunk | None:
        """The steps within ``[start, stop)`` (None when none is)."""
        if start is None and stop is None:
            return self
        steps = self.step_numbers()
        keep = np.ones(steps.shape[0], np.bool_)
        if start is not None:
            keep &= steps >= start
        if stop is not None:
            keep &= steps < stop
        if not keep.any():
            return None
        if keep.all():
            return self
        return StepChunk(self.columns, self.starts[keep], self.stops[keep], self.position)


# Steps gathered into one chunk (record batches are concatenated until they hold as many).
CHUNK_STEPS = 256


def _concat_columns(parts: list[_Columns]) -> _Columns:
    if len(parts) == 1:
        return parts[0]
    return _Columns(
        *(
            _concat_arrivals(parts)
            if name == "arrival_s"
            else Ragged.concat([getattr(p, name) for p in parts])
            if isinstance(getattr(parts[0], name), Ragged)
            else np.concatenate([getattr(p, name) for p in parts])
            for name in _Columns._fields
        )
    )


def _concat_arrivals(parts: list[_Columns]) -> np.ndarray | None:
    """The parts' arrival times (NaN where a part has none), or None when none has any."""
    if all(p.arrival_s is None for p in parts):
        return None
    return np.concatenate(
        [np.full(p.op.shape[0], np.nan) if p.arrival_s is None else p.arrival_s for p in parts]
    )


def _columns_slice(columns: _Columns, start: int, stop: int) -> _Columns:
    return _Columns(
        *(
            value if value is None else value.slice(start, stop) if isinstance(value, Ragged) else value[start:stop]
            for value in columns
        )
    )


def _chunk_of(
    blocks: list[tuple[_Columns, ResumePoint | None]], keep_last: bool
) -> tuple[StepChunk | None, list[tuple[_Columns, ResumePoint | None]]]:
    """The steps of ``blocks`` (consecutive record batches' rows) as one chunk, and, with
    ``keep_last``, the last step's rows held back as the next blocks (it may continue)."""
    columns = _concat_columns([b for b, _ in blocks])
    n = columns.step.shape[0]
    bounds = np.flatnonzero(columns.step[1:] != columns.step[:-1]) + 1
    starts = np.concatenate(([0], bounds)).astype(np.int64)
    stops = np.concatenate((bounds, [n])).astype(np.int64)
    position = blocks[0][1]
    if not keep_last:
        return StepChunk(columns, starts, stops, position), []
    last = int(starts[-1])
    # the held-back step resumes at the batch holding its first row
    ends = np.cumsum([b.step.shape[0] for b, _ in blocks])
    held_at = blocks[int(np.searchsorted(ends, last, side="right"))][1]
    rest = [(_columns_slice(columns, last, n), held_at)]
    if starts.shape[0] == 1:
        return None, rest
    return StepChunk(columns, starts[:-1], stops[:-1], position), rest


class TraceReader(IpcReader):
    """Open a trace, validate it once, and stream it step by step.

    Opening checks that the file exists and is Arrow IPC (a stream, or a file), that
    its ``kvtrace`` metadata is present and parses, that its ``format_version`` is
    one this kvtrace reads, and that the required columns are present with the
    right types (missing optional columns read as defaults).

    Attributes:
        path: the file.
        meta: its ``TraceMeta``.
        schema: its Arrow schema.
        file_bytes: its size.
        ipc_format: ``"stream"`` (as recorded) or ``"file"`` (compacted).
        num_rows: rows in its complete record batches (counted from the message
            headers when it is opened).
        truncated: after an iteration reached the end: whether the tail was cut (a
            partial record batch, or no end-of-stream marker). Complete batches
            before the cut are read normally; nothing raises.
        truncation_detail: one line saying what was cut and after which step.
        recording: how the trace was recorded (None when its metadata does not say).
            At open, what the metadata says; after an iteration reached the end, the
            final status: a stream's closing status, or, when its writer never
            closed it (killed, or still recording), ``"interrupted"``.

    Raises:
        TraceReadError: missing, a directory, unreadable, empty, or not Arrow IPC.
        TraceCorruptError: the schema message is damaged.
        TraceMetadataError: the metadata is missing or invalid.
        TraceVersionError: a format version this kvtrace does not read.
        TraceSchemaError: a required column is missing or has the wrong type.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path, what="trace")
        self.meta = self._read_meta()
        self.recording: Recording | None = self.meta.recording
        self._closing_status: Recording | None = None
        self._check_columns()
        try:
            with self._open() as file:
                self.num_rows = count_rows(file, self._layout)
        except OSError as exc:
            raise self._fail(TraceReadError, f"cannot read it: {os_reason(exc)}") from None

    @property
    def rid_bound(self) -> int:
        """Request ids lie below this: the trace's row count (ids are dense), at most
        ``traces.schema.MAX_RID``. What sizes every per-request array."""
        return min(self.num_rows, MAX_RID)

    def _read_meta(self) -> TraceMeta:
        raw = (self.schema.metadata or {}).get(METADATA_KEY)
        other = [key.decode(errors="replace") for key in (self.schema.metadata or {}) if key.startswith(b"kvtrace.")]
        if raw is None and other:  # another kvtrace file, e.g. a state log ("kvtrace.statelog")
            raise self._fail(
                TraceMetadataError,
                f"is a kvtrace {other[0].removeprefix('kvtrace.').replace('statelog', 'state log')} file, "
                "not a trace; "
                "kvtrace info shows what it holds",
            )
        if raw is None:
            raise self._fail(
                TraceMetadataError,
                "has no kvtrace metadata (schema metadata key 'kvtrace'); "
                "it was not written by kvtrace",
            )
        try:
            data = parse_meta_json(raw)
        except ValueError as exc:
            raise self._fail(TraceMetadataError, f"its kvtrace {exc}") from None
        version = data.get("format_version") if isinstance(data, dict) else None
        if isinstance(version, int) and not isinstance(version, bool):
            if version > SCHEMA_VERSION:
                raise self._fail(
                    TraceVersionError,
                    f"written in trace format version {version}, but this kvtrace reads "
                    f"format version {SCHEMA_VERSION} at most; upgrade kvtrace to read it",
                )
            if version < 1:
                raise self._fail(
                    TraceVersionError,
                    f"unknown trace format version {version} (this kvtrace reads version "
                    f"1 to {SCHEMA_VERSION})",
                )
        try:
            return TraceMeta.from_dict(data)
        except ValueError as exc:
            raise self._fail(TraceMetadataError, f"invalid kvtrace metadata: {exc}") from None

    def _check_columns(self) -> None:
        names = self.schema.names
        missing = [name for name in REQUIRED_COLUMNS if name not in names]
        if missing:
            raise self._fail(
                TraceSchemaError,
                f"required column{'s' if len(missing) > 1 else ''} "
                f"{', '.join(repr(m) for m in missing)} missing (found: {', '.join(names)})",
            )
        for column in COLUMNS:
            if column.name not in names:
                continue
            found = self.schema.field(column.name).type
            if not _type_matches(column.name, found, column.type):
                raise self._fail(
                    TraceSchemaError,
                    f"column '{column.name}' has type {found}, expected {column.type}",
                )
        self._present = frozenset(c.name for c in COLUMNS if c.name in names)

    def _iteration_ended(self) -> None:
        recording = self._closing_status or self.meta.recording
        if recording is not None and recording.status == "recording":
            recording = replace(
                recording,
                status="interrupted",
                detail="the recorder stopped without closing the trace (killed, or still recording)",
            )
        self.recording = recording

    def _iter_raw(self, resume: ResumePoint | None = None) -> Iterator[tuple[pa.RecordBatch, Any]]:
        self._closing_status = None
        for batch, custom in super()._iter_raw(resume):
            raw = custom.get(RECORDING_KEY) if custom is not None else None
            if raw is not None:
                try:
                    self._closing_status = Recording.from_dict(parse_meta_json(raw))
                except (ValueError, UnicodeDecodeError) as exc:
                    raise self._corrupt_detail(f"its recording status is not valid ({exc})") from None
            yield batch, custom

    def iter_columns(self, resume: ResumePoint | None = None) -> Iterator[_Columns]:
        """Each record batch as numpy columns (optional columns filled with defaults).

        Raises:
            TraceCorruptError: as ``iter_batches``.
            TraceSchemaError: a required column holds nulls, an op name is unknown, or
                the rows of a step hold different times.
        """
        op_lut: tuple[pa.Array, np.ndarray | None] | None = None
        for batch, custom in self._iter_raw(resume):
            columns, op_lut = self._to_columns(batch, op_lut)
            stored = custom.get(CHECKSUM_KEY) if custom is not None else None
            if stored is not None:
                computed = _checksum([*columns[:10], *columns.block_hashes, *columns.token_ids])
                if computed != stored:
                    raise self._corrupt_detail(
                        f"checksum mismatch (stored {stored.decode(errors='replace')}, "
                        f"computed {computed.decode()})"
                    )
            stored = custom.get(ARRIVAL_CHECKSUM_KEY) if custom is not None else None
            if stored is not None and "arrival_s" in self._present:
                computed = _checksum([numpy_view(batch.column("arrival_s"))])
                if computed != stored:
                    raise self._corrupt_detail(
                        f"arrival_s checksum mismatch (stored {stored.decode(errors='replace')}, "
                        f"computed {computed.decode()})"
                    )
            self._check_step_times(columns)
            yield columns

    def _check_step_times(self, columns: _Columns) -> None:
        """A step has one time: every row of a step holds the same ``time_s`` (NaN included).

        A step's time is read from its first row; without this a NaN (or any other
        value) in a later row would never be seen by the checks.

        Raises:
            TraceSchemaError: two rows of one step in this record batch disagree.
        """
        step, time_s = columns.step, columns.time_s
        if time_s.shape[0] < 2:
            return
        before, after = time_s[:-1], time_s[1:]
        # NaN != NaN: a pair of NaNs agrees (a NaN step time is the checker's to report).
        differs = (step[1:] == step[:-1]) & (before != after) & ~(np.isnan(before) & np.isnan(after))
        if not np.count_nonzero(differs):
            return
        i = int(np.flatnonzero(differs)[0]) + 1
        raise self._fail(
            TraceSchemaError,
            f"step {int(step[i])} in record batch {self.num_record_batches} has rows with different time_s "
            f"({float(time_s[i - 1])!r} and {float(time_s[i])!r}); every row of a step holds the step's time",
        )

    def steps(
        self, start: int | None = None, stop: int | None = None, resume: ResumePoint | None = None
    ) -> Iterator[StepBatch]:
        """Yield one ``StepBatch`` per step, in file order (``chunks`` one step at a time).

        Args:
            start: first step to yield (inclusive); None: from the beginning.
            stop: step to stop before (exclusive); None: to the end. Reading stops
                early once a step ``>= stop`` is seen (steps do not decrease).
            resume: start reading at this record batch (``step_position`` of an
                earlier step) instead of the first one.

        A step split across record batches is merged into one ``StepBatch``. While
        a step is being consumed, ``step_position`` says where to resume to read it
        again.

        Raises:
            TraceCorruptError: a complete record batch does not decode.
            TraceSchemaError: a required column holds nulls, or an op name is unknown.
        """
        for chunk in self.chunks(start, stop, resume):
            self.step_position = chunk.position
            for i in range(chunk.num_steps):
                yield chunk.step_batch(i)

    def chunks(
        self, start: int | None = None, stop: int | None = None, resume: ResumePoint | None = None
    ) -> Iterator[StepChunk]:
        """The trace as ``StepChunk``s: runs of whole steps, column-wise, in file order.

        Record batches are gathered until they hold ``CHUNK_STEPS`` steps (a stream
        written one step per batch still gives long chunks); a chunk never ends inside
        a step: the last step read waits for the next batch, which may continue it.
        Arguments as ``steps``.

        Raises:
            TraceCorruptError, TraceSchemaError: as ``steps``.
        """
        blocks: list[tuple[_Columns, ResumePoint | None]] = []  # rows not given out yet
        gathered = 0  # steps in ``blocks`` (counted per batch; a step split in two counts twice)
        batches = self.iter_columns(resume)
        while True:
            try:
                columns = next(batches)
            except StopIteration:
                break
            except TraceError:
                # The steps before the damage are delivered first (the last one read may
                # have continued in the damaged batch: it is not).
                if blocks:
                    chunk, _ = _chunk_of(blocks, keep_last=True)
                    emit = chunk.window(start, stop) if chunk is not None else None
                    if emit is not None:
                        yield emit
                raise
            n = columns.step.shape[0]
            if n == 0:
                continue
            blocks.append((columns, self.batch_position))
            gathered += 1 + int(np.count_nonzero(columns.step[1:] != columns.step[:-1]))
            if gathered < CHUNK_STEPS:
                continue
            chunk, blocks = _chunk_of(blocks, keep_last=True)
            gathered = 1
            emit = chunk.window(start, stop) if chunk is not None else None
            if emit is not None:
                yield emit
            if stop is not None and chunk is not None and chunk.last_step >= stop:
                return
            if stop is not None and int(blocks[0][0].step[0]) >= stop:
                return
        if blocks:
            chunk, _ = _chunk_of(blocks, keep_last=False)
            emit = chunk.window(start, stop) if chunk is not None else None
            if emit is not None:
                yield emit

    def _to_columns(
        self, batch: pa.RecordBatch, op_lut: tuple[pa.Array, np.ndarray | None] | None
    ) -> tuple[_Columns, tuple[pa.Array, np.ndarray | None]]:
        n = batch.num_rows
        present = self._present

        def where() -> str:
            return f"record batch {self.num_record_batches}"

        def required(name: str, dtype: type) -> np.ndarray:
            array = batch.column(name)
            if array.null_count:
                raise self._fail(
                    TraceSchemaError,
                    f"column '{name}' holds {array.null_count} null values in {where()}",
                )
            return numpy_view(array).astype(dtype, copy=False)

        def optional(name: str, dtype: type) -> np.ndarray:
            if name not in present:
                return np.zeros(n, dtype)
            return numpy_filled(batch.column(name), 0).astype(dtype, copy=False)

        op_array = batch.column("op")
        if op_array.null_count:
            raise self._fail(
                TraceSchemaError, f"column 'op' holds {op_array.null_count} null values in {where()}"
            )
        dictionary = op_array.dictionary
        if op_lut is None or not (op_lut[0] is dictionary or op_lut[0].equals(dictionary)):
            names = dictionary.to_pylist()
            if names == list(OPS[: len(names)]):
                op_lut = (dictionary, None)  # the indices are the op codes
            else:
                op_lut = (dictionary, np.array([OP_CODE.get(v, -1) for v in names], np.int8))
        indices = numpy_view(op_array.indices)
        if op_lut[1] is None:
            op = indices.astype(np.int8, copy=False)
        else:
            op = op_lut[1][indices]
            if np.any(op < 0):
                bad = dictionary[int(indices[np.flatnonzero(op < 0)[0]])].as_py()
                raise self._fail(
                    TraceSchemaError,
                    f"unknown op {bad!r} in {where()} (valid ops: {', '.join(OPS)})",
                )

        if "prompt_len" in present:
            prompt = numpy_filled(batch.column("prompt_len"), -1).astype(np.int64, copy=False)
        else:
            prompt = np.full(n, -1, np.int64)

        columns = _Columns(
            step=required("step", np.int64),
            time_s=required("time_s", np.float64),
            op=op,
            rid=required("rid", np.int64),
            seq_len=required("seq_len", np.int64),
            append_len=required("append_len", np.int32),
            draft_len=optional("draft_len", np.int32),
            accepted_len=optional("accepted_len", np.int32),
            prefix_len=optional("prefix_len", np.int64),
            prompt_len=prompt,
            block_hashes=self._ragged(batch, "block_hashes", np.uint64),
            token_ids=self._ragged(batch, "token_ids", np.int64),
            arrival_s=self._arrivals(batch),
        )
        return columns, op_lut

    def _arrivals(self, batch: pa.RecordBatch) -> np.ndarray | None:
        if "arrival_s" not in self._present:
            return None
        array = batch.column("arrival_s")
        if array.null_count == len(array):
            return None
        values = numpy_view(array)
        return np.where(validity(array), values, np.nan) if array.null_count else values

    def _ragged(self, batch: pa.RecordBatch, name: str, dtype: type) -> Ragged:
        n = batch.num_rows
        if name not in self._present:
            return Ragged.empty(n, dtype)
        array = batch.column(name)
        if array.null_count == n:
            return Ragged.empty(n, dtype)
        offsets = numpy_view(array.offsets).astype(np.int64)
        values = numpy_view(array.values)
        base = offsets[0]
        if base:
            offsets = offsets - base
        values = values[base : base + offsets[-1]]
        if array.null_count:
            valid = validity(array)
            lengths = np.diff(offsets)
            if np.any(lengths[~valid]):  # a null row with a slice: drop the slice
                return Ragged.from_rows(
                    [values[offsets[i] : offsets[i + 1]] if valid[i] else None for i in range(n)],
                    dtype,
                )
        else:
            valid = np.ones(n, np.bool_)
        return Ragged(offsets, values.astype(dtype, copy=False), valid)


def _type_matches(name: str, found: pa.DataType, expected: pa.DataType) -> bool:
    if name == "op":
        return (
            pa.types.is_dictionary(found)
            and pa.types.is_integer(found.index_type)
            and (pa.types.is_string(found.value_type) or pa.types.is_large_string(found.value_type))
        )
    if pa.types.is_list(expected):
        return pa.types.is_list(found) and found.value_type == expected.value_type
    return found == expected


__all__ = [
    "ARRIVAL_CHECKSUM_KEY",
    "CHECKSUM_KEY",
    "COMPRESSIONS",
    "RECORDING_KEY",
    "ResumePoint",
    "Compression",
    "IpcFormat",
    "IpcReader",
    "TraceReader",
    "TraceWriter",
    "compact_trace",
    "describe_stop",
    "interrupt_when_safe",
    "stopped_compacting",
]
