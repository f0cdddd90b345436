"""numpy views of Arrow arrays and Arrow arrays built from numpy buffers.

``pa.array`` and ``Array.to_numpy`` import pandas when it is installed (a large
share of a command's start-up); these never do.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

_NUMPY_TO_ARROW = {
    np.dtype(np.int8): pa.int8(),
    np.dtype(np.int32): pa.int32(),
    np.dtype(np.int64): pa.int64(),
    np.dtype(np.uint64): pa.uint64(),
    np.dtype(np.float64): pa.float64(),
}


def arrow_array(values: np.ndarray, mask: np.ndarray | None = None) -> pa.Array:
    """A primitive numpy array as an Arrow array, zero-copy; ``mask`` True marks nulls.

    Built from buffers rather than with ``pa.array``, which imports pandas (when it is
    installed) to ask whether its argument is a pandas object.
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


def numpy_view(array: pa.Array) -> np.ndarray:
    """A primitive Arrow array's values as a read-only numpy view (null slots hold
    whatever the buffer holds).

    Not ``Array.to_numpy``: its first call initialises pyarrow's pandas support,
    importing pandas (when it is installed), a start-up cost ``kvtrace info`` need not pay.
    """
    dtype = _ARROW_TO_NUMPY.get(array.type)
    if dtype is None:  # not a type kvtrace writes
        return array.to_numpy(zero_copy_only=False)
    data = array.buffers()[1]
    if data is None or len(array) == 0:
        return np.zeros(0, dtype)
    return np.frombuffer(data, dtype, count=len(array), offset=array.offset * dtype.itemsize)


def validity(array: pa.Array) -> np.ndarray:
    """bool [n]: which slots of ``array`` are not null."""
    bitmap = array.buffers()[0]
    if bitmap is None or array.null_count == 0:
        return np.ones(len(array), np.bool_)
    bits = np.unpackbits(np.frombuffer(bitmap, np.uint8), bitorder="little")
    return bits[array.offset : array.offset + len(array)].astype(np.bool_)


def numpy_filled(array: pa.Array, fill: int) -> np.ndarray:
    """``numpy_view(array)`` with null slots set to ``fill``."""
    values = numpy_view(array)
    if array.null_count:
        values = np.where(validity(array), values, fill)
    return values


def string_array(strings: Sequence[str]) -> pa.Array:
    """A utf8 Arrow array of ``strings`` (built from buffers, see ``_arrow``)."""
    data = [text.encode() for text in strings]
    offsets = np.zeros(len(data) + 1, np.int32)
    np.cumsum([len(d) for d in data], out=offsets[1:])
    return pa.StringArray.from_buffers(len(data), pa.py_buffer(offsets), pa.py_buffer(b"".join(data)))
