"""Hand-edited copies of a bundled sample (valid Arrow, written with plain pyarrow):
each gets one clear line from ``replay`` (exit 2) or a problem from ``validate``
(exit 1), never "internal error", "factory failed" or "no reason given".
"""

from __future__ import annotations

import json
import os
import resource
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from traces.samples import sample_path
from traces.schema import METADATA_KEY, OP_CODE

runner = CliRunner()
FORBIDDEN = ("internal error", "factory failed", "no reason given", "Traceback")


def invoke(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args))
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.stdout, result.stderr


def edited(
    tmp_path: Path,
    sample: str,
    *,
    meta: Callable[[dict[str, Any]], None] | None = None,
    column: str | None = None,
    where: Callable[[pa.Table], int] | None = None,
    value: Any = None,
) -> Path:
    """A copy of ``sample`` with one metadata edit or one cell set to ``value``."""
    with pa.OSFile(str(sample_path(sample))) as source:
        is_file = source.read(6) == b"ARROW1"  # samples are IPC files; recordings streams
        source.seek(0)
        reader = pa.ipc.open_file(source) if is_file else pa.ipc.open_stream(source)
        schema, table = reader.schema, reader.read_all()
    data = json.loads(schema.metadata[METADATA_KEY])
    if meta is not None:
        meta(data)
    if column is not None:
        assert where is not None
        index = table.column_names.index(column)
        values = table.column(column).combine_chunks().fill_null(-1).to_numpy(zero_copy_only=False).copy()
        values[where(table)] = value
        table = table.set_column(index, table.schema.field(index), pa.array(values, table.schema.field(index).type))
    schema = table.schema.with_metadata({METADATA_KEY: json.dumps(data).encode()})
    path = tmp_path / f"{sample}-edited.kvtrace"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        writer.write_table(table.replace_schema_metadata(schema.metadata), max_chunksize=64)
    return path


def first_row(op: str, skip: int = 0) -> Callable[[pa.Table], int]:
    def pick(table: pa.Table) -> int:
        codes = table.column("op").combine_chunks().indices.to_numpy()
        return int(np.flatnonzero(codes == OP_CODE[op])[skip])

    return pick


def middle(table: pa.Table) -> int:
    return table.num_rows // 2


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtrace: error: "), err
    assert not any(word in err for word in FORBIDDEN), err
    return lines[0]


def validate_problems(path: Path) -> list[str]:
    code, out, err = invoke("validate", str(path), "--json")
    assert code == 1, (out, err)
    report = json.loads(out)
    return [f"step {p['step']}, request {p['rid']}: {p['problem']}" for p in report["problems"]]


def replay_error(path: Path, *options: str) -> str:
    code, out, err = invoke("replay", str(path), "--json", *options)
    assert code == 2 and out == "", (code, out, err)
    return one_error_line(err)


def test_a_request_id_of_ten_to_the_fifteen(tmp_path: Path) -> None:
    path = edited(tmp_path, "tiny", column="rid", where=middle, value=10**15)
    bound = "request id outside [0, 630) (ids are dense, from 0, fewer than the trace's 630 rows)"
    problems = validate_problems(path)
    assert any(p.endswith(f"request {10**15}: {bound}") for p in problems), problems
    line = replay_error(path)
    assert f"request {10**15}: {bound}" in line and "step " in line
    # Skipping the bad row replays the rest (no array is sized by the bad id).
    code, out, err = invoke("replay", str(path), "--json", "--on-bad-op", "skip")
    assert code == 1 and json.loads(out)["bad_ops"] >= 1 and "internal error" not in err
    code, out, _ = invoke("info", str(path), "--json")
    assert code == 0 and json.loads(out)["requests"] == 32


def test_metadata_pool_tokens_of_ten_to_the_twelve(tmp_path: Path) -> None:
    path = edited(tmp_path, "tiny", meta=lambda m: m["config"].update(pool_tokens=10**12))
    for command in ("info", "validate", "replay"):
        code, out, err = invoke(command, str(path), "--json")
        assert code == 2 and out == ""
        assert one_error_line(err).endswith(
            "invalid kvtrace metadata: metadata 'config.pool_tokens' must be an integer in "
            "[1, 2147483647], found 1000000000000"
        )


