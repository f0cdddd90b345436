"""The one framing between kvtrace and the children it starts: the standard library's
``multiprocessing.connection.Connection`` over a pipe's descriptors.

A ``Connection`` frames each message (a length, then the bytes) and writes all of it
(a write that a signal or a full pipe cuts short goes on with the rest). Typed messages
(``kvtrace.proc.contracts``) go as ``send(contract.to_wire())`` and come back through
``decode``; raw payloads (a dashboard update's columns) as ``send_bytes``. A byte stream
that has its own format (a state log's Arrow IPC stream) travels in chunks
(``ChunkWriter`` / ``ChunkReader``). Importing this module imports nothing of kvtrace.
"""

from __future__ import annotations

import io
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["ChunkReader", "ChunkWriter", "chunk_reader", "chunk_writer", "connection", "receive_all"]


def connection(fd: int, *, readable: bool = True, writable: bool = True) -> Connection:
    """A ``Connection`` over descriptor ``fd`` (one end of a pipe this process inherited or
    made), which it owns from now on (closing it closes ``fd``)."""
    return Connection(fd, readable=readable, writable=writable)


def receive_all(conn: Connection) -> list[Any]:
    """Every object ``conn`` still carries, until its writer closed it (then ``conn`` is closed)."""
    out: list[Any] = []
    try:
        while True:
            out.append(conn.recv())
    except (EOFError, OSError):
        pass
    finally:
        conn.close()
    return out


class ChunkWriter(io.RawIOBase):
    """A raw stream whose every write is one ``send_bytes`` (buffer it: ``chunk_writer``).

    Once the reader has gone away, the first write raises ``BrokenPipeError`` and later
    ones are dropped (so that closing the buffered file on the way out does not raise again).
    """

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._broken = False

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes and not self._broken:
            try:
                self._conn.send_bytes(view)
            except BrokenPipeError:
                self._broken = True
                raise
        return view.nbytes

    def close(self) -> None:
        if not self.closed:
            super().close()
            self._conn.close()


class ChunkReader(io.RawIOBase):
    """The raw stream a ``ChunkWriter`` wrote: its chunks, concatenated (EOF once the
    writer closed its end)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._chunk = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if not self._chunk:
            try:
                self._chunk = memoryview(self._conn.recv_bytes())
            except EOFError:
                return 0
        view = memoryview(buffer).cast("B")
        n = min(view.nbytes, self._chunk.nbytes)
        view[:n] = self._chunk[:n]
        self._chunk = self._chunk[n:]
        return n

    def close(self) -> None:
        if not self.closed:
            super().close()
            self._conn.close()


def chunk_writer(conn: Connection, buffer_size: int = 1 << 16) -> io.BufferedWriter:
    """A buffered binary file writing to ``conn`` (closed with it) in chunks of up to
    ``buffer_size`` bytes, each one message."""
    return io.BufferedWriter(ChunkWriter(conn), buffer_size=buffer_size)


def chunk_reader(fd: int) -> io.BufferedReader:
    """A buffered binary file reading what ``chunk_writer`` wrote to the other end of ``fd``
    (owned from now on)."""
    return io.BufferedReader(ChunkReader(connection(fd, writable=False)), buffer_size=1 << 16)

