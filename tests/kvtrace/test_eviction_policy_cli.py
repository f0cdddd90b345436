"""``--eviction-policy``: stored in the trace's config by ``record``, a what-if of
``replay`` and ``diff``, an unknown name exits 2 naming the valid ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from traces.reader import TraceReader

runner = CliRunner()


@pytest.fixture(scope="module")
def lfu_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sample:tiny recorded with LFU and a pool small enough that the radix cache evicts."""
    out = tmp_path_factory.mktemp("policy") / "lfu.kvtrace"
    res = runner.invoke(app, ["record", "sample:tiny", "--pool-tokens", "2048", "--page-size", "1",
                              "--eviction-policy", "lfu", "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout.strip().splitlines()[-1])["evicted_tokens"] > 0
    return out


def _replay(trace: Path, *extra: str) -> dict:
    res = runner.invoke(app, ["replay", str(trace), "--json", *extra])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_record_stores_the_policy(lfu_trace: Path) -> None:
    assert TraceReader(lfu_trace).meta.config.eviction_policy == "lfu"
    # An LRU trace's metadata has no key for it: what traces before policies held.
    assert "eviction_policy" not in TraceReader(Path("traces/samples/tiny.kvtrace")).meta.to_dict()["config"]


def test_replay_what_if_policy_changes_the_outcome(lfu_trace: Path) -> None:
    recorded = _untimed(_replay(lfu_trace))
    assert _untimed(_replay(lfu_trace, "--eviction-policy", "lfu")) == recorded
    mru = _untimed(_replay(lfu_trace, "--eviction-policy", "mru"))
    assert mru["evicted_tokens"] != recorded["evicted_tokens"]


def _untimed(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if not (k.endswith("_s") or k.startswith("speedup"))}


def test_diff_what_if_policy_between_versions(lfu_trace: Path) -> None:
    res = runner.invoke(app, ["diff", str(lfu_trace), "--a", "builtin", "--b", "builtin", "--eviction-policy", "fifo",
                              "--exact", "--jobs", "1"])
    assert res.exit_code == 0, res.output
    assert "identical over" in res.output


@pytest.mark.parametrize("command", ["replay", "diff"])
def test_unknown_policy_exits_2_naming_the_valid_ones(command: str) -> None:
    args = [command, "sample:tiny", "--eviction-policy", "lifo"] + (["--b", "builtin"] if command == "diff" else [])
    res = runner.invoke(app, args)
    assert res.exit_code == 2
    assert "'lru', 'lfu', 'fifo', 'mru', 'filo', 'priority', 'slru'" in res.output


def test_record_refuses_tlru_with_the_valid_ones(tmp_path: Path) -> None:
    res = runner.invoke(app, ["record", "sample:tiny", "--eviction-policy", "tlru", "-o", str(tmp_path / "t.kvtrace")])
    assert res.exit_code == 2
    assert "lru" in res.output and "slru" in res.output
