"""What the screen learns of a batch of replayed steps: the steps' ``SnapshotBlock``, and
how it travels over a pipe.

The replayer sends one every ``batch_s`` while it plays (``kvtrace.tui.replayer``): the
replay session's own block of those steps (``ReplaySession.take_block``), with the
request rows of the steps that are not the last of their decode run in the block left
out (the run's last step lists the same requests, with their lengths after it); the
screen folds it into its own ``ReplayState`` (``ReplayState.apply_block``), which is the
replay's fold. The one-hour sample's blocks carry some 22 rows a step: 80.7 MB over the
hour, which a pickle copies. The replay process used to fold each batch itself and send
the rows of the requests the batch changed: that fold, once every 30 ms, took 1.6 s of
CPU of a 25 s replay (sending took 2.4 s in all, 1.5 s now; bench/RESULTS.md); its own
fold now waits for 1,024 steps, or until its state is read.

Over a pipe an update is one frame: its length (8 bytes, little-endian) and its pickle
(the pipe joins a process to the child it started, running this same code).
"""

from __future__ import annotations

import pickle
import struct
from typing import BinaryIO

from kvtrace.snapshot import SnapshotBlock

__all__ = ["read_update", "write_update"]

_LENGTH = struct.Struct("<Q")


def write_update(out: BinaryIO, update: SnapshotBlock) -> None:
    """Write one update (a block of steps) to ``out`` as a frame (and flush)."""
    data = pickle.dumps(update, protocol=pickle.HIGHEST_PROTOCOL)
    out.write(_LENGTH.pack(len(data)))
    out.write(data)
    out.flush()


def read_update(source: BinaryIO) -> SnapshotBlock | None:
    """The next update ``write_update`` wrote to ``source`` (None at the end of the stream).

    Raises:
        EOFError: the stream ends inside a frame.
    """
    head = source.read(_LENGTH.size)
    if not head:
        return None
    if len(head) < _LENGTH.size:
        raise EOFError("the update stream ends inside a frame's length")
    (size,) = _LENGTH.unpack(head)
    data = source.read(size)
    if len(data) < size:
        raise EOFError(f"the update stream ends inside a frame ({len(data)} of {size} bytes)")
    update = pickle.loads(data)
    assert isinstance(update, SnapshotBlock), type(update)
    return update
