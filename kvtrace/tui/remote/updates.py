"""What the screen learns of a batch of replayed steps: the steps' ``SnapshotBlock``, and
how it travels over a pipe.

The replayer sends one every ``batch_s`` while it plays (``kvtrace.tui.remote.replayer``): the
replay session's own block of those steps (``ReplaySession.take_block``), with the
request rows of the steps that are not the last of their decode run in the block left
out (the run's last step lists the same requests, with their lengths after it); the
screen folds it into its own ``ReplayState`` (``ReplayState.apply_block``), which is the
replay's fold. A frame copies a block's rows once. The replay process does not fold each
batch to send only the rows of the requests it changed: a fold's cost is mostly per call,
so its own fold waits for ``_FOLD_STEPS`` steps, or until its state is read
(``kvtrace.replay.session``; bench/RESULTS.md).

Over a pipe an update is one message of a ``multiprocessing.connection.Connection``
(``kvtrace.proc.channel``: it frames and writes it whole), its body: a 32-byte header
(``KVU1``, the number of pool counters a step, steps, rows, the length of the tail), the
block's columns as raw bytes in the machine's order (8-byte ones first, so that each
starts aligned), then the tail: the events, the state digests and the names of a hybrid model's other
pools (``SnapshotBlock.other_pool_names``), pickled, when there are any (the pipe joins a
process to the child it started, running this same code).
The pool counters of a step are the full pool's, then those of the other pools of a
hybrid model (``SnapshotBlock.other_pools``) in one row: a full-attention frame is the
same size it always was, a hybrid one a few counters a step longer. A block with the
requests' SWA cursors (``SnapshotBlock.swa_evicted``) says ``KVS1`` instead of ``KVU1``
and has that column (int64, a row each) right after the counters; one with the requests'
Mamba state slots (``SnapshotBlock.mamba_slot``) says ``KVM1`` (``KVB1``: both columns)
and has that column (int64, a row each) after them.
Raw columns rather than pickled arrays: pickling costs per array, which this layout
mostly saves, and the screen reads the columns in place.
"""

from __future__ import annotations

import pickle
import struct
from typing import TYPE_CHECKING

import numpy as np

from kvtrace.replay.snapshot import PoolCounters, RequestDelta, SnapshotBlock

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

__all__ = ["decode_update", "encode_update", "read_update", "write_update"]

_HEADER = struct.Struct("<4sIQQQ")  # magic, pool counters a step, steps, rows, tail bytes
_MAGIC = b"KVU1"
_MAGIC_SWA = b"KVS1"  # the same, with the SWA cursor column
_MAGIC_MAMBA = b"KVM1"  # the same, with the Mamba slot column
_MAGIC_BOTH = b"KVB1"  # the same, with both
# magic -> (SWA cursor column, Mamba slot column)
_ROW_EXTRAS = {_MAGIC: (False, False), _MAGIC_SWA: (True, False), _MAGIC_MAMBA: (False, True), _MAGIC_BOTH: (True, True)}
_NUM_POOL = len(PoolCounters._fields)
# (column, dtype, per step or per row): the body's order, widest first.
_STEP, _ROW = "step", "row"
_COLUMNS: tuple[tuple[str, type, str], ...] = (
    ("steps", np.int64, _STEP),
    ("times", np.float64, _STEP),
    ("allocator_s", np.float64, _STEP),
    ("row_counts", np.int64, _STEP),
    ("rids", np.int64, _ROW),
    ("allocated", np.int64, _ROW),
    ("committed", np.int64, _ROW),
    ("protected", np.int64, _ROW),
    ("prefix", np.int64, _ROW),
    ("num_ops", np.int32, _STEP),
    ("keyframes", np.bool_, _STEP),
    ("op", np.int8, _ROW),
    ("phase", np.int8, _ROW),
)
_REQUEST_FIELDS = frozenset(RequestDelta._fields)


