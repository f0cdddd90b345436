"""A trace as a workload: the arrival_s column, the requests read back, and
``kvtrace record TRACE`` scheduling them anew."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.record.recorder import Recorder
from traces.batches import StepBatch
from traces.encoding import ARRIVAL_CHECKSUM_KEY
from traces.errors import TraceError
from traces.metadata import TraceConfig, TraceMeta
from traces.reader import TraceReader
from traces.trace_workload import read_trace_workload
from traces.writer import compact_trace

ROOT = Path(__file__).resolve().parents[2]
MOONCAKE = ROOT / "traces" / "workloads_data" / "mooncake-fast25" / "conversation_trace.jsonl"
META = TraceMeta(config=TraceConfig(page_size=16, pool_tokens=4096, max_running=8, max_context_len=2048))


def _record(args: list[str]) -> tuple[int, dict, str]:
    result = CliRunner().invoke(app, ["record", *args, "--json", "-q"])
    return result.exit_code, json.loads(result.stdout) if result.exit_code == 0 else {}, result.output


def test_arrival_s_is_kept_on_first_rows_and_survives_compaction(tmp_path: Path) -> None:
    path = tmp_path / "a.kvtrace"
    with Recorder(path, META) as rec:
        rec.begin_step(0.5)
        rec.extend([0, 1], [10, 20], prompt_lens=[10, 20], arrival_s=[0.25, 0.5])
        rec.end_step()
        rec.begin_step(0.75)
        rec.decode([0, 1])
        rec.extend([2], [5], prompt_lens=[5], arrival_s=[0.6])
        rec.end_step()
    steps = list(TraceReader(path).steps())
    assert steps[0].arrivals().tolist() == [0.25, 0.5]
    # Only a request's first row keeps it; the decodes of step 1 have none.
    got = steps[1].arrivals()
    assert np.isnan(got[steps[1].rid != 2]).all() and got[steps[1].rid == 2].tolist() == [0.6]
    compact_trace(path, steps_per_batch=8)
    again = list(TraceReader(path).steps())
    assert all(a.equals(b) for a, b in zip(steps, again)) and len(again) == 2


def test_the_arrival_checksum_follows_the_readme_recipe_and_catches_damage(tmp_path: Path) -> None:
    path = tmp_path / "a.kvtrace"
    with Recorder(path, META, compact_steps_per_batch=4) as rec:
        for step in range(6):
            rec.begin_step(float(step))
            rec.extend([step], [8], prompt_lens=[8], arrival_s=[step / 2])
            rec.end_step()
    with pa.memory_map(str(path)) as source:
        file = pa.ipc.open_file(source)
        for i in range(file.num_record_batches):
            batch, custom = file.get_batch_with_custom_metadata(i)
            values = np.asarray(batch.column("arrival_s").fill_null(np.nan).to_numpy(zero_copy_only=False), "<f8")
            assert custom[ARRIVAL_CHECKSUM_KEY].decode() == f"{zlib.crc32(values.tobytes()):08x}"
    # The same rows, one arrival changed, the old checksums kept: the reader refuses it.
    table = pa.ipc.open_file(str(path)).read_all()
    batches = []
    with pa.memory_map(str(path)) as source:
        file = pa.ipc.open_file(source)
        batches = [file.get_batch_with_custom_metadata(i) for i in range(file.num_record_batches)]
    bad = tmp_path / "bad.kvtrace"
    with pa.ipc.new_file(str(bad), table.schema) as writer:
        for i, (batch, custom) in enumerate(batches):
            if i == 0:
                arrival = batch.column("arrival_s").to_pylist()
                arrival[0] = 99.0
                batch = batch.set_column(batch.schema.get_field_index("arrival_s"), "arrival_s", pa.array(arrival, pa.float64()))
            writer.write_batch(batch, custom_metadata=custom)
    with pytest.raises(TraceError, match="arrival_s checksum mismatch"):
        list(TraceReader(bad).steps())


def test_a_trace_without_the_column_reads_as_no_arrivals(tmp_path: Path) -> None:
    from traces.samples import sample_path

    reader = TraceReader(sample_path("tiny"))
    assert "arrival_s" not in reader.schema.names
    first = next(reader.steps())
    assert first.arrival_s is None and np.isnan(first.arrivals()).all()
    workload = read_trace_workload(sample_path("tiny"))
    assert not workload.arrivals_recorded and len(workload.requests) == 32
    arrivals = [r.arrival_s for r in workload.requests]
    assert arrivals == sorted(arrivals)


@pytest.mark.slow
def test_a_recorded_trace_scheduled_anew_under_its_own_options_is_the_same_trace(tmp_path: Path) -> None:
    first, again = tmp_path / "first.kvtrace", tmp_path / "again.kvtrace"
    common = ["--page-size", "16", "--pool-tokens", "60000", "--max-running", "8"]
    code, a, output = _record([str(MOONCAKE), "--duration", "4s", "--out", str(first), *common])
    assert code == 0, output
    workload = read_trace_workload(first)
    assert workload.arrivals_recorded and workload.block_size == 512 and len(workload.requests) == a["requests"]
    code, b, output = _record([str(first), "--out", str(again)])  # every option from the trace
    assert code == 0, output
    assert b["format"] == "trace" and b["config"] == a["config"]
    for key in ("steps", "requests", "prefix_hit_rate", "duration_s", "retractions", "peak_used_tokens", "ttft_s"):
        assert a[key] == b[key], key
    steps_a, steps_b = list(TraceReader(first).steps()), list(TraceReader(again).steps())
    assert len(steps_a) == len(steps_b) == a["steps"] and all(x.equals(y) for x, y in zip(steps_a, steps_b))
    # A smaller pool schedules the same requests anew instead of running out of memory.
    smaller = tmp_path / "smaller.kvtrace"
    code, c, output = _record([str(first), "--pool-tokens", "20000", "--out", str(smaller)])
    assert code == 0, output
    # (prompts that cannot fit the smaller pool are rejected on arrival, as SGLang rejects them)
    assert c["requests"] + c["rejected"] == a["requests"] and c["config"]["pool_tokens"] == 20000
    assert c["peak_used_tokens"] <= 20000 and c["duration_s"] >= a["duration_s"]


def test_explicit_prompt_ids_keep_their_sharing_when_scheduled_anew(tmp_path: Path) -> None:
    """Two requests whose prompts share 64 explicit ids: the second reuses them from the cache."""
    path = tmp_path / "ids.kvtrace"
    shared = np.arange(1000, 1064)
    with Recorder(path, META) as rec:
        rec.begin_step(0.0)
        rec.extend([0], [80], prompt_lens=[80], token_ids=[np.concatenate([shared, np.arange(16)])], arrival_s=[0.0])
        rec.end_step()
        rec.begin_step(0.1)
        rec.decode([0])
        rec.end_step()
        rec.begin_step(0.2)
        rec.finish([0], [81])
        rec.end_step()
        rec.begin_step(1.0)
        rec.extend([1], [96], prompt_lens=[96], token_ids=[np.concatenate([shared, np.arange(50, 82)])], arrival_s=[1.0])
        rec.end_step()
        rec.begin_step(1.1)
        rec.finish([1], [96])
        rec.end_step()
    workload = read_trace_workload(path)
    assert workload.block_size == 1
    a, b = workload.requests
    assert (a.input_len, a.output_len, b.input_len, b.output_len) == (80, 2, 96, 1)
    assert np.array_equal(a.block_hashes[:64], b.block_hashes[:64]) and a.block_hashes[64] != b.block_hashes[64]
    out = tmp_path / "anew.kvtrace"
    code, report, output = _record([str(path), "--out", str(out), "--context-len", "2048"])
    assert code == 0, output
    assert report["prefix_hit_tokens"] == 64 and report["requests"] == 2


def test_bad_arrivals_and_old_traces_on_the_command_line(tmp_path: Path) -> None:
    path = tmp_path / "neg.kvtrace"
    with Recorder(path, META) as rec:
        rec.begin_step(0.0)
        rec.extend([0], [8], prompt_lens=[8], arrival_s=[-1.0])
        rec.end_step()
    result = CliRunner().invoke(app, ["record", str(path), "--out", str(tmp_path / "x.kvtrace")])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "request 0 (step 0) has arrival_s -1.0" in lines[0], lines
    old = CliRunner().invoke(app, ["record", "sample:tiny", "--out", str(tmp_path / "y.kvtrace"), "-q"])
    assert old.exit_code == 0, old.output
    assert "kvtrace: warning: " in old.stderr and "no arrival times" in old.stderr
    same = CliRunner().invoke(app, ["record", str(path), "--out", str(path), "--force"])
    assert same.exit_code == 2 and "is the input" in same.stderr


def test_step_batches_compare_arrivals() -> None:
    a = StepBatch.from_columns(0, 0.0, op=["extend"], rid=[0], seq_len=[4], append_len=[4], arrival_s=[None])
    b = StepBatch.from_columns(0, 0.0, op=["extend"], rid=[0], seq_len=[4], append_len=[4])
    c = StepBatch.from_columns(0, 0.0, op=["extend"], rid=[0], seq_len=[4], append_len=[4], arrival_s=[0.5])
    assert a.equals(b) and not a.equals(c) and c.take(np.array([0])).equals(c)
