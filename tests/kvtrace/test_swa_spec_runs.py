"""A hybrid SWA trace with speculative decoding replayed with runs of speculative steps
(``KvAllocator.spec_decode_run``) equals it replayed step by step: the summary and
the state log (all but its timing column)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from kvtrace.replay.engine import ReplayOptions
from kvtrace.replay.session import ReplaySession
from kvtrace.statelog.log import TIMING_COLUMNS, StateLogWriter
from tests.helpers import with_meta
from traces.samples import sample_path

ROOT = Path(__file__).resolve().parents[2]

# gpt-oss's 1:1 alternation of its 24 layers with a 128-token window.
LAYOUT = {
    "full_layer_ids": list(range(1, 32, 2)),
    "swa_layer_ids": list(range(0, 32, 2)),
    "sliding_window": 128,
    "swa_full_tokens_ratio": 0.8,
    "swa_pool_tokens": 736_000,  # 0.8 of the sample's pool
}


def swa_eagle(tmp_path: Path) -> Path:
    """sample:mooncake-eagle (EAGLE 3,1,4, page 16) as if served by an SWA model."""

    def edit(data: dict[str, Any]) -> None:
        data.update(format_version=2, attention=dict(LAYOUT))

    return with_meta(sample_path("mooncake-eagle"), tmp_path / "swa-eagle.kvtrace", edit)


def replay_both(trace: Path, tmp_path: Path, stop_step: int | None = None) -> list[tuple[dict[str, Any], pa.Table, int]]:
    """The summary, the state log (timings dropped) and the number of spec runs done in
    one call, with runs and step by step."""
    out = []
    for runs in (True, False):
        options = ReplayOptions(check="end", decode_runs=runs, stop_step=stop_step)
        log_path = tmp_path / f"log-{runs}.arrow"
        with ReplaySession(trace, options=options) as s, StateLogWriter(log_path, {"trace": str(trace)}) as log:
            alloc = s.allocator
            real = alloc.spec_decode_run  # type: ignore[attr-defined]
            done = [0]

            def counted(rids: Any, accepted: Any) -> Any:
                got = real(rids, accepted)
                done[0] += got is not None
                return got

            alloc.spec_decode_run = counted  # type: ignore[attr-defined]
            for snap in s.snapshots():
                log.write(snap)
            summary = s.result().to_dict()
        for key in ("wall_s", "allocator_s", "speedup_vs_realtime"):
            summary.pop(key, None)
        out.append((summary, pa.ipc.open_file(log_path).read_all().drop_columns(list(TIMING_COLUMNS)), done[0]))
    return out


def test_an_swa_eagle_replay_with_spec_runs_equals_it_step_by_step(tmp_path: Path) -> None:
    (runs_summary, runs_log, runs_done), (steps_summary, steps_log, steps_done) = replay_both(
        swa_eagle(tmp_path), tmp_path, stop_step=250
    )
    assert runs_done > 0 and steps_done == 0
    assert "swa_available" in runs_log.column_names
    assert runs_summary == steps_summary
    assert runs_log.equals(steps_log)


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_a_recorded_gpt_oss_eagle_trace_replays_with_spec_runs_as_step_by_step(tmp_path: Path, page_size: int) -> None:
    """``kvtrace record --model gpt-oss-20b --spec eagle:3,1,4``, replayed both ways."""
    trace = tmp_path / "eagle.kvtrace"
    subprocess.run(
        [sys.executable, "-m", "kvtrace", "record",
         str(ROOT / "traces/workloads_data/mooncake-fast25/conversation_trace.jsonl"), "--duration", "4s",
         "--model", "gpt-oss-20b", "--page-size", str(page_size), "--pool-tokens", "30000",
         "--spec", "eagle:3,1,4", "-o", str(trace), "-q"],
        check=True, capture_output=True, cwd=ROOT, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    (runs_summary, runs_log, runs_done), (steps_summary, steps_log, _) = replay_both(trace, tmp_path)
    assert runs_done > 0
    assert runs_summary == steps_summary
    assert runs_log.equals(steps_log)
