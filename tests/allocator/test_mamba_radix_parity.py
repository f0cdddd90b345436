"""Parity of ``allocator.mamba_radix.MambaRadixCache`` with SGLang 0.5.23's own
``UnifiedRadixCache(FULL, MAMBA)``.

Seeded random op lists (``generate``: requests that match with copy-on-write, lock, take
slots, checkpoint at a chunk boundary and finish by inserting or abort; plain matches;
evictions with and without targets; pools small enough that both run out) at pages 1, 16 and 64 (no_buffer at page
1, extra_buffer above, as SGLang requires), with and without a states-per-path cap.
Ours run in this process, SGLang's through ``tests/differential/mamba_radix_driver.py``
in ONE subprocess of ``$KVTRACE_SGLANG_PYTHON`` (skipped when it is unset); every state
(nodes, slots, states, locks, access times, ledgers, Mamba LRU, both free lists) must
be equal after every op. ``KVTRACE_MAMBA_RADIX_SEEDS`` sets the seeds per configuration.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import pytest

from allocator.mamba import MambaSlotsExhausted
from tests.differential import harness
from tests.differential.case_driver import run_in_sglang
from tests.differential.mamba_radix_driver import OursAdapter, apply_op

DRIVER = Path(__file__).resolve().parents[1] / "differential" / "mamba_radix_driver.py"
NUM_SEEDS = int(os.environ.get("KVTRACE_MAMBA_RADIX_SEEDS", "4"))
NUM_OPS = 120
# (page size, chunk size, states-per-path cap)
CONFIGS = [(1, 4, -1), (1, 4, 2), (16, 16, -1), (16, 32, 2), (64, 64, -1)]


def generate(seed: int, ps: int, chunk: int, cap: int, num_ops: int = NUM_OPS) -> tuple[dict, list[dict]]:
    """A random case and our states after each of its ops. Prompts share prefixes drawn
    from a few stems, lengths in whole pages."""
    rng = random.Random(f"mamba-radix-{seed}-{ps}-{chunk}-{cap}")
    pages = rng.randint(10, 24)
    case: dict[str, Any] = {"ps": ps, "chunk": chunk, "pool": pages * ps, "mamba": rng.randint(4, 10), "cap": cap,
                            "ops": []}
    side = OursAdapter(case)
    reqs: dict[int, dict[str, Any]] = {}
    stems = [[rng.randint(1, 50) for _ in range(6 * ps)] for _ in range(3)]
    next_rid = 0
    states: list[dict] = []

    seen: list[list[int]] = []

    def tokens() -> list[int]:
        if seen and rng.random() < 0.35:  # a repeated prompt, a prefix of one, or one extended
            old = rng.choice(seen)
            if rng.random() < 0.5:
                return old[: rng.randint(1, len(old) // ps) * ps]
            seen.append(old + [rng.randint(1, 50) for _ in range(rng.randint(1, 3) * ps)])
            return seen[-1]
        stem = rng.choice(stems)
        keep = rng.randint(0, 6) * ps
        extra = rng.randint(0 if keep else 1, 4) * ps
        seen.append(stem[:keep] + [rng.randint(1, 50) for _ in range(extra)])
        return seen[-1]

    for _ in range(num_ops):
        kinds = ["start", "start", "start", "finish", "finish", "abort", "checkpoint", "match", "evict"]
        kind = rng.choice(kinds)
        if kind in ("finish", "abort", "checkpoint") and not reqs:
            kind = "start"
        if kind == "start" and len(reqs) >= 3:
            kind = "finish"
        if kind == "start":
            op: dict[str, Any] = {"op": "start", "rid": next_rid, "tokens": tokens()}
            next_rid += 1
        elif kind in ("finish", "abort", "checkpoint"):
            op = {"op": kind, "rid": rng.choice(sorted(reqs))}
        elif kind == "match":
            op = {"op": "match", "tokens": tokens()}
        else:
            op = {"op": "evict", "full": rng.choice([0, ps, 3 * ps]), "mamba": rng.choice([0, 1, 2]),
                  "targets": rng.random() < 0.5}
        case["ops"].append(op)
        try:
            result = apply_op(side, reqs, op)
        except MambaSlotsExhausted:  # SGLang asserts there: the case ends
            states.append({"error": "exhausted"})
            break
        st = side.state()
        st["result"] = result
        states.append(st)
    case["stats"] = dict(side.tree.stats)  # what the tree did (read by the coverage test only)
    return case, states


def first_divergence(case: dict, ours: list[dict], theirs: list[dict]) -> str | None:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if "error" in a or "error" in b:
            if a.get("error") != b.get("error"):
                return f"op {i} {case['ops'][i]}: ours {a.get('error', 'ran')}, SGLang {b.get('error', 'ran')}"
            continue
        a = json.loads(json.dumps(a))
        for field in ("result", "nodes", "ledgers", "lru", "full_free", "mamba_free"):
            if a[field] != b[field]:
                return f"op {i} {case['ops'][i]}: {field} ours {a[field]} SGLang {b[field]}"
    if len(ours) != len(theirs):
        return f"{len(ours)} states ours, {len(theirs)} SGLang's"
    return None


CASES = [(cfg, seed) for cfg in CONFIGS for seed in range(NUM_SEEDS)]


@pytest.fixture(scope="module")
def sglang_states(tmp_path_factory: pytest.TempPathFactory) -> dict:
    python = harness.require_sglang()
    generated = {key: generate(key[1], *key[0]) for key in CASES}
    tmp = tmp_path_factory.mktemp("mamba_radix")
    theirs = run_in_sglang(python, DRIVER, [generated[k][0] for k in CASES], tmp)
    return {key: (generated[key], theirs[i]) for i, key in enumerate(CASES)}


@pytest.mark.slow
@pytest.mark.parametrize(("cfg", "seed"), CASES)
def test_mamba_radix_identical_to_sglang(sglang_states: dict, cfg: tuple[int, int, int], seed: int) -> None:
    (case, ours), theirs = sglang_states[(cfg, seed)]
    d = first_divergence(case, ours, theirs)
    assert d is None, d
    assert len(ours) == len(case["ops"])


def test_generated_ops_reach_every_tree_path() -> None:
    """The generator exercises what the parity test claims (ours only: fast): copy-on-write
    matches, gated matches, tombstones, leaf deletions by the Mamba walk, out-of-memory
    starts, states already cached at insert, and (with a cap) states capped off a path."""
    totals: dict[str, int] = {}
    for ps, chunk, cap in CONFIGS:
        for seed in range(NUM_SEEDS):
            case, states = generate(seed, ps, chunk, cap)
            for op, st in zip(case["ops"], states):
                r = st.get("result")
                totals["oom"] = totals.get("oom", 0) + (r == "oom")
                totals["exist"] = totals.get("exist", 0) + (op["op"] in ("finish", "checkpoint") and r is True)
                totals["checkpoint"] = totals.get("checkpoint", 0) + (op["op"] == "checkpoint" and r is False)
                totals["ops"] = totals.get("ops", 0) + 1
            for k, v in case["stats"].items():
                totals[k] = totals.get(k, 0) + v
    for k in ("cow", "gated_match", "tombstoned", "mamba_leaf_deleted", "oom", "exist", "checkpoint", "path_capped"):
        assert totals.get(k, 0) > 0, (k, totals)
