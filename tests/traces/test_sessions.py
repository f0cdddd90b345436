"""Streaming-session ops (``hold``, ``close``): recorder, reader, format version, checker."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.record.recorder import Recorder
from tests.helpers import make_meta
from traces.batches import StepBatch
from traces.checker import OpSequenceChecker
from traces.errors import TraceSchemaError
from traces.metadata import TraceMeta
from traces.reader import TraceReader
from traces.schema import CLOSE, EXTEND, HOLD, OP_CODE, OPS, arrow_schema


def session_meta() -> TraceMeta:
    return make_meta(sessions=True)


def record_two_turns(path: Path) -> None:
    """One session, two turns: prompt 10, one decode, held; then 9 more tokens, held, closed."""
    with Recorder(path, session_meta(), overwrite=True) as rec:
        rec.begin_step(0.0)
        rec.extend([7], [10], prompt_lens=[10])
        rec.end_step()
        rec.begin_step(0.1)
        rec.decode([7])
        rec.end_step()
        rec.begin_step(0.2)
        rec.hold([7])
        rec.end_step()
        rec.begin_step(0.3)
        rec.extend([7], [20], prefix_lens=[11])
        rec.end_step()
        rec.begin_step(0.4)
        rec.hold([7], held_lens=[19])
        rec.end_step()
        rec.begin_step(0.5)
        rec.close_session([7])
        rec.end_step()


def test_recorded_session_reads_back_as_version_6_and_checks_clean(tmp_path: Path) -> None:
    path = tmp_path / "s.kvtrace"
    record_two_turns(path)
    reader = TraceReader(path)
    assert reader.meta.format_version == 6 and reader.meta.config.sessions
    checker = OpSequenceChecker(reader.meta)
    rows = []
    for batch in reader.steps():
        assert checker.check(batch) == []
        rows += [(OPS[o], int(s), int(a)) for o, s, a in zip(batch.op, batch.seq_len, batch.append_len)]
    # the second turn extends from the held 11 tokens; the close releases the held 19
    assert rows == [
        ("extend", 10, 10), ("decode", 11, 1), ("hold", 11, 0),
        ("extend", 20, 9), ("hold", 19, 0), ("close", 19, 0),
    ]
    summary = checker.finish()
    assert summary.ended == 1 and summary.holding_kv == 0 and summary.problems == 0


def test_trace_without_sessions_stays_at_its_old_version(tmp_path: Path) -> None:
    assert make_meta().format_version == 1
    assert "sessions" not in make_meta().to_json()


def test_writer_refuses_session_ops_without_sessions(tmp_path: Path) -> None:
    with Recorder(tmp_path / "t.kvtrace", make_meta()) as rec:
        rec.begin_step(0.0)
        rec.extend([0], [4], prompt_lens=[4])
        rec.end_step()
        rec.begin_step(0.1)
        rec.hold([0])
        with pytest.raises(ValueError, match="hold op in a trace without sessions"):
            rec.end_step()


def write_raw(path: Path, meta: TraceMeta, ops: list[str], seq: list[int], append: list[int]) -> None:
    """A trace file written with pyarrow directly (as a damaged or foreign writer would)."""
    schema = arrow_schema(meta)
    n = len(ops)
    columns = {
        "step": pa.array(range(n), pa.int64()),
        "time_s": pa.array([float(i) for i in range(n)], pa.float64()),
        "op": pa.DictionaryArray.from_arrays(
            pa.array([OP_CODE[o] for o in ops], pa.int8()), pa.array(list(OPS))
        ),
        "rid": pa.array([0] * n, pa.int64()),
        "seq_len": pa.array(seq, pa.int64()),
        "append_len": pa.array(append, pa.int32()),
    }
    arrays = [
        columns[f.name] if f.name in columns else pa.nulls(n, f.type) if f.nullable else pa.array([0] * n, f.type)
        for f in schema
    ]
    with pa.ipc.new_file(str(path), schema) as sink:
        sink.write_batch(pa.record_batch(arrays, schema=schema))


def test_reader_refuses_session_ops_in_a_trace_without_sessions(tmp_path: Path) -> None:
    path = tmp_path / "damaged.kvtrace"
    meta = make_meta()
    write_raw(path, meta, ["extend", "hold"], [4, 4], [4, 0])
    reader = TraceReader(path)
    with pytest.raises(TraceSchemaError, match="hold op in record batch .* config.sessions"):
        list(reader.steps())


def test_validate_cli_reports_a_damaged_session_trace_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "damaged.kvtrace"
    write_raw(path, make_meta(), ["extend", "close"], [4, 4], [4, 0])
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "close op" in lines[0] and "config.sessions" in lines[0]


def one(step: int, op: int, seq_len: int, append_len: int = 0) -> StepBatch:
    return StepBatch.from_columns(
        step, float(step), op=[op], rid=[0], seq_len=[seq_len], append_len=[append_len],
        prompt_len=[8] if step == 0 else None,
    )


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (one(2, EXTEND, 12, 3), "seq_len 12 inconsistent with extend"),  # a turn starts at the held length
        (one(2, CLOSE, 6), "close seq_len 6 != current length 8"),
        (one(2, OP_CODE["decode"], 9, 1), "decode of a request its session holds"),
        (one(2, HOLD, 8), "hold of a request its session holds"),
    ],
)
def test_checker_flags_broken_session_rows(bad: StepBatch, message: str) -> None:
    checker = OpSequenceChecker(session_meta())
    assert checker.check(one(0, EXTEND, 8, 8)) == []
    assert checker.check(one(1, HOLD, 8)) == []
    problems = [str(p) for p in checker.check(bad)]
    assert len(problems) == 1 and message in problems[0], problems


def test_checker_flags_close_of_a_running_request() -> None:
    checker = OpSequenceChecker(session_meta())
    assert checker.check(one(0, EXTEND, 8, 8)) == []
    problems = [str(p) for p in checker.check(one(1, CLOSE, 8))]
    assert problems == ["step 1, request 0: close of a running request (hold its turn first)"]


def _turn(step: int, seq_len: int, append_len: int, prompt_len: int | None) -> StepBatch:
    return StepBatch.from_columns(
        step, float(step), op=[EXTEND], rid=[0], seq_len=[seq_len], append_len=[append_len],
        prompt_len=None if prompt_len is None else [prompt_len],
    )


def test_a_turn_gives_its_prompt_len_and_prefills_up_to_it() -> None:
    """A session's next turn may say where its prompt ends (the conversation so far):
    its prefill may take several extends up to it, none beyond, then it decodes."""
    checker = OpSequenceChecker(session_meta())
    assert checker.check(one(0, EXTEND, 8, 8)) == []
    assert checker.check(one(1, HOLD, 8)) == []
    assert checker.check(_turn(2, 12, 4, 20)) == []  # a chunk: prompt_len differs from the first row's 8
    assert checker.check(_turn(3, 20, 8, None)) == []
    problems = [str(p) for p in checker.check(_turn(4, 22, 2, None))]
    assert len(problems) == 1 and "extend of a request whose prefill is complete" in problems[0], problems


def test_a_turn_may_not_extend_past_its_prompt_len() -> None:
    checker = OpSequenceChecker(session_meta())
    assert checker.check(one(0, EXTEND, 8, 8)) == []
    assert checker.check(one(1, HOLD, 8)) == []
    problems = [str(p) for p in checker.check(_turn(2, 30, 22, 20))]
    assert problems == [
        "step 2, request 0: extend to seq_len 30 beyond the prompt_len 20 of a session's turn "
        "(it prefills its prompt, then decodes)"
    ]


def test_checker_flags_a_finish_of_a_later_turn_in_one_line() -> None:
    """SGLang keeps a finished turn of a session in its slot, the built-in frees it: the
    checker refuses the op so that the two sides never part on it."""
    checker = OpSequenceChecker(session_meta())
    assert checker.check(one(0, EXTEND, 8, 8)) == []
    assert checker.check(one(1, HOLD, 8)) == []
    assert checker.check(_turn(2, 12, 4, None)) == []
    problems = [str(p) for p in checker.check(one(3, OP_CODE["finish"], 12))]
    assert problems == [
        "step 3, request 0: finish of a streaming session's turn: SGLang keeps it in the session slot, "
        "the built-in allocator frees it (hold the turn, or abort it)"
    ]


def test_a_first_turn_may_finish_and_an_abort_ends_the_session() -> None:
    """Before its first hold a request is no session's; after an abort its id is done."""
    checker = OpSequenceChecker(session_meta())
    assert checker.check(one(0, EXTEND, 8, 8)) == []
    assert checker.check(one(1, OP_CODE["finish"], 8)) == []
    checker = OpSequenceChecker(session_meta())
    assert checker.check(one(0, EXTEND, 8, 8)) == []
    assert checker.check(one(1, HOLD, 8)) == []
    assert checker.check(_turn(2, 12, 4, None)) == []
    assert checker.check(one(3, OP_CODE["abort"], 12)) == []
    assert checker.finish().problems == 0


def test_validate_cli_flags_a_finished_session_turn_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "finished_turn.kvtrace"
    with Recorder(path, session_meta(), overwrite=True) as rec:
        rec.begin_step(0.0)
        rec.extend([0], [10], prompt_lens=[10])
        rec.end_step()
        rec.begin_step(0.1)
        rec.hold([0])
        rec.end_step()
        rec.begin_step(0.2)
        rec.extend([0], [14], prefix_lens=[10])
        rec.end_step()
        rec.begin_step(0.3)
        rec.finish([0])
        rec.end_step()
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 1, result.output
    problems = [line for line in result.output.splitlines() if line.startswith("step ")]
    assert problems == [
        "step 3, request 0: finish of a streaming session's turn: SGLang keeps it in the session slot, "
        "the built-in allocator frees it (hold the turn, or abort it)"
    ]
