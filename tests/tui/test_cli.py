"""The dashboard's command-line options: bad combinations are one line and exit 2; the
served command is the same command without the serving options."""

from __future__ import annotations

import sys

import pytest
from typer.testing import CliRunner

from kvtrace.cli import app, optional_value
from kvtrace.tui.run import serve_command

runner = CliRunner()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["replay", "sample:tiny", "--serve"], "serving is for the dashboard; add --tui"),
        (["replay", "sample:tiny", "--serve", "9000"], "serving is for the dashboard; add --tui"),
        (["replay", "sample:tiny", "--tui", "--json"], "the dashboard prints no JSON"),
        (["replay", "sample:tiny", "--host", "0.0.0.0"], "--host is where --serve listens"),
        (["replay", "sample:tiny", "--tui", "--serve", "70000"], "'--serve': 70000 is not in the range 1<=x<=65535"),
        (["view", "/nonexistent/run.log"], "state log /nonexistent/run.log: no such file"),
        (["view", "/nonexistent/run.log", "--host", "0.0.0.0"], "--host is where --serve listens"),
        (["replay", "sample:nosuch", "--tui"], "sample"),
    ],
)
def test_bad_dashboard_options_are_one_line(args: list[str], message: str) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0], result.output


def test_serve_takes_an_optional_port() -> None:
    assert optional_value(["replay", "t", "--serve"], "--serve", "8000") == ["replay", "t", "--serve", "8000"]
    assert optional_value(["replay", "--serve", "t"], "--serve", "8000") == ["replay", "--serve", "8000", "t"]
    assert optional_value(["replay", "--serve", "9000"], "--serve", "8000") == ["replay", "--serve", "9000"]


def test_the_served_command_is_the_dashboard_without_serving_options() -> None:
    cmd = serve_command(["replay", "my trace.kvtrace", "--tui", "--serve", "9000", "--host", "0.0.0.0", "--pool-tokens", "4096"])
    assert cmd == f"{sys.executable} -m kvtrace replay 'my trace.kvtrace' --tui --pool-tokens 4096"
    assert serve_command(["view", "run.log", "--serve"]).endswith("-m kvtrace view run.log")
