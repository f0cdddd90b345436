"""A series of commits to verify one by one (``kvtrace diff TRACE... --range BASE..HEAD``).

``read_series`` lists the commits on the first-parent path from BASE (excluded) to
HEAD, oldest first (``git log --first-parent --ancestry-path``: HEAD's first-parent chain
down to BASE; when BASE came in through a merge, down to that merge, so that every commit
listed descends from BASE): each with its subject, the tree of its ``allocator`` package (what
a replay of that commit runs, so what its cached results are keyed by) and whether
its first-parent diff touches the watched paths (``--path``; the others are skipped).

``allocator_checkout`` extracts one ``allocator`` tree (``git archive``: the package
only, not a whole working tree) into the kvtrace cache directory, once: every commit
with that tree, and every later run, reuses it. A checkout in use holds a shared lock,
so ``prune_checkouts`` never removes it from under a replay.
"""

from __future__ import annotations

import fcntl
import io
import os
import secrets
import shutil
import subprocess
import tarfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvtrace.errors import ConfigError
from kvtrace.versions.git import cache_dir, commit_of, current_repository, run_git

__all__ = ["ALLOCATOR_PACKAGE", "Commit", "Series", "allocator_checkout", "parse_range", "prune_checkouts", "read_series"]

ALLOCATOR_PACKAGE = "allocator"
TREES_KEEP = 64  # extracted allocator trees kept (least recently used removed first)
SHORT = 10  # digits of a short commit hash in reports


@dataclass(frozen=True, slots=True)
class Commit:
    """One commit of a series.

    ``allocator_tree``: the object id of its ``allocator`` package (None when it has
    none); ``touches``: whether its diff against its first parent touches a watched path.
    """

    commit: str
    subject: str
    allocator_tree: str | None
    touches: bool

    @property
    def short(self) -> str:
        return self.commit[:SHORT]


@dataclass(frozen=True, slots=True)
class Series:
    """The commits of ``BASE..HEAD`` on the first-parent path, oldest first (BASE excluded)."""

    repo: Path
    spec: str
    base: Commit
    head: str
    paths: tuple[str, ...]
    commits: tuple[Commit, ...]

    @property
    def touched(self) -> tuple[Commit, ...]:
        """The commits that touch a watched path (the ones replayed)."""
        return tuple(c for c in self.commits if c.touches)


def parse_range(text: str) -> tuple[str, str]:
    """``BASE..HEAD`` -> (BASE, HEAD); ``BASE..`` means ``BASE..HEAD``.

    Raises:
        ConfigError: not of that form.
    """
    if "..." in text:
        raise ConfigError(f"--range {text}: a symmetric difference has no first-parent path; use BASE..HEAD")
    base, sep, head = text.partition("..")
    if not sep or not base.strip():
        raise ConfigError(f"--range {text}: use BASE..HEAD (two revisions; BASE.. means BASE..HEAD)")
    return base.strip(), head.strip() or "HEAD"


def _objects(repo: Path, names: Sequence[str], what: str) -> dict[str, str | None]:
    """``REV:PATH`` names -> their object ids (None where the path does not exist), one git call."""
    unique = list(dict.fromkeys(names))
    if not unique:
        return {}
    out = run_git(["cat-file", "--batch-check=%(objectname)"], repo, what, ConfigError, stdin="\n".join(unique) + "\n")
    lines = out.splitlines()
    if len(lines) != len(unique):
        raise ConfigError(f"{what}: git cat-file answered {len(lines)} lines for {len(unique)} objects in {repo}")
    return {name: (None if line.endswith(" missing") or line.endswith(" ambiguous") else line) for name, line in zip(unique, lines)}


