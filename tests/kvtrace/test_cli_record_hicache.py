"""HiCache's host tier on the command line: ``record --hicache-*`` stores it in the
trace (format version 5), ``record --like`` carries it, ``info`` shows it, bad values
are one line, and replay / diff / sweep serve such a trace with the tier (replay's
``--hicache-*`` what-if options change it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from traces.hicache_layout import host_pool_tokens_for, host_tokens_for_size

runner = CliRunner()
WORKLOAD = ["sample:mooncake-tiny", "--duration", "2s", "-q"]
POOL = 60_000


def invoke(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def info(path: Path | str) -> dict[str, Any]:
    code, out, err = invoke("info", str(path), "--json")
    assert code == 0, err
    return json.loads(out)


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtrace: error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def tiered(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("hicache") / "hicache.kvtrace"
    code, stdout, err = invoke("record", *WORKLOAD, "--pool-tokens", str(POOL), "--page-size", "16",
                               "--hicache-ratio", "3", "--hicache-write-policy", "write_back",
                               "-o", str(out), "--json")  # fmt: skip
    assert code == 0, err
    return out, json.loads(stdout)


def test_record_stores_the_tier_sized_as_sglang_sizes_it(tiered: tuple[Path, dict[str, Any]]) -> None:
    out, report = tiered
    trace = info(out)
    assert trace["format_version"] == 5
    tier = {"host_pool_tokens": host_pool_tokens_for(POOL, 16, 3.0), "write_policy": "write_back",
            "host_ratio": 3.0, "host_size_gb": None}  # fmt: skip
    assert trace["config"]["hicache"] == tier == report["config"]["hicache"]
    assert tier["host_pool_tokens"] == 180_016  # 180,000 rounded down to a page, plus the padding page
    assert report["integrity_violations"] == []


def test_a_recording_without_the_options_has_no_tier(tmp_path: Path) -> None:
    out = tmp_path / "plain.kvtrace"
    code, _, err = invoke("record", *WORKLOAD, "--pool-tokens", str(POOL), "-o", str(out))
    assert code == 0, err
    trace = info(out)
    assert "hicache" not in trace["config"] and trace["format_version"] == 1


def test_info_shows_the_tier(tiered: tuple[Path, dict[str, Any]]) -> None:
    code, out, err = invoke("info", str(tiered[0]), "--no-color")
    assert code == 0, err
    assert "host pool 180,016 tokens (--hicache-ratio 3, 23.60 GB), write policy write_back" in " ".join(out.split())
    tier = info(tiered[0])["hicache"]  # --json: the stored tier and the host memory it takes
    assert tier["device_pool_tokens"] == POOL and tier["host_bytes"] == 180_016 * 131_072
    assert info("sample:tiny")["hicache"] is None


def test_record_like_carries_the_tier(tiered: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    out = tmp_path / "like.kvtrace"
    code, _, err = invoke("record", *WORKLOAD, "--duration", "1s", "--like", str(tiered[0]), "-o", str(out))
    assert code == 0, err
    assert info(out)["config"]["hicache"] == info(tiered[0])["config"]["hicache"]
    # Another device pool: the ratio follows it; another policy: the rest kept.
    code, _, err = invoke("record", *WORKLOAD, "--duration", "1s", "--like", str(tiered[0]), "--pool-tokens", "30000",
                          "--hicache-write-policy", "write_through_selective", "-o", str(out), "--force")  # fmt: skip
    assert code == 0, err
    assert info(out)["config"]["hicache"] == {"host_pool_tokens": host_pool_tokens_for(30_000, 16, 3.0),
                                              "write_policy": "write_through_selective", "host_ratio": 3.0,
                                              "host_size_gb": None}  # fmt: skip
    code, _, err = invoke("record", *WORKLOAD, "--duration", "1s", "--like", str(tiered[0]), "--no-hicache",
                          "-o", str(out), "--force")  # fmt: skip
    assert code == 0, err
    assert "hicache" not in info(out)["config"] and info(out)["format_version"] == 1


def test_hicache_size_is_sized_from_the_models_bytes_per_token(tmp_path: Path) -> None:
    out = tmp_path / "gb.kvtrace"
    code, _, err = invoke("record", *WORKLOAD, "--pool-tokens", str(POOL), "--page-size", "1", "--hicache-size", "2",
                          "--hicache-ratio", "5", "-o", str(out))  # fmt: skip
    assert code == 0, err
    tier = info(out)["config"]["hicache"]
    # Llama-3.1-8B's 131,072 bytes per token; as in SGLang, the size overrides the ratio.
    assert tier == {"host_pool_tokens": host_tokens_for_size(2, 131_072, 1), "write_policy": "write_through",
                    "host_ratio": None, "host_size_gb": 2}  # fmt: skip
    assert tier["host_pool_tokens"] == 15_259


@pytest.mark.parametrize(
    ("extra", "fragments"),
    [
        (["--hicache-ratio", "0"], ["--hicache-ratio", "must lie in (0, 1000], found 0.0"]),
        (["--hicache-ratio", "-2"], ["--hicache-ratio", "must lie in (0, 1000]"]),
        (["--hicache-ratio", "nan"], ["--hicache-ratio", "must be a finite number"]),
        (["--hicache-size", "-1"], ["--hicache-size", "must lie in [0, "]),
        (["--hicache-write-policy", "write_around"], ["--hicache-write-policy", "'write_around' is not one of"]),
        (["--no-hicache", "--hicache-ratio", "2"], ["--no-hicache", "leave out --no-hicache"]),
        (["--hicache-ratio", "999"], ["--hicache-ratio", "above 2,147,483,647"]),
        (["--model", "gpt-oss-20b", "--hicache-size", "4"], ["--hicache-size", "full-attention model only", "give --hicache-ratio"]),
    ],
)
def test_bad_tier_options_are_one_line_and_exit_2(tmp_path: Path, extra: list[str], fragments: list[str]) -> None:
    code, _, err = invoke("record", *WORKLOAD, "--pool-tokens", "3000000", *extra, "-o", str(tmp_path / "x.kvtrace"))
    line = one_error_line(err)
    assert code == 2 and all(f in line for f in fragments), line
    assert not (tmp_path / "x.kvtrace").exists()


def test_replay_serves_the_tier(tiered: tuple[Path, dict[str, Any]]) -> None:
    code, out, err = invoke("replay", str(tiered[0]), "--json", "--check", "every", "-q")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["num_violations"] == 0 and summary["num_ooms"] == 0
    assert summary["pools"]["host"]["pool_tokens"] == 180_016
    tier = summary["hicache"]
    assert tier["write_policy"] == "write_back" and tier["host_pool_tokens"] == 180_016
    t = tier["prefix_tokens"]
    assert t["device"] + t["host"] == summary["tokens"]["reused"]


def test_replay_what_if_tier_options(tiered: tuple[Path, dict[str, Any]]) -> None:
    code, out, err = invoke("replay", str(tiered[0]), "--json", "-q", "--hicache-ratio", "1",
                            "--hicache-write-policy", "write_through")  # fmt: skip
    assert code == 0, err
    tier = json.loads(out)["hicache"]
    assert tier["write_policy"] == "write_through"
    assert tier["host_pool_tokens"] == host_pool_tokens_for(POOL, 16, 1.0)
    code, _, err = invoke("replay", "sample:tiny", "--hicache-ratio", "-1")
    assert code == 2 and "--hicache-ratio" in one_error_line(err)


@pytest.mark.parametrize("command", [["diff", "--a", "builtin", "--b", "builtin"], ["sweep", "--pool-tokens", "60k,90k", "-j", "1"]])
def test_diff_and_sweep_run_it(tiered: tuple[Path, dict[str, Any]], tmp_path: Path, command: list[str]) -> None:
    extra = ["-o", str(tmp_path / "s.parquet"), "-q"] if command[0] == "sweep" else []
    code, _, err = invoke(command[0], str(tiered[0]), *command[1:], *extra)
    assert code == 0, err


@pytest.mark.parametrize("command", [["info"], ["validate"], ["replay"], ["info", "--json"]])
def test_a_damaged_tier_is_one_error_line(tmp_path: Path, command: list[str]) -> None:
    from tests.helpers import with_meta
    from traces.samples import sample_path

    def edit(data: dict[str, Any]) -> None:
        data["format_version"] = 5
        data["config"]["hicache"] = {"host_pool_tokens": 8208, "write_policy": "write_always", "host_ratio": 2.0}

    trace = with_meta(sample_path("tiny"), tmp_path / "bad.kvtrace", edit)
    code, _, err = invoke(command[0], str(trace), *command[1:])
    line = one_error_line(err)
    assert code == 2 and "bad.kvtrace" in line
    assert "'config.hicache.write_policy' must be one of write_through, write_through_selective, write_back" in line


def test_a_workload_file_is_sized_with_the_default_model(tmp_path: Path) -> None:
    # No trace and no --model: Llama-3.1-8B's 131,072 bytes per token size the GB.
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(
        json.dumps({"hash_ids": [i, 100 + i], "output_length": 8, "input_length": 1000, "timestamp": 1000 * i}) + "\n"
        for i in range(3)
    ))  # fmt: skip
    out = tmp_path / "w.kvtrace"
    code, _, err = invoke("record", str(workload), "--pool-tokens", "20000", "--hicache-size", "1", "-o", str(out), "-q")
    assert code == 0, err
    assert info(out)["config"]["hicache"]["host_pool_tokens"] == host_tokens_for_size(1, 131_072, 1) == 7630