def encode_update(update: SnapshotBlock) -> bytes:
    """The body of one update (a block of steps); ``decode_update`` reverses it."""
    k, r = update.num_steps, update.requests.num_requests
    digests = update.digests if any(d is not None for d in update.digests) else None
    names = update.other_pool_names
    tail = pickle.dumps((update.event_steps, update.events, digests, names), protocol=pickle.HIGHEST_PROTOCOL) \
        if update.events or digests is not None or names else b""
    columns = [_column(getattr(update.requests if name in _REQUEST_FIELDS else update, name), dtype)
               for name, dtype, _ in _COLUMNS]
    pools = update.pools
    if update.other_pools is not None:  # a hybrid model: each step's row goes on with its other pools
        pools = np.concatenate([pools, update.other_pools.reshape(k, -1)], axis=1)
    swa = [] if update.swa_evicted is None else [_column(update.swa_evicted, np.int64)]
    mamba = [] if update.mamba_slot is None else [_column(update.mamba_slot, np.int64)]
    magic = next(m for m, has in _ROW_EXTRAS.items() if has == (bool(swa), bool(mamba)))
    return b"".join([_HEADER.pack(magic, pools.shape[1], k, r, len(tail)), _column(pools, np.int64), *swa, *mamba,
                     *columns, tail])


def write_update(out: Connection, update: SnapshotBlock) -> None:
    """Send one update to ``out`` as one message."""
    out.send_bytes(encode_update(update))


def _column(values: np.ndarray, dtype: type) -> memoryview:
    return memoryview(np.ascontiguousarray(values, dtype=dtype).reshape(-1)).cast("B")


def read_update(source: Connection) -> SnapshotBlock | None:
    """The next update ``write_update`` sent to ``source`` (None once its writer closed it).

    Raises:
        OSError: the stream ends inside a message.
        ValueError: a message that is not an update.
    """
    try:
        body = source.recv_bytes()
    except EOFError:
        return None
    return decode_update(bytearray(body))  # writable: the columns are views of it


def decode_update(body: bytearray) -> SnapshotBlock:
    """The update ``encode_update`` made ``body`` of (its columns are views of ``body``).

    Raises:
        ValueError: not an update, or a damaged one.
    """
    size = len(body)
    if size < _HEADER.size:
        raise ValueError(f"an update frame of {size} bytes is shorter than its header")
    magic, num_pool, k, r, tail_len = _HEADER.unpack_from(body)
    if magic not in _ROW_EXTRAS:
        raise ValueError(f"not an update frame (it begins {bytes(body[:8])!r})")
    has_swa, has_mamba = _ROW_EXTRAS[magic]
    expected = _HEADER.size + 8 * k * num_pool + 8 * r * (has_swa + has_mamba) + sum(np.dtype(t).itemsize * (k if per == _STEP else r)
                                                     for _, t, per in _COLUMNS) + tail_len
    if num_pool == 0 or num_pool % _NUM_POOL or expected != size:
        raise ValueError(f"a damaged update frame ({num_pool} pool counters, {k} steps, {r} rows and {tail_len} "
                         f"bytes of events in {size} bytes)")
    at = _HEADER.size
    counters = np.frombuffer(body, np.int64, k * num_pool, at).reshape(k, num_pool)
    at += counters.nbytes
    pools = counters[:, :_NUM_POOL]
    other = counters[:, _NUM_POOL:].reshape(k, -1, _NUM_POOL) if num_pool > _NUM_POOL else None
    swa = None
    if has_swa:
        swa = np.frombuffer(body, np.int64, r, at)
        at += swa.nbytes
    mamba = None
    if has_mamba:
        mamba = np.frombuffer(body, np.int64, r, at)
        at += mamba.nbytes
    cols: dict[str, np.ndarray] = {}
    for name, dtype, per in _COLUMNS:
        n = k if per == _STEP else r
        cols[name] = np.frombuffer(body, dtype, n, at)
        at += cols[name].nbytes
    event_steps, events, digests, names = pickle.loads(body[at:]) if tail_len else ([], [], None, ())
    return SnapshotBlock(
        steps=cols["steps"], times=cols["times"], pools=pools, keyframes=cols["keyframes"], num_ops=cols["num_ops"],
        allocator_s=cols["allocator_s"], row_counts=cols["row_counts"],
        requests=RequestDelta(*(cols[name] for name in RequestDelta._fields)),
        event_steps=event_steps, events=events, digests=digests if digests is not None else [None] * k,
        other_pools=other,
        swa_evicted=swa,
        other_pool_names=names,
        mamba_slot=mamba,
    )
