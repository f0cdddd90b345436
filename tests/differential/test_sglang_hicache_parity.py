"""HiCache's host tier: ``kvtrace diff --a sglang --b builtin --exact`` identical on
recordings served with the tier, at pages 1 and 16, for each write policy (``kvtrace
diff``'s ``--hicache-write-policy`` what-if), and on one made without the tier that
``--hicache-ratio`` turns on. SGLang's side is world decision 17: its own
``UnifiedRadixCache`` in HiCache mode, its ``HostKVCache`` free list, a synchronous
controller. The device pool is small enough that prefixes are demoted to the host and
loaded back (asserted: host hits in the replay's summary). And, without SGLang, the
what-ifs reach both sides and a divergence in the host pool names the pool ``"host"``.

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


def _record(tmp_path: Path, page_size: int, policy: str = "write_through", tier: bool = True) -> Path:
    """A recording on a 4,096-token pool served with the host tier (ratio 2, ``policy``),
    or without it."""
    workload = tmp_path / "conversations.jsonl"
    workload.write_text("".join(
        json.dumps({"timestamp": i * 2000, "input_length": 512 * len(h), "output_length": 6, "hash_ids": h}) + "\n"
        for i, h in enumerate(_BLOCKS)
    ))
    trace = tmp_path / f"hicache-{page_size}-{policy}-{tier}.kvtrace"
    res = runner.invoke(app, ["record", str(workload), "--format", "mooncake", "--pool-tokens", "4096",
                              "--page-size", str(page_size), "--max-running", "4", "-o", str(trace), "--json",
                              *(["--hicache-ratio", "2", "--hicache-write-policy", policy] if tier else [])])
    assert res.exit_code == 0, res.output
    return trace


def _host_hits(trace: Path, policy: str) -> int:
    res = runner.invoke(app, ["replay", str(trace), "--hicache-write-policy", policy, "--json"])
    assert res.exit_code == 0, res.output
    tier = json.loads(res.stdout)["hicache"]
    assert tier["write_policy"] == policy
    return tier["prefix_tokens"]["host"]


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16])
def test_a_recording_with_the_host_tier_identical_to_sglang_exactly(page_size: int, tmp_path: Path) -> None:
    """Each write policy as ``kvtrace diff``'s what-if on one recording."""
    python = harness.require_sglang()
    trace = _record(tmp_path, page_size)
    for policy in POLICIES:
        assert _host_hits(trace, policy) > 0  # prefixes went to the host and came back
        res = runner.invoke(app, ["diff", str(trace), "--a", f"sglang:{python}", "--b", "builtin", "--exact",
                                  "--hicache-write-policy", policy, "--json"])
        assert res.exit_code == 0, (policy, res.output)
        out = json.loads(res.stdout)
        assert out["identical"] and out["steps_compared"] > 0
        assert out["a"]["hicache"]["write_policy"] == out["b"]["hicache"]["write_policy"] == policy


@pytest.mark.slow
def test_a_tier_turned_on_by_the_diff_identical_to_sglang_exactly(tmp_path: Path) -> None:
    """A recording made without the tier, served with it by ``--hicache-ratio``."""
    python = harness.require_sglang()
    trace = _record(tmp_path, 16, tier=False)
    res = runner.invoke(app, ["replay", str(trace), "--hicache-ratio", "2", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["hicache"]["prefix_tokens"]["host"] > 0
    res = runner.invoke(app, ["diff", str(trace), "--a", f"sglang:{python}", "--b", "builtin", "--exact",
                              "--hicache-ratio", "2", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["identical"] and out["a"]["hicache"]["host_pool_tokens"] == 8192 + 16


def test_diff_applies_the_host_tier_what_ifs_to_both_sides(tmp_path: Path) -> None:
    trace = _record(tmp_path, 1)
    res = runner.invoke(app, ["diff", str(trace), "--b", "token", "--hicache-ratio", "3",
                              "--hicache-write-policy", "write_back", "--jobs", "1", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    for side in ("a", "b"):
        assert out[side]["hicache"]["write_policy"] == "write_back"
        assert out[side]["hicache"]["host_pool_tokens"] == 4096 * 3 + 1


@pytest.mark.parametrize(
    ("extra", "named"),
    [(["--range", "HEAD~1..HEAD"], "--range"), (["--tui"], "--tui"), (["--kv-events"], "--kv-events")],
)
def test_the_host_tier_what_ifs_are_refused_where_they_do_not_apply(extra: list[str], named: str) -> None:
    res = runner.invoke(app, ["diff", "sample:tiny", "--b", "token", "--hicache-ratio", "2", *extra])
    assert res.exit_code == 2, res.output
    assert named in res.output and "--hicache-ratio" in res.output


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


def test_a_scenario_with_the_host_tier_round_trips() -> None:
    """The driver's scenario config carries the tier (decision 17); without it the
    header is as before HiCache existed."""
    from kvtrace.sglang.scenario import HiCacheSpec, ScenarioConfig

    cfg = ScenarioConfig(pool_tokens=64, page_size=16, hicache=HiCacheSpec(host_ratio=3.0, write_policy="write_back"))
    assert ScenarioConfig.from_dict(cfg.to_dict()) == cfg
    assert "hicache" not in ScenarioConfig(pool_tokens=64).to_dict()
