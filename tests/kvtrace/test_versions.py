"""Allocator versions: the registry's forms, ``kvtrace versions``, entry points, and
``git:REV`` / ``worktree`` versions of a repository created here (each runs in a child
process with its own ``allocator`` package)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtrace.versions import git as gitversions
from kvtrace.cli import app
from kvtrace.errors import VersionSpecError
from kvtrace.versions.registry import VALID_FORMS, AllocatorVersion, ChildVersion, code_digest, resolve_any, resolve_version

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]
ALLOCATOR = ROOT / "allocator"
# Appended to a copy's manager.py: the copy's allocator keeps SGLang's speculative
# bookkeeping of before #29432 (its over-allocation ledger goes negative on sample:tiny).
BROKEN = """

def create_allocator(config):
    from allocator.pre_encapsulation import create_allocator as broken

    return broken(config)
"""


def _git(repo: Path, *args: str) -> str:
    out = subprocess.run(
        ["git", "-c", "user.email=kvtrace@example.com", "-c", "user.name=kvtrace", *args],
        cwd=repo, check=True, capture_output=True, text=True,
    )
    return out.stdout.strip()


@pytest.fixture()
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A git repository holding a copy of this checkout's allocator package, committed;
    checkouts cached under the test's own directory."""
    root = tmp_path / "repo"
    shutil.copytree(ALLOCATOR, root / "allocator", ignore=shutil.ignore_patterns("__pycache__"))
    _git(tmp_path, "init", "-q", str(root))
    _git(root, "add", "allocator")
    _git(root, "commit", "-qm", "allocator")
    monkeypatch.setenv(gitversions.CACHE_ENV, str(tmp_path / "cache"))
    return root


def test_the_builtin_forms_resolve_in_this_process() -> None:
    for spec, page in (("builtin", None), ("token", 1), ("paged", None), ("paged:32", 32), ("pre-encapsulation", None)):
        v = resolve_version(spec)
        assert isinstance(v, AllocatorVersion) and v.page_size == page and "built in" in v.origin


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nosuch", f"unknown allocator 'nosuch'; valid forms: {VALID_FORMS}"),
        ("paged:0", "the page size after 'paged:' must be a positive integer"),
        ("no.such.module:f", "cannot import module 'no.such.module'"),
        ("missing.py:f", "no such file missing.py"),
        ("git:", "give a revision after 'git:'"),
    ],
)
def test_a_spec_that_does_not_resolve_is_one_line(spec: str, message: str) -> None:
    with pytest.raises(VersionSpecError) as info:
        resolve_any(spec)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_git_versions_do_not_replay_in_this_process(repo: Path) -> None:
    with pytest.raises(VersionSpecError, match="run in their own process"):
        resolve_version(f"worktree@{repo}")


def test_versions_lists_every_form_with_its_origin() -> None:
    result = runner.invoke(app, ["versions"])
    assert result.exit_code == 0, result.output
    for name in ("builtin", "token", "paged[:N]", "pre-encapsulation", "worktree[@PATH]", "git:REV[@PATH]",
                 "package.module:factory", "path/to/file.py:factory"):
        assert name in result.output
    assert str(ALLOCATOR) in result.output
    data = json.loads(runner.invoke(app, ["versions", "--json"]).stdout)
    assert {v["kind"] for v in data["versions"]} >= {"builtin", "git", "factory"}
    assert all(v["origin"] for v in data["versions"]) and data["forms"] == VALID_FORMS


