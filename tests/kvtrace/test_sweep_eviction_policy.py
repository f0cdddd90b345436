"""``kvtrace sweep --eviction-policy``: an axis of the grid, each cell runs its policy
(simulated cells schedule under it), the report shows it, a bad name exits 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.sweep.grid import Cell, Grid, SweepInput

runner = CliRunner()
_INPUT = SweepInput("sample:tiny", "p", "trace", "replay", "1-2")


def test_policy_axis_multiplies_cells_and_keeps_old_keys() -> None:
    cells = Grid(inputs=(_INPUT,), pool_tokens=(1024, 2048), eviction_policies=("lru", "lfu")).cells()
    assert [(c.pool_tokens, c.eviction_policy) for c in cells] == [
        (1024, "lru"), (1024, "lfu"), (2048, "lru"), (2048, "lfu"),
    ]
    assert len({c.key for c in cells}) == 4
    # A cell without a policy keeps the key it had before the axis existed, so a
    # sweep resumed after the upgrade does not run its finished cells again.
    assert Cell(_INPUT, pool_tokens=2048).key == "ca4938fb39e1699e7e18"


@pytest.mark.slow
def test_sweep_runs_each_policy(tmp_path: Path) -> None:
    out = tmp_path / "r.parquet"
    res = runner.invoke(app, ["sweep", "run", "sample:tiny", "--reschedule", "--pool-tokens", "2048",
                              "--page-size", "1", "--eviction-policy", "lru,mru", "-o", str(out), "-j", "1"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["sweep", "report", str(out), "--no-plots", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)["rows"]
    assert [r["eviction_policy"] for r in rows] == ["lru", "mru"]
    # MRU keeps the oldest prefixes and drops the newest: another hit rate on this workload.
    assert rows[0]["prefix_hit_rate"] != rows[1]["prefix_hit_rate"]
    res = runner.invoke(app, ["sweep", "report", str(out), "--no-plots"])
    assert "eviction" in res.stdout and "mru" in res.stdout


def test_sweep_bad_policy_exits_2(tmp_path: Path) -> None:
    res = runner.invoke(app, ["sweep", "run", "sample:tiny", "--eviction-policy", "lru,lifo", "-o",
                              str(tmp_path / "r.parquet")])
    assert res.exit_code == 2
    assert "valid: lru, lfu, fifo, mru, filo, priority, slru" in res.output
