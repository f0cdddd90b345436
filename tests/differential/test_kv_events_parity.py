"""The KV events kvtrace derives (``kvtrace.events.emit``) against SGLang 0.5.23's own, byte for byte.

The same random operations (inserts of sequences sharing prefixes, matches that split
nodes, evictions) go through SGLang's real ``RadixCache`` with its event recorder on
(in the SGLang interpreter) and through kvtrace's radix cache with ``TreeEvents``;
after each group of operations (a step) both sides' events are encoded as one batch
(time 0) and compared. Pages of 1 and 16 tokens; some tokens above 2**32 (SGLang's
64-bit page form). Skipped unless ``KVTRACE_SGLANG_PYTHON`` names the SGLang venv's
interpreter (``tests/differential/harness.py``).
"""

from __future__ import annotations

import json
import random
import subprocess
import textwrap

import numpy as np
import pytest

from kvtrace.events.blocks import KVEventBatch
from kvtrace.events.emit import TreeEvents
from kvtrace.events.wire import encode
from tests.differential import harness

# Run by the SGLang interpreter: each run of operations (JSON on stdin) through a fresh
# SGLang RadixCache; prints, per run, one hex batch per step.
_SGLANG_SIDE = textwrap.dedent("""
    import importlib.abc, importlib.machinery, json, sys, types
    from array import array
    from types import SimpleNamespace

    class Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        # Two modules on SGLang's import path need torchvision; nothing here uses them
        # (as kvtrace/sglang/world.py does).
        names = {"sglang.srt.multimodal.internvl_utils", "sglang.srt.configs.deepseek_ocr"}
        def find_spec(self, name, path, target=None):
            return importlib.machinery.ModuleSpec(name, self) if name in self.names else None
        def create_module(self, spec):
            module = types.ModuleType(spec.name)
            module.__getattr__ = lambda attr: type(attr, (), {"model_type": "stub_" + attr.lower()})
            return module
        def exec_module(self, module):
            pass

    sys.meta_path.insert(0, Stubs())
    import msgspec, torch
    from sglang.srt.disaggregation.kv_events import KVEventBatch
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    page_size, runs = json.load(sys.stdin)
    pool = SimpleNamespace(device="cpu", free_segment=lambda *a, **k: None)
    out = []
    for steps in runs:
        tree = RadixCache.create_simulated(mock_allocator=pool, page_size=page_size, enable_kv_cache_events=True)
        out.append([])
        for ops in steps:
            for op, arg in ops:
                if op == "insert":
                    tree.insert(InsertParams(key=RadixKey(array("q", arg)), value=torch.arange(len(arg))))
                elif op == "match":
                    tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", arg))))
                else:
                    tree.evict(EvictParams(num_tokens=arg))
            batch = KVEventBatch(ts=0.0, events=tree.take_events(), attn_dp_rank=0)
            out[-1].append(msgspec.msgpack.encode(batch).hex())
    print(json.dumps(out))
""")


class _Pool:
    def free_segment(self, slots: object, start: int) -> None:
        pass


def _ours(page_size: int, steps: list) -> list[str]:
    from allocator.radix_cache import RadixCache

    tree = RadixCache(page_size, _Pool())
    listener = TreeEvents(tree)
    tree.listener = listener
    out = []
    for ops in steps:
        for op, arg in ops:
            if op == "insert":
                tree.insert(np.array(arg, np.int64), np.arange(len(arg), dtype=np.int32))
            elif op == "match":
                tree.match_prefix(np.array(arg, np.int64))
            else:
                tree.evict(arg)
        out.append(encode(KVEventBatch(ts=0.0, events=listener.take(), attn_dp_rank=0)).hex())
    return out


def _operations(seed: int, page_size: int) -> list:
    rng = random.Random(seed)
    documents = [[rng.randrange(1, 50_000) for _ in range(rng.randrange(1, 6) * page_size)] for _ in range(4)]
    documents.append([2**40 + i for i in range(2 * page_size)])  # pages hashed in the 64-bit form
    steps = []
    for _ in range(40):
        ops = []
        for _ in range(rng.randrange(1, 4)):
            prefix = rng.choice(documents)
            seq = prefix[: rng.randrange(0, len(prefix) + 1)] + [rng.randrange(1, 50_000)
                                                                for _ in range(rng.randrange(0, 4 * page_size))]
            kind = rng.random()
            if kind < 0.6:
                ops.append(("insert", seq))
            elif kind < 0.85:
                ops.append(("match", seq))
            else:
                ops.append(("evict", rng.randrange(1, 6) * page_size))
        steps.append(ops)
    return steps


