"""A hybrid linear-attention (Mamba) trace recorded with the radix cache on, through the
replay: the allocator keeps the checkpointed states in its Mamba radix tree, the reports
count them (summary, ``--json``, the state log's ``mamba_evictable`` / ``mamba_protected``),
the checks find none broken on the bundled sample, and injected faults (a checkpoint freed
twice, a state copied across requests that share no prefix) are caught with blame."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.replay.config import allocator_config_for
from kvtrace.replay.engine import ReplayOptions
from kvtrace.replay.session import ReplaySession
from traces.reader import TraceReader
from traces.samples import sample_path

runner = CliRunner()
SAMPLE = "sample:mooncake-qwen3-next-radix"
FAULTY = str(Path(__file__).with_name("faulty_allocators.py"))


def test_the_sample_gets_the_mamba_pool_with_the_radix_cache() -> None:
    config = allocator_config_for(TraceReader(sample_path("mooncake-qwen3-next-radix")).meta)
    assert config.radix_cache and config.page_size == 1
    assert config.mamba is not None and config.mamba.slots == 56 and config.mamba.strategy == "no_buffer"


def test_a_resized_pool_gets_the_slots_of_its_memory_with_the_radix_cache() -> None:
    # SGLang sizes the Mamba slots from memory with the radix cache (by the rows without)
    meta = TraceReader(sample_path("mooncake-qwen3-next-radix")).meta
    assert meta.mamba is not None
    config = allocator_config_for(meta, pool_tokens=100_000)
    assert config.mamba is not None and config.mamba.slots == meta.mamba.for_pool(100_000, meta.model).mamba_cache_size
    assert config.mamba.slots < 56
    kept = allocator_config_for(meta, pool_tokens=100_000, radix_cache=False).mamba
    assert kept is not None and kept.slots == 56


def test_the_rows_are_capped_at_the_slots_over_three(tmp_path: Path) -> None:
    # SGLang caps max_running at slots // 3 with the radix cache; a replay with fewer
    # slots than the trace's rows runs out of rows, never of a checkpoint's state copy
    from tests.helpers import with_meta

    def edit(data: dict[str, object]) -> None:
        data["mamba"]["mamba_cache_size"] = 8  # type: ignore[index]

    trace = with_meta(sample_path("mooncake-qwen3-next-radix"), tmp_path / "small.kvtrace", edit)
    assert allocator_config_for(TraceReader(trace).meta).max_running == 2
    result = runner.invoke(app, ["replay", str(trace), "--json", "--on-oom", "skip", "--check", "every"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["num_ooms"] > 0 and summary["oom"]["op"] == "extend_rows" and summary["num_violations"] == 0

    def edit_none(data: dict[str, object]) -> None:
        data["mamba"]["mamba_cache_size"] = 2  # type: ignore[index]

    trace = with_meta(sample_path("mooncake-qwen3-next-radix"), tmp_path / "none.kvtrace", edit_none)
    result = runner.invoke(app, ["replay", str(trace)])
    assert result.exit_code == 2 and "2 Mamba state slot(s) serve no request with the radix cache" in result.stderr


def test_replay_counts_the_cached_checkpoints(tmp_path: Path) -> None:
    log = tmp_path / "run.state"
    result = runner.invoke(app, ["replay", SAMPLE, "--json", "--check", "every", "--out", str(log)])
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["num_violations"] == 0 and summary["num_ooms"] == 0 and summary["radix_cache"]
    # the recorder matched as the replay does (state-gated): every recorded prefix agrees
    assert summary["prefix_hit_rate"] > 0 and summary["prefix_differs_from_recorded"] == 0
    assert list(summary["pools"]) == ["full", "mamba"] and summary["pools"]["mamba"]["pool_tokens"] == 56
    table = pa.ipc.open_file(str(log)).read_all()
    evictable = table.column("mamba_evictable").to_numpy()
    protected = table.column("mamba_protected").to_numpy()
    available = table.column("mamba_available").to_numpy()
    committed = table.column("mamba_committed").to_numpy()
    assert evictable.max() > 0 and protected.max() > 0
    # every slot is free, held by a request or a cached checkpoint, at every step
    assert ((available + evictable + protected + committed) == 56).all()


@pytest.mark.parametrize(("factory", "check"),
                         [("mamba_checkpoint_double_free", "double_free"), ("mamba_state_reuse", "state_reuse")])
def test_an_injected_mamba_radix_fault_is_caught_with_blame(factory: str, check: str) -> None:
    session = ReplaySession(sample_path("mooncake-qwen3-next-radix"), version=f"{FAULTY}:{factory}",
                            options=ReplayOptions(check="every"), checker="inline")  # type: ignore[arg-type]
    alloc = session.allocator
    fault_step = None
    for snap in session.snapshots():
        if fault_step is None and alloc.fault_rid is not None:  # type: ignore[attr-defined]
            fault_step = snap.step
    assert fault_step is not None, "the fault never fired on this trace"
    violations = [v for v in session.result().stats.violations if v.check == check]
    assert violations, "the checker missed the injected fault"
    first = violations[0]
    assert (first.pool, first.step, first.rid) == ("mamba", fault_step, alloc.fault_rid)  # type: ignore[attr-defined]


def test_a_radix_recording_runs_the_allocator_with_the_mamba_radix_tree(tmp_path: Path) -> None:
    # A faulty version behind the recorder: its fault (a checkpoint freed twice by the
    # tree's eviction) fires, and the recording's own integrity check sees it, only if the
    # recorder's allocator keeps the Mamba radix tree as the replay's does.
    import dataclasses

    from kvtrace.record.simulate import RecordOptions, record_workload
    from tests.kvtrace.test_scheduler import _azure_file
    from traces.models import model_preset

    wl = _azure_file(tmp_path, [(0.0, 3000, 3), (0.1, 3000, 2), (0.2, 3000, 3), (0.3, 3000, 2), (0.4, 3000, 2)])
    preset = model_preset("qwen3-next-80b-a3b")
    options = RecordOptions(workload=wl, fmt="azure", out=None, pool_tokens=8_000, page_size=1, radix_cache=True,
                            model=preset.shape,
                            mamba=dataclasses.replace(preset.mamba_layout(60_000), mamba_cache_size=6))  # fmt: skip
    assert record_workload(options).violations == []
    faulty = record_workload(dataclasses.replace(options, version=f"{FAULTY}:mamba_checkpoint_double_free"))
    assert any("pool has 6 slots" in v for v in faulty.violations), faulty.violations  # the Mamba pool's conservation
