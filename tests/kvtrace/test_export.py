"""``kvtrace export``: the timeline model, the Perfetto trace decoded with Perfetto's own
protobuf definitions, the Chrome JSON, and the command's input and output contracts."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace, TrackEvent
from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.export.run import ProcessExport, open_timeline_file
from kvtrace.export.timeline import COUNTERS, HitRate, SliceBegin, SliceEnd, TimelineBuilder
from kvtrace.replay.session import ReplaySession
from kvtrace.replay.snapshot import PHASES, PoolCounters, RequestDelta, StepSnapshot
from traces.schema import DECODE, EXTEND, FINISH, PREALLOC

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()
_FIELDS = ("available", "evictable", "protected", "committed", "overallocated")


def _export(*args: str) -> Any:
    return runner.invoke(app, ["export", *args])


def _decode(path: Path) -> dict[str, Any]:
    """The tracks and events of a .pftrace, by track name."""
    trace = Trace.FromString(path.read_bytes())
    names: dict[int, str] = {}
    processes: dict[int, str] = {}
    parents: dict[int, int] = {}
    counters: dict[str, list[tuple[int, float]]] = defaultdict(list)
    slices: dict[str, list[tuple[str, int, Any]]] = defaultdict(list)  # track -> (B|E, ts, name/args)
    instants: list[tuple[int, str, dict[str, Any]]] = []
    for packet in trace.packet:
        if packet.HasField("track_descriptor"):
            d = packet.track_descriptor
            if d.HasField("process"):
                processes[d.uuid] = d.process.process_name
            else:
                names[d.uuid] = d.name
                parents[d.uuid] = d.parent_uuid
            continue
        if not packet.HasField("track_event"):
            continue
        e = packet.track_event
        track = names[e.track_uuid]  # a track is described before its first event
        args = {a.name: (a.int_value if a.HasField("int_value") else a.string_value) for a in e.debug_annotations}
        if e.type == TrackEvent.TYPE_COUNTER:
            value = e.double_counter_value if e.HasField("double_counter_value") else e.counter_value
            counters[track].append((packet.timestamp, value))
            for uuid, extra in zip(e.extra_counter_track_uuids, e.extra_counter_values, strict=True):
                counters[names[uuid]].append((packet.timestamp, extra))
        elif e.type == TrackEvent.TYPE_SLICE_BEGIN:
            slices[track].append(("B", packet.timestamp, e.name))
        elif e.type == TrackEvent.TYPE_SLICE_END:
            slices[track].append(("E", packet.timestamp, args))
        elif e.type == TrackEvent.TYPE_INSTANT:
            assert track == "events"
            instants.append((packet.timestamp, e.name, args))
    return {"processes": processes, "parents": parents, "names": names, "counters": counters, "slices": slices,
            "instants": instants}


def _value_at(series: list[tuple[int, float]], ts: int) -> float:
    """A counter's value at ``ts``: the last one written at or before it."""
    value = None
    for t, v in series:
        if t > ts:
            break
        value = v
    assert value is not None
    return value


def _request_slices(events: list[tuple[str, int, Any]]) -> list[tuple[int, int, str]]:
    """The depth-0 slices (requests) of one lane: (begin, end, name), checking the nesting."""
    out, stack = [], []
    for kind, ts, what in events:
        if kind == "B":
            stack.append((ts, what))
        else:
            begin, name = stack.pop()
            assert ts >= begin
            if not stack:
                out.append((begin, ts, name))
    assert not stack, "a slice left open"
    return out


def test_the_perfetto_trace_decodes_and_its_counters_are_the_replays(tmp_path: Path) -> None:
    out = tmp_path / "tiny.pftrace"
    result = _export("sample:tiny", "--to", "perfetto", "--out", str(out))
    assert result.exit_code == 0, result.output
    got = _decode(out)
    assert list(got["processes"].values()) == ["sample:tiny (builtin)"]
    process = next(iter(got["processes"]))
    assert set(got["parents"].values()) == {process}  # every track under the replay's process
    for counter in COUNTERS:
        assert f"full {counter}" in got["counters"]
    assert "prefix hit rate" in got["counters"]
    with ReplaySession("sample:tiny", checker="inline") as session:
        snaps = list(session.snapshots())
    assert len(snaps) == 139
    for snap in (snaps[0], snaps[10], snaps[57], snaps[100], snaps[-1]):
        ts = int(round(snap.time_s * 1e9))
        for counter, field in zip(COUNTERS, _FIELDS, strict=True):
            assert _value_at(got["counters"][f"full {counter}"], ts) == getattr(snap.pool, field), (snap.step, counter)
    rates = [v for _, v in got["counters"]["prefix hit rate"]]
    assert all(0 <= v <= 100 for v in rates) and any(v > 0 for v in rates)


