"""The import contracts of ``pyproject.toml`` (``lint-imports``, run by ``.ci/run``): they
hold on this tree, and an import that breaks one fails them.

Each breaking case plants one import in a copy of the three packages and runs the real
``lint-imports`` there with that copy first on ``sys.path``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
PACKAGES = ("traces", "allocator", "kvtrace")


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120)


def copy_tree(dest: Path) -> Path:
    """The packages' Python files and ``pyproject.toml``, copied under ``dest``."""
    for package in PACKAGES:
        skip = shutil.ignore_patterns("__pycache__", "*.kvtrace", "workloads_data")
        shutil.copytree(ROOT / package, dest / package, ignore=skip)
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def test_the_tree_keeps_every_contract() -> None:
    proc = lint_imports(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


@pytest.mark.parametrize(
    ("module", "planted", "contract"),
    [
        # the trace format imports the allocator above it
        ("traces/schema.py", "import allocator.manager", "Layers"),
        # kvtrace's core imports the CLI on top of it
        ("kvtrace/replay/report.py", "import kvtrace.cli.replay", "Layers"),
        # the dashboard's replay process imports Textual (through nothing else)
        ("kvtrace/tui/remote/updates.py", "import textual.app", "never imports Textual"),
        # the replay's engine imports its session back: a cycle inside kvtrace.replay
        ("kvtrace/replay/engine.py", "import kvtrace.replay.session", "No import cycles"),
    ],
)
def test_a_planted_import_breaks_its_contract(tmp_path: Path, module: str, planted: str, contract: str) -> None:
    tree = copy_tree(tmp_path)
    assert lint_imports(tree).returncode == 0  # the copy holds before the plant
    path = tree / module
    path.write_text(path.read_text() + f"\n{planted}  # planted\n")
    proc = lint_imports(tree)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    broken = proc.stdout.split("Broken contracts", 1)[1]
    assert contract in broken, proc.stdout
