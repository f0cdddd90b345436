"""``kvtrace export --flows``: arrows from an eviction to the admissions that missed its
tokens, decoded from the Perfetto file with Perfetto's protobuf definitions, on a
hand-built trace whose eviction and miss are known (as in tests/kvtrace/test_explain.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace, TrackEvent
from typer.testing import CliRunner

from kvtrace.cli import app
from tests.kvtrace.test_explain import _prefill, _trace

runner = CliRunner()

P = list(range(200, 208))  # 8 tokens: two pages of 4
BIG = list(range(300, 328))  # 28 tokens: 7 pages


def _evicting_trace(tmp_path: Path) -> Path:
    """A pool of 8 pages. rid 0 caches P; rid 1's admission at step 3 needs 7 pages with 6
    free and evicts P; rid 2 (P + 1) and rid 3 (P + 2), admitted together at step 5, miss P."""
    steps = [
        [_prefill(0, P)], [("decode", 0, 9, 1)], [("finish", 0, 9, 0)],
        [_prefill(1, BIG)], [("finish", 1, 28, 0)],
        [_prefill(2, [*P, 5]), _prefill(3, [*P, 6, 7])],
    ]
    return _trace(tmp_path / "evict.kvtrace", steps, pool_tokens=32)


def _lane_slices(trace: Trace) -> dict[int, list[tuple[int, int, str]]]:
    """Per lane track: its request slices (begin, end, name), from the begin / end pairs."""
    out: dict[int, list[tuple[int, int, str]]] = {}
    stacks: dict[int, list[tuple[int, str]]] = {}
    for p in trace.packet:
        e = p.track_event
        if e.type == TrackEvent.TYPE_SLICE_BEGIN:
            stacks.setdefault(e.track_uuid, []).append((p.timestamp, e.name))
        elif e.type == TrackEvent.TYPE_SLICE_END:
            begin, name = stacks[e.track_uuid].pop()
            if not stacks[e.track_uuid]:
                out.setdefault(e.track_uuid, []).append((begin, p.timestamp, name))
    return out


def _enclosing(slices: dict[int, list[tuple[int, int, str]]], track: int, ts: int) -> str:
    (name,) = [n for b, e, n in slices.get(track, []) if b <= ts <= e]
    return name


def _args(e: Any) -> dict[str, Any]:
    return {a.name: (a.int_value if a.HasField("int_value") else a.string_value) for a in e.debug_annotations}


def test_a_flow_links_the_evicting_admission_to_each_admission_that_missed(tmp_path: Path) -> None:
    trace_path = _evicting_trace(tmp_path)
    out = tmp_path / "flows.pftrace"
    result = runner.invoke(app, ["export", str(trace_path), "--out", str(out), "--flows", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["flows"] == 2
    trace = Trace.FromString(out.read_bytes())
    slices = _lane_slices(trace)
    sources = {fid: p for p in trace.packet for fid in p.track_event.flow_ids}
    ends = {fid: p for p in trace.packet for fid in p.track_event.terminating_flow_ids}
    assert len(sources) == len(ends) == 2 and set(sources) == set(ends)
    got = []
    for fid, src in sources.items():
        dst = ends[fid]
        # The source sits in rid 1's slice at step 3 (its admission evicted P); the end in the
        # slice of the admission that missed P's 8 tokens, at its step.
        assert src.timestamp == 3 * 10**9 and _args(src.track_event)["evictor_rid"] == 1
        assert _enclosing(slices, src.track_event.track_uuid, src.timestamp) == "rid 1"
        assert _args(src.track_event)["trigger"] == "admission"
        args = _args(dst.track_event)
        assert args["missed_tokens"] == 8 and args["eviction_step"] == 3
        got.append((dst.timestamp, _enclosing(slices, dst.track_event.track_uuid, dst.timestamp), args["rid"]))
    assert sorted(got) == [(5 * 10**9, "rid 2", 2), (5 * 10**9, "rid 3", 3)]


def test_without_flows_the_file_has_none_and_chrome_gets_s_and_f(tmp_path: Path) -> None:
    trace_path = _evicting_trace(tmp_path)
    plain = tmp_path / "plain.pftrace"
    assert runner.invoke(app, ["export", str(trace_path), "--out", str(plain)]).exit_code == 0
    assert not any(p.track_event.flow_ids or p.track_event.terminating_flow_ids
                   for p in Trace.FromString(plain.read_bytes()).packet)
    out = tmp_path / "flows.json"
    assert runner.invoke(app, ["export", str(trace_path), "--out", str(out), "--flows"]).exit_code == 0
    events = json.loads(out.read_text())["traceEvents"]
    lane_of = {}  # tid -> the request slices open on it: (begin, end, name)
    stack: dict[int, list[tuple[float, str]]] = {}
    for e in events:
        if e["ph"] == "B":
            stack.setdefault(e["tid"], []).append((e["ts"], e["name"]))
        elif e["ph"] == "E":
            begin, name = stack[e["tid"]].pop()
            if not stack[e["tid"]]:
                lane_of.setdefault(e["tid"], []).append((begin, e["ts"], name))
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    finishes = {e["id"]: e for e in events if e["ph"] == "f"}
    assert len(starts) == 2 and set(starts) == set(finishes)

    def within(e: dict[str, Any]) -> str:
        (name,) = [n for b, end, n in lane_of[e["tid"]] if b <= e["ts"] <= end]
        return name

    assert {within(s) for s in starts.values()} == {"rid 1"}
    assert sorted(within(f) for f in finishes.values()) == ["rid 2", "rid 3"]


def test_flows_need_a_replay_with_a_radix_cache(tmp_path: Path) -> None:
    log = tmp_path / "tiny.arrow"
    assert runner.invoke(app, ["replay", "sample:tiny", "--out", str(log)]).exit_code == 0
    refused = runner.invoke(app, ["export", str(log), "--out", str(tmp_path / "a.pftrace"), "--flows"])
    assert refused.exit_code == 2 and "--flows applies to a trace" in refused.output
    no_cache = runner.invoke(app, ["export", "sample:mooncake-gpt-oss", "--out", str(tmp_path / "b.pftrace"),
                                   "--flows"])
    assert no_cache.exit_code == 2 and "no prefix hit to explain" in no_cache.output
    assert not (tmp_path / "a.pftrace").exists() and not (tmp_path / "b.pftrace").exists()
