"""Long deterministic random runs: 10,000 scheduler steps per configuration, the whole
state checked (``check_integrity``) after every step, and the pool whole at the end."""

from __future__ import annotations

import numpy as np
import pytest

from allocator import AllocatorConfig, SpecConfig
from tests.allocator.sim import RandomScheduler

STEPS = 10_000


@pytest.mark.parametrize(
    ("page_size", "spec", "need_sort"),
    [
        pytest.param(1, None, False, id="page1"),
        pytest.param(16, SpecConfig("eagle", 3, 1, 4), True, id="page16-eagle-need_sort"),
        pytest.param(64, SpecConfig("standalone", 3, 1, 4), False, id="page64-standalone"),
    ],
)
@pytest.mark.slow
def test_ten_thousand_steps_stay_sound(page_size: int, spec: SpecConfig | None, need_sort: bool) -> None:
    config = AllocatorConfig(
        pool_tokens={1: 1536, 16: 3072, 64: 8192}[page_size],
        page_size=page_size,
        max_running=16,
        max_context_len=600,
        spec=spec,
        need_sort=need_sort,
    )
    sim = RandomScheduler(config, seed=1000 + page_size)
    for step in range(STEPS):
        sim.step()
        violations = sim.alloc.check_integrity()
        assert violations == [], f"step {step}: {violations[:3]}"
    # the run did real work: requests finished, the cache was hit and evicted
    assert sim.next_rid > STEPS // 2
    assert sim.alloc.tree_cache.evicted_tokens_total > 0
    rids = sim.alloc.live_rids()
    sim.alloc.release(rids, sim.alloc.request_lens(rids).committed, None, "abort")
    sim.alloc.evict(1 << 30)
    counters = sim.alloc.counters()
    assert counters.available == counters.pool_tokens
    assert np.array_equal(np.sort(sim.alloc.token_to_kv_pool_allocator.get_all_free_pages()),
                          np.arange(1, counters.pool_tokens // page_size + 1))


@pytest.mark.parametrize("page_size", [1, 16])
def test_hisparse_runs_stay_sound(page_size: int) -> None:
    """PD decode with HiSparse (no radix cache): the logical pool and the device pool
    stay consistent through extend / decode / spec / release."""
    config = AllocatorConfig(
        pool_tokens={1: 1024, 16: 2048}[page_size],
        page_size=page_size,
        max_running=16,
        max_context_len=600,
        spec=SpecConfig("eagle", 3, 1, 4) if page_size == 16 else None,
        hisparse=True,
        radix_cache=False,
    )
    sim = RandomScheduler(config, seed=77 + page_size)
    for step in range(1500):
        sim.step()
        violations = sim.alloc.check_integrity()
        assert violations == [], f"step {step}: {violations[:3]}"
    assert sim.next_rid > 500
    tok = sim.alloc.token_to_kv_pool_allocator
    rids = sim.alloc.live_rids()
    sim.alloc.release(rids, sim.alloc.request_lens(rids).committed, None, "abort")
    assert tok.logical_attn_allocator.available_size() == tok.logical_attn_allocator.num_pages * page_size
    assert tok.hisparse_attn_allocator.available_size() == tok.hisparse_attn_allocator.num_pages * page_size
