"""Cache namespaces: ``kvtrace diff --a sglang --b builtin --exact`` identical on traces
whose requests share tokens across two namespaces, at pages 1 and 16 (SGLang's own
RadixCache keys the requests by ``Req.extra_key``); and on a recording from the tiny
sample put into three namespaces, with a pool small enough to evict.

Skipped unless ``KVTRACE_SGLANG_PYTHON`` names an interpreter with sglang 0.5.23.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from tests.differential import harness
from tests.namespaced import write_namespaced_trace

runner = CliRunner()


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16])
def test_shared_tokens_across_namespaces_identical_to_sglang_exactly(page_size: int, tmp_path: Path) -> None:
    python = harness.require_sglang()
    trace = write_namespaced_trace(tmp_path / f"ns-{page_size}.kvtrace", page_size)
    res = runner.invoke(app, ["diff", str(trace), "--a", f"sglang:{python}", "--b", "builtin", "--exact"])
    assert res.exit_code == 0, res.output
    assert "identical over 15 steps" in res.output


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16])
def test_a_namespaced_recording_identical_to_sglang_exactly(page_size: int, tmp_path: Path) -> None:
    python = harness.require_sglang()
    trace = tmp_path / f"tiny-ns-{page_size}.kvtrace"
    res = runner.invoke(app, ["record", "sample:tiny", "--pool-tokens", "2048", "--page-size", str(page_size),
                              "--namespaces", "3", "-o", str(trace), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout.strip().splitlines()[-1])["evicted_tokens"] > 0
    res = runner.invoke(app, ["diff", str(trace), "--a", f"sglang:{python}", "--b", "builtin", "--exact"])
    assert res.exit_code == 0, res.output
    assert "identical over" in res.output


def test_the_parity_trace_shares_tokens_across_namespaces() -> None:
    """What makes the parity above mean something: the trace's requests carry one prompt
    in two namespaces (and none), so a namespace-blind side would reuse across them."""
    import tempfile

    from tests.namespaced import NAMESPACE_OF
    from traces.reader import TraceReader

    with tempfile.TemporaryDirectory() as tmp:
        reader = TraceReader(write_namespaced_trace(Path(tmp) / "ns.kvtrace", 16))
        table = reader.meta.namespaces
        assert table is not None
        names = {table.name_of(rid) for rid in NAMESPACE_OF}
        assert {"lora-a", "lora-b", None} <= names
