"""kvtrace sweep on hybrid (SWA) traces: the sliding window and the SWA/full pool ratio
are axes, each cell replays with its own (the numbers of a replay of that layout), the
results carry both pools, and a full-attention input refuses the axes (one line, exit 2)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.replay.session import ReplaySession, open_trace
from kvtrace.sweep import Grid, SweepInput, parse_ratios
from kvtrace.sweep.cells import run_cell
from traces.samples import resolve_trace

runner = CliRunner()
SWA = "sample:mooncake-gpt-oss"  # window 128, SWA pool 48,000 of 60,000 (ratio 0.8), page 16


def _input(label: str) -> SweepInput:
    return SweepInput(label, str(resolve_trace(label)), "trace", "replay")


def test_the_swa_axes_make_cells_and_leave_other_cells_as_they_were() -> None:
    grid = Grid(inputs=(_input(SWA),), swa_windows=(128, 512), swa_ratios=(0.5, 0.8))
    cells = grid.cells()
    assert [(c.swa_window, c.swa_full_tokens_ratio) for c in cells] == [(128, 0.5), (128, 0.8), (512, 0.5), (512, 0.8)]
    assert cells[1].params()["param.swa_window"] == 128 and cells[1].params()["param.swa_full_tokens_ratio"] == 0.8
    assert len({c.key for c in cells}) == 4
    plain = Grid(inputs=(_input(SWA),)).cells()[0]
    assert not any("swa" in k for k in plain.params())  # a sweep without the axes keeps its cell keys


def test_a_cell_replays_with_its_window_and_pool_ratio() -> None:
    """Each cell's numbers are those of a replay of the trace with that layout."""
    row = run_cell(Grid(inputs=(_input(SWA),), swa_windows=(512,), swa_ratios=(0.7,)).cells()[0])
    assert row["status"] == "ok", row
    assert row["pools.swa.pool_tokens"] == 42_000 and row["pools.full.pool_tokens"] == 60_000
    reader = open_trace(SWA)
    layout = dataclasses.replace(reader.meta.attention, sliding_window=512, swa_full_tokens_ratio=0.7, swa_pool_tokens=42_000)
    reader.meta = dataclasses.replace(reader.meta, attention=layout)
    with ReplaySession(reader, checker="inline") as alone:
        expected = alone.run().to_dict()["pools"]["swa"]
    assert row["pools.swa.peak_used_tokens"] == expected["peak_used_tokens"]
    recorded = run_cell(Grid(inputs=(_input(SWA),)).cells()[0])
    assert row["pools.swa.peak_used_tokens"] != recorded["pools.swa.peak_used_tokens"]  # a wider window holds more


def test_a_full_attention_trace_refuses_the_swa_axes_in_one_line(tmp_path: Path) -> None:
    for option, value in (("--swa-window", "64,128"), ("--swa-full-tokens-ratio", "0.5")):
        result = runner.invoke(app, ["sweep", "sample:tiny", option, value, "-o", str(tmp_path / "r.parquet")])
        assert result.exit_code == 2, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and option in lines[0] and "sample:tiny is a full-attention trace" in lines[0]
    assert not (tmp_path / "r.parquet").exists()


@pytest.mark.parametrize("text", ["0", "1.5", "x", "0.5,0.5"])
def test_bad_ratios_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="--swa-full-tokens-ratio"):
        parse_ratios(text, "--swa-full-tokens-ratio")


def test_the_sweep_table_and_json_report_both_pools(tmp_path: Path) -> None:
    out = tmp_path / "r.parquet"
    result = runner.invoke(app, ["sweep", SWA, "--swa-window", "128,512", "-j", "1", "-o", str(out), "-q"])
    assert result.exit_code == 0, result.output
    report = runner.invoke(app, ["sweep", "report", str(out), "--no-plots", "--json"])
    rows = json.loads(report.stdout)["rows"]
    assert [(r["swa_window"], r["swa_pool_tokens"]) for r in rows] == [(128, 48_000), (512, 48_000)]
    assert rows[0]["swa_peak_occupancy"] < rows[1]["swa_peak_occupancy"]
    table = runner.invoke(app, ["sweep", "report", str(out), "--no-plots", "--no-color"], terminal_width=250)
    assert table.exit_code == 0 and "SWA pool" in table.stdout and "window" in table.stdout
