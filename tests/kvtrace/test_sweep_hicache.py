"""``kvtrace sweep --hicache-ratio / --hicache-write-policy``: HiCache's host tier as
axes of the grid (0: no tier), the report's reuse split by tier, and its plot against
the host pool."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.sweep.grid import Cell, Grid, SweepInput
from kvtrace.sweep.report import hicache_lines, report_rows

runner = CliRunner()
_INPUT = SweepInput("sample:tiny", "p", "trace", "replay", "1-2")


def test_ratio_zero_is_one_cell_whatever_the_write_policies() -> None:
    cells = Grid(inputs=(_INPUT,), hicache_ratios=(0.0, 2.0), hicache_write_policies=("write_through", "write_back")).cells()
    assert [(c.hicache_ratio, c.hicache_write_policy) for c in cells] == [
        (0.0, None), (2.0, "write_through"), (2.0, "write_back"),
    ]
    assert len({c.key for c in cells}) == 3
    # A cell without the axes keeps the key it had before them (a resumed sweep reruns nothing).
    assert Cell(_INPUT, pool_tokens=2048).key == "ca4938fb39e1699e7e18"


def _raw(ratio: float, policy: str | None, split: tuple[int, int, int] | None) -> dict:
    row = {"cell": str(ratio), "input": "t", "kind": "replay", "status": "ok", "pool_tokens": 100,
           "param.hicache_ratio": ratio, "param.hicache_write_policy": policy}
    if split is None:
        row["prefix_hit_rate"] = 0.25
    else:
        device, host, miss = split
        row |= {"prefix_hit_rate": (device + host) / sum(split), "hicache.host_pool_tokens": int(100 * ratio),
                "hicache.write_policy": policy, "hicache.prefix_tokens.device": device,
                "hicache.prefix_tokens.host": host, "hicache.prefix_tokens.miss": miss}
    return row


def test_report_splits_reuse_by_tier_and_lines_start_at_no_tier() -> None:
    import pyarrow as pa

    raws = [_raw(0.0, None, None), _raw(1.0, "write_through", (25, 25, 50)), _raw(1.0, "write_back", (25, 15, 60))]
    names = {k for r in raws for k in r}
    table = pa.Table.from_pylist([{k: r.get(k) for k in sorted(names)} for r in raws])
    rows = report_rows(table)
    assert [(r["device_hit_rate"], r["host_hit_rate"], r["miss_rate"]) for r in rows] == [
        (0.25, 0.0, 0.75), (0.25, 0.25, 0.5), (0.25, 0.15, 0.6),
    ]
    assert [r["host_pool_tokens"] for r in rows] == [0, 100, 100]
    lines = hicache_lines(rows)
    # the cell with no tier is the first point of each write policy's line
    assert {k: [r["host_pool_tokens"] for r in v] for k, v in lines.items()} == {
        "write_back": [0, 100], "write_through": [0, 100],
    }


def test_sweep_over_host_ratios_table_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "r.parquet"
    res = runner.invoke(app, ["sweep", "run", "sample:mooncake-tiny", "--hicache-ratio", "0,2", "-o", str(out), "-j", "1"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["sweep", "report", str(out), "--plots", str(tmp_path / "p"), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    rows = report["rows"]
    assert [(r["hicache_ratio"], r["host_pool_tokens"] > 0) for r in rows] == [(0.0, False), (2.0, True)]
    for r in rows:
        assert abs(r["device_hit_rate"] + r["host_hit_rate"] - r["prefix_hit_rate"]) < 1e-6
    assert sorted(Path(p).name for p in report["plots"]) == ["mooncake-tiny-hicache.png", "mooncake-tiny.png"]
    res = runner.invoke(app, ["sweep", "report", str(out), "--no-plots"], env={"COLUMNS": "400"})
    assert "host hit" in res.stdout and "device hit" in res.stdout


def test_sweep_bad_host_ratio_or_policy_exits_2(tmp_path: Path) -> None:
    res = runner.invoke(app, ["sweep", "run", "sample:tiny", "--hicache-ratio", "1,-1", "-o", str(tmp_path / "r.parquet")])
    assert res.exit_code == 2 and "0: no host tier" in res.output
    res = runner.invoke(app, ["sweep", "run", "sample:tiny", "--hicache-write-policy", "write_around",
                              "-o", str(tmp_path / "r.parquet")])
    assert res.exit_code == 2 and "write_through" in res.output
