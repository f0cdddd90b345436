"""Parity of kvtrace's Mamba radix cache with SGLang 0.5.23's own classes, radix cache
on: ``kvtrace diff TRACE --a sglang --b builtin --exact`` is identical (every step's
state digest and both pools' counters, the Mamba pool's cached checkpoints included) on
the bundled radix-on hybrid sample and on hybrid traces recorded from two bundled
workloads at pages 1, 16 and 64, EAGLE on and off. Page 1 runs SGLang's ``no_buffer``
strategy; pages 16 and 64 its non-overlap ``extra_buffer`` (a tracking slot per request),
which SGLang's server refuses on CPU but its pool and tree classes run there. The SGLang
side runs ``HybridReqToTokenPool`` and an enabled ``UnifiedRadixCache(FULL, MAMBA)``
(``kvtrace/sglang/world.py``, decisions 13 to 15). A Mamba2 model (Nemotron-H), which
SGLang serves with no extra_buffer, is refused above page 1 in one line.

Skipped unless ``KVTRACE_SGLANG_PYTHON`` names the interpreter of a venv made by
``tools/sglang_oracle/setup.sh``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from tests.differential import harness
from tests.helpers import with_meta
from traces.samples import sample_path

runner = CliRunner()
MODEL = ["--model", "qwen3-next-80b-a3b", "--radix-cache", "--pool-tokens", "60000"]


def diff_exact(trace: str, *extra: str) -> dict[str, Any]:
    python = harness.require_sglang()
    result = runner.invoke(app, ["diff", trace, "--a", f"sglang:{python}", "--b", "builtin", "--exact", "--json",
                                 *extra])  # fmt: skip
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)  # type: ignore[no-any-return]


@pytest.mark.slow
def test_the_bundled_radix_sample_is_identical() -> None:
    report = diff_exact("sample:mooncake-qwen3-next-radix")
    assert report["identical"] is True
    assert report["a"]["pools"]["mamba"] == report["b"]["pools"]["mamba"]


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("workload", ["sample:mooncake-tiny", "sample:azure-code"])
@pytest.mark.parametrize("spec", [None, "eagle:3,1,4"])
def test_recorded_radix_hybrid_traces_are_identical(
    tmp_path: Path, workload: str, spec: str | None, page_size: int
) -> None:
    harness.require_sglang()
    out = tmp_path / "hybrid.kvtrace"
    result = runner.invoke(app, ["record", workload, "--duration", "6s", "--page-size", str(page_size), *MODEL,
                                 *(["--spec", spec] if spec else []), "-o", str(out), "-q"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert diff_exact(str(out))["identical"] is True


@pytest.mark.slow
def test_a_mamba_pool_too_small_for_the_rows_runs_out_alike(tmp_path: Path) -> None:
    # 8 slots serve 2 rows at 3 per request: the trace's wider batches are OOMs of rows,
    # and an extend retried without the dropped request stashes its chunks once
    def edit(data: dict[str, Any]) -> None:
        data["mamba"]["mamba_cache_size"] = 8

    trace = with_meta(sample_path("mooncake-qwen3-next-radix"), tmp_path / "small.kvtrace", edit)
    report = diff_exact(str(trace), "--on-oom", "skip")
    assert report["identical"] is True and report["b"]["num_ooms"] > 0


def test_a_radix_hybrid_trace_above_page_1_replays_with_a_tracking_slot_per_request(tmp_path: Path) -> None:
    out = tmp_path / "paged.kvtrace"
    result = runner.invoke(app, ["record", "sample:mooncake-tiny", "--duration", "1s", "--page-size", "16",
                                 *MODEL, "-o", str(out), "-q"])  # fmt: skip
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["replay", str(out), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    mamba = report["pools"]["mamba"]
    # 4 slots per running request (3 + the tracking slot) cap the rows
    assert report["max_running"] == mamba["pool_tokens"] // 4


def test_a_mamba2_radix_trace_above_page_1_is_refused_in_one_line(tmp_path: Path) -> None:
    """SGLang has no extra_buffer for Mamba2 layers: record refuses such a trace above page
    1, and replay refuses to take a page-1 one there as a what-if, each in one line."""
    args = ["record", "sample:mooncake-tiny", "--duration", "1s", "--model", "nemotron-h-8b", "--radix-cache",
            "--pool-tokens", "60000", "-q"]
    paged = runner.invoke(app, [*args, "--page-size", "16", "-o", str(tmp_path / "paged.kvtrace")])
    assert paged.exit_code == 2 and len(paged.stderr.strip().splitlines()) == 1, paged.output
    assert "no extra_buffer" in paged.stderr and not (tmp_path / "paged.kvtrace").exists()
    out = tmp_path / "page1.kvtrace"
    result = runner.invoke(app, [*args, "--page-size", "1", "-o", str(out)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["replay", str(out), "--page-size", "16"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "radix cache at page size 16" in lines[0] and "no extra_buffer" in lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16])
def test_a_namespaced_radix_hybrid_trace_is_identical(tmp_path: Path, page_size: int) -> None:
    # three cache namespaces over shared prompts: both trees key the nodes (and states) by them
    harness.require_sglang()
    out = tmp_path / "namespaced.kvtrace"
    result = runner.invoke(app, ["record", "sample:mooncake-tiny", "--duration", "6s", "--page-size", str(page_size),
                                 *MODEL, "--namespaces", "3", "-o", str(out), "-q"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert diff_exact(str(out))["identical"] is True
