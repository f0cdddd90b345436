"""The package layout: a few modules directly in ``kvtrace/``, light package ``__init__``s,
and the names written into files unchanged by the moves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvtrace.replay", "kvtrace.statelog", "kvtrace.versions", "kvtrace.diff", "kvtrace.proc",
            "kvtrace.record", "kvtrace.tui.remote", "allocator.check", "kvtrace.explain")


def test_kvtrace_holds_packages_and_a_few_modules() -> None:
    modules = sorted(p.name for p in (ROOT / "kvtrace").glob("*.py"))
    assert len(modules) <= 10, modules
    for package in PACKAGES:
        assert (ROOT / package.replace(".", "/") / "__init__.py").is_file(), package


def test_importing_a_package_imports_none_of_its_modules() -> None:
    # An __init__ that pulled its modules in would load torch and pyarrow wherever a
    # light module of the package is imported (the CLI's start-up).
    code = (
        "import sys, importlib\n"
        f"for name in {PACKAGES!r}:\n"
        "    importlib.import_module(name)\n"
        f"loaded = sorted(m for m in sys.modules if m.startswith({PACKAGES!r}) and m not in {PACKAGES!r})\n"
        "heavy = sorted({'torch', 'numpy', 'pyarrow', 'textual'} & set(sys.modules))\n"
        "print(loaded, heavy)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[] []", proc.stdout


def test_the_recorder_keeps_its_import() -> None:
    from kvtrace.record import Recorder
    from kvtrace.record.recorder import Recorder as Defined

    assert Recorder is Defined


def test_names_written_into_files_are_not_module_paths_that_moved(tmp_path: Path) -> None:
    # A state log's schema key and a simulated trace's recorder name are data: files
    # written before the moves carry them, so they stay what they were.
    from kvtrace.statelog.format import STATE_LOG_METADATA_KEY
    from traces.reader import TraceReader

    assert STATE_LOG_METADATA_KEY == b"kvtrace.statelog"
    out = tmp_path / "rec.kvtrace"
    proc = subprocess.run([sys.executable, "-m", "kvtrace", "record", "sample:tiny", "--duration", "5s", "--out", str(out),
                           "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert TraceReader(out).meta.extra["recorder"] == "kvtrace.scheduler"


MAX_MODULE_LINES = 600
# The sentence a longer module's docstring starts its justification with.
ONE_CONCEPT = "One concept, read top to bottom:"


def _one_concept_reason(docstring: str | None) -> str:
    """What follows the marker on its docstring line ("" when there is no such line)."""
    for line in (docstring or "").splitlines():
        if line.strip().startswith(ONE_CONCEPT):
            return line.strip().removeprefix(ONE_CONCEPT).strip()
    return ""


def test_modules_are_short_or_say_why_not() -> None:
    # Issue #34: a module over the limit is one concept that reads top to bottom, and its
    # docstring says which and why; anything else is split by concept.
    import ast

    too_long = []
    for package in ("traces", "kvtrace"):
        for path in sorted((ROOT / package).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            text = path.read_text(encoding="utf-8")
            if len(text.splitlines()) <= MAX_MODULE_LINES:
                continue
            if not _one_concept_reason(ast.get_docstring(ast.parse(text))):
                too_long.append(f"{name} ({len(text.splitlines())} lines)")
    assert too_long == [], f"over {MAX_MODULE_LINES} lines without '{ONE_CONCEPT} ...' in the docstring: {too_long}"


def test_the_one_concept_marker_is_read_from_the_docstring_only() -> None:
    assert _one_concept_reason(f'x\n\n{ONE_CONCEPT} the checker and its rules.\n') == "the checker and its rules."
    assert _one_concept_reason(f"x\n\n  {ONE_CONCEPT}\n") == ""  # a marker without a reason
    assert _one_concept_reason("One concept: the checker.") == ""
    assert _one_concept_reason(None) == ""
