"""Streaming writer and reader of kvtrace traces (one Arrow IPC stream per file).

The writer buffers ``steps_per_batch`` whole steps, writes them as one record
batch and flushes the file, so a recording killed with SIGKILL leaves every
completed batch readable. The reader validates the schema and metadata once
when it opens a file, then streams record batches (memory flat in trace
length) and yields one ``StepBatch`` per step.

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
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, Literal, NamedTuple

import numpy as np
import pyarrow as pa

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
    MAX_RID,
    METADATA_KEY,
    OP_CODE,
    OPS,
    REQUIRED_COLUMNS,
    SCHEMA_VERSION,
    Ragged,
    StepBatch,
    TraceMeta,
    arrow_schema,
    parse_meta_json,
)

Compression = Literal["zstd", "lz4"]
COMPRESSIONS: tuple[str, ...] = ("zstd", "lz4")

_OPS_DICTIONARY = pa.array(OPS, pa.utf8())
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


# --------------------------------------------------------------------------------------
# Writer
# --------------------------------------------------------------------------------------


def compact_trace(path: str | os.PathLike[str], *, steps_per_batch: int, compression: Compression = "zstd") -> None:
    """Rewrite a trace in place with ``steps_per_batch`` steps per record batch.

    The new file is written beside the old one and renamed over it, so a crash at
    any point leaves either the old or the new file, both complete.

    Raises:
        TraceWriteError: the new file cannot be written (the old one is kept).
        TraceError: the trace cannot be read.
    """
    src = Path(path)
    tmp = src.with_name(src.name + ".compacting")
    reader = TraceReader(src)
    try:
        with TraceWriter(tmp, reader.meta, compression=compression, steps_per_batch=steps_per_batch, overwrite=True) as out:
            for batch in reader.steps():
                out.write(batch)
        os.replace(tmp, src)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
    ) -> None:
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
            self._ipc = pa.ipc.new_stream(
                self._sink,
                self._schema,
                # Per-buffer thread hand-offs cost more than they save on batches this small.
                options=pa.ipc.IpcWriteOptions(compression=codec, use_threads=False),
            )
            # pyarrow writes the schema lazily; an empty first batch puts the schema and
            # the metadata on disk now, so a writer killed before its first step still
            # leaves a readable (empty, truncated) trace.
            empty, checksum = _to_record_batch([_EMPTY_STEP], self._schema)
            self._ipc.write_batch(empty, custom_metadata={CHECKSUM_KEY: checksum})
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
        self._last_step = step
        n = len(batch)
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

    def close(self) -> None:
        """Write the buffered steps and the end-of-stream marker, and close the file."""
        if self._closed:
            return
        try:
            if self._pending:
                self._write_pending()
            self._ipc.close()
            self._sink.close()
        except OSError as exc:
            self._abandon()
            raise TraceWriteError(
                f"cannot write trace {self.path}: {_os_reason(exc)}", path=self.path
            ) from None
        self._closed = True
        if self.compact_steps_per_batch is not None:
            compact_trace(self.path, steps_per_batch=self.compact_steps_per_batch, compression=self.compact_compression)

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
        # Keep what is complete (uncompacted: leave fast); never mask the exception.
        self.compact_steps_per_batch = None
        try:
            self.close()
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
    values = pa.array(ragged.values, arrow_type.value_type)
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
        "step": pa.array(step_col),
        "time_s": pa.array(time_col),
        "op": pa.DictionaryArray.from_arrays(pa.array(op, pa.int8()), _OPS_DICTIONARY, safe=False),
        "rid": pa.array(rid),
        "prompt_len": pa.array(prompt, pa.int64(), mask=prompt_mask if prompt_mask.any() else None),
    }
    content = [step_col, time_col, op, rid]
    for name, dtype in _NUMERIC:
        column = _concat([getattr(s, name) for s in steps], dtype)
        arrays[name] = pa.array(column)
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
# A record batch may decompress to at most this: a writer's batch of 256 steps holds a few
# MiB. pyarrow allocates the sizes a compressed buffer declares before it decompresses.
MAX_BATCH_BYTES = 1 << 30
_HEADER_SCHEMA, _HEADER_DICTIONARY, _HEADER_RECORD_BATCH = 1, 2, 3
_ARROW_FILE_MAGIC = b"ARROW1"
_EOS_MARKER = b"\xff\xff\xff\xff\x00\x00\x00\x00"


class _Message(NamedTuple):
    offset: int
    header_type: int
    body_len: int


def _table_field(meta: bytes, table: int, index: int) -> int:
    """Absolute position of field ``index`` of the flatbuffer table at ``table`` (0: absent)."""
    vtable = table - struct.unpack_from("<i", meta, table)[0]
    vtable_len = struct.unpack_from("<H", meta, vtable)[0]
    if vtable < 0 or vtable_len < 4 or vtable + vtable_len > len(meta):
        raise ValueError("bad vtable")
    slot = 4 + 2 * index
    offset = struct.unpack_from("<H", meta, vtable + slot)[0] if slot < vtable_len else 0
    return table + offset if offset else 0


def _parse_message_header(meta: bytes) -> tuple[int, int]:
    """``(header_type, body_len)`` of an Arrow IPC ``Message`` flatbuffer.

    Raises ``ValueError`` when the flatbuffer is malformed. Only the two scalar
    fields the framing needs are read: ``header_type`` (field 1) and
    ``bodyLength`` (field 3).
    """
    try:
        root = struct.unpack_from("<I", meta, 0)[0]
        version_at, type_at, body_at = (_table_field(meta, root, i) for i in (0, 1, 3))
        version = struct.unpack_from("<h", meta, version_at)[0] if version_at else 0
        header_type = meta[type_at] if type_at else 0
        body_len = struct.unpack_from("<q", meta, body_at)[0] if body_at else 0
    except (struct.error, IndexError) as exc:
        raise ValueError(f"malformed message header ({exc})") from None
    if not 0 <= version <= 4 or header_type not in (1, 2, 3) or body_len < 0:
        raise ValueError(
            f"malformed message header (version {version}, type {header_type}, body {body_len})"
        )
    return header_type, body_len


def _record_batch_rows(meta: bytes) -> int | None:
    """Rows of a ``RecordBatch`` message: its ``length``, when the first column's node
    agrees (a damaged header that disagrees counts as None; reading it fails later)."""
    try:
        root = struct.unpack_from("<I", meta, 0)[0]
        header_at = _table_field(meta, root, 2)
        if not header_at:
            return None
        batch = header_at + struct.unpack_from("<I", meta, header_at)[0]
        length_at, nodes_at = _table_field(meta, batch, 0), _table_field(meta, batch, 1)
        length = struct.unpack_from("<q", meta, length_at)[0] if length_at else 0
        if not nodes_at:
            return None
        nodes = nodes_at + struct.unpack_from("<I", meta, nodes_at)[0]
        if struct.unpack_from("<I", meta, nodes)[0] == 0:
            return None
        first_column_rows = struct.unpack_from("<q", meta, nodes + 4)[0]
    except (struct.error, IndexError, ValueError):
        return None
    return length if length == first_column_rows and length >= 0 else None


def _decompressed_size(meta: bytes, body: bytes) -> int:
    """Bytes a ``RecordBatch`` message's body decompresses to, as its buffers declare.

    An uncompressed body is its own size. A compressed buffer starts with its
    uncompressed length (int64; -1: stored uncompressed). A header that cannot be
    parsed counts as the body's size (reading it fails later).
    """
    try:
        root = struct.unpack_from("<I", meta, 0)[0]
        header_at = _table_field(meta, root, 2)
        batch = header_at + struct.unpack_from("<I", meta, header_at)[0]
        buffers_at, compression_at = _table_field(meta, batch, 2), _table_field(meta, batch, 3)
        if not compression_at or not buffers_at:
            return len(body)
        vector = buffers_at + struct.unpack_from("<I", meta, buffers_at)[0]
        count = struct.unpack_from("<I", meta, vector)[0]
        total = 0
        for i in range(count):
            offset, length = struct.unpack_from("<qq", meta, vector + 4 + 16 * i)
            if length >= 8 and 0 <= offset <= len(body) - 8:
                declared = struct.unpack_from("<q", body, offset)[0]
                total += length - 8 if declared == -1 else max(0, declared)
        return total
    except (struct.error, IndexError, ValueError):
        return len(body)


def count_rows(path: str | os.PathLike[str], file_bytes: int) -> int:
    """Rows in the complete record batches of a trace stream, from the message headers
    alone (each body is skipped, never read or decompressed).

    Stops quietly at the first message that is cut, damaged or not a record batch
    header it understands: reading the file reports those.
    """
    rows = 0
    with open(path, "rb") as file:
        offset = 0
        while offset + 8 <= file_bytes:
            file.seek(offset)
            header = file.read(8)
            continuation, meta_len = struct.unpack("<Ii", header)
            if continuation != _CONTINUATION or not 0 < meta_len <= _MAX_METADATA_BYTES:
                break
            meta = file.read(meta_len)
            if len(meta) < meta_len:
                break
            try:
                header_type, body_len = _parse_message_header(meta)
            except ValueError:
                break
            offset += 8 + meta_len + body_len
            if offset > file_bytes:
                break
            if header_type == _HEADER_RECORD_BATCH:
                batch_rows = _record_batch_rows(meta)
                if batch_rows is None:
                    break
                rows += batch_rows
    return rows


class _FramedSource(io.RawIOBase):
    """The trace file as pyarrow sees it: only complete, well-framed messages.

    pyarrow's stream reader pulls bytes through ``read``. Before serving a
    message, this source reads its framing (continuation marker, metadata
    length, metadata flatbuffer, body length) and the whole body. A message cut
    short by the end of the file is never served: pyarrow then sees a clean end
    of stream and ``truncation`` says what was cut. Broken framing sets
    ``corruption`` and also ends the stream; the reader raises it.
    """

    def __init__(self, file: BinaryIO, file_bytes: int) -> None:
        super().__init__()
        self._file = file
        self._file_bytes = file_bytes
        # A file that ends with the end-of-stream marker was closed by its writer: a
        # message that runs past its end is damaged, not cut short.
        self._closed_by_writer = False
        if file_bytes >= 16:
            file.seek(file_bytes - 8)
            self._closed_by_writer = file.read(8) == _EOS_MARKER
            file.seek(0)
        self._offset = 0  # end of the last message loaded
        self._pieces: list[bytes] = []
        self._finished = False
        self.messages: list[_Message] = []
        self.num_record_batches = 0
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
        header = self._file.read(8)
        if len(header) == 0:
            self._finished = True
            if offset > 0:
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
            if trailing > 0:
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
        if offset + 8 + meta_len + body_len > self._file_bytes:
            present = max(0, self._file_bytes - (offset + 8 + meta_len))
            what = "record batch" if header_type == _HEADER_RECORD_BATCH else "message"
            return self._truncated(
                f"the last {what} is incomplete ({present} of {body_len} body bytes present)"
            )
        body = self._file.read(body_len) if body_len else b""
        if len(body) < body_len:  # the file shrank while being read
            return self._truncated(f"the last message is incomplete ({len(body)} of {body_len} bytes)")
        if header_type == _HEADER_RECORD_BATCH:
            size = _decompressed_size(meta, body)
            if size > MAX_BATCH_BYTES:
                return self._corrupt(
                    offset, f"a record batch declares {size:,} bytes of decompressed data, more than a "
                    f"trace's batch may hold ({MAX_BATCH_BYTES:,})"
                )
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


class TraceReader:
    """Open a trace, validate it once, and stream it step by step.

    Opening checks that the file exists and is an Arrow IPC stream, that its
    ``kvtrace`` metadata is present and parses, that its ``format_version`` is
    one this kvtrace reads, and that the required columns are present with the
    right types (missing optional columns read as defaults).

    Attributes:
        path: the file.
        meta: its ``TraceMeta``.
        schema: its Arrow schema.
        file_bytes: its size.
        num_rows: rows in its complete record batches (counted from the message
            headers when it is opened).
        truncated: after an iteration reached the end: whether the tail was cut (a
            partial record batch, or no end-of-stream marker). Complete batches
            before the cut are read normally; nothing raises.
        truncation_detail: one line saying what was cut and after which step.

    Raises:
        TraceReadError: missing, a directory, unreadable, empty, or not an Arrow stream.
        TraceCorruptError: the schema message is damaged.
        TraceMetadataError: the metadata is missing or invalid.
        TraceVersionError: a format version this kvtrace does not read.
        TraceSchemaError: a required column is missing or has the wrong type.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.truncated = False
        self.truncation_detail: str | None = None
        self.num_record_batches = 0
        self.last_step: int | None = None
        self._bytes_read = 0
        self._source: _FramedSource | None = None
        self.file_bytes = self._stat()
        self.schema = self._read_schema()
        self.meta = self._read_meta()
        self._check_columns()
        try:
            self.num_rows = count_rows(self.path, self.file_bytes)
        except OSError as exc:
            raise self._fail(TraceReadError, f"cannot read it: {_os_reason(exc)}") from None

    @property
    def rid_bound(self) -> int:
        """Request ids lie below this: the trace's row count (ids are dense), at most
        ``traces.schema.MAX_RID``. What sizes every per-request array."""
        return min(self.num_rows, MAX_RID)

    # -- opening ---------------------------------------------------------------------

    def _fail(self, cls: type[Exception], detail: str) -> Exception:
        return cls(f"trace {self.path}: {detail}", path=self.path)

    def _stat(self) -> int:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            raise self._fail(TraceReadError, "no such file") from None
        except OSError as exc:
            raise self._fail(TraceReadError, f"cannot read it: {_os_reason(exc)}") from None
        if self.path.is_dir():
            raise self._fail(TraceReadError, "is a directory, not a trace file")
        return st.st_size

    def _open(self) -> BinaryIO:
        try:
            return open(self.path, "rb")  # noqa: SIM115 - closed by the caller
        except IsADirectoryError:
            raise self._fail(TraceReadError, "is a directory, not a trace file") from None
        except OSError as exc:
            raise self._fail(TraceReadError, f"cannot read it: {_os_reason(exc)}") from None

    def _read_schema(self) -> pa.Schema:
        if self.file_bytes == 0:
            raise self._fail(TraceReadError, "is empty, not an Arrow IPC stream")
        with self._open() as file:
            head = file.read(8)
            file.seek(0)
            if head.startswith(_ARROW_FILE_MAGIC):
                raise self._fail(
                    TraceReadError,
                    "is an Arrow IPC file, not an Arrow IPC stream (kvtrace traces are streams)",
                )
            source = _FramedSource(file, self.file_bytes)
            if not source._load_next():
                if source.truncation and len(head) == 8 and head[:4] == b"\xff\xff\xff\xff":
                    raise self._fail(
                        TraceReadError,
                        "ends inside its schema message; the recording was cut before any step",
                    )
                raise self._fail(
                    TraceReadError, "is not an Arrow IPC stream (is it a .kvtrace file?)"
                )
            if not source.messages or source.messages[0].header_type != _HEADER_SCHEMA:
                raise self._fail(TraceReadError, "is not an Arrow IPC stream (no schema message)")
            message = b"".join(source._pieces)
        try:
            schema = pa.ipc.read_schema(pa.py_buffer(message))
            _ = schema.names, [f.type for f in schema], schema.metadata  # decodes every name
            return schema
        except (pa.ArrowException, OSError, ValueError) as exc:  # UnicodeDecodeError included
            raise self._fail(TraceCorruptError, f"its schema message is corrupt ({exc})") from None

    def _read_meta(self) -> TraceMeta:
        raw = (self.schema.metadata or {}).get(METADATA_KEY)
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

    def _iter_raw(self) -> Iterator[tuple[pa.RecordBatch, Any]]:
        self.truncated = False
        self.truncation_detail = None
        self.num_record_batches = 0
        self.last_step = None
        file = self._open()
        source = _FramedSource(file, self.file_bytes)
        self._source = source
        try:
            try:
                reader = pa.ipc.open_stream(
                    pa.PythonFile(source, mode="r"),
                    options=pa.ipc.IpcReadOptions(use_threads=False),
                )
            except (pa.ArrowException, OSError) as exc:
                raise self._corrupt(source, exc) from None
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
                yield batch, custom
                if batch.num_rows:
                    self.last_step = int(batch.column("step")[batch.num_rows - 1].as_py())
            if source.corruption is not None:
                raise self._corrupt(source, None)
            if source.truncation is not None:
                self.truncated = True
                after = (
                    f"after step {self.last_step}" if self.last_step is not None else "before any step"
                )
                self.truncation_detail = f"file truncated {after}: {source.truncation}"
        finally:
            self._bytes_read = source.bytes_read
            self._source = None
            file.close()

    def _corrupt(self, source: _FramedSource, exc: BaseException | None) -> TraceCorruptError:
        detail = source.corruption if exc is None else f"{type(exc).__name__}: {exc}"
        return self._corrupt_detail(detail, self.num_record_batches + 1)

    def _corrupt_detail(self, detail: str | None, batch_index: int | None = None) -> TraceCorruptError:
        where = f"record batch {batch_index or self.num_record_batches}"
        after = f"after step {self.last_step}" if self.last_step is not None else "before any step"
        detail = " ".join(str(detail).split())
        return TraceCorruptError(
            f"trace {self.path}: corrupt data in {where} ({after}): {detail}; "
            "the file is damaged (steps before it can still be read)",
            path=self.path,
        )

    def iter_columns(self) -> Iterator[_Columns]:
        """Each record batch as numpy columns (optional columns filled with defaults).

        Raises:
            TraceCorruptError: as ``iter_batches``.
            TraceSchemaError: a required column holds nulls, or an op name is unknown.
        """
        op_lut: tuple[pa.Array, np.ndarray | None] | None = None
        for batch, custom in self._iter_raw():
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

    def steps(self, start: int | None = None, stop: int | None = None) -> Iterator[StepBatch]:
        """Yield one ``StepBatch`` per step, in file order.

        Args:
            start: first step to yield (inclusive); None: from the beginning.
            stop: step to stop before (exclusive); None: to the end. Reading stops
                early once a step ``>= stop`` is seen (steps do not decrease).

        A step split across record batches is merged into one ``StepBatch``.

        Raises:
            TraceCorruptError: a complete record batch does not decode.
            TraceSchemaError: a required column holds nulls, or an op name is unknown.
        """
        pending: StepBatch | None = None
        for columns in self.iter_columns():
            n = columns.step.shape[0]
            if n == 0:
                continue
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
                        yield pending
                    pending = None
                if stop is not None and step >= stop:
                    return
                pending = columns.step_batch(a, b)
        if pending is not None and (start is None or pending.step >= start):
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
            return array.to_numpy().astype(dtype, copy=False)

        def optional(name: str, dtype: type) -> np.ndarray:
            if name not in present:
                return np.zeros(n, dtype)
            array = batch.column(name)
            if array.null_count:
                array = array.fill_null(0)
            return array.to_numpy().astype(dtype, copy=False)

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
        indices = op_array.indices.to_numpy()
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
            prompt_array = batch.column("prompt_len")
            if prompt_array.null_count:
                prompt_array = prompt_array.fill_null(-1)
            prompt = prompt_array.to_numpy().astype(np.int64, copy=False)
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
        offsets = array.offsets.to_numpy().astype(np.int64)
        values = array.values.to_numpy()
        base = offsets[0]
        if base:
            offsets = offsets - base
        values = values[base : base + offsets[-1]]
        if array.null_count:
            valid = ~array.is_null().to_numpy(zero_copy_only=False)
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
    "COMPRESSIONS",
    "Compression",
    "count_rows",
    "TraceReader",
    "TraceWriter",
]
