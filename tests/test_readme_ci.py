"""The README's quick-start commands are exactly what CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def quick_start_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    return [line for block in blocks for line in block.strip().splitlines() if line.strip()]


def test_readme_quick_start_is_what_ci_runs() -> None:
    commands = quick_start_commands()
    assert len(commands) == 2, commands
    assert commands[0].startswith("python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e '.[dev]'")
    assert commands[1] == ".venv/bin/python -m pytest -q"
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    for command in commands:
        assert command in ci_lines, f"README command not run verbatim by .ci/run: {command}"
    executable = [ln for ln in ci_lines if ln and not ln.startswith("#")]
    assert executable[0] == "set -euo pipefail"  # a failing command (or no tests: exit 5) fails CI
    assert executable[-1] == commands[1]
    # between the install and the tests, only the import contracts (lint-imports) run
    assert executable[executable.index(commands[0]) + 1 : -1] == [".venv/bin/lint-imports --no-cache"]


def test_the_main_job_names_a_bundled_file() -> None:
    main_job = quick_start_commands()[0].split("&&")[-1].split()
    assert main_job[0] == ".venv/bin/kvtrace"
    assert (ROOT / main_job[-1]).is_file(), main_job
