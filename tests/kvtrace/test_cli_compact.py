"""``kvtrace compact``: an interrupted recording (an IPC stream) becomes an IPC file that
polars, pandas and DuckDB read, holding the same steps and status (kvtrace.cli.compact)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pandas as pd
import polars as pl
import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from traces.metadata import Recording
from traces.reader import TraceReader
from traces.samples import sample_path
from traces.writer import TraceWriter

runner = CliRunner()
STEPS = 90  # of the 139 of sample:tiny: the recording stopped before its end


def interrupted_stream(path: Path) -> Path:
    """sample:tiny's first STEPS steps, as a recording stopped by SIGTERM leaves them."""
    reader = TraceReader(sample_path("tiny"))
    recording = Recording(kvtrace_version="0.1.0", command="kvtrace record w.jsonl --out t.kvtrace")
    writer = TraceWriter(path, dataclasses.replace(reader.meta, recording=recording), compression="lz4")
    for batch in reader.steps(stop=STEPS):
        writer.write(batch)
    writer.close(interrupted="terminated by SIGTERM")
    return path


def replay_summary(path: Path) -> dict:
    result = runner.invoke(app, ["replay", str(path), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    return {k: v for k, v in summary.items() if k not in ("wall_s", "allocator_s", "speedup_vs_realtime", "trace")}


def test_an_interrupted_recording_compacts_in_place_for_polars_and_pandas(tmp_path: Path) -> None:
    trace = interrupted_stream(tmp_path / "run.kvtrace")
    with pytest.raises(Exception):  # noqa: B017, PT011 - polars reads IPC files only
        pl.read_ipc(trace)
    before = replay_summary(trace)
    result = runner.invoke(app, ["compact", str(trace), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["format_before"] == "stream" and report["format"] == "file"
    assert report["steps"] == STEPS and report["recording"] == "interrupted"
    reader = TraceReader(trace)
    assert reader.ipc_format == "file" and reader.recording.detail == "terminated by SIGTERM"
    frame = pl.read_ipc(trace)
    assert frame["step"].n_unique() == STEPS
    assert len(pd.read_feather(trace)) == frame.height
    assert replay_summary(trace) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.kvtrace"]


def test_compact_out_leaves_the_stream_and_needs_force_to_replace(tmp_path: Path) -> None:
    trace = interrupted_stream(tmp_path / "run.kvtrace")
    stream = trace.read_bytes()
    out = tmp_path / "compact.kvtrace"
    out.write_bytes(b"keep")
    refused = runner.invoke(app, ["compact", str(trace), "--out", str(out)])
    assert refused.exit_code == 2 and "already exists; pass --force" in refused.stderr
    assert out.read_bytes() == b"keep"
    done = runner.invoke(app, ["compact", str(trace), "--out", str(out), "--force"])
    assert done.exit_code == 0, done.output
    assert trace.read_bytes() == stream and pl.read_ipc(out)["step"].n_unique() == STEPS
    sample = runner.invoke(app, ["compact", "sample:tiny"])
    assert sample.exit_code == 2 and "is a bundled sample" in sample.stderr
