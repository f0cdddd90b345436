"""The device mirror's packing of table ranges (runs on the CPU)."""

from __future__ import annotations

import numpy as np

from allocator.req_to_token import ReqToTokenPool
from allocator.table_writer import CpuTableWriter, pack_ranges


def _naive(flat: np.ndarray, row_base: np.ndarray, rows, starts, ends) -> dict[tuple[int, int], int]:
    return {(r, p): int(flat[row_base[r] + p]) for r, s, e in zip(rows, starts, ends) for p in range(s, e)}


def _unpack(out: np.ndarray, bs: int) -> dict[tuple[int, int], int]:
    rows, starts, ends, values = out[:bs], out[bs : 2 * bs], out[2 * bs : 3 * bs], out[3 * bs :]
    got: dict[tuple[int, int], int] = {}
    o = 0
    for r, s, e in zip(rows.tolist(), starts.tolist(), ends.tolist()):
        for p in range(s, e):
            got[(r, p)] = int(values[o])
            o += 1
    assert o == values.shape[0]
    return got


def test_pack_ranges_matches_a_per_position_gather() -> None:
    rng = np.random.default_rng(0)
    width, num_rows = 512, 9
    table = rng.integers(0, 1 << 30, (num_rows, width)).astype(np.int32)
    flat = table.reshape(-1)
    row_base = np.arange(num_rows, dtype=np.int64) * width
    for _ in range(50):
        bs = int(rng.integers(1, 40))
        rows = rng.integers(0, num_rows, bs).astype(np.int64)
        starts = rng.integers(0, width, bs).astype(np.int64)
        # a mix of single slots (decode), short spans and long spans (extend)
        lengths = rng.choice([1, 5, 63, 64, 200], bs)
        ends = np.minimum(starts + lengths, width).astype(np.int64)
        counts = ends - starts
        out = np.full(3 * bs + int(counts.sum()), -7, np.int64)
        pack_ranges(flat, row_base, rows, starts, ends, counts, out)
        assert (out != -7).all()
        assert _unpack(out, bs) == _naive(flat, row_base, rows.tolist(), starts.tolist(), ends.tolist())


def test_read_points_reads_what_write_points_wrote() -> None:
    writer = CpuTableWriter(ReqToTokenPool(4, 16))
    rows = np.array([3, 1, 4], dtype=np.int64)
    positions = np.array([0, 15, 7], dtype=np.int64)
    writer.write_points(rows, positions, np.array([11, 22, 33], dtype=np.int32))
    got = writer.read_points(rows, positions)
    assert got.tolist() == [11, 22, 33] and got.dtype == np.int32
    assert writer.read_points(rows, np.array([1, 14, 6], dtype=np.int64)).tolist() == [0, 0, 0]  # neighbours
