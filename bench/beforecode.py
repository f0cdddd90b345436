"""The code a benchmark compares this tree with: an extracted tree, or a revision checked out
into a temporary git worktree (removed afterwards). Shared by bench/check.py and
bench/replay_speed.py."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def code_at(rev: str | None, tree: Path | None) -> Iterator[Path | None]:
    """The code to compare with: ``tree`` (checked to hold a kvtrace package), or ``rev``
    checked out into a temporary git worktree, or None when neither is given."""
    if tree is not None:
        if not (tree / "kvtrace" / "__main__.py").is_file():
            raise SystemExit(f"--before-tree {tree}: no kvtrace package there (git archive REV allocator "
                             "kvtrace traces pyproject.toml | tar -x -C DIR)")
        yield tree.resolve()
        return
    if rev is None:
        yield None
        return
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp) / "before"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(where), rev], cwd=ROOT, check=True)
        try:
            yield where
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(where)], cwd=ROOT, check=False)
