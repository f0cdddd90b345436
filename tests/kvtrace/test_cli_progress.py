"""Every long command shows its progress as the one ``ui.progress`` line: drawn on a
terminal's stderr and erased, never on stdout, and nothing at all with --json."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers import run_with_terminal_stderr

DATA = Path(__file__).resolve().parents[2] / "traces" / "workloads_data"
AZURE = DATA / "azure-llm-inference-2023" / "AzureLLMInferenceTrace_code.csv"


def _commands(tmp: Path) -> dict[str, tuple[list[str], str]]:
    """Each command, and words that only its progress line draws on stderr."""
    return {
        "replay": (["replay", "sample:tiny"], "replay"),
        "record": (["record", str(AZURE), "--duration", "20s", "--out", str(tmp / "r.kvtrace"), "--page-size", "16"],
                   "recording"),
        "export": (["export", "sample:mooncake-tiny", "--out", str(tmp / "e.pftrace")], "exporting"),
        "sweep": (["sweep", "sample:tiny", "--pool-tokens", "30k,45k", "-j", "1", "--out", str(tmp / "s.parquet")],
                  " eta "),
    }


def test_a_progress_line_redraws_at_most_once_a_period_and_is_silent_where_not_shown() -> None:
    import io

    from rich.console import Console
    from rich.progress import Progress

    from kvtrace.cli import ui

    silent = ui.ProgressLine()
    assert not silent.due()
    silent(5, "x")  # nothing to draw on: no error
    live = Progress(console=Console(file=io.StringIO(), force_terminal=True), auto_refresh=False)
    task = live.add_task("t", total=None, info="")
    line = ui.ProgressLine(live, task)
    assert line.due() and not line.due()  # a redraw restarts the period
    line.show(3, "three", total=10)
    assert (live.tasks[0].completed, live.tasks[0].total, live.tasks[0].fields["info"]) == (3, 10, "three")
    line(7, "seven")  # within the period: not redrawn
    assert live.tasks[0].completed == 3


@pytest.mark.slow
@pytest.mark.parametrize("name", ["replay", "record", "export", "sweep"])
def test_progress_is_drawn_on_a_terminal_and_absent_with_json(tmp_path: Path, name: str) -> None:
    args, words = _commands(tmp_path)[name]
    command = [sys.executable, "-m", "kvtrace", *args]
    code, out, drawn = run_with_terminal_stderr(command)
    assert code == 0, drawn
    assert words in drawn, drawn
    assert "\x1b" not in out
    for path in tmp_path.iterdir():
        path.unlink()
    code, out, drawn = run_with_terminal_stderr([*command, "--json"])
    assert code == 0, drawn
    assert words not in drawn, drawn
