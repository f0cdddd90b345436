"""``kvtrace diff TRACE --range BASE..HEAD``: a series of allocator commits built here
(pure moves, renames, a commit that touches no allocator file, one that stops recording
the speculative reserve on the paged path, so that over-allocated slots are never
released), each replayed and compared with BASE; ``--bisect``; the cache; commits that
do not import or whose allocator raises; bad ranges. ``first_true`` against a linear
scan."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvtrace.versions import git as gitversions
from kvtrace.proc.child import OPTIONAL_PROTOCOLS
from kvtrace.cli import app
from kvtrace.diff.rangediff import first_true
from traces.reader import TraceReader
from traces.schema import SPEC
from tests.kvtrace.test_versions import ALLOCATOR, _git
from traces.synth import generate

runner = CliRunner()


def _commit(repo: Path, message: str) -> str:
    _git(repo, "add", "-A", ".")
    _git(repo, "commit", "-qm", message)
    return _git(repo, "rev-parse", "HEAD")


def _replace(path: Path, pattern: str, new: str, *, at_least: int = 1) -> None:
    text, count = re.subn(pattern, new, path.read_text(), flags=re.DOTALL)
    assert count >= at_least, f"{path.name}: '{pattern}' found {count} times (the allocator changed: update the test)"
    path.write_text(text)


def _move_module(repo: Path, old: str, new: str) -> None:
    """A pure move: ``allocator/OLD.py`` -> ``allocator/NEW.py`` (dotted names: ``check.digest``),
    its imports rewritten."""
    _git(repo, "mv", f"allocator/{old.replace('.', '/')}.py", f"allocator/{new.replace('.', '/')}.py")
    found = 0
    for path in (repo / "allocator").rglob("*.py"):
        text, n = re.subn(rf"\b(from|import) allocator\.{re.escape(old)}\b", rf"\1 allocator.{new}", path.read_text())
        text, m = re.subn(rf'"allocator\.{re.escape(old)}"', f'"allocator.{new}"', text)
        path.write_text(text)
        found += n + m
    assert found, f"nothing imports allocator.{old}: update the test"


def _rename(repo: Path, old: str, new: str) -> None:
    """A rename of an identifier throughout the package."""
    found = 0
    for path in (repo / "allocator").rglob("*.py"):
        text, n = re.subn(rf"\b{old}\b", new, path.read_text())
        path.write_text(text)
        found += n
    assert found >= 2, f"{old}: found {found} times (the allocator changed: update the test)"


def _stop_recording_the_paged_reserve(repo: Path) -> None:
    """The bug class of ``allocator/pre_encapsulation.py``: the speculative reserve takes
    its slots, and the caller records ``kv_allocated_len`` on the page-1 path only, so
    the paged path never releases what it over-allocated."""
    _replace(
        repo / "allocator" / "manager.py",
        r"\n        return alloc_for_spec_decode\(self\.ctx, rows, plan, rids\)\n",
        "\n        from allocator.allocation import SpecResult, record_spec_reserve, take_spec_slots\n\n"
        "        res = take_spec_slots(self.ctx, rows, plan, rids)\n"
        "        if isinstance(res, SpecResult) and res.num_tokens and self.ctx.page_size == 1:\n"
        "            record_spec_reserve(self.ctx, rows, plan, res.taken)\n"
        "        return res\n",
    )


def _start(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    shutil.copytree(ALLOCATOR, repo / "allocator", ignore=shutil.ignore_patterns("__pycache__"))
    _git(tmp_path, "init", "-q", str(repo))
    _commit(repo, "allocator")
    return repo


@pytest.fixture()
def series(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, dict[str, str]]:
    """BASE and seven commits, six of them touching the allocator; the fifth stops
    releasing the paged path's speculative over-allocation. Cache under the test's own
    directory."""
    monkeypatch.setenv(gitversions.CACHE_ENV, str(tmp_path / "cache"))
    repo = _start(tmp_path)
    hashes = {"base": _git(repo, "rev-parse", "HEAD")}
    _move_module(repo, "check.digest", "check.state_digest")
    hashes["move digest"] = _commit(repo, "Move the state digest to allocator/state_digest.py")
    _rename(repo, "_fit_evict_take", "_fit_then_take")
    hashes["rename helper"] = _commit(repo, "Rename _fit_evict_take to _fit_then_take")
    (repo / "README.md").write_text("An allocator.\n")
    hashes["readme"] = _commit(repo, "README")
    _move_module(repo, "table_writer", "row_writer")
    hashes["move writer"] = _commit(repo, "Move the table writer to allocator/row_writer.py")
    _stop_recording_the_paged_reserve(repo)
    hashes["bug"] = _commit(repo, "Speculative reserve: the caller records kv_allocated_len")
    _rename(repo, "ReleaseOutcome", "ReleaseTotals")
    hashes["rename outcome"] = _commit(repo, "Rename ReleaseOutcome to ReleaseTotals")
    _move_module(repo, "check.checkpoint", "check.saved_state")
    hashes["move checkpoint"] = _commit(repo, "Move checkpoints to allocator/saved_state.py")
    return repo, hashes


@pytest.fixture()
def spec_trace(tmp_path: Path) -> tuple[str, int]:
    """A small synthetic trace with speculative steps at page size 16, and its first
    speculative step."""
    path = tmp_path / "spec.kvtrace"
    generate(path, num_requests=10, seed=3, page_size=16, spec=True, spec_fraction=0.8, max_running=4)
    first_spec = next(b.step for b in TraceReader(path).steps() if np.any(b.op == SPEC))
    return str(path), first_spec


def _range(*args: str, code: int) -> dict:
    result = runner.invoke(app, ["diff", *args, "--json", "-q"])
    assert result.exit_code == code, result.output
    return json.loads(result.stdout)


@pytest.mark.slow
def test_the_table_marks_the_diverging_commit_and_every_later_one_bisect_finds_it_and_reruns_use_the_cache(
    series: tuple[Path, dict[str, str]], spec_trace: tuple[str, int]
) -> None:
    repo, hashes = series
    trace, first_spec = spec_trace
    span = f"{hashes['base']}..HEAD"
    touched = [h for name, h in hashes.items() if name not in ("base", "readme")]
    n = len(touched)
    assert n == 6

    # --bisect, nothing cached: BASE and at most ceil(log2(N + 1)) commits
    out = _range(trace, "--range", span, "--repo", str(repo), "--bisect", code=1)
    assert out["first_diverging_commit"] == hashes["bug"]
    assert out["replays"] <= math.ceil(math.log2(n)) + 1 and out["replays"] == 1 + math.ceil(math.log2(n + 1))
    assert out["cached"] == 0 and out["bisect"] is True
    tested = {c["commit"]: c["status"] for c in out["commits"] if c["status"] != "untested"}
    assert tested[hashes["bug"]] == "diverged" and "skipped" in {c["status"] for c in out["commits"]}

    # the whole table: only what the bisection did not replay is replayed
    out = _range(trace, "--range", span, "--repo", str(repo), code=1)
    assert (out["replays"], out["cached"]) == (3, 4)  # BASE and three commits came from the bisection's replays
    assert out["base"] == hashes["base"] and out["head"] == _git(repo, "rev-parse", "HEAD")
    assert [c["commit"] for c in out["commits"]] == list(hashes.values())[1:]
    statuses = {name: c["status"] for name, c in zip(list(hashes)[1:], out["commits"])}
    assert statuses == {
        "move digest": "identical", "rename helper": "identical", "readme": "skipped", "move writer": "identical",
        "bug": "diverged", "rename outcome": "diverged", "move checkpoint": "diverged",
    }
    assert out["first_diverging_commit"] == hashes["bug"]
    firsts = [c["first_divergence"][trace] for c in out["commits"] if c["status"] == "diverged"]
    for first in firsts:  # the same first divergence on every commit from the bug on
        assert (first["step"], first["op"], first["field"]) == (first_spec, "spec", "kv_allocated_len")
        assert first["a"] > first["b"]  # the reserve was taken but not recorded
    assert firsts[0] == firsts[1] == firsts[2]
    for c in out["commits"]:
        if c["status"] == "identical":
            assert c["first_divergence"] == {trace: None} and c["traces"][0]["steps_compared"] > first_spec
    (report,) = out["divergences"]  # the first diverging commit's diff, as kvtrace diff --json has it
    assert report["first_divergence"] == firsts[0] and report["identical"] is False
    assert report["versions"]["b"]["spec"] == f"git:{hashes['bug'][:10]}"

    # three more commits: one does not import, one whose allocator raises, one back to the last good tree
    last_good = _git(repo, "rev-parse", "HEAD")
    with (repo / "allocator" / "base.py").open("a") as f:
        f.write("\ndef broken(:\n")
    broken_import = _commit(repo, "base: a syntax error")
    _git(repo, "checkout", last_good, "--", "allocator")
    with (repo / "allocator" / "manager.py").open("a") as f:
        f.write("\n\ndef _broken(self, *args, **kwargs):\n    raise RuntimeError('decode is broken here')\n\n"
                "KvAllocator.decode = _broken\n")
    raises = _commit(repo, "decode raises")
    _git(repo, "checkout", last_good, "--", "allocator")
    back = _commit(repo, "Back to the last good allocator")
    out = _range(trace, "--range", span, "--repo", str(repo), code=1)
    assert out["replays"] == 2  # only the two new trees; the third is the last good one, cached
    by_commit = {c["commit"]: c for c in out["commits"]}
    assert by_commit[broken_import]["status"] == "error"
    assert "SyntaxError" in by_commit[broken_import]["traces"][0]["error"]
    assert by_commit[raises]["status"] == "error"
    assert "RuntimeError: decode is broken here" in by_commit[raises]["traces"][0]["error"]
    assert by_commit[back]["status"] == "diverged" and by_commit[back]["traces"][0]["cached"] is True
    assert out["first_diverging_commit"] == hashes["bug"]

    # the text report, from the cache: a line per commit, then the divergence as kvtrace diff prints it
    result = runner.invoke(app, ["diff", trace, "--range", span, "--repo", str(repo), "--no-color"])
    assert result.exit_code == 1, result.output
    lines = result.stdout.splitlines()
    # a replay that failed is not cached (it may depend on the environment): those two run again
    assert "10 commits on the first-parent path, 9 touching allocator; 2 replayed, 7 from the cache" in lines[0]
    row = {h: next(line for line in lines if h[:10] in line) for h in hashes.values()}
    assert "identical" in row[hashes["move digest"]] and "skipped" in row[hashes["readme"]]
    assert f"step {first_spec} (spec, request" in row[hashes["bug"]] and row[hashes["bug"]].lstrip().startswith(">")
    assert "error: SyntaxError" in next(line for line in lines if broken_import[:10] in line)
    assert "FIRST DIVERGING COMMIT" in result.stdout and f"FIRST DIVERGENCE at step {first_spec} (spec)" in result.stdout
    assert "side by side" in result.stdout


@pytest.mark.slow
def test_a_series_that_preserves_behaviour_exits_0_and_base_that_does_not_replay_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec_trace: tuple[str, int]
) -> None:
    """The first commit has no ``spec_decode_run`` (its ``DecodeRuns`` declares other
    methods than this kvtrace calls, as before it had one): this kvtrace's protocol stands
    in, the allocator does not satisfy it and replays step by step. The second also drops
    the optional protocols from ``allocator.base``, as a package older than them lacks
    them: the child supplies them. Both replay (with --exact too)."""
    monkeypatch.setenv(gitversions.CACHE_ENV, str(tmp_path / "cache"))
    repo = _start(tmp_path)
    base = _git(repo, "rev-parse", "HEAD")
    _rename(repo, "spec_decode_run", "spec_decode_run_v0")
    _commit(repo, "An allocator whose DecodeRuns has no spec_decode_run")
    _move_module(repo, "check.digest", "check.state_digest")
    for protocol in OPTIONAL_PROTOCOLS:
        _replace(repo / "allocator" / "base.py", rf"\n@runtime_checkable\nclass {protocol}\(Protocol\):.*?(?=\n\n\n|\Z)", "")
    assert "Digestible" not in (repo / "allocator" / "base.py").read_text()
    _commit(repo, "Move the state digest; an allocator.base without the optional protocols")
    trace = spec_trace[0]
    out = _range(trace, "sample:tiny", "--range", f"{base}..", "--repo", str(repo), "--jobs", "2", code=0)
    assert [c["status"] for c in out["commits"]] == ["identical", "identical"]
    assert out["first_diverging_commit"] is None and out["traces"] == [trace, "sample:tiny"] and not out["exact"]
    assert set(out["commits"][0]["first_divergence"]) == {trace, "sample:tiny"} and out["replays"] == 6
    # --exact: state digests (Digestible), and no runs
    out = _range(trace, "--range", f"{base}..", "--repo", str(repo), "--exact", "--jobs", "2", code=0)
    assert [c["status"] for c in out["commits"]] == ["identical", "identical"] and out["exact"]
    # BASE whose allocator does not import: nothing to compare with
    with (repo / "allocator" / "base.py").open("a") as f:
        f.write("\nraise ImportError('no base here')\n")
    broken = _commit(repo, "broken")
    _git(repo, "commit", "-q", "--allow-empty", "-m", "touches nothing")
    result = runner.invoke(app, ["diff", trace, "--range", f"{broken}..HEAD", "--repo", str(repo), "-q"])
    assert result.exit_code == 2
    line = result.stderr.strip()
    assert "\n" not in line and line.startswith(f"kvtrace: error: --range {broken}..HEAD: BASE {broken[:10]} (broken)")
    assert "no base here" in line


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--range", "nosuch..HEAD"], "no revision 'nosuch'"),
        (["--range", "HEAD..HEAD~1"], "is not an ancestor of HEAD~1"),
        (["--range", "HEAD..HEAD"], "no commit between HEAD and HEAD"),
        (["--range", "HEAD"], "use BASE..HEAD"),
        (["--range", "HEAD~1...HEAD"], "symmetric difference"),
        (["--range", "HEAD~1..HEAD", "--path", "nowhere"], "--path nowhere: no such path"),
        (["--range", "HEAD~1..HEAD", "--b", "builtin"], "drop --b"),
        (["--bisect"], "--bisect goes with --range"),
        (["--path", "allocator"], "--path goes with --range"),
    ],
)
def test_bad_ranges_are_one_line_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], message: str
) -> None:
    monkeypatch.setenv(gitversions.CACHE_ENV, str(tmp_path / "cache"))
    repo = _start(tmp_path)
    (repo / "allocator" / "extra.py").write_text("X = 1\n")
    _commit(repo, "extra")
    if "--range" in args:
        args = [*args, "--repo", str(repo)]
    result = runner.invoke(app, ["diff", "sample:tiny", *args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtrace: error:") and message in lines[0], lines
    assert not (tmp_path / "cache" / "replays").exists()  # nothing was replayed


def test_pruning_never_removes_a_tree_in_use_and_pruned_records_are_a_miss(tmp_path: Path) -> None:
    import pyarrow as pa

    from kvtrace.diff.replaycache import ReplayCache
    from kvtrace.diff.series import allocator_checkout, prune_checkouts
    from kvtrace.statelog.log import STATE_LOG_SCHEMA

    repo = _start(tmp_path)
    old = _git(repo, "rev-parse", "HEAD:allocator")
    (repo / "allocator" / "extra.py").write_text("X = 1\n")
    _commit(repo, "extra")
    new = _git(repo, "rev-parse", "HEAD:allocator")
    cache = tmp_path / "cache"
    with allocator_checkout(repo, old, cache) as root:
        assert (root / "allocator" / "__init__.py").is_file() and not (root / "allocator" / "extra.py").exists()
    with allocator_checkout(repo, new, cache) as root:
        assert (root / "allocator" / "extra.py").read_text() == "X = 1\n"
        prune_checkouts(cache, keep=0)
        assert root.is_dir()  # in use: kept
    assert not (cache / "trees" / old).exists()  # not in use: removed
    prune_checkouts(cache, keep=0)
    assert not (cache / "trees" / new).exists()

    replays = ReplayCache(cache / "replays")
    writer = replays.writer()
    writer.write(pa.RecordBatch.from_pylist([], schema=STATE_LOG_SCHEMA))
    stored = replays.put("k", writer, {"steps": 0})
    assert replays.get("k") == stored and stored.log.is_file()
    replays.prune(keep_bytes=0, grace_s=0)
    assert replays.get("k") is None and not stored.log.exists()


def test_a_directory_outside_git_is_one_line(tmp_path: Path) -> None:
    result = runner.invoke(app, ["diff", "sample:tiny", "--range", "a..b", "--repo", str(tmp_path)])
    assert result.exit_code == 2 and "is not inside a git repository" in result.stderr


@given(n=st.integers(0, 300), data=st.data())
def test_first_true_finds_the_first_of_a_monotone_predicate_in_log2_calls(n: int, data: st.DataObject) -> None:
    """Against a linear scan; an index whose test cannot tell (a commit that does not
    replay) is skipped and costs one call more."""
    k = data.draw(st.integers(0, n))  # k == n: true nowhere
    unknown = data.draw(st.sets(st.integers(0, max(n - 1, 0)), max_size=n // 4 if n else 0))
    calls: list[int] = []

    def test(i: int) -> bool | None:
        assert 0 <= i < n and i not in calls
        calls.append(i)
        return None if i in unknown else i >= k

    expected = next((i for i in range(n) if i not in unknown and i >= k), None)
    assert first_true(n, test) == expected
    assert len(calls) <= math.ceil(math.log2(n + 1)) + len(unknown & set(calls))
    if not unknown:
        assert len(calls) <= math.ceil(math.log2(n + 1))
