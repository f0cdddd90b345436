"""Streaming sessions are modelled for full-attention pools only: a session trace asked
to replay with a host tier (HiCache, the trace's or ``--hicache-ratio``), sliding-window
or Mamba layers, or HiSparse is refused in one line, exit 2, by every command that
replays it (replay, diff), as ``record --sessions`` refuses such a recording."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.record.recorder import Recorder
from tests.helpers import make_meta
from traces.hicache_layout import HostTier
from traces.metadata import TraceMeta
from traces.reader import TraceReader
from traces.samples import resolve_trace

runner = CliRunner()
_UNSERVED = "this trace has streaming sessions, which are modelled for full-attention pools only, not with "
_INFO = "(kvtrace info shows the trace's configuration)"


def _session_trace(path: Path, meta: TraceMeta) -> Path:
    """One session of one turn: extended, held, closed."""
    with Recorder(path, dataclasses.replace(meta, config=dataclasses.replace(meta.config, sessions=True)),
                  overwrite=True) as rec:  # fmt: skip
        rec.begin_step(0.0)
        rec.extend([0], [8], prompt_lens=[8])
        rec.end_step()
        rec.begin_step(0.1)
        rec.hold([0])
        rec.end_step()
        rec.begin_step(0.2)
        rec.close_session([0])
        rec.end_step()
    return path


def _sample_meta(name: str) -> TraceMeta:
    return TraceReader(resolve_trace(f"sample:{name}")).meta


def _one_line_refusal(args: list[str]) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def test_a_host_tier_what_if_is_refused(tmp_path: Path) -> None:
    trace = _session_trace(tmp_path / "s.kvtrace", make_meta())
    assert runner.invoke(app, ["replay", str(trace), "--quiet"]).exit_code == 0
    line = _one_line_refusal(["replay", str(trace), "--hicache-ratio", "2"])
    assert line == f"kvtrace: error: {_UNSERVED}HiCache's host tier (drop --hicache-ratio and --hicache-write-policy)"


@pytest.mark.parametrize(
    ("meta", "what"),
    [
        (lambda: make_meta(hicache=HostTier(host_pool_tokens=8192)), "HiCache's host tier"),
        (lambda: make_meta(hisparse=True, radix_cache=False), "HiSparse"),
        (lambda: _sample_meta("mooncake-gemma-3"), "sliding-window layers"),
        (lambda: _sample_meta("mooncake-qwen3-next"), "Mamba layers"),
    ],
    ids=["hicache", "hisparse", "swa", "mamba"],
)
@pytest.mark.parametrize("command", ["replay", "diff"])
def test_a_session_trace_on_pools_sessions_are_not_modelled_for_is_refused(
    tmp_path: Path, meta: object, what: str, command: str
) -> None:
    trace = _session_trace(tmp_path / "s.kvtrace", meta())  # type: ignore[operator]
    args = ["replay", str(trace)] if command == "replay" else ["diff", str(trace), "--a", "builtin", "--b", "builtin"]
    assert _one_line_refusal(args) == f"kvtrace: error: {_UNSERVED}{what} {_INFO}"


def test_record_refuses_sessions_with_a_host_tier(tmp_path: Path) -> None:
    workload = tmp_path / "w.jsonl"
    workload.write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}\n')
    line = _one_line_refusal([
        "record", str(workload), "--format", "mooncake", "--out", str(tmp_path / "r.kvtrace"), "--sessions",
        "--hicache-ratio", "2",
    ])  # fmt: skip
    assert line == "kvtrace: error: streaming sessions are modelled for full-attention pools only, not with HiCache's host tier"
    assert not (tmp_path / "r.kvtrace").exists()
