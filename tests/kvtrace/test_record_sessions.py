"""``kvtrace record --sessions``: conversations named by the workload or inferred from
the block hashes, a streaming session per conversation in the scheduler model, and the
trace it writes (hold, the next turn's extend with its prompt_len, close)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.record.sessions import plan_sessions
from traces.checker import OpSequenceChecker
from traces.reader import TraceReader
from traces.schema import CLOSE, EXTEND, HOLD, OPS
from traces.workload_request import WorkloadRequest
from traces.workloads import WorkloadFileError, read_mooncake

runner = CliRunner()

# (ms, input_length, output_length, hash_ids, extra fields)
LINES = [
    (0, 1200, 12, [0, 1, 2], {}),  # conversation A, turn 1: complete blocks [0, 1]
    (500, 700, 9, [0, 50], {}),  # a lone request: one complete block, continues nothing
    (1000, 600, 5, [60, 61], {"session_id": "named"}),
    (1500, 640, 5, [70, 71], {"session_id": "named"}),  # named: a turn whatever its blocks
    (4000, 1600, 10, [0, 1, 7, 8], {}),  # A, turn 2: extends [0, 1]
    (4500, 1300, 10, [0, 1, 9], {}),  # extends [0, 1] too, but A has moved on: a new one
    (9000, 2100, 7, [0, 1, 7, 9, 10], {}),  # A, turn 3: extends turn 2's [0, 1, 7]
]


def _workload(path: Path, lines: list = LINES) -> Path:
    with path.open("w") as fh:
        for ms, n, out, hashes, extra in lines:
            fh.write(json.dumps({"timestamp": ms, "input_length": n, "output_length": out, "hash_ids": hashes,
                                 **extra}) + "\n")  # fmt: skip
    return path


def test_conversations_are_named_or_inferred_from_the_blocks(tmp_path: Path) -> None:
    plan = plan_sessions(read_mooncake(_workload(tmp_path / "w.jsonl")))
    ids = [r.session_id for r in plan.requests]
    assert ids == ["conversation-0", None, "named", "named", "conversation-0", None, "conversation-0"]
    assert plan.turns == {"conversation-0": 3, "named": 2}


def test_a_bad_session_id_is_one_line(tmp_path: Path) -> None:
    path = _workload(tmp_path / "w.jsonl", [(0, 10, 1, [0], {"session_id": [1]})])
    with pytest.raises(WorkloadFileError, match=r"w.jsonl:1: session_id must be a string, an integer or null"):
        list(read_mooncake(path))
    assert next(read_mooncake(_workload(tmp_path / "i.jsonl", [(0, 10, 1, [0], {"session_id": 7})]))).session_id == "7"


def _record(tmp_path: Path, page_size: int, *extra: str) -> Path:
    out = tmp_path / f"s{page_size}.kvtrace"
    result = runner.invoke(app, [
        "record", str(_workload(tmp_path / "w.jsonl")), "--format", "mooncake", "--out", str(out), "--sessions",
        "--pool-tokens", "20000", "--page-size", str(page_size), "--force", "--json", *extra,
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_session_recording_holds_turns_and_replays_clean(tmp_path: Path, page_size: int) -> None:
    # --chunk 512: turn 3 of conversation A prefills in chunks, which its prompt_len ends
    path = _record(tmp_path, page_size, "--chunk", "512")
    reader = TraceReader(path)
    assert reader.meta.format_version == 6 and reader.meta.config.sessions
    rows: dict[int, list[tuple[str, int, int]]] = {}
    checker = OpSequenceChecker(reader.meta)
    problems = []
    for step in reader.steps():
        problems += checker.check(step)
        for op, rid, seq, prompt in zip(step.op, step.rid, step.seq_len, step.prompt_len):
            if op in (EXTEND, HOLD, CLOSE):
                rows.setdefault(int(rid), []).append((OPS[op], int(seq), int(prompt)))
    assert problems == [] and checker.finish().holding_kv == 0
    a = rows[0]  # conversation A, one request id for its three turns
    assert [op for op, _, _ in a if op != "extend"] == ["hold", "hold", "hold", "close"]
    turn_starts = [(seq, prompt) for op, seq, prompt in a if op == "extend" and prompt >= 0]
    assert [prompt for _, prompt in turn_starts] == [1200, 1600, 2100]
    assert sum(op == "extend" for op, _, _ in a) > 4  # chunked turns
    named = [r for r, ops in rows.items() if sum(op == "hold" for op, _, _ in ops) == 2 and r != 0]
    assert len(named) == 1
    for ps in ("1", "16"):
        out = runner.invoke(app, ["replay", str(path), "--page-size", ps, "--check", "every", "--json"])
        assert out.exit_code == 0, out.output
        summary = json.loads(out.output)
        assert summary["num_violations"] == 0 and summary["bad_ops"] == 0
        assert summary["session_held"]["holds"] == 5 and summary["session_held"]["closes"] == 2
        assert summary["prefix_differs_from_recorded"] == 0 or ps != str(page_size)


def test_without_sessions_the_same_workload_records_plain_requests(tmp_path: Path) -> None:
    out = tmp_path / "plain.kvtrace"
    result = runner.invoke(app, ["record", str(_workload(tmp_path / "w.jsonl")), "--format", "mooncake",
                                 "--out", str(out), "--pool-tokens", "20000", "--force", "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    reader = TraceReader(out)
    assert reader.meta.format_version == 1 and not reader.meta.config.sessions
    assert not any(np.isin(step.op, [HOLD, CLOSE]).any() for step in reader.steps())


def test_sessions_are_refused_where_they_are_not_modelled(tmp_path: Path) -> None:
    result = runner.invoke(app, ["record", str(_workload(tmp_path / "w.jsonl")), "--format", "mooncake",
                                 "--out", str(tmp_path / "x.kvtrace"), "--sessions", "--namespaces", "2"])  # fmt: skip
    assert result.exit_code == 2
    assert "streaming sessions are modelled for full-attention pools only, not with cache namespaces" in result.output


def test_a_session_pinning_the_pool_is_closed_rather_than_stuck(tmp_path: Path) -> None:
    """A held session's KV can keep the head of the queue from ever fitting: the model
    closes the sessions between turns (as SGLang's session timeout would), dropping the
    turn that waited for it, and goes on."""
    lines = [
        (0, 3000, 4, [0, 1, 2, 3, 4, 5], {}),
        (100, 3000, 4, [0, 21, 22, 23, 24, 25], {}),  # needs the pool the held session pins
        (60000, 3100, 4, [0, 1, 2, 3, 4, 5, 6], {}),  # A's second turn, behind it in the queue
    ]
    out = tmp_path / "p.kvtrace"
    result = runner.invoke(app, ["record", str(_workload(tmp_path / "w.jsonl", lines)), "--format", "mooncake",
                                 "--out", str(out), "--sessions", "--pool-tokens", "5000", "--force", "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["finished"] == 2 and summary["rejected"] == 1
    ops = [(OPS[o], int(r)) for step in TraceReader(out).steps() for o, r in zip(step.op, step.rid) if o != 1]
    assert ops == [("extend", 0), ("hold", 0), ("close", 0), ("extend", 1), ("finish", 1)]


def test_workload_request_session_id_defaults_to_none() -> None:
    assert WorkloadRequest(arrival_s=0.0, input_len=1, output_len=0).session_id is None
