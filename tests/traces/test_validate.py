"""OpSequenceChecker: a clean sequence, then one test per kind of problem."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from tests.helpers import make_meta
from traces.batches import StepBatch
from traces.checker import OpSequenceChecker, Problem
from traces.metadata import SpecSettings, TraceMeta
from traces.schema import METADATA_KEY, OP_CODE, OPS, arrow_schema
from traces.writer import TraceWriter


def row(op: str, rid: int, seq_len: int, append_len: int, **fields: object) -> dict[str, object]:
    return dict(op=op, rid=rid, seq_len=seq_len, append_len=append_len, **fields)


def step(number: int, *rows: dict[str, object], time_s: float | None = None, sort: bool = True) -> StepBatch:
    def column(name: str, default: object) -> list[object]:
        return [r.get(name, default) for r in rows]

    return StepBatch.from_columns(
        number,
        float(number) if time_s is None else time_s,
        op=np.array([OP_CODE[str(r["op"])] for r in rows], np.int8),
        rid=column("rid", 0),
        seq_len=column("seq_len", 0),
        append_len=column("append_len", 0),
        draft_len=column("draft_len", 0),
        accepted_len=column("accepted_len", 0),
        prefix_len=column("prefix_len", 0),
        prompt_len=column("prompt_len", None),
        block_hashes=column("block_hashes", None),
        token_ids=column("token_ids", None),
        sort=sort,
    )


def run(steps: list[StepBatch], **config: object) -> tuple[list[Problem], OpSequenceChecker]:
    checker = OpSequenceChecker(make_meta(**config))
    problems: list[Problem] = []
    for batch in steps:
        problems.extend(checker.check(batch))
    return problems, checker


def messages(problems: list[Problem]) -> list[str]:
    return [str(p) for p in problems]


def test_a_valid_sequence_of_every_op_has_no_problem() -> None:
    steps = [
        # request 0: chunked prefill across pages, block hashes (block_size 32: 2 blocks)
        step(0, row("extend", 0, 24, 24, prompt_len=40, block_hashes=[11, 12])),
        step(1, row("extend", 0, 40, 16), row("prealloc", 1, 30, 30, prompt_len=29)),
        step(2, row("decode", 0, 41, 1, token_ids=[5]), row("spec", 1, 33, 3, draft_len=4, accepted_len=3)),
        step(3, row("retract", 0, 41, 0), row("spec", 1, 38, 5, draft_len=4, accepted_len=5)),
        # request 0 comes back from 0; request 1 stops early (owned < length)
        step(4, row("finish", 1, 36, 0), row("extend", 0, 41, 41, token_ids=list(range(41)))),
        step(5, row("decode", 0, 42, 1), row("extend", 2, 7, 7, prompt_len=7)),
        step(6, row("abort", 2, 7, 0), row("decode", 0, 43, 1)),
        step(7, row("decode", 0, 44, 1), row("extend", 3, 3, 3, prompt_len=9)),
    ]
    problems, checker = run(steps, spec=SpecSettings(), pd_decode=True)
    assert problems == []
    summary = checker.finish()
    assert summary.steps == 8 and summary.requests == 4 and summary.ended == 2
    assert summary.holding_kv == 2  # requests 0 and 3: a window, not a problem
    assert summary.problems == 0
    assert checker.phase_of(0) == "decode" and checker.length_of(0) == 44
    assert checker.phase_of(3) == "prefill"


@pytest.mark.parametrize(
    ("steps", "config", "expected"),
    [
        (
            [step(0, row("decode", 5, 1, 1))],
            {},
            ["step 0, request 5: decode of a request that does not exist (no extend or prealloc before it)"],
        ),
        (
            [
                step(0, row("extend", 0, 4, 4, prompt_len=4)),
                step(1, row("finish", 0, 4, 0)),
                step(2, row("decode", 0, 5, 1)),
            ],
            {},
            ["step 2, request 0: decode of a request that already ended (finish or abort earlier)"],
        ),
        (
            [
                step(0, row("extend", 0, 4, 4, prompt_len=4)),
                step(1, row("decode", 0, 5, 1)),
                step(2, row("extend", 0, 9, 4)),
            ],
            {},
            ["step 2, request 0: extend of a request that is mid-decode"],
        ),
        (
            [step(0, row("extend", 0, 4, 4, prompt_len=8)), step(1, row("extend", 0, 2, 1))],
            {},
            ["step 1, request 0: length shrinks from 4 to 2 on extend"],
        ),
        (
            [step(0, row("extend", 0, 4, 4, prompt_len=4)), step(1, row("decode", 0, 6, 1))],
            {},
            ["step 1, request 0: seq_len 6 inconsistent with decode: length before 4 + 1 appended = 5"],
        ),
        (
            [step(0, row("extend", 0, 5000, 5000, prompt_len=5000))],
            {},
            ["step 0, request 0: seq_len 5000 exceeds config.max_context_len 4096"],
        ),
        (
            [
                step(0, row("extend", 0, 4, 4, prompt_len=4)),
                step(1, row("finish", 0, 9, 0)),
            ],
            {},
            ["step 1, request 0: finish seq_len 9 > current length 4"],
        ),
        (
            [step(0, row("extend", 0, 4, 4))],
            {},
            ["step 0, request 0: the request's first row has no prompt_len"],
        ),
        (
            [step(0, row("extend", 0, 4, 4, prompt_len=8)), step(1, row("decode", 0, 5, 1))],
            {},
            ["step 1, request 0: decode before the prefill is complete (length 4 < prompt_len 8)"],
        ),
        (
            [step(0, row("extend", 0, 4, 4, prompt_len=4, token_ids=[1, 2, 3]))],
            {},
            ["step 0, request 0: token_ids has 3 ids but append_len is 4"],
        ),
        (
            [step(0, row("extend", 0, 2, 2, prompt_len=2, token_ids=[1, -7]))],
            {},
            ["step 0, request 0: explicit token id outside [0, 2**62) (larger ids are reserved for synthetic content)"],
        ),
        (
            [step(0, row("extend", 0, 40, 40, prompt_len=40, block_hashes=[1, 2, 3]))],
            {},
            ["step 0, request 0: 3 block_hashes for prompt_len 40 (expected ceil(40 / 32) = 2)"],
        ),
        (
            [
                step(0, row("extend", 0, 4, 4, prompt_len=4, block_hashes=[1]),
                     row("extend", 1, 4, 4, prompt_len=4, block_hashes=[1])),
            ],
            {"block_size": None},
            ["step 0, request 0: block_hashes but the metadata has no block_size (reported once)"],
        ),
        (
            [
                step(0, row("extend", 0, 4, 4, prompt_len=4), row("extend", 1, 4, 4, prompt_len=4)),
                step(1, row("spec", 0, 6, 2, draft_len=4, accepted_len=2),
                     row("spec", 1, 6, 2, draft_len=4, accepted_len=2)),
                step(2, row("spec", 0, 7, 1, draft_len=4, accepted_len=1)),
            ],
            {},
            [
                "step 1, request 0: spec row but the metadata has no spec settings (config.spec is null)",
                "step 1, request 1: spec row but the metadata has no spec settings (config.spec is null)",
                "step 2, request 0: spec row but the metadata has no spec settings (config.spec is null)",
            ],
        ),
        (
            [
                step(0, row("extend", 0, 4, 4, prompt_len=4)),
                step(1, row("spec", 0, 10, 6, draft_len=4, accepted_len=6)),
            ],
            {"spec": SpecSettings()},
            ["step 1, request 0: accepted_len 6 > draft_len 4 + 1"],
        ),
        (
            [step(0, row("prealloc", 0, 9, 9, prompt_len=9))],
            {},
            ["step 0, request 0: prealloc rows but the metadata says config.pd_decode is false (reported once)"],
        ),
        (
            [
                step(0, row("extend", 0, 4, 4, prompt_len=4)),
                step(1, row("retract", 0, 3, 0)),
                step(2, row("decode", 0, 1, 1)),
            ],
            {},
            [
                "step 1, request 0: retract seq_len 3 != current length 4",
                "step 2, request 0: decode of a retracted request (it must be extended again first)",
            ],
        ),
        (
            [
                step(0, row("extend", 0, 4, 4, prompt_len=4)),
                step(1, row("decode", 0, 5, 1), row("decode", 0, 6, 1)),
            ],
            {},
            ["step 1, request 0: the request appears 2 times in this step (once at most; none of them is applied)"],
        ),
        (
            [step(0, row("decode", 1, 5, 1), row("extend", 0, 4, 4, prompt_len=4), sort=False)],
            {},
            [
                "step 0, request 1: decode of a request that does not exist (no extend or prealloc before it)",
                "step 0, request 0: rows not in OP_ORDER: a extend row after a decode row "
                "(releases come first: finish, abort, retract, prealloc, extend, decode, spec)",
            ],
        ),
        (
            [
                step(3, row("extend", 0, 4, 4, prompt_len=8), time_s=0.0),
                step(2, row("extend", 0, 5, 1), time_s=0.0),
                step(3, row("extend", 0, 6, 1), time_s=0.0),  # a step fed in parts: fine
                step(1, row("extend", 0, 7, 1), time_s=0.0),
            ],
            {},
            [
                "step 2: step 2 comes after step 3: steps must not decrease",
                "step 1: step 1 comes after step 3: steps must not decrease",
            ],
        ),
        (
            [
                step(0, row("extend", 0, 4, 4, prompt_len=8), time_s=5.0),
                step(1, row("extend", 0, 5, 1), time_s=4.5),
                step(2, row("extend", 0, 6, 1), time_s=float("nan")),
            ],
            {},
            ["step 1: time goes backwards: 4.5 s after 5 s", "step 2: time_s is nan, not a finite number"],
        ),
    ],
)
def test_each_problem_is_reported_with_step_and_request(
    steps: list[StepBatch], config: dict[str, object], expected: list[str]
) -> None:
    problems, checker = run(steps, **config)
    assert messages(problems) == expected
    assert checker.finish().problems == len(expected)


def test_rows_failing_the_fast_check_are_explained_and_others_not() -> None:
    batch = step(
        1,
        row("decode", 0, 5, 1),
        row("decode", 1, 9, 1),  # 2 tokens more than it holds + 1
        row("decode", 2, 5, 1),
    )
    start = step(0, *(row("extend", r, 4, 4, prompt_len=4) for r in range(3)))
    problems, _ = run([start, batch])
    assert messages(problems) == [
        "step 1, request 1: seq_len 9 inconsistent with decode: length before 4 + 1 appended = 5"
    ]


def test_a_mistake_is_reported_once_then_adopted() -> None:
    steps = [step(0, row("decode", 0, 10, 1))] + [step(s, row("decode", 0, 10 + s, 1)) for s in range(1, 6)]
    problems, checker = run(steps)
    assert len(problems) == 1 and checker.length_of(0) == 15


def test_bad_request_ids_and_op_codes() -> None:
    batch = StepBatch.from_columns(
        0, 0.0, op=np.array([0, 0], np.int8), rid=[-3, 2**40], seq_len=[1, 1], append_len=[1, 1],
        prompt_len=[1, 1],
    )
    problems, _ = run([batch])
    assert messages(problems) == [
        "step 0, request -3: request id outside [0, 2**24) (ids are dense, from 0)",
        f"step 0, request {2**40}: request id outside [0, 2**24) (ids are dense, from 0)",
    ]
    bad_op = StepBatch(
        0, 0.0, np.array([9], np.int8), np.array([0]), np.array([1]), np.array([1], np.int32),
        np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros(1, np.int64), np.array([1]),
        step(0, row("extend", 0, 1, 1)).block_hashes, step(0, row("extend", 0, 1, 1)).token_ids,
    )
    problems, _ = run([bad_op])
    assert messages(problems) == ["step 0, request 0: unknown op code 9 (valid: 0..8)"]


def test_problem_records() -> None:
    problem = Problem(4, None, "time goes backwards")
    assert str(problem) == "step 4: time goes backwards"
    assert problem.to_dict() == {"step": 4, "rid": None, "problem": "time goes backwards"}
    with pytest.raises(AttributeError):
        problem.step = 5  # type: ignore[misc]


def test_background_checker_reports_what_the_checker_reports(tmp_path) -> None:
    """The child-process checker returns, step by step, exactly the in-process result."""
    from traces.checker import OpSequenceChecker
    from traces.checker_process import BackgroundChecker
    from traces.reader import TraceReader
    from traces.synth import generate
    from tests.helpers import make_meta, write_steps

    good = tmp_path / "good.kvtrace"
    generate(good, num_requests=20, seed=5, retract_prob=0.1, abort_prob=0.05)
    steps = list(TraceReader(good).steps())
    # Break it: a decode of a request that never existed, and a shrinking length.
    bad_steps = list(steps)
    last = bad_steps[5]
    bad_steps[5] = StepBatch.from_columns(
        last.step, last.time_s, op=["decode"], rid=[99], seq_len=[10], append_len=[1]
    )
    bad = write_steps(tmp_path / "bad.kvtrace", bad_steps, meta=TraceReader(good).meta)
    found = {}
    for path in (good, bad):
        reader = TraceReader(path)
        inline = OpSequenceChecker(reader.meta, rid_bound=reader.rid_bound)
        found[path] = 0
        with BackgroundChecker(path) as background:
            for batch in TraceReader(path).steps():
                problems = background.check(batch)
                assert problems == inline.check(batch)
                found[path] += len(problems)
    assert found[good] == 0 and found[bad] >= 1
    # Stopping early (the replay's OOM stop) leaves no process behind.
    background = BackgroundChecker(bad)
    background.check(next(iter(TraceReader(bad).steps())))
    background.close()
    assert not background._proc.is_alive()


def test_background_checker_runs_at_the_priority_asked(tmp_path) -> None:
    """``nice``: the child lowers its own priority by that much, and checks as before."""
    import os

    from tests.helpers import priority_once_set
    from traces.checker_process import BackgroundChecker
    from traces.reader import TraceReader
    from traces.synth import generate

    if not hasattr(os, "getpriority"):
        pytest.skip("no os.getpriority here")
    path = tmp_path / "t.kvtrace"
    generate(path, num_requests=20, seed=5)
    own = os.getpriority(os.PRIO_PROCESS, 0)
    for nice, wanted in ((0, own), (5, min(own + 5, 19))):
        with BackgroundChecker(path, nice=nice) as background:
            assert priority_once_set(background._proc.pid, wanted) == wanted  # a zombie keeps its priority
            assert all(background.check(batch) == [] for batch in TraceReader(path).steps())


def _decode_run_steps(num_steps: int, rows: int) -> list[StepBatch]:
    """A prefill of ``rows`` requests, then plain decode steps of all of them."""
    rid = np.arange(rows, dtype=np.int64)
    prompt = 40 + 3 * rid
    steps = [StepBatch.from_columns(0, 0.0, op=["extend"] * rows, rid=rid, seq_len=prompt, append_len=prompt,
                                    prompt_len=prompt)]
    for s in range(1, num_steps + 1):
        steps.append(StepBatch.from_columns(s, 0.01 * s, op=["decode"] * rows, rid=rid, seq_len=prompt + s,
                                            append_len=np.ones(rows, np.int64)))
    return steps


def _with(batch: StepBatch, **changes: object) -> StepBatch:
    import dataclasses

    return dataclasses.replace(batch, **changes)


@pytest.mark.parametrize(
    "damage",
    ["length jump", "time back", "unknown request", "append 2", "draft", "past context", "nan time", "prefix"],
)
def test_a_damaged_step_inside_a_decode_run_is_found_as_step_by_step(tmp_path, damage: str) -> None:
    """The background checker screens runs of plain decode steps at once
    (``check_run``); a run with a bad step gives, step by step, the problems
    the in-process checker gives."""
    from tests.helpers import make_meta, write_steps
    from traces.checker import OpSequenceChecker
    from traces.checker_process import BackgroundChecker
    from traces.reader import TraceReader

    steps = _decode_run_steps(600, rows=4)
    k = 300
    b = steps[k]
    steps[k] = {
        "length jump": lambda: _with(b, seq_len=b.seq_len + np.array([0, 0, 5, 0])),
        "time back": lambda: _with(b, time_s=0.5),
        "unknown request": lambda: _with(b, rid=np.array([0, 1, 2, 7], b.rid.dtype)),
        "append 2": lambda: _with(b, append_len=b.append_len + 1),
        "draft": lambda: _with(b, draft_len=np.array([0, 1, 0, 0], b.draft_len.dtype)),
        "past context": lambda: _with(b, seq_len=b.seq_len + 5000),
        "nan time": lambda: _with(b, time_s=float("nan")),
        "prefix": lambda: _with(b, prefix_len=np.array([0, 0, 0, 3], b.prefix_len.dtype)),
    }[damage]()
    path = write_steps(tmp_path / "run.kvtrace", steps, meta=make_meta(pool_tokens=1 << 16), steps_per_batch=64)
    reader = TraceReader(path)
    inline = OpSequenceChecker(reader.meta, rid_bound=reader.rid_bound)
    found = []
    with BackgroundChecker(path, rid_bound=reader.rid_bound) as background:
        for batch in TraceReader(path).steps():
            problems = background.check(batch)
            assert problems == inline.check(batch), batch.step
            found += problems
    assert found, damage  # the damage is found


def test_check_run_applies_a_run_as_its_steps(tmp_path) -> None:
    """A clean run applied at once leaves the checker where step by step leaves it."""
    from tests.helpers import write_steps
    from traces.reader import TraceReader
    from traces.runs import run_lengths

    steps = _decode_run_steps(50, rows=3)
    meta = make_meta(pool_tokens=1 << 16)
    chunk = next(TraceReader(write_steps(tmp_path / "t.kvtrace", steps, meta=meta)).chunks())
    one, many = OpSequenceChecker(meta), OpSequenceChecker(meta)
    for batch in steps:
        assert one.check(batch) == []
    # The first decode after a prefill moves its requests to decoding: the per-step path.
    assert not many.check_run(chunk, 0, 1) and not many.check_run(chunk, 1, 50)
    assert many.check(chunk.step_batch(0)) == [] and many.check(chunk.step_batch(1)) == []
    assert int(run_lengths(chunk)[2]) == 49
    assert many.check_run(chunk, 2, 49)
    assert many.finish() == one.finish()
    assert [many.length_of(r) for r in range(3)] == [one.length_of(r) for r in range(3)]
    assert not many.check_run(chunk, 2, 49)  # the same steps again: lengths no longer follow
    assert many.finish() == one.finish()  # ... and nothing was applied


# -- hostile files through the command line: bounded work, one line -------------------

runner = CliRunner()


def _invoke(*args: str) -> tuple[int, str, str, float]:
    t0 = time.perf_counter()
    result = runner.invoke(app, list(args))
    elapsed = time.perf_counter() - t0
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.stdout, result.stderr, elapsed


def _write_table(path: Path, meta: dict[str, object], table: pa.Table) -> Path:
    """``table`` (rows in the project's schema) as a trace written with plain pyarrow:
    no checksums, as a hand-edited or foreign file has."""
    schema = table.schema.with_metadata({METADATA_KEY: json.dumps(meta).encode()})
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema, options=options) as writer:
        writer.write_table(table.replace_schema_metadata(schema.metadata))
    return path


def _decode_table(times: list[float]) -> pa.Table:
    """Request 0 extended to 4 tokens at step 0, then one decode per step; row ``i`` at
    ``times[i]``; step 2 holds two rows (requests 0 and 1 decoding)."""
    steps = [0, 0, 1, 1, 2, 2]
    rid = [0, 1, 0, 1, 0, 1]
    op = [0, 0, 1, 1, 1, 1]
    seq_len = [4, 4, 5, 5, 6, 6]
    append = [4, 4, 1, 1, 1, 1]
    schema = arrow_schema(make_meta())
    columns = {
        "step": steps, "time_s": times, "rid": rid, "seq_len": seq_len, "append_len": append,
        "op": pa.DictionaryArray.from_arrays(pa.array(op, pa.int8()), pa.array(list(OPS))),
        "prompt_len": [4, 4, None, None, None, None],
    }
    arrays = [
        pa.array(columns[f.name], f.type) if f.name in columns and f.name != "op" else
        columns["op"] if f.name == "op" else pa.nulls(len(steps), f.type) if f.nullable else
        pa.array([0] * len(steps), f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(arrays, schema=schema.remove_metadata())


@pytest.mark.parametrize("op", ["extend", "decode"])
@pytest.mark.slow
def test_a_step_of_millions_of_one_row_is_refused_at_once(tmp_path: Path, op: str) -> None:
    # The finding: an 11 KB file, 3,000,000 identical rows (request 0 at step 0) in one
    # zstd record batch, held validate and replay past 120 s, their time linear in rows.
    n = 3_000_000
    zeros = np.zeros(n, np.int64)
    batch = StepBatch.from_columns(0, 0.0, op=np.full(n, OP_CODE[op], np.int8), rid=zeros, seq_len=zeros,
                                   append_len=np.zeros(n, np.int32), sort=False)
    path = tmp_path / "copies.kvtrace"
    with TraceWriter(path, make_meta(), compression="zstd") as writer:
        writer.write(batch)
    assert path.stat().st_size < 64_000
    line = "step 0, request 0: the request appears 3,000,000 times in this step (once at most; none of them is applied)"
    code, out, err, elapsed = _invoke("validate", str(path))
    assert code == 1 and out.splitlines()[0] == line and out.splitlines()[1].startswith("1 problem:"), out
    assert elapsed < 30, elapsed
    code, out, err, elapsed = _invoke("replay", str(path))
    assert code == 2 and err.splitlines() == [f"kvtrace: error: {line}; run 'kvtrace validate' for every problem, "
                                              "or replay with --on-bad-op skip to skip such ops"], err
    assert elapsed < 30, elapsed


def test_duplicated_requests_cost_one_problem_each_and_others_are_checked() -> None:
    rows = [row("extend", r, 4, 4, prompt_len=4) for r in (0, 1, 2)]
    pairs = [row("decode", r, 5, 1) for r in (0, 1, 0, 1, 0)] + [row("decode", 2, 9, 1)]
    problems, checker = run([step(0, *rows), step(1, *pairs)])
    assert messages(problems) == [
        "step 1, request 0: the request appears 3 times in this step (once at most; none of them is applied)",
        "step 1, request 1: the request appears 2 times in this step (once at most; none of them is applied)",
        "step 1, request 2: seq_len 9 inconsistent with decode: length before 4 + 1 appended = 5",
    ]
    assert checker.length_of(0) == 4 and checker.length_of(1) == 4  # refused: not applied


@pytest.mark.parametrize("where", ["every row", "second row"])
def test_a_nan_time_is_refused_by_validate_and_replay(tmp_path: Path, where: str) -> None:
    # A step's time is read from its first row: a NaN in a later row used to pass.
    times = [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
    for i in (2, 3) if where == "every row" else (3,):
        times[i] = float("nan")
    path = _write_table(tmp_path / "nan.kvtrace", json.loads(make_meta().to_json()), _decode_table(times))
    code, out, err, _ = _invoke("validate", str(path))
    if where == "every row":  # the step's time: a problem of the step
        assert code == 1 and out.splitlines()[0] == "step 1: time_s is nan, not a finite number", out
    else:  # a row that disagrees with its step's time: the file is inconsistent
        assert code == 2 and err.splitlines() == [
            f"kvtrace: error: trace {path}: step 1 in record batch 1 has rows with different time_s (1.0 and nan); "
            "every row of a step holds the step's time"
        ], err
    code, out, err, _ = _invoke("replay", str(path))
    assert code == 2 and len(err.splitlines()) == 1 and "nan" in err and "Traceback" not in err, err


def test_an_unknown_model_dtype_is_refused_naming_the_valid_ones(tmp_path: Path) -> None:
    meta = json.loads(make_meta().to_json())
    meta["model"]["dtype"] = "float1024"
    path = _write_table(tmp_path / "dtype.kvtrace", meta, _decode_table([0.0, 0.0, 1.0, 1.0, 2.0, 2.0]))
    expected = (f"kvtrace: error: trace {path}: invalid kvtrace metadata: metadata 'model.dtype' 'float1024' is not "
                "a known KV-cache dtype (valid: float32, bfloat16, float16, fp8, float8_e4m3fn)")
    for command in ("validate", "replay"):
        code, out, err, _ = _invoke(command, str(path))
        assert code == 2 and err.splitlines() == [expected], (command, err)
    with pytest.raises(ValueError, match="float1024"):
        TraceMeta.from_dict(meta)