@pytest.mark.parametrize(
    ("field", "fragments"),
    [
        ("max_running", ["1,000,000,000 rows (metadata config.max_running)", "request table"]),
        ("max_context_len", ["1,000,000,004 positions (metadata config.max_context_len plus headroom)"]),
    ],
)
def test_metadata_rows_or_context_of_ten_to_the_ninth(tmp_path: Path, field: str, fragments: list[str]) -> None:
    # mooncake-tiny: 256 rows of 131,072 positions; either edit asks for at least a TiB.
    path = edited(tmp_path, "mooncake-tiny", meta=lambda m: m["config"].update({field: 10**9}))
    line = replay_error(path)
    assert line.startswith("kvtrace: error: not enough memory: the allocator needs about ")
    assert line.endswith("; pass --ignore-memory-check to try anyway")
    for fragment in fragments:
        assert fragment in line
    code, _, _ = invoke("info", str(path), "--json")
    assert code == 0


def test_one_rows_step_of_two_to_the_sixty_two(tmp_path: Path) -> None:
    path = edited(tmp_path, "tiny", column="step", where=middle, value=2**62)
    problems = validate_problems(path)
    assert f"step {2**62}, request None: step {2**62} outside [0, 2**53)" in problems
    assert any(f"comes after step {2**62}: steps must not decrease" in p for p in problems), problems
    line = replay_error(path)
    assert f"step {2**62}: step {2**62} outside [0, 2**53)" in line


@pytest.mark.parametrize(
    ("op", "column", "value", "message"),
    [
        ("spec", "draft_len", 2**30, "draft_len 1073741824 exceeds config.spec.num_draft_tokens 4"),
        ("finish", "draft_len", 3, "draft_len 3 on a finish row (only spec rows carry it; it must be 0)"),
        ("extend", "prefix_len", 10**12, "prefix_len 1000000000000 exceeds seq_len"),
        ("decode", "prefix_len", 10**12, "prefix_len 1000000000000 on a decode row (only extend and prealloc rows"),
        ("extend", "prompt_len", 10**12, "prompt_len 1000000000000 exceeds config.max_context_len 2048"),
    ],
)
def test_columns_an_op_kind_does_not_use_and_lengths_past_their_bound(
    tmp_path: Path, op: str, column: str, value: int, message: str
) -> None:
    path = edited(tmp_path, "tiny", column=column, where=first_row(op), value=value)
    problems = validate_problems(path)
    assert any(message in p for p in problems), problems
    line = replay_error(path)
    assert message in line and ", request " in line


def test_the_exact_lines_of_the_errors_that_were_already_clear(tmp_path: Path) -> None:
    negative = edited(tmp_path, "tiny", column="rid", where=first_row("decode"), value=-1)
    assert any(
        p.endswith("request -1: request id outside [0, 630) (ids are dense, from 0, fewer than the trace's 630 rows)")
        for p in validate_problems(negative)
    )
    newer = edited(tmp_path, "mooncake-tiny", meta=lambda m: m.update(format_version=7))
    code, _, err = invoke("replay", str(newer))
    assert code == 2 and "format version 7, but this kvtrace reads format version 6 at most" in one_error_line(err)


def test_record_with_an_impossible_pool_is_one_line(tmp_path: Path) -> None:
    workload = tmp_path / "w.jsonl"
    workload.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n')
    out = tmp_path / "t.kvtrace"
    code, _, err = invoke("record", str(workload), "--out", str(out), "--pool-tokens", "999999999999", "-q")
    assert code == 2 and "--pool-tokens" in one_error_line(err) and "exceeds 2**31 - 1" in err
    code, _, err = invoke("record", str(workload), "--out", str(out), "--max-running", "100000000", "-q")
    line = one_error_line(err)
    assert code == 2 and "not enough memory" in line and "100,000,000 rows (--max-running)" in line
    assert line.endswith("lower --max-running or --context-len, or pass --ignore-memory-check to try anyway")
    assert not out.exists()


def test_metadata_text_is_shown_as_text_not_markup(tmp_path: Path) -> None:
    def edit(meta: dict[str, Any]) -> None:
        meta["source"].update(engine="[/]oops[bold", license="[link=x]")

    path = edited(tmp_path, "tiny", meta=edit)
    code, out, err = invoke("info", str(path))
    assert code == 0 and err == ""
    assert "[/]oops[bold" in out and "[link=x]" in out


