"""Writers of ``req_to_token`` rows: the one place each op kind writes the table.

Bookkeeping and free lists live on the host; every slot index is computed there.
``CpuTableWriter`` writes the host table with numpy (slices for a few requests,
one flat scatter for large batches). ``CudaTableWriter`` writes the host copy the
same way and mirrors the write to the device table with the Triton
``assign_req_to_token_pool`` kernel, fed from a pinned host buffer by a
non-blocking copy (``allocator.kernels`` is imported lazily, so CPU use never
needs it).

NOTE: no writer writes outside a row: callers clip positions at the row width
first (and report the request), so the writers only see in-bounds ranges.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
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

    def write_points(self, rows: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> None:
        """``table[rows[i], positions[i]] = slots[i]`` (one slot per request: decode)."""
        index = self.row_base[rows]
        index += positions
        self._flat[index] = slots

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
        bs = rows.shape[0]
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
        self.table[row, start : start + slots.shape[0]] = slots


class CudaTableWriter(CpuTableWriter):
    """Host write plus a device mirror through the Triton assign kernel.

    Each call packs ``rows | starts | ends | slots`` into one pinned int64 buffer
    (two buffers used in turn, each guarded by an event so it is never rewritten
    while its copy is in flight), copies it with ``non_blocking=True`` and launches
    the kernel on the device views.
    """

    def __init__(self, pool: ReqToTokenPool) -> None:
        super().__init__(pool)
        from allocator import kernels  # lazy: only the CUDA path needs it

        if pool.device_req_to_token is None:
            raise ValueError("CudaTableWriter: the pool has no device table (device is 'cpu')")
        self._kernels = kernels
        self.device_table = pool.device_req_to_token
        self.device = self.device_table.device
        self._pinned = [torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)]
        self._device_buf = [torch.empty(0, dtype=torch.int64, device=self.device) for _ in range(2)]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def write_points(self, rows: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> None:
        super().write_points(rows, positions, slots)
        self._mirror(rows, positions, positions + 1, slots)

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
        self._mirror(rows, starts, ends, slots)

    def assign_row(self, row: int, start: int, slots: np.ndarray) -> None:
        super().assign_row(row, start, slots)
        self._mirror(
            np.array([row], dtype=np.int64),
            np.array([start], dtype=np.int64),
            np.array([start + slots.shape[0]], dtype=np.int64),
            slots,
        )

    def _mirror(self, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray, slots: np.ndarray) -> None:
        bs = int(rows.shape[0])
        total = int(slots.shape[0])
        if bs == 0:
            return
        need = 3 * bs + total
        turn = self._turn
        self._turn ^= 1
        event = self._events[turn]
        if event is not None:
            event.synchronize()
        if self._pinned[turn].shape[0] < need:
            size = max(need, 2 * self._pinned[turn].shape[0], 4096)
            self._pinned[turn] = torch.empty(size, dtype=torch.int64, pin_memory=True)
            self._device_buf[turn] = torch.empty(size, dtype=torch.int64, device=self.device)
        host = self._pinned[turn].numpy()
        host[:bs] = rows
        host[bs : 2 * bs] = starts
        host[2 * bs : 3 * bs] = ends
        host[3 * bs : need] = slots
        dev = self._device_buf[turn]
        dev[:need].copy_(self._pinned[turn][:need], non_blocking=True)
        self._events[turn] = torch.cuda.Event()
        self._events[turn].record()
        self._kernels.assign_req_to_token_pool(
            self.device_table, dev[:bs], dev[bs : 2 * bs], dev[2 * bs : 3 * bs], dev[3 * bs : need]
        )


def make_table_writer(pool: ReqToTokenPool) -> CpuTableWriter:
    """The writer for the pool's device: ``CpuTableWriter`` or ``CudaTableWriter``."""
    if pool.device_req_to_token is None:
        return CpuTableWriter(pool)
    return CudaTableWriter(pool)
