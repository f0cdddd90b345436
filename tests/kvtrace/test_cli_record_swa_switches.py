"""``kvtrace record --draft-swa-window N`` and ``--release-prefill-swa`` on a sliding-window
model: stored in the trace's attention layout (each only when set), read back by the
replay's allocator (so ``replay`` and ``diff`` run with them), kept by ``--like``, and
refused on a full-attention model in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.replay.config import allocator_config_for
from kvtrace.replay.session import ReplaySession
from traces.reader import TraceReader

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def _record(out: Path, *args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["record", "sample:tiny", "-o", str(out), "-q", *args])
    return result.exit_code, result.stderr


def test_the_switches_go_into_the_trace_and_the_replays_allocator(tmp_path: Path) -> None:
    trace = tmp_path / "switches.kvtrace"
    code, err = _record(trace, "--model", "gpt-oss-20b", "--draft-swa-window", "200", "--release-prefill-swa")
    assert code == 0, err
    meta = TraceReader(trace).meta
    assert meta.attention is not None
    assert meta.attention.draft_sliding_window == 200 and meta.attention.release_prefill_swa
    with ReplaySession(trace) as s:
        swa = s.config.swa
        assert swa is not None and swa.draft_window == 200 and swa.release_prefill_swa and swa.retain_window == 200
        s.run()
    # --like takes them with the rest of the serving configuration; a switch given overrides
    like = tmp_path / "like.kvtrace"
    code, err = _record(like, "--like", str(trace), "--no-release-prefill-swa")
    assert code == 0, err
    layout = TraceReader(like).meta.attention
    assert layout is not None and layout.draft_sliding_window == 200 and not layout.release_prefill_swa


def test_a_switch_off_is_not_written(tmp_path: Path) -> None:
    trace = tmp_path / "plain.kvtrace"
    code, err = _record(trace, "--model", "gpt-oss-20b")
    assert code == 0, err
    meta = TraceReader(trace).meta
    stored = meta.to_dict()["attention"]
    assert "release_prefill_swa" not in stored and "draft_sliding_window" not in stored
    swa = allocator_config_for(meta).swa
    assert swa is not None and not swa.release_prefill_swa and swa.draft_window == 0


@pytest.mark.parametrize("switch", [["--release-prefill-swa"], ["--draft-swa-window", "64"]], ids=["release", "draft"])
def test_a_switch_on_a_full_attention_model_is_refused_in_one_line(tmp_path: Path, switch: list[str]) -> None:
    out = tmp_path / "full.kvtrace"
    code, err = _record(out, *switch)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and switch[0] in lines[0] and "full attention" in lines[0], err
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        # EAGLE with a fused draft's window past the model's (radix cache off)
        ["--spec", "eagle:3,1,4", "--draft-swa-window", "256", "--no-radix-cache"],
        # the early SWA lock release lives in the radix tree
        ["--release-prefill-swa"],
    ],
    ids=["draft-window", "release-prefill-swa"],
)
def test_sglang_parity_on_a_trace_recorded_with_the_switch(tmp_path: Path, args: list[str]) -> None:
    """``diff --a sglang --b builtin --exact`` on a gpt-oss trace recorded with the switch."""
    python = os.environ.get("KVTRACE_SGLANG_PYTHON")
    if not python:
        pytest.skip("KVTRACE_SGLANG_PYTHON names no SGLang 0.5.23 interpreter")
    trace = tmp_path / "switch.kvtrace"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    workload = ROOT / "traces/workloads_data/mooncake-fast25/conversation_trace.jsonl"
    subprocess.run(
        [sys.executable, "-m", "kvtrace", "record", str(workload), "--duration", "4s", "--model", "gpt-oss-20b",
         "--page-size", "16", "--pool-tokens", "30000", *args, "-o", str(trace), "-q"],
        check=True, capture_output=True, env=env, cwd=ROOT,
    )  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "kvtrace", "diff", str(trace), "--a", f"sglang:{python}", "--b", "builtin", "--exact", "-q"],
        capture_output=True, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
