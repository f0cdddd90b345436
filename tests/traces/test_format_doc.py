"""traces/README.md's description of the format is enough to read a trace without kvtrace:
its checksum recipe and token derivation, re-implemented here from the text alone
(plain pyarrow, zlib and Python integers), agree with the files and with traces.tokens."""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa

from traces.samples import sample_path
from traces.tokens import block_token_ids, unique_token_ids
from traces.writer import compact_trace

M64 = (1 << 64) - 1


def _crc_per_readme(batch: pa.RecordBatch) -> str:
    def col(name: str, dtype: str, null: int = 0) -> np.ndarray:
        return np.asarray(batch.column(name).fill_null(null).to_numpy(zero_copy_only=False), dtype)

    op = np.asarray(batch.column("op").indices.to_numpy(zero_copy_only=False), np.int8)  # dictionary in OPS order
    pieces = [
        col("step", "<i8"), col("time_s", "<f8"), op, col("rid", "<i8"), col("seq_len", "<i8"),
        col("append_len", "<i4"), col("draft_len", "<i4"), col("accepted_len", "<i4"), col("prefix_len", "<i8"),
        col("prompt_len", "<i8", -1),
    ]  # fmt: skip
    for name, dtype in (("block_hashes", "<u8"), ("token_ids", "<i8")):
        lists = batch.column(name)
        valid = np.asarray(lists.is_valid().to_numpy(zero_copy_only=False), np.bool_)
        rows = lists.to_pylist()
        lengths = [len(r) if r is not None else 0 for r in rows]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype("<i8")
        values = np.asarray([v for r in rows if r is not None for v in r], dtype)
        pieces += [offsets, values, valid]
    crc = 0
    for piece in pieces:
        crc = zlib.crc32(np.ascontiguousarray(piece).tobytes(), crc)
    return f"{crc:08x}"


def test_the_checksum_recipe_matches_every_batch(tmp_path: Path) -> None:
    path = tmp_path / "tiny.kvtrace"
    path.write_bytes(sample_path("tiny").read_bytes())
    compact_trace(path, steps_per_batch=16)  # an IPC file, as a completed recording leaves it
    with pa.memory_map(str(path)) as source:
        file = pa.ipc.open_file(source)
        for i in range(file.num_record_batches):
            batch, custom = file.get_batch_with_custom_metadata(i)
            assert custom[b"kvtrace.crc32"].decode() == _crc_per_readme(batch), i


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _block_token(h: int, offset: int) -> int:
    low = (1 << 62) - 1
    token = ((_splitmix64(h) & low) | (1 << 62)) ^ (_splitmix64(offset + 0x5BD1E9955BD1E995) & low)
    return token if token < 1 << 63 else token - (1 << 64)


def test_the_token_derivation_matches_traces_tokens() -> None:
    hashes = np.array([0, 7, 2**63 + 5, 2**64 - 1], np.uint64)
    block_size = 32
    got = block_token_ids(hashes, block_size, 0, len(hashes) * block_size)
    expected = [_block_token(int(hashes[p // block_size]), p % block_size) for p in range(len(hashes) * block_size)]
    assert got.tolist() == expected and all(1 << 62 <= t < 1 << 63 for t in expected)
    assert unique_token_ids(5, 10, 13).tolist() == [-1 - (5 << 31 | p) for p in (10, 11, 12)]
