"""The bundled hybrid linear-attention (Mamba) sample: the shape it claims, recorded with the
radix cache off, and it replays clean through both pools."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvtrace.cli import app
from traces.reader import TraceReader
from traces.samples import sample_path


def test_the_mamba_sample_is_the_shape_it_claims_and_replays_clean() -> None:
    meta = TraceReader(sample_path("mooncake-qwen3-next")).meta
    layout = meta.mamba
    assert layout is not None and layout.kind == "gdn" and layout.mamba_cache_size == 16
    assert len(layout.mamba_layer_ids) == 3 * len(layout.full_layer_ids)
    assert meta.config.radix_cache is False and meta.config.page_size == 16 and meta.format_version == 3
    result = CliRunner().invoke(app, ["replay", "sample:mooncake-qwen3-next", "--json", "--check", "every"])
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["num_violations"] == 0 and summary["oom"] is None
    assert summary["pools"]["mamba"]["pool_tokens"] == 16
    assert 0 < summary["pools"]["mamba"]["peak_used_tokens"] <= 16
