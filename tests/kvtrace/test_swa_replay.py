"""A hybrid sliding-window (SWA) trace through the replay: the allocator gets the
trace's SWA pool, and every report names both pools (summary, ``--json``, state log,
``info``, sweep rows); a full-attention replay reports its one pool as before."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from allocator.base import AllocatorConfig
from kvtrace.cli import app
from kvtrace.errors import ConfigError
from kvtrace.replay.config import allocator_config_for
from tests.helpers import with_meta
from traces.reader import TraceReader
from traces.samples import sample_path

runner = CliRunner()

# tiny's 32 layers as gpt-oss alternates them; a window and SWA pool small enough
# that tiny's requests slide out of it and free SWA slots.
LAYOUT = {
    "full_layer_ids": list(range(1, 32, 2)),
    "swa_layer_ids": list(range(0, 32, 2)),
    "sliding_window": 128,
    "swa_full_tokens_ratio": 0.8,
    "swa_pool_tokens": 3168,
}


def swa_tiny(tmp_path: Path, *, radix_cache: bool = False, **edits: Any) -> Path:
    """sample:tiny as if served by an SWA model (radix cache off unless asked)."""

    def edit(data: dict[str, Any]) -> None:
        data.update(format_version=2, attention={**LAYOUT, **edits})
        data["config"]["radix_cache"] = radix_cache

    return with_meta(sample_path("tiny"), tmp_path / "swa.kvtrace", edit)


def invoke(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_the_allocator_gets_the_traces_swa_pool(tmp_path: Path) -> None:
    meta = TraceReader(swa_tiny(tmp_path)).meta
    config = allocator_config_for(meta)
    assert config.swa is not None and config.swa.window == 128 and config.swa.swa_pool_tokens == 3168
    # a what-if pool follows the recorded ratio, as SGLang derives the SWA pool
    resized = allocator_config_for(meta, pool_tokens=2048)
    assert resized.swa is not None and resized.swa.swa_pool_tokens is None
    assert resized.swa.pool_tokens(resized.pool_tokens, resized.page_size) == 1632
    assert allocator_config_for(TraceReader(sample_path("tiny")).meta).swa is None


def allocator_serves(config: AllocatorConfig) -> bool:
    """Whether the allocator's own check takes ``config`` (the rule lives there only)."""
    try:
        config.check()
    except ValueError:
        return False
    return True


def test_a_draft_window_in_the_layout_reaches_the_allocator(tmp_path: Path) -> None:
    """attention.draft_sliding_window (SGLang's draft_swa_window) round-trips through
    the trace and becomes SwaConfig.draft_window; the SWA history kept is the larger
    window, the model's own window stays 128; a layout without it writes no key."""
    meta = TraceReader(swa_tiny(tmp_path, draft_sliding_window=200)).meta
    assert meta.attention is not None and meta.attention.draft_sliding_window == 200
    swa = allocator_config_for(meta).swa
    assert swa is not None and (swa.window, swa.draft_window, swa.retain_window) == (128, 200, 200)
    assert json.loads(meta.to_json())["attention"]["draft_sliding_window"] == 200
    (tmp_path / "plain").mkdir()
    plain = TraceReader(swa_tiny(tmp_path / "plain")).meta
    assert "draft_sliding_window" not in json.loads(plain.to_json())["attention"]
    assert allocator_config_for(plain).swa.retain_window == 128  # type: ignore[union-attr]


def test_a_switch_the_swa_allocator_refuses_is_one_config_error_naming_it(tmp_path: Path) -> None:
    def hisparse(data: dict[str, Any]) -> None:
        data.update(format_version=2, attention=LAYOUT)
        data["config"].update(radix_cache=False, hisparse=True, pd_decode=True)

    meta = TraceReader(with_meta(sample_path("tiny"), tmp_path / "hisparse.kvtrace", hisparse)).meta
    with pytest.raises(ConfigError) as info:
        allocator_config_for(meta)
    assert str(info.value).startswith("SGLang 0.5.23 does not serve HiSparse with sliding-window models")


def test_the_radix_switch_is_decided_by_the_allocators_own_check(tmp_path: Path) -> None:
    # Refused while the allocator refuses SWA with the radix cache; served once it does.
    meta = TraceReader(swa_tiny(tmp_path, radix_cache=True)).meta
    wanted = dataclasses.replace(allocator_config_for(meta, radix_cache=False), radix_cache=True)
    if allocator_serves(wanted):
        assert allocator_config_for(meta).radix_cache is True
    else:
        with pytest.raises(ConfigError, match="served with the radix cache, which the SWA allocator does not serve"):
            allocator_config_for(meta)


