"""Parity of ``allocator.mamba.HybridReqToTokenPool`` with SGLang 0.5.23's own classes.

Seeded random op lists (``generate``: admissions of new, copy-on-write and continuing
requests under admission groups, rejections, releases and retractions, finishes whose
state the tree keeps, checkpoint donations and evictions, lazy tracking slots, clears;
pools small enough that rows and slots run out) in each buffer mode SGLang's pool
has: no_buffer, extra_buffer without and with the overlap scheduler, and
extra_buffer_lazy. Ours run in this process, SGLang's through ``mamba_pool_driver.py``
in ONE subprocess of ``$KVTRACE_SGLANG_PYTHON`` (skipped when it is unset); the two
states must be equal after every op. ``KVTRACE_MAMBA_SEEDS`` sets the seeds per mode.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.differential import harness
from tests.differential.case_driver import run_in_sglang
from tests.differential.mamba_pool_driver import Exhausted, OursAdapter, apply_op

DRIVER = Path(__file__).with_name("mamba_pool_driver.py")
NUM_SEEDS = int(os.environ.get("KVTRACE_MAMBA_SEEDS", "6"))
NUM_OPS = 150
MODES = [("no_buffer", False), ("extra_buffer", False), ("extra_buffer", True), ("extra_buffer_lazy", True)]


def generate(seed: int, strategy: str, overlap: bool, num_ops: int = NUM_OPS) -> tuple[dict, list[dict]]:
    """A random case and our states after each of its ops.

    Ops are chosen from our pool's state as it runs (which requests hold what); SGLang
    then replays the same op list on its own. An admission the Mamba pool cannot
    serve ends the case (SGLang asserts there), so it is drawn rarely.
    """
    rng = random.Random(f"{seed}-{strategy}-{overlap}")
    case: dict[str, Any] = {
        "rows": rng.randint(2, 8),
        "mamba_size": rng.randint(2, 24),
        "strategy": strategy,
        "overlap": overlap,
        "ops": [],
    }
    side = OursAdapter(case["rows"], case["mamba_size"], strategy, overlap)
    pool = side.pool
    reqs: dict[int, Any] = {}
    tree: list[int] = []
    extra = strategy != "no_buffer"
    lazy = strategy == "extra_buffer_lazy"
    next_rid = 0
    in_group = False

    def record(op: dict[str, Any]) -> dict[str, Any]:
        case["ops"].append(op)
        result = apply_op(side, reqs, tree, op)
        state = side.state()
        state["result"] = result
        state["reqs"] = {str(rid): side.req_state(q) for rid, q in sorted(reqs.items())}
        state["tree"] = list(tree)
        return state

    states: list[dict] = []
    for _ in range(num_ops):
        with_row = [rid for rid, q in reqs.items() if q.holds_kv]
        no_row = [rid for rid, q in reqs.items() if not q.holds_kv]
        kinds = ["admit", "admit", "admit", "release", "release", "cow", "reject", "group", "finish"]
        if extra:
            kinds += ["donate", "tree_free"]
        if lazy:
            kinds += ["lazy_pre", "lazy_pre", "lazy_post", "lazy_undo"]
        if rng.random() < 0.01 and not in_group:
            kinds = ["clear"]
        kind = rng.choice(kinds)
        op: dict[str, Any] | None = None
        if kind == "admit":
            batch: list[int] = []
            for _ in range(rng.randint(1, 3)):
                r = rng.random()
                cands = [x for x in (no_row if r < 0.4 else with_row) if x not in batch]
                if r < 0.7 and cands:
                    batch.append(rng.choice(cands))
                else:
                    batch.append(next_rid)
                    next_rid += 1
            objs = [reqs[r] if r in reqs else side.new_req(r) for r in batch]
            rows_short = sum(not q.holds_kv for q in objs) > pool.available_size()
            if rows_short or pool._mamba_fits(objs) or rng.random() < 0.05:
                op = {"op": "admit", "rids": batch}
        elif kind == "cow":
            op = {"op": "cow", "rid": next_rid}
            next_rid += 1
        elif kind == "reject" and no_row:
            op = {"op": "reject", "rid": rng.choice(no_row)}
        elif kind == "release" and reqs:
            op = {"op": "release", "rid": rng.choice(list(reqs))}
        elif kind == "finish":
            cands = [
                rid for rid in with_row
                if reqs[rid].holds_mamba and (not extra or not all(reqs[rid].ping_pong_empty))
            ]
            if cands:
                rid = rng.choice(cands)
                keep = None
                if extra:
                    q = reqs[rid]
                    keep = rng.choice([i for i, empty in enumerate(q.ping_pong_empty) if not empty])
                op = {"op": "finish_keep", "rid": rid, "keep": keep}
        elif kind == "donate":
            cands = [
                rid for rid in with_row
                if reqs[rid].ping_pong is not None and not reqs[rid].ping_pong_empty[reqs[rid].last_track_idx]
            ]
            if cands:
                op = {"op": "donate", "rid": rng.choice(cands)}
        elif kind == "tree_free" and tree:
            op = {"op": "tree_free", "i": rng.randrange(len(tree))}
        elif kind in ("lazy_pre", "lazy_post", "lazy_undo"):
            cands = [rid for rid in with_row if reqs[rid].ping_pong is not None]
            if kind == "lazy_undo":
                cands = [rid for rid in cands if not any(reqs[rid].ping_pong_empty)]
            if cands:
                rid = rng.choice(cands)
                op = {"op": kind, "rid": rid}
                if kind == "lazy_post":
                    q = reqs[rid]
                    # the entry the boundary's forward wrote: one holding a slot
                    op["track"] = rng.choice([i for i, empty in enumerate(q.ping_pong_empty) if not empty])
        elif kind == "group":
            if in_group and rng.random() < 0.1:
                op = {"op": "group_begin", "n": rng.randint(0, 6)}  # reopened: SGLang drops the open one
            else:
                op = {"op": "group_end"} if in_group else {"op": "group_begin", "n": rng.randint(0, 6)}
                in_group = not in_group
        elif kind == "clear":
            op = {"op": "clear"}
        if op is None:
            continue
        try:
            states.append(record(op))
        except Exhausted:
            states.append({"error": "exhausted"})  # as run_case records it; the case ends
            return case, states
    if in_group:
        states.append(record({"op": "group_end"}))
    return case, states


def first_divergence(case: dict, ours: list[dict], theirs: list[dict]) -> str | None:
    """Where the two state lists first differ (op index, op, field, both values), or None."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            key = next((k for k in a if a[k] != b.get(k)), "error")
            return f"op {i} {json.dumps(case['ops'][i])}: {key}: ours {str(a.get(key))[:300]} sglang {str(b.get(key))[:300]}"
    if len(ours) != len(theirs):
        return f"{len(ours)} states ours, {len(theirs)} SGLang's"
    return None


