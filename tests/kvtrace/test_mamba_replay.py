"""A hybrid linear-attention (Mamba) trace through the replay, radix cache off: the
allocator gets the trace's Mamba state pool, every report names it beside the full pool
(summary, ``--json``, state log columns, ``info`` of the log), the checks watch it at
``--check end`` and ``every`` with blame, and a pool too small is an OOM of pool "mamba"."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.errors import ConfigError
from kvtrace.replay.config import allocator_config_for
from kvtrace.replay.engine import ReplayOptions
from kvtrace.replay.session import ReplaySession
from tests.helpers import with_meta
from traces.reader import TraceReader
from traces.samples import sample_path

runner = CliRunner()
SAMPLE = "sample:mooncake-qwen3-next"
FAULTY = str(Path(__file__).with_name("faulty_allocators.py"))


def invoke(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def edited(tmp_path: Path, **config: Any) -> Path:
    """The sample with its serving config (or, under ``slots``, its Mamba slots) changed."""
    slots = config.pop("slots", None)

    def edit(data: dict[str, Any]) -> None:
        data["config"].update(config)
        if slots is not None:
            data["mamba"]["mamba_cache_size"] = slots

    return with_meta(sample_path("mooncake-qwen3-next"), tmp_path / "edited.kvtrace", edit)


def test_the_allocator_gets_the_traces_mamba_pool(tmp_path: Path) -> None:
    config = allocator_config_for(TraceReader(sample_path("mooncake-qwen3-next")).meta)
    assert config.mamba is not None and config.mamba.slots == 16 and not config.radix_cache
    assert allocator_config_for(TraceReader(sample_path("mooncake-tiny")).meta).mamba is None
    # the radix cache at page 16: SGLang's (non-overlap) extra_buffer, 4 slots per request
    paged = allocator_config_for(TraceReader(sample_path("mooncake-qwen3-next")).meta, radix_cache=True)
    assert paged.mamba is not None and paged.mamba.strategy == "extra_buffer" and not paged.mamba.overlap_schedule
    assert paged.max_running == paged.mamba.slots // 4
    with pytest.raises(ConfigError, match="SGLang has no extra_buffer Mamba strategy for mamba2 layers"):
        meta = TraceReader(sample_path("mooncake-qwen3-next")).meta
        allocator_config_for(dataclasses.replace(meta, mamba=dataclasses.replace(meta.mamba, kind="mamba2")),
                             radix_cache=True)  # fmt: skip


def test_replay_reports_the_mamba_pool(tmp_path: Path) -> None:
    log = tmp_path / "run.state"
    code, out, err = invoke("replay", SAMPLE, "--json", "--check", "every", "--out", str(log))
    assert code == 0, err
    summary = json.loads(out)
    assert summary["num_violations"] == 0 and summary["num_ooms"] == 0
    mamba = summary["pools"]["mamba"]
    assert mamba["pool_tokens"] == 16 and 0 < mamba["peak_used_tokens"] <= 16 and mamba["used_tokens_at_end"] == 0
    assert list(summary["pools"]) == ["full", "mamba"]
    schema = pa.ipc.open_file(str(log)).schema
    assert "mamba_available" in schema.names and "mamba_committed" in schema.names
    assert not any(name.startswith("swa_") for name in schema.names)
    code, out, err = invoke("info", str(log), "--json")
    assert code == 0, err
    assert json.loads(out)["pools"]["mamba"]["final"]["available"] == 16
    code, out, err = invoke("info", str(log), "--no-color")
    assert code == 0 and "mamba pool" in out and "slots" in out


def test_the_text_summary_counts_the_mamba_pool_in_slots() -> None:
    code, out, err = invoke("replay", SAMPLE, "--no-color")
    assert code == 0, err
    row = next(line for line in out.splitlines() if "mamba pool" in line)
    assert "16 slots; peak" in row and "0 out-of-memories" in row


def test_a_pool_too_small_is_an_oom_of_the_mamba_pool(tmp_path: Path) -> None:
    code, out, err = invoke("replay", str(edited(tmp_path, slots=2)), "--json", "--on-oom", "skip")
    summary = json.loads(out)
    assert summary["num_ooms"] > 0 and summary["pools"]["mamba"]["num_ooms"] == summary["num_ooms"], err
    assert summary["pools"]["full"]["num_ooms"] == 0
    assert summary["oom"]["pool"] == "mamba" and summary["oom"]["op"] == "extend"


@pytest.mark.parametrize(("factory", "check"), [("mamba_leak", "leak"), ("mamba_double_free", "double_free")])
@pytest.mark.parametrize("mode", ["every", "end"])
def test_an_injected_mamba_fault_is_caught_with_blame(factory: str, check: str, mode: str) -> None:
    session = ReplaySession(sample_path("mooncake-qwen3-next"), version=f"{FAULTY}:{factory}",
                            options=ReplayOptions(check=mode), checker="inline")  # type: ignore[arg-type]
    alloc = session.allocator
    fault_step = None
    for snap in session.snapshots():
        if fault_step is None and alloc.fault_rid is not None:  # type: ignore[attr-defined]
            fault_step = snap.step
    assert fault_step is not None, "the fault never fired on this trace"
    violations = [v for v in session.result().stats.violations if v.check == check]
    assert violations, "the checker missed the injected fault"
    first = violations[0]
    assert first.pool == "mamba"
    if mode == "every":
        assert (first.step, first.rid, first.op) == (fault_step, alloc.fault_rid, "finish")  # type: ignore[attr-defined]
    elif check == "leak":  # a leaked slot is never handed out again: still blamed on its last holder
        assert first.rid == alloc.fault_rid  # type: ignore[attr-defined]


def test_a_recording_runs_the_allocator_with_the_mamba_pool(tmp_path: Path) -> None:
    # A leaky version behind the recorder: its fault (a finish keeping the Mamba slot)
    # fires, and the recording's own integrity check sees it, only if the recorder's
    # allocator keeps the Mamba pool as the replay's does.
    from kvtrace.record.simulate import RecordOptions, record_workload
    from tests.kvtrace.test_scheduler import _azure_file
    from traces.models import model_preset

    wl = _azure_file(tmp_path, [(0.0, 100, 3), (0.0, 40, 2), (0.5, 64, 3)])
    preset = model_preset("qwen3-next-80b-a3b")
    options = RecordOptions(workload=wl, fmt="azure", out=None, pool_tokens=60_000, page_size=16, radix_cache=False,
                            model=preset.shape, mamba=preset.mamba_layout(60_000))  # fmt: skip
    assert record_workload(options).violations == []
    leaky = record_workload(dataclasses.replace(options, version=f"{FAULTY}:mamba_leak"))
    assert any("leaked_mamba_pages" in v for v in leaky.violations), leaky.violations


def test_a_sweep_reports_the_mamba_pool(tmp_path: Path) -> None:
    out = tmp_path / "r.parquet"
    result = runner.invoke(app, ["sweep", SAMPLE, "--pool-tokens", "60000", "-j", "1", "-o", str(out), "-q"])
    assert result.exit_code == 0, result.output
    report = runner.invoke(app, ["sweep", "report", str(out), "--no-plots", "--json"])
    row = json.loads(report.stdout)["rows"][0]
    assert row["mamba_slots"] == 16 and 0 < row["mamba_peak_occupancy"] <= 1
    table = runner.invoke(app, ["sweep", "report", str(out), "--no-plots", "--no-color"], terminal_width=250)
    assert table.exit_code == 0 and "Mamba slots" in table.stdout and "SWA pool" not in table.stdout
