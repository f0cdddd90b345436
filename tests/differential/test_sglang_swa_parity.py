"""Parity of kvtrace's SWA allocator with SGLang 0.5.23's real SWA classes, step by step.

Hybrid sliding-window models with the radix cache off (``scenarios.SWA_CONFIGS``: pages
1, 16 and 64, spec off and EAGLE 3,1,4, PD decode with the SWA tail, the overlap
scheduler's chunk rule, an SWA pool as large as the full one): per step, besides the full pool's state, the SWA pool's free
list in order and available size, and per request ``swa_evicted_seqlen`` and the SWA
slot of every row position (``scenario.SWA_STATE_FIELDS``). The SGLang side runs
``SWATokenToKVPoolAllocator``, ``UnifiedRadixCache(FULL, SWA)`` disabled and the real
``maybe_evict_swa`` (``kvtrace/sglang/world.py``, decision 11).

Skipped unless ``KVTRACE_SGLANG_PYTHON`` names the interpreter of a venv made by
``tools/sglang_oracle/setup.sh``. ``KVTRACE_DIFF_SEEDS`` (default 3) seeds per configuration.
"""

from __future__ import annotations

import io
import json
import os

import pytest

from kvtrace.sglang import scenario as sc
from tests.differential import compare, harness, ours_driver, scenarios as gen

NUM_SEEDS = int(os.environ.get("KVTRACE_DIFF_SEEDS", "3"))
SCENARIOS: list[sc.Scenario] = gen.random_scenarios(range(NUM_SEEDS), gen.SWA_CONFIGS)


@pytest.fixture(scope="module")
def parity() -> compare.Summary:
    python = harness.require_sglang()
    summary, _times = harness.differential(SCENARIOS, python)
    return summary


@pytest.mark.slow
@pytest.mark.parametrize("name", [s.name for s in SCENARIOS])
def test_swa_identical_to_sglang(parity: compare.Summary, name: str) -> None:
    result = next(r for r in parity.results if r.scenario == name)
    assert result.status == "identical", (
        result.divergence.render() if result.divergence else f"{result.status}: {result.note}"
    )
    assert result.steps_compared == len(next(s for s in SCENARIOS if s.name == name).steps)


def test_swa_configurations_cover_pages_spec_and_pd() -> None:
    configs = [s.config for s in SCENARIOS]
    assert all(c.swa is not None and not c.radix_cache for c in configs)
    for ps in (1, 16, 64):
        assert any(c.page_size == ps and c.spec is None for c in configs), ps
    for ps in (1, 16, 64):
        assert any(c.page_size == ps and c.spec == gen.EAGLE_314 for c in configs), ps
    pd = [s for s in SCENARIOS if any(o.op == "prealloc" for st in s.steps for o in st.ops)]
    assert {s.config.page_size for s in pd} >= {16, 64}
    assert any(c.swa.overlap_chunked_prefill for c in configs)  # the overlap scheduler's chunk rule


def test_swa_scenarios_free_windows_and_run_short_of_each_pool() -> None:
    """Ours alone (no SGLang): the scenarios exercise what the parity is about, window
    frees and out-of-memory calls; a config round-trips through the scenario file."""
    out = io.StringIO()
    assert ours_driver.run_scenarios(SCENARIOS[: len(gen.SWA_CONFIGS)], out) == 0
    dumps = [json.loads(line) for line in out.getvalue().splitlines()]
    assert max(q[1] for d in dumps for q in d.get("swa_reqs", ())) > 0
    ooms = sum(1 for d in dumps for e in d.get("events", ()) if e.get("outcome") == "oom")
    assert ooms > 0
    cfg = SCENARIOS[0].config
    assert sc.ScenarioConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert "swa" not in sc.ScenarioConfig(pool_tokens=64).to_dict()
