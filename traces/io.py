"""Streaming writer and reader of kvtrace traces (Arrow IPC: a stream, or a file).

The writer buffers ``steps_per_batch`` whole steps, writes them as one record
batch and flushes the file, so a recording killed with SIGKILL leaves every
completed batch readable. Closing it records the final status of the recording
(complete, or interrupted and why) and, when asked to compact, rewrites the trace
as an Arrow IPC *file* (with a footer: random access, memory-mapping, lazy scans
in polars, pandas and DuckDB). The reader accepts both the stream and the file
layout, validates the schema and metadata once when it opens a file, then
streams record batches (memory flat in trace length) and yields one
``StepBatch`` per step.

Damage is classified by framing the stream itself (``_FramedSource``): a message
whose bytes are all present but do not decode is *corrupt* (an error naming the
file and the batch); a message cut by the end of the file, or a file without the
end-of-stream marker, is *truncated* (every complete batch reads back, and
``TraceReader.truncated`` says so after iteration).
"""

from __future__ import annotations

import io
import json
import os
import struct
import threading
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, Literal, NamedTuple

import numpy as np
import pyarrow as pa

from traces.atomic import replacing
from traces.errors import (
    TraceCorruptError,
    TraceMetadataError,
    TraceReadError,
    TraceSchemaError,
    TraceVersionError,
    TraceWriteError,
)
from traces.schema import (
    COLUMN_BY_NAME,
    COLUMNS,
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
    timestamp,
)

Compression = Literal["zstd", "lz4"]
COMPRESSIONS: tuple[str, ...] = ("zstd", "lz4")
IpcFormat = Literal["stream", "file"]

_NUMPY_TO_ARROW = {
    np.dtype(np.int8): pa.int8(),
    np.dtype(np.int32): pa.int32(),
    np.dtype(np.int64): pa.int64(),
    np.dtype(np.uint64): pa.uint64(),
    np.dtype(np.float64): pa.float64(),
}


def _arrow(values: np.ndarray, mask: np.ndarray | None = None) -> pa.Array:
    """A primitive numpy array as an Arrow array, zero-copy; ``mask`` True marks nulls.

    Built from buffers rather than with ``pa.array``, which imports pandas (when it is
    installed, ~0.3 s) to ask whether its argument is a pandas object.
    """
    values = np.ascontiguousarray(values)
    arrow_type = _NUMPY_TO_ARROW[values.dtype]
    if mask is None or not mask.any():
        return pa.Array.from_buffers(arrow_type, values.shape[0], [None, pa.py_buffer(values)])
    bitmap = pa.py_buffer(np.packbits(~mask, bitorder="little"))
    nulls = int(np.count_nonzero(mask))
    return pa.Array.from_buffers(arrow_type, values.shape[0], [bitmap, pa.py_buffer(values)], null_count=nulls)


_INTEGER_DTYPES = (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)
_ARROW_TO_NUMPY = {
    pa.from_numpy_dtype(np.dtype(dtype)): np.dtype(dtype) for dtype in (*_INTEGER_DTYPES, np.float64)
}


def _numpy(array: pa.Array) -> np.ndarray:
    """A primitive Arrow array's values as a read-only numpy view (null slots hold
    whatever the buffer holds).

    Not ``Array.to_numpy``: its first call initialises pyarrow's pandas support,
    importing pandas (when it is installed, ~0.3 s of ``kvtrace info``).
    """
    dtype = _ARROW_TO_NUMPY.get(array.type)
    if dtype is None:  # not a type kvtrace writes
        return array.to_numpy(zero_copy_only=False)
    data = array.buffers()[1]
    if data is None or len(array) == 0:
        return np.zeros(0, dtype)
    return np.frombuffer(data, dtype, count=len(array), offset=array.offset * dtype.itemsize)


def _validity(array: pa.Array) -> np.ndarray:
    """bool [n]: which slots of ``array`` are not null."""
    bitmap = array.buffers()[0]
    if bitmap is None or array.null_count == 0:
        return np.ones(len(array), np.bool_)
    bits = np.unpackbits(np.frombuffer(bitmap, np.uint8), bitorder="little")
    return bits[array.offset : array.offset + len(array)].astype(np.bool_)


