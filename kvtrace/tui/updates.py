"""What the screen learns of a batch of replayed steps: ``StepsUpdate``.

The replayer sends one every ``batch_s`` while it plays (``kvtrace.tui.replayer``). It
holds the steps' timeline rows (pool counters, times and events, step by step: the
occupancy chart and the events log need every step) and, for the requests those steps
changed, their per-request columns after the last step, already folded by the replay's
own ``ReplayState``: not every step's request deltas. At full speed a step of the
one-hour sample changes a hundred requests or more, so the deltas of a batch run to
hundreds of thousands of rows, which the replay would encode and the screen decode and
fold again; the batch's changed requests are a few hundred.

Over a pipe an update is one frame: its length (8 bytes, little-endian) and its pickle
(the pipe joins a process to the child it started, running this same code).
"""

from __future__ import annotations

import pickle
import struct
from typing import TYPE_CHECKING, BinaryIO, NamedTuple

import numpy as np

from kvtrace.snapshot import RequestDelta

if TYPE_CHECKING:
    from kvtrace.snapshot import SnapshotBlock
    from kvtrace.state import ReplayState

__all__ = ["StepsUpdate", "read_update", "write_update"]

_LENGTH = struct.Struct("<Q")


class StepsUpdate(NamedTuple):
    """Consecutive replayed steps as the screen folds them.

    ``timeline`` is their ``SnapshotBlock`` without request rows (``row_counts`` all 0);
    ``rids`` the requests they changed and ``rows`` those requests' columns after the
    last step (``ReplayState.rows``). A keyframe among the steps clears every length
    when the timeline is folded; it lists every request holding KV, so those are sent.
    """

    timeline: SnapshotBlock
    rids: np.ndarray  # int64 [n]
    rows: dict[str, np.ndarray]  # column name -> [n]

    @property
    def num_steps(self) -> int:
        return self.timeline.num_steps

    @classmethod
    def of(cls, block: SnapshotBlock, state: ReplayState) -> StepsUpdate:
        """The update of ``block``'s steps, ``state`` being the fold after its last step.

        Args:
            block: the steps (with their request deltas).
            state: the replay's fold, at ``block``'s last step.

        Returns:
            The update: the block's timeline, the changed requests' columns.
        """
        rids = np.unique(block.requests.rids)
        timeline = block._replace(row_counts=np.zeros(block.num_steps, np.int64), requests=RequestDelta.empty())
        return cls(timeline, rids, state.rows(rids))

    def apply(self, state: ReplayState) -> None:
        """Fold the update into ``state`` (the screen's): the same state as folding the
        steps themselves."""
        state.apply_block(self.timeline)  # the timeline; a keyframe clears the lengths first
        state.assign(self.rids, self.rows)


def write_update(out: BinaryIO, update: StepsUpdate) -> None:
    """Write one update to ``out`` as a frame (and flush)."""
    data = pickle.dumps(update, protocol=pickle.HIGHEST_PROTOCOL)
    out.write(_LENGTH.pack(len(data)))
    out.write(data)
    out.flush()


def read_update(source: BinaryIO) -> StepsUpdate | None:
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
    assert isinstance(update, StepsUpdate), type(update)
    return update
