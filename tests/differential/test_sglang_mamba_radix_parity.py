"""Parity of kvtrace's Mamba radix cache with SGLang 0.5.23's own classes, radix cache
on: ``kvtrace diff TRACE --a sglang --b builtin --exact`` is identical (every step's
state digest and both pools' counters, the Mamba pool's cached checkpoints included) on
the bundled radix-on hybrid sample and on hybrid traces recorded from two bundled
workloads, EAGLE on and off. SGLang serves a Mamba radix cache on CPU with
``no_buffer`` only, which needs page 1: pages 16 and 64 (``extra_buffer``) are refused
by the replay in one line. The SGLang side runs ``HybridReqToTokenPool`` and an enabled
``UnifiedRadixCache(FULL, MAMBA)`` (``kvtrace/sglang/world.py``, decision 13).

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
@pytest.mark.parametrize("workload", ["sample:mooncake-tiny", "sample:azure-code"])
@pytest.mark.parametrize("spec", [None, "eagle:3,1,4"])
def test_recorded_radix_hybrid_traces_are_identical(tmp_path: Path, workload: str, spec: str | None) -> None:
    harness.require_sglang()
    out = tmp_path / "hybrid.kvtrace"
    result = runner.invoke(app, ["record", workload, "--duration", "6s", "--page-size", "1", *MODEL,
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


@pytest.mark.parametrize("page_size", [16, 64])
def test_a_radix_hybrid_trace_above_page_1_is_refused_in_one_line(tmp_path: Path, page_size: int) -> None:
    out = tmp_path / "paged.kvtrace"
    result = runner.invoke(app, ["record", "sample:mooncake-tiny", "--duration", "1s", "--page-size", str(page_size),
                                 *MODEL, "-o", str(out), "-q"])  # fmt: skip
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["replay", str(out)])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"radix cache at page size {page_size}" in lines[0] and "extra_buffer" in lines[0]
