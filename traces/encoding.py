"""How steps are laid out as Arrow record batches, and what a record batch's custom
metadata holds (checksums of its content; a stream's closing recording status).

The writer encodes with ``to_record_batch`` and ``batch_metadata``; the reader verifies
with ``content_checksum`` and the keys below.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from traces.arrow_arrays import arrow_array, numpy_view, string_array
from traces.batches import Ragged, StepBatch
from traces.schema import COLUMN_BY_NAME, COLUMNS, OPS

_OPS_DICTIONARY = string_array(OPS)
LIST_TYPES = {name: COLUMN_BY_NAME[name].type for name in ("block_hashes", "token_ids")}
_LIST_DTYPES = {"block_hashes": np.uint64, "token_ids": np.int64}
_NUMERIC = (
    ("seq_len", np.int64),
    ("append_len", np.int32),
    ("draft_len", np.int32),
    ("accepted_len", np.int32),
    ("prefix_len", np.int64),
)


# Record-batch custom metadata: CRC-32 of the batch's logical content (see ``content_checksum``).
# Arrow IPC has no checksums of its own, and a damaged lz4 or zstd literal run
# decodes silently to wrong values.
CHECKSUM_KEY = b"kvtrace.crc32"
# CRC-32 of the ``arrival_s`` column (float64, nulls as NaN), kept apart so that readers
# from before the column still verify ``CHECKSUM_KEY``.
ARRIVAL_CHECKSUM_KEY = b"kvtrace.crc32.arrival_s"
# Custom metadata of a stream's last (empty) record batch: the final ``Recording`` as JSON.
RECORDING_KEY = b"kvtrace.recording"


def content_checksum(arrays: Sequence[np.ndarray]) -> bytes:
    """CRC-32 of the arrays' bytes, in order, as 8 hex digits."""
    crc = 0
    for array in arrays:
        crc = zlib.crc32(np.ascontiguousarray(array), crc)
    return b"%08x" % crc


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


def to_record_batch(steps: list[StepBatch], schema: pa.Schema) -> tuple[pa.RecordBatch, bytes]:
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
    for name, arrow_type in LIST_TYPES.items():
        ragged = Ragged.concat([getattr(s, name) for s in steps])
        ragged = Ragged(ragged.offsets, ragged.values.astype(_LIST_DTYPES[name], copy=False), ragged.valid)
        arrays[name] = _list_array(ragged, arrow_type)
        content.extend(ragged)
    batch = pa.RecordBatch.from_arrays([arrays[c.name] for c in COLUMNS], schema=schema)
    return batch, content_checksum(content)


def batch_metadata(batch: pa.RecordBatch, checksum: bytes) -> dict[bytes, bytes]:
    """A written record batch's custom metadata: its checksums."""
    arrival = numpy_view(batch.column("arrival_s"))  # nulls hold NaN (see to_record_batch)
    return {CHECKSUM_KEY: checksum, ARRIVAL_CHECKSUM_KEY: content_checksum([arrival])}
