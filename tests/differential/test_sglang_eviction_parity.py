"""Every radix eviction policy: ``kvtrace diff --a sglang --b builtin --exact`` identical on
a trace recorded with ``--eviction-policy`` from the tiny sample, at pages 1 and 16, with a
pool small enough that the radix cache evicts (SGLang's own RadixCache runs the policy).

Skipped unless ``KVTRACE_SGLANG_PYTHON`` names an interpreter with sglang 0.5.23.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from allocator.evict_policy import EVICTION_POLICIES
from kvtrace.cli import app
from kvtrace.sglang import scenario as sc
from tests.differential import harness

runner = CliRunner()


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_policy_identical_to_sglang_exactly(policy: str, page_size: int, tmp_path: Path) -> None:
    python = harness.require_sglang()
    trace = tmp_path / f"{policy}-{page_size}.kvtrace"
    res = runner.invoke(app, ["record", "sample:tiny", "--pool-tokens", "2048", "--page-size", str(page_size),
                              "--eviction-policy", policy, "-o", str(trace), "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["evicted_tokens"] > 0  # the policy decided something
    res = runner.invoke(app, ["diff", str(trace), "--a", f"sglang:{python}", "--b", "builtin", "--exact"])
    assert res.exit_code == 0, res.output
    assert "identical over" in res.output


def test_scenario_header_carries_the_policy() -> None:
    """SGLang's side is built from the scenario config: a policy other than LRU travels
    in it; LRU leaves the header as it was before policies existed."""
    lfu = sc.ScenarioConfig(pool_tokens=64, eviction_policy="lfu")
    assert sc.ScenarioConfig.from_dict(lfu.to_dict()).eviction_policy == "lfu"
    assert "evict=lfu" in lfu.label()
    assert "eviction_policy" not in sc.ScenarioConfig(pool_tokens=64).to_dict()
