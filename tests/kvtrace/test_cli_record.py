"""``kvtrace record`` through the CLI: output contract, option errors, unseen files of the
same formats, and a real SIGKILL in the middle of a recording."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import kvtrace
from kvtrace.cli import app
from traces.checker import OpSequenceChecker
from traces.errors import TraceError
from traces.reader import TraceReader

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "traces" / "workloads_data"
MOONCAKE = DATA / "mooncake-fast25" / "conversation_trace.jsonl"
AZURE = DATA / "azure-llm-inference-2023" / "AzureLLMInferenceTrace_code.csv"
SHAREGPT = DATA / "sharegpt-arxiv-lengths" / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"

SMALL = ["--page-size", "16", "--pool-tokens", "200000", "--quiet"]


def _record(args: list[str]) -> tuple[int, dict | None, str]:
    result = CliRunner().invoke(app, ["record", *args, "--json"])
    payload = json.loads(result.stdout) if result.exit_code == 0 else None
    return result.exit_code, payload, result.output


def _validate(path: Path) -> dict:
    result = CliRunner().invoke(app, ["validate", str(path), "--json"])
    report = json.loads(result.stdout)
    assert result.exit_code == (0 if report["ok"] else 1)
    return report


@pytest.mark.slow
def test_record_json_contract_and_validate(tmp_path: Path) -> None:
    out = tmp_path / "m.kvtrace"
    code, report, output = _record([str(MOONCAKE), "--format", "mooncake", "--duration", "15s", "--out", str(out), *SMALL])
    assert code == 0, output
    for key in ("out", "steps", "requests", "wall_s", "duration_s", "prefix_hit_rate", "retractions", "aborts", "evicted_tokens"):
        assert key in report
    assert report["out"] == str(out) and report["integrity_violations"] == []
    assert report["requests"] == report["finished"] > 20
    checked = _validate(out)
    assert checked["ok"] and checked["steps"] == report["steps"] and checked["requests"] == report["requests"]
    meta = TraceReader(out).meta
    assert meta.source.license == "Apache-2.0" and "FAST 2025" in meta.source.citation
    assert meta.config.page_size == 16 and meta.config.chunk_size == 8192


def test_summary_table_and_overwrite_refused(tmp_path: Path) -> None:
    out = tmp_path / "a.kvtrace"
    args = ["record", str(AZURE), "--duration", "20s", "--out", str(out), "--page-size", "16"]
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0, first.output
    assert "prefix hit rate" in first.stdout and "allocator integrity" in first.stdout and "clean" in first.stdout
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 2
    assert "already exists; pass --force to overwrite it" in again.output
    forced = CliRunner().invoke(app, [*args, "--force", "--quiet"])
    assert forced.exit_code == 0, forced.output


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--page-size", "0"], "--page-size"),
        (["--rate", "3"], "applies to the lengths format only"),
        (["--spec", "medusa:3,1,4"], "ALGORITHM:STEPS,TOPK,DRAFT"),
        (["--spec", "eagle:3,1"], "three integers"),
        (["--spec", "dflash:3,1,4"], "DFlash takes STEPS 1 and TOPK 1"),
        (["--duration", "soon"], "is not a duration"),
        (["--time-scale", "0"], "positive factor"),
        (["--chunk", "8"], "at least the page size 16"),
        (["--step-time", "warp=3"], "unknown step-time coefficient"),
        (["--policy", "random"], "random"),
        (["--pool-tokens", "1"], "Invalid value for --pool-tokens: a pool of 1 tokens holds fewer than 4 pages of 16"),
        (["--page-size", "1000000"], "Invalid value for --page-size: 1,000,000 tokens per page leave fewer than 4 pages"),
        (["--device", "tpu"], "--device"),
        (["--compression", "gzip"], "--compression"),
    ],
)
def test_bad_options_exit_2(tmp_path: Path, extra: list[str], message: str) -> None:
    out = tmp_path / "x.kvtrace"
    result = CliRunner().invoke(app, ["record", str(MOONCAKE), "--out", str(out), "--page-size", "16", *extra])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output and not out.exists()


def test_empty_workload_is_an_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    out = tmp_path / "e.kvtrace"
    result = CliRunner().invoke(app, ["record", str(empty), "--out", str(out)])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"kvtrace: error: {empty}: holds no requests; nothing to record"
    assert not out.exists()


def test_lengths_needs_a_rate_and_records_with_one(tmp_path: Path) -> None:
    out = tmp_path / "l.kvtrace"
    no_rate = CliRunner().invoke(app, ["record", str(SHAREGPT), "--format", "lengths", "--out", str(out)])
    assert no_rate.exit_code == 2 and "needs an arrival rate" in no_rate.output
    code, report, output = _record(
        [str(SHAREGPT), "--format", "lengths", "--rate", "4", "--duration", "10s", "--out", str(out), *SMALL]
    )
    assert code == 0, output
    assert 25 <= report["requests"] <= 60  # Poisson(40)
    assert _validate(out)["ok"]
    assert TraceReader(out).meta.source.repository == "project-etalon/etalon"


def test_unseen_files_of_the_same_formats(tmp_path: Path) -> None:
    # A Mooncake-format trace other than the conversation one (as toolagent_trace.jsonl):
    # other ids, a non-zero first timestamp, float timestamps, keys in another order.
    lines = []
    for i in range(30):
        n = 700 + 97 * i
        blocks = -(-n // 512)
        ids = [900_000 + (i % 3)] + [1_000_000 + 10 * i + j for j in range(blocks - 1)]
        lines.append(json.dumps({"hash_ids": ids, "output_length": 20 + i, "input_length": n, "timestamp": 5000.5 + 400 * i}))
    tool = tmp_path / "toolagent_trace.jsonl"
    tool.write_text("\n".join(lines) + "\n")
    out = tmp_path / "tool.kvtrace"
    code, report, output = _record([str(tool), "--out", str(out), *SMALL])
    assert code == 0, output
    assert report["format"] == "mooncake" and report["requests"] == 30 and report["prefix_hit_rate"] > 0
    assert TraceReader(out).meta.source.path == "FAST25-release/traces/toolagent_trace.jsonl"
    # An Azure CSV like the conversation one of 2024: UTC offsets, columns reordered.
    conv = tmp_path / "AzureLLMInferenceTrace_conv.csv"
    rows = ["ContextTokens,GeneratedTokens,TIMESTAMP"] + [
        f"{300 + 11 * i},{5 + i % 7},2024-05-10 00:00:{i * 0.5:09.6f}+00:00" for i in range(40)
    ]
    conv.write_text("\n".join(rows))
    out2 = tmp_path / "conv.kvtrace"
    code, report, output = _record([str(conv), "--out", str(out2), *SMALL])
    assert code == 0, output
    assert report["format"] == "azure" and report["requests"] == 40
    assert _validate(out2)["ok"]


@pytest.mark.slow
def test_sigkill_keeps_every_completed_step(tmp_path: Path) -> None:
    """Kill ``kvtrace record`` (default options) mid-run: the trace holds every step
    written before the kill (each step is flushed at its end) and they validate."""
    out = tmp_path / "killed.kvtrace"
    cmd = [
        sys.executable, "-m", "kvtrace", "record", str(MOONCAKE), "--format", "mooncake",
        "--out", str(out), "--page-size", "16", "--quiet",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    seen = 0
    deadline = time.monotonic() + 120
    try:
        while seen < 300:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "the recording made no progress"
            time.sleep(0.2)
            try:
                seen = sum(1 for _ in TraceReader(out).steps())
            except TraceError:
                continue  # not created yet
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    reader = TraceReader(out)
    checker = OpSequenceChecker(reader.meta)
    steps = list(reader.steps())
    problems = [p for s in steps for p in checker.check(s)]
    assert reader.truncated  # no end-of-stream marker: the writer never closed
    assert len(steps) >= seen
    assert [s.step for s in steps] == list(range(len(steps)))
    assert problems == []
    report = _validate(out)
    assert [p["problem"] for p in report["problems"]] == [report["truncation_detail"]]
    assert report["interrupted"] is True
    info = _info(out)
    assert info["interrupted"] is True and info["recording"]["status"] == "interrupted"
    assert "without closing the trace" in info["recording"]["detail"]


def _info(path: Path) -> dict:
    result = CliRunner().invoke(app, ["info", str(path), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _start_recording(out: Path, *extra: str) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "kvtrace", "record", str(MOONCAKE), "--format", "mooncake",
        "--out", str(out), "--page-size", "16", *extra,
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_for_steps(proc: subprocess.Popen, path_of: object, steps: int) -> None:
    """Until the trace being written (``path_of()``) holds ``steps`` steps."""
    deadline = time.monotonic() + 120
    seen = 0
    while seen < steps:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() < deadline, "the recording made no progress"
        time.sleep(0.2)
        path = path_of()  # type: ignore[operator]
        if path is None:
            continue
        try:
            seen = sum(1 for _ in TraceReader(path).steps())
        except TraceError:
            continue  # not created yet


@pytest.mark.parametrize(
    ("signum", "code", "detail"),
    [(signal.SIGINT, 130, "interrupted by Ctrl-C (SIGINT)"), (signal.SIGTERM, 128 + signal.SIGTERM, "terminated by SIGTERM")],
)
@pytest.mark.slow
def test_an_interrupted_recording_says_so(tmp_path: Path, signum: int, code: int, detail: str) -> None:
    """Ctrl-C (a real SIGINT) or kill (SIGTERM) mid-recording: the trace keeps its steps,
    is marked interrupted with the reason, and info and validate report it."""
    out = tmp_path / "stopped.kvtrace"
    proc = _start_recording(out, "--quiet")
    try:
        _wait_for_steps(proc, lambda: out, 100)
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == code, stderr
    assert f"holds the steps recorded so far, marked interrupted" in stderr and "Traceback" not in stderr
    info = _info(out)
    recording = info["recording"]
    assert info["interrupted"] is True and recording["status"] == "interrupted" and recording["detail"] == detail
    assert recording["steps"] == info["steps"] >= 100 and not info["truncated"]
    assert recording["kvtrace_version"] == kvtrace.__version__ and info["created_at"] is not None
    assert recording["command"].startswith("kvtrace record ") and f"--out {out}" in recording["command"]
    assert info["ipc_format"] == "stream"  # not compacted: leave fast
    report = _validate(out)
    assert not report["ok"] and report["interrupted"] is True
    assert [p["problem"] for p in report["problems"]] == [f"recording interrupted after {info['steps']:,} steps: {detail}"]
    table = CliRunner().invoke(app, ["info", str(out)])
    assert "interrupted" in table.stdout and f"kvtrace: warning: {out}: recording interrupted" in table.stderr


@pytest.mark.slow
def test_an_interrupted_recording_over_an_old_trace_keeps_the_old_one(tmp_path: Path) -> None:
    out = tmp_path / "kept.kvtrace"
    out.write_bytes(b"a previous trace")
    proc = _start_recording(out, "--quiet", "--force")

    def live() -> Path | None:
        found = list(tmp_path.glob(".kept.kvtrace.*.tmp"))
        return found[0] if found else None

    try:
        _wait_for_steps(proc, live, 50)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130 and f"{out} was left as it was" in stderr
    assert out.read_bytes() == b"a previous trace"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.kvtrace"]  # no half file


def test_a_complete_recording_records_its_provenance(tmp_path: Path) -> None:
    out = tmp_path / "done.kvtrace"
    code, _, output = _record([str(MOONCAKE), "--duration", "10s", "--out", str(out), *SMALL])
    assert code == 0, output
    info = _info(out)
    assert info["ipc_format"] == "file" and info["interrupted"] is False
    assert info["recording"]["status"] == "complete" and info["recording"]["steps"] == info["steps"]
    assert info["recording"]["command"] == f"kvtrace record {MOONCAKE} --duration 10s --out {out} " + " ".join(SMALL) + " --json"
    assert info["created_at"].endswith("Z") and info["recording"]["finished_at"] >= info["created_at"]
    assert _validate(out)["ok"]


def _small_mooncake(tmp_path: Path) -> Path:
    lines = MOONCAKE.read_text().splitlines()[:25]
    path = tmp_path / "small.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.slow
def test_gzip_and_zstd_workloads_are_read_as_they_are(tmp_path: Path) -> None:
    import gzip

    import pyarrow as pa

    plain = _small_mooncake(tmp_path)
    gz = tmp_path / "small.jsonl.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    zst = tmp_path / "small.data"  # no telling suffix: recognised by its first bytes
    with pa.output_stream(str(zst), compression="zstd") as sink:
        sink.write(plain.read_bytes())
    reports = {}
    for source in (plain, gz, zst):
        out = tmp_path / f"{source.name}.kvtrace"
        extra = ["--format", "mooncake"] if source is zst else []
        code, report, output = _record([str(source), "--out", str(out), *extra, *SMALL])
        assert code == 0, output
        reports[source.name] = report
        assert report["format"] == "mooncake"
    assert len({(r["steps"], r["requests"], r["prefix_hit_rate"]) for r in reports.values()}) == 1
    a, b = TraceReader(tmp_path / "small.jsonl.kvtrace"), TraceReader(tmp_path / "small.jsonl.gz.kvtrace")
    assert all(x.equals(y) for x, y in zip(a.steps(), b.steps()))


@pytest.mark.parametrize("kind", ["trace", "gzip-trace", "binary", "latin-1", "cut-gzip"])
def test_a_trace_or_a_binary_is_one_line_naming_what_it_is(tmp_path: Path, kind: str) -> None:
    import gzip

    from traces.samples import sample_path

    path = tmp_path / f"{kind}.input"
    expected = {
        "trace": "is an Arrow IPC file (a kvtrace trace or state log), not a workload",
        "gzip-trace": "is gzip-compressed and an Arrow IPC file",
        "binary": "is a binary file, not a workload",
        "latin-1": "is not UTF-8 text",
        "cut-gzip": "cannot be decompressed",
    }[kind]
    if kind == "trace":
        path.write_bytes(sample_path("tiny").read_bytes())
    elif kind == "gzip-trace":
        path.write_bytes(gzip.compress(sample_path("tiny").read_bytes()))
    elif kind == "binary":
        path.write_bytes(bytes(range(256)) * 4)
    elif kind == "latin-1":
        path.write_bytes("num_prefill_tokens,num_decode_tokens\n12,3\ncaf\u00e9,4\n".encode("latin-1"))
    else:
        path.write_bytes(gzip.compress(_small_mooncake(tmp_path).read_bytes())[:600])
    out = tmp_path / "x.kvtrace"
    # A trace is a workload of its own format (scheduled anew); with another --format it is refused.
    for extra in ([], ["--format", "lengths", "--rate", "2"])[1 if kind == "trace" else 0 :]:
        result = CliRunner().invoke(app, ["record", str(path), "--out", str(out), *extra])
        assert result.exit_code == 2, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"kvtrace: error: {path}") and expected in lines[0], lines
        assert "Traceback" not in result.stderr and "internal error" not in result.stderr and not out.exists()


def test_when_every_request_is_rejected_record_says_why_and_exits_1(tmp_path: Path) -> None:
    out = tmp_path / "none.kvtrace"
    result = CliRunner().invoke(app, ["record", str(MOONCAKE), "--duration", "10s", "--context-len", "100", "--out", str(out), "-q"])
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "nothing was recorded: all 38 requests were rejected on arrival" in lines[0]
    assert "raise --context-len" in lines[0] and not out.exists()
    some = CliRunner().invoke(app, ["record", str(MOONCAKE), "--duration", "10s", "--context-len", "9000", "--out", str(out), "-q"])
    assert some.exit_code == 0 and "kvtrace: warning: " in some.stderr and "rejected on arrival" in some.stderr


@pytest.mark.slow
def test_a_completed_recording_is_compacted(tmp_path: Path) -> None:
    """Recorded step by step (durable), rewritten into few large batches at the end;
    the rewrite keeps every row."""
    from traces.reader import TraceReader

    durable, compact = tmp_path / "durable.kvtrace", tmp_path / "compact.kvtrace"
    code, _, output = _record([str(MOONCAKE), "--format", "mooncake", "--out", str(durable), "--compact", "0", "--duration", "30s", *SMALL])
    assert code == 0, output
    code, _, output = _record([str(MOONCAKE), "--format", "mooncake", "--out", str(compact), "--duration", "30s", *SMALL])
    assert code == 0, output
    a, b = TraceReader(durable), TraceReader(compact)
    steps_a, steps_b = list(a.steps()), list(b.steps())
    assert len(steps_a) == len(steps_b) > 10
    assert all(x.equals(y) for x, y in zip(steps_a, steps_b))
    assert b.file_bytes < a.file_bytes
    assert not (tmp_path / "compact.kvtrace.compacting").exists()


# --------------------------------------------------------------------------- streams
# A workload that can be read only once (a FIFO, a pipe's /dev/fd/N, stdin) is read
# once: the format is sniffed from what was read, never by opening it again.


def _record_process(args: list[str], **kwargs: object) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvtrace", "record", *args, *SMALL, "--json"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, timeout=120, **kwargs)  # type: ignore[call-overload]


def _feed_fifo(path: Path, data: bytes) -> threading.Thread:
    """A writer thread that opens the FIFO ``path`` (waiting for its reader), writes ``data`` and closes it."""

    def write() -> None:
        with open(path, "wb") as fifo:
            fifo.write(data)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    return writer


@pytest.mark.slow
def test_a_fifo_with_a_writer_is_read_once_and_its_format_sniffed(tmp_path: Path) -> None:
    fifo = tmp_path / "workload"  # no suffix: the format comes from the first line
    os.mkfifo(fifo)
    writer = _feed_fifo(fifo, _small_mooncake(tmp_path).read_bytes())
    done = _record_process([str(fifo), "--out", str(tmp_path / "f.kvtrace")])
    writer.join(timeout=5)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["format"] == "mooncake" and report["requests"] == 25


@pytest.mark.slow
def test_a_trace_through_a_fifo_is_not_called_empty(tmp_path: Path) -> None:
    fifo = tmp_path / "trace"
    os.mkfifo(fifo)
    writer = _feed_fifo(fifo, (ROOT / "traces" / "samples" / "tiny.kvtrace").read_bytes())
    done = _record_process([str(fifo), "--out", str(tmp_path / "t.kvtrace")])
    writer.join(timeout=5)
    assert done.returncode == 0, done.stderr
    assert b"is empty" not in done.stderr
    assert json.loads(done.stdout)["format"] == "trace"


def test_an_empty_fifo_holds_no_requests(tmp_path: Path) -> None:
    fifo = tmp_path / "workload"
    os.mkfifo(fifo)
    writer = _feed_fifo(fifo, b"")
    done = _record_process([str(fifo), "--format", "mooncake", "--out", str(tmp_path / "e.kvtrace")])
    writer.join(timeout=5)
    assert done.returncode == 2
    assert done.stderr.decode().strip() == f"kvtrace: error: {fifo}: holds no requests; nothing to record"


@pytest.mark.slow
def test_a_pipe_as_dev_fd_is_read_once(tmp_path: Path) -> None:
    # What a shell's `record <(head -200 WORKLOAD)` passes: /dev/fd/N of a pipe.
    lines = SHAREGPT.read_text().splitlines()[:31]
    read_fd, write_fd = os.pipe()

    def write() -> None:
        with os.fdopen(write_fd, "wb") as pipe:
            pipe.write(("\n".join(lines) + "\n").encode())

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        done = _record_process(
            [f"/dev/fd/{read_fd}", "--format", "lengths", "--rate", "5", "--out", str(tmp_path / "p.kvtrace")],
            pass_fds=(read_fd,),
        )
    finally:
        os.close(read_fd)
    writer.join(timeout=5)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["requests"] == 30


def test_stdin_dash_is_a_workload(tmp_path: Path) -> None:
    lines = AZURE.read_text().splitlines()[:21]
    out = tmp_path / "s.kvtrace"
    result = CliRunner().invoke(
        app, ["record", "-", "--out", str(out), *SMALL, "--json"], input="\n".join(lines) + "\n"
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["format"] == "azure" and report["requests"] == 20
    assert TraceReader(out).meta.source.workload == "azure:stdin"


def test_a_bad_line_on_stdin_names_stdin(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["record", "-", "--format", "mooncake", "--out", str(tmp_path / "b.kvtrace")], input='{"timestamp": 1}\n'
    )
    assert result.exit_code == 2
    assert result.output.strip().startswith("kvtrace: error: <stdin>:1: missing field 'input_length'"), result.output


# --------------------------------------------------------------------------- summary


@pytest.mark.parametrize("extra", [[], ["--spec", "eagle:3,1,4"], ["--pd-decode"]], ids=["plain", "spec", "pd"])
@pytest.mark.slow
def test_summary_step_kinds_add_up_to_the_steps(tmp_path: Path, extra: list[str]) -> None:
    # A step that only releases requests finished in the step before is a kind of its own.
    workload = _small_mooncake(tmp_path)
    code, report, output = _record([str(workload), "--out", str(tmp_path / "j.kvtrace"), *SMALL, *extra])
    assert code == 0, output
    kinds = ("prefill_steps", "decode_steps", "release_steps", "retract_steps")
    assert sum(report[k] for k in kinds) == report["steps"]
    assert report["release_steps"] >= 1
    assert report["spec_steps"] == (report["decode_steps"] if extra[:1] == ["--spec"] else 0)
    table = CliRunner().invoke(app, ["record", str(workload), "--out", str(tmp_path / "t.kvtrace"), *SMALL, *extra])
    assert table.exit_code == 0, table.output
    row = next(line for line in table.output.splitlines() if "│ steps" in line)
    total, *counts = (int(n.replace(",", "")) for n in re.findall(r"(\d[\d,]*)(?: \(| [a-z])", row))
    assert len(counts) >= 3 and sum(counts) == total, row
    assert "release-only" in row
    assert ("spec decode" in row) == (extra[:1] == ["--spec"]) and ("prealloc" in row) == (extra == ["--pd-decode"])


def test_record_takes_dflash_on_a_sliding_window_preset(tmp_path: Path) -> None:
    """DFlash (SGLang's DFLASH: one step, topk 1, a verify block of DRAFT) records on an
    SWA model; the trace's config keeps the algorithm and its layout."""
    out = tmp_path / "dflash.kvtrace"
    code, report, output = _record(["sample:tiny", "--model", "gpt-oss-20b", "--spec", "dflash:1,1,8",
                                    "--page-size", "16", "--pool-tokens", "8000", "--out", str(out), "--quiet"])
    assert code == 0, output
    assert report["config"]["spec"] == "dflash:1,1,8" and report["spec_steps"] > 0
    meta = TraceReader(out).meta
    assert meta.config.spec is not None and meta.config.spec.algorithm == "dflash"
    assert meta.attention is not None and meta.attention.swa_layer_ids