@pytest.mark.parametrize("page_size", [1, 16])
def test_the_operations_store_and_remove_blocks(page_size: int) -> None:
    """The parity below compares streams with stores and removals in them, not empty ones."""
    from allocator.radix_cache import RadixCache
    from kvtrace.events.blocks import BlockRemoved, BlockStored

    kinds: set[type] = set()
    for seed in range(3):
        tree = RadixCache(page_size, _Pool())
        listener = TreeEvents(tree)
        tree.listener = listener
        for ops in _operations(seed, page_size):
            for op, arg in ops:
                if op == "insert":
                    tree.insert(np.array(arg, np.int64), np.arange(len(arg), dtype=np.int32))
                elif op == "evict":
                    tree.evict(arg)
            kinds |= {type(event) for event in listener.take()}
    assert {BlockStored, BlockRemoved} <= kinds


@pytest.mark.slow  # SGLang's import
@pytest.mark.parametrize("page_size", [1, 16])
def test_events_are_sglangs_own(page_size: int) -> None:
    python = harness.require_sglang()
    runs = [_operations(seed, page_size) for seed in range(3)]
    done = subprocess.run([python, "-c", _SGLANG_SIDE], input=json.dumps([page_size, runs]),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    for seed, (steps, theirs) in enumerate(zip(runs, json.loads(done.stdout.strip().splitlines()[-1]))):
        ours = _ours(page_size, steps)
        assert any(len(h) > 40 for h in ours), "no step recorded events"
        for step, (a, b) in enumerate(zip(ours, theirs)):
            assert a == b, f"seed {seed}, page {page_size}: step {step} differs"
        assert len(ours) == len(theirs)


# -- kvtrace diff --kv-events: SGLang's own recorder, driven by a replay, against ours ---------


@pytest.mark.slow  # SGLang replays the trace (twice: the plain diff, then the events)
@pytest.mark.parametrize(("sample", "page_size", "steps"), [
    ("mooncake-tiny", 1, ":"), ("mooncake-tiny", 16, ":"), ("azure-code", 1, ":1500"), ("azure-code", 16, ":1500"),
])
def test_diff_kv_events_sglang_against_builtin_is_identical(sample: str, page_size: int, steps: str) -> None:
    """``--a sglang --b builtin --kv-events``: the events SGLang's RadixCache records with
    its recorder on (``enable_kv_cache_events``), step by step, equal the built-in's,
    tokens unique to a request (negative ids) included."""
    from typer.testing import CliRunner

    from kvtrace.cli import app

    python = harness.require_sglang()
    result = CliRunner().invoke(app, ["diff", f"sample:{sample}", "--a", f"sglang:{python}", "--b", "builtin",
                                      "--page-size", str(page_size), "--steps", steps, "--kv-events", "--jobs", "1",
                                      "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    events = out["kv_events"]
    assert out["identical"] and events["identical"], events["first_divergence"]
    assert events["steps_compared"] == out["steps_compared"] > 0
    assert events["batches"] > 20 and events["events"] > events["batches"]


@pytest.mark.slow  # SGLang's import
def test_diff_kv_events_refuses_an_eagle_trace_on_sglangs_side_too() -> None:
    from typer.testing import CliRunner

    from kvtrace.cli import app

    python = harness.require_sglang()
    result = CliRunner().invoke(app, ["diff", "sample:tiny", "--a", f"sglang:{python}", "--b", "builtin",
                                      "--kv-events", "--jobs", "1"])
    assert result.exit_code == 2, result.output
    assert "EAGLE" in result.output


@pytest.mark.slow  # SGLang replays the trace
def test_a_replays_event_file_checks_identical_against_sglangs_own_events(tmp_path) -> None:
    """``events check FILE --against TRACE --allocator sglang``: the file ``replay --kv-events``
    writes is what SGLang's own recorder publishes for the same replay."""
    from typer.testing import CliRunner

    from kvtrace.cli import app

    python = harness.require_sglang()
    out = tmp_path / "run.kvev"
    runner = CliRunner()
    assert runner.invoke(app, ["replay", "sample:mooncake-tiny", "--kv-events", str(out), "-q"]).exit_code == 0
    result = runner.invoke(app, ["events", "check", str(out), "--against", "sample:mooncake-tiny",
                                 "--allocator", f"sglang:{python}", "--json"])
    assert result.exit_code == 0, result.output
    against = json.loads(result.stdout)["against"]
    assert against["identical"] and against["batches"] > 50
