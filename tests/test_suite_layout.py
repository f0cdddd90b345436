"""How the test suite is organised: plain helpers in ``tests/helpers.py`` (never imported from a
``conftest.py``), and a fast tier (``pytest -m 'not slow'``) that still tests every module.

Read from the sources (``ast``), so these checks cost no collection of the suite.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# Test modules marked ``slow`` as a whole: each test in them runs SGLang, a browser, a terminal or
# commits of the git history, so none could stand for the module in the fast tier.
ALL_SLOW = {
    "differential/test_sglang_live.py",
    "kvtrace/test_history.py",
    "tui/test_browser.py",
    "tui/test_terminal.py",
}


def _rel(path: Path) -> str:
    return path.relative_to(TESTS).as_posix()


def _test_files() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def _is_slow_mark(node: ast.expr) -> bool:
    """Whether ``node`` is ``pytest.mark.slow`` (or a list/tuple holding it)."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return any(_is_slow_mark(n) for n in node.elts)
    return isinstance(node, ast.Attribute) and node.attr == "slow" and ast.unparse(node.value).endswith("mark")


def _module_slow(tree: ast.Module) -> bool:
    return any(
        isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
        and _is_slow_mark(node.value)
        for node in tree.body
    )


def _tests(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """The module's test functions, and those of its ``Test*`` classes."""
    found = []
    for node in tree.body:
        body = node.body if isinstance(node, ast.ClassDef) and node.name.startswith("Test") else [node]
        found += [f for f in body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name.startswith("test")]
    return found


def test_no_module_imports_a_conftest() -> None:
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [alias.name for alias in node.names]
            if any(name.split(".")[-1] == "conftest" for name in names):
                offenders.append(f"{_rel(path)}:{node.lineno}")
    assert not offenders, f"import helpers from tests.helpers, not from a conftest: {offenders}"


def test_every_test_module_keeps_fast_tests() -> None:
    hollow, unlisted = [], []
    for path in _test_files():
        tree = ast.parse(path.read_text())
        if _module_slow(tree):
            if _rel(path) not in ALL_SLOW:
                unlisted.append(_rel(path))
        elif not any(not any(_is_slow_mark(d) for d in f.decorator_list) for f in _tests(tree)):
            hollow.append(_rel(path))
    assert not unlisted, f"marked slow as a whole but not in ALL_SLOW: {unlisted}"
    assert not hollow, f"every test is marked slow (mark the module instead, if it must be): {hollow}"


def test_the_inherently_slow_modules_are_marked_slow() -> None:
    for rel in sorted(ALL_SLOW):
        assert _module_slow(ast.parse((TESTS / rel).read_text())), f"{rel}: no pytestmark = pytest.mark.slow"
