"""StateLogSession: a state log stepped and sought like a replay session; bad logs are one
clear error."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtrace.errors import TraceError
from kvtrace.statelog.session import StateLogSession
from kvtrace.replay.session import ReplaySession
from kvtrace.statelog.log import STATE_LOG_METADATA_KEY, STATE_LOG_SCHEMA, StateLogWriter

TINY = "sample:tiny"


@pytest.fixture(scope="module")
def tiny_log(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, list]]:
    """A log of the tiny sample in 16-step batches, and the straight fold's table at each step."""
    path = tmp_path_factory.mktemp("log") / "tiny.log"
    tables = {}
    with ReplaySession(TINY, track_state=True, checker="inline") as s:
        with StateLogWriter(path, {"trace": TINY, "config": {"page_size": s.config.page_size}}, steps_per_batch=16) as w:
            for snap in s.snapshots():
                w.write(snap)
                tables[snap.step] = s.state.table()
    return path, tables


def test_steps_through_the_whole_log(tiny_log) -> None:  # noqa: ANN001
    path, tables = tiny_log
    with StateLogSession(path) as log:
        assert (log.first_step, log.last_step, log.total_steps) == (0, 138, 139)
        steps = [snap.step for snap in log.snapshots()]
        assert steps == sorted(tables)
        assert log.done and log.state.table() == tables[138]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(-5, 150), min_size=1, max_size=8))
def test_seeks_land_on_the_straight_fold(tiny_log, targets: list[int]) -> None:  # noqa: ANN001
    path, tables = tiny_log
    log = StateLogSession(path, checkpoint_batches=2)
    for target in targets:
        snap = log.seek(target)
        expect = max([s for s in tables if s <= target], default=min(tables))
        assert snap is not None and snap.step == expect
        assert log.state.table() == tables[expect], target
    # stepping on after a seek continues from there
    nxt = log.step()
    if nxt is not None:
        assert log.state.table() == tables[nxt.step]


def test_bad_logs_are_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no such file"):
        StateLogSession(tmp_path / "missing.log")
    junk = tmp_path / "junk.log"
    junk.write_bytes(b"not arrow at all")
    with pytest.raises(TraceError, match="not an Arrow IPC stream or file"):
        StateLogSession(junk)
    other = tmp_path / "other.arrow"
    with pa.ipc.new_stream(pa.OSFile(str(other), "wb"), pa.schema([("x", pa.int64())])) as w:
        w.write_batch(pa.record_batch([pa.array([1])], names=["x"]))
    with pytest.raises(TraceError, match="not a kvtrace state log"):
        StateLogSession(other)
    old = tmp_path / "old.log"
    schema = STATE_LOG_SCHEMA.with_metadata({STATE_LOG_METADATA_KEY: json.dumps({"version": 1}).encode()})
    with pa.ipc.new_stream(pa.OSFile(str(old), "wb"), schema):
        pass
    with pytest.raises(TraceError, match="version 1 is not supported"):
        StateLogSession(old)
    empty = tmp_path / "empty.log"
    StateLogWriter(empty, {"trace": "x"}).close()
    with pytest.raises(TraceError, match="holds no step"):
        StateLogSession(empty)
