"""Parity of ``allocator.hiradix.HiRadixCache`` with SGLang 0.5.23's own
``UnifiedRadixCache(FULL)`` with HiCache on (its controller made synchronous, see
``tests/differential/hiradix_driver.py`` and docs/hicache-semantics.md).

Seeded random op lists (``generate``: requests that match, load back their host hit, lock,
take slots and finish by inserting or abort; plain matches; device evictions with and
without targets; host evictions; acks; pools small enough that both tiers fill) at pages
1 and 16, for each write policy. Ours run in this process, SGLang's in ONE subprocess of
``$KVTRACE_SGLANG_PYTHON`` (skipped when it is unset); every state (nodes with both tiers'
slots, locks, hit counts, in-flight marks and access times, the ledgers, the D-leaf and
H-leaf sets, the tracked host duplicates, the in-flight transfers, both free lists) must be
equal after every op. ``KVTRACE_HIRADIX_SEEDS`` sets the seeds per configuration.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import pytest

from tests.differential import harness
from tests.differential.case_driver import run_in_sglang
from tests.differential.hiradix_driver import OursAdapter, apply_op

DRIVER = Path(__file__).resolve().parents[1] / "differential" / "hiradix_driver.py"
NUM_SEEDS = int(os.environ.get("KVTRACE_HIRADIX_SEEDS", "4"))
NUM_OPS = 150
POLICIES = ("write_through", "write_through_selective", "write_back")
CONFIGS = [(ps, policy) for ps in (1, 16) for policy in POLICIES]


def generate(seed: int, ps: int, policy: str, num_ops: int = NUM_OPS) -> tuple[dict, list[dict]]:
    """A random case and our states after each of its ops. Prompts share prefixes drawn
    from a few stems (and repeat, so host hits load back), lengths in whole pages."""
    rng = random.Random(f"hiradix-{seed}-{ps}-{policy}")
    pages = rng.randint(12, 28)
    host_pages = rng.randint(2, 6) if rng.random() < 0.3 else rng.randint(pages // 2, 2 * pages)
    case: dict[str, Any] = {"ps": ps, "pool": pages * ps, "host": host_pages * ps, "policy": policy, "ops": []}
    side = OursAdapter(case)
    reqs: dict[int, dict[str, Any]] = {}
    stems = [[rng.randint(1, 50) for _ in range(6 * ps)] for _ in range(3)]
    seen: list[list[int]] = []
    next_rid = 0
    states: list[dict] = []

    def tokens() -> list[int]:
        if seen and rng.random() < 0.45:  # a repeated prompt, a prefix of one, or one extended
            old = rng.choice(seen)
            r = rng.random()
            if r < 0.4:
                return old
            if r < 0.7:
                return old[: rng.randint(1, len(old) // ps) * ps]
            seen.append(old + [rng.randint(1, 50) for _ in range(rng.randint(1, 3) * ps)])
            return seen[-1]
        stem = rng.choice(stems)
        keep = rng.randint(0, 6) * ps
        extra = rng.randint(0 if keep else 1, 4) * ps
        seen.append(stem[:keep] + [rng.randint(1, 50) for _ in range(extra)])
        return seen[-1]

    for _ in range(num_ops):
        kind = rng.choice(["start", "start", "start", "finish", "finish", "abort", "match", "evict", "evict",
                           "evict_host", "ack", "ack"])
        if kind in ("finish", "abort") and not reqs:
            kind = "start"
        if kind == "start" and len(reqs) >= 3:
            kind = "finish"
        if kind == "start":
            op: dict[str, Any] = {"op": "start", "rid": next_rid, "tokens": tokens()}
            if rng.random() < 0.2:
                op["quota"] = rng.randint(0, 6) * ps
            next_rid += 1
        elif kind in ("finish", "abort"):
            op = {"op": kind, "rid": rng.choice(sorted(reqs))}
        elif kind == "match":
            op = {"op": "match", "tokens": tokens()}
        elif kind == "evict":
            op = {"op": "evict", "n": rng.choice([ps, 3 * ps, 8 * ps]), "targets": rng.random() < 0.5}
        elif kind == "evict_host":
            op = {"op": "evict_host", "n": rng.choice([ps, 4 * ps])}
        else:
            op = {"op": "ack"}
        case["ops"].append(op)
        try:
            result = apply_op(side, reqs, op)
        except Exception as e:  # noqa: BLE001 - recorded like the driver does; parity compares it
            states.append({"error": f"{type(e).__name__}: {e}"})
            break
        st = side.state()
        st["result"] = result
        states.append(st)
    case["stats"] = dict(side.tree.stats)  # what the tree did (read by the coverage test only)
    return case, states


FIELDS = ("result", "nodes", "ledgers", "leaves", "dups", "inflight", "free", "host_free")


def first_divergence(case: dict, ours: list[dict], theirs: list[dict]) -> str | None:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if "error" in a or "error" in b:
            return f"op {i} {case['ops'][i]}: ours {a.get('error', 'ran')}, SGLang {b.get('error', 'ran')}"
        a = json.loads(json.dumps(a))
        for field in FIELDS:
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
    tmp = tmp_path_factory.mktemp("hiradix")
    theirs = run_in_sglang(python, DRIVER, [generated[k][0] for k in CASES], tmp)
    return {key: (generated[key], theirs[i]) for i, key in enumerate(CASES)}


@pytest.mark.slow
@pytest.mark.parametrize(("cfg", "seed"), CASES)
def test_hiradix_identical_to_sglang(sglang_states: dict, cfg: tuple[int, str], seed: int) -> None:
    (case, ours), theirs = sglang_states[(cfg, seed)]
    d = first_divergence(case, ours, theirs)
    assert d is None, d
    assert len(ours) == len(case["ops"])


@pytest.mark.slow
def test_host_pool_size_identical_to_sglang(tmp_path: Path) -> None:
    """``HiCacheConfig.pool_tokens`` (ratio sizing) equals SGLang's ``HostKVCache.size``."""
    from allocator.base import HiCacheConfig

    python = harness.require_sglang()
    pairs = [[d, r, ps] for d in (1, 100, 4096, 123_457) for r in (0.2, 1.0, 2.0, 3.7) for ps in (1, 16, 64)]
    theirs = run_in_sglang(python, DRIVER, pairs, tmp_path, "--sizes", timeout=300)
    ours = [HiCacheConfig(host_ratio=r, page_size=ps).pool_tokens(d) for d, r, ps in pairs]
    assert ours == theirs


