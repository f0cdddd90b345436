"""A trace's attention layout on the command line: ``info`` shows it, a bad one is one
error line, and a sliding-window trace served with the radix cache is refused (not
replayed as full attention) until the SWA allocator's radix cache serves it."""

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

# tiny's 32 layers as gpt-oss alternates them: sliding (even), full (odd).
LAYOUT = {
    "full_layer_ids": list(range(1, 32, 2)),
    "swa_layer_ids": list(range(0, 32, 2)),
    "sliding_window": 128,
    "swa_full_tokens_ratio": 0.8,
    "swa_pool_tokens": 3168,
}


def invoke(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def one_error_line(stderr: str, *fragments: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtrace: error: ") and "Traceback" not in stderr, stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def swa_tiny(tmp_path: Path, **edits: Any) -> Path:
    def edit(data: dict[str, Any]) -> None:
        data.update(format_version=2, attention={**LAYOUT, **edits})

    return with_meta(sample_path("tiny"), tmp_path / "swa.kvtrace", edit)


def test_info_shows_the_layout_and_both_pools(tmp_path: Path) -> None:
    trace = swa_tiny(tmp_path)
    code, out, err = invoke("info", str(trace), "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["format_version"] == 2
    attention = info["attention"]
    assert attention["full_layer_ids"] == LAYOUT["full_layer_ids"] and attention["sliding_window"] == 128
    assert attention["num_full_layers"] == attention["num_swa_layers"] == 16
    assert attention["full_pool_tokens"] == 3968 and attention["swa_pool_tokens"] == 3168
    assert attention["full_bytes_per_token"] == attention["swa_bytes_per_token"] == 16 * 2 * 8 * 128 * 2
    code, out, err = invoke("info", str(trace), "--no-color")
    assert code == 0, err
    assert "16 full + 16 sliding-window layers" in out and "window 128 tokens" in out
    assert "full 3,968 tokens" in out and "SWA 3,168 tokens" in out


def test_info_of_a_full_attention_trace_has_no_layout() -> None:
    code, out, _ = invoke("info", "sample:tiny", "--json")
    assert code == 0 and json.loads(out)["attention"] is None
    code, out, _ = invoke("info", "sample:tiny", "--no-color")
    assert code == 0 and "sliding-window" not in out


@pytest.mark.parametrize("command", [["validate"], ["info"], ["replay"], ["validate", "--json"]])
def test_a_bad_layout_is_one_error_line(tmp_path: Path, command: list[str]) -> None:
    trace = swa_tiny(tmp_path, swa_layer_ids=[0, 1, 40])
    code, _, err = invoke(command[0], str(trace), *command[1:])
    assert code == 2
    one_error_line(err, "swa.kvtrace", "'attention.swa_layer_ids' must be a list of layer ids in [0, 32)")


def test_a_sliding_window_trace_with_the_radix_cache_replays_clean_with_both_pools(tmp_path: Path) -> None:
    """tiny with a gpt-oss-like layout: PD prealloc, EAGLE and the radix cache, on both pools."""
    trace = swa_tiny(tmp_path)
    code, out, err = invoke("replay", str(trace), "--json", "--check", "every")
    assert code == 0, err
    pools = json.loads(out)["pools"]
    assert set(pools) == {"full", "swa"} and pools["swa"]["peak_used_tokens"] > 0
    code, out, err = invoke("diff", str(trace), "--a", "builtin", "--b", "paged:16")
    assert code == 0 and "identical over 139 steps" in out, (out, err)


def test_a_version_2_trace_without_layout_replays_as_version_1(tmp_path: Path) -> None:
    v2 = with_meta(sample_path("tiny"), tmp_path / "v2.kvtrace", lambda d: d.update(format_version=2))
    results = []
    for trace in (str(sample_path("tiny")), str(v2)):
        code, out, err = invoke("replay", trace, "--json")
        assert code == 0, err
        summary = json.loads(out)
        results.append({k: v for k, v in summary.items() if not k.endswith("_s") and "speed" not in k and k != "trace"})
    assert results[0] == results[1]
