"""``device="cuda"``: the device ``req_to_token`` stays equal to the host copy through
every op kind (the Triton assign kernel fed from pinned buffers), and a CUDA run
makes exactly the allocations a CPU run makes. Skipped without a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from allocator import AllocatorConfig, SpecConfig
from allocator.table_writer import CpuTableWriter, make_table_writer
from allocator.req_to_token import ReqToTokenPool
from tests.allocator.sim import RandomScheduler

_needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def test_cpu_pool_gets_the_host_writer() -> None:
    pool = ReqToTokenPool(4, 16, "cpu")
    assert pool.device_req_to_token is None
    writer = make_table_writer(pool)
    assert type(writer) is CpuTableWriter
    # the batched writer: slices for few requests, one scatter for many
    rows = np.arange(1, 5, dtype=np.int64)
    writer.assign(rows[:2], np.array([0, 3]), np.array([2, 6]), np.array([7, 8, 9, 10, 11], dtype=np.int32))
    assert pool.req_to_token_np[1, :2].tolist() == [7, 8] and pool.req_to_token_np[2, 3:6].tolist() == [9, 10, 11]
    big = np.repeat(rows, 3)
    writer.assign(big, np.arange(12) % 5, np.arange(12) % 5 + 1, np.arange(100, 112, dtype=np.int32))
    for i in range(12):
        assert pool.req_to_token_np[big[i], i % 5] == 100 + i
    writer.write_points(rows, np.array([15, 14, 13, 12]), np.array([1, 2, 3, 4], dtype=np.int32))
    assert [pool.req_to_token_np[r, 16 - r] for r in rows.tolist()] == [1, 2, 3, 4]


@pytest.mark.cuda
@_needs_cuda
@pytest.mark.parametrize(
    ("page_size", "spec", "flush_every"),
    [(1, None, 64), (16, SpecConfig("eagle", 3, 1, 4), 1), (16, SpecConfig("eagle", 3, 1, 4), 64), (64, None, 7)],
)
def test_cuda_run_matches_cpu_run_and_device_table_matches_host(
    page_size: int, spec: SpecConfig | None, flush_every: int
) -> None:
    def config(device: str) -> AllocatorConfig:
        return AllocatorConfig(
            pool_tokens={1: 1536, 16: 3072, 64: 8192}[page_size],
            page_size=page_size,
            max_running=16,
            max_context_len=600,
            spec=spec,
            device=device,
        )

    cpu = RandomScheduler(config("cpu"), seed=7)
    gpu = RandomScheduler(config("cuda"), seed=7)
    assert gpu.alloc.req_to_token_pool.device_req_to_token is not None
    gpu.alloc.writer.flush_every = flush_every
    for step in range(1500):
        cpu.step()
        gpu.step()
        if step % 50 == 0 or step > 1450:
            violations = gpu.alloc.check_integrity()  # includes the device-vs-host check
            assert violations == [], f"step {step}: {violations[:3]}"
            assert cpu.alloc.check_integrity() == []
            assert np.array_equal(
                cpu.alloc.token_to_kv_pool_allocator.get_all_free_pages(),
                gpu.alloc.token_to_kv_pool_allocator.get_all_free_pages(),
            )
    gpu.alloc.sync_device()
    torch.cuda.synchronize()
    live = gpu.alloc.live_rids()
    assert live.tolist() == cpu.alloc.live_rids().tolist()
    for rid in live.tolist():
        assert np.array_equal(gpu.alloc.row_slots(rid), cpu.alloc.row_slots(rid))
        row = gpu.alloc.row_of(rid)
        n = int(gpu.alloc.req_kv.kv_allocated_len[row])
        device_row = gpu.alloc.req_to_token_pool.device_req_to_token[row, :n].cpu().numpy()
        assert np.array_equal(device_row, gpu.alloc.row_slots(rid))
