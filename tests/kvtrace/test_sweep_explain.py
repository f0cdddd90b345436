"""Sweep cells with ``--explain``: the oracle gaps and the causes as ``explain.*`` columns."""

from __future__ import annotations

import json

from kvtrace.sweep import SweepInput, SweepSettings
from kvtrace.sweep.cells import run_cell
from kvtrace.sweep.grid import Cell
from traces.samples import resolve_trace


def _cell(**settings: object) -> Cell:
    label = "sample:tiny"
    return Cell(SweepInput(label, str(resolve_trace(label)), "trace", "replay"), settings=SweepSettings(**settings))


def test_an_explained_cell_reports_the_oracle_gaps_and_the_causes() -> None:
    row = run_cell(_cell(explain=True))
    assert row["status"] == "ok", row
    lru, belady = row["explain.hit_rates.lru"], row["explain.hit_rates.model.belady"]
    assert 0 <= row["explain.hit_rates.model.lru"] <= belady <= row["explain.hit_rates.model.infinite"] <= 1
    assert lru <= row["explain.hit_rates.infinite"]
    causes = {k.removeprefix("explain.causes."): v for k, v in row.items() if k.startswith("explain.causes.")}
    assert sum(causes.values()) == row["explain.missed_tokens"] > 0
    assert lru == row["prefix_hit_rate"]


def test_explain_changes_no_other_sweeps_cell_keys() -> None:
    plain, explained = _cell(), _cell(explain=True)
    assert "explain" not in plain.settings.fingerprint()
    assert plain.key != explained.key
    assert json.loads(json.dumps(explained.settings.fingerprint()))["explain"] is True


def test_sweep_run_takes_explain() -> None:
    from typer.testing import CliRunner

    from kvtrace.cli import app

    result = CliRunner().invoke(app, ["sweep", "run", "--help"], env={"COLUMNS": "250"})
    assert result.exit_code == 0 and "--explain" in result.stdout