def test_prompt_lengths_that_end_a_prefill_early_are_problems_not_allocator_errors(tmp_path: Path) -> None:
    """A first row claiming a 7-token prompt followed by more prefill chunks: the replay's
    allocator would be asked to extend a request whose prefill is done."""
    path = edited(tmp_path, "mooncake-tiny", column="prompt_len", where=first_row("extend"), value=7)
    problems = validate_problems(path)
    assert any("beyond the prompt_len 7 of a new request (it prefills its prompt, then decodes)" in p for p in problems)
    line = replay_error(path)
    assert "beyond the prompt_len 7" in line
    code, out, err = invoke("replay", str(path), "--json", "--on-bad-op", "skip")
    assert code == 1 and "internal error" not in err and json.loads(out)["dropped_requests"] >= 1


def test_a_non_finite_time_keeps_the_json_valid(tmp_path: Path) -> None:
    path = edited(tmp_path, "tiny", column="time_s", where=lambda t: t.num_rows - 1, value=float("inf"))
    for command, expected in (("replay", 1), ("info", 0)):
        args = ["--on-bad-op", "skip"] if command == "replay" else []
        code, out, _ = invoke(command, str(path), "--json", *args)
        assert code == expected
        summary = json.loads(out, parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))
        assert summary["duration_s"] > 0


# -- a hostile environment: standard output that cannot be written, a full disk ---------------


ROOT = Path(__file__).resolve().parents[2]
MOONCAKE = ROOT / "traces" / "workloads_data" / "mooncake-fast25" / "conversation_trace.jsonl"


def kvtrace(*args: str, stdout: Any = subprocess.PIPE, **popen: Any) -> subprocess.CompletedProcess[str]:
    """The console script (``python -m kvtrace``) in a process of its own."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "kvtrace", *args], cwd=ROOT, env=env, stdout=stdout, stderr=subprocess.PIPE,
        text=True, timeout=300, **popen,
    )  # fmt: skip


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full on this system")
@pytest.mark.parametrize(
    "args",
    [["info", "sample:tiny"], ["info", "sample:tiny", "--json"], ["validate", "sample:tiny"], ["versions"], ["--version"]],
)
def test_stdout_on_a_full_device_is_one_line(args: list[str]) -> None:
    with open("/dev/full", "w") as full:
        done = kvtrace(*args, stdout=full)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == ["kvtrace: error: cannot write to standard output: No space left on device"]


def test_a_closed_stdout_is_one_line() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        f"exec {shlex.quote(sys.executable)} -m kvtrace info sample:tiny >&-", shell=True, cwd=ROOT, env=env,
        stderr=subprocess.PIPE, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "kvtrace: error: cannot write to standard output: it is closed; redirect it (> FILE, > /dev/null)"
    ]


@pytest.mark.parametrize("args", [["versions"], ["--help"], ["replay", "--help"]])
def test_a_reader_that_goes_away_is_not_an_error(args: list[str]) -> None:
    """``kvtrace versions | head -1``: the pipe closes before kvtrace writes; exit 0, quietly.
    The help too, which typer prints through a console of its own."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    with os.fdopen(write_end, "w") as pipe:
        done = kvtrace(*args, stdout=pipe)
    assert (done.returncode, done.stderr) == (0, "")


def test_out_dash_is_refused_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for args in (["replay", "sample:tiny"], ["record", str(sample_path("tiny"))], ["compact", str(sample_path("tiny"))]):
        code, _, err = invoke(*args, "--out", "-")
        assert code == 2 and one_error_line(err).startswith("kvtrace: error: --out -: this output is a file"), err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_full_disk_during_record_is_one_line(tmp_path: Path) -> None:
    """A file size limit stands for a full disk: writes fail with EFBIG."""

    def limit_file_size() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    out = tmp_path / "big.kvtrace"
    done = kvtrace("record", str(MOONCAKE), "--out", str(out), "-q", preexec_fn=limit_file_size)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [f"kvtrace: error: cannot write trace {out}: File too large"]


def test_record_stopped_while_compacting_says_the_trace_is_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while the finished recording is compacted: the trace is complete (an uncompacted
    stream), and record's message and info agree on it."""
    import traces.writer

    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt  # Ctrl-C during the compaction

    monkeypatch.setattr(traces.writer, "compact_trace", interrupted)
    out = tmp_path / "run.kvtrace"
    result = runner.invoke(app, ["record", str(sample_path("tiny")), "--out", str(out), "-q"])
    assert result.exit_code == 130
    assert f"interrupted while compacting; {out} holds the complete recording, uncompacted" in result.stderr
    assert "marked interrupted" not in result.stderr
    code, stdout, _ = invoke("info", str(out), "--json")
    info = json.loads(stdout)
    assert code == 0 and info["interrupted"] is False and info["recording"]["status"] == "complete"
