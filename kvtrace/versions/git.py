"""``git:REV[@PATH]`` and ``worktree[@PATH]`` versions: an ``allocator`` package from git.

``git:REV`` checks revision REV of a repository (default: the one holding the
current directory) out into a git worktree under the cache directory, one per
commit, reused by later runs and by parallel ones (a file lock guards the
checkout); the least recently used beyond ``KEEP`` are removed (``git worktree
remove``). ``worktree`` is the repository's working tree itself, uncommitted and
untracked files included: there is nothing to check out.

Either way the version runs in a child process whose ``allocator`` package is the
one in that tree (``kvtrace.proc.child``); this checkout's ``kvtrace`` and ``traces``
drive it.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from kvtrace.errors import KvtraceError, VersionSpecError
from kvtrace.versions.base import ChildVersion, code_identity

__all__ = ["CachedCheckout", "cache_dir", "cached_checkouts", "current_repository", "resolve", "run_git"]

KEEP = 8  # cached checkouts kept (least recently used removed first)
CACHE_ENV = "KVTRACE_CACHE_DIR"


@dataclass(frozen=True, slots=True)
class CachedCheckout:
    """One cached checkout: the commit, its repository, its directory, its last use."""

    commit: str
    repo: str
    path: Path
    last_used: float


def cache_dir() -> Path:
    """Where checkouts are cached: ``$KVTRACE_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvtrace``,
    else ``~/.cache/kvtrace``."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvtrace"


def run_git(
    args: list[str], cwd: Path | str, what: str, error: type[KvtraceError] = VersionSpecError, stdin: str | None = None
) -> str:
    """``git ARGS`` in ``cwd`` (``stdin`` fed to it): its stdout, stripped.

    Raises:
        ``error``: git is missing or fails (one line starting with ``what``, with git's last line).
    """
    try:
        proc = subprocess.run(["git", *args], cwd=cwd, input=stdin, capture_output=True, text=True, timeout=300)
    except FileNotFoundError:
        raise error(f"{what}: git is not installed (git: and worktree versions and --range need it)") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise error(f"{what}: git {args[0]} failed in {cwd}: {last}")
    return proc.stdout.strip()


def commit_of(repo: Path, rev: str, what: str, error: type[KvtraceError]) -> str:
    """The commit ``rev`` names in ``repo`` (full hash).

    Raises:
        ``error``: no such revision (one line starting with ``what``).
    """
    found = subprocess.run(
        ["git", "rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}"],
        cwd=repo, capture_output=True, text=True, timeout=60,
    )
    commit = found.stdout.strip()
    if found.returncode != 0 or not commit:
        raise error(f"{what}: no revision '{rev}' in {repo}")
    return commit


def _git(args: list[str], cwd: Path | str, spec: str) -> str:
    return run_git(args, cwd, f"allocator '{spec}'")


def current_repository(path: str | Path = ".") -> Path | None:
    """The top of the git repository holding ``path``, or None."""
    try:
        proc = subprocess.run(
            ["git", "rev-parse", "--show-toplevel"], cwd=path, capture_output=True, text=True, timeout=60
        )
    except (FileNotFoundError, NotADirectoryError):
        return None
    return Path(proc.stdout.strip()) if proc.returncode == 0 else None


def _split(spec: str) -> tuple[str, str | None]:
    """``git:REV@PATH`` -> (REV, PATH); an ``@{...}`` stays in REV (``HEAD@{1}``)."""
    body = spec[4:] if spec.startswith("git:") else spec[len("worktree"):]
    at = body.rfind("@")
    while at >= 0 and body[at + 1 : at + 2] == "{":
        at = body.rfind("@", 0, at)
    if at < 0:
        return body, None
    return body[:at], body[at + 1 :] or None


def _repository(spec: str, path: str | None) -> Path:
    where = Path(path).expanduser() if path else Path.cwd()
    if not where.is_dir():
        raise VersionSpecError(f"allocator '{spec}': no such directory {where}")
    repo = current_repository(where)
    if repo is None:
        raise VersionSpecError(
            f"allocator '{spec}': {where} is not inside a git repository; give one with '@PATH' "
            "(git:REV@PATH, worktree@PATH)"
        )
    return repo


