"""``kvtrace record --like TRACE`` (a trace's whole serving config) and ``--model NAME``
(a preset's shape and layout; sliding-window presets record with the radix cache off,
the SWA radix cache being built)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from tests.helpers import with_meta
from traces.samples import sample_path

runner = CliRunner()
# Ten seconds of the Mooncake sample: a few requests, a recording of a second or two.
WORKLOAD = ["sample:mooncake-tiny", "--duration", "10s", "-q"]


def invoke(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def info(path: Path | str) -> dict[str, Any]:
    code, out, err = invoke("info", str(path), "--json")
    assert code == 0, err
    return json.loads(out)


def one_error_line(stderr: str, *fragments: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtrace: error: ") and "Traceback" not in stderr, stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_like_takes_the_whole_serving_config_of_the_trace(tmp_path: Path) -> None:
    out = tmp_path / "like.kvtrace"
    code, _, err = invoke("record", *WORKLOAD, "--like", "sample:tiny", "-o", str(out))
    assert code == 0, err
    like, recorded = info("sample:tiny"), info(out)
    # tiny: page 16, a 3,968-token pool, 8 running, context 2,048, chunk 43, EAGLE 3/1/4,
    # PD decode WITH a radix cache (not what --pd-decode alone implies), its own model.
    assert recorded["config"] == like["config"]
    assert recorded["model"] == like["model"] and recorded["attention"] is None
    assert recorded["format_version"] == 1  # full attention: the lowest version that holds it


def test_options_given_override_the_like_trace(tmp_path: Path) -> None:
    out = tmp_path / "like.kvtrace"
    code, _, err = invoke(
        "record", *WORKLOAD, "--like", "sample:tiny", "--page-size", "1", "--max-running", "4", "--no-pd-decode",
        "--model", "llama-3.1-8b", "-o", str(out),
    )  # fmt: skip
    assert code == 0, err
    like, recorded = info("sample:tiny")["config"], info(out)
    assert recorded["config"]["page_size"] == 1 and recorded["config"]["max_running"] == 4
    assert recorded["config"]["pd_decode"] is False
    assert recorded["model"]["name"] == "Llama-3.1-8B"
    keep = ("pool_tokens", "max_context_len", "chunk_size", "spec", "radix_cache")
    assert {k: recorded["config"][k] for k in keep} == {k: like[k] for k in keep}


def test_a_switch_the_swa_allocator_refuses_is_refused_before_recording() -> None:
    from kvtrace.errors import ConfigError
    from kvtrace.record.simulate import refuse_sliding_window
    from traces.models import model_preset

    layout = model_preset("gpt-oss-20b").layout(60000, 16)
    with pytest.raises(ConfigError, match="^gpt-oss-20b: SGLang 0.5.23 does not serve HiSparse with sliding-window models"):
        refuse_sliding_window("gpt-oss-20b", layout, page_size=16, pool_tokens=60000, radix_cache=False, hisparse=True)
    refuse_sliding_window("gpt-oss-20b", layout, page_size=16, pool_tokens=60000, radix_cache=False)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "window"), [("gpt-oss-20b", 128), ("gemma-3-27b", 1024)])
def test_a_sliding_window_preset_records_with_the_radix_cache_off(tmp_path: Path, name: str, window: int) -> None:
    out = tmp_path / "swa.kvtrace"
    code, _, err = invoke("record", *WORKLOAD, "--model", name, "--no-radix-cache", "--pool-tokens", "60000",
                          "--page-size", "16", "-o", str(out))  # fmt: skip
    assert code == 0, err
    recorded = info(out)
    assert recorded["attention"]["sliding_window"] == window and recorded["config"]["radix_cache"] is False
    code, stdout, err = invoke("replay", str(out), "--json", "--check", "every")
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["num_violations"] == 0 and summary["oom"] is None
    assert summary["pools"]["swa"]["peak_used_tokens"] > 0


@pytest.mark.slow
def test_like_a_sliding_window_trace_takes_its_layout_and_its_radix_switch(tmp_path: Path) -> None:
    def edit(data: dict[str, Any]) -> None:
        data.update(format_version=2, attention={
            "full_layer_ids": list(range(1, 32, 2)), "swa_layer_ids": list(range(0, 32, 2)),
            "sliding_window": 128, "swa_pool_tokens": 3168,
        })  # fmt: skip

    swa = with_meta(sample_path("tiny"), tmp_path / "swa-tiny.kvtrace", edit)
    out = tmp_path / "out.kvtrace"
    # tiny was served with the radix cache: its layout and its radix switch are taken
    code, _, err = invoke("record", *WORKLOAD, "--like", str(swa), "--no-pd-decode", "-o", str(out))
    assert code == 0, err
    assert info(out)["attention"]["sliding_window"] == 128 and info(out)["config"]["radix_cache"] is True
    code, _, err = invoke("record", *WORKLOAD, "--like", str(swa), "--no-pd-decode", "--no-radix-cache", "-o", str(out),
                          "--force")  # fmt: skip
    assert code == 0, err
    assert info(out)["attention"]["sliding_window"] == 128 and info(out)["config"]["radix_cache"] is False
    code, _, err = invoke("record", *WORKLOAD, "--like", str(swa), "--model", "llama-3.1-8b", "-o", str(out), "--force")
    assert code == 0, err
    assert info(out)["attention"] is None and info(out)["config"]["pool_tokens"] == 3968


def test_model_presets_are_listed_in_help() -> None:
    result = runner.invoke(app, ["record", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for name in ("llama-3.1-8b", "gpt-oss-20b", "gemma-3-27b", "--like"):
        assert name in result.stdout


def test_like_a_missing_trace_is_one_error_line(tmp_path: Path) -> None:
    code, _, err = invoke("record", *WORKLOAD, "--like", str(tmp_path / "none.kvtrace"), "-o", str(tmp_path / "o.kvtrace"))
    assert code == 2
    one_error_line(err, "none.kvtrace", "no such file")


def test_the_scheduler_budgets_a_tight_swa_pool(tmp_path: Path) -> None:
    # An SWA pool of 1,024 tokens (window 128) under 512-token chunks: admission must
    # charge each request's SWA need (SGLang's SWAPrefillBudget) or an extend runs the
    # SWA pool dry although the full pool's budget admitted it.
    def edit(data: dict[str, Any]) -> None:
        data.update(format_version=2, attention={
            "full_layer_ids": list(range(1, 32, 2)), "swa_layer_ids": list(range(0, 32, 2)),
            "sliding_window": 128, "swa_pool_tokens": 1024,
        })  # fmt: skip

    swa = with_meta(sample_path("tiny"), tmp_path / "swa-tiny.kvtrace", edit)
    out = tmp_path / "out.kvtrace"
    code, _, err = invoke("record", *WORKLOAD, "--like", str(swa), "--no-pd-decode", "--no-radix-cache",
                          "--chunk", "512", "-o", str(out))  # fmt: skip
    assert code == 0, err
    code, stdout, err = invoke("replay", str(out), "--json", "--check", "every")
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["oom"] is None and summary["num_violations"] == 0
    assert summary["pools"]["swa"]["pool_tokens"] == 1024


def test_the_out_may_not_be_the_trace_it_is_like(tmp_path: Path) -> None:
    like = tmp_path / "like.kvtrace"
    like.write_bytes(sample_path("tiny").read_bytes())
    before = like.read_bytes()
    code, _, err = invoke("record", *WORKLOAD, "--like", str(like), "-o", str(like), "--force")
    assert code == 2
    one_error_line(err, f"--out {like} is the input", "give another path")
    assert like.read_bytes() == before


def test_like_a_sliding_window_trace_with_another_pool_sizes_its_swa_pool_by_the_ratio(tmp_path: Path) -> None:
    out = tmp_path / "half.kvtrace"
    code, _, err = invoke("record", *WORKLOAD, "--like", "sample:mooncake-gpt-oss", "--pool-tokens", "30000", "-o", str(out))
    assert code == 0, err
    like, recorded = info("sample:mooncake-gpt-oss")["attention"], info(out)["attention"]
    assert like["swa_pool_tokens"] == 48000 and like["swa_full_tokens_ratio"] == 0.8
    assert recorded["swa_pool_tokens"] == 24000  # int(30,000 x 0.8), whole pages of 16


def test_spec_off_turns_off_the_speculation_of_the_like_trace() -> None:
    # --spec off is None once parsed: it must not fall back to the like trace's EAGLE.
    from kvtrace.record.serving import serving_settings

    eagle = sample_path("mooncake-eagle")
    workload = sample_path("tiny")
    assert serving_settings(workload, "trace", {}, like=eagle)["spec"] is not None
    assert serving_settings(workload, "trace", {"spec": None}, like=eagle)["spec"] is None
    assert serving_settings(eagle, "trace", {"spec": None})["spec"] is None
