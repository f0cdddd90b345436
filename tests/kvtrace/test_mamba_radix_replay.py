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


def test_replay_counts_the_cached_checkpoints(tmp_path: Path) -> None:
    log = tmp_path / "run.state"
    result = runner.invoke(app, ["replay", SAMPLE, "--json", "--check", "every", "--out", str(log)])
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["num_violations"] == 0 and summary["num_ooms"] == 0 and summary["radix_cache"]
    assert summary["prefix_hit_rate"] > 0
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
