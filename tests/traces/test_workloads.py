"""Workload importers: good files of each format, and one clear error per bad file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from traces.block_reuse import block_reuse
from traces.workloads import (
    WorkloadFileError,
    parse_duration,
    read_azure,
    read_lengths,
    read_mooncake,
    read_workload,
    within,
)

DATA = Path(__file__).resolve().parents[2] / "traces" / "workloads_data"
MOONCAKE = DATA / "mooncake-fast25" / "conversation_trace.jsonl"
AZURE = DATA / "azure-llm-inference-2023" / "AzureLLMInferenceTrace_code.csv"
SHAREGPT = DATA / "sharegpt-arxiv-lengths" / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _mooncake_line(ts: float, input_len: int, output_len: int, hashes: list[int]) -> str:
    return json.dumps({"timestamp": ts, "input_length": input_len, "output_length": output_len, "hash_ids": hashes})


# --------------------------------------------------------------------------- good files


def test_mooncake_bundled_file_reads_whole_hour() -> None:
    requests = list(read_mooncake(MOONCAKE))
    assert len(requests) == 12_031
    assert requests[0].arrival_s == 0.0
    assert requests[-1].arrival_s == pytest.approx(3536.999)
    first = requests[0]
    assert first.block_size == 512
    assert first.block_hashes is not None and first.block_hashes.dtype == np.uint64
    assert first.block_hashes.shape[0] == -(-first.input_len // 512)
    assert all(r.block_hashes[0] == 0 for r in requests[:50])  # the shared system prompt


def test_mooncake_block_reuse_matches_published_figure() -> None:
    reuse = block_reuse(read_mooncake(MOONCAKE))
    assert reuse.references == 288_500
    assert reuse.distinct == 182_790
    assert reuse.repeated_fraction == pytest.approx(0.366, abs=5e-4)
    # Every repeat is a prefix hit in this trace.
    assert reuse.prefix_hit_fraction == pytest.approx(reuse.repeated_fraction)


def test_mooncake_shared_prefix_and_partial_last_block(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "t.jsonl",
        "\n".join(
            [
                _mooncake_line(1000, 1000, 5, [7, 8]),
                _mooncake_line(1500.5, 1100, 3, [7, 8, 9]),
                "",
                _mooncake_line(2000, 1, 0, [10]),
            ]
        )
        + "\n",
    )
    reqs = list(read_mooncake(path))
    assert [r.arrival_s for r in reqs] == [0.0, 0.5005, 1.0]
    assert [r.line for r in reqs] == [1, 2, 4]
    assert reqs[2].output_len == 0
    reuse = block_reuse(reqs)
    assert (reuse.references, reuse.distinct) == (6, 4)
    assert reuse.prefix_hit_fraction == pytest.approx(2 / 6)
    # Request 2 reuses two whole blocks = 1024 of its 1100 tokens; 1 of 2101 total.
    assert reuse.token_hit_fraction == pytest.approx(1024 / 2101)


def test_azure_seven_digit_timestamps_and_no_trailing_newline(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "az.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,4808,10\n"
        "2023-11-16 18:17:04.0319600,3180,8\n"
        "2023-11-16 18:17:05.0319601,20,0",
    )
    reqs = list(read_azure(path))
    assert [r.input_len for r in reqs] == [4808, 3180, 20]
    assert reqs[1].arrival_s == pytest.approx(0.052)
    assert reqs[2].arrival_s == pytest.approx(1.052, abs=1e-6)
    assert all(r.block_hashes is None for r in reqs)


def test_azure_columns_in_any_order_with_utc_offset(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "conv.csv",
        "GeneratedTokens,ContextTokens,TIMESTAMP,extra\n"
        "5,100,2024-05-10 00:00:00.004000+00:00,x\n"
        "6,200,2024-05-10 01:00:00.004000+01:00,y\n",
    )
    reqs = list(read_azure(path))
    assert [(r.input_len, r.output_len) for r in reqs] == [(100, 5), (200, 6)]
    assert reqs[1].arrival_s == pytest.approx(0.0)  # 01:00+01:00 is 00:00 UTC


def test_azure_bundled_file() -> None:
    reqs = list(read_azure(AZURE))
    assert len(reqs) == 8819
    assert reqs[-1].arrival_s == pytest.approx(3435.948056, abs=1e-5)


def test_lengths_poisson_arrivals_are_seeded(tmp_path: Path) -> None:
    first = [r.arrival_s for r in read_lengths(SHAREGPT, rate=5.0, seed=3)]
    again = [r.arrival_s for r in read_lengths(SHAREGPT, rate=5.0, seed=3)]
    other = [r.arrival_s for r in read_lengths(SHAREGPT, rate=5.0, seed=4)]
    assert first == again and first != other
    assert len(first) == 30_731 and first[0] == 0.0
    gaps = np.diff(first)
    assert (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / 5.0, rel=0.03)  # 30k exponential gaps


def test_duration_window_cuts_by_arrival() -> None:
    reqs = list(read_workload(MOONCAKE, "mooncake", duration_s=parse_duration("90s")))
    assert reqs and max(r.arrival_s for r in reqs) < 90.0
    assert len(reqs) == sum(1 for r in read_mooncake(MOONCAKE) if r.arrival_s < 90.0)
    assert list(within(iter(reqs), 0.0)) == []


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("10m", 600), ("1h", 3600), ("1h30m", 5400), ("2.5m", 150), ("45", 45), ("500ms", 0.5)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "abc", "10x", "-5m", "0s", "m"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


# --------------------------------------------------------------------------- bad files

BAD_MOONCAKE = {
    "invalid_json": (
        _mooncake_line(0, 600, 5, [1, 2]) + "\n" + '{"timestamp": 1, "input_length": 3,\n',
        2,
        "invalid JSON",
    ),
    "missing_field": (
        _mooncake_line(0, 600, 5, [1, 2]) + "\n" + json.dumps({"timestamp": 5, "input_length": 600, "hash_ids": [1, 2]}),
        2,
        "missing field 'output_length'",
    ),
    "non_numeric": (
        json.dumps({"timestamp": 0, "input_length": "many", "output_length": 3, "hash_ids": [1]}),
        1,
        "input_length must be an integer, found 'many'",
    ),
    "zero_input": (_mooncake_line(0, 0, 3, []), 1, "input_length must be >= 1, found 0"),
    "negative_output": (_mooncake_line(0, 10, -1, [1]), 1, "output_length must be >= 0, found -1"),
    "unsorted": (
        _mooncake_line(2000, 10, 1, [1]) + "\n" + _mooncake_line(3000, 10, 1, [1]) + "\n" + _mooncake_line(1000, 10, 1, [1]),
        3,
        "timestamp 1000 ms is earlier than 3000 ms on line 2",
    ),
    "hash_len": (_mooncake_line(0, 1025, 3, [1, 2]), 1, "hash_ids has 2 entries but input_length 1025 needs ceil(1025/512) = 3"),
    "hash_type": (_mooncake_line(0, 10, 3, ["a"]), 1, "hash_ids must hold non-negative integers, found 'a'"),
    "not_object": ("[1, 2, 3]", 1, "expected a JSON object, found list"),
}


@pytest.mark.parametrize("case", sorted(BAD_MOONCAKE))
def test_bad_mooncake_raises_one_line_with_file_and_line(tmp_path: Path, case: str) -> None:
    text, line, message = BAD_MOONCAKE[case]
    path = _write(tmp_path, f"{case}.jsonl", text)
    with pytest.raises(WorkloadFileError) as info:
        list(read_mooncake(path))
    err = info.value
    assert (err.path, err.line) == (str(path), line)
    assert message in str(err)
    assert str(err).startswith(f"{path}:{line}: ")
    assert "\n" not in str(err)


BAD_AZURE = {
    "missing_column": ("TIMESTAMP,ContextTokens\n2023-11-16 18:17:03.9799600,10\n", 1, "missing column 'GeneratedTokens'"),
    "non_numeric": (
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,ten,3\n",
        2,
        "ContextTokens must be an integer, found 'ten'",
    ),
    "bad_time": ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,10,3\n", 2, "TIMESTAMP 'yesterday' is not a"),
    "unsorted": (
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,10,3\n"
        "2023-11-16 18:17:02.0000000,10,3",
        3,
        "is earlier than 2023-11-16 18:17:03.979960 on line 2",
    ),
    "zero_context": ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,0,3\n", 2, "ContextTokens must be >= 1"),
    "short_row": ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,3\n", 2, "row has 2 fields, the header has 3"),
    "empty": ("", 1, "empty file"),
}


@pytest.mark.parametrize("case", sorted(BAD_AZURE))
def test_bad_azure_raises_one_line_with_file_and_line(tmp_path: Path, case: str) -> None:
    text, line, message = BAD_AZURE[case]
    path = _write(tmp_path, f"{case}.csv", text)
    with pytest.raises(WorkloadFileError) as info:
        list(read_azure(path))
    assert info.value.line == line
    assert message in str(info.value)
    assert str(info.value).startswith(f"{path}:{line}: ")


BAD_LENGTHS = {
    "missing_column": ("num_prefill_tokens,x\n10,3\n", 1, "missing column 'num_decode_tokens'"),
    "non_numeric": ("num_prefill_tokens,num_decode_tokens\n10,3\n1.5e3x,2\n", 3, "num_prefill_tokens must be an integer"),
    "negative": ("num_prefill_tokens,num_decode_tokens\n10,-3\n", 2, "num_decode_tokens must be >= 0, found -3"),
}


@pytest.mark.parametrize("case", sorted(BAD_LENGTHS))
def test_bad_lengths_raises_one_line_with_file_and_line(tmp_path: Path, case: str) -> None:
    text, line, message = BAD_LENGTHS[case]
    path = _write(tmp_path, f"{case}.csv", text)
    with pytest.raises(WorkloadFileError) as info:
        list(read_lengths(path, rate=1.0))
    assert info.value.line == line
    assert message in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(WorkloadFileError, match="no such file"):
        list(read_mooncake(tmp_path / "nope.jsonl"))


# --------------------------------------------------------------------------- through the CLI

CLI_CASES = [
    ("mooncake", "bad.jsonl", BAD_MOONCAKE["invalid_json"]),
    ("mooncake", "bad.jsonl", BAD_MOONCAKE["missing_field"]),
    ("mooncake", "bad.jsonl", BAD_MOONCAKE["non_numeric"]),
    ("mooncake", "bad.jsonl", BAD_MOONCAKE["unsorted"]),
    ("mooncake", "bad.jsonl", BAD_MOONCAKE["hash_len"]),
    ("azure", "bad.csv", BAD_AZURE["missing_column"]),
    ("azure", "bad.csv", BAD_AZURE["non_numeric"]),
    ("azure", "bad.csv", BAD_AZURE["unsorted"]),
    ("lengths", "bad.csv", BAD_LENGTHS["missing_column"]),
]


@pytest.mark.parametrize(("fmt", "name", "case"), CLI_CASES)
def test_cli_bad_workload_is_one_line_exit_2(tmp_path: Path, fmt: str, name: str, case: tuple[str, int, str]) -> None:
    text, line, message = case
    path = _write(tmp_path, name, text)
    out = tmp_path / "out.kvtrace"
    args = ["record", str(path), "--format", fmt, "--out", str(out), "--quiet"]
    if fmt == "lengths":
        args += ["--rate", "2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert lines == [f"kvtrace: error: {path}:{line}: " + lines[0].split(f"{path}:{line}: ", 1)[1]]
    assert message in lines[0]
    assert "Traceback" not in result.output
    assert not out.exists()


def test_rereadable_copies_a_pipe_once_and_keeps_a_regular_file(tmp_path: Path) -> None:
    import os
    import threading

    from traces.workloads import guess_format, read_workload, rereadable

    regular = tmp_path / "w.jsonl"
    regular.write_text('{"timestamp": 0, "input_length": 3, "output_length": 2, "hash_ids": [7]}\n')
    with rereadable(regular) as path:
        assert path == regular
    read_fd, write_fd = os.pipe()

    def write() -> None:
        os.write(write_fd, regular.read_bytes())
        os.close(write_fd)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        with rereadable(f"/dev/fd/{read_fd}") as path:
            # Read as often as needed: the format, then two passes.
            assert guess_format(path) == "mooncake"
            assert [r.input_len for r in read_workload(path, "mooncake")] == [3]
            assert [r.input_len for r in read_workload(path, "mooncake")] == [3]
            assert path.name == str(read_fd)
        assert not path.exists()
    finally:
        os.close(read_fd)
        writer.join()