def _numpy_filled(array: pa.Array, fill: int) -> np.ndarray:
    """``_numpy(array)`` with null slots set to ``fill``."""
    values = _numpy(array)
    if array.null_count:
        values = np.where(_validity(array), values, fill)
    return values


def _string_array(strings: Sequence[str]) -> pa.Array:
    """A utf8 Arrow array of ``strings`` (built from buffers, see ``_arrow``)."""
    data = [text.encode() for text in strings]
    offsets = np.zeros(len(data) + 1, np.int32)
    np.cumsum([len(d) for d in data], out=offsets[1:])
    return pa.StringArray.from_buffers(len(data), pa.py_buffer(offsets), pa.py_buffer(b"".join(data)))


_OPS_DICTIONARY = _string_array(OPS)
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
# Custom metadata of a stream's last (empty) record batch: the final ``Recording`` as JSON.
RECORDING_KEY = b"kvtrace.recording"


def _checksum(arrays: Sequence[np.ndarray]) -> bytes:
    """CRC-32 of the arrays' bytes, in order, as 8 hex digits."""
    crc = 0
    for array in arrays:
        crc = zlib.crc32(np.ascontiguousarray(array), crc)
    return b"%08x" % crc


def _os_reason(exc: OSError) -> str:
    """The OS's words for ``exc`` ("No space left on device"), without pyarrow's decoration."""
    if exc.errno:
        return os.strerror(exc.errno)
    return str(exc)


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
) -> None:
    """Rewrite a trace in place as an Arrow IPC file with ``steps_per_batch`` steps per batch.

    The new file is written beside the old one and renamed over it, so a crash at
    any point leaves either the old or the new file, both complete.

    Args:
        path: the trace (a stream or a file).
        steps_per_batch: whole steps per record batch of the new file.
        compression: its codec.
        recording: the recording status to store (the writer passes the final one it
            knows at close); None: the trace's own final status (read first, when the
            trace records one).

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
    try:
        with replacing(src) as tmp:
            with TraceWriter(
                tmp, meta, compression=compression, steps_per_batch=steps_per_batch, ipc_format="file"
            ) as out:
                for batch in reader.steps():
                    out.write(batch)
    except OSError as exc:
        raise TraceWriteError(f"cannot rewrite trace {src}: {_os_reason(exc)}", path=src) from None


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
            self._raw = pa.OSFile(str(self.path), "wb")
        except OSError as exc:
            raise TraceWriteError(
                f"cannot create trace {self.path}: {_os_reason(exc)}", path=self.path
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
                f"cannot write trace {self.path}: {_os_reason(exc)}", path=self.path
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
                f"cannot write trace {self.path}: {_os_reason(exc)}", path=self.path
            ) from None
        self._closed = True
        self.recording = final
        if self.compact_steps_per_batch is not None and interrupted is None:
            compact_trace(
                self.path,
                steps_per_batch=self.compact_steps_per_batch,
                compression=self.compact_compression,
                recording=final,
            )

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
        self._closed = True
        self._pending.clear()
        try:
            self._raw.close()
        except OSError:
            pass

    def _write_empty(self, custom: dict[bytes, bytes]) -> None:
        empty, checksum = _to_record_batch([_EMPTY_STEP], self._schema)
        self._ipc.write_batch(empty, custom_metadata={CHECKSUM_KEY: checksum, **custom})

    def _write_pending(self) -> None:
        pending = self._pending
        self._pending = []
        record_batch, checksum = _to_record_batch(pending, self._schema)
        try:
            self._ipc.write_batch(record_batch, custom_metadata={CHECKSUM_KEY: checksum})
            self._sink.flush()
        except OSError as exc:
            self._abandon()
            raise TraceWriteError(
                f"cannot write trace {self.path}: {_os_reason(exc)}", path=self.path
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
    values = _arrow(ragged.values)  # already of the column's dtype (_LIST_DTYPES)
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
    arrays: dict[str, pa.Array] = {
        "step": _arrow(step_col),
        "time_s": _arrow(time_col),
        "op": pa.DictionaryArray.from_arrays(_arrow(op), _OPS_DICTIONARY, safe=False),
        "rid": _arrow(rid),
        "prompt_len": _arrow(prompt, prompt_mask),
    }
    content = [step_col, time_col, op, rid]
    for name, dtype in _NUMERIC:
        column = _concat([getattr(s, name) for s in steps], dtype)
        arrays[name] = _arrow(column)
        content.append(column)
    content.append(prompt)
    for name, arrow_type in _LIST_TYPES.items():
        ragged = Ragged.concat([getattr(s, name) for s in steps])
        ragged = Ragged(ragged.offsets, ragged.values.astype(_LIST_DTYPES[name], copy=False), ragged.valid)
        arrays[name] = _list_array(ragged, arrow_type)
        content.extend(ragged)
    batch = pa.RecordBatch.from_arrays([arrays[c.name] for c in COLUMNS], schema=schema)
    return batch, _checksum(content)


# --------------------------------------------------------------------------------------
# Stream framing: tells truncation from corruption
# --------------------------------------------------------------------------------------

_CONTINUATION = 0xFFFFFFFF
_MAX_METADATA_BYTES = 64 << 20  # kvtrace message headers are a few hundred bytes
_HEADER_SCHEMA, _HEADER_DICTIONARY, _HEADER_RECORD_BATCH = 1, 2, 3
_ARROW_FILE_MAGIC = b"ARROW1"
_EOS_MARKER = b"\xff\xff\xff\xff\x00\x00\x00\x00"


class ResumePoint(NamedTuple):
    """Where a reader can start again: the record batch holding a step's first row.

    ``offset`` is the byte offset of the batch's message in the file, ``batch_index``
    the number of record batches before it. ``TraceReader.steps(resume=...)`` reads
    from there (the schema and dictionaries are read from the start of the file).
    """

    offset: int
    batch_index: int


class _Message(NamedTuple):
    offset: int
    header_type: int
    body_len: int


class _Layout(NamedTuple):
    """Where the message stream lies in a file, and whether its writer finished it.

    A stream is the whole file. An IPC file is ``ARROW1`` + padding, the same
    stream (end-of-stream marker included), the footer, its int32 length and
    ``ARROW1``; a file cut short (no trailing magic) is read as the stream after
    its leading magic, up to the cut.
    """

    ipc_format: IpcFormat
    start: int  # first byte of the schema message
    end: int  # end of the message stream (the footer's first byte in a complete file)
    closed: bool  # the writer finished it: end-of-stream marker (stream) or footer (file)


_FILE_HEAD = 8  # "ARROW1" + 2 bytes of padding
_FILE_TAIL = 10  # int32 footer length + "ARROW1"


def _layout(file: BinaryIO, file_bytes: int) -> _Layout | str:
    """The layout of ``file``, or a one-line reason why its footer cannot be right."""
    file.seek(0)
    head = file.read(_FILE_HEAD)
    if not head.startswith(_ARROW_FILE_MAGIC):
        closed = False
        if file_bytes >= 16:
            file.seek(file_bytes - 8)
            closed = file.read(8) == _EOS_MARKER
        file.seek(0)
        return _Layout("stream", 0, file_bytes, closed)
    tail = b""
    if file_bytes >= _FILE_HEAD + _FILE_TAIL:
        file.seek(file_bytes - _FILE_TAIL)
        tail = file.read(_FILE_TAIL)
    file.seek(_FILE_HEAD)
    if not tail.endswith(_ARROW_FILE_MAGIC):
        return _Layout("file", _FILE_HEAD, file_bytes, False)  # cut short: no footer
    footer_len = struct.unpack("<i", tail[:4])[0]
    end = file_bytes - _FILE_TAIL - footer_len
    if footer_len <= 0 or end < _FILE_HEAD + 8:
        return f"its footer length {footer_len} does not fit in a file of {file_bytes} bytes"
    return _Layout("file", _FILE_HEAD, end, True)


def _parse_message_header(meta: bytes) -> tuple[int, int]:
    """``(header_type, body_len)`` of an Arrow IPC ``Message`` flatbuffer.

    Raises ``ValueError`` when the flatbuffer is malformed. Only the two scalar
    fields the framing needs are read: ``header_type`` (field 1) and
    ``bodyLength`` (field 3).
    """
    try:
        root = struct.unpack_from("<I", meta, 0)[0]
        vtable = root - struct.unpack_from("<i", meta, root)[0]
        vtable_len = struct.unpack_from("<H", meta, vtable)[0]
        if vtable < 0 or vtable_len < 4 or vtable + vtable_len > len(meta):
            raise ValueError("bad vtable")

        def field_offset(index: int) -> int:
            slot = 4 + 2 * index
            return struct.unpack_from("<H", meta, vtable + slot)[0] if slot < vtable_len else 0

        version_at, type_at, body_at = field_offset(0), field_offset(1), field_offset(3)
        version = struct.unpack_from("<h", meta, root + version_at)[0] if version_at else 0
        header_type = meta[root + type_at] if type_at else 0
        body_len = struct.unpack_from("<q", meta, root + body_at)[0] if body_at else 0
    except (struct.error, IndexError) as exc:
        raise ValueError(f"malformed message header ({exc})") from None
    if not 0 <= version <= 4 or header_type not in (1, 2, 3) or body_len < 0:
        raise ValueError(
            f"malformed message header (version {version}, type {header_type}, body {body_len})"
        )
    return header_type, body_len


class _FramedSource(io.RawIOBase):
    """The trace file as pyarrow sees it: only complete, well-framed messages.

    pyarrow's stream reader pulls bytes through ``read``. Before serving a
    message, this source reads its framing (continuation marker, metadata
    length, metadata flatbuffer, body length) and the whole body. A message cut
    short by the end of the file is never served: pyarrow then sees a clean end
    of stream and ``truncation`` says what was cut. Broken framing sets
    ``corruption`` and also ends the stream; the reader raises it.
    """

    def __init__(self, file: BinaryIO, layout: _Layout, resume: ResumePoint | None = None) -> None:
        super().__init__()
        self._resume = resume
        self._file = file
        self._layout = layout
        self._file_bytes = layout.end  # where the messages end
        # A stream that ends with the end-of-stream marker, or a file with its footer,
        # was closed by its writer: a message that runs past the end is damaged, not
        # cut short.
        self._closed_by_writer = layout.closed
        file.seek(layout.start)
        self._offset = layout.start  # end of the last message loaded
        self._pieces: list[bytes] = []
        self._finished = False
        self.messages: list[_Message] = []
        self.num_record_batches = 0
        # a dictionary message after the first record batch: resuming past it would miss it
        self.late_dictionary = False
        self.eos = False
        self.truncation: str | None = None
        self.corruption: str | None = None

    # io.RawIOBase protocol used by pa.PythonFile
    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self._offset - sum(len(p) for p in self._pieces)

    def read(self, size: int = -1) -> bytes:
        out: list[bytes] = []
        want = size if size >= 0 else 1 << 62
        while want > 0:
            if not self._pieces and not self._load_next():
                break
            head = self._pieces[0]
            if len(head) <= want:
                out.append(self._pieces.pop(0))
                want -= len(head)
            else:
                out.append(head[:want])
                self._pieces[0] = head[want:]
                want = 0
        return out[0] if len(out) == 1 else b"".join(out)

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    @property
    def bytes_read(self) -> int:
        return self._offset

    def _load_next(self) -> bool:
        if self._finished:
            return False
        offset = self._offset
        header = self._file.read(min(8, max(0, self._file_bytes - offset)))
        if len(header) == 0:
            self._finished = True
            # A file with its footer is complete even without the marker (as older
            # Arrow writers left it); a stream without it was not closed.
            finished = self._layout.ipc_format == "file" and self._layout.closed
            if offset > self._layout.start and not finished:
                self.truncation = "no end-of-stream marker (the writer did not close the file)"
            return False
        if len(header) < 8:
            return self._truncated(f"a message header is cut ({len(header)} of 8 bytes present)")
        continuation, meta_len = struct.unpack("<Ii", header)
        if continuation != _CONTINUATION:
            return self._corrupt(offset, "no message starts here")
        if meta_len == 0:  # end-of-stream marker
            self._finished = True
            self.eos = True
            trailing = self._file_bytes - (offset + 8)
            if self._layout.ipc_format == "file" and not self._layout.closed:
                self.truncation = "the file's footer is missing (the file was cut short)"
            elif trailing > 0:
                self.corruption = (
                    f"{trailing} bytes of unexpected data after the end-of-stream marker "
                    f"at byte {offset}"
                )
            self._pieces = [header[:4], header[4:]]
            self._offset = offset + 8
            return True
        if meta_len < 0 or meta_len > _MAX_METADATA_BYTES:
            return self._corrupt(offset, f"impossible message header length {meta_len}")
        meta = self._file.read(meta_len)
        if len(meta) < meta_len:
            return self._truncated(
                f"the last message is cut inside its header ({len(meta)} of {meta_len} bytes present)"
            )
        try:
            header_type, body_len = _parse_message_header(meta)
        except ValueError as exc:
            return self._corrupt(offset, str(exc))
        if header_type == _HEADER_SCHEMA and self.messages:
            return self._corrupt(offset, "a second schema message")
        if header_type != _HEADER_SCHEMA and not self.messages:
            return self._corrupt(offset, "the stream does not start with a schema")
        if header_type == _HEADER_RECORD_BATCH and self._resume is not None:
            # The schema and dictionaries are served; continue at the resume point.
            resume, self._resume = self._resume, None
            self._file.seek(resume.offset)
            self._offset = resume.offset
            self.num_record_batches = resume.batch_index
            return self._load_next()
        if header_type == _HEADER_DICTIONARY and self.num_record_batches:
            self.late_dictionary = True
        if offset + 8 + meta_len + body_len > self._file_bytes:
            present = max(0, self._file_bytes - (offset + 8 + meta_len))
            what = "record batch" if header_type == _HEADER_RECORD_BATCH else "message"
            return self._truncated(
                f"the last {what} is incomplete ({present} of {body_len} body bytes present)"
            )
        body = self._file.read(body_len) if body_len else b""
        if len(body) < body_len:  # the file shrank while being read
            return self._truncated(f"the last message is incomplete ({len(body)} of {body_len} bytes)")
        self.messages.append(_Message(offset, header_type, body_len))
        if header_type == _HEADER_RECORD_BATCH:
            self.num_record_batches += 1
        self._pieces = [header[:4], header[4:], meta] + ([body] if body_len else [])
        self._offset = offset + 8 + meta_len + body_len
        return True

    def _truncated(self, detail: str) -> bool:
        if self._closed_by_writer:
            return self._corrupt(self._offset, f"a message runs past the end of the file: {detail}")
        self._finished = True
        self.truncation = detail
        return False

    def _corrupt(self, offset: int, detail: str) -> bool:
        self._finished = True
        self.corruption = f"{detail} (byte {offset})"
        return False


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
        )


def _merge_steps(first: StepBatch, second: StepBatch) -> StepBatch:
    def cat(name: str) -> np.ndarray:
        return np.concatenate([getattr(first, name), getattr(second, name)])

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
    )


class IpcReader:
    """Open any kvtrace Arrow IPC file (a trace, a state log) and stream its record batches.

    Reads both layouts: the IPC *stream* a recording writes as it goes, and the IPC
    *file* (with a footer) written on completion; an IPC file whose footer is
    missing (cut short) reads as the stream after its leading magic. Damage is
    classified by framing the messages (see ``_FramedSource``): a cut tail is
    *truncation* (every complete batch reads back; ``truncated`` says so after
    iteration), a complete message that does not decode is *corruption* (an error
    naming the file and the batch).

    Args:
        path: the file.
        what: how messages name it ("trace", "state log").

    Attributes:
        path, file_bytes, schema: the file, its size and its Arrow schema.
        ipc_format: ``"stream"`` or ``"file"``.
        truncated: after an iteration reached the end: whether the tail was cut (a
            partial record batch, no end-of-stream marker, or a cut footer). Complete
            batches before the cut are read normally; nothing raises.
        truncation_detail: one line saying what was cut and after which step.

    Raises:
        TraceReadError: missing, a directory, unreadable, empty, or not Arrow IPC.
        TraceCorruptError: the schema message (or the file's footer) is damaged.
    """

    def __init__(self, path: str | os.PathLike[str], *, what: str = "trace") -> None:
        self.path = Path(path)
        self.what = what
        self.truncated = False
        self.truncation_detail: str | None = None
        self.num_record_batches = 0
        self.last_step: int | None = None
        # where the record batch just read starts, and where to resume to read the
        # step just yielded again (``steps``); False when the file cannot be resumed
        self.batch_position: ResumePoint | None = None
        self.step_position: ResumePoint | None = None
        self.resumable = True
        self._bytes_read = 0
        self._source: _FramedSource | None = None
        self.file_bytes = self._stat()
        self.schema = self._read_schema()

    # -- opening ---------------------------------------------------------------------

    def _fail(self, cls: type[Exception], detail: str) -> Exception:
        return cls(f"{self.what} {self.path}: {detail}", path=self.path)

    def _stat(self) -> int:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            raise self._fail(TraceReadError, "no such file") from None
        except OSError as exc:
            raise self._fail(TraceReadError, f"cannot read it: {_os_reason(exc)}") from None
        if self.path.is_dir():
            raise self._fail(TraceReadError, f"is a directory, not a {self.what} file")
        return st.st_size

    def _open(self) -> BinaryIO:
        try:
            return open(self.path, "rb")  # noqa: SIM115 - closed by the caller
        except IsADirectoryError:
            raise self._fail(TraceReadError, f"is a directory, not a {self.what} file") from None
        except OSError as exc:
            raise self._fail(TraceReadError, f"cannot read it: {_os_reason(exc)}") from None

    def _read_schema(self) -> pa.Schema:
        if self.file_bytes == 0:
            raise self._fail(TraceReadError, "is empty, not an Arrow IPC file")
        with self._open() as file:
            layout = _layout(file, self.file_bytes)
            if isinstance(layout, str):
                raise self._fail(TraceCorruptError, f"is a damaged Arrow IPC file: {layout}")
            self._layout = layout
            self.ipc_format = layout.ipc_format
            file.seek(layout.start)
            head = file.read(8)
            source = _FramedSource(file, layout)
            if not source._load_next():
                if source.truncation and len(head) == 8 and head[:4] == b"\xff\xff\xff\xff":
                    raise self._fail(
                        TraceReadError,
                        "ends inside its schema message; the recording was cut before any step",
                    )
                raise self._fail(
                    TraceReadError, f"is not an Arrow IPC stream or file (is it a {self.what}?)"
                )
            if not source.messages or source.messages[0].header_type != _HEADER_SCHEMA:
                raise self._fail(TraceReadError, "is not an Arrow IPC stream or file (no schema message)")
            message = b"".join(source._pieces)
        try:
            schema = pa.ipc.read_schema(pa.py_buffer(message))
            _ = schema.names, [f.type for f in schema], schema.metadata  # decodes every name
            return schema
        except (pa.ArrowException, OSError, ValueError) as exc:  # UnicodeDecodeError included
            raise self._fail(TraceCorruptError, f"its schema message is corrupt ({exc})") from None

    # -- reading ---------------------------------------------------------------------

    @property
    def bytes_read(self) -> int:
        """Bytes of the file consumed by the iteration in progress (for progress bars)."""
        return self._source.bytes_read if self._source is not None else self._bytes_read

    def iter_batches(self) -> Iterator[pa.RecordBatch]:
        """The raw record batches, in order (a truncated tail ends the iteration quietly).

        Raises:
            TraceCorruptError: a complete message does not decode (names the batch and
                the last step read before it).
        """
        for batch, _ in self._iter_raw():
            yield batch

    def iter_batches_with_metadata(self) -> Iterator[tuple[pa.RecordBatch, Any]]:
        """``iter_batches`` with each batch's custom metadata (a ``KeyValueMetadata`` or None)."""
        return self._iter_raw()

    def _iter_raw(self, resume: ResumePoint | None = None) -> Iterator[tuple[pa.RecordBatch, Any]]:
        self.truncated = False
        self.truncation_detail = None
        self.num_record_batches = resume.batch_index if resume is not None else 0
        self.last_step = None
        file = self._open()
        source = _FramedSource(file, self._layout, resume)
        self._source = source
        try:
            try:
                reader = pa.ipc.open_stream(
                    pa.PythonFile(source, mode="r"),
                    options=pa.ipc.IpcReadOptions(use_threads=False),
                )
            except (pa.ArrowException, OSError) as exc:
                raise self._corrupt(source, exc) from None
            has_step = "step" in reader.schema.names
            while True:
                try:
                    batch, custom = reader.read_next_batch_with_custom_metadata()
                    # pyarrow trusts buffer sizes and offsets in the message header;
                    # a damaged header must fail here, not crash the process later.
                    batch.validate(full=True)
                except StopIteration:
                    break
                except (pa.ArrowException, OSError) as exc:
                    raise self._corrupt(source, exc) from None
                self.num_record_batches += 1
                message = source.messages[-1]
                self.batch_position = ResumePoint(message.offset, self.num_record_batches - 1)
                self.resumable = not source.late_dictionary
                yield batch, custom
                if batch.num_rows and has_step:
                    self.last_step = int(batch.column("step")[batch.num_rows - 1].as_py())
            if source.corruption is not None:
                raise self._corrupt(source, None)
            if source.truncation is not None:
                self.truncated = True
                after = (
                    f"after step {self.last_step}" if self.last_step is not None else "before any step"
                )
                self.truncation_detail = f"file truncated {after}: {source.truncation}"
            self._iteration_ended()
        finally:
            self._bytes_read = source.bytes_read
            self._source = None
            file.close()

    def _iteration_ended(self) -> None:
        """Called when an iteration has read every batch (a hook for subclasses)."""

    def _corrupt(self, source: _FramedSource, exc: BaseException | None) -> TraceCorruptError:
        detail = source.corruption if exc is None else f"{type(exc).__name__}: {exc}"
        return self._corrupt_detail(detail, self.num_record_batches + 1)

    def _corrupt_detail(self, detail: str | None, batch_index: int | None = None) -> TraceCorruptError:
        where = f"record batch {batch_index or self.num_record_batches}"
        after = f"after step {self.last_step}" if self.last_step is not None else "before any step"
        detail = " ".join(str(detail).split())
        return TraceCorruptError(
            f"{self.what} {self.path}: corrupt data in {where} ({after}): {detail}; "
            "the file is damaged (steps before it can still be read)",
            path=self.path,
        )


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
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise self._fail(TraceMetadataError, f"its kvtrace metadata is not valid JSON ({exc})") from None
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
                    self._closing_status = Recording.from_dict(json.loads(raw))
                except (ValueError, UnicodeDecodeError) as exc:
                    raise self._corrupt_detail(f"its recording status is not valid ({exc})") from None
            yield batch, custom

    def iter_columns(self, resume: ResumePoint | None = None) -> Iterator[_Columns]:
        """Each record batch as numpy columns (optional columns filled with defaults).

        Raises:
            TraceCorruptError: as ``iter_batches``.
            TraceSchemaError: a required column holds nulls, or an op name is unknown.
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
            yield columns

    def steps(
        self, start: int | None = None, stop: int | None = None, resume: ResumePoint | None = None
    ) -> Iterator[StepBatch]:
        """Yield one ``StepBatch`` per step, in file order.

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
        pending: StepBatch | None = None
        pending_at: ResumePoint | None = None
        for columns in self.iter_columns(resume):
            n = columns.step.shape[0]
            if n == 0:
                continue
            here = self.batch_position
            bounds = np.flatnonzero(columns.step[1:] != columns.step[:-1]) + 1
            starts = np.concatenate(([0], bounds)).tolist()
            stops = np.concatenate((bounds, [n])).tolist()
            for a, b in zip(starts, stops):
                step = int(columns.step[a])
                if pending is not None:
                    if pending.step == step:
                        pending = _merge_steps(pending, columns.step_batch(a, b))
                        continue
                    if start is None or pending.step >= start:
                        self.step_position = pending_at
                        yield pending
                    pending = None
                if stop is not None and step >= stop:
                    return
                pending = columns.step_batch(a, b)
                pending_at = here
        if pending is not None and (start is None or pending.step >= start):
            self.step_position = pending_at
            yield pending

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
            return _numpy(array).astype(dtype, copy=False)

        def optional(name: str, dtype: type) -> np.ndarray:
            if name not in present:
                return np.zeros(n, dtype)
            return _numpy_filled(batch.column(name), 0).astype(dtype, copy=False)

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
        indices = _numpy(op_array.indices)
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
            prompt = _numpy_filled(batch.column("prompt_len"), -1).astype(np.int64, copy=False)
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
        )
        return columns, op_lut

    def _ragged(self, batch: pa.RecordBatch, name: str, dtype: type) -> Ragged:
        n = batch.num_rows
        if name not in self._present:
            return Ragged.empty(n, dtype)
        array = batch.column(name)
        if array.null_count == n:
            return Ragged.empty(n, dtype)
        offsets = _numpy(array.offsets).astype(np.int64)
        values = _numpy(array.values)
        base = offsets[0]
        if base:
            offsets = offsets - base
        values = values[base : base + offsets[-1]]
        if array.null_count:
            valid = _validity(array)
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
]
