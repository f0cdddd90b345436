"""The recorder API: id mapping, op order, derived columns, durability."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvtrace.record.recorder import Recorder
from traces.metadata import TraceConfig, TraceMeta
from traces.reader import TraceReader
from traces.schema import DECODE, EXTEND, FINISH, OP_ORDER, OPS, PREALLOC, RETRACT, SPEC

META = TraceMeta(config=TraceConfig(page_size=16, pool_tokens=4096, max_running=8, max_context_len=2048))


def _steps(path: Path) -> list:
    return list(TraceReader(path).steps())


def test_string_ids_are_dense_and_ops_follow_op_order(tmp_path: Path) -> None:
    path = tmp_path / "t.kvtrace"
    hashes = np.array([11, 12], np.uint64)
    with Recorder(path, META, rid_map_path=tmp_path / "ids.jsonl") as rec:
        assert rec.begin_step(0.0) == 0
        rec.extend(["req-a", "req-b"], [10, 20], prefix_lens=[0, 16], prompt_lens=[10, 20], block_hashes=[hashes, None])
        rec.end_step()
        rec.begin_step(0.5)
        # Added out of order on purpose: decode before the finish.
        rec.decode(["req-b"], [21])
        rec.finish(["req-a"], [10])
        rec.end_step()
        rec.record_step(0.75, extend=(["req-c"], [5]), spec=(["req-b"], [3], [4]))
        rec.begin_step(1.0)
        rec.retract(["req-b"])
        rec.end_step()
        assert rec.rid_map == {"req-a": 0, "req-b": 1, "req-c": 2}
    steps = _steps(path)
    assert [s.step for s in steps] == [0, 1, 2, 3]
    assert [s.time_s for s in steps] == [0.0, 0.5, 0.75, 1.0]
    s0, s1, s2, s3 = steps
    assert s0.rid.tolist() == [0, 1]
    assert s0.append_len.tolist() == [10, 20]
    assert s0.prefix_len.tolist() == [0, 16]
    assert s0.prompt_len.tolist() == [10, 20]
    assert s0.block_hashes.row(0).tolist() == [11, 12] and s0.block_hashes.row(1) is None
    # Releases come first in a step.
    assert [OPS[c] for c in s1.op.tolist()] == ["finish", "decode"]
    assert s1.seq_len.tolist() == [10, 21] and s1.append_len.tolist() == [0, 1]
    ranks = [OP_ORDER.index(c) for c in s2.op.tolist()]
    assert ranks == sorted(ranks)
    spec_row = int(s2.rows_of(SPEC)[0])
    assert s2.seq_len[spec_row] == 24 and s2.accepted_len[spec_row] == 3 and s2.draft_len[spec_row] == 4
    assert s2.append_len[spec_row] == 3
    ext_row = int(s2.rows_of(EXTEND)[0])
    assert s2.rid[ext_row] == 2 and s2.prompt_len[ext_row] == -1  # not given
    assert s3.op.tolist() == [RETRACT] and s3.seq_len.tolist() == [24] and s3.append_len.tolist() == [0]
    ids = [json.loads(line) for line in (tmp_path / "ids.jsonl").read_text().splitlines()]
    assert ids == [{"id": "req-a", "rid": 0}, {"id": "req-b", "rid": 1}, {"id": "req-c", "rid": 2}]


def test_first_row_columns_only_on_first_row_and_readmission(tmp_path: Path) -> None:
    path = tmp_path / "t.kvtrace"
    with Recorder(path, META, dense_ids=True) as rec:
        rec.record_step(0.0, extend={"rids": [0], "seq_lens": [8], "prompt_lens": [12], "block_hashes": [np.array([5], np.uint64)]})
        rec.record_step(0.1, extend={"rids": [0], "seq_lens": [12], "prompt_lens": [12], "block_hashes": [np.array([5], np.uint64)]})
        rec.record_step(0.2, retract=[0])
        # Re-admitted from 0: appends the whole length again, prompt_len not repeated.
        rec.record_step(0.3, extend={"rids": [0], "seq_lens": [13], "prompt_lens": [12]})
        rec.record_step(0.4, prealloc=([1], [40]))
    s = _steps(path)
    assert [b.prompt_len.tolist() for b in s] == [[12], [-1], [-1], [-1], [-1]]
    assert s[0].block_hashes.row(0).tolist() == [5] and s[1].block_hashes.row(0) is None
    assert [b.append_len.tolist() for b in s] == [[8], [4], [0], [13], [40]]
    assert s[4].op.tolist() == [PREALLOC]


def test_every_completed_step_is_on_disk_while_recording(tmp_path: Path) -> None:
    path = tmp_path / "t.kvtrace"
    rec = Recorder(path, META, dense_ids=True)
    rec.record_step(0.0, extend=([0, 1], [4, 4]))
    rec.record_step(0.1, decode=[0, 1])
    rec.begin_step(0.2)
    rec.decode([0, 1])  # not ended: must not be visible
    reader = TraceReader(path)
    seen = list(reader.steps())
    assert [b.step for b in seen] == [0, 1]
    assert seen[1].op.tolist() == [DECODE, DECODE]
    assert reader.truncated  # no end-of-stream marker yet
    rec.end_step()
    rec.close()
    assert [b.step for b in _steps(path)] == [0, 1, 2]


def test_exception_keeps_completed_steps_and_drops_the_open_one(tmp_path: Path) -> None:
    path = tmp_path / "t.kvtrace"
    with pytest.raises(KeyError):
        with Recorder(path, META, dense_ids=True, steps_per_batch=16) as rec:
            rec.record_step(0.0, extend=([0], [4]))
            rec.record_step(0.1, decode=[0])
            rec.begin_step(0.2)
            rec.finish([0])
            raise KeyError("engine crashed")
    reader = TraceReader(path)
    assert [b.step for b in reader.steps()] == [0, 1]
    assert not reader.truncated


def test_empty_step_reuses_its_number(tmp_path: Path) -> None:
    path = tmp_path / "t.kvtrace"
    with Recorder(path, META, dense_ids=True) as rec:
        rec.record_step(0.0, extend=([0], [4]))
        assert rec.begin_step(0.1) == 1
        rec.end_step()
        assert rec.begin_step(0.2) == 1
        rec.finish([0])
        rec.end_step()
        assert rec.stats().steps == 2
    assert [(b.step, b.op.tolist()) for b in _steps(path)] == [(0, [EXTEND]), (1, [FINISH])]


def test_misuse_is_refused(tmp_path: Path) -> None:
    with Recorder(tmp_path / "t.kvtrace", META) as rec:
        with pytest.raises(RuntimeError, match="begin_step"):
            rec.decode(["a"])
        rec.begin_step(0.0)
        with pytest.raises(RuntimeError, match="still open"):
            rec.begin_step(0.1)
        with pytest.raises(ValueError, match="seq_lens has 1 values for 2 requests"):
            rec.extend(["a", "b"], [3])
