"""Parity of kvtrace's Mamba state pool with SGLang 0.5.23's own hybrid classes, radix
cache off: ``kvtrace diff TRACE --a sglang --b builtin --exact`` is identical (every
step's state digest, which holds the Mamba free list in order and each row's state slot,
and both pools' counters) on the bundled hybrid sample, on hybrid traces recorded from
two bundled workloads at pages 1, 16 and 64, on one with EAGLE and retractions, and on
a trace whose Mamba pool is too small (OOMs of pool "mamba"). The SGLang side runs ``HybridReqToTokenPool`` and
``UnifiedRadixCache(FULL, MAMBA)`` disabled (``kvtrace/sglang/world.py``, decision 13).

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
MODEL = ["--model", "qwen3-next-80b-a3b", "--no-radix-cache", "--pool-tokens", "60000"]


def diff_exact(trace: str, *extra: str) -> dict[str, Any]:
    python = harness.require_sglang()
    result = runner.invoke(app, ["diff", trace, "--a", f"sglang:{python}", "--b", "builtin", "--exact", "--json",
                                 *extra])  # fmt: skip
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)  # type: ignore[no-any-return]


@pytest.mark.slow
def test_the_bundled_mamba_sample_is_identical() -> None:
    report = diff_exact("sample:mooncake-qwen3-next")
    assert report["identical"] is True
    assert report["a"]["pools"]["mamba"] == report["b"]["pools"]["mamba"]


@pytest.mark.slow
@pytest.mark.parametrize("workload", ["sample:mooncake-tiny", "sample:azure-code"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_recorded_hybrid_traces_are_identical(tmp_path: Path, workload: str, page_size: int) -> None:
    harness.require_sglang()
    out = tmp_path / "hybrid.kvtrace"
    result = runner.invoke(app, ["record", workload, "--duration", "6s", "--page-size", str(page_size), *MODEL,
                                 "-o", str(out), "-q"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert diff_exact(str(out))["identical"] is True


@pytest.mark.slow
def test_speculative_decoding_and_retractions_are_identical(tmp_path: Path) -> None:
    # EAGLE 5,4,8 at page 64 in a 40k-token pool: the draft reserve forces retractions,
    # which free each retracted request's state slot.
    harness.require_sglang()
    out = tmp_path / "pressure.kvtrace"
    model = ["--model", "qwen3-next-80b-a3b", "--no-radix-cache", "--pool-tokens", "40000"]
    result = runner.invoke(app, ["record", "sample:mooncake-tiny", "--duration", "12s", "--page-size", "64",
                                 "--spec", "eagle:5,4,8", *model, "-o", str(out), "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["retractions"] > 0
    report = diff_exact(str(out))
    assert report["identical"] is True and report["b"]["retractions"] > 0


@pytest.mark.slow
def test_a_mamba_pool_too_small_runs_out_alike(tmp_path: Path) -> None:
    def edit(data: dict[str, Any]) -> None:
        data["mamba"]["mamba_cache_size"] = 3

    trace = with_meta(sample_path("mooncake-qwen3-next"), tmp_path / "small.kvtrace", edit)
    report = diff_exact(str(trace), "--on-oom", "skip")
    assert report["identical"] is True
    assert report["b"]["pools"]["mamba"]["num_ooms"] > 0


def test_the_sglang_side_takes_the_traces_mamba_pool_as_it_can_drive_it() -> None:
    """The replay's Mamba pool reaches SGLang's side as its scenario (slots, strategy); a
    strategy SGLang's side cannot drive from a trace (lazy, or the overlap scheduler's) is
    refused there, not replayed otherwise."""
    import dataclasses

    from kvtrace.replay.config import allocator_config_for
    from kvtrace.sglang.scenario import ScenarioError
    from kvtrace.sglang.server import _mamba_spec
    from traces.reader import TraceReader

    config = allocator_config_for(TraceReader(sample_path("mooncake-qwen3-next")).meta)
    assert config.mamba is not None
    spec = _mamba_spec(dataclasses.asdict(config))
    assert spec is not None and spec.slots == config.mamba.slots and spec.strategy == "no_buffer"
    assert _mamba_spec({"mamba": None}) is None
    assert _mamba_spec({"mamba": {"slots": 4, "strategy": "extra_buffer"}}).strategy == "extra_buffer"
    for mamba in ({"slots": 4, "strategy": "extra_buffer_lazy"}, {"slots": 4, "strategy": "extra_buffer",
                                                                   "overlap_schedule": True}):
        with pytest.raises(ScenarioError, match="no overlap scheduler only"):
            _mamba_spec({"mamba": mamba})