def test_an_entry_point_registers_a_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "kvtest_versions.py").write_text(
        "from allocator import create_allocator\n\ndef factory(config):\n    return create_allocator(config)\n"
    )
    info = tmp_path / "kvtest_versions-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvtest-versions\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text("[kvtrace.allocators]\nmine = kvtest_versions:factory\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    v = resolve_any("mine")
    assert isinstance(v, AllocatorVersion) and "kvtest-versions 0.3" in v.origin and "kvtest_versions:factory" in v.origin
    listed = runner.invoke(app, ["versions"]).output
    assert "mine" in listed and "kvtest-versions 0.3" in listed
    result = runner.invoke(app, ["diff", "sample:tiny", "--b", "mine", "--jobs", "1", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["identical"] is True


def test_git_revisions_resolve_to_cached_checkouts(repo: Path, tmp_path: Path) -> None:
    head = _git(repo, "rev-parse", "HEAD")
    v = resolve_any(f"git:HEAD@{repo}")
    assert isinstance(v, ChildVersion) and v.commit == head
    assert v.allocator_root == tmp_path / "cache" / "worktrees" / head
    assert (v.allocator_root / "allocator" / "manager.py").is_file()
    marker = v.allocator_root / "allocator" / "kept.txt"
    marker.write_text("reused")
    again = resolve_any(f"git:{head[:12]}@{repo}")  # the same commit: the same checkout, not a new one
    assert again.allocator_root == v.allocator_root and marker.read_text() == "reused"
    assert [c.commit for c in gitversions.cached_checkouts()] == [head]
    w = resolve_any(f"worktree@{repo}")
    assert isinstance(w, ChildVersion) and w.allocator_root == repo and w.commit is None
    for spec, message in ((f"git:nosuch@{repo}", "no revision 'nosuch'"),
                          (f"git:HEAD@{tmp_path / 'cache'}", "is not inside a git repository"),
                          (f"worktree@{tmp_path / 'nowhere'}", "no such directory")):
        with pytest.raises(VersionSpecError, match=message):
            resolve_any(spec)


def test_old_checkouts_are_removed_beyond_the_cache_size(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gitversions, "KEEP", 1)
    first = resolve_any(f"git:HEAD@{repo}")
    (repo / "allocator" / "extra.py").write_text("X = 1\n")
    _git(repo, "add", "allocator")
    _git(repo, "commit", "-qm", "second")
    second = resolve_any(f"git:HEAD@{repo}")
    assert second.allocator_root != first.allocator_root
    assert not first.allocator_root.exists()
    assert str(first.allocator_root) not in _git(repo, "worktree", "list")  # unregistered too


def _diff(*args: str) -> tuple[int, dict]:
    result = runner.invoke(app, ["diff", *args, "--json"])
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(result.stdout)


@pytest.mark.slow
def test_git_head_and_the_clean_worktree_are_identical_and_an_edit_is_found(repo: Path) -> None:
    code, out = _diff("sample:tiny", "--a", f"git:HEAD@{repo}", "--b", f"worktree@{repo}", "--exact")
    assert (code, out["identical"], out["steps_compared"], out["mode"]) == (0, True, 139, "parallel")
    assert out["versions"]["a"]["origin"].startswith("commit ") and str(repo) in out["versions"]["b"]["origin"]
    # an uncommitted edit: the working tree's allocator becomes the pre-encapsulation one
    init = repo / "allocator" / "__init__.py"
    init.write_text(init.read_text() + "\nfrom allocator.pre_encapsulation import create_allocator  # noqa: E402,F811\n")
    code, out = _diff("sample:tiny", "--a", f"git:HEAD@{repo}", "--b", f"worktree@{repo}")
    first = out["first_divergence"]
    assert code == 1
    assert (first["step"], first["op"], first["rid"], first["field"], first["a"], first["b"]) == (
        1, "spec", 0, "kv_allocated_len", 400, 379,
    )


@pytest.mark.slow
def test_a_revision_that_fails_in_its_process_is_one_line_naming_the_side(repo: Path) -> None:
    (repo / "allocator" / "manager.py").write_text("raise RuntimeError('this revision is broken')\n")
    _git(repo, "commit", "-qam", "broken")
    result = runner.invoke(app, ["diff", "sample:tiny", "--b", f"git:HEAD@{repo}"])
    assert result.exit_code == 2
    line = result.stderr.strip()
    assert "\n" not in line and line.startswith("kvtrace: error: side B (git:HEAD@")
    assert "this revision is broken" in line


@pytest.mark.parametrize("jobs", ["1", "2"])
@pytest.mark.slow
def test_each_side_runs_the_code_its_label_names_from_inside_a_checkout(repo: Path, jobs: str) -> None:
    """Run from inside an engine checkout whose own (committed) allocator/ is broken,
    that checkout first on PYTHONPATH too: side A, the built-in version, runs this
    kvtrace's allocator (in this process with --jobs 1, in a child with --jobs 2) and
    side B, git:HEAD, the checkout's; each label names its files and their hash."""
    (repo / "allocator" / "manager.py").write_text((repo / "allocator" / "manager.py").read_text() + BROKEN)
    _git(repo, "commit", "-qam", "broken")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(repo), str(ROOT)))}
    proc = subprocess.run(
        [sys.executable, "-m", "kvtrace", "diff", "sample:tiny", "--b", "git:HEAD", "--jobs", jobs, "--json"],
        cwd=repo, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    out = json.loads(proc.stdout)
    own, theirs = out["versions"]["a"]["origin"], out["versions"]["b"]["origin"]
    assert own == f"built in ({ALLOCATOR} sha256:{code_digest(ALLOCATOR)[:12]})"
    assert theirs.endswith(f"/allocator sha256:{code_digest(repo / 'allocator')[:12]}")
    assert code_digest(repo / "allocator") != code_digest(ALLOCATOR)
    # what ran: this kvtrace's allocator balances its over-allocation ledger, the broken one does not
    assert out["a"]["overalloc"]["allocated"] == 220 and out["a"]["violations"] == []
    assert out["b"]["overalloc"]["allocated"] < 0 and out["b"]["violations"]
    assert out["first_divergence"]["field"] == "kv_allocated_len"


def test_a_side_that_would_import_other_code_than_its_label_names_stops(tmp_path: Path) -> None:
    """The child checks what it imported against the side's label (a checkout changed
    under it, say) and reports one line instead of replaying unnamed code."""
    from kvtrace.diff.sides import ChildSide, SideError, side_job

    shutil.copytree(ALLOCATOR, tmp_path / "allocator", ignore=shutil.ignore_patterns("__pycache__"))
    version = ChildVersion("worktree", "worktree", tmp_path, origin="here")
    job = side_job(version, "sample:tiny", trace_label="sample:tiny", page_size=None, pool_tokens=None, device="cpu",
                   options={})
    (tmp_path / "allocator" / "manager.py").write_text((tmp_path / "allocator" / "manager.py").read_text() + BROKEN)
    side = ChildSide("B", job)
    try:
        with pytest.raises(SideError, match=r"this process imported .*/allocator sha256:\w+, but the side is labelled"):
            list(side.chunks())
            side.summary()
    finally:
        side.close()


@pytest.mark.slow
def test_nothing_in_a_trace_s_metadata_is_ever_executed(tmp_path: Path) -> None:
    """Version specs and Python code in a trace's metadata (source, extra) are data:
    replaying and diffing the trace, in this process and in children, runs none of it."""
    from tests.helpers import decode_steps, make_meta, write_steps
    from traces.metadata import TraceSource

    mark = tmp_path / "executed"
    payload = tmp_path / "payload.py"
    payload.write_text(f"open({str(mark)!r}, 'w').close()\ndef factory(config):\n    raise SystemExit(3)\n")
    code = f"open({str(mark)!r}, 'w').close()"
    meta = make_meta()
    meta = type(meta)(
        config=meta.config, block_size=meta.block_size,
        source=TraceSource(engine=f"{payload}:factory", workload="git:HEAD", repository=code, path=f"{payload}:factory"),
        extra={"allocator": f"{payload}:factory", "version": f"{payload}:factory", "a": "worktree", "exec": code},
    )
    trace = write_steps(tmp_path / "t.kvtrace", decode_steps(4), meta=meta)
    skip = ["--on-bad-op", "skip", "--json"]  # decode steps alone: requests that were never extended
    for args in (["replay", str(trace), *skip], ["info", str(trace), "--json"],
                 ["diff", str(trace), "--b", "builtin", "--jobs", "1", *skip],
                 ["diff", str(trace), "--b", "paged", "--jobs", "2", *skip]):
        result = runner.invoke(app, args)
        assert result.exit_code in (0, 1), (args, result.output)
        assert not mark.exists(), args


@pytest.mark.parametrize("command", ["diff", "replay"])
def test_help_says_which_versions_execute_code(command: str) -> None:
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert "execute the code they name" in text or "execute that code" in text
    assert "nothing in a trace is ever executed" in text
