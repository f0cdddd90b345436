"""``kvtrace record --namespaces N`` and namespaced workloads: the scheduler model keys
prefix matches by namespace, and the trace says which request is in which."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.record.simulate import round_robin_namespaces
from tests.namespaced import write_namespaced_trace
from traces.reader import TraceReader
from traces.workload_request import WorkloadRequest

runner = CliRunner()


def _record(*args: str) -> dict:
    result = runner.invoke(app, ["record", *args, "--force", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_one_namespace_per_request_leaves_no_prefix_to_share(tmp_path: Path) -> None:
    plain = _record("sample:mooncake-tiny", "-o", str(tmp_path / "plain.kvtrace"))
    alone = _record("sample:mooncake-tiny", "-o", str(tmp_path / "ns.kvtrace"), "--namespaces", "1000")
    assert plain["prefix_hit_tokens"] > 0 and alone["prefix_hit_tokens"] == 0
    meta = TraceReader(tmp_path / "ns.kvtrace").meta
    assert meta.format_version == 4 and meta.namespaces.of_rid == tuple(range(len(meta.namespaces.of_rid)))
    assert TraceReader(tmp_path / "plain.kvtrace").meta.namespaces is None


def test_the_replay_of_a_namespaced_recording_matches_what_was_recorded(tmp_path: Path) -> None:
    _record("sample:mooncake-tiny", "-o", str(tmp_path / "ns.kvtrace"), "--namespaces", "3")
    result = runner.invoke(app, ["replay", str(tmp_path / "ns.kvtrace"), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["prefix_differs_from_recorded"] == 0


def test_a_namespaced_trace_taken_as_a_workload_keeps_its_namespaces(tmp_path: Path) -> None:
    source = write_namespaced_trace(tmp_path / "src.kvtrace")
    _record(str(source), "-o", str(tmp_path / "again.kvtrace"), "--context-len", "512", "--pool-tokens", "1024")
    table = TraceReader(tmp_path / "again.kvtrace").meta.namespaces
    assert table is not None and table.names == ("lora-a", "lora-b")
    assert [table.name_of(r) for r in range(5)] == ["lora-a", "lora-b", "lora-a", None, "lora-b"]


def test_round_robin_counts_admitted_requests_only() -> None:
    lens = [10, 500, 20, 30, 40]  # the 500-token prompt is rejected: it gets no request id
    out = list(round_robin_namespaces((WorkloadRequest(0.0, n, 1) for n in lens), 2, max_input_len=100))
    assert [r.namespace for r in out] == ["adapter-0", None, "adapter-1", "adapter-0", "adapter-1"]