def test_generated_ops_reach_every_tier_path() -> None:
    """The generator exercises what the parity test claims (ours only: fast): backups,
    demotions, host evictions, load-backs (and refused ones), out-of-memory starts, splits
    of nodes with a write in flight, and per policy what only it does (deletion of
    unbacked leaves; write_back's reclaim and its subtree drop when the host is full)."""
    totals: dict[str, dict[str, int]] = {}
    for ps, policy in CONFIGS:
        t = totals.setdefault(policy, {})
        for seed in range(NUM_SEEDS):
            case, states = generate(seed, ps, policy)
            assert all("error" not in s for s in states), states[-1]
            for k, v in case["stats"].items():
                t[k] = t.get(k, 0) + v
            t["oom"] = t.get("oom", 0) + sum(s.get("result") == "oom" for s in states)
    for policy, t in totals.items():
        for k in ("backed_up", "demoted", "host_evicted", "loaded_back", "load_back_refused", "oom"):
            assert t.get(k, 0) > 0, (policy, k, t)
    assert totals["write_through"]["deleted_unbacked"] > 0, totals
    assert totals["write_through_selective"]["deleted_unbacked"] > 0, totals
    assert totals["write_back"]["host_reclaimed"] > 0, totals
    assert totals["write_back"]["dropped_no_host"] > 0, totals
    assert totals["write_through"]["split_in_flight"] > 0, totals