def test_a_radix_off_swa_trace_replays_clean(tmp_path: Path) -> None:
    code, out, err = invoke("replay", str(swa_tiny(tmp_path)), "--json", "--check", "every")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["num_violations"] == 0 and summary["oom"] is None and summary["radix_cache"] is False


def test_the_summary_reports_both_pools_and_keeps_the_full_pool_at_the_top(tmp_path: Path) -> None:
    code, out, err = invoke("replay", str(swa_tiny(tmp_path)), "--json")
    assert code == 0, err
    summary = json.loads(out)
    pools = summary["pools"]
    assert list(pools) == ["full", "swa"]
    assert pools["full"]["pool_tokens"] == summary["pool_tokens"] == 3968 and pools["swa"]["pool_tokens"] == 3168
    assert pools["full"]["peak_used_tokens"] == summary["peak_used_tokens"]
    assert pools["full"]["peak_step"] == summary["peak_step"]
    # the window frees SWA slots: the SWA pool's peak stays below the full pool's
    assert 0 < pools["swa"]["peak_used_tokens"] < pools["full"]["peak_used_tokens"]
    assert pools["swa"]["used_tokens_at_end"] == 0 and pools["swa"]["num_ooms"] == 0
    code, out, err = invoke("replay", str(swa_tiny(tmp_path)), "--no-color")
    assert code == 0, err
    assert "swa pool" in out and "3,168 tokens" in out


def test_a_full_attention_summary_has_no_pools_object() -> None:
    code, out, err = invoke("replay", "sample:tiny", "--json")
    assert code == 0, err
    assert "pools" not in json.loads(out)


def test_the_state_log_and_its_info_carry_both_pools(tmp_path: Path) -> None:
    from kvtrace.statelog.log import read_state_log

    log = tmp_path / "swa.kvstate"
    code, out, err = invoke("replay", str(swa_tiny(tmp_path)), "--json", "--out", str(log))
    assert code == 0, err
    summary = json.loads(out)
    _, snaps = read_state_log(log)
    steps = list(snaps)
    assert all(set(s.pools) == {"full", "swa"} for s in steps)
    swa_used = [s.pools["swa"].used_tokens for s in steps]
    assert max(swa_used) == summary["pools"]["swa"]["peak_used_tokens"]
    assert all(s.pools["swa"].pool_tokens == 3168 for s in steps)
    code, out, err = invoke("info", str(log), "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["pools"]["swa"]["peak_used_tokens"] == max(swa_used)
    assert info["pools"]["full"]["peak_used_tokens"] == info["peak_used_tokens"] == summary["peak_used_tokens"]
    assert info["pools"]["swa"]["final"]["available"] == 3168


def test_a_full_attention_state_log_has_one_pool(tmp_path: Path) -> None:
    from kvtrace.statelog.log import STATE_LOG_SCHEMA, read_state_log
    from traces.ipc import IpcReader

    log = tmp_path / "tiny.kvstate"
    code, _, err = invoke("replay", "sample:tiny", "--out", str(log))
    assert code == 0, err
    assert IpcReader(log).schema.remove_metadata().equals(STATE_LOG_SCHEMA)
    _, snaps = read_state_log(log)
    assert all(list(s.pools) == ["full"] and s.other_pools == () for s in snaps)
    code, out, _ = invoke("info", str(log), "--json")
    assert code == 0 and "pools" not in json.loads(out)


def test_an_oom_in_the_swa_pool_names_the_pool(tmp_path: Path) -> None:
    trace = swa_tiny(tmp_path, swa_pool_tokens=160)  # above window + page, below tiny's prompts
    code, out, err = invoke("replay", str(trace), "--json")
    summary = json.loads(out)
    assert summary["oom"] is not None, err
    assert summary["oom"]["pool"] == "swa" and summary["pools"]["swa"]["num_ooms"] == summary["num_ooms"] >= 1
    assert summary["pools"]["full"]["num_ooms"] == 0
    code, out, err = invoke("replay", str(trace), "--no-color")
    assert "swa pool" in out


@pytest.mark.slow
def test_sweep_rows_report_both_pools(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    out = tmp_path / "sweep.parquet"
    code, _, err = invoke("sweep", str(swa_tiny(tmp_path)), "--pool-tokens", "3k,4k", "-j", "1", "-o", str(out), "-q")
    assert code == 0, err
    rows = pq.read_table(out).to_pylist()
    assert len(rows) == 2 and all(r["status"] == "ok" for r in rows)
    for row in rows:
        assert row["pools.full.peak_used_tokens"] == row["peak_used_tokens"]
        # a what-if pool resizes the SWA pool by the recorded ratio (0.8), as SGLang does
        assert row["pools.swa.pool_tokens"] == int(row["pools.full.pool_tokens"] * 0.8) // 16 * 16
        assert 0 < row["pools.swa.peak_used_tokens"] <= row["pools.swa.pool_tokens"]
