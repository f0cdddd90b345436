"""``kvtrace record`` through the CLI: output contract, option errors, unseen files of the
same formats, and a real SIGKILL in the middle of a recording."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from traces.errors import TraceError
from traces.io import TraceReader
from traces.validate import OpSequenceChecker

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "traces" / "workloads_data"
MOONCAKE = DATA / "mooncake-fast25" / "conversation_trace.jsonl"
AZURE = DATA / "azure-llm-inference-2023" / "AzureLLMInferenceTrace_code.csv"
SHAREGPT = DATA / "sharegpt-arxiv-lengths" / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"

SMALL = ["--page-size", "16", "--pool-tokens", "200000", "--quiet"]


def _record(args: list[str]) -> tuple[int, dict | None, str]:
    result = CliRunner().invoke(app, ["record", *args, "--json"])
    payload = json.loads(result.stdout) if result.exit_code == 0 else None
    return result.exit_code, payload, result.output


def _validate(path: Path) -> dict:
    result = CliRunner().invoke(app, ["validate", str(path), "--json"])
    report = json.loads(result.stdout)
    assert result.exit_code == (0 if report["ok"] else 1)
    return report


def test_record_json_contract_and_validate(tmp_path: Path) -> None:
    out = tmp_path / "m.kvtrace"
    code, report, output = _record([str(MOONCAKE), "--format", "mooncake", "--duration", "15s", "--out", str(out), *SMALL])
    assert code == 0, output
    for key in ("out", "steps", "requests", "wall_s", "duration_s", "prefix_hit_rate", "retractions", "aborts", "evicted_tokens"):
        assert key in report
    assert report["out"] == str(out) and report["integrity_violations"] == []
    assert report["requests"] == report["finished"] > 20
    checked = _validate(out)
    assert checked["ok"] and checked["steps"] == report["steps"] and checked["requests"] == report["requests"]
    meta = TraceReader(out).meta
    assert meta.source.license == "Apache-2.0" and "FAST 2025" in meta.source.citation
    assert meta.config.page_size == 16 and meta.config.chunk_size == 8192


def test_summary_table_and_overwrite_refused(tmp_path: Path) -> None:
    out = tmp_path / "a.kvtrace"
    args = ["record", str(AZURE), "--duration", "20s", "--out", str(out), "--page-size", "16"]
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0, first.output
    assert "prefix hit rate" in first.stdout and "allocator integrity" in first.stdout and "clean" in first.stdout
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 2
    assert "already exists; pass --force to overwrite it" in again.output
    forced = CliRunner().invoke(app, [*args, "--force", "--quiet"])
    assert forced.exit_code == 0, forced.output


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--page-size", "0"], "--page-size"),
        (["--rate", "3"], "applies to the lengths format only"),
        (["--spec", "medusa:3,1,4"], "ALGORITHM:STEPS,TOPK,DRAFT"),
        (["--spec", "eagle:3,1"], "three integers"),
        (["--duration", "soon"], "is not a duration"),
        (["--time-scale", "0"], "positive factor"),
        (["--chunk", "8"], "at least the page size 16"),
        (["--step-time", "warp=3"], "unknown step-time coefficient"),
        (["--policy", "random"], "random"),
    ],
)
def test_bad_options_exit_2(tmp_path: Path, extra: list[str], message: str) -> None:
    out = tmp_path / "x.kvtrace"
    result = CliRunner().invoke(app, ["record", str(MOONCAKE), "--out", str(out), "--page-size", "16", *extra])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output and not out.exists()


def test_empty_workload_is_an_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    out = tmp_path / "e.kvtrace"
    result = CliRunner().invoke(app, ["record", str(empty), "--out", str(out)])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"kvtrace: error: {empty}: holds no requests; nothing to record"
    assert not out.exists()


def test_lengths_needs_a_rate_and_records_with_one(tmp_path: Path) -> None:
    out = tmp_path / "l.kvtrace"
    no_rate = CliRunner().invoke(app, ["record", str(SHAREGPT), "--format", "lengths", "--out", str(out)])
    assert no_rate.exit_code == 2 and "needs an arrival rate" in no_rate.output
    code, report, output = _record(
        [str(SHAREGPT), "--format", "lengths", "--rate", "4", "--duration", "10s", "--out", str(out), *SMALL]
    )
    assert code == 0, output
    assert 25 <= report["requests"] <= 60  # Poisson(40)
    assert _validate(out)["ok"]
    assert TraceReader(out).meta.source.repository == "project-etalon/etalon"


def test_unseen_files_of_the_same_formats(tmp_path: Path) -> None:
    # A Mooncake-format trace other than the conversation one (as toolagent_trace.jsonl):
    # other ids, a non-zero first timestamp, float timestamps, keys in another order.
    lines = []
    for i in range(30):
        n = 700 + 97 * i
        blocks = -(-n // 512)
        ids = [900_000 + (i % 3)] + [1_000_000 + 10 * i + j for j in range(blocks - 1)]
        lines.append(json.dumps({"hash_ids": ids, "output_length": 20 + i, "input_length": n, "timestamp": 5000.5 + 400 * i}))
    tool = tmp_path / "toolagent_trace.jsonl"
    tool.write_text("\n".join(lines) + "\n")
    out = tmp_path / "tool.kvtrace"
    code, report, output = _record([str(tool), "--out", str(out), *SMALL])
    assert code == 0, output
    assert report["format"] == "mooncake" and report["requests"] == 30 and report["prefix_hit_rate"] > 0
    assert TraceReader(out).meta.source.path == "FAST25-release/traces/toolagent_trace.jsonl"
    # An Azure CSV like the conversation one of 2024: UTC offsets, columns reordered.
    conv = tmp_path / "AzureLLMInferenceTrace_conv.csv"
    rows = ["ContextTokens,GeneratedTokens,TIMESTAMP"] + [
        f"{300 + 11 * i},{5 + i % 7},2024-05-10 00:00:{i * 0.5:09.6f}+00:00" for i in range(40)
    ]
    conv.write_text("\n".join(rows))
    out2 = tmp_path / "conv.kvtrace"
    code, report, output = _record([str(conv), "--out", str(out2), *SMALL])
    assert code == 0, output
    assert report["format"] == "azure" and report["requests"] == 40
    assert _validate(out2)["ok"]


def test_sigkill_keeps_every_completed_step(tmp_path: Path) -> None:
    """Kill ``kvtrace record`` (default options) mid-run: the trace holds every step
    written before the kill (each step is flushed at its end) and they validate."""
    out = tmp_path / "killed.kvtrace"
    cmd = [
        sys.executable, "-m", "kvtrace", "record", str(MOONCAKE), "--format", "mooncake",
        "--out", str(out), "--page-size", "16", "--quiet",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    seen = 0
    deadline = time.monotonic() + 120
    try:
        while seen < 300:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "the recording made no progress"
            time.sleep(0.2)
            try:
                seen = sum(1 for _ in TraceReader(out).steps())
            except TraceError:
                continue  # not created yet
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    reader = TraceReader(out)
    checker = OpSequenceChecker(reader.meta)
    steps = list(reader.steps())
    problems = [p for s in steps for p in checker.check(s)]
    assert reader.truncated  # no end-of-stream marker: the writer never closed
    assert len(steps) >= seen
    assert [s.step for s in steps] == list(range(len(steps)))
    assert problems == []
    report = _validate(out)
    assert [p["problem"] for p in report["problems"]] == [report["truncation_detail"]]


def test_a_completed_recording_is_compacted(tmp_path: Path) -> None:
    """Recorded step by step (durable), rewritten into few large batches at the end;
    the rewrite keeps every row."""
    from traces.io import TraceReader

    durable, compact = tmp_path / "durable.kvtrace", tmp_path / "compact.kvtrace"
    code, _, output = _record([str(MOONCAKE), "--format", "mooncake", "--out", str(durable), "--compact", "0", "--duration", "30s", *SMALL])
    assert code == 0, output
    code, _, output = _record([str(MOONCAKE), "--format", "mooncake", "--out", str(compact), "--duration", "30s", *SMALL])
    assert code == 0, output
    a, b = TraceReader(durable), TraceReader(compact)
    steps_a, steps_b = list(a.steps()), list(b.steps())
    assert len(steps_a) == len(steps_b) > 10
    assert all(x.equals(y) for x, y in zip(steps_a, steps_b))
    assert b.file_bytes < a.file_bytes
    assert not (tmp_path / "compact.kvtrace.compacting").exists()
