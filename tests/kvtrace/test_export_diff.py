"""``kvtrace diff TRACE --export``: the file is written from the diff's own replays (each
side replayed once), and each side's tracks are that side's replay."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace, TrackEvent
from typer.testing import CliRunner

from kvtrace.cli import app

runner = CliRunner()


def _counters_by_process(path: Path) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """Process name -> counter track name -> (ts, value), in file order."""
    trace = Trace.FromString(path.read_bytes())
    processes: dict[int, str] = {}
    tracks: dict[int, tuple[str, str]] = {}
    out: dict[str, dict[str, list[tuple[int, float]]]] = defaultdict(lambda: defaultdict(list))
    for p in trace.packet:
        if p.HasField("track_descriptor"):
            d = p.track_descriptor
            if d.HasField("process"):
                processes[d.uuid] = d.process.process_name
            else:
                tracks[d.uuid] = (processes[d.parent_uuid], d.name)
        elif p.HasField("track_event") and p.track_event.type == TrackEvent.TYPE_COUNTER:
            e = p.track_event
            proc, name = tracks[e.track_uuid]
            value = e.double_counter_value if e.HasField("double_counter_value") else e.counter_value
            out[proc][name].append((p.timestamp, value))
            for uuid, extra in zip(e.extra_counter_track_uuids, e.extra_counter_values, strict=True):
                out[proc][tracks[uuid][1]].append((p.timestamp, extra))
    return out


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_diff_export_replays_each_side_once_and_writes_what_it_compared(tmp_path: Path, monkeypatch,
                                                                        jobs: str) -> None:
    # --jobs 1: two sessions in this process, in lockstep; --jobs 2: two child processes whose
    # record batches reach this one. Either way no session is opened again for the export.
    from kvtrace.replay import session as session_module

    opened = []
    real_init = session_module.ReplaySession.__init__

    def counting_init(self, *args, **kwargs):  # the real constructor, counted
        opened.append(kwargs.get("version"))
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(session_module.ReplaySession, "__init__", counting_init)
    out = tmp_path / "diff.pftrace"
    result = runner.invoke(app, ["diff", "sample:tiny", "--b", "pre-encapsulation", "--jobs", jobs,
                                 "--export", str(out)])
    assert result.exit_code == 1, result.output  # diverged
    assert len(opened) == (2 if jobs == "1" else 0), opened
    monkeypatch.undo()
    # Each side's counters are its own replay's: A is the plain export of the trace.
    plain = tmp_path / "plain.pftrace"
    assert runner.invoke(app, ["export", "sample:tiny", "--out", str(plain)]).exit_code == 0
    both = _counters_by_process(out)
    assert sorted(both) == ["A: sample:tiny (builtin)", "B: sample:tiny (pre-encapsulation)"]
    assert both["A: sample:tiny (builtin)"] == _counters_by_process(plain)["sample:tiny (builtin)"]
    assert both["B: sample:tiny (pre-encapsulation)"] != both["A: sample:tiny (builtin)"]
