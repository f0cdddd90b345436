"""Parity of ``allocator.swa.SWATokenToKVPoolAllocator`` with SGLang 0.5.23's own class.

Seeded random op lists (``generate``: extend / decode allocations, PD-prealloc SWA
tails, out-of-window SWA frees through both free_swa paths, releases split as
``free_kv_row_segments`` does, plain frees, free groups, clears; sizes that run
either pool out of memory) at pages 1, 16 and 64, with and without ``need_sort``; and
the same allocations with ``allocator.swa_window``'s out-of-window frees and
release split against SGLang's ``free_swa_out_of_window_slots`` / ``free_kv_row``.
Ours run in this process, SGLang's through ``swa_pool_driver.py`` in ONE subprocess
of ``$KVTRACE_SGLANG_PYTHON`` (skipped when it is unset); the two states must be
equal after every op. ``KVTRACE_SWA_SEEDS`` sets the seeds per configuration.
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
from tests.differential.swa_pool_driver import OursAdapter, Req, apply_op, cursors

DRIVER = Path(__file__).with_name("swa_pool_driver.py")
NUM_SEEDS = int(os.environ.get("KVTRACE_SWA_SEEDS", "4"))
NUM_OPS = 160
CONFIGS = [(ps, need_sort) for ps in (1, 16, 64) for need_sort in (False, True)]


def _floor(x: int, ps: int) -> int:
    return x // ps * ps


def generate(
    seed: int, page_size: int, need_sort: bool, num_ops: int = NUM_OPS, mode: str = "pool"
) -> tuple[dict, list[dict]]:
    """A random case and our states after each of its ops.

    Ops are chosen from our allocator's state as it runs (which requests exist, how
    long they are); SGLang then replays the same op list on its own. ``mode`` "pool"
    frees SWA with the allocator's own calls; "window" through
    ``free_swa_out_of_window_slots`` and ``release_kv`` on each request's bookkeeping.
    """
    rng = random.Random(seed * 1000 + page_size * 10 + need_sort + (7 if mode == "window" else 0))
    ps = page_size
    full_pages = rng.randint(6, 40)
    swa_pages = rng.randint(3, full_pages + 8)  # either pool can be the short one
    # A remainder below a page: the paged pools floor to whole pages.
    size = full_pages * ps + (rng.randint(0, ps - 1) if ps > 1 else 0)
    size_swa = swa_pages * ps + (rng.randint(0, ps - 1) if ps > 1 else 0)
    case: dict[str, Any] = {"size": size, "size_swa": size_swa, "page_size": ps, "need_sort": need_sort, "ops": []}
    side = OursAdapter(size, size_swa, ps, need_sort)
    reqs: dict[int, Req] = {}
    states: list[dict] = []
    next_rid = 0
    in_group = False

    def tokens() -> int:
        r = rng.random()
        if r < 0.55:
            return rng.randint(1, max(2, ps * 2))
        if r < 0.9:
            return rng.randint(1, max(4, size // 4))
        return rng.randint(size // 2, size + ps)  # runs a pool out

    def growable() -> list[int]:
        # Requests whose last token still has its SWA slot (decode continues from it).
        return [rid for rid, q in reqs.items() if q.row and q.swa_hi < len(q.row)]

    for _ in range(num_ops):
        kinds = ["extend", "extend", "decode", "decode", "window", "window", "release", "free", "group"]
        if ps > 1:
            kinds += ["tail", "tail"]
        if mode == "window":
            kinds = ["extend", "extend", "decode", "decode", "decode", "evict", "evict", "evict", "release_kv", "group"]
        if rng.random() < 0.01:
            kinds = ["clear"]
        kind = rng.choice(kinds)
        op: dict[str, Any] | None = None
        if kind == "extend":
            batch: list[list[int]] = []
            for _ in range(rng.randint(1, 3)):
                pool = [r for r in growable() if r not in {b[0] for b in batch}]
                if pool and rng.random() < 0.5:
                    rid = rng.choice(pool)
                else:
                    rid, next_rid = next_rid, next_rid + 1
                batch.append([rid, tokens()])
            op = {"op": "alloc" if ps == 1 else "alloc_extend", "reqs": batch}
        elif kind == "decode" and growable():
            pool = growable()
            rids = rng.sample(pool, rng.randint(1, len(pool)))
            op = {"op": "alloc", "reqs": [[r, 1] for r in rids]} if ps == 1 else {"op": "alloc_decode", "rids": rids}
        elif kind == "tail":
            n = tokens()
            window = rng.choice([0, 1, ps, 2 * ps, 128, n + 1])
            head = _floor(max(0, n - window), ps)
            if rng.random() < 0.1:
                head = _floor(n, ps)  # an empty tail when n is page-aligned
            op = {"op": "alloc_swa_tail", "rid": next_rid, "n": n, "tail": n - head}
            next_rid += 1
        elif kind == "window":
            cands = []
            for rid, q in reqs.items():
                top = _floor(len(q.row) - 1, ps)  # never the last token's page
                lo = q.swa_hi if q.swa_hi > q.swa_lo else None
                if (lo if lo is not None else 0) < top:
                    cands.append((rid, lo, top))
            if cands:
                rid, lo, top = rng.choice(cands)
                op = {"op": "swa_window", "rid": rid, "segment": rng.random() < 0.6}
                if lo is None:
                    lo = _floor(rng.randint(0, top - 1), ps)
                    op["lo"] = lo
                op["upto"] = rng.choice(range(lo + ps, top + 1, ps))
        elif kind == "release" and reqs:
            op = {"op": "release", "rid": rng.choice(list(reqs))}
        elif kind == "free":
            pool = [rid for rid, q in reqs.items() if q.swa_hi == q.swa_lo]
            if pool:
                op = {"op": "free", "rid": rng.choice(pool)}
        elif kind == "group":
            op = {"op": "group_end" if in_group else "group_begin"}
            in_group = not in_group
        elif kind == "evict" and reqs:
            rid = rng.choice(list(reqs))
            q = reqs[rid]
            n = len(q.row)
            op = {"op": "evict_window", "rid": rid, "pre_len": n - rng.randint(0, min(n, 2))}
            op["window"] = rng.choice([1, ps // 2 + 1, ps, 2 * ps, 8, 40, 128])
            op["sharing"] = rng.random() < 0.7
            op["retain_floor"] = rng.choice([None, None, rng.randint(0, n)])
            op["interval"] = rng.choice([1, 1, 4, 128])
            if q.kv is None:
                op["protected"] = _floor(rng.randint(0, n), ps)
                op["floor"] = rng.choice([0, op["protected"], rng.randint(0, n)])
        elif kind == "release_kv" and reqs:
            rid = rng.choice(list(reqs))
            q = reqs[rid]
            protected = q.kv.cache_protected_len if q.kv is not None else 0
            owned = max(protected, len(q.row) - rng.randint(0, 2 * ps))
            op = {"op": "release_kv", "rid": rid, "owned": owned, "evict_prefix": rng.random() < 0.8}
        elif kind == "clear" and not in_group:
            op = {"op": "clear"}
        if op is None:
            continue
        states.append(_step(side, reqs, op))
        case["ops"].append(op)
    if in_group:
        op = {"op": "group_end"}
        states.append(_step(side, reqs, op))
        case["ops"].append(op)
    return case, states


def _step(side: OursAdapter, reqs: dict[int, Req], op: dict[str, Any]) -> dict[str, Any]:
    result = apply_op(side, reqs, op)
    state = side.state()
    state["result"] = result
    state["cursors"] = cursors(side, reqs)
    return state


def first_divergence(case: dict, ours: list[dict], theirs: list[dict]) -> str | None:
    """Where the two state lists first differ (op index, op, field, both values), or None."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            key = next((k for k in a if a[k] != b.get(k)), "error")
            return f"op {i} {json.dumps(case['ops'][i])}: {key}: ours {str(a.get(key))[:300]} sglang {str(b.get(key))[:300]}"
    if len(ours) != len(theirs):
        return f"{len(ours)} states ours, {len(theirs)} SGLang's"
    return None


