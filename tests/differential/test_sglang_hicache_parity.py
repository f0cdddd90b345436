"""HiCache's host tier: ``kvtrace diff --a sglang --b builtin --exact`` identical on
recordings served with the tier, at pages 1 and 16, for each write policy (world
decision 17: SGLang's own ``UnifiedRadixCache`` in HiCache mode, its ``HostKVCache``
free list, a synchronous controller); the device pool is small enough that prefixes are
demoted to the host and loaded back (asserted: host hits in the replay's summary). And,
without SGLang, a divergence in the host pool names the pool ``"host"``.

The parity tests are skipped unless ``KVTRACE_SGLANG_PYTHON`` names an interpreter with
sglang 0.5.23.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from tests.differential import harness

runner = CliRunner()

# Mooncake requests (512-token blocks): prefixes come back after the 4,096-token pool
# has evicted them, some after a device hit first (write_through_selective backs a node
# up on its second hit).
_BLOCKS = [[1, 2], [1, 2, 30], [3, 4, 5], [3, 4, 31], [6, 7, 8], [9, 10, 11], [1, 2, 12], [3, 4, 13], [6, 7, 14],
           [15, 16, 17], [1, 2, 12, 18], [9, 10, 19], [3, 4, 5, 20], [21, 22, 23], [6, 7, 8, 24], [1, 2, 25]]
POLICIES = ("write_through", "write_through_selective", "write_back")


def _record(tmp_path: Path, page_size: int, policy: str) -> Path:
    """A recording served with the host tier (ratio 2, ``policy``) on a 4,096-token pool."""
    workload = tmp_path / "conversations.jsonl"
    workload.write_text("".join(
        json.dumps({"timestamp": i * 2000, "input_length": 512 * len(h), "output_length": 6, "hash_ids": h}) + "\n"
        for i, h in enumerate(_BLOCKS)
    ))
    trace = tmp_path / f"hicache-{page_size}-{policy}.kvtrace"
    res = runner.invoke(app, ["record", str(workload), "--format", "mooncake", "--pool-tokens", "4096",
                              "--page-size", str(page_size), "--max-running", "4", "--hicache-ratio", "2",
                              "--hicache-write-policy", policy, "-o", str(trace), "--json"])
    assert res.exit_code == 0, res.output
    return trace


def _host_hits(trace: Path) -> int:
    res = runner.invoke(app, ["replay", str(trace), "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)["hicache"]["prefix_tokens"]["host"]


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_a_recording_with_the_host_tier_identical_to_sglang_exactly(page_size: int, policy: str,
                                                                    tmp_path: Path) -> None:
    python = harness.require_sglang()
    trace = _record(tmp_path, page_size, policy)
    assert _host_hits(trace) > 0  # prefixes went to the host and came back
    res = runner.invoke(app, ["diff", str(trace), "--a", f"sglang:{python}", "--b", "builtin", "--exact", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["identical"] and out["steps"] > 0


_BIGGER_HOST = '''
import dataclasses
from allocator.manager import KvAllocator


def bigger_host(config):
    """The built-in allocator with one host page more than the trace's tier."""
    tier = config.hicache
    tokens = tier.pool_tokens(config.pool_tokens) + tier.page_size
    return KvAllocator(dataclasses.replace(config, hicache=dataclasses.replace(tier, host_pool_tokens=tokens)))
'''


def test_a_divergence_in_the_host_pool_names_the_pool_host(tmp_path: Path) -> None:
    trace = _record(tmp_path, 1, "write_through")
    factory = tmp_path / "bigger_host.py"
    factory.write_text(_BIGGER_HOST)
    res = runner.invoke(app, ["diff", str(trace), "--b", f"{factory}:bigger_host", "--jobs", "1", "--json"])
    assert res.exit_code == 1, res.output
    out = json.loads(res.stdout)
    first = out["first_divergence"]
    assert (first["step"], first["field"], first["pool"]) == (0, "host_pool_tokens", "host")
    figures = out["divergences"][0]["pools"]
    assert set(figures) == {"full", "host"}
    assert figures["full"]["differs"] == [] and "pool_tokens" in figures["host"]["differs"]
    assert figures["host"]["b"]["pool_tokens"] == figures["host"]["a"]["pool_tokens"] + 1