def test_request_lanes_never_overlap_and_are_as_many_as_the_peak(tmp_path: Path) -> None:
    out = tmp_path / "tiny.pftrace"
    assert _export("sample:tiny", "--out", str(out)).exit_code == 0
    got = _decode(out)
    lanes = {name: _request_slices(ev) for name, ev in got["slices"].items()}
    assert sorted(lanes) == [f"lane {i}" for i in range(len(lanes))]
    intervals = []
    for slices in lanes.values():
        for (b0, e0, _), (b1, _, _) in zip(slices, slices[1:]):
            assert e0 <= b1, "two requests overlap on one lane"
        intervals += [(b, e) for b, e, _ in slices]
    # The peak number of requests open at once (an end before a begin at the same instant).
    points = sorted([(b, 1) for b, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda p: (p[0], p[1]))
    peak = max(np.cumsum([d for _, d in points]))
    assert len(lanes) == peak
    # Every admission is a slice: each request once, and once more after each retraction (every
    # request of the sample ends, finished or aborted); ends carry the lengths.
    summary = json.loads(_export("sample:tiny", "--out", str(tmp_path / "b.pftrace"), "--json").stdout)["replay"]
    assert summary["finishes"] + summary["aborts"] == summary["requests"] == 32
    assert len(intervals) == summary["requests"] + summary["retractions"] == 37
    ends = [what for ev in got["slices"].values() for kind, _, what in ev if kind == "E" and what]
    assert {e["end"] for e in ends} >= {"finished", "retracted", "aborted"}
    assert all(e["kv_allocated_len"] >= e["kv_committed_len"] for e in ends)


def test_instants_for_evictions_retractions_aborts_and_overallocation(tmp_path: Path) -> None:
    out = tmp_path / "tiny.pftrace"
    assert _export("sample:tiny", "--out", str(out)).exit_code == 0
    kinds = defaultdict(int)
    for _, name, _ in _decode(out)["instants"]:
        kinds[name] += 1
    assert kinds["evict"] == 13 and kinds["retract"] == 5 and kinds["abort"] == 6 and kinds["overalloc_release"] == 16
    assert "finish" not in kinds  # a finish ends its request's slice


def test_an_out_of_memory_is_an_instant_and_stopping_at_it_exits_1(tmp_path: Path) -> None:
    skipped = tmp_path / "skip.pftrace"
    result = _export("sample:tiny", "--pool-tokens", "1024", "--on-oom", "skip", "--out", str(skipped))
    assert result.exit_code == 0, result.output
    got = _decode(skipped)
    ooms = [args for _, name, args in got["instants"] if name == "oom"]
    assert ooms and all("rid" in args for args in ooms)
    assert {"dropped"} <= {name for _, name, _ in got["instants"]}
    # --on-oom stop: the file holds the steps up to the out-of-memory, and the exit code says it.
    stopped = tmp_path / "stop.pftrace"
    result = _export("sample:tiny", "--pool-tokens", "1024", "--out", str(stopped), "--json")
    assert result.exit_code == 1, result.output
    summary = json.loads(result.stdout)
    oom = summary["replay"]["oom"]
    assert summary["last_step"] == oom["step"] < 138
    assert [args["rid"] for _, name, args in _decode(stopped)["instants"] if name == "oom"] == [oom["rid"]]


def test_the_hit_rate_over_a_window_of_every_admission_is_the_replays() -> None:
    builder = TimelineBuilder(hit_window=10**6)
    with ReplaySession("sample:mooncake-tiny", checker="inline") as session:
        rates = [r.value for snap in session.snapshots() for r in builder.feed(snap) if isinstance(r, HitRate)]
        expected = session.result().to_dict()["prefix_hit_rate"]
    assert expected > 0 and rates[-1] == pytest.approx(expected, abs=1e-6)


def test_the_chrome_json_follows_the_trace_event_format(tmp_path: Path) -> None:
    out = tmp_path / "tiny.json"
    result = _export("sample:tiny", "--to", "chrome", "--out", str(out))
    assert result.exit_code == 0, result.output
    events = json.loads(out.read_text())["traceEvents"]
    open_slices: dict[tuple[int, int], int] = defaultdict(int)
    kinds = defaultdict(int)
    for e in events:
        assert {"ph", "pid", "tid"} <= set(e), e
        kinds[e["ph"]] += 1
        if e["ph"] != "M":
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
        if e["ph"] == "C":
            assert e["args"] and all(isinstance(v, (int, float)) for v in e["args"].values())
        if e["ph"] == "B":
            open_slices[e["pid"], e["tid"]] += 1
        if e["ph"] == "E":
            open_slices[e["pid"], e["tid"]] -= 1
            assert open_slices[e["pid"], e["tid"]] >= 0
    assert not any(open_slices.values())
    assert kinds["C"] > 100 and kinds["B"] == kinds["E"] > 0 and kinds["i"] == 13 + 5 + 6 + 16
    pool = [e for e in events if e["ph"] == "C" and e["name"] == "full pool (tokens)"]
    assert set(pool[0]["args"]) == set(COUNTERS)
    # Without --to, a .json file gets the JSON format (and any other name Perfetto's).
    by_name = tmp_path / "by-name.json"
    assert _export("sample:tiny", "--out", str(by_name)).exit_code == 0
    assert json.loads(by_name.read_text())["traceEvents"] == events


def test_a_state_log_exports_as_its_replay_did(tmp_path: Path) -> None:
    log = tmp_path / "tiny.arrow"
    replayed = runner.invoke(app, ["replay", "sample:tiny", "--out", str(log), "--json"])
    assert replayed.exit_code == 0, replayed.output
    from_trace, from_log = tmp_path / "t.pftrace", tmp_path / "l.pftrace"
    assert _export("sample:tiny", "--out", str(from_trace)).exit_code == 0
    result = _export(str(log), "--out", str(from_log), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["kind"] == "state_log"
    a, b = _decode(from_trace), _decode(from_log)
    assert a["counters"] == b["counters"] and a["slices"] == b["slices"] and a["instants"] == b["instants"]
    # Replay options belong to a trace: one line, exit 2.
    refused = _export(str(log), "--out", str(tmp_path / "x.pftrace"), "--pool-tokens", "2048")
    assert refused.exit_code == 2
    assert "--pool-tokens applies to a trace" in refused.output and not (tmp_path / "x.pftrace").exists()


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    missing = _export(str(tmp_path / "nope.kvtrace"), "--out", str(tmp_path / "a.pftrace"))
    assert missing.exit_code == 2
    assert len(missing.output.strip().splitlines()) == 1 and "nope.kvtrace" in missing.output
    junk = tmp_path / "junk.kvtrace"
    junk.write_bytes(b"not arrow at all")
    bad = _export(str(junk), "--out", str(tmp_path / "a.pftrace"))
    assert bad.exit_code == 2 and len(bad.output.strip().splitlines()) == 1
    assert not (tmp_path / "a.pftrace").exists()
    unknown = _export("sample:tiny", "--to", "svg", "--out", str(tmp_path / "a.svg"))
    assert unknown.exit_code == 2


def test_an_existing_file_is_replaced_only_with_force_and_whole(tmp_path: Path) -> None:
    out = tmp_path / "tiny.pftrace"
    out.write_bytes(b"mine")
    refused = _export("sample:tiny", "--out", str(out))
    assert refused.exit_code == 2 and "--force" in refused.output
    assert out.read_bytes() == b"mine"
    assert _export("sample:tiny", "--out", str(out), "--force").exit_code == 0
    assert len(_decode(out)["slices"]) > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.pftrace"]  # no temporary file left


@pytest.mark.slow
def test_an_interrupted_export_leaves_no_file(tmp_path: Path) -> None:
    # A real process, killed by SIGTERM mid-way through the one-hour sample.
    import signal
    import time

    out = tmp_path / "conv.pftrace"
    proc = subprocess.Popen([sys.executable, "-m", "kvtrace", "export", "sample:mooncake-conversation", "--out", str(out)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    deadline = time.monotonic() + 60
    while not any(tmp_path.iterdir()) and time.monotonic() < deadline:  # the temporary file is being written
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert list(tmp_path.iterdir()) == []


def test_packets_are_written_as_the_replay_goes() -> None:
    # Streamed: each step's packets reach the file when the step is fed, not at the end.
    buf = io.BytesIO()
    with open_timeline_file_obj(buf) as out:
        export = ProcessExport(out, "stream")
        sizes = []
        with ReplaySession("sample:tiny", checker="inline") as session:
            for snap in session.snapshots():
                export.feed(snap)
                sizes.append(buf.tell())
        export.finish()
    assert sizes[0] > 0 and all(b > a for a, b in zip(sizes[::20], sizes[20::20]))


def open_timeline_file_obj(buf: io.BytesIO) -> Any:
    from contextlib import nullcontext

    from kvtrace.export.perfetto import PerfettoFile

    return nullcontext(PerfettoFile(buf))


def _snap(step: int, rids: list[int], phases: list[str], ops: list[int], committed: list[int],
          prefix: list[int] | None = None) -> StepSnapshot:
    n = len(rids)
    arr = np.array(committed, np.int64)
    delta = RequestDelta(np.array(rids, np.int64), arr, arr, np.zeros(n, np.int64), np.array(ops, np.int8),
                         np.array([PHASES.index(p) for p in phases], np.int8),
                         np.array(prefix or [0] * n, np.int64))
    pool = PoolCounters(100, 100 - step, 0, 0, step, 0, n, 8)
    return StepSnapshot(step, step * 0.5, pool, delta, (), n, 0.0)


def test_a_lane_freed_in_a_step_takes_that_steps_admission_and_the_hit_rate_slides() -> None:
    b = TimelineBuilder(hit_window=2)
    recs = b.feed(_snap(0, [0, 1], ["decode", "decode"], [EXTEND, EXTEND], [10, 10], prefix=[5, 0]))
    assert [r.lane for r in recs if isinstance(r, SliceBegin) and r.name.startswith("rid")] == [0, 1]
    # rid 0 finishes while rid 2 is admitted: rid 2 takes lane 0, after rid 0's slice ends.
    recs = b.feed(_snap(1, [2, 0, 1], ["prefill", "finished", "decode"], [EXTEND, FINISH, DECODE], [4, 0, 11]))
    kinds = [(type(r).__name__, r.lane) for r in recs if isinstance(r, (SliceBegin, SliceEnd))]
    assert kinds == [("SliceEnd", 0), ("SliceEnd", 0), ("SliceBegin", 0), ("SliceBegin", 0)]
    end = [r for r in recs if isinstance(r, SliceEnd) and r.args][0]
    assert end.args == {"end": "finished", "kv_committed_len": 10, "kv_allocated_len": 10, "prompt_len": 10,
                        "output_len": 0}
    rates = [r.value for r in b.feed(_snap(2, [2], ["decode"], [EXTEND], [8], prefix=[0]))
             if type(r).__name__ == "HitRate"]
    assert rates == [0.0]  # window of 2: (rid 1: 0/10) and (rid 2: 0/8); rid 0's 5/10 slid out
    assert b.num_lanes == b.peak_concurrency == 2
    # A PD decode's pre-allocation is no prefill admission: it leaves the hit rate alone.
    b.feed(_snap(3, [3], ["waiting"], [PREALLOC], [50], prefix=[40]))
    recs = b.feed(_snap(4, [3], ["decode"], [DECODE], [51]))
    assert [r for r in recs if isinstance(r, HitRate)] == [] and b.num_lanes == 3
    closing = b.finish()
    assert sum(isinstance(r, SliceEnd) and r.args.get("end") == "running" for r in closing) == 3
    ends = [r.args for r in closing if isinstance(r, SliceEnd) and r.args]
    assert {"end": "running", "kv_committed_len": 51, "kv_allocated_len": 51, "prompt_len": 50, "output_len": 1} in ends


@pytest.mark.slow
def test_the_one_hour_sample_exports_with_lanes_within_the_running_limit(tmp_path: Path) -> None:
    out = tmp_path / "conv.pftrace"
    result = _export("sample:mooncake-conversation", "--out", str(out), "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["steps"] == 77271 and 0 < summary["lanes"] <= summary["replay"]["max_running"]
    assert Trace.FromString(out.read_bytes()).packet


def test_a_diff_exports_both_sides_on_one_clock_with_the_divergence_marked(tmp_path: Path) -> None:
    out = tmp_path / "diff.pftrace"
    result = runner.invoke(app, ["diff", "sample:tiny", "--b", "pre-encapsulation", "--export", str(out), "--json"])
    assert result.exit_code == 1, result.output  # diverged
    report = json.loads(result.stdout)
    assert report["export"] == str(out) and report["first_divergence"]["step"] == 1
    trace = Trace.FromString(out.read_bytes())
    processes = {p.track_descriptor.process.pid: p.track_descriptor.process.process_name
                 for p in trace.packet if p.track_descriptor.HasField("process")}
    assert sorted(processes.values()) == ["A: sample:tiny (builtin)", "B: sample:tiny (pre-encapsulation)"]
    with ReplaySession("sample:tiny", checker="inline") as session:
        step1 = [s for s in session.snapshots() if s.step == 1][0]
    marks = [(p.trusted_packet_sequence_id, p.timestamp) for p in trace.packet
             if p.track_event.name == "first divergence"]
    assert sorted(marks) == [(1, int(round(step1.time_s * 1e9))), (2, int(round(step1.time_s * 1e9)))]
    again = runner.invoke(app, ["diff", "sample:tiny", "--b", "pre-encapsulation", "--export", str(out)])
    assert again.exit_code == 2 and "--force" in again.output
