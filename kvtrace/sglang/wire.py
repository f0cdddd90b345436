"""The pipe protocol between kvtrace and the SGLang driver (standard library only).

A message is an 8-byte little-endian length and a pickle (protocol 4) of plain
Python values: ``(method, args)`` one way, ``("ok", value)`` or ``("error", text,
traceback)`` the other. Integer arrays travel as ``bytes`` of little-endian int64
(``pack_ints`` / ``numpy.frombuffer``), never as numpy objects, so the two
interpreters may run different numpy versions.
"""

from __future__ import annotations

import pickle
import struct
from typing import IO, Any

__all__ = ["WireClosed", "pack_ints", "recv", "send"]

_HEADER = struct.Struct("<Q")


class WireClosed(EOFError):
    """The other side closed the pipe (it exited)."""


def send(stream: IO[bytes], message: Any) -> None:
    """Write one message and flush."""
    data = pickle.dumps(message, protocol=4)
    stream.write(_HEADER.pack(len(data)))
    stream.write(data)
    stream.flush()


def _read_exact(stream: IO[bytes], n: int) -> bytes:
    chunks = []
    while n:
        chunk = stream.read(n)
        if not chunk:
            raise WireClosed("the pipe closed in the middle of a message" if chunks else "the pipe closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv(stream: IO[bytes]) -> Any:
    """Read one message.

    Raises:
        WireClosed: the pipe closed.
    """
    (size,) = _HEADER.unpack(_read_exact(stream, _HEADER.size))
    return pickle.loads(_read_exact(stream, size))


def pack_ints(values: Any) -> bytes:
    """An integer sequence (a numpy array, a list) as little-endian int64 bytes."""
    import numpy as np

    return np.ascontiguousarray(values, dtype="<i8").tobytes()
