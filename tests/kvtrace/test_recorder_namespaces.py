"""The recorder API carries cache namespaces: given with a request's first row, stored in
the metadata when the recorder closes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtrace.record.recorder import Recorder
from tests.helpers import make_meta
from traces.reader import TraceReader


def _record(path: Path, **kwargs: object) -> None:
    with Recorder(path, make_meta(), **kwargs) as rec:  # type: ignore[arg-type]
        rec.begin_step(0.0)
        rec.extend(["req-a", "req-b", "req-c"], [8, 8, 8], prompt_lens=[8, 8, 8],
                   namespaces=["lora-1", None, "lora-2"])
        rec.end_step()
        rec.begin_step(0.1)
        rec.decode(["req-a", "req-b", "req-c"], [9, 9, 9])
        rec.extend(["req-d"], [4], prompt_lens=[4], namespaces=["lora-1"])
        rec.end_step()


@pytest.mark.parametrize("compact", [None, 16])
def test_the_closed_trace_holds_each_request_s_namespace(tmp_path: Path, compact: int | None) -> None:
    path = tmp_path / "live.kvtrace"
    _record(path, compact_steps_per_batch=compact)
    reader = TraceReader(path)
    table = reader.meta.namespaces
    assert reader.meta.format_version == 4 and reader.ipc_format == "file"
    assert [table.name_of(r) for r in range(4)] == ["lora-1", None, "lora-2", "lora-1"]
    assert sum(len(s) for s in reader.steps()) == 7 and reader.recording.status == "complete"


def test_a_recording_without_namespaces_is_left_as_written(tmp_path: Path) -> None:
    path = tmp_path / "plain.kvtrace"
    with Recorder(path, make_meta()) as rec:
        rec.begin_step(0.0)
        rec.extend([1], [8], prompt_lens=[8])
        rec.end_step()
    reader = TraceReader(path)
    assert reader.meta.namespaces is None and reader.meta.format_version == 1 and reader.ipc_format == "stream"


def test_a_bad_namespace_is_refused_at_once(tmp_path: Path) -> None:
    with Recorder(tmp_path / "bad.kvtrace", make_meta()) as rec:
        rec.begin_step(0.0)
        with pytest.raises(ValueError, match="namespace of request 0 must be a non-empty string"):
            rec.extend([1], [8], namespaces=[""])
        with pytest.raises(ValueError, match="namespaces has 2 entries, expected 1"):
            rec.extend([1], [8], namespaces=["a", "b"])
        rec.extend([1], [np.int64(8)])
        rec.end_step()
