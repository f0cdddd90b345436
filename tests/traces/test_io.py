"""TraceWriter / TraceReader: round trip, truncation, corruption, errors, SIGKILL."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import decode_steps, make_meta, write_steps
from traces.batches import Ragged, StepBatch
from traces.encoding import CHECKSUM_KEY, to_record_batch
from traces.errors import (
    TraceCorruptError,
    TraceError,
    TraceMetadataError,
    TraceReadError,
    TraceSchemaError,
    TraceVersionError,
    TraceWriteError,
)
from traces.reader import TraceReader
from traces.schema import COLUMNS, METADATA_KEY, OPS, arrow_schema
from traces.writer import TraceWriter

REPO = Path(__file__).resolve().parents[2]


def read_all(path: Path) -> tuple[list[StepBatch], TraceReader]:
    reader = TraceReader(path)
    return list(reader.steps()), reader


# -- round trip -------------------------------------------------------------------------

_ragged_row = st.one_of(
    st.none(),
    st.lists(st.integers(0, 2**64 - 1), max_size=5),
)


@st.composite
def step_lists(draw: st.DrawFn) -> list[StepBatch]:
    steps = []
    step, time_s = draw(st.integers(0, 5)), draw(st.floats(0, 10, allow_nan=False))
    for _ in range(draw(st.integers(0, 8))):
        n = draw(st.integers(0, 7))
        ints = st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)
        small = st.lists(st.integers(0, 2**15), min_size=n, max_size=n)
        optional_small = st.one_of(st.none(), small)
        prompt = st.one_of(
            st.none(), st.lists(st.one_of(st.none(), st.integers(0, 2**40)), min_size=n, max_size=n)
        )
        hashes = st.one_of(st.none(), st.lists(_ragged_row, min_size=n, max_size=n))
        token_rows = st.one_of(
            st.none(),
            st.lists(
                st.one_of(st.none(), st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4)),
                min_size=n,
                max_size=n,
            ),
        )
        steps.append(
            StepBatch.from_columns(
                step,
                time_s,
                op=draw(st.lists(st.sampled_from(OPS), min_size=n, max_size=n)),
                rid=draw(ints),
                seq_len=draw(st.lists(st.integers(0, 2**40), min_size=n, max_size=n)),
                append_len=draw(small),
                draft_len=draw(optional_small),
                accepted_len=draw(optional_small),
                prefix_len=draw(st.one_of(st.none(), ints)),
                prompt_len=draw(prompt),
                block_hashes=draw(hashes),
                token_ids=draw(token_rows),
            )
        )
        step += draw(st.integers(1, 3))
        time_s += draw(st.floats(0, 1, allow_nan=False))
    return steps


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=step_lists(),
    compression=st.sampled_from(["zstd", "lz4"]),
    steps_per_batch=st.sampled_from([1, 2, 3, 7]),
)
def test_round_trip_is_identical(steps: list[StepBatch], compression: str, steps_per_batch: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.kvtrace"
        # every op kind, the session ops included (a sessions trace may hold them)
        meta = make_meta(sessions=True)
        write_steps(path, steps, meta=meta, compression=compression, steps_per_batch=steps_per_batch)
        back, reader = read_all(path)
    expected = [s for s in steps if len(s)]  # a step without rows is not written
    assert len(back) == len(expected)
    for got, want in zip(back, expected):
        assert got.equals(want), (got, want)
        assert got.is_op_ordered()
    assert not reader.truncated and reader.truncation_detail is None
    assert reader.meta == make_meta(sessions=True)


def test_rows_are_sorted_stably_into_op_order(tmp_path: Path) -> None:
    path = tmp_path / "t.kvtrace"
    with TraceWriter(path, make_meta()) as writer:
        writer.write_step(
            3,
            1.5,
            op=["decode", "extend", "finish", "decode", "retract", "spec", "abort", "prealloc"],
            rid=[10, 11, 12, 13, 14, 15, 16, 17],
            seq_len=[5, 6, 7, 8, 9, 10, 11, 12],
            append_len=[1, 6, 0, 1, 0, 2, 0, 12],
            token_ids=[[1], None, None, [2], None, None, None, None],
        )
        assert writer.steps_written == 1 and writer.rows_written == 8
    (step,), _ = read_all(path)
    assert [OPS[c] for c in step.op] == [
        "finish", "abort", "retract", "prealloc", "extend", "decode", "decode", "spec"
    ]
    assert step.rid.tolist() == [12, 16, 14, 17, 11, 10, 13, 15]
    assert [None if r is None else r.tolist() for r in step.token_ids.rows()] == [
        None, None, None, None, None, [1], [2], None
    ]


def test_steps_range_filter_and_batches_holding_several_steps(tmp_path: Path) -> None:
    path = write_steps(tmp_path / "t.kvtrace", decode_steps(20), steps_per_batch=6)
    reader = TraceReader(path)
    assert [s.step for s in reader.steps(start=5, stop=9)] == [5, 6, 7, 8]
    assert [s.step for s in reader.steps(start=18)] == [18, 19]
    assert [s.step for s in reader.steps(stop=2)] == [0, 1]
    # An empty batch written at open (schema on disk at once), then 6 + 6 + 6 + 2 steps.
    assert [b.num_rows for b in reader.iter_batches()] == [0, 36, 36, 36, 12]
    assert reader.num_record_batches == 5 and not reader.truncated


def test_a_step_split_across_record_batches_is_merged(tmp_path: Path) -> None:
    meta = make_meta()
    schema = arrow_schema(meta)
    whole = StepBatch.from_columns(
        7, 0.5, op=["finish", "decode", "decode"], rid=[0, 1, 2], seq_len=[4, 5, 6],
        append_len=[0, 1, 1], token_ids=[None, [9], [8]],
    )
    path = tmp_path / "split.kvtrace"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for part in (whole.take(np.array([0])), whole.take(np.array([1, 2]))):
            batch, checksum = to_record_batch([part], schema)
            writer.write_batch(batch, custom_metadata={CHECKSUM_KEY: checksum})
    (step,), reader = read_all(path)
    assert step.equals(whole)
    assert reader.num_record_batches == 2


def test_missing_optional_columns_read_as_defaults(tmp_path: Path) -> None:
    meta = make_meta()
    required = [c for c in COLUMNS if c.required]
    schema = pa.schema(
        [pa.field(c.name, c.type) for c in required], metadata={METADATA_KEY: meta.to_json().encode()}
    )
    arrays = [
        pa.array([0, 0, 1]),
        pa.array([0.0, 0.0, 0.1]),
        pa.DictionaryArray.from_arrays(pa.array([0, 0, 1], pa.int8()), pa.array(OPS)),
        pa.array([0, 1, 0]),
        pa.array([8, 9, 9]),
        pa.array([8, 9, 1], pa.int32()),
    ]
    path = tmp_path / "minimal.kvtrace"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(pa.RecordBatch.from_arrays(arrays, schema=schema))
    steps, reader = read_all(path)
    assert [s.step for s in steps] == [0, 1]
    first = steps[0]
    assert first.prompt_len.tolist() == [-1, -1] and first.draft_len.tolist() == [0, 0]
    assert first.block_hashes.equals(Ragged.empty(2, np.uint64))
    assert not reader.truncated


# -- writer behaviour and errors --------------------------------------------------------


def test_writer_refuses_a_step_that_does_not_increase(tmp_path: Path) -> None:
    with TraceWriter(tmp_path / "t.kvtrace", make_meta()) as writer:
        writer.write_step(5, 0.0, op=["decode"], rid=[0], seq_len=[3], append_len=[1])
        with pytest.raises(ValueError, match="step 4 written after step 5"):
            writer.write_step(4, 0.0, op=["decode"], rid=[0], seq_len=[4], append_len=[1])
        with pytest.raises(ValueError, match="step 5 written after step 5"):
            writer.write_step(5, 0.0, op=["decode"], rid=[0], seq_len=[4], append_len=[1])


def test_writer_rejects_bad_columns(tmp_path: Path) -> None:
    with TraceWriter(tmp_path / "t.kvtrace", make_meta()) as writer:
        with pytest.raises(ValueError, match="column 'seq_len' has shape"):
            writer.write_step(0, 0.0, op=["decode"] * 2, rid=[0, 1], seq_len=[3], append_len=[1, 1])
        with pytest.raises(ValueError, match="unknown op 'prefill'"):
            writer.write_step(0, 0.0, op=["prefill"], rid=[0], seq_len=[3], append_len=[1])
        with pytest.raises(ValueError, match="token_ids: 1 rows, expected 2"):
            writer.write_step(
                0, 0.0, op=[1, 1], rid=[0, 1], seq_len=[3, 3], append_len=[1, 1], token_ids=[[1]]
            )
        good = decode_steps(1, rows=3)[0]
        with pytest.raises(ValueError, match="column 'seq_len' has shape"):
            writer.write(dataclasses.replace(good, seq_len=good.seq_len[:2]))
        with pytest.raises(ValueError, match="op codes must lie in"):
            writer.write(dataclasses.replace(good, op=np.array([1, 9, 1], np.int8)))
    with pytest.raises(ValueError, match="compression must be one of zstd, lz4"):
        TraceWriter(tmp_path / "u.kvtrace", make_meta(), compression="gzip")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="steps_per_batch"):
        TraceWriter(tmp_path / "u.kvtrace", make_meta(), steps_per_batch=0)


def test_writer_refuses_to_overwrite_unless_asked(tmp_path: Path) -> None:
    path = write_steps(tmp_path / "t.kvtrace", decode_steps(2))
    with pytest.raises(TraceWriteError, match=r"t\.kvtrace already exists"):
        TraceWriter(path, make_meta())
    write_steps(path, decode_steps(3), overwrite=True)
    assert len(read_all(path)[0]) == 3


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("dir", "it is a directory"),
        ("missing/parent/t.kvtrace", "No such file or directory"),
        ("/dev/full", "No space left on device"),
    ],
)
def test_writer_io_errors_name_the_path(tmp_path: Path, target: str, message: str) -> None:
    if target == "/dev/full" and not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    path = Path(target) if target.startswith("/") else tmp_path / target
    if target == "dir":
        path.mkdir()
    with pytest.raises(TraceWriteError) as info:
        with TraceWriter(path, make_meta(), overwrite=True) as writer:
            for batch in decode_steps(3):
                writer.write(batch)
    assert message in str(info.value) and str(path) in str(info.value)
    assert "\n" not in str(info.value)


def test_exception_inside_the_writer_keeps_complete_steps(tmp_path: Path) -> None:
    path = tmp_path / "t.kvtrace"
    with pytest.raises(RuntimeError, match="engine crashed"):
        with TraceWriter(path, make_meta(), steps_per_batch=4) as writer:
            for batch in decode_steps(6):
                writer.write(batch)
            raise RuntimeError("engine crashed")
    steps, reader = read_all(path)
    assert [s.step for s in steps] == list(range(6))
    assert not reader.truncated  # the writer closed the stream properly
    with pytest.raises(ValueError, match="closed"):
        writer.write(decode_steps(1, first_step=9)[0])


def test_empty_trace_round_trips(tmp_path: Path) -> None:
    path = write_steps(tmp_path / "t.kvtrace", [])
    steps, reader = read_all(path)
    assert steps == [] and not reader.truncated and reader.meta == make_meta()


# -- truncation -------------------------------------------------------------------------


def _message_ends(data: bytes) -> list[int]:
    """Byte offsets where each IPC message ends (framing: 0xFFFFFFFF, length, metadata, body)."""
    from traces.ipc import _parse_message_header

    ends, pos = [], 0
    while pos < len(data):
        meta_len = int.from_bytes(data[pos + 4 : pos + 8], "little", signed=True)
        if meta_len == 0:
            ends.append(pos + 8)
            break
        _, body = _parse_message_header(data[pos + 8 : pos + 8 + meta_len])
        pos += 8 + meta_len + body
        ends.append(pos)
    return ends


def test_truncated_files_read_back_every_complete_batch(tmp_path: Path) -> None:
    original = decode_steps(9)
    path = write_steps(tmp_path / "t.kvtrace", original, steps_per_batch=2)
    data = path.read_bytes()
    # schema, dictionary, the empty first batch, 5 record batches, end-of-stream
    ends = _message_ends(data)
    assert len(ends) == 9 and ends[-1] == len(data)
    cut_path = tmp_path / "cut.kvtrace"
    cuts = sorted({*ends[1:-1], *(e - 1 for e in ends[2:]), *(e + 5 for e in ends[1:-2])})
    for cut in cuts + [len(data) - 8, len(data) - 3]:
        cut_path.write_bytes(data[:cut])
        steps, reader = read_all(cut_path)
        complete_batches = sum(1 for e in ends[3:-1] if e <= cut)
        expected = original[: min(9, 2 * complete_batches)]
        assert len(steps) == len(expected), cut
        assert all(a.equals(b) for a, b in zip(steps, expected))
        assert reader.truncated, cut
        last = f"after step {expected[-1].step}" if expected else "before any step"
        assert reader.truncation_detail.startswith(f"file truncated {last}: "), reader.truncation_detail
        at_boundary = cut in ends
        assert ("no end-of-stream marker" in reader.truncation_detail) == at_boundary, cut


def test_truncated_inside_the_schema_is_an_error(tmp_path: Path) -> None:
    data = write_steps(tmp_path / "t.kvtrace", decode_steps(1)).read_bytes()
    cut = tmp_path / "cut.kvtrace"
    cut.write_bytes(data[:40])
    with pytest.raises(TraceReadError, match="ends inside its schema message"):
        TraceReader(cut)


# -- corruption -------------------------------------------------------------------------


@pytest.mark.parametrize("compression", ["zstd", "lz4"])
@pytest.mark.slow
def test_every_single_byte_corruption_is_detected_or_harmless(tmp_path: Path, compression: str) -> None:
    original = decode_steps(4, rows=12)
    path = write_steps(tmp_path / "t.kvtrace", original, compression=compression, steps_per_batch=2)
    data = path.read_bytes()
    damaged = tmp_path / "damaged.kvtrace"
    outcomes = {"identical": 0, "error": 0}
    for offset in range(0, len(data), 5):
        flipped = bytearray(data)
        flipped[offset] ^= 0xA5
        damaged.write_bytes(bytes(flipped))
        try:
            steps, reader = read_all(damaged)
        except TraceError as exc:
            assert "\n" not in str(exc) and str(damaged) in str(exc)
            outcomes["error"] += 1
            continue
        # A damaged end-of-stream marker reads as a file that was not closed.
        assert not reader.truncated or offset >= len(data) - 8, offset
        assert len(steps) == len(original) and all(a.equals(b) for a, b in zip(steps, original)), offset
        outcomes["identical"] += 1
    assert outcomes["error"] > len(data) // 10  # most bytes matter


def test_garbage_in_the_middle_names_the_batch_and_step(tmp_path: Path) -> None:
    path = write_steps(tmp_path / "t.kvtrace", decode_steps(8, rows=30), steps_per_batch=2)
    data = bytearray(path.read_bytes())
    ends = _message_ends(bytes(data))  # schema, dictionary, empty batch, batches of 2 steps...
    start = ends[4] + 200  # inside the body of record batch 4 (steps 4 and 5)
    data[start : start + 64] = np.random.default_rng(1).integers(0, 256, 64, dtype=np.uint8).tobytes()
    path.write_bytes(bytes(data))
    reader = TraceReader(path)
    seen = []
    with pytest.raises(TraceCorruptError, match=r"corrupt data in record batch 4 \(after step 3\)") as info:
        for step in reader.steps():
            seen.append(step.step)
    assert seen == [0, 1, 2]  # steps of complete batches before the damage were delivered
    assert str(path) in str(info.value)


def test_data_after_the_end_of_stream_marker_is_corruption(tmp_path: Path) -> None:
    path = write_steps(tmp_path / "t.kvtrace", decode_steps(2))
    path.write_bytes(path.read_bytes() + b"extra bytes")
    with pytest.raises(TraceCorruptError, match="11 bytes of unexpected data after the end-of-stream"):
        read_all(path)


# -- open errors ------------------------------------------------------------------------


def _write_raw(path: Path, schema: pa.Schema, arrays: list[pa.Array] | None = None) -> Path:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        if arrays is not None:
            writer.write_batch(pa.RecordBatch.from_arrays(arrays, schema=schema))
    return path


def _schema_with(metadata: bytes | None, drop: str | None = None, retype: tuple[str, pa.DataType] | None = None) -> pa.Schema:
    fields = []
    for c in COLUMNS:
        if c.name == drop:
            continue
        fields.append(pa.field(c.name, retype[1] if retype and retype[0] == c.name else c.type))
    return pa.schema(fields, metadata=None if metadata is None else {METADATA_KEY: metadata})


def test_open_errors(tmp_path: Path) -> None:
    good_meta = make_meta().to_json().encode()
    newer = json.loads(good_meta)
    newer["format_version"] = 7
    no_config = json.loads(good_meta)
    del no_config["config"]["pool_tokens"]
    (tmp_path / "adir").mkdir()
    (tmp_path / "empty.kvtrace").write_bytes(b"")
    (tmp_path / "text.kvtrace").write_text("step,op\n0,decode\n")
    table = pa.table({"a": [1, 2]})
    with pa.OSFile(str(tmp_path / "file-format.kvtrace"), "wb") as sink:
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
    cases = {
        "missing.kvtrace": (TraceReadError, "no such file"),
        "adir": (TraceReadError, "is a directory"),
        "empty.kvtrace": (TraceReadError, "is empty"),
        "text.kvtrace": (TraceReadError, "is not an Arrow IPC stream"),
        "file-format.kvtrace": (TraceMetadataError, "has no kvtrace metadata"),  # read, then judged
        "newer.kvtrace": (TraceVersionError, "format version 7, but this kvtrace reads format version 6 at most; upgrade kvtrace"),
        "nometa.kvtrace": (TraceMetadataError, "has no kvtrace metadata"),
        "badjson.kvtrace": (TraceMetadataError, "kvtrace metadata is not valid JSON"),
        "badmeta.kvtrace": (TraceMetadataError, "'config.pool_tokens' is missing"),
        "nocol.kvtrace": (TraceSchemaError, "required column 'seq_len' missing"),
        "badtype.kvtrace": (TraceSchemaError, "column 'seq_len' has type string, expected int64"),
    }
    _write_raw(tmp_path / "newer.kvtrace", _schema_with(json.dumps(newer).encode()))
    _write_raw(tmp_path / "nometa.kvtrace", _schema_with(None))
    _write_raw(tmp_path / "badjson.kvtrace", _schema_with(b"{not json"))
    _write_raw(tmp_path / "badmeta.kvtrace", _schema_with(json.dumps(no_config).encode()))
    _write_raw(tmp_path / "nocol.kvtrace", _schema_with(good_meta, drop="seq_len"))
    _write_raw(tmp_path / "badtype.kvtrace", _schema_with(good_meta, retype=("seq_len", pa.string())))
    for name, (error, message) in cases.items():
        with pytest.raises(error) as info:
            TraceReader(tmp_path / name)
        assert message in str(info.value), (name, str(info.value))
        assert str(tmp_path / name) in str(info.value) and "\n" not in str(info.value)


def test_nulls_in_a_required_column_and_unknown_ops(tmp_path: Path) -> None:
    meta = make_meta().to_json().encode()
    required = [c for c in COLUMNS if c.required]
    schema = pa.schema([pa.field(c.name, c.type) for c in required], metadata={METADATA_KEY: meta})

    def arrays(rid: pa.Array, ops: list[str]) -> list[pa.Array]:
        return [
            pa.array([0, 0]), pa.array([0.0, 0.0]),
            pa.DictionaryArray.from_arrays(pa.array([0, 1], pa.int8()), pa.array(ops)),
            rid, pa.array([1, 1]), pa.array([1, 1], pa.int32()),
        ]

    _write_raw(tmp_path / "nulls.kvtrace", schema, arrays(pa.array([0, None], pa.int64()), ["extend", "decode"]))
    with pytest.raises(TraceSchemaError, match="column 'rid' holds 1 null values in record batch 1"):
        read_all(tmp_path / "nulls.kvtrace")
    _write_raw(tmp_path / "ops.kvtrace", schema, arrays(pa.array([0, 1]), ["extend", "prefill"]))
    with pytest.raises(TraceSchemaError, match="unknown op 'prefill' in record batch 1"):
        read_all(tmp_path / "ops.kvtrace")


# -- SIGKILL ----------------------------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {repo!r})
    from tests.helpers import decode_steps, make_meta
    from traces.writer import TraceWriter

    writer = TraceWriter({path!r}, make_meta(), steps_per_batch=3)
    step = 0
    while True:
        for batch in decode_steps(1, rows=40, first_step=step):
            writer.write(batch)
        step += 1
        if step % 3 == 0:  # a record batch was just written and flushed
            print(step, flush=True)
    """
)


