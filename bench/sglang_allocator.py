"""Time SGLang 0.5.23's own allocation functions, the cases of ``bench/allocator.py``.

Runs INSIDE an SGLang environment (``tools/sglang_oracle/setup.sh``); imports the
standard library, numpy, torch, sglang and ``kvtrace/sglang/world.py`` (SGLang's
objects built the way the driver builds them), never kvtrace::

    $KVTRACE_SGLANG_PYTHON bench/sglang_allocator.py [--quick] [--json out.json]

``bench/allocator.py`` runs it in the same run and prints ours / SGLang per row.
Pool 1,000,000 tokens, 512 request rows, row width 32,768. Each call is timed alone
(``perf_counter_ns``); the state is put back between calls (untimed: the world is
restored from a copy, or the few fields the call changes). Median and p90 in µs.
torch runs on one thread (``world.load_sglang``, decision 10).

* ``decode``: ``alloc_for_decode(batch, 1)``, B = 1 / 32 / 256, lengths 1000 + 7 i;
* ``extend``: ``alloc_for_extend`` of 1 x 8,192 / 8 x 1,024 new tokens, each request's
  first half matched and locked in the radix cache beforehand;
* ``spec``: ``alloc_for_spec_decode`` for a prepared plan (``page_aligned_decode_alloc_lens``;
  the row write, a Triton kernel on a GPU, is left out), EAGLE 3/1/4, B = 32 / 256;
* ``release``: ``release_kv_cache(checkpoint=True)`` of a finished 4,000-token request
  (prompt 3,000): nothing cached / its first 2,048 tokens cached under other slots;
* ``match``: ``RadixCache.match_prefix`` of an 8,000-token key on a tree of ~430k tokens
  (60 conversations of 7 growing turns), full / 50% hit.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from array import array
from pathlib import Path
from typing import Any, Callable

import numpy as np
from calltimer import time_calls  # bench/, beside this script

POOL_TOKENS = 1_000_000
ROWS = 512
ROW_WIDTH = 32_768


def _driver_package() -> Any:
    path = Path(__file__).resolve().parents[1] / "kvtrace" / "sglang" / "driver.py"
    spec = importlib.util.spec_from_file_location("kvtrace_sglang_bench_driver", path)
    assert spec is not None and spec.loader is not None
    driver = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(driver)
    return driver.package()


PKG = _driver_package()
world = importlib.import_module(f"{PKG.__name__}.world")
sc = importlib.import_module(f"{PKG.__name__}.scenario")


def _time(fn: Callable[[], object], reset: Callable[[], None], reps: int) -> list[float]:
    """Microseconds of ``reps`` calls of ``fn``, ``reset`` (untimed) after each."""
    return time_calls(fn, reset, reps, warmup=max(5, reps // 10))


def _engine(page_size: int, spec: bool = False) -> Any:
    spec_spec = sc.SpecSpec("eagle", 3, 1, 4) if spec else None
    config = sc.ScenarioConfig(
        pool_tokens=POOL_TOKENS, page_size=page_size, max_running=ROWS,
        max_context_len=ROW_WIDTH - 16, spec=spec_spec,  # (the row is 16 + 4 + drafts wider: ~32,768)
    )
    eng = world.SGLangEngine(config)
    _ENGINES.append(eng)
    return eng


def _prefill(eng: Any, rids: list[int], lens: list[int], base: int = 10**6) -> None:
    toks = [np.arange(n, dtype=np.int64) + base * (i + 1) for i, n in enumerate(lens)]
    res = eng.extend(rids, lens, toks, [n + 1 for n in lens], [False] * len(rids))
    assert res.outcome == "ok", res


class _Rewind:
    """Put an engine back to the state it had when this was made (any number of times:
    a restored world is the live one, so a fresh copy is taken after each restore)."""

    def __init__(self, eng: Any) -> None:
        self.eng = eng
        self.snap = eng._snapshot()

    def __call__(self) -> None:
        self.eng._restore(self.snap)
        self.snap = self.eng._snapshot()


def _save_lens(eng: Any, rids: list[int]) -> tuple[Any, list[tuple[int, int]]]:
    kvs = [eng.reqs[r].kv for r in rids]
    return eng.alloc.free_pages.clone(), [(kv.kv_allocated_len, kv.kv_committed_len) for kv in kvs]


def _restore_lens(eng: Any, rids: list[int], saved: tuple[Any, list[tuple[int, int]]]) -> None:
    eng.alloc.free_pages = saved[0].clone()
    for r, (a, c) in zip(rids, saved[1]):
        kv = eng.reqs[r].kv
        kv.kv_allocated_len, kv.kv_committed_len = a, c


def bench_decode(ps: int, bs: int, reps: int) -> list[float]:
    torch = world.SG.torch
    eng = _engine(ps)
    rids = list(range(bs))
    _prefill(eng, rids, [1000 + 7 * i for i in range(bs)])
    reqs = [eng.reqs[r] for r in rids]
    saved = _save_lens(eng, rids)

    def batch() -> Any:
        lens = [r.kv.kv_committed_len for r in reqs]
        t = torch.tensor(lens, dtype=torch.int64)
        return eng._batch(reqs, seq_lens=t, seq_lens_cpu=t.clone())

    box = [batch()]

    def reset() -> None:
        _restore_lens(eng, rids, saved)
        box[0] = batch()

    return _time(lambda: world.SG.allocation.alloc_for_decode(box[0], 1), reset, reps)


def bench_extend(ps: int, bs: int, new_tokens: int, reps: int) -> list[float]:
    torch = world.SG.torch
    eng = _engine(ps)
    prompts = [np.arange(2 * new_tokens, dtype=np.int64) + 10**7 * (i + 1) for i in range(bs)]
    warm = [10_000 + i for i in range(bs)]
    assert eng.extend(warm, [new_tokens] * bs, [p[:new_tokens] for p in prompts], [new_tokens] * bs,
                      [True] * bs).outcome == "ok"
    eng.publish()
    eng.release("finish", warm, [new_tokens] * bs, [p[:new_tokens] for p in prompts], [new_tokens] * bs, [0] * bs)
    rids = list(range(bs))
    seq = [2 * new_tokens] * bs
    common = world.SG.common
    for rid, p in zip(rids, prompts):  # match and lock, as the scheduler's admission does
        req = eng._req(rid, 2 * new_tokens)
        eng._set_tokens(req, p, 2 * new_tokens)
        common.match_kv_cache(req, eng.tree, req.full_untruncated_fill_ids, max_prefix_len=2 * new_tokens - 1)
        req.kv.cache_protected_len = req.prefix_len
        req.lock = eng.tree.lock(req.last_node)
        req.extend_end = 2 * new_tokens
    assert all(eng.reqs[r].prefix_len == new_tokens for r in rids)
    rewind = _Rewind(eng)

    def batch() -> Any:
        reqs = [eng.reqs[r] for r in rids]
        prefix = [r.prefix_len for r in reqs]
        ext = [s - p for s, p in zip(seq, prefix)]
        t = torch.tensor(seq, dtype=torch.int64)
        return eng._batch(reqs, prefix_lens=prefix, extend_lens=ext, extend_num_tokens=sum(ext),
                          seq_lens=t, seq_lens_cpu=t.clone())

    box = [batch()]

    def reset() -> None:
        rewind()
        box[0] = batch()

    return _time(lambda: world.SG.allocation.alloc_for_extend(box[0]), reset, reps)


def bench_spec(ps: int, bs: int, reps: int) -> list[float]:
    torch = world.SG.torch
    eng = _engine(ps, spec=True)
    rids = list(range(bs))
    _prefill(eng, rids, [1000 + 3 * i for i in range(bs)])
    reqs = [eng.reqs[r] for r in rids]
    saved = _save_lens(eng, rids)
    cur, nxt, needed = world.SG.page_aligned_decode_alloc_lens(
        reqs, reserve=world.SG.alloc_reserve_per_decode(), page_size=ps)
    cur_t = torch.tensor(list(cur), dtype=torch.int64)
    nxt_t = torch.tensor(list(nxt), dtype=torch.int64)
    rows = torch.tensor([r.kv.req_pool_idx for r in reqs], dtype=torch.int64)
    allocation = world.SG.allocation
    kernel = allocation.assign_req_to_token_pool_func
    allocation.assign_req_to_token_pool_func = lambda *a, **k: None  # the row write is a GPU kernel

    batch = eng._batch(reqs)

    def fn() -> None:
        allocation.alloc_for_spec_decode(
            eng.tree, eng.pool, reqs=reqs, req_pool_indices=rows, cur_kv_lens=cur_t, cur_kv_lens_cpu=cur_t,
            nxt_kv_lens=nxt_t, nxt_kv_lens_cpu=nxt_t, num_needed_tokens=int(needed), batch=batch,
        )

    try:
        return _time(fn, lambda: _restore_lens(eng, rids, saved), reps)
    finally:
        allocation.assign_req_to_token_pool_func = kernel


def bench_release(ps: int, duplicates: bool, reps: int) -> list[float]:
    eng = _engine(ps)
    toks = np.arange(4000, dtype=np.int64) + 5 * 10**6
    if duplicates:  # the first 2,048 tokens cached under other slots
        other = 900
        assert eng.extend([other], [2049], [toks[:2049]], [2049], [True]).outcome == "ok"
        eng.publish()
        eng.release("finish", [other], [2048], [toks[:2048]], [2048], [0])
    assert eng.extend([0], [4000], [toks], [4001], [False]).outcome == "ok"  # no prefix match (chunk 0)
    req = eng.reqs[0]
    eng._set_tokens(req, toks, 3000)
    req.finished_reason = world.SG.schedule_batch.FINISH_LENGTH(length=1000)
    req.finished_len = 1000
    rewind = _Rewind(eng)

    def fn() -> None:
        world.SG.common.release_kv_cache(eng.reqs[0], eng.tree, checkpoint=True)

    return _time(fn, rewind, reps)


def bench_match(ps: int, half: bool, reps: int) -> list[float]:
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    torch = world.SG.torch
    eng = _engine(ps)
    tree = eng.tree
    rng = np.random.default_rng(0)
    slot = 1
    probe = None
    system = rng.integers(0, 32_000, 1024)
    for c in range(60):
        toks = np.concatenate([system[: int(rng.integers(0, 1024))], rng.integers(0, 32_000, 8000)])[:8000]
        for turn in range(1, 8):
            n = 8000 * turn // 7 // ps * ps
            tree.insert(InsertParams(key=RadixKey(array("q", toks[:n].tolist())),
                                     value=torch.arange(slot, slot + n, dtype=torch.int64)))
            slot += n
        if c == 30:
            probe = toks.copy()
    assert probe is not None
    if half:
        probe[4000:] = -1
    key = RadixKey(array("q", probe.tolist()))
    params = MatchPrefixParams(key=key)
    tree.match_prefix(params)  # the first 50% match splits a node
    return _time(lambda: tree.match_prefix(params), lambda: None, reps)


_ENGINES: list[Any] = []


def _closing(fn: Callable[..., list[float]]) -> Callable[..., list[float]]:
    """Close the engines a case made (each installs SGLang's runtime context)."""

    def wrapped(*args: Any) -> list[float]:
        try:
            return fn(*args)
        finally:
            while _ENGINES:
                _ENGINES.pop().close()

    return wrapped


def run(quick: bool) -> dict[str, tuple[float, float]]:
    fast, slow = (200, 40) if quick else (2000, 300)
    out: dict[str, tuple[float, float]] = {}

    bench = {name: _closing(globals()[f"bench_{name}"]) for name in ("decode", "extend", "spec", "release", "match")}

    def put(kind: str, ps: int, case: str, times: list[float]) -> None:
        arr = np.array(times)
        out[f"{kind}|{ps}|{case}"] = (float(np.median(arr)), float(np.percentile(arr, 90)))

    for ps in (1, 16, 64):
        for bs in (1, 32, 256):
            put("decode", ps, f"B={bs}", bench["decode"](ps, bs, fast))
    for ps in (1, 16, 64):
        put("extend", ps, "1x8192", bench["extend"](ps, 1, 8192, slow))
        put("extend", ps, "8x1024", bench["extend"](ps, 8, 1024, slow))
    for ps in (1, 16):
        for bs in (32, 256):
            put("spec", ps, f"B={bs}", bench["spec"](ps, bs, fast))
    for ps in (1, 16):
        put("release", ps, "nothing cached", bench["release"](ps, False, slow))
        put("release", ps, "2048 duplicates", bench["release"](ps, True, slow))
    for ps in (1, 16):
        put("match", ps, "full", bench["match"](ps, False, fast))
        put("match", ps, "50%", bench["match"](ps, True, fast))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--json", type=Path, default=None, help="write {kind|page|case: [median, p90]} here")
    args = parser.parse_args()
    real_stdout = sys.stdout
    sys.stdout = sys.stderr  # SGLang prints
    world.load_sglang()
    results = run(args.quick)
    text = json.dumps({"sglang": world.SG.version, "results": results})
    if args.json:
        args.json.write_text(text)
    else:
        real_stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
