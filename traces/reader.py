"""Reader of kvtrace traces (Arrow IPC: a stream, or a file).

The reader accepts both the stream and the file layout, validates the schema and
metadata once when it opens a file, then streams record batches (memory flat in
trace length) and yields one ``StepBatch`` per step, or runs of whole steps
(``StepChunk``).

Opening, framing and telling truncation from corruption are ``traces.ipc``'s
(``IpcReader``, which ``TraceReader`` extends with the trace's metadata, columns
and steps).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pyarrow as pa

from traces.arrow_arrays import numpy_filled, numpy_view, validity
from traces.batches import Ragged, StepBatch
from traces.chunks import CHUNK_STEPS, BatchColumns, StepChunk, chunk_of
from traces.encoding import ARRIVAL_CHECKSUM_KEY, CHECKSUM_KEY, RECORDING_KEY, content_checksum
from traces.errors import TraceError, TraceMetadataError, TraceReadError, TraceSchemaError, TraceVersionError
from traces.ipc import IpcReader, ResumePoint, count_rows, os_reason
from traces.metadata import Recording, TraceMeta, parse_meta_json
from traces.schema import COLUMNS, HOLD, MAX_RID, METADATA_KEY, OP_CODE, OPS, REQUIRED_COLUMNS, SCHEMA_VERSION

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

    def iter_columns(self, resume: ResumePoint | None = None) -> Iterator[BatchColumns]:
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
                computed = content_checksum([*columns[:10], *columns.block_hashes, *columns.token_ids])
                if computed != stored:
                    raise self._corrupt_detail(
                        f"checksum mismatch (stored {stored.decode(errors='replace')}, "
                        f"computed {computed.decode()})"
                    )
            stored = custom.get(ARRIVAL_CHECKSUM_KEY) if custom is not None else None
            if stored is not None and "arrival_s" in self._present:
                computed = content_checksum([numpy_view(batch.column("arrival_s"))])
                if computed != stored:
                    raise self._corrupt_detail(
                        f"arrival_s checksum mismatch (stored {stored.decode(errors='replace')}, "
                        f"computed {computed.decode()})"
                    )
            self._check_step_times(columns)
            yield columns

    def _check_step_times(self, columns: BatchColumns) -> None:
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
        blocks: list[tuple[BatchColumns, ResumePoint | None]] = []  # rows not given out yet
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
                    chunk, _ = chunk_of(blocks, keep_last=True)
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
            chunk, blocks = chunk_of(blocks, keep_last=True)
            gathered = 1
            emit = chunk.window(start, stop) if chunk is not None else None
            if emit is not None:
                yield emit
            if stop is not None and chunk is not None and chunk.last_step >= stop:
                return
            if stop is not None and int(blocks[0][0].step[0]) >= stop:
                return
        if blocks:
            chunk, _ = chunk_of(blocks, keep_last=False)
            emit = chunk.window(start, stop) if chunk is not None else None
            if emit is not None:
                yield emit

    def _to_columns(
        self, batch: pa.RecordBatch, op_lut: tuple[pa.Array, np.ndarray | None] | None
    ) -> tuple[BatchColumns, tuple[pa.Array, np.ndarray | None]]:
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

        if n and not self.meta.config.sessions and int(op.max()) >= HOLD:
            bad = OPS[int(op.max())]
            raise self._fail(
                TraceSchemaError,
                f"{bad} op in {where()} but the metadata does not say config.sessions "
                "(session ops need a version 6 trace with sessions)",
            )
        if "prompt_len" in present:
            prompt = numpy_filled(batch.column("prompt_len"), -1).astype(np.int64, copy=False)
        else:
            prompt = np.full(n, -1, np.int64)

        columns = BatchColumns(
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