@pytest.mark.slow
def test_sigkill_leaves_every_completed_batch_readable(tmp_path: Path) -> None:
    path = tmp_path / "killed.kvtrace"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD.format(repo=str(REPO), path=str(path))],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        flushed = 0
        assert child.stdout is not None
        while flushed < 300:
            line = child.stdout.readline()
            assert line, "the writer process died"
            flushed = int(line)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    steps, reader = read_all(path)
    assert len(steps) >= flushed and len(steps) % 3 == 0
    expected = decode_steps(1, rows=40, first_step=0)[0]
    assert steps[0].equals(expected)
    assert [s.step for s in steps] == list(range(len(steps)))
    assert all(s.equals(decode_steps(1, rows=40, first_step=s.step)[0]) for s in steps[-3:])
    assert reader.truncated
    assert reader.truncation_detail.startswith(f"file truncated after step {steps[-1].step}: ")


def test_a_non_lru_eviction_policy_is_written_as_a_version_older_readers_refuse() -> None:
    """A reader of version 4 ignores unknown config keys: it would replay an LFU trace as
    LRU, so such a trace is version 5; an LRU one keeps the version it had."""
    from traces.metadata import TraceMeta

    lru = make_meta()
    lfu = lru.with_config(eviction_policy="lfu")
    assert lru.format_version == 1
    assert lfu.written_version == lfu.format_version == 5
    assert TraceMeta.from_json(lfu.to_json()).config.eviction_policy == "lfu"
