"""The IPC file layout written by compaction, files cut short, the recording status,
and the tools data people use reading a trace directly."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pyarrow as pa
import pytest

from tests.helpers import decode_steps, make_meta, write_steps
from traces.encoding import RECORDING_KEY
from traces.metadata import Recording, TraceMeta
from traces.reader import TraceReader
from traces.writer import TraceWriter, compact_trace

RECORDING = Recording(kvtrace_version="0.1.0", command="kvtrace record w.jsonl --out t.kvtrace")


def recording_meta() -> TraceMeta:
    return dataclasses.replace(make_meta(), recording=RECORDING, created_at="2025-01-01T00:00:00Z")


def read(path: Path) -> tuple[list, TraceReader]:
    reader = TraceReader(path)
    return list(reader.steps()), reader


def test_compaction_writes_an_ipc_file_with_the_same_steps(tmp_path: Path) -> None:
    steps = decode_steps(40)
    stream = write_steps(tmp_path / "stream.kvtrace", steps, meta=recording_meta())
    compact = write_steps(tmp_path / "compact.kvtrace", steps, meta=recording_meta(), compact_steps_per_batch=16)
    assert stream.read_bytes()[:6] != b"ARROW1"
    data = compact.read_bytes()
    assert data[:6] == b"ARROW1" and data[-6:] == b"ARROW1"
    got, reader = read(compact)
    assert reader.ipc_format == "file" and not reader.truncated
    assert len(got) == 40 and all(a.equals(b) for a, b in zip(got, steps))
    assert reader.num_record_batches == 3  # 16 + 16 + 8 steps, no empty batch
    # The footer indexes the batches: random access without reading the rest.
    with pa.memory_map(str(compact)) as source:
        file = pa.ipc.open_file(source)
        assert file.num_record_batches == 3
        assert file.get_batch(2).column("step").to_pylist()[0] == 32
    # The final status is in the schema metadata of the file.
    assert reader.meta.recording is not None and reader.meta.recording.status == "complete"
    assert reader.recording == reader.meta.recording and reader.recording.steps == 40
    assert not list(tmp_path.glob(".*.tmp"))  # the temporary file was renamed into place


def test_a_file_cut_short_reads_every_complete_batch(tmp_path: Path) -> None:
    steps = decode_steps(40)
    path = write_steps(tmp_path / "t.kvtrace", steps, compact_steps_per_batch=8)
    data = path.read_bytes()
    footer_start = len(data) - 10 - int.from_bytes(data[-10:-6], "little")
    cases = {
        "in-footer.kvtrace": (footer_start + 5, 40, "footer is missing"),
        "no-footer.kvtrace": (footer_start, 40, "footer is missing"),
        "no-eos.kvtrace": (footer_start - 8, 40, "no end-of-stream marker"),
        "in-batch.kvtrace": (footer_start - 300, 32, "incomplete"),
    }
    for name, (size, complete_steps, detail) in cases.items():
        cut = tmp_path / name
        cut.write_bytes(data[:size])
        got, reader = read(cut)
        assert reader.ipc_format == "file"
        assert len(got) == complete_steps and all(a.equals(b) for a, b in zip(got, steps)), name
        assert reader.truncated, name
        assert detail in reader.truncation_detail, (name, reader.truncation_detail)


def test_a_stream_records_its_closing_status(tmp_path: Path) -> None:
    path = write_steps(tmp_path / "done.kvtrace", decode_steps(5), meta=recording_meta())
    got, reader = read(path)
    assert len(got) == 5 and reader.meta.recording.status == "recording"  # as written at the start
    assert reader.recording.status == "complete" and reader.recording.steps == 5
    assert reader.recording.finished_at is not None and reader.recording.command == RECORDING.command


def test_an_exception_marks_the_stream_interrupted_and_skips_compaction(tmp_path: Path) -> None:
    path = tmp_path / "stopped.kvtrace"
    with pytest.raises(KeyboardInterrupt):
        with TraceWriter(path, recording_meta(), compact_steps_per_batch=16) as writer:
            for batch in decode_steps(7):
                writer.write(batch)
            raise KeyboardInterrupt
    got, reader = read(path)
    assert reader.ipc_format == "stream" and len(got) == 7 and not reader.truncated
    assert reader.recording.status == "interrupted"
    assert reader.recording.detail == "interrupted by Ctrl-C (SIGINT)" and reader.recording.steps == 7
    with pytest.raises(RuntimeError):
        with TraceWriter(tmp_path / "crashed.kvtrace", recording_meta()) as writer:
            writer.write(decode_steps(1)[0])
            raise RuntimeError("engine crashed")
    _, crashed = read(tmp_path / "crashed.kvtrace")
    assert crashed.recording.detail == "stopped by an error: RuntimeError: engine crashed"


def test_a_writer_that_never_closed_reads_as_interrupted(tmp_path: Path) -> None:
    path = tmp_path / "killed.kvtrace"
    writer = TraceWriter(path, recording_meta())
    for batch in decode_steps(3):
        writer.write(batch)
    writer.flush()  # as a killed process leaves it: no closing status, no end marker
    reader = TraceReader(path)
    assert reader.recording.status == "recording"  # not read to the end yet
    assert len(list(reader.steps())) == 3 and reader.truncated
    assert reader.recording.status == "interrupted"
    assert "without closing the trace" in reader.recording.detail
    writer.close()


def test_a_trace_without_recording_metadata_gets_no_closing_batch(tmp_path: Path) -> None:
    path = write_steps(tmp_path / "plain.kvtrace", decode_steps(3))
    reader = TraceReader(path)
    batches = list(reader.iter_batches_with_metadata())
    assert all(custom is None or RECORDING_KEY not in custom for _, custom in batches)
    assert reader.meta.recording is None and reader.recording is None
    assert '"recording"' not in reader.schema.metadata[b"kvtrace"].decode()  # as older traces hold


def test_compacting_an_existing_trace_in_place_keeps_its_status(tmp_path: Path) -> None:
    steps = decode_steps(10)
    path = write_steps(tmp_path / "t.kvtrace", steps)
    compact_trace(path, steps_per_batch=4)
    got, reader = read(path)
    assert reader.ipc_format == "file" and reader.num_record_batches == 3 and reader.recording is None
    assert all(a.equals(b) for a, b in zip(got, steps))
    done = write_steps(tmp_path / "done.kvtrace", steps, meta=recording_meta())
    compact_trace(done, steps_per_batch=4)
    _, reader = read(done)
    assert reader.ipc_format == "file" and reader.meta.recording.status == "complete"
    killed = tmp_path / "killed.kvtrace"
    writer = TraceWriter(killed, recording_meta())
    for batch in steps[:4]:
        writer.write(batch)
    writer.flush()  # never closed
    compact_trace(killed, steps_per_batch=4)
    got, reader = read(killed)
    assert len(got) == 4 and reader.meta.recording.status == "interrupted"
    assert reader.recording.status == "interrupted"
    writer.close()


def test_metadata_of_older_traces_still_parses() -> None:
    data = make_meta().to_dict()
    assert "recording" not in data
    assert TraceMeta.from_dict(data) == make_meta()
    data["recording"] = {"status": "done"}
    with pytest.raises(ValueError, match="'recording.status' must be one of recording, complete, interrupted"):
        TraceMeta.from_dict(data)


# -- the tools data people use ----------------------------------------------------------


@pytest.fixture
def compact_trace_file(tmp_path: Path) -> Path:
    return write_steps(tmp_path / "t.kvtrace", decode_steps(30), meta=recording_meta(), compact_steps_per_batch=8)


def test_polars_scans_a_trace(compact_trace_file: Path) -> None:
    pl = pytest.importorskip("polars", reason="polars is not installed (pip install -e '.[dev]')")
    frame = pl.scan_ipc(compact_trace_file).filter(pl.col("step") >= 10).select("step", "op", "seq_len").collect()
    assert frame.height == 20 * 6
    assert set(frame["op"].cast(pl.Utf8)) == {"decode"}


def test_pandas_reads_a_trace_as_feather(compact_trace_file: Path) -> None:
    pd = pytest.importorskip("pandas", reason="pandas is not installed (pip install -e '.[dev]')")
    frame = pd.read_feather(compact_trace_file, columns=["step", "rid", "seq_len"])
    assert len(frame) == 30 * 6 and int(frame["seq_len"].max()) == 100 * 29 + 5


def test_duckdb_queries_a_trace(compact_trace_file: Path) -> None:
    duckdb = pytest.importorskip("duckdb", reason="duckdb is not installed (pip install -e '.[dev]')")
    import pyarrow.dataset as ds

    trace = ds.dataset(compact_trace_file, format="arrow")  # lazy: DuckDB pushes the filter down
    rows = duckdb.sql("SELECT count(*), max(seq_len) FROM trace WHERE op = 'decode' AND rid = 5").fetchall()
    assert rows == [(30, 100 * 29 + 5)]


def test_damage_inside_a_file_is_corruption_not_truncation(tmp_path: Path) -> None:
    from traces.errors import TraceCorruptError

    path = write_steps(tmp_path / "t.kvtrace", decode_steps(40), compact_steps_per_batch=8)
    data = bytearray(path.read_bytes())
    bad_footer = tmp_path / "bad-footer.kvtrace"
    bad_footer.write_bytes(bytes(data[:-10]) + (10**9).to_bytes(4, "little") + b"ARROW1")
    with pytest.raises(TraceCorruptError, match="its footer length 1000000000 does not fit"):
        TraceReader(bad_footer)
    # A byte flipped in the middle of a batch: the batch checksum (or the codec) catches it.
    data[len(data) // 2] ^= 0xFF
    damaged = tmp_path / "damaged.kvtrace"
    damaged.write_bytes(bytes(data))
    with pytest.raises(TraceCorruptError, match=r"trace .*damaged\.kvtrace: corrupt data in record batch"):
        list(TraceReader(damaged).steps())


def test_an_interruption_during_a_step_write_lands_after_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A signal handler raising through ``interrupt_when_safe`` in the middle of a step
    being written: the step reaches the file and the closing status counts it."""
    import signal

    import traces.writer as trace_writer

    path = tmp_path / "t.kvtrace"
    convert = trace_writer.to_record_batch
    calls = []

    def convert_and_get_a_signal(steps: list, schema: pa.Schema) -> tuple:
        calls.append(len(steps))
        if len(calls) == 4:  # the empty first batch, then steps 0, 1, 2: Ctrl-C while writing step 2
            signal.raise_signal(signal.SIGINT)
        return convert(steps, schema)

    monkeypatch.setattr(trace_writer, "to_record_batch", convert_and_get_a_signal)
    previous = signal.signal(signal.SIGINT, lambda signum, frame: trace_writer.interrupt_when_safe(KeyboardInterrupt()))
    try:
        with pytest.raises(KeyboardInterrupt):
            with TraceWriter(path, recording_meta()) as writer:
                for batch in decode_steps(10):
                    writer.write(batch)
    finally:
        signal.signal(signal.SIGINT, previous)
    got, reader = read(path)
    assert [s.step for s in got] == [0, 1, 2] and reader.recording.steps == 3
    assert reader.recording.detail == "interrupted by Ctrl-C (SIGINT)"