CASES = [(strategy, overlap, seed) for strategy, overlap in MODES for seed in range(NUM_SEEDS)]


@pytest.fixture(scope="module")
def sglang_states(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool, int], Any]:
    python = harness.require_sglang()
    generated = {key: generate(key[2], key[0], key[1]) for key in CASES}
    tmp = tmp_path_factory.mktemp("mamba")
    theirs = run_in_sglang(python, DRIVER, [generated[k][0] for k in CASES], tmp)
    return {key: (generated[key], theirs[i]) for i, key in enumerate(CASES)}


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "overlap", "seed"), CASES)
def test_mamba_pool_identical_to_sglang(sglang_states: dict, strategy: str, overlap: bool, seed: int) -> None:
    (case, ours), theirs = sglang_states[(strategy, overlap, seed)]
    assert first_divergence(case, ours, theirs) is None, first_divergence(case, ours, theirs)
    assert len(ours) == len(case["ops"])


def test_generated_ops_reach_every_path() -> None:
    """The generator exercises what the parity test claims, per mode: each op kind,
    rows running out (a None admission), the Mamba pool running out (ours only: fast)."""
    for strategy, overlap in MODES:
        kinds: set[str] = set()
        row_ooms = exhausted = 0
        for seed in range(NUM_SEEDS):
            case, states = generate(seed, strategy, overlap)
            for op, st in zip(case["ops"], states):
                kinds.add(op["op"])
                row_ooms += op["op"] == "admit" and st.get("result", 0) is None
                exhausted += st.get("error") == "exhausted"
        want = {"admit", "release", "cow", "reject", "finish_keep", "group_begin", "group_end"}
        if strategy != "no_buffer":
            want |= {"donate", "tree_free"}
        if strategy == "extra_buffer_lazy":
            want |= {"lazy_pre", "lazy_post", "lazy_undo"}
        assert want <= kinds, (strategy, overlap, want - kinds)
        assert row_ooms > 0, (strategy, overlap)
        assert exhausted > 0, (strategy, overlap)


if __name__ == "__main__":  # python -m tests.differential.test_mamba_pool_parity: op counts per mode
    for strategy, overlap in MODES:
        runs = [generate(s, strategy, overlap) for s in range(NUM_SEEDS)]
        n = sum(len(c["ops"]) for c, _ in runs)
        ends = sum(bool(sts) and "error" in sts[-1] for _, sts in runs)
        print(f"{strategy} overlap={overlap}: {n} ops, {ends} cases end on an error", file=sys.stderr)
