"""``kvtrace diff --kv-events``: two versions' KV event streams compared step by step
(``kvtrace.diff.kvevents``, ``kvtrace.events.sources``): identical versions exit 0, an
eviction-order fault is found at its step and event, the comparator names the field,
and inputs without events are refused in one line (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.diff.kvevents import compare_batches
from kvtrace.events.blocks import GPU, AllBlocksCleared, BlockRemoved, BlockStored
from kvtrace.events.sources import step_events
from kvtrace.replay.engine import ReplayOptions
from kvtrace.replay.session import ReplaySession

runner = CliRunner()
FAULTY = str(Path(__file__).with_name("faulty_allocators.py"))
TRACE = "sample:mooncake-tiny"  # no EAGLE; its default pool evicts from step 94 on
STEPS = ":150"


def _diff(*args: str, code: int) -> dict:
    result = runner.invoke(app, ["diff", TRACE, "--kv-events", "--steps", STEPS, "--jobs", "1", *args, "--json"])
    assert result.exit_code == code, result.output
    return json.loads(result.stdout)


def test_identical_versions_publish_identical_streams_and_exit_0() -> None:
    out = _diff("--b", "builtin", code=0)
    events = out["kv_events"]
    assert events["identical"] and events["first_divergence"] is None
    assert events["steps_compared"] == out["steps_compared"] == 150
    assert events["batches"] > 0 and events["events"] > events["batches"] - 1


def test_an_eviction_order_fault_is_found_at_its_step_and_event() -> None:
    """``mru_evict`` removes other blocks at the first eviction: the first step whose
    batch holds a BlockRemoved in the built-in's own stream."""
    with ReplaySession(TRACE, options=ReplayOptions(stop_step=150), checker="inline") as alone:
        first_remove = next(
            (s.step, i) for s in step_events(alone) for i, e in enumerate(s.events) if isinstance(e, BlockRemoved)
        )
    out = _diff("--b", f"{FAULTY}:mru_evict", code=1)
    first = out["kv_events"]["first_divergence"]
    assert (first["step"], first["event"], first["field"]) == (*first_remove, "block_hashes[0]")
    assert first["a"] != first["b"]
    text = runner.invoke(app, ["diff", TRACE, "--kv-events", "--steps", STEPS, "--jobs", "1",
                               "--b", f"{FAULTY}:mru_evict"])
    assert text.exit_code == 1
    assert f"KV events differ at step {first_remove[0]}, event {first_remove[1]}: block_hashes[0]" in text.output


def _stored(hashes: list[int], parent: int | None = None) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=[1] * len(hashes),
                       block_size=1, lora_id=None, medium=GPU)


def test_the_comparator_names_the_first_differing_event_and_field() -> None:
    a = [AllBlocksCleared(), _stored([1, 2, 3])]
    assert compare_batches(7, a, [AllBlocksCleared(), _stored([1, 2, 3])]) is None
    assert compare_batches(7, a, [AllBlocksCleared(), _stored([1, 9, 3])]).to_dict() == {
        "step": 7, "event": 1, "field": "block_hashes[1]", "a": 2, "b": 9}
    assert compare_batches(7, a, [AllBlocksCleared(), _stored([1, 2])]).field == "len(block_hashes)"
    assert compare_batches(7, a, [AllBlocksCleared(), _stored([1, 2, 3], parent=5)]).field == "parent_block_hash"
    kind = compare_batches(7, a, [AllBlocksCleared(), BlockRemoved(block_hashes=[1], medium=GPU)])
    assert (kind.field, kind.a, kind.b) == ("type", "BlockStored", "BlockRemoved")
    more = compare_batches(7, a, [*a, BlockRemoved(block_hashes=[1], medium=GPU)])
    assert (more.event, more.field, more.a, more.b) == (2, "events", 2, 3)


@pytest.mark.parametrize(("args", "message"), [
    (["sample:tiny", "--b", "builtin"], "EAGLE"),
    ([TRACE, "--b", "builtin", "--steps", "5:"], "first step"),
    ([TRACE, "--b", "worktree"], "runs in its own process"),
    ([TRACE, "--b", "builtin", "--range", "HEAD~1..HEAD"], "--kv-events"),
    ([TRACE, "--b", "builtin", "--tui"], "dashboard"),
])
def test_where_events_are_not_compared_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["diff", *args, "--kv-events", "--jobs", "1"])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output
