"""Writer of kvtrace traces (Arrow IPC: a stream while recorded, a file once compacted).

The writer buffers ``steps_per_batch`` whole steps, writes them as one record
batch and flushes the file, so a recording killed with SIGKILL leaves every
completed batch readable. Closing it records the final status of the recording
(complete, or interrupted and why) and, when asked to compact, rewrites the trace
as an Arrow IPC *file* (``compact_trace``: with a footer: random access,
memory-mapping, lazy scans in polars, pandas and DuckDB). Compaction lives here
because closing a writer compacts: it reads with a ``TraceReader`` and writes with a
``TraceWriter``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import pyarrow as pa

from traces.atomic import replacing
from traces.batches import StepBatch
from traces.encoding import LIST_TYPES, RECORDING_KEY, batch_metadata, to_record_batch
from traces.errors import TraceWriteError
from traces.ipc import IpcFormat, os_reason
from traces.metadata import Recording, TraceMeta, timestamp
from traces.namespaces import NamespaceTable
from traces.reader import TraceReader
from traces.schema import HOLD, OPS, arrow_schema

Compression = Literal["zstd", "lz4"]
COMPRESSIONS: tuple[str, ...] = ("zstd", "lz4")

_ROW_COLUMNS = (
    "op", "rid", "seq_len", "append_len", "draft_len", "accepted_len", "prefix_len", "prompt_len",
)


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


def compact_trace(
    path: str | os.PathLike[str],
    *,
    steps_per_batch: int,
    compression: Compression = "zstd",
    recording: Recording | None = None,
    out: str | os.PathLike[str] | None = None,
    namespaces: NamespaceTable | None = None,
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
        namespaces: the requests' cache namespaces to store in the new file's metadata
            (None: the trace's own).

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
    if namespaces is not None:
        meta = replace(meta, namespaces=namespaces)

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
                different lengths, an op code outside ``OPS``, a session op (``hold``,
                ``close``) without ``config.sessions``, or a closed writer.
            TraceWriteError: the file cannot be written.
        """
        n = len(batch)
        for name in _ROW_COLUMNS:
            if getattr(batch, name).shape != (n,):
                raise ValueError(f"column '{name}' has shape {getattr(batch, name).shape}, expected ({n},)")
        for name in LIST_TYPES:
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
        if n and not self.meta.config.sessions and int(batch.op.max()) >= HOLD:
            raise ValueError(
                f"{OPS[int(batch.op.max())]} op in a trace without sessions (set config.sessions)"
            )
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
            ValueError: mismatched column lengths, an unknown op, a session op without
                ``config.sessions``, a step that does not increase, or a closed writer.
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

    def close(self, *, interrupted: str | None = None, namespaces: NamespaceTable | None = None) -> None:
        """Write the buffered steps, the recording's final status and the end of the
        file, close it, and compact it when asked to (a complete recording only).

        Args:
            interrupted: why the writing stops before its end (``describe_stop``): the
                recording is marked interrupted and the file is left uncompacted.
            namespaces: the requests' cache namespaces learnt while writing (a live
                recorder's): a complete recording is compacted (with ``steps_per_batch``
                steps per batch unless asked otherwise) so that its metadata holds them;
                an interrupted one is left without them.

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
        compact_every = self.compact_steps_per_batch
        if compact_every is None and namespaces is not None:
            compact_every = self.steps_per_batch
        if compact_every is not None and interrupted is None:
            try:
                compact_trace(
                    self.path,
                    steps_per_batch=compact_every,
                    compression=self.compact_compression,
                    recording=final,
                    namespaces=namespaces,
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
        empty, checksum = to_record_batch([_EMPTY_STEP], self._schema)
        self._ipc.write_batch(empty, custom_metadata={**batch_metadata(empty, checksum), **custom})

    def _write_pending(self) -> None:
        pending = self._pending
        self._pending = []
        record_batch, checksum = to_record_batch(pending, self._schema)
        try:
            self._ipc.write_batch(record_batch, custom_metadata=batch_metadata(record_batch, checksum))
            self._sink.flush()
        except OSError as exc:
            self._abandon()
            raise TraceWriteError(
                f"cannot write trace {self.path}: {os_reason(exc)}", path=self.path
            ) from None


_EMPTY_STEP = StepBatch.from_columns(0, 0.0, op=[], rid=[], seq_len=[], append_len=[])
