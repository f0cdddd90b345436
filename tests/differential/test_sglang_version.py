"""The versions ``sglang`` / ``sglang:PYTHON``: errors without SGLang, and exact parity
with the built-in allocator through ``kvtrace diff`` and ``kvtrace replay`` with it.

The parity tests skip unless ``KVTRACE_SGLANG_PYTHON`` names an interpreter with
sglang 0.5.23 (``tools/sglang_oracle/setup.sh``; ``.ci/run`` builds one). They run
in lockstep in this process (``jobs=1``), so every replay after the first reuses
the driver process and SGLang's import (~6 s) is paid once per interpreter.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.errors import VersionSpecError
from kvtrace.versions.registry import resolve_any
from kvtrace.versions.sglang import ENV_VAR
from tests.differential import harness

runner = CliRunner()


def _sglang_python() -> str:
    return harness.require_sglang()


# ---------------------------------------------------------------------------- without SGLang


def _fake_python(tmp_path: Path, prints: str, code: int = 0) -> str:
    """An executable that answers the version probe like an interpreter would."""
    path = tmp_path / "python"
    path.write_text(f"#!/bin/sh\nprintf '%s' '{prints}'\nexit {code}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_unknown_sglang_version_is_one_line(tmp_path: Path) -> None:
    fake = _fake_python(tmp_path, "0.4.9")
    with pytest.raises(VersionSpecError, match=r"sglang 0\.4\.9 is not a version the driver knows \(0\.5\.23\)"):
        resolve_any(f"sglang:{fake}")


def test_unknown_sglang_version_may_be_driven_on_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_python(tmp_path, "0.5.24.dev3")
    monkeypatch.setenv("KVTRACE_SGLANG_UNCHECKED", "1")
    version = resolve_any(f"sglang:{fake}")
    assert version.label == "sglang 0.5.24.dev3" and fake in version.origin


def test_missing_interpreter_and_missing_sglang(tmp_path: Path) -> None:
    with pytest.raises(VersionSpecError, match="is not an executable file"):
        resolve_any(f"sglang:{tmp_path / 'nope'}")
    with pytest.raises(VersionSpecError, match="give the interpreter"):
        resolve_any("sglang:")
    broken = _fake_python(tmp_path, "", code=1)
    with pytest.raises(VersionSpecError, match="sglang is not installed for"):
        resolve_any(f"sglang:{broken}")


def test_cli_error_without_sglang_exits_2_with_one_line(tmp_path: Path) -> None:
    result = runner.invoke(app, ["replay", "sample:tiny", "--allocator", f"sglang:{tmp_path / 'nope'}"])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "is not an executable file" in lines[0], result.output
    assert "Traceback" not in result.output


def test_versions_lists_sglang_with_what_was_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, _fake_python(tmp_path, "0.5.23"))
    result = runner.invoke(app, ["versions", "--json"])
    assert result.exit_code == 0, result.output
    rows = {v["name"]: v for v in json.loads(result.output)["versions"]}
    assert rows["sglang:PYTHON"]["origin"].startswith("sglang 0.5.23 at ")
    assert rows["sglang"]["kind"] == "sglang"


# ---------------------------------------------------------------------------- parity


def _diff(trace: str, a: str, b: str = "builtin", **kw: object) -> dict:
    from kvtrace.diff.diff import DiffOptions, diff_trace

    report = diff_trace(trace, a, b, options=DiffOptions(exact=True), jobs=1, **kw)  # type: ignore[arg-type]
    out = report.to_dict()
    assert report.identical, out["first_divergence"]
    assert out["steps_compared"] == out["a"]["steps"] > 0
    return out


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_tiny_identical_to_builtin_exactly(page_size: int) -> None:
    """Every op kind: chunked prefill, EAGLE, PD prealloc (need_sort), retract, abort."""
    python = _sglang_python()
    out = _diff("sample:tiny", f"sglang:{python}", page_size=page_size)
    assert out["a"]["retractions"] > 0 and out["a"]["aborts"] > 0
    assert out["a"]["overalloc"] == out["b"]["overalloc"]


@pytest.mark.slow
def test_out_of_memory_skip_and_every_check_identical() -> None:
    """A pool too small: OOMs named alike (request, need), the same requests dropped,
    SGLang's own pool checked after every call."""
    from kvtrace.replay.engine import ReplayOptions

    python = _sglang_python()
    out = _diff("sample:tiny", f"sglang:{python}", pool_tokens=1200,
                replay=ReplayOptions(on_oom="skip", check="every"))
    assert out["a"]["num_ooms"] > 0 and out["a"]["dropped_requests"] > 0
    assert out["a"]["num_violations"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["p1-chunked-retract", "p16-pd-explicit", "p64-spec"])
def test_generated_traces_identical(tmp_path: Path, shape: str) -> None:
    from traces.synth import generate

    python = _sglang_python()
    kw = {
        "p1-chunked-retract": dict(page_size=1, chunk_size=64, retract_prob=0.05),
        "p16-pd-explicit": dict(page_size=16, pd_decode=True, block_size=16, retract_prob=0.05, abort_prob=0.02,
                                explicit_fraction=0.3),
        "p64-spec": dict(page_size=64, spec=True, retract_prob=0.03),
    }[shape]
    path = str(tmp_path / f"{shape}.kvtrace")
    generate(path, num_requests=24, seed=11, pool_tokens=8192, max_context_len=2048, **kw)
    _diff(path, f"sglang:{python}")


@pytest.mark.slow
def test_two_sglang_environments_and_the_replay_command() -> None:
    python = _sglang_python()
    _diff("sample:tiny", f"sglang:{python}", f"sglang:{python}")
    result = runner.invoke(app, ["replay", "sample:tiny", "--allocator", f"sglang:{python}", "--check", "every", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["allocator"] == f"sglang:{python}" and summary["num_violations"] == 0
