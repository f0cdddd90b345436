"""Replaying and diffing a trace whose requests share tokens across two cache namespaces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.replay.engine import ReplayOptions
from kvtrace.replay.session import ReplaySession
from tests.namespaced import write_namespaced_trace

FAULTY = str(Path(__file__).with_name("faulty_allocators.py"))
runner = CliRunner()


@pytest.mark.parametrize(("ps", "reused"), [(1, 2 * 63), (16, 2 * 48)])
def test_requests_reuse_kv_of_their_own_namespace_only(tmp_path: Path, ps: int, reused: int) -> None:
    """Of five requests with one prompt, only the second of each namespace hits (ignoring
    namespaces, every request after the first would)."""
    trace = write_namespaced_trace(tmp_path / "ns.kvtrace", ps)
    with ReplaySession(str(trace), checker="inline", options=ReplayOptions(check="every")) as session:
        session.run()
        stats = session.result().stats
    assert stats.reused_tokens == reused and not stats.violations


def test_a_namespace_blind_cache_is_caught_by_the_invariant_blaming_the_request(tmp_path: Path) -> None:
    trace = write_namespaced_trace(tmp_path / "ns.kvtrace")
    with ReplaySession(str(trace), version=f"{FAULTY}:ignore_namespaces", checker="inline",
                       options=ReplayOptions(check="every")) as session:
        session.run()
        stats = session.result().stats
    assert stats.reused_tokens == 4 * 48
    first = stats.violations[0]
    assert (first.check, first.rid) == ("namespace", 0)
    assert "rid=0 (namespace 'lora-a') holds radix node" in first.detail
    assert {v.rid for v in stats.violations if v.op == "extend"} >= {1, 2, 4}


def test_diff_finds_the_namespace_blind_cache_at_the_first_cross_namespace_hit(tmp_path: Path) -> None:
    trace = write_namespaced_trace(tmp_path / "ns.kvtrace")
    result = runner.invoke(app, ["diff", str(trace), "--b", f"{FAULTY}:ignore_namespaces", "--jobs", "1", "--json"])
    assert result.exit_code == 1, result.output
    first = json.loads(result.stdout)["first_divergence"]
    assert {k: first[k] for k in ("step", "op", "rid", "field", "a", "b")} == {
        "step": 3, "op": "extend", "rid": 1, "field": "prefix_len", "a": 0, "b": 48,
    }
    same = runner.invoke(app, ["diff", str(trace), "--b", "builtin", "--exact", "--jobs", "1"])
    assert same.exit_code == 0 and "identical over 15 steps" in same.output


def test_a_shrunk_trace_keeps_each_kept_request_s_namespace_under_its_new_id(tmp_path: Path) -> None:
    """Shrinking renumbers the kept requests from 0: the table follows them."""
    import numpy as np

    from kvtrace.replay.session import open_trace
    from kvtrace.shrink.table import Candidate, TraceTable, build

    reader = open_trace(str(write_namespaced_trace(tmp_path / "ns.kvtrace")))
    table = TraceTable(reader.meta, list(reader.steps()))
    meta, _ = build(table, Candidate(np.flatnonzero(np.isin(table.rid, [1, 3, 4]))))
    assert [meta.namespaces.name_of(r) for r in range(3)] == ["lora-b", None, "lora-b"]
    meta, _ = build(table, Candidate(np.flatnonzero(table.rid == 3)))
    assert meta.namespaces is None and meta.format_version == 1


def test_a_host_tier_over_namespaces_is_refused_in_one_line(tmp_path: Path) -> None:
    """The tiered tree keys by tokens alone: a namespaced trace with a host tier would share
    KV across namespaces, so the replay refuses it (exit 2, one line)."""
    trace = write_namespaced_trace(tmp_path / "ns.kvtrace")
    res = CliRunner().invoke(app, ["replay", str(trace), "--hicache-ratio", "2"])
    assert res.exit_code == 2, res.output
    assert "cache namespaces" in res.output and "Traceback" not in res.output
    assert CliRunner().invoke(app, ["replay", str(trace)]).exit_code == 0
