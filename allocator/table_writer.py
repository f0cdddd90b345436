"""Writers of ``req_to_token`` rows: the one place each op kind writes the table.

Bookkeeping and free lists live on the host; every slot index is computed there.
``CpuTableWriter`` writes the host table with numpy (slices for a few requests,
one flat scatter for large batches). ``CudaTableWriter`` writes the host copy the
same way and mirrors the writes of one batched allocator call to the device table
with one launch of the Triton ``assign_req_to_token_pool`` kernel, fed from a
pinned host buffer by a non-blocking copy (``allocator.kernels`` is imported
lazily, so CPU use never needs it). Callers call ``end_call()`` at the end of each
batched call (the device copy may lag the host by a few calls: the mirror is
batched) and ``sync()`` before anything reads the device table.

NOTE: no writer writes outside a row: callers clip positions at the row width
first (and report the request), so the writers only see in-bounds ranges.

With a ``journal`` attached (an incremental checker, ``allocator.check.journal``) every
range written is recorded there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from allocator.check.journal import Journal
    from allocator.req_to_token import ReqToTokenPool

__all__ = ["CpuTableWriter", "CudaTableWriter", "make_table_writer"]

# Batches up to this size are written with one slice assignment per request.
_SLICE_BATCH = 4


class CpuTableWriter:
    """Writes the host table (int32) from host int64 indices."""

    def __init__(self, pool: ReqToTokenPool) -> None:
        self.table = pool.req_to_token_np
        self.width = pool.max_context_len
        self._flat = self.table.reshape(-1)
        # int64 [rows]: flat index of each row's position 0
        self.row_base = np.arange(self.table.shape[0], dtype=np.int64) * self.width
        # int64 [rows]: lowest position written per row since the state digest last
        # looked (int64 max: none); None until a digest is asked for (allocator.check.digest)
        self.dirty_lo: np.ndarray | None = None
        self.journal: Journal | None = None

    def read_points(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """``table[rows[i], positions[i]]`` (e.g. the slot before each row's next one).

        Args:
            rows: int64 ``[bs]`` rows.
            positions: int64 ``[bs]`` one in-bounds position per row.

        Returns:
            int32 ``[bs]`` slots (a copy).
        """
        return self._flat[self.row_base[rows] + positions]

    def write_points(self, rows: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> None:
        """``table[rows[i], positions[i]] = slots[i]`` (one slot per request: decode)."""
        if self.journal is not None:
            self.journal.points(rows, positions)
        index = self.row_base[rows]
        index += positions
        self._flat[index] = slots
        if self.dirty_lo is not None:
            np.minimum.at(self.dirty_lo, rows, positions)

    def assign(
        self,
        rows: np.ndarray,
        starts: np.ndarray,
        ends: np.ndarray,
        slots: np.ndarray,
        counts: np.ndarray | None = None,
        ends_cumsum: np.ndarray | None = None,
    ) -> None:
        """``table[rows[i], starts[i]:ends[i]] = slots[o_i : o_i + ends[i] - starts[i]]``,
        ``o_i`` the total length of the earlier ranges (SGLang ``assign_req_to_token_pool``).

        ``counts`` (``ends - starts``) and ``ends_cumsum`` (its inclusive cumulative
        sum) may be passed when the caller has them already."""
        if self.journal is not None:
            self.journal.write(rows, starts, ends)
        bs = rows.shape[0]
        if self.dirty_lo is not None:
            np.minimum.at(self.dirty_lo, rows, np.where(ends > starts, starts, np.iinfo(np.int64).max))
        if bs <= _SLICE_BATCH:
            table = self.table
            offset = 0
            for row, start, end in zip(rows.tolist(), starts.tolist(), ends.tolist()):
                n = end - start
                if n:
                    table[row, start:end] = slots[offset : offset + n]
                    offset += n
            return
        total = int(slots.shape[0])
        if total == 0:
            return
        if counts is None:
            counts = ends - starts
        if ends_cumsum is None:
            ends_cumsum = np.add.accumulate(counts)
        # slot o of request i goes to flat row_base[i] + ends[i] - (cumsum_i - o)
        base = self.row_base[rows]
        base += ends
        base -= ends_cumsum
        index = base.repeat(counts)
        index += np.arange(total, dtype=np.int64)
        self._flat[index] = slots

    def assign_row(self, row: int, start: int, slots: np.ndarray) -> None:
        """``table[row, start:start + len(slots)] = slots`` (one request)."""
        if self.journal is not None:
            self.journal.write(np.array([row]), np.array([start]), np.array([start + slots.shape[0]]))
        self.table[row, start : start + slots.shape[0]] = slots
        if self.dirty_lo is not None and slots.shape[0]:
            self.dirty_lo[row] = min(int(self.dirty_lo[row]), start)

    def end_call(self) -> None:
        """End of one batched allocator call (nothing to do on the host)."""

    def sync(self) -> None:
        """Make every write visible on the device (nothing to do on the host)."""


class CudaTableWriter(CpuTableWriter):
    """Host write plus a batched device mirror through the Triton assign kernel.

    Every write lands in the host table at once and records its row ranges. At the
    end of every ``flush_every``-th batched call (``end_call``), and on ``sync()``,
    all recorded ranges are mirrored to the device table with ONE kernel launch
    (each launch costs far more than the host work of a call): it gathers the
    ranges' *current* host values (so a range written twice in one call carries its
    final values, with no write-order race on the device), packs
    ``rows | starts | ends | slots`` into a pinned int64 buffer (two used in turn,
    each guarded by an event so it is never rewritten while its copy is in flight)
    and copies it with ``non_blocking=True``.
    """

    def __init__(self, pool: ReqToTokenPool, flush_every: int = 256) -> None:
        super().__init__(pool)
        from allocator import kernels  # lazy: only the CUDA path needs it

        if pool.device_req_to_token is None:
            raise ValueError("CudaTableWriter: the pool has no device table (device is 'cpu')")
        self._kernels = kernels
        self.device_table = pool.device_req_to_token
        self.device = self.device_table.device
        self._dirty: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.flush_every = max(1, flush_every)
        self._calls = 0
        self._pinned = [torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)]
        self._device_buf = [torch.empty(0, dtype=torch.int64, device=self.device) for _ in range(2)]
        self._events = [torch.cuda.Event(), torch.cuda.Event()]
        self._used = [False, False]
        self._turn = 0

    def write_points(self, rows: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> None:
        super().write_points(rows, positions, slots)
        self._dirty.append((np.array(rows, dtype=np.int64), np.array(positions, dtype=np.int64), positions + 1))

    def assign(
        self,
        rows: np.ndarray,
        starts: np.ndarray,
        ends: np.ndarray,
        slots: np.ndarray,
        counts: np.ndarray | None = None,
        ends_cumsum: np.ndarray | None = None,
    ) -> None:
        CpuTableWriter.assign(self, rows, starts, ends, slots, counts, ends_cumsum)
        self._dirty.append(
            (np.array(rows, dtype=np.int64), np.array(starts, dtype=np.int64), np.array(ends, dtype=np.int64))
        )

    def assign_row(self, row: int, start: int, slots: np.ndarray) -> None:
        super().assign_row(row, start, slots)
        self._dirty.append(
            (np.array([row], dtype=np.int64), np.array([start], dtype=np.int64),
             np.array([start + slots.shape[0]], dtype=np.int64))
        )

    def end_call(self) -> None:
        self._calls += 1
        if self._calls >= self.flush_every:
            self.sync()

    def sync(self) -> None:
        """Mirror every range written since the last sync to the device (one launch)."""
        self._calls = 0
        if not self._dirty:
            return
        dirty, self._dirty = self._dirty, []
        rows = np.concatenate([d[0] for d in dirty])
        starts = np.concatenate([d[1] for d in dirty])
        ends = np.concatenate([d[2] for d in dirty])
        counts = ends - starts
        keep = counts > 0
        if not keep.all():
            rows, starts, ends, counts = rows[keep], starts[keep], ends[keep], counts[keep]
        bs = int(rows.shape[0])
        if bs == 0:
            return
        total = int(counts.sum())
        need = 3 * bs + total
        turn = self._turn
        self._turn ^= 1
        if self._used[turn]:
            self._events[turn].synchronize()
        if self._pinned[turn].shape[0] < need:
            size = max(need, 2 * self._pinned[turn].shape[0], 4096)
            self._pinned[turn] = torch.empty(size, dtype=torch.int64, pin_memory=True)
            self._device_buf[turn] = torch.empty(size, dtype=torch.int64, device=self.device)
        host = self._pinned[turn].numpy()
        pack_ranges(self._flat, self.row_base, rows, starts, ends, counts, host[:need])
        dev = self._device_buf[turn]
        dev[:need].copy_(self._pinned[turn][:need], non_blocking=True)
        self._events[turn].record()
        self._used[turn] = True
        self._kernels.assign_req_to_token_pool(
            self.device_table, dev[:bs], dev[bs : 2 * bs], dev[2 * bs : 3 * bs], dev[3 * bs : need]
        )


# Ranges at least this long are copied as slices (memcpy speed); shorter ones
# (decode's single slots, small spec reserves) by one fancy-index gather.
_SLICE_RANGE = 64


def pack_ranges(
    flat: np.ndarray,
    row_base: np.ndarray,
    rows: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    counts: np.ndarray,
    out: np.ndarray,
) -> None:
    """Pack ``rows | starts | ends | values`` of table ranges into ``out`` (int64), the
    layout the assign kernel reads: ``values`` holds each range's current entries of
    the flat host table, range after range in the order the ranges are packed.

    Long ranges are packed first (copied as slices, never through an index array);
    the order of ranges is free because every range carries the table's final
    values, so two ranges covering one position write the same value.
    """
    long_mask = counts >= _SLICE_RANGE
    if long_mask.any() and not long_mask.all():
        order = np.concatenate([np.flatnonzero(long_mask), np.flatnonzero(~long_mask)])
        rows, starts, ends, counts = rows[order], starts[order], ends[order], counts[order]
    bs = rows.shape[0]
    out[:bs] = rows
    out[bs : 2 * bs] = starts
    out[2 * bs : 3 * bs] = ends
    values = out[3 * bs :]
    first = row_base[rows] + starts
    num_long = int(np.count_nonzero(counts >= _SLICE_RANGE))
    offset = 0
    for b, c in zip(first[:num_long].tolist(), counts[:num_long].tolist()):
        values[offset : offset + c] = flat[b : b + c]
        offset += c
    if num_long < bs:
        c = counts[num_long:]
        cumsum = np.add.accumulate(c)
        index = (first[num_long:] + c - cumsum).repeat(c) + np.arange(int(cumsum[-1]), dtype=np.int64)
        values[offset:] = flat[index]


def make_table_writer(pool: ReqToTokenPool, flush_every: int = 256) -> CpuTableWriter:
    """The writer for the pool's device: ``CpuTableWriter`` or ``CudaTableWriter``
    (mirroring to the device at the end of every ``flush_every``-th batched call)."""
    if pool.device_req_to_token is None:
        return CpuTableWriter(pool)
    return CudaTableWriter(pool, flush_every)
