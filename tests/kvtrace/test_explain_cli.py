"""``kvtrace explain`` and ``kvtrace replay --explain`` end to end (CliRunner)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtrace.cli import app

runner = CliRunner()


def test_explain_json_holds_the_causes_the_oracles_and_the_replay() -> None:
    result = runner.invoke(app, ["explain", "sample:tiny", "--json"])
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert sum(out["causes"].values()) == out["missed_tokens"] > 0
    assert out["replay"]["prefix_hit_rate"] == out["hit_rates"]["lru"]
    model = out["hit_rates"]["model"]
    assert model["infinite"] >= model["belady"] >= model["lru"]
    assert set(out["distributions"]) == {"age_at_hit", "reuse_distance", "reuse_count", "age_at_eviction"}
    assert out["retraction_cost"] and out["by_trigger"]["spec_reserve"]["evictions"] >= 1


def test_explain_text_and_the_replay_options() -> None:
    result = runner.invoke(app, ["explain", "sample:tiny", "--pool-tokens", "100000", "--no-belady"])
    assert result.exit_code == 0, result.stderr
    text = result.stdout
    assert "missed tokens by cause" in text and "recomputed after retraction" in text
    assert "evictions by trigger" not in text  # nothing is evicted from a pool that large
    assert "Belady -" in text and "policy gap" not in text


def test_a_configuration_without_a_radix_cache_is_one_line() -> None:
    result = runner.invoke(app, ["explain", "sample:mooncake-gemma-3"])
    assert result.exit_code == 2
    assert result.stderr.strip().startswith("kvtrace: error: the radix cache is off") and "\n" not in result.stderr.strip()


def test_replay_explain_adds_the_report_under_a_key() -> None:
    plain = json.loads(runner.invoke(app, ["replay", "sample:tiny", "--json"]).stdout)
    assert "explain" not in plain
    result = runner.invoke(app, ["replay", "sample:tiny", "--json", "--explain"])
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["explain"]["missed_tokens"] == sum(out["explain"]["causes"].values())
    assert {k: v for k, v in out.items() if k not in ("explain", "wall_s", "allocator_s", "speedup_vs_realtime")} == {
        k: v for k, v in plain.items() if k not in ("wall_s", "allocator_s", "speedup_vs_realtime")}
    text = runner.invoke(app, ["replay", "sample:tiny", "--explain"])
    assert text.exit_code == 0 and "missed tokens by cause" in text.stdout


def test_replay_explain_goes_with_the_dashboard() -> None:
    # --explain --tui is the dashboard with explain on (its e key): refused here only for
    # want of a terminal, no longer for --explain.
    result = runner.invoke(app, ["replay", "sample:tiny", "--explain", "--tui"])
    assert result.exit_code == 2 and "--explain" not in result.stderr and "terminal" in result.stderr


def test_explain_and_kv_events_share_the_radix_cache_listener(tmp_path: Path) -> None:
    alone = json.loads(runner.invoke(app, ["replay", "sample:mooncake-tiny", "--json", "--kv-events",
                                           str(tmp_path / "a.kvev")]).stdout)
    result = runner.invoke(app, ["replay", "sample:mooncake-tiny", "--json", "--explain", "--kv-events",
                                  str(tmp_path / "b.kvev")])
    assert result.exit_code == 0, result.stderr
    both = json.loads(result.stdout)
    assert both["kv_events"]["blocks_removed"] == alone["kv_events"]["blocks_removed"] > 0
    assert sum(row["evicted_tokens"] for row in both["explain"]["by_trigger"].values()) == both["evicted_tokens"]


@pytest.mark.slow  # records a trace in a subprocess
def test_swa_evictions_name_their_evictor(tmp_path: Path) -> None:
    # A sliding-window model (gpt-oss-20b) with the radix cache on: a shared two-block prefix
    # is evicted between its uses by the admissions in between; the SWA tree tells explain.
    import subprocess
    import sys

    rows = []
    for i in range(10):
        hashes = [1, 2, 100 + i] if i % 3 == 0 else [200 + 2 * i, 201 + 2 * i]
        rows.append({"timestamp": 2000 * i, "input_length": 512 * len(hashes) - 7, "output_length": 4,
                     "hash_ids": hashes})
    workload = tmp_path / "swa.jsonl"
    workload.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trace = tmp_path / "swa.kvtrace"
    rec = subprocess.run(
        [sys.executable, "-m", "kvtrace", "record", str(workload), "--model", "gpt-oss-20b", "--radix-cache",
         "--pool-tokens", "2048", "--page-size", "16", "-o", str(trace), "--quiet"],
        capture_output=True, text=True,
    )
    assert rec.returncode == 0, rec.stderr
    result = runner.invoke(app, ["explain", str(trace), "--json"])
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["causes"]["evicted"] > 0 and out["unknown_evictor_tokens"] == 0
    assert sum(t["missed_tokens"] for t in out["by_trigger"].values()) == out["causes"]["evicted"]
    assert sum(t["evicted_tokens"] for t in out["by_trigger"].values()) == out["replay"]["evicted_tokens"]
    assert all(e["rid"] >= 0 for e in out["top_evictors"])


def test_replay_explain_out_writes_each_steps_missed_tokens_by_cause(tmp_path: Path) -> None:
    # The hand-built eviction: rid 0's 8 cold at step 0, rid 1's 28 at step 3, and rid 2's
    # at step 5: 1 cold, 8 evicted (by step 3's admission).
    import pyarrow.ipc as ipc

    from kvtrace.explain.attribution import CAUSES, STEP_COLUMNS
    from kvtrace.statelog.session import StateLogSession
    from tests.kvtrace.test_explain import _evicting_steps, _trace

    trace = _trace(tmp_path / "t.kvtrace", _evicting_steps(), pool_tokens=32)
    log = tmp_path / "run.log"
    result = runner.invoke(app, ["replay", str(trace), "--explain", "--out", str(log), "--json"])
    assert result.exit_code == 0, result.output
    causes = json.loads(result.stdout)["explain"]["causes"]
    table = ipc.open_file(log).read_all()
    assert tuple(table.schema.names[-len(STEP_COLUMNS):]) == STEP_COLUMNS
    rows = {step: {c: table.column(f"explain_{c}")[i].as_py() for c in CAUSES if table.column(f"explain_{c}")[i].as_py()}
            for i, step in enumerate(table.column("step").to_pylist())}
    assert rows == {0: {"cold": 8}, 1: {}, 2: {}, 3: {"cold": 28}, 4: {}, 5: {"cold": 1, "evicted": 8}}
    assert {c: sum(table.column(f"explain_{c}").to_pylist()) for c in CAUSES} == causes
    info = json.loads(runner.invoke(app, ["info", str(log), "--json"]).stdout)
    assert info["explain"] == causes
    assert "missed tokens" in runner.invoke(app, ["info", str(log)]).stdout
    with StateLogSession(log) as saved:  # the dashboard's reader (kvtrace view) reads it
        assert (saved.first_step, saved.last_step) == (0, 5)
        assert saved.seek(5).step == 5


def test_a_log_without_explain_has_the_plain_schema(tmp_path: Path) -> None:
    import pyarrow.ipc as ipc

    from kvtrace.statelog.log import state_log_schema

    log = tmp_path / "run.log"
    assert runner.invoke(app, ["replay", "sample:tiny", "--out", str(log)]).exit_code == 0
    assert ipc.open_file(log).schema.equals(state_log_schema())
    assert "explain" not in json.loads(runner.invoke(app, ["info", str(log), "--json"]).stdout)
