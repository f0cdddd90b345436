"""Comments and docstrings state reasons, not measurements, and use one word per concept.

A timing quoted in a comment ("82 us a block against 243") is stale after the next change; it
belongs in bench/RESULTS.md with its command. The op-sequence checker is "the checker": "screen" is
the dashboard's word.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvtrace", "allocator", "traces", "tools")
# Derivations of model constants from published figures (vLLM's CI, SGLang's PR): the reason
# for each default's value, not a measurement of this code.
TIMING_ALLOWED = {"kvtrace/record/step_time.py"}
TIMING = re.compile(
    r"(?<![\w.])\d[\d,]*(\.\d+)? ?(ms|us|µs)\b"  # 40 ms, 0.7 us
    r"|\b\d+\.\d+ ?s\b"  # 0.068 s
    r"|[+-]\d+(\.\d+)?%"  # +4.4%
    r"|\b\d+(\.\d+)?x (faster|slower|better|smaller)\b"  # 4x better
)
CHECKER_AS_SCREEN = re.compile(r"\bscreen(ed|ing)\b|\bscreens (a|the|each|every|its|this|steps?)\b|\bwhat screens\b", re.I)


def _prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of every comment and docstring line of ``path``."""
    src = path.read_text(encoding="utf-8")
    lines = src.splitlines()
    found = {tok.start[0]: tok.string for tok in tokenize.generate_tokens(io.StringIO(src).readline)
             if tok.type == tokenize.COMMENT}
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                for n in range(first.lineno, (first.end_lineno or first.lineno) + 1):
                    found.setdefault(n, lines[n - 1])
    return sorted(found.items())


def _hits(pattern: re.Pattern[str], allowed: set[str] = frozenset()) -> list[str]:
    hits = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in allowed:
                continue
            hits += [f"{rel}:{n}: {text.strip()}" for n, text in _prose_lines(path) if pattern.search(text)]
    return hits


def test_no_timings_in_comments_or_docstrings() -> None:
    hits = _hits(TIMING, TIMING_ALLOWED)
    assert not hits, "figures belong in bench/RESULTS.md:\n" + "\n".join(hits)


def test_op_checker_is_called_checker_not_screen() -> None:
    hits = _hits(CHECKER_AS_SCREEN)
    assert not hits, "say 'checker'/'check' for the op-sequence checker:\n" + "\n".join(hits)


def test_markdown_code_fences_are_closed() -> None:
    """A fence left open turns the rest of a document into one code block."""
    open_fences = []
    for path in sorted([ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("bench/*.md")]):
        fences = [n for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if line.startswith("```")]
        if len(fences) % 2:
            open_fences.append(f"{path.relative_to(ROOT)}: {len(fences)} fences, the last at line {fences[-1]}")
    assert not open_fences, open_fences


def test_no_name_outside_the_dashboard_says_screen() -> None:
    """Outside the Textual dashboard, "screen" names nothing: the op checker's names say
    checker (``StepChecker``, ``checker=``, ``checker_fd``)."""
    found = []
    for package in ("kvtrace", "traces", "allocator"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith("kvtrace/tui/") and not rel.startswith("kvtrace/tui/remote/"):
                continue
            for tok in tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline):
                if tok.type == tokenize.NAME and "screen" in tok.string.lower():
                    found.append(f"{rel}:{tok.start[0]}: {tok.string}")
    assert not found, found
