"""Every name a benchmark script imports from this project exists where it imports it
from: a benchmark is run by hand, so a moved name would otherwise be found only then."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OURS = ("kvtrace", "allocator", "traces", "tests")


def test_every_benchmark_import_resolves() -> None:
    missing = []
    scripts = sorted((ROOT / "bench").glob("*.py"))
    assert scripts
    for script in scripts:
        for node in ast.walk(ast.parse(script.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.split(".")[0] in OURS:
                module = importlib.import_module(node.module)
                is_package = hasattr(module, "__path__")
                missing += [f"{script.name}: {node.module}.{a.name}" for a in node.names if not hasattr(module, a.name)
                            and not (is_package and importlib.util.find_spec(f"{node.module}.{a.name}"))]
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in OURS and importlib.util.find_spec(alias.name) is None:
                        missing.append(f"{script.name}: {alias.name}")
    assert not missing, missing