CASES = [(mode, ps, ns, seed) for mode in ("pool", "window") for ps, ns in CONFIGS for seed in range(NUM_SEEDS)]


@pytest.fixture(scope="module")
def sglang_states(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int, bool, int], Any]:
    python = harness.require_sglang()
    generated = {key: generate(key[3], key[1], key[2], mode=key[0]) for key in CASES}
    tmp = tmp_path_factory.mktemp("swa")
    theirs = run_in_sglang(python, DRIVER, [generated[k][0] for k in CASES], tmp)
    return {key: (generated[key], theirs[i]) for i, key in enumerate(CASES)}


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "page_size", "need_sort", "seed"), CASES)
def test_swa_pool_identical_to_sglang(
    sglang_states: dict, mode: str, page_size: int, need_sort: bool, seed: int
) -> None:
    (case, ours), theirs = sglang_states[(mode, page_size, need_sort, seed)]
    assert first_divergence(case, ours, theirs) is None, first_divergence(case, ours, theirs)
    assert len(ours) == len(case["ops"]) >= NUM_OPS // 2


def test_generated_ops_reach_every_path() -> None:
    """The generator exercises what the parity test claims: each op kind, both
    free_swa paths, out-of-memory results, at every page size (ours only: fast)."""
    for ps in (1, 16, 64):
        kinds: set[str] = set()
        ooms = 0
        for seed in range(NUM_SEEDS):
            case, states = generate(seed, ps, False)
            for op, st in zip(case["ops"], states):
                kinds.add(op["op"] + (f":{op['segment']}" if op["op"] == "swa_window" else ""))
                ooms += st["result"] is None
        want = {"release", "free", "group_begin", "group_end", "swa_window:True", "swa_window:False"}
        want |= {"alloc"} if ps == 1 else {"alloc_extend", "alloc_decode", "alloc_swa_tail"}
        assert want <= kinds, (ps, want - kinds)
        assert ooms > 0, ps
        # window mode: the cursor moves, both with and without prefix sharing
        moved = {True: 0, False: 0}
        for seed in range(NUM_SEEDS):
            case, states = generate(seed, ps, False, mode="window")
            prev: dict[int, int] = {}
            for op, st in zip(case["ops"], states):
                cur = dict(map(tuple, st["cursors"]))
                if op["op"] == "evict_window" and cur[op["rid"]] > prev.get(op["rid"], 0):
                    moved[op["sharing"]] += 1
                prev = cur
        assert moved[True] and moved[False], (ps, moved)


if __name__ == "__main__":  # python -m tests.differential.test_swa_pool_parity: op counts per configuration
    for mode in ("pool", "window"):
        for ps, ns in CONFIGS:
            runs = [generate(s, ps, ns, mode=mode) for s in range(NUM_SEEDS)]
            n = sum(len(c["ops"]) for c, _ in runs)
            ooms = sum(st["result"] is None for _, sts in runs for st in sts)
            print(f"{mode} page {ps} need_sort {ns}: {n} ops, {ooms} out of memory", file=sys.stderr)
