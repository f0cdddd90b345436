"""The bundled hybrid sliding-window (SWA) samples: each is the shape it claims, replays
clean through both pools, and (with SGLang installed) SGLang's own SWA allocator
replays it state-identically to the built-in one."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from tests.differential import harness
from traces.reader import TraceReader
from traces.samples import sample_path

# name -> (window, sliding layers per full layer)
SWA_SAMPLES = {"mooncake-gpt-oss": (128, 1), "mooncake-gemma-3": (1024, 5)}


@pytest.mark.parametrize("name", sorted(SWA_SAMPLES))
def test_an_swa_sample_is_the_shape_it_claims_and_replays_clean(name: str) -> None:
    window, ratio = SWA_SAMPLES[name]
    meta = TraceReader(sample_path(name)).meta
    layout = meta.attention
    assert layout is not None and layout.sliding_window == window
    assert len(layout.swa_layer_ids) // len(layout.full_layer_ids) == ratio  # gemma-3-27b: 52 of 62 sliding
    assert meta.config.radix_cache is False and meta.config.page_size == 16
    result = CliRunner().invoke(app, ["replay", f"sample:{name}", "--json", "--check", "every"])
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["num_violations"] == 0 and summary["oom"] is None
    assert summary["pools"]["swa"]["pool_tokens"] == layout.swa_pool_tokens
    assert 0 < summary["pools"]["swa"]["peak_used_tokens"] <= layout.swa_pool_tokens


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SWA_SAMPLES))
def test_sglang_and_builtin_are_identical_on_an_swa_sample(name: str) -> None:
    # skipped unless $KVTRACE_SGLANG_PYTHON names an interpreter with SGLang 0.5.23
    python = harness.require_sglang()
    result = CliRunner().invoke(
        app, ["diff", f"sample:{name}", "--a", f"sglang:{python}", "--b", "builtin", "--exact", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["identical"] is True


@pytest.mark.slow
def test_sglang_reports_both_pools_as_the_builtin_does(tmp_path: Path) -> None:
    # every step's SWA pool counters, read off SGLang's SWATokenToKVPoolAllocator
    python = harness.require_sglang()
    tables = []
    for version in ("builtin", f"sglang:{python}"):
        log = tmp_path / f"{len(tables)}.kvstate"
        result = CliRunner().invoke(app, ["replay", "sample:mooncake-gpt-oss", "--allocator", version, "--out", str(log)])
        assert result.exit_code == 0, result.output
        tables.append(pa.ipc.open_file(log).read_all())
    swa_columns = [name for name in tables[0].schema.names if name.startswith("swa_")]
    assert len(swa_columns) == 8
    assert all(tables[0][name].equals(tables[1][name]) for name in swa_columns)


MOONCAKE = Path(__file__).resolve().parents[2] / "traces" / "workloads_data" / "mooncake-fast25" / "conversation_trace.jsonl"


@pytest.mark.slow
@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("model", ["gpt-oss-20b", "gemma-3-27b"])
def test_sglang_and_builtin_are_identical_on_a_recorded_swa_trace_with_the_radix_cache(
    tmp_path: Path, model: str, page: int
) -> None:
    # skipped unless $KVTRACE_SGLANG_PYTHON names an interpreter with SGLang 0.5.23
    python = harness.require_sglang()
    trace = tmp_path / "swa.kvtrace"
    recorded = CliRunner().invoke(app, [
        "record", str(MOONCAKE), "--model", model, "--page-size", str(page), "--pool-tokens", "60000",
        "--duration", "12s", "--out", str(trace), "--json",
    ])
    assert recorded.exit_code == 0, recorded.output
    assert json.loads(recorded.stdout)["evicted_tokens"] > 0  # the tree is under pressure
    result = CliRunner().invoke(
        app, ["diff", str(trace), "--a", f"sglang:{python}", "--b", "builtin", "--exact", "--json"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["identical"] is True, report