def read_series(rev_range: str, *, paths: Sequence[str] = (ALLOCATOR_PACKAGE,), repo: str | Path | None = None) -> Series:
    """The commits of ``rev_range`` (``BASE..HEAD``) on the first-parent path.

    Args:
        rev_range: ``BASE..HEAD``.
        paths: the watched paths, relative to the repository's top (a commit whose
            first-parent diff touches none of them is skipped).
        repo: a directory inside the repository (default: the current directory).

    Raises:
        ConfigError: not a repository, an unknown revision, BASE not an ancestor of
            HEAD, an empty range, a path found in no commit of it (one line each).
    """
    what = f"--range {rev_range}"
    where = Path(repo).expanduser() if repo is not None else Path.cwd()
    if not where.is_dir():
        raise ConfigError(f"--repo {where}: no such directory")
    top = current_repository(where)
    if top is None:
        raise ConfigError(f"{what}: {where} is not inside a git repository; give one with --repo PATH")
    base_rev, head_rev = parse_range(rev_range)
    base, head = commit_of(top, base_rev, what, ConfigError), commit_of(top, head_rev, what, ConfigError)
    ancestor = subprocess.run(["git", "merge-base", "--is-ancestor", base, head], cwd=top, capture_output=True, timeout=60)
    if ancestor.returncode != 0:
        raise ConfigError(f"{what}: {base_rev} ({base[:SHORT]}) is not an ancestor of {head_rev} ({head[:SHORT]}) in {top}")
    log = run_git(
        ["log", "--first-parent", "--ancestry-path", "-z", "--format=%H%x1f%P%x1f%s", f"{base}..{head}"],
        top, what, ConfigError,
    )
    rows = [entry.split("\x1f", 2) for entry in log.split("\0") if entry.strip()]
    if not rows:
        raise ConfigError(f"{what}: no commit between {base_rev} and {head_rev} ({base[:SHORT]} is {head_rev})")
    rows.reverse()  # oldest first
    paths = tuple(p.strip("/") or "." for p in paths)
    names = [f"{c}:{ALLOCATOR_PACKAGE}" for c in (base, *(r[0] for r in rows))]
    for commit, parents, _ in rows:
        first_parent = parents.split()[0] if parents.split() else None
        names += [f"{commit}:{p}" for p in paths] + ([f"{first_parent}:{p}" for p in paths] if first_parent else [])
    names += [f"{base}:{p}" for p in paths]
    objects = _objects(top, names, what)
    for p in paths:
        if all(objects.get(f"{c}:{p}") is None for c in (base, *(r[0] for r in rows))):
            raise ConfigError(
                f"--path {p}: no such path in {base_rev} nor in any commit up to {head_rev} "
                f"(paths are relative to the repository's top, {top})"
            )
    commits = []
    for commit, parents, subject in rows:
        first_parent = parents.split()[0] if parents.split() else None
        touches = any(
            objects[f"{commit}:{p}"] != (objects[f"{first_parent}:{p}"] if first_parent else None) for p in paths
        )
        commits.append(Commit(commit, subject.strip(), objects[f"{commit}:{ALLOCATOR_PACKAGE}"], touches))
    base_subject = run_git(["log", "-1", "--format=%s", base], top, what, ConfigError)
    return Series(
        top, rev_range, Commit(base, base_subject, objects[f"{base}:{ALLOCATOR_PACKAGE}"], True), head, paths, tuple(commits)
    )


def _trees(cache: Path | None) -> Path:
    return (cache if cache is not None else cache_dir()) / "trees"


@contextmanager
def allocator_checkout(repo: Path, tree: str, cache: Path | None = None) -> Iterator[Path]:
    """A directory holding ``allocator/``, the tree ``tree`` of ``repo``, extracted once
    under the cache directory; shared-locked while the block runs.

    Raises:
        ConfigError: git cannot archive the tree.
    """
    root = _trees(cache)
    root.mkdir(parents=True, exist_ok=True)
    path = root / tree
    # Two locks: "use" is held shared for as long as the tree is in use (prune_checkouts
    # removes a tree only when it gets it exclusively), "extract" exclusively while one
    # run extracts it (the others wait, then find it there).
    with open(root / f"{tree}.use", "w") as use:
        fcntl.flock(use, fcntl.LOCK_SH)
        with open(root / f"{tree}.extract", "w") as extract:
            fcntl.flock(extract, fcntl.LOCK_EX)
            if not (path / ALLOCATOR_PACKAGE / "__init__.py").is_file():
                _extract(repo, tree, path)
        os.utime(path)  # its last use, for prune_checkouts
        yield path


def _extract(repo: Path, tree: str, path: Path) -> None:
    proc = subprocess.run(
        ["git", "archive", "--format=tar", f"--prefix={ALLOCATOR_PACKAGE}/", tree],
        cwd=repo, capture_output=True, timeout=300,
    )
    if proc.returncode != 0:
        last = (proc.stderr.decode(errors="replace").strip().splitlines() or ["(no message)"])[-1]
        raise ConfigError(f"allocator tree {tree[:SHORT]}: git archive failed in {repo}: {last}")
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(3)}.tmp")
    try:
        with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tar:
            tar.extractall(tmp, filter="data")
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def prune_checkouts(cache: Path | None = None, keep: int = TREES_KEEP) -> None:
    """Remove the least recently used extracted trees beyond ``keep`` (never one in use)."""
    root = _trees(cache)
    if not root.is_dir():
        return
    trees = sorted((p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")),
                   key=lambda p: p.stat().st_mtime, reverse=True)
    for old in trees[keep:]:
        with open(root / f"{old.name}.use", "w") as use:
            try:
                fcntl.flock(use, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # in use right now
            shutil.rmtree(old, ignore_errors=True)  # the lock files stay: another run may hold them open
