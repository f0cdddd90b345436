"""Hybrid linear-attention models on the command line: ``record --model`` writes the
Mamba layout, the scheduler model admits under the Mamba slots, ``record --like``
carries the layout, ``info`` shows it, and one recorded with the radix cache at page 16
replays (SGLang's extra_buffer strategy: a tracking slot per request beside the 3)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.record.scheduler import SchedulerConfig
from tests.kvtrace.test_scheduler import Rig, ops_of, req
from traces.models import model_preset

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


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("mamba") / "qwen3-next.kvtrace"
    code, stdout, err = invoke("record", *WORKLOAD, "--model", "qwen3-next-80b-a3b", "--pool-tokens", str(POOL),
                               "--page-size", "16", "-o", str(out), "--json")  # fmt: skip
    assert code == 0, err
    return out, json.loads(stdout)


def test_record_model_writes_the_layout_and_admits_under_the_slots(hybrid: tuple[Path, dict[str, Any]]) -> None:
    out, report = hybrid
    expected = model_preset("qwen3-next-80b-a3b").mamba_layout(POOL)
    assert expected is not None and expected.mamba_cache_size == 16
    trace = info(out)
    assert trace["format_version"] == 3 and trace["attention"] is None
    mamba = trace["mamba"]
    assert mamba["mamba_cache_size"] == 16 and mamba["layer_kinds"] == "MMMF" * 12
    assert mamba["state_bytes_per_request"] == expected.state_bytes_per_request
    assert mamba["slots_per_request"] == 4 and mamba["full_bytes_per_token"] == 24_576
    # SGLang's rows at page 16 (extra_buffer): min(256, 16 slots // 4 per request) = 4
    assert trace["config"]["max_running"] == 4 == report["config"]["max_running"]
    assert report["config"]["mamba_slots"] == 16 and 0 < report["peak_running"] <= 4
    assert report["integrity_violations"] == []


def test_info_shows_the_layers_and_the_mamba_pool(hybrid: tuple[Path, dict[str, Any]]) -> None:
    code, out, err = invoke("info", str(hybrid[0]), "--no-color")
    assert code == 0, err
    assert "12 full-attention + 36 linear (gdn) layers" in out
    assert "Mamba 16 slots of 77,266,944 bytes" in out and "KV 60,000 tokens (24,576 bytes/token)" in out


@pytest.mark.parametrize("command", [["replay"], ["replay", "--json"], ["diff", "--a", "builtin", "--b", "builtin"]])
def test_replay_serves_it(hybrid: tuple[Path, dict[str, Any]], command: list[str]) -> None:
    # page 16 with the radix cache: SGLang's extra_buffer strategy, which the replay models
    code, _, err = invoke(command[0], str(hybrid[0]), *command[1:])
    assert code == 0 and "Traceback" not in err, err


def test_record_like_carries_the_layout(hybrid: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    out = tmp_path / "like.kvtrace"
    code, _, err = invoke("record", *WORKLOAD, "--duration", "1s", "--like", str(hybrid[0]), "-o", str(out))
    assert code == 0, err
    assert info(out)["mamba"] == info(hybrid[0])["mamba"] and info(out)["config"]["max_running"] == 4
    # Another pool: the slots of the memory that holds it; another model: no layout.
    code, _, err = invoke("record", *WORKLOAD, "--duration", "1s", "--like", str(hybrid[0]), "--pool-tokens", "120000",
                          "-o", str(out), "--force")  # fmt: skip
    assert code == 0, err
    assert info(out)["mamba"]["mamba_cache_size"] == model_preset("qwen3-next-80b-a3b").mamba_layout(120_000).mamba_cache_size  # type: ignore[union-attr]
    code, _, err = invoke("record", *WORKLOAD, "--duration", "1s", "--like", str(hybrid[0]), "--model", "llama-3.1-8b",
                          "-o", str(out), "--force")  # fmt: skip
    assert code == 0, err
    assert info(out)["mamba"] is None and info(out)["format_version"] == 1


def test_the_hybrid_presets_are_listed_in_help() -> None:
    result = runner.invoke(app, ["record", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "qwen3-next-80b-a3b" in result.stdout and "nemotron-h-8b" in result.stdout


@pytest.mark.parametrize(("radix_cache", "admitted"), [(True, 2), (False, 6)])
def test_a_request_waits_for_free_mamba_slots(tmp_path: Path, radix_cache: bool, admitted: int) -> None:
    # 6 slots: 2 requests at 3 slots each with the radix cache, 6 at 1 without; the
    # rows (8) and the KV pool would admit all 8.
    cfg = SchedulerConfig(page_size=1, pool_tokens=4000, max_running=8, max_context_len=4096, chunk_size=None,
                          radix_cache=radix_cache, mamba_slots=6)  # fmt: skip
    rig = Rig(tmp_path, cfg)
    rig.arrive(*(req(0, 50, 3) for _ in range(8)))
    rig.step()
    assert [op[0] for op in ops_of(rig.steps()[0])] == ["extend"] * admitted
    assert len(rig.sched.waiting) == 8 - admitted and rig.sched.batch_is_full
    for _ in range(3):  # decode to the end: the first ones finish and free their slots
        rig.step()
    rig.step()  # release, then admit the next ones
    extends = [op for b in rig.steps() for op in ops_of(b) if op[0] == "extend"]
    assert len(extends) > admitted
    rig.close()


def test_a_pool_whose_slots_serve_no_request_is_one_error_line(tmp_path: Path) -> None:
    out = tmp_path / "none.kvtrace"
    code, _, err = invoke("record", *WORKLOAD, "--model", "qwen3-next-80b-a3b", "--pool-tokens", "5000", "-o", str(out))
    assert code == 2 and not out.exists()
    assert err.strip().splitlines() == [
        "kvtrace: error: 1 Mamba state slot(s) serve no request (4 per request with the radix cache); "
        "give a larger --pool-tokens"
    ]


def test_a_pd_decode_server_preallocates_only_while_slots_are_free(tmp_path: Path) -> None:
    # PD decode without a radix cache: 1 slot per request, 3 slots, 8 rows.
    cfg = SchedulerConfig(page_size=1, pool_tokens=4000, max_running=8, max_context_len=4096, chunk_size=None,
                          pd_decode=True, radix_cache=False, mamba_slots=3)  # fmt: skip
    rig = Rig(tmp_path, cfg)
    rig.arrive(*(req(0, 50, 5) for _ in range(6)))
    rig.step()
    assert [op[0] for op in ops_of(rig.steps()[0])] == ["prealloc"] * 3 and len(rig.sched.waiting) == 3
    rig.close()


@pytest.mark.parametrize("command", [["info"], ["validate"], ["replay"], ["info", "--json"]])
def test_a_damaged_mamba_layout_is_one_error_line(tmp_path: Path, command: list[str]) -> None:
    from tests.helpers import with_meta
    from traces.samples import sample_path

    def edit(data: dict[str, Any]) -> None:  # tiny has 32 layers; layer 40 is none of them
        data.update(format_version=3, mamba={
            "full_layer_ids": [3, 7], "mamba_layer_ids": [0, 1, 40], "conv_state_bytes": 49152,
            "temporal_state_bytes": 2097152, "mamba_cache_size": 16,
        })  # fmt: skip

    trace = with_meta(sample_path("tiny"), tmp_path / "bad.kvtrace", edit)
    code, _, err = invoke(command[0], str(trace), *command[1:])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "bad.kvtrace" in lines[0]
    assert "'mamba.mamba_layer_ids' must be a list of layer ids in [0, 32)" in lines[0]


@pytest.mark.parametrize("extra", [[], ["--like", "sample:mooncake-qwen3-next-radix"]])
def test_record_refuses_mamba2_with_the_radix_cache_above_page_1(tmp_path: Path, extra: list[str]) -> None:
    # SGLang has no extra_buffer for Mamba2 layers: replay refuses such a trace, so record does, in one line
    out = tmp_path / "nemotron.kvtrace"
    code, _, err = invoke("record", *WORKLOAD, *extra, "--model", "nemotron-h-8b", "--page-size", "16",
                          "--pool-tokens", str(POOL), "-o", str(out))  # fmt: skip
    assert code == 2 and not out.exists(), err
    line = err.strip()
    assert "\n" not in line and "Traceback" not in err
    assert "mamba2" in line and "--page-size 1" in line and "--no-radix-cache" in line
    if extra:
        return
    code, _, err = invoke("record", *WORKLOAD, "--duration", "1s", *extra, "--model", "nemotron-h-8b",
                          "--page-size", "16", "--no-radix-cache", "--pool-tokens", str(POOL), "-o", str(out))  # fmt: skip
    assert code == 0 and out.exists(), err
