"""A saved state log read like a replay session: step, seek (forwards or backwards), fold.

``StateLogSession(path)`` offers what the dashboard and other consumers use of a
``ReplaySession`` (``step()``, ``seek(step)``, ``state``, ``last``, ``done``) without
an allocator: the snapshots come from the log (``kvtrace replay --out``). The record
batches stay compressed in a memory map and are decoded one at a time; every
``checkpoint_batches`` batches the per-request fold is saved, so a seek decodes at
most that many batches.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from kvtrace.errors import TraceError
from kvtrace.replay.state import ReplayState
from kvtrace.statelog.log import open_state_log, snapshots_of

__all__ = ["StateLogSession"]


class StateLogSession:
    """Step through a state log.

    Args:
        path: the log file.
        checkpoint_batches: save the per-request fold every this many record batches.

    Raises:
        TraceError: the file is missing, not a kvtrace state log, of an unsupported
            version, or damaged.
    """

    def __init__(self, path: str | Path, checkpoint_batches: int = 8) -> None:
        self.path = Path(path)
        self.info, reader = open_state_log(self.path)
        self._batches = _random_access(self.path, reader)
        first_steps: list[int] = []
        self._index: list[int] = []  # batch indices that hold steps
        self.total_steps = 0
        self.first_step = self.last_step = 0
        try:
            for i in range(len(self._batches)):
                steps = self._batches[i].column("step")
                if len(steps) == 0:
                    continue
                self._index.append(i)
                first_steps.append(int(steps[0].as_py()))
                self.total_steps += len(steps)
                self.last_step = int(steps[-1].as_py())
        except (OSError, pa.ArrowInvalid) as exc:
            raise TraceError(f"{self.path}: damaged after {self.total_steps} steps ({exc})") from None
        if not self._index:
            raise TraceError(f"{self.path}: the state log holds no step")
        self.first_step = first_steps[0]
        self._first_steps = first_steps
        config = self.info.get("config") or {}
        self.config: dict[str, Any] = config
        self.state = ReplayState(int(config.get("page_size", 1)))
        self._every = checkpoint_batches
        self._saved: dict[int, tuple[Any, Any]] = {}  # batch index -> (state.save(), last snapshot)
        self.last = None
        self.done = False
        self._open_at(0)

    # ------------------------------------------------------------------ reading
    def _open_at(self, index: int) -> None:
        self._pending: Iterator[Any] = iter(())
        self._loaded = index - 1
        self._peeked: Any = None

    def _next_snapshot(self) -> Any:
        while True:
            snap = next(self._pending, None)
            if snap is not None:
                return snap
            nxt = self._loaded + 1
            if nxt >= len(self._index):
                return None
            if nxt % self._every == 0 and nxt not in self._saved:
                self._saved[nxt] = (self.state.save(), self.last)
            self._pending = iter(snapshots_of(self._batches[self._index[nxt]]))
            self._loaded = nxt

    def _peek(self) -> Any:
        if self._peeked is None:
            self._peeked = self._next_snapshot()
        return self._peeked

    def step(self) -> Any:
        """The next snapshot (folded into ``state``), or None at the end of the log."""
        if self.done:
            return None
        snap = self._peek()
        if snap is None:
            self.done = True
            return None
        self._peeked = None
        self.last = snap
        self.state.apply(snap)
        return snap

    def snapshots(self) -> Iterator[Any]:
        """Every remaining snapshot, in order."""
        while (snap := self.step()) is not None:
            yield snap

    def seek(self, step: int) -> Any:
        """Go to the state after ``step`` (the last logged step at or before it; the first
        one if ``step`` is before it) and return that snapshot."""
        current = self.last.step if self.last is not None else None
        going_back = current is not None and step < current
        index = max(0, bisect.bisect_right(self._first_steps, step) - 1)
        base = max((i for i in self._saved if i <= index), default=None)
        if going_back or (base is not None and base > self._loaded):
            if base is None:
                self._restart()
            else:
                saved, last = self._saved[base]
                self.state.restore(saved, last.pool if last is not None else None)
                self.last = last
                self.done = False
                self._open_at(base)
        while not self.done:
            snap = self._peek()
            if snap is None:
                self.done = True
                break
            if self.last is not None and snap.step > step:
                break
            self.step()
        return self.last

    def _restart(self) -> None:
        timeline = self.state.timeline
        self.state = ReplayState(self.state.page_size)
        self.state.timeline = timeline  # append-only: survives a restart
        self.last = None
        self.done = False
        self._open_at(0)

    @property
    def progress(self) -> float:
        """Share of the log read so far (0..1)."""
        return (self._loaded + 1) / len(self._index)

    def close(self) -> None:
        """Release the file (the memory map closes with the last reference)."""
        self._batches = []

    def nbytes(self) -> int:
        return self.state.nbytes() + sum(s.columns[k].nbytes for s, _ in self._saved.values() for k in s.columns)

    def __enter__(self) -> StateLogSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Batches(list):  # type: ignore[type-arg]
    """Record batches held in memory (a log that is not a complete IPC file)."""


class _FileBatches:
    """Record batches of an IPC file, decoded on access from a memory map."""

    def __init__(self, reader: pa.ipc.RecordBatchFileReader) -> None:
        self._reader = reader

    def __len__(self) -> int:
        return int(self._reader.num_record_batches)

    def __getitem__(self, index: int) -> pa.RecordBatch:
        return self._reader.get_batch(index)


def _random_access(path: Path, reader: Any) -> _FileBatches | _Batches:
    """Random access to a log's record batches: the file's footer, else every batch read once."""
    try:
        return _FileBatches(pa.ipc.open_file(pa.memory_map(str(path))))
    except (OSError, pa.ArrowInvalid):
        return _Batches(reader.iter_batches())
