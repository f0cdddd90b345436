"""This repository's own allocator history as versions: commits from before the
driver's current ``allocator`` names (``PoolMemory``, ``PoolCounters.used_tokens``,
``AllocatorConfig.check``, ``ReleaseResult.evicted_tokens``) replay through the
child's shims, as ``git:REV`` and as ``--range`` commits (the README's examples)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtrace.versions import git as gitversions
from kvtrace.cli import app
from kvtrace.versions.registry import ChildVersion
from kvtrace.diff.series import allocator_checkout
from kvtrace.replay.session import open_trace
from kvtrace.diff.sides import ChildSide, SideError, side_job

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]
FIRST_ALLOCATOR = "c29c77b"  # the first commit whose allocator package has create_allocator


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def _has_history() -> bool:
    try:
        _git("cat-file", "-e", f"{FIRST_ALLOCATOR}^{{commit}}")
    except (subprocess.CalledProcessError, FileNotFoundError):
        return False
    return True


pytestmark = [pytest.mark.slow,  # replays commits of the history in git worktrees
              pytest.mark.skipif(not _has_history(), reason="needs this repository's git history")]


@pytest.fixture()
def clone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A local clone of this repository (git: versions register their worktrees there,
    not here); checkouts and replays cached under the test's own directory."""
    path = tmp_path / "clone"
    _git("clone", "-q", "--no-checkout", str(ROOT), str(path), cwd=tmp_path)
    monkeypatch.setenv(gitversions.CACHE_ENV, str(tmp_path / "cache"))
    return path


@pytest.mark.slow
def test_a_commit_from_before_pool_memory_replays_as_a_git_version(clone: Path) -> None:
    """Its allocator.sizing has no PoolMemory (its AllocatorConfig no check, its
    ReleaseResult no evicted_tokens): the child supplies this kvtrace's; the version
    replays every step, and the diff finds what did change since: a retract did not yet
    evict from the radix cache to keep room for the requests still decoding."""
    result = runner.invoke(app, ["diff", "sample:tiny", "--a", f"git:{FIRST_ALLOCATOR}@{clone}", "--b", "builtin",
                                 "--jobs", "1", "--json"])
    assert result.exit_code == 1, result.output
    out = json.loads(result.stdout)
    assert out["a"]["steps"] == out["b"]["steps"] == 139 and out["a"]["violations"] == []
    first = out["first_divergence"]
    assert (first["step"], first["field"], first["a"], first["b"]) == (120, "events.evict", "(none)", "evict 48 tokens")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("rev_range", "replayed"), [("f42b549..4a6c5f2", 3), ("4a6c5f2..42eca2a", 3)]
)
def test_the_readme_range_examples_replay_every_commit(rev_range: str, replayed: int, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gitversions.CACHE_ENV, str(tmp_path / "cache"))
    result = runner.invoke(app, ["diff", "sample:tiny", "--range", rev_range, "--repo", str(ROOT), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    statuses = [c["status"] for c in out["commits"]]
    assert statuses.count("identical") == replayed and "error" not in statuses
    assert out["first_diverging_commit"] is None


def _imports_on_its_own(commit: str, tmp: Path) -> bool:
    """Whether the commit's ``allocator`` package imports ``create_allocator`` with only
    its own tree and this checkout's trace format (``traces``, the layer beneath it, which a
    diff side takes from the running kvtrace) on the path."""
    tree = tmp / f"own-{commit}"
    if not tree.exists():
        tree.mkdir()
        archive = subprocess.run(["git", "archive", commit, "allocator"], cwd=ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    import sys

    done = subprocess.run([sys.executable, "-S", "-c", "import sys; sys.path[:0] = [sys.argv[1], *sys.argv[2:]]; "
                           "from allocator import create_allocator", str(tree), str(ROOT), *_site_paths()],
                          capture_output=True, cwd=tree)
    return done.returncode == 0


def _site_paths() -> list[str]:
    """This interpreter's site-packages (numpy, torch), without this checkout."""
    import site

    return [*site.getsitepackages()]


def _replay_tree(commit: str, cache: Path) -> dict:
    tree = _git("rev-parse", f"{commit}:allocator")
    path = str(open_trace("sample:tiny").path)
    with allocator_checkout(ROOT, tree, cache) as root:
        version = ChildVersion(commit, commit, root, origin=f"commit {commit}")
        side = ChildSide("A", side_job(version, path, trace_label="sample:tiny", page_size=None, pool_tokens=None,
                                       device="cpu", options={}))
        try:
            steps = sum(len(chunk) for chunk in side.chunks())
            return {**side.summary(), "records": steps}
        finally:
            side.close()


@pytest.mark.slow
def test_every_tenth_allocator_commit_replays_sample_tiny(tmp_path: Path) -> None:
    """Every 10th commit of 'git log -- allocator' (and the oldest): those with an
    allocator replay the whole tiny sample without a broken invariant; those from before the first
    allocator (a protocol and kernels only) say so in one line."""
    commits = _git("log", "--format=%h", "--", "allocator").split()
    for commit in [*commits[::10], commits[-1]]:
        found = subprocess.run(["git", "grep", "-q", "def create_allocator", commit, "--", "allocator"], cwd=ROOT)
        has_allocator = found.returncode == 0
        if has_allocator and not _imports_on_its_own(commit, tmp_path):
            # A commit caught halfway through a move: its own package does not import.
            with pytest.raises(SideError, match="its allocator package does not import"):
                _replay_tree(commit, tmp_path)
        elif has_allocator:
            summary = _replay_tree(commit, tmp_path)
            assert (summary["records"], summary["steps"], summary["violations"]) == (139, 139, []), commit
        else:
            with pytest.raises(SideError, match="has no create_allocator"):
                _replay_tree(commit, tmp_path)
