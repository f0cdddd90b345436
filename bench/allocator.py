"""Time the allocator's allocation functions against SGLang 0.5.23's own, in the same run, on the CPU.

Same pool as SGLang's measurement: 1,000,000 tokens, 512 request rows, row width
32,768. Every call is timed alone (``perf_counter_ns``) and the state is reset
between calls (untimed) so each call does the same work; the table gives the
median and p90 in microseconds over many repetitions, SGLang's median beside it
and the ratio (ours / SGLang). SGLang's figures are measured in this run by
``bench/sglang_allocator.py`` (the same cases on SGLang's own functions) under the
interpreter of an SGLang environment (``--sglang PYTHON``, default
``$KVTRACE_SGLANG_PYTHON``; ``tools/sglang_oracle/setup.sh`` makes one); without one
the SGLang columns stay empty. ``--passes 2`` (default) runs everything twice, ours
and SGLang's passes alternating, and keeps each row's better pass on each side (the
machine may be shared: passes can differ). torch runs on one thread on both sides
(``kvtrace/sglang/world.py``, decision 10: its intra-op threads only wait on each
other on a shared CPU).

Rows (``fn`` = the allocation function itself, as SGLang's figures measure it;
``api`` = the ``KvAllocator`` batched call, which adds request-id lookup, the
radix match for new requests and the commit of accepted tokens):

* ``decode``: ``alloc_for_decode``, B = 1 / 32 / 256 at page 1 / 16 / 64; request
  lengths staggered so a new page is needed once every ``page_size`` requests.
* ``extend``: ``alloc_for_extend`` of 1 x 8,192 and 8 x 1,024 new tokens, each
  request's first half (8,192 / 1,024 tokens) matched in the radix cache.
* ``spec``: ``alloc_for_spec_decode`` for a prepared plan (with the row write;
  SGLang's figure is without it), EAGLE 3/1/4 (reserve 8: 8 new positions per
  request), B = 32 / 256, page 1 / 16; ``prep+fn`` adds the prepare step.
* ``release``: ``release_kv_cache`` with checkpoint of a finished 4,000-token request
  (prompt 3,000 + 1,000 outputs): nothing cached / its first 2,048 tokens already
  cached under other slots (2,048 duplicates freed).
* ``match``: ``RadixCache.match_prefix`` of an 8,000-token key on a warm tree of
  ~430k tokens (60 conversations of 7 growing turns), full hit / 50% hit.

Targets: every row at or below SGLang; decode, extend and spec at most half.

Usage: ``python bench/allocator.py [--passes 2] [--quick] [--sglang PYTHON] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from allocator import AllocatorConfig, SpecConfig, create_allocator  # noqa: E402
from allocator.allocation import (  # noqa: E402
    alloc_for_decode,
    alloc_for_extend,
    alloc_for_spec_decode,
    prepare_spec_decode,
    release_kv_cache,
)
from allocator.radix_cache import RadixCache  # noqa: E402
from allocator.sizing import row_extra_len  # noqa: E402
from allocator.token_to_kv import TokenToKVPoolAllocator  # noqa: E402
from calltimer import time_calls  # noqa: E402  (bench/, beside this script)

POOL_TOKENS = 1_000_000
ROWS = 512
ROW_WIDTH = 32_768
EAGLE = SpecConfig("eagle", 3, 1, 4)

# Rows whose target is half of SGLang's time (the others: at or below).
HALF_TARGET = ("decode", "extend", "spec")


def _config(page_size: int, spec: SpecConfig | None = None) -> AllocatorConfig:
    return AllocatorConfig(
        pool_tokens=POOL_TOKENS,
        page_size=page_size,
        max_running=ROWS,
        max_context_len=ROW_WIDTH - row_extra_len(spec, page_size),
        spec=spec,
    )


def _time(fn: Callable[[], object], reset: Callable[[], None], reps: int) -> list[float]:
    """Microseconds of ``reps`` calls of ``fn``, ``reset`` (untimed) after each."""
    return time_calls(fn, reset, reps, warmup=max(20, reps // 10))


def _a(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


# ---------------------------------------------------------------------------- decode


def bench_decode(page_size: int, bs: int, reps: int) -> tuple[list[float], list[float]]:
    alloc = create_allocator(_config(page_size))
    rids = np.arange(bs, dtype=np.int64)
    lens = 1000 + np.arange(bs, dtype=np.int64) * 7
    alloc.extend(rids, lens, [np.arange(n, dtype=np.int64) + 10**6 * i for i, n in enumerate(lens)],
                 np.zeros(bs, dtype=bool))
    ctx = alloc.ctx
    rows = alloc._held_rows(rids, "bench")
    tok = alloc.token_to_kv_pool_allocator
    kv = alloc.req_kv
    state = (kv.kv_allocated_len.copy(), kv.kv_committed_len.copy(), kv.sum_committed, kv.sum_allocated_ceil)

    free0 = tok.free_pages_np()

    def reset() -> None:
        kv.kv_allocated_len[:] = state[0]
        kv.kv_committed_len[:] = state[1]
        kv.sum_committed, kv.sum_allocated_ceil = state[2], state[3]
        tok._free.replace(free0)

    fn_times = _time(lambda: alloc_for_decode(ctx, rows), reset, reps)
    api_times = _time(lambda: alloc.decode(rids), reset, reps)
    return fn_times, api_times


# ---------------------------------------------------------------------------- extend


def bench_extend(page_size: int, bs: int, new_tokens: int, reps: int) -> tuple[list[float], list[float]]:
    alloc = create_allocator(_config(page_size))
    ctx = alloc.ctx
    tree = alloc.tree_cache
    tok = alloc.token_to_kv_pool_allocator
    kv = alloc.req_kv
    prompts = [np.arange(2 * new_tokens, dtype=np.int64) + 10**7 * (i + 1) for i in range(bs)]
    # Cache each request's first half: prefill it, publish, finish.
    warm = np.arange(bs, dtype=np.int64) + 10_000
    alloc.extend(warm, np.full(bs, new_tokens), [p[:new_tokens] for p in prompts])
    alloc.release(warm, np.full(bs, new_tokens), [p[:new_tokens] for p in prompts], "finish")
    alloc.end_step()
    rids = np.arange(bs, dtype=np.int64)
    seq = np.full(bs, 2 * new_tokens, dtype=np.int64)
    free0 = tok.free_pages_np()
    slots_rows = list(alloc.req_to_token_pool.free_slots)
    sums = (kv.sum_committed, kv.sum_protected, kv.sum_allocated_ceil)
    matched: list = []

    def match_and_lock() -> None:
        matched.clear()
        for p in prompts:
            m = tree.match_prefix(p[:-1])
            tree.lock(m.last_node)
            matched.append(m)

    def reset_fn() -> None:
        for m in matched:
            tree.unlock(m.last_node)
        for row in np.flatnonzero(kv.rid >= 0).tolist():
            kv.kv_allocated_len[row] = kv.kv_committed_len[row] = kv.cache_protected_len[row] = 0
            kv.rid[row] = -1
            kv.lock_node[row] = None
        kv.sum_committed, kv.sum_protected, kv.sum_allocated_ceil = sums
        alloc.req_to_token_pool.free_slots[:] = slots_rows
        tok._free.replace(free0)
        match_and_lock()

    def fn() -> None:
        prefix = _a([m.prefix_len for m in matched])
        slots = [tree.path_device_indices(m.last_node)[: m.prefix_len] for m in matched]
        res = alloc_for_extend(ctx, rids, np.full(bs, -1, dtype=np.int64), prefix, seq, slots,
                               [m.last_node for m in matched])
        assert res.out_cache_loc.shape[0] == bs * new_tokens

    match_and_lock()
    fn_times = _time(fn, reset_fn, reps)
    for m in matched:
        tree.unlock(m.last_node)
    matched.clear()

    def reset_api() -> None:
        alloc.release(rids, seq, None, "retract")
        tok._free.replace(free0)
        alloc.req_to_token_pool.free_slots[:] = slots_rows

    def api() -> None:
        res = alloc.extend(rids, seq, prompts, np.zeros(bs, dtype=bool))
        assert res.num_tokens == bs * new_tokens

    api_times = _time(api, reset_api, reps)
    return fn_times, api_times


# ---------------------------------------------------------------------------- spec


def bench_spec(page_size: int, bs: int, reps: int) -> tuple[list[float], list[float]]:
    alloc = create_allocator(_config(page_size, EAGLE))
    rids = np.arange(bs, dtype=np.int64)
    lens = 1000 + np.arange(bs, dtype=np.int64) * 3
    alloc.extend(rids, lens, [np.arange(n, dtype=np.int64) + 10**6 * i for i, n in enumerate(lens)],
                 np.zeros(bs, dtype=bool))
    ctx = alloc.ctx
    rows = alloc._held_rows(rids, "bench")
    tok = alloc.token_to_kv_pool_allocator
    kv = alloc.req_kv
    state = (kv.kv_allocated_len.copy(), kv.kv_committed_len.copy(), kv.sum_committed, kv.sum_allocated_ceil)
    free0 = tok.free_pages_np()
    accepted = np.full(bs, 2, dtype=np.int64)

    def reset() -> None:
        kv.kv_allocated_len[:] = state[0]
        kv.kv_committed_len[:] = state[1]
        kv.sum_committed, kv.sum_allocated_ceil = state[2], state[3]
        tok._free.replace(free0)

    plan = prepare_spec_decode(ctx, rows)
    assert page_size > 1 or plan.num_needed_tokens == 8 * bs
    fn_times = _time(lambda: alloc_for_spec_decode(ctx, rows, plan), reset, reps)
    prep_times = _time(lambda: alloc_for_spec_decode(ctx, rows, prepare_spec_decode(ctx, rows)), reset, reps)
    api_times = _time(lambda: alloc.spec_decode(rids, accepted), reset, reps)
    return fn_times, api_times, prep_times


# ---------------------------------------------------------------------------- release


def bench_release(page_size: int, duplicates: bool, reps: int) -> tuple[list[float], list[float]]:
    alloc = create_allocator(_config(page_size))
    ctx = alloc.ctx
    tree = alloc.tree_cache
    tok = alloc.token_to_kv_pool_allocator
    kv = alloc.req_kv
    toks = np.arange(4000, dtype=np.int64) + 5 * 10**6
    prompt_len = 3000
    rid = 0

    def setup() -> None:
        tree.evict(10**9)
        if duplicates:
            other = tok.alloc(2048)
            tree.insert(toks[:2048], other)
        res = alloc_for_extend(ctx, _a([rid]), _a([-1]), _a([0]), _a([4000]), [None], [None])
        assert not hasattr(res, "op")

    def fn() -> None:
        out = release_kv_cache(ctx, int(row_of()), 4000, toks, prompt_len, True)
        assert out.cached_tokens == (4000 - 2048 if duplicates else 4000)

    def row_of() -> int:
        return int(np.flatnonzero(kv.rid == rid)[0])

    setup()
    fn_times = _time(fn, setup, reps)
    return fn_times, []


# ---------------------------------------------------------------------------- match


def _warm_tree(page_size: int) -> tuple[RadixCache, np.ndarray]:
    rng = np.random.default_rng(0)
    tree = RadixCache(page_size, TokenToKVPoolAllocator(POOL_TOKENS))
    slot = 1
    probe = None
    system = rng.integers(0, 32_000, 1024)
    for c in range(60):
        toks = np.concatenate([system[: int(rng.integers(0, 1024))], rng.integers(0, 32_000, 8000)])[:8000]
        toks = toks.astype(np.int64)
        for turn in range(1, 8):
            n = 8000 * turn // 7
            tree.insert(toks[:n], np.arange(slot, slot + n, dtype=np.int64))
            slot += n
        if c == 30:
            probe = toks
    return tree, probe


def bench_match(page_size: int, half: bool, reps: int) -> tuple[list[float], list[float]]:
    tree, probe = _warm_tree(page_size)
    key = probe.copy()
    if half:
        key[4000:] = -1
    tree.match_prefix(key)  # the first 50% match splits a node; later ones repeat the same walk
    expected = 4000 if half else 8000
    assert tree.match_prefix(key).prefix_len == expected

    def fn() -> None:
        tree.match_prefix(key)

    return _time(fn, lambda: None, reps), []


# ---------------------------------------------------------------------------- main


def _stats(times: list[float]) -> tuple[float, float]:
    if not times:
        return float("nan"), float("nan")
    arr = np.array(times)
    return float(np.median(arr)), float(np.percentile(arr, 90))


def run_pass(quick: bool) -> dict[tuple[str, int, str, str], tuple[float, float]]:
    fast = 300 if quick else 3000
    slow = 50 if quick else 400
    results: dict[tuple[str, int, str, str], tuple[float, float]] = {}

    def put(kind: str, ps: int, case: str, times: tuple[list[float], ...]) -> None:
        results[(kind, ps, case, "fn")] = _stats(times[0])
        if len(times) > 2:
            results[(kind, ps, case, "prep+fn")] = _stats(times[2])
        if times[1]:
            results[(kind, ps, case, "api")] = _stats(times[1])

    for ps in (1, 16, 64):
        for bs in (1, 32, 256):
            put("decode", ps, f"B={bs}", bench_decode(ps, bs, fast))
    for ps in (1, 16, 64):
        put("extend", ps, "1x8192", bench_extend(ps, 1, 8192, slow))
        put("extend", ps, "8x1024", bench_extend(ps, 8, 1024, slow))
    for ps in (1, 16):
        for bs in (32, 256):
            put("spec", ps, f"B={bs}", bench_spec(ps, bs, fast))
    for ps in (1, 16):
        put("release", ps, "nothing cached", bench_release(ps, False, slow))
        put("release", ps, "2048 duplicates", bench_release(ps, True, slow))
    for ps in (1, 16):
        put("match", ps, "full", bench_match(ps, False, fast))
        put("match", ps, "50%", bench_match(ps, True, fast))
    return results


def sglang_pass(python: str, quick: bool) -> tuple[str, dict[tuple[str, int, str], float]]:
    """One pass of ``bench/sglang_allocator.py`` under ``python``: SGLang's version and
    each row's median (us)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sglang.json"
        cmd = [python, str(Path(__file__).with_name("sglang_allocator.py")), "--json", str(out)]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        done = subprocess.run(cmd + (["--quick"] if quick else []), capture_output=True, text=True, env=env)
        if done.returncode != 0:
            raise SystemExit(f"bench/sglang_allocator.py failed under {python}:\n{done.stderr[-3000:]}")
        data = json.loads(out.read_text())
    rows = {}
    for key, (median, _p90) in data["results"].items():
        kind, ps, case = key.split("|")
        rows[(kind, int(ps), case)] = median
    return data["sglang"], rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=2, help="full passes; each row keeps its best median")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    parser.add_argument("--sglang", default=os.environ.get("KVTRACE_SGLANG_PYTHON"),
                        help="interpreter of an SGLang 0.5.23 environment (default: $KVTRACE_SGLANG_PYTHON)")
    parser.add_argument("--json", type=Path, default=None, help="also write the table as JSON")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)  # as on SGLang's side (world.py, decision 10)
    best: dict[tuple[str, int, str, str], tuple[float, float]] = {}
    theirs: dict[tuple[str, int, str], float] = {}
    version = None
    if not args.sglang:
        print("no SGLang environment (--sglang / $KVTRACE_SGLANG_PYTHON): ours only", file=sys.stderr)
    for p in range(args.passes):
        print(f"pass {p + 1}/{args.passes} ...", file=sys.stderr, flush=True)
        for key, value in run_pass(args.quick).items():
            if key not in best or value[0] < best[key][0]:
                best[key] = value
        if args.sglang:
            version, rows = sglang_pass(args.sglang, args.quick)
            for key, median in rows.items():
                theirs[key] = min(median, theirs.get(key, median))

    print(f"{'call':<9}{'case':<17}{'page':>5}{'':>8}{'median us':>11}{'p90 us':>9}{'SGLang us':>11}"
          f"{'ratio':>7}  target")
    rows_out = []
    failed = 0
    for (kind, ps, case, which), (median, p90) in best.items():
        sglang = theirs.get((kind, ps, case))
        ratio = median / sglang if sglang else None
        limit = 0.5 if kind in HALF_TARGET else 1.0
        if which == "api":
            verdict = "(batched API call, informative)"
        elif which == "prep+fn":
            verdict = "(with the prepare step, informative)"
        elif ratio is None:
            verdict = "(no SGLang figure)"
        else:
            verdict = ("ok" if ratio <= limit else "MISSED") + f" (<= {limit:g}x)"
            failed += ratio > limit
        their_text = f"{sglang:>11.1f}{ratio:>7.2f}" if ratio is not None else f"{'-':>11}{'-':>7}"
        print(f"{kind:<9}{case:<17}{ps:>5}{which:>8}{median:>11.1f}{p90:>9.1f}{their_text}  {verdict}")
        rows_out.append({"call": kind, "case": case, "page_size": ps, "measured": which, "median_us": median,
                         "p90_us": p90, "sglang_us": sglang, "ratio": ratio})
    where = f"SGLang {version} ({args.sglang}) measured in this run" if version else "no SGLang figures"
    print(f"\nbest of {args.passes} pass(es) per row and side; {where}; the machine may be shared with other "
          f"work. {'all targets met' if not failed else f'{failed} target(s) missed'}")
    if args.json:
        args.json.write_text(json.dumps({"sglang": version, "rows": rows_out}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
