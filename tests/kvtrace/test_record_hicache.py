"""``kvtrace record`` with HiCache's host tier: the scheduler model runs on the tiered
allocator and admits host hits as SGLang's ``PrefillAdder`` does, so a recording loads
evicted prefixes back, replays clean with the same prefix lengths, and ``--like``
carries the tier into a recording that serves it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from allocator.base import AllocatorConfig, AllocResult, HiCacheConfig
from allocator.manager import KvAllocator
from kvtrace.cli import app
from kvtrace.record.simulate import RecordOptions, record_workload
from traces.hicache_layout import HostTier, host_pool_tokens_for

runner = CliRunner()
POLICIES = ("write_through", "write_through_selective", "write_back")
POOL = 6144


def _workload(path: Path) -> Path:
    """Mooncake rows (512-token blocks): a hot prefix served twice (the second hit backs
    it up under write_through_selective), fillers and one long prompt that push it off
    the device, then two prompts that extend it (host hits, loaded back). The long prompt
    arrives at an idle engine and fits only once the fillers' backups are acknowledged."""
    hot = [1, 2, 3, 4]
    rows = [
        {"timestamp": 0, "input_length": 2048, "output_length": 4, "hash_ids": hot},
        {"timestamp": 500, "input_length": 2100, "output_length": 4, "hash_ids": [*hot, 5]},
    ]
    for i in range(6):
        rows.append({"timestamp": 1000 + 500 * i, "input_length": 2048, "output_length": 4,
                     "hash_ids": list(range(100 + 4 * i, 104 + 4 * i))})  # fmt: skip
    rows += [
        {"timestamp": 6000, "input_length": 5000, "output_length": 4, "hash_ids": list(range(200, 210))},
        {"timestamp": 10000, "input_length": 2600, "output_length": 4, "hash_ids": [*hot, 6, 7]},
        {"timestamp": 11000, "input_length": 2100, "output_length": 4, "hash_ids": [*hot, 8]},
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _replay(trace: Path | str, *extra: str) -> dict[str, Any]:
    result = runner.invoke(app, ["-q", "--json", "replay", str(trace), *extra])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def workload(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _workload(tmp_path_factory.mktemp("hicache-rec") / "hot.jsonl")


@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("policy", POLICIES)
def test_a_tiered_recording_loads_back_and_replays_clean(workload: Path, tmp_path: Path, ps: int, policy: str) -> None:
    out = tmp_path / "tiered.kvtrace"
    tier = HostTier(host_pool_tokens_for(POOL, ps, 4.0), policy, 4.0)  # type: ignore[arg-type]
    result = record_workload(RecordOptions(workload=workload, fmt="mooncake", out=out, pool_tokens=POOL,
                                           page_size=ps, hicache=tier))  # fmt: skip
    summary = result.summary
    # every request served: the long prompt was not dropped as stuck behind backup locks
    assert (summary.requests, summary.finished, summary.rejected) == (11, 11, 0)
    assert summary.extend_retries == 0 and result.violations == []
    report = _replay(out, "--check", "every")
    assert report["num_violations"] == 0
    assert report["prefix_differs_from_recorded"] == 0
    hits = report["hicache"]["prefix_tokens"]
    assert hits["host"] >= 2048  # the hot prefix, loaded back for the last prompts
    # the recorded hits are the replay's: device hits and load-backs both
    assert summary.prefix_hit_tokens == hits["device"] + hits["host"]


def test_the_match_of_both_tiers_is_a_pure_query() -> None:
    a = KvAllocator(AllocatorConfig(pool_tokens=256, page_size=16, max_running=8, max_context_len=1024,
                                    hicache=HiCacheConfig(host_ratio=4.0, write_policy="write_back", page_size=16)))
    rng = np.random.default_rng(3)
    prompt = rng.integers(1, 50_000, 160, dtype=np.int64)
    for rid, toks in enumerate([prompt, *(rng.integers(1, 50_000, 200, dtype=np.int64) for _ in range(4))]):
        res = a.extend(np.array([rid]), np.array([toks.shape[0]]), [toks])
        assert isinstance(res, AllocResult)
        a.end_step()
        a.release(np.array([rid]), np.array([toks.shape[0]]), [toks], "finish")
        a.end_step()
    query = np.concatenate([prompt[:100], rng.integers(1, 50_000, 40, dtype=np.int64)])
    before = a.state_digest()
    device, host = a.match_prefix_hi(query)
    assert a.state_digest() == before and a.match_prefix(query) == device
    assert host == 96 - device > 0  # the prompt's pages matched, on host (evicted from the device)
    res = a.extend(np.array([9]), np.array([query.shape[0]]), [query])
    assert isinstance(res, AllocResult)
    assert res.host_hit_lens is not None and (int(res.prefix_lens[0]), int(res.host_hit_lens[0])) == (96, host)


def test_record_like_serves_the_tier(workload: Path, tmp_path: Path) -> None:
    like = tmp_path / "like.kvtrace"
    code = runner.invoke(app, ["-q", "record", str(workload), "--format", "mooncake", "--pool-tokens", str(POOL),
                               "--page-size", "16", "--hicache-ratio", "4", "-o", str(like)])  # fmt: skip
    assert code.exit_code == 0, code.stderr
    out = tmp_path / "out.kvtrace"
    code = runner.invoke(app, ["-q", "record", str(workload), "--format", "mooncake", "--like", str(like),
                               "-o", str(out)])  # fmt: skip
    assert code.exit_code == 0, code.stderr
    report = _replay(out)
    assert report["hicache"]["host_pool_tokens"] == host_pool_tokens_for(POOL, 16, 4.0)
    assert report["hicache"]["prefix_tokens"]["host"] >= 2048
    assert report["prefix_differs_from_recorded"] == 0


@pytest.mark.parametrize(
    ("extra", "switch"),
    [(["--pd-decode"], "--pd-decode"), (["--spec", "eagle:3,1,4"], "--spec"), (["--namespaces", "2"], "--namespaces"),
     (["--model", "gpt-oss-20b"], "a sliding-window --model")],
)
def test_switches_the_tiered_allocator_does_not_serve_are_refused(
    workload: Path, tmp_path: Path, extra: list[str], switch: str
) -> None:
    result = runner.invoke(app, ["record", str(workload), "--format", "mooncake", "--pool-tokens", str(POOL),
                                 "--page-size", "16", "--hicache-ratio", "2", *extra, "-o", str(tmp_path / "x.kvtrace")])  # fmt: skip
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtrace: error: HiCache's host tier"), result.stderr
    assert f"not with {switch}:" in lines[0]


@pytest.mark.slow
def test_the_bundled_sample_loads_back_what_it_recorded() -> None:
    report = _replay("sample:mooncake-hicache")
    assert report["hicache"]["write_policy"] == "write_through"
    assert report["hicache"]["host_pool_tokens"] == host_pool_tokens_for(80_000, 16, 24.0)
    assert report["hicache"]["prefix_tokens"]["host"] > 10_000
    assert report["prefix_differs_from_recorded"] == 0 and report["num_violations"] == 0
