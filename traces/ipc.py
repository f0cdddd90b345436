"""Arrow IPC as kvtrace reads it: the stream and file layouts, and damage told apart.

A kvtrace file (a trace, a state log) is an Arrow IPC *stream* while it is written
and an IPC *file* (``ARROW1``, the same messages, a footer) once complete.
``IpcReader`` reads both, and a file whose footer is missing as the stream after
its leading magic. Damage is classified by framing the messages itself
(``_FramedSource``): a message whose bytes are all present but do not decode is
*corrupt* (an error naming the file and the batch); a message cut by the end of
the file, a stream without the end-of-stream marker, or a file without its
footer is *truncated* (every complete batch reads back, and ``truncated`` says so
after iteration). A reader can resume at any record batch (``ResumePoint``).
"""

from __future__ import annotations

import io
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, Literal, NamedTuple

import pyarrow as pa

from traces.errors import TraceCorruptError, TraceReadError

IpcFormat = Literal["stream", "file"]

__all__ = [
    "IpcFormat",
    "IpcReader",
    "ResumePoint",
    "os_reason",
]


def os_reason(exc: OSError) -> str:
    """The OS's words for ``exc`` ("No space left on device"), without pyarrow's decoration."""
    if exc.errno:
        return os.strerror(exc.errno)
    return str(exc)


# --------------------------------------------------------------------------------------
# Stream framing: tells truncation from corruption
# --------------------------------------------------------------------------------------

_CONTINUATION = 0xFFFFFFFF
_MAX_METADATA_BYTES = 64 << 20  # kvtrace message headers are a few hundred bytes
_HEADER_SCHEMA, _HEADER_DICTIONARY, _HEADER_RECORD_BATCH = 1, 2, 3
_ARROW_FILE_MAGIC = b"ARROW1"
# A record batch may decompress to at most this: a writer's batch of 256 steps holds a few
# MiB. pyarrow allocates the sizes a compressed buffer declares before it decompresses.
MAX_BATCH_BYTES = 1 << 30
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


def count_rows(file: BinaryIO, layout: _Layout) -> int:
    """Rows in the complete record batches of a file's message stream, from the
    message headers alone (each body is skipped, never read or decompressed).

    Stops quietly at the first message that is cut, damaged or not a record batch
    header it understands: reading the file reports those.
    """
    rows = 0
    offset = layout.start
    while offset + 8 <= layout.end:
        file.seek(offset)
        continuation, meta_len = struct.unpack("<Ii", file.read(8))
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
        if offset > layout.end:
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
            raise self._fail(TraceReadError, f"cannot read it: {os_reason(exc)}") from None
        if self.path.is_dir():
            raise self._fail(TraceReadError, f"is a directory, not a {self.what} file")
        return st.st_size

    def _open(self) -> BinaryIO:
        try:
            return open(self.path, "rb")  # noqa: SIM115 - closed by the caller
        except IsADirectoryError:
            raise self._fail(TraceReadError, f"is a directory, not a {self.what} file") from None
        except OSError as exc:
            raise self._fail(TraceReadError, f"cannot read it: {os_reason(exc)}") from None

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