def resolve(spec: str, *, cache: Path | None = None) -> ChildVersion:
    """A ``git:REV[@PATH]`` or ``worktree[@PATH]`` spec -> its ``ChildVersion``.

    Raises:
        VersionSpecError: not a repository, an unknown revision, no ``allocator`` package
            there, or git failing (one line naming the spec).
    """
    rev, path = _split(spec)
    repo = _repository(spec, path)
    if not spec.startswith("git:"):
        if rev:
            raise VersionSpecError(f"allocator '{spec}': use 'worktree' or 'worktree@PATH'")
        if not (repo / "allocator" / "__init__.py").is_file():
            raise VersionSpecError(f"allocator '{spec}': the working tree {repo} has no allocator package")
        return ChildVersion(
            spec, "worktree", repo, origin=f"the working tree of {repo}: {code_identity(repo / 'allocator')}"
        )
    if not rev:
        raise VersionSpecError(f"allocator '{spec}': give a revision after 'git:' (git:REV or git:REV@PATH)")
    commit = commit_of(repo, rev, f"allocator '{spec}'", VersionSpecError)
    probe = subprocess.run(
        ["git", "cat-file", "-e", f"{commit}:allocator/__init__.py"], cwd=repo, capture_output=True, timeout=60
    )
    if probe.returncode != 0:
        raise VersionSpecError(f"allocator '{spec}': revision {rev} ({commit[:10]}) of {repo} has no allocator package")
    root = _checkout(repo, commit, cache if cache is not None else cache_dir(), spec)
    return ChildVersion(
        spec, f"git:{rev} ({commit[:10]})", root,
        origin=f"commit {commit[:12]} of {repo}: {code_identity(root / 'allocator')}", commit=commit,
    )


def _entries(cache: Path) -> Path:
    return cache / "worktrees"


def _checkout(repo: Path, commit: str, cache: Path, spec: str) -> Path:
    """The cached worktree of ``commit`` (checked out now if missing)."""
    root = _entries(cache)
    root.mkdir(parents=True, exist_ok=True)
    path = root / commit
    meta = root / f"{commit}.json"
    with open(root / f"{commit}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (meta.is_file() and (path / "allocator" / "__init__.py").is_file()):
            if path.exists():
                _remove(path, repo)
            _git(["worktree", "add", "--detach", "--force", str(path), commit], repo, spec)
        meta.write_text(json.dumps({"commit": commit, "repo": str(repo), "last_used": time.time()}))
    _prune(root, keep=KEEP, spare=commit)
    return path


def cached_checkouts(cache: Path | None = None) -> list[CachedCheckout]:
    """The cached checkouts, most recently used first."""
    root = _entries(cache or cache_dir())
    out = []
    for meta in root.glob("*.json") if root.is_dir() else ():
        try:
            info = json.loads(meta.read_text())
            out.append(CachedCheckout(info["commit"], info["repo"], root / info["commit"], float(info["last_used"])))
        except (OSError, ValueError, KeyError):
            continue
    return sorted(out, key=lambda c: -c.last_used)


def _prune(root: Path, keep: int, spare: str) -> None:
    """Remove the least recently used checkouts beyond ``keep`` (never ``spare``, nor one
    another process holds locked)."""
    for old in cached_checkouts(root.parent)[keep:]:
        if old.commit == spare:
            continue
        with open(root / f"{old.commit}.lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # in use right now
            (root / f"{old.commit}.json").unlink(missing_ok=True)
            _remove(old.path, Path(old.repo))
        (root / f"{old.commit}.lock").unlink(missing_ok=True)


def _remove(path: Path, repo: Path) -> None:
    """Remove a checkout and unregister it from its repository (if that still exists)."""
    if repo.is_dir():
        subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=repo, capture_output=True, timeout=300)
        subprocess.run(["git", "worktree", "prune"], cwd=repo, capture_output=True, timeout=300)
    if path.exists():
        shutil.rmtree(path, ignore_errors=True)
