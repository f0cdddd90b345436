"""The scenario generator and the step runner (run without SGLang).

Every generated scenario must be runnable whatever the engines answer: the runner
turns out-of-memory outcomes into stalled requests, and a scenario it rejects
(``ScenarioError``) would be reported as a harness error, not a divergence.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
import pytest

from kvtrace.sglang import runner, scenario as sc
from tests.differential import ours_driver, scenarios as gen

SEEDS = range(12)


class _RandomOutcomeEngine:
    """Answers every batched call ``ok`` or ``oom`` at random and records the calls.

    Not an allocator: it exercises the runner's bookkeeping under out-of-memory
    patterns a real allocator reaches only rarely."""

    def __init__(self, seed: int, oom_prob: float = 0.3) -> None:
        self.rng = np.random.default_rng(seed)
        self.oom_prob = oom_prob
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def _answer(self, kind: str, **args: Any) -> sc.CallResult:
        self.calls.append((kind, args))
        return sc.CallResult("oom" if self.rng.random() < self.oom_prob else "ok")

    def extend(self, rids, seq_lens, token_ids, prompt_lens, prefill_done) -> sc.CallResult:
        for toks, n in zip(token_ids, seq_lens):
            assert len(toks) == n
        return self._answer("extend", rids=rids, seq_lens=seq_lens, prompt_lens=prompt_lens, done=prefill_done)

    def decode(self, rids) -> sc.CallResult:
        return self._answer("decode", rids=rids)

    def spec(self, rids, accepted) -> sc.CallResult:
        return self._answer("spec", rids=rids, accepted=accepted)

    def prealloc(self, rids, fill_lens, token_ids, prompt_lens) -> sc.CallResult:
        return self._answer("prealloc", rids=rids, fill_lens=fill_lens, prompt_lens=prompt_lens)

    def release(self, kind, rids, owned_lens, token_ids, prompt_lens, remaining) -> sc.CallResult:
        self.calls.append((kind, dict(rids=rids, owned=owned_lens, prompt_lens=prompt_lens, remaining=remaining)))
        return sc.CallResult("ok")

    def dump(self, rids: Sequence[int], final: bool = True) -> dict[str, Any]:
        return {}


@pytest.mark.parametrize("key", sorted(gen.RANDOM_CONFIGS))
def test_generated_scenarios_run_under_any_oom_pattern(key: str) -> None:
    for seed in SEEDS:
        scen = gen.random_scenario(seed, gen.RANDOM_CONFIGS[key], f"{key}-{seed}")
        for engine_seed in range(3):
            engine = _RandomOutcomeEngine(1000 * seed + engine_seed)
            stats = runner.run_scenario(scen, engine, lambda d: None)
            assert stats.steps == len(scen.steps)
            assert stats.oom_calls > 0


@pytest.mark.parametrize("key", sorted(gen.RANDOM_CONFIGS))
def test_generated_scenarios_run_through_our_allocator(key: str) -> None:
    factory, base = ours_driver.load_factory("allocator")
    for seed in SEEDS:
        scen = gen.random_scenario(seed + 100, gen.RANDOM_CONFIGS[key], f"{key}-{seed}")
        dumps: list[dict[str, Any]] = []
        stats = runner.run_scenario(scen, ours_driver.OursEngine(scen.config, factory, base), dumps.append)
        assert stats.steps == len(scen.steps) == len(dumps)


def test_early_stops_land_in_the_last_verify() -> None:
    """A stop can only cut the tokens the last speculative verify accepted (SGLang
    commits past a stop, never before tokens generated earlier)."""
    seen = 0
    for key in ("p1-eagle314", "p16-eagle548"):
        for seed in SEEDS:
            scen = gen.random_scenario(seed, gen.RANDOM_CONFIGS[key], f"{key}-{seed}")
            before_last: dict[int, int] = {}
            length: dict[int, int] = {}
            for step in scen.steps:
                for op in step.ops:
                    if op.op == "spec":
                        before_last[op.rid] = length[op.rid]
                    elif op.op in ("extend", "retract"):
                        before_last.pop(op.rid, None)
                    if op.op == "finish" and op.seq_len < length[op.rid]:
                        seen += 1
                        assert op.seq_len > before_last[op.rid], (scen.name, step.step, op)
                    length[op.rid] = op.seq_len if op.op != "retract" else 0
    assert seen > 0


class _OomOnce(_RandomOutcomeEngine):
    """``ok`` except the listed (call index) answers."""

    def __init__(self, oom_at: set[int]) -> None:
        super().__init__(0, 0.0)
        self.oom_at = oom_at

    def _answer(self, kind: str, **args: Any) -> sc.CallResult:
        self.calls.append((kind, args))
        return sc.CallResult("oom" if len(self.calls) - 1 in self.oom_at else "ok")


def test_retract_remaining_counts_running_requests_only() -> None:
    """r2 stalls mid-prefill (its second chunk runs out of memory): retracting it does
    not lower ``remaining``, retracting a decoding request does."""
    steps = [
        [sc.Op("extend", 0, 8), sc.Op("extend", 1, 8), sc.Op("extend", 2, 8, prompt_len=40)],
        [sc.Op("extend", 2, 24), sc.Op("decode", 0, 9), sc.Op("decode", 1, 9)],
        [sc.Op("retract", 2, 24), sc.Op("retract", 1, 9), sc.Op("decode", 0, 10)],
    ]
    scen = sc.Scenario("t", sc.ScenarioConfig(pool_tokens=4096), tuple(sc.Step(i, tuple(o)) for i, o in enumerate(steps)))
    engine = _OomOnce({1})  # the extend of step 1
    runner.run_scenario(scen, engine, lambda d: None)
    retract = [args for kind, args in engine.calls if kind == "retract"]
    assert retract == [dict(rids=[2, 1], owned=[8, 9], prompt_lens=[40, 8], remaining=[2, 1])]


def test_retracted_stalled_request_re_prefills_to_the_retract_length() -> None:
    """r1's first chunk runs out of memory (no KV), its decodes are skipped, it is
    retracted at the scenario's length 12 and re-prefilled to 12: that extend completes
    its prefill, and its prompt for the engines becomes 12 (where it completed)."""
    steps = [
        [sc.Op("extend", 0, 8), sc.Op("extend", 1, 10)],
        [sc.Op("decode", 0, 9), sc.Op("decode", 1, 11)],
        [sc.Op("decode", 0, 10), sc.Op("decode", 1, 12)],
        [sc.Op("retract", 1, 12), sc.Op("extend", 1, 8)],
        [sc.Op("extend", 1, 12)],
        [sc.Op("decode", 1, 13), sc.Op("finish", 0, 10)],
        [sc.Op("finish", 1, 13)],
    ]
    scen = sc.Scenario("t", sc.ScenarioConfig(pool_tokens=4096), tuple(sc.Step(i, tuple(o)) for i, o in enumerate(steps)))
    engine = _OomOnce({0})  # the first extend (r0 and r1 together) fails
    runner.run_scenario(scen, engine, lambda d: None)
    extends = [args for kind, args in engine.calls if kind == "extend"]
    assert [(a["rids"], a["seq_lens"], a["done"], a["prompt_lens"]) for a in extends] == [
        ([0, 1], [8, 10], [True, True], [8, 10]),
        ([1], [8], [False], [12]),
        ([1], [12], [True], [12]),
    ]
    finishes = [args for kind, args in engine.calls if kind == "finish"]
    assert finishes == [dict(rids=[1], owned=[13], prompt_lens=[12], remaining=[0])]


def test_a_scenario_with_a_mamba_pool_runs_our_allocator_with_it() -> None:
    """The scenario header's ``mamba`` (a round trip through JSON) gives our driver's
    allocator the Mamba pool, radix cache off, and a scenario runs through it."""
    factory, base = ours_driver.load_factory("allocator")
    scen = gen.random_scenario(7, gen.RANDOM_CONFIGS["p16-nospec"], "mamba")
    config = sc.ScenarioConfig.from_dict(
        {**scen.config.to_dict(), "radix_cache": False, "mamba": {"slots": 64, "strategy": "no_buffer"}}
    )
    assert config.mamba == sc.MambaSpec(64) and "mamba=64,no_buffer" in config.label()
    engine = ours_driver.OursEngine(config, factory, base)
    assert engine.alloc.config.mamba == base.MambaConfig(slots=64)
    stats = runner.run_scenario(dataclasses.replace(scen, config=config), engine, lambda d: None)
    assert stats.steps == len(scen.steps)
