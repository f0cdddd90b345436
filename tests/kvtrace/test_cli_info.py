"""``kvtrace info`` and ``kvtrace validate``: output, JSON keys, and every error case.

Every damaged or wrong input must give exactly one line on stderr naming the
file (or option) and the problem, exit code 2, and no traceback; ``validate``
findings exit 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from tests.helpers import decode_steps, make_meta, write_steps
from traces.samples import sample_path
from traces.schema import COLUMNS, METADATA_KEY, OPS
from traces.writer import TraceWriter

runner = CliRunner()


def invoke(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def assert_one_error_line(stderr: str, *fragments: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("kvtrace: error: "), stderr
    assert "Traceback" not in stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


# -- info -------------------------------------------------------------------------------


def test_info_json_on_the_bundled_sample() -> None:
    code, out, err = invoke("info", "sample:tiny", "--json")
    assert code == 0 and err == ""
    info = json.loads(out)
    for key in (
        "format_version", "source", "config", "steps", "requests", "ops", "tokens",
        "duration_s", "file_bytes", "model", "truncated",
    ):
        assert key in info, key
    assert info["format_version"] == 1 and info["truncated"] is False
    assert {"page_size", "pool_tokens", "max_running", "max_context_len"} <= set(info["config"])
    assert info["config"]["page_size"] == 16
    assert set(info["ops"]) == set(OPS) - {"hold", "close"} and all(info["ops"].values())  # no sessions
    assert sum(info["ops"].values()) == info["rows"]
    assert {"prefill", "decode", "spec_accepted"} <= set(info["tokens"])
    assert info["tokens"]["decode"] == info["ops"]["decode"]
    assert info["model"]["bytes_per_token"] == 2 * 32 * 8 * 128 * 2
    assert info["file_bytes"] == sample_path("tiny").stat().st_size
    assert info["requests"] == 32 and info["steps"] > 0 and info["duration_s"] > 0


def test_info_counts_match_a_hand_built_trace(tmp_path: Path) -> None:
    path = tmp_path / "t.kvtrace"
    with TraceWriter(path, make_meta(), steps_per_batch=2) as writer:
        writer.write_step(0, 1.0, op=["extend", "extend"], rid=[0, 1], seq_len=[10, 7],
                          append_len=[10, 7], prompt_len=[10, 7])
        writer.write_step(1, 1.5, op=["decode", "decode"], rid=[0, 1], seq_len=[11, 8], append_len=[1, 1])
        writer.write_step(2, 3.25, op=["finish", "decode"], rid=[0, 1], seq_len=[11, 9], append_len=[0, 1])
    code, out, _ = invoke("info", str(path), "--json")
    info = json.loads(out)
    assert code == 0
    assert (info["steps"], info["requests"], info["rows"]) == (3, 2, 6)
    assert info["ops"]["extend"] == 2 and info["ops"]["decode"] == 3 and info["ops"]["finish"] == 1
    assert info["tokens"]["prefill"] == 17 and info["tokens"]["decode"] == 3
    assert info["duration_s"] == 2.25 and info["record_batches"] == 3  # an empty one first


def test_info_table() -> None:
    code, out, _ = invoke("info", "sample:tiny")
    assert code == 0
    for fragment in ("kvtrace info", "format version", "page_size 16", "requests", "truncated", "no"):
        assert fragment in out


# -- validate ---------------------------------------------------------------------------


def test_validate_clean_sample() -> None:
    code, out, err = invoke("validate", "sample:tiny")
    assert code == 0 and err == ""
    assert out.startswith("ok: ") and "32 requests" in out
    code, out, _ = invoke("validate", "sample:tiny", "--json")
    report = json.loads(out)
    assert code == 0
    assert report["ok"] is True and report["problems"] == [] and report["num_problems"] == 0
    assert report["truncated"] is False


def _bad_trace(path: Path, num_bad: int) -> Path:
    """A trace whose requests 0..num_bad-1 decode without ever being extended."""
    with TraceWriter(path, make_meta()) as writer:
        writer.write_step(0, 0.0, op=["extend"], rid=[num_bad], seq_len=[5], append_len=[5], prompt_len=[5])
        for s in range(1, num_bad + 1):
            writer.write_step(s, float(s), op=["decode"], rid=[s - 1], seq_len=[9], append_len=[1])
    return path


def test_validate_reports_problems_and_exits_1(tmp_path: Path) -> None:
    path = _bad_trace(tmp_path / "bad.kvtrace", 25)
    code, out, err = invoke("validate", str(path))
    assert code == 1 and err == ""
    lines = out.strip().splitlines()
    assert lines[0] == (
        "step 1, request 0: decode of a request that does not exist (no extend or prealloc before it)"
    )
    assert len([ln for ln in lines if ln.startswith("step ")]) == 20
    assert "... and 5 more" in lines
    assert lines[-1].startswith("25 problems: 26 steps")
    code, out, _ = invoke("validate", str(path), "--max-problems", "3", "--json")
    report = json.loads(out)
    assert code == 1 and report["ok"] is False and report["num_problems"] == 25
    assert report["problems"][0] == {
        "step": 1, "rid": 0,
        "problem": "decode of a request that does not exist (no extend or prealloc before it)",
    }
    assert len(report["problems"]) == 3 and report["truncated"] is False


# -- truncated and damaged files --------------------------------------------------------


def _truncated(tmp_path: Path) -> Path:
    """A valid trace of 6 steps, cut inside its last record batch (steps 4 and 5)."""
    path = tmp_path / "full.kvtrace"
    with TraceWriter(path, make_meta(), steps_per_batch=2) as writer:
        writer.write_step(0, 0.0, op=["extend"], rid=[0], seq_len=[3], append_len=[3], prompt_len=[3])
        for s in range(1, 6):
            writer.write_step(s, 0.1 * s, op=["decode"], rid=[0], seq_len=[3 + s], append_len=[1])
    data = path.read_bytes()
    cut = tmp_path / "cut.kvtrace"
    cut.write_bytes(data[: len(data) - 40])
    return cut


def test_truncated_file_info_exits_0_and_warns(tmp_path: Path) -> None:
    cut = _truncated(tmp_path)
    code, out, err = invoke("info", str(cut), "--json")
    info = json.loads(out)
    assert code == 0
    assert info["truncated"] is True and info["steps"] == 4
    assert "file truncated after step 3" in info["truncation_detail"]
    assert err.startswith("kvtrace: warning: ") and "file truncated after step 3" in err


def test_truncated_file_validate_exits_1(tmp_path: Path) -> None:
    cut = _truncated(tmp_path)
    code, out, err = invoke("validate", str(cut), "--json")
    report = json.loads(out)
    assert code == 1 and report["ok"] is False and report["truncated"] is True
    assert report["problems"][-1]["step"] == 3 and report["problems"][-1]["rid"] is None
    assert report["problems"][-1]["problem"].startswith("file truncated after step 3: ")
    assert "file truncated after step 3" in err
    code, out, _ = invoke("validate", str(cut))
    assert code == 1 and "step 3: file truncated after step 3" in out


def _corrupt(tmp_path: Path) -> Path:
    path = write_steps(tmp_path / "c.kvtrace", decode_steps(8, rows=40), steps_per_batch=2)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 32] = np.random.default_rng(3).integers(0, 256, 32, dtype=np.uint8).tobytes()
    path.write_bytes(bytes(data))
    return path


def _raw(path: Path, metadata: bytes | None, drop: str | None = None, retype: pa.DataType | None = None,
         batch: bool = False) -> Path:
    fields = [
        pa.field(c.name, retype if (retype is not None and c.name == "seq_len") else c.type)
        for c in COLUMNS if c.name != drop
    ]
    schema = pa.schema(fields, metadata=None if metadata is None else {METADATA_KEY: metadata})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        if batch:
            arrays = []
            for field in schema:
                if field.name == "op":
                    arrays.append(pa.DictionaryArray.from_arrays(pa.array([0], pa.int8()), pa.array(OPS)))
                elif field.name == "rid":
                    arrays.append(pa.array([None], pa.int64()))
                else:
                    arrays.append(pa.array([None], field.type) if pa.types.is_list(field.type)
                                  else pa.array([1], field.type))
            writer.write_batch(pa.RecordBatch.from_arrays(arrays, schema=schema))
    return path


def _file(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _directory(path: Path) -> Path:
    path.mkdir()
    return path


def _meta_json(**changes: object) -> bytes:
    data = json.loads(make_meta().to_json())
    for key, value in changes.items():
        if value is None:
            data["config"].pop(key, None)
        else:
            data[key] = value
    return json.dumps(data).encode()


ERROR_CASES = {
    # name: (builder, expected fragments)
    "missing file": (lambda d: d / "nope.kvtrace", ["nope.kvtrace", "no such file"]),
    "a directory": (lambda d: _directory(d / "adir"), ["adir", "is a directory"]),
    "empty file": (lambda d: _file(d / "e.kvtrace", b""), ["e.kvtrace", "is empty"]),
    "not an Arrow file": (
        lambda d: _file(d / "x.kvtrace", b'{"step": 1}\n'), ["x.kvtrace", "is not an Arrow IPC stream"]
    ),
    "newer format version": (
        lambda d: _raw(d / "v.kvtrace", _meta_json(format_version=7)),
        ["v.kvtrace", "format version 7", "reads format version 6 at most", "upgrade kvtrace"],
    ),
    "missing required column": (
        lambda d: _raw(d / "m.kvtrace", _meta_json(), drop="rid"),
        ["m.kvtrace", "required column 'rid' missing"],
    ),
    "wrong column type": (
        lambda d: _raw(d / "w.kvtrace", _meta_json(), retype=pa.float32()),
        ["w.kvtrace", "column 'seq_len' has type float, expected int64"],
    ),
    "missing metadata": (
        lambda d: _raw(d / "n.kvtrace", None),
        ["n.kvtrace", "has no kvtrace metadata"],
    ),
    "metadata not JSON": (
        lambda d: _raw(d / "j.kvtrace", b"{'page_size': 16"),
        ["j.kvtrace", "kvtrace metadata is not valid JSON"],
    ),
    "metadata missing a key": (
        lambda d: _raw(d / "k.kvtrace", _meta_json(pool_tokens=None)),
        ["k.kvtrace", "invalid kvtrace metadata", "'config.pool_tokens' is missing"],
    ),
    "null in a required column": (
        lambda d: _raw(d / "z.kvtrace", _meta_json(), batch=True),
        ["z.kvtrace", "column 'rid' holds 1 null values in record batch 1"],
    ),
    "corrupt compressed buffer": (
        _corrupt,
        ["c.kvtrace", "corrupt data in record batch", "(after step", "the file is damaged"],
    ),
    "unknown sample": (lambda d: "sample:huge", ["unknown sample 'huge'", "bundled samples: ", "tiny"]),
}


@pytest.mark.parametrize("command", ["info", "validate"])
@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, command: str, case: str) -> None:
    build, fragments = ERROR_CASES[case]
    target = build(tmp_path)
    code, out, err = invoke(command, str(target), "--json")
    assert code == 2, (case, out, err)
    assert out == ""
    assert_one_error_line(err, *fragments)


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["validate", "sample:tiny", "--max-problems", "-2"], ["'--max-problems'", "-2", "x>=0"]),
        (["validate", "sample:tiny", "--max-problems", "many"], ["'--max-problems'", "'many' is not a valid"]),
        (["info", "sample:tiny", "--colour"], ["No such option: --colour"]),
        (["info"], ["Missing argument"]),
    ],
)
def test_bad_options_are_one_line_and_exit_2(args: list[str], fragments: list[str]) -> None:
    code, out, err = invoke(*args)
    assert code == 2 and out == ""
    assert_one_error_line(err, *fragments)


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    code, _, err = invoke("info", str(tmp_path / "missing.kvtrace"), "--debug")
    assert code == 2
    assert "Traceback (most recent call last)" in err and "TraceReadError" in err
    assert err.strip().splitlines()[-1].startswith("kvtrace: error: ")


def test_a_recording_cut_before_its_first_step(tmp_path: Path) -> None:
    path = tmp_path / "early.kvtrace"
    TraceWriter(path, make_meta())  # never closed: schema only, as after a SIGKILL
    code, out, err = invoke("info", str(path), "--json")
    info = json.loads(out)
    assert code == 0 and info["steps"] == 0 and info["truncated"] is True
    assert "before any step" in err
    code, out, _ = invoke("validate", str(path))
    assert code == 1 and "file truncated before any step" in out


def test_step_batches_of_the_sample_round_trip_through_validate(tmp_path: Path) -> None:
    # A copy written with other writer settings is the same trace to validate and info.
    from traces.reader import TraceReader

    reader = TraceReader(sample_path("tiny"))
    copy = tmp_path / "copy.kvtrace"
    with TraceWriter(copy, reader.meta, compression="lz4", steps_per_batch=7) as writer:
        for batch in reader.steps():
            writer.write(batch)
    _, original, _ = invoke("info", "sample:tiny", "--json")
    _, copied, _ = invoke("info", str(copy), "--json")
    strip = lambda d: {k: v for k, v in json.loads(d).items() if k not in ("path", "file_bytes", "record_batches")}  # noqa: E731
    assert strip(original) == strip(copied)
    assert invoke("validate", str(copy))[0] == 0


def _damage(data: bytes, kind: int, rng: np.random.Generator) -> bytes:
    out = bytearray(data)
    at = int(rng.integers(len(out)))
    size = int(rng.integers(1, 300))
    if kind == 0:  # flipped bits
        for _ in range(int(rng.integers(1, 5))):
            out[int(rng.integers(len(out)))] ^= int(rng.integers(1, 256))
    elif kind == 1:  # cut short
        del out[at:]
    elif kind == 2:  # overwritten with garbage
        out[at : at + size] = rng.integers(0, 256, len(out[at : at + size]), dtype=np.uint8).tobytes()
    elif kind == 3:  # bytes inserted
        out[at:at] = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    elif kind == 4:  # bytes lost
        del out[at : at + size]
    else:  # zeroed
        out[at : at + size] = bytes(len(out[at : at + size]))
    return bytes(out)


@pytest.mark.slow
def test_damaged_files_of_every_kind_never_crash(tmp_path: Path) -> None:
    data = sample_path("tiny").read_bytes()
    rng = np.random.default_rng(20)
    damaged = tmp_path / "damaged.kvtrace"
    seen_codes = set()
    for i in range(90):
        damaged.write_bytes(_damage(data, i % 6, rng))
        for command in ("info", "validate"):
            code, _, err = invoke(command, str(damaged), "--json")
            seen_codes.add(code)
            assert code in (0, 1, 2), err
            assert "Traceback" not in err and "internal error" not in err, err
            if code == 2:
                assert_one_error_line(err, str(damaged))
    assert 2 in seen_codes and 1 in seen_codes


# -- state logs -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def state_log(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    log = tmp_path_factory.mktemp("statelog") / "state.arrow"
    result = runner.invoke(app, ["replay", "sample:mooncake-tiny", "--out", str(log), "--json"])
    assert result.exit_code == 0, result.output
    return log, json.loads(result.stdout)


def test_info_recognises_and_summarises_a_state_log(state_log: tuple[Path, dict]) -> None:
    log, replayed = state_log
    code, out, err = invoke("info", str(log), "--json")
    assert code == 0 and err == ""
    info = json.loads(out)
    assert info["kind"] == "state_log" and info["ipc_format"] == "file" and not info["truncated"]
    assert info["trace"] == "sample:mooncake-tiny" and info["allocator"] == "builtin"
    assert info["steps"] == replayed["steps"] and info["peak_used_tokens"] == replayed["peak_used_tokens"]
    assert info["peak_step"] == replayed["peak_step"]
    assert info["events"]["evict"]["tokens"] == replayed["evicted_tokens"]
    assert info["config"]["page_size"] == replayed["page_size"]
    code, table, _ = invoke("info", str(log))
    assert code == 0 and "(state log)" in table and "peak used" in table and "not written by kvtrace" not in table
    for command in ("validate", "replay"):
        code, _, err = invoke(command, str(log))
        assert code == 2
        assert_one_error_line(err, str(log), "is a kvtrace state log file, not a trace; kvtrace info shows what it holds")


def test_a_state_log_cut_short_reads_as_far_as_it_goes(state_log: tuple[Path, dict], tmp_path: Path) -> None:
    from kvtrace.statelog.log import read_state_log

    log, replayed = state_log
    data = log.read_bytes()
    for size in (len(data) - 20, len(data) // 2):  # in the footer; in the middle of the batches
        cut = tmp_path / f"cut-{size}.arrow"
        cut.write_bytes(data[:size])
        code, out, err = invoke("info", str(cut), "--json")
        info = json.loads(out)
        assert code == 0 and info["truncated"] and err.startswith(f"kvtrace: warning: {cut}: file truncated")
        _, snapshots = read_state_log(cut)
        steps = [s.step for s in snapshots]
        assert steps == list(range(info["steps"])) and 0 < len(steps) <= replayed["steps"]


def test_data_tools_read_a_state_log(state_log: tuple[Path, dict]) -> None:
    log, replayed = state_log
    pl = pytest.importorskip("polars", reason="polars is not installed (pip install -e '.[dev]')")
    used = pl.scan_ipc(log).select((pl.col("pool_tokens") - pl.col("available") - pl.col("evictable")).max()).collect()
    assert used.item() == replayed["peak_used_tokens"]
    pd = pytest.importorskip("pandas", reason="pandas is not installed (pip install -e '.[dev]')")
    assert len(pd.read_feather(log, columns=["step"])) == replayed["steps"]
    duckdb = pytest.importorskip("duckdb", reason="duckdb is not installed (pip install -e '.[dev]')")
    import pyarrow.dataset as ds

    steps = ds.dataset(log, format="arrow")  # noqa: F841 - DuckDB finds it by name
    evicted = duckdb.sql(
        "SELECT sum(e.tokens) FROM (SELECT unnest(events) AS e FROM steps) WHERE e.kind = 'evict'"
    ).fetchall()
    assert evicted == [(replayed["evicted_tokens"],)]


def test_data_tools_read_a_recorded_trace(tmp_path: Path) -> None:
    out = tmp_path / "t.kvtrace"
    workload = Path(__file__).resolve().parents[2] / "traces" / "workloads_data" / "mooncake-fast25" / "conversation_trace.jsonl"
    result = runner.invoke(app, ["record", str(workload), "--duration", "10s", "--page-size", "16", "--out", str(out), "-q", "--json"])
    assert result.exit_code == 0, result.output
    steps = json.loads(result.stdout)["steps"]
    pl = pytest.importorskip("polars", reason="polars is not installed (pip install -e '.[dev]')")
    assert pl.scan_ipc(out).select(pl.col("step").n_unique()).collect().item() == steps
    pd = pytest.importorskip("pandas", reason="pandas is not installed (pip install -e '.[dev]')")
    assert pd.read_feather(out, columns=["step"])["step"].nunique() == steps
    duckdb = pytest.importorskip("duckdb", reason="duckdb is not installed (pip install -e '.[dev]')")
    import pyarrow.dataset as ds

    trace = ds.dataset(out, format="arrow")  # noqa: F841 - DuckDB finds it by name
    assert duckdb.sql("SELECT count(DISTINCT step) FROM trace").fetchall() == [(steps,)]


@pytest.mark.slow
def test_damaged_compacted_traces_never_crash(tmp_path: Path) -> None:
    """The IPC file layout under the same damage as the stream test above."""
    from traces.writer import compact_trace

    compacted = tmp_path / "tiny-file.kvtrace"
    compacted.write_bytes(sample_path("tiny").read_bytes())
    compact_trace(compacted, steps_per_batch=16)
    data = compacted.read_bytes()
    assert data[:6] == b"ARROW1"
    rng = np.random.default_rng(21)
    damaged = tmp_path / "damaged.kvtrace"
    for i in range(48):
        damaged.write_bytes(_damage(data, i % 6, rng))
        for command in ("info", "validate"):
            code, _, err = invoke(command, str(damaged), "--json")
            assert code in (0, 1, 2), err
            assert "Traceback" not in err and "internal error" not in err, err
            if code == 2:
                assert_one_error_line(err, str(damaged))


# -- progress -----------------------------------------------------------------------------


def test_validate_shows_progress_on_a_terminal_and_nothing_with_q_or_json() -> None:
    """stderr a terminal: the progress line is drawn there (and erased); stdout (a pipe)
    holds the verdict only. -q and --json draw nothing."""
    import sys

    from tests.helpers import run_with_terminal_stderr

    command = [sys.executable, "-m", "kvtrace", "validate", "sample:tiny"]
    code, out, drawn = run_with_terminal_stderr(command)
    assert code == 0, drawn
    assert out.startswith("ok: 139 steps") and len(out.splitlines()) == 1 and "\x1b" not in out
    assert "validating tiny.kvtrace" in drawn
    for flag in ("-q", "--json"):
        code, out, drawn = run_with_terminal_stderr([*command, flag])
        assert code == 0 and drawn == "", (flag, drawn)
