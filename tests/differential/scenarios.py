"""Differential scenarios: hand-written ones (SGLang reference §9 vectors, §6 bug
classes) and a seeded random generator of valid op sequences.

    python -m tests.differential.scenarios OUT.jsonl [--random N] [--seed S]

writes every hand-written scenario (and N random ones per configuration).
Imports only ``scenario`` (stdlib + numpy).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from typing import Iterable

import numpy as np

from kvtrace.sglang import scenario as sc

Op, Step, Scenario, Cfg, Spec = sc.Op, sc.Step, sc.Scenario, sc.ScenarioConfig, sc.SpecSpec

EAGLE_314 = Spec("eagle", 3, 1, 4)
EAGLE_548 = Spec("eagle", 5, 4, 8)
STANDALONE_314 = Spec("standalone", 3, 1, 4)
DFLASH_8 = Spec("dflash", 1, 1, 8)  # SGLang's DFLASH: one step, topk 1, a verify block of 8


def _steps(*ops_per_step: Iterable[Op]) -> tuple[Step, ...]:
    return tuple(Step(i, tuple(ops)) for i, ops in enumerate(ops_per_step))


def _toks(start: int, n: int) -> tuple[int, ...]:
    return tuple(range(start, start + n))


# --------------------------------------------------------------------------- §9 vectors


def v1_token_fifo() -> Scenario:
    """§9.1: page 1, no need_sort: alloc 5 -> 1..5; free [1,2] -> free list ends ...,16,1,2."""
    cfg = Cfg(pool_tokens=16, page_size=1, max_running=4, max_context_len=32, radix_cache=False)
    return Scenario("v9.1-token-fifo", cfg, _steps(
        [Op("extend", 0, 2), Op("extend", 1, 3)],
        [Op("abort", 0, 2)],
        [Op("extend", 2, 2)],
    ), "§9.1 token allocator FIFO reuse")


def v1_token_need_sort() -> Scenario:
    """§9.1: need_sort, size 8: alloc 1..6, free [5,1] -> release [5,1]; alloc 3 merges+sorts -> 1,5,7."""
    cfg = Cfg(pool_tokens=8, page_size=1, max_running=6, max_context_len=16, radix_cache=False, need_sort=True)
    return Scenario("v9.1-token-need-sort", cfg, _steps(
        [Op("extend", 0, 1), Op("extend", 1, 3), Op("extend", 2, 1), Op("extend", 3, 1)],
        [Op("abort", 2, 1), Op("abort", 0, 1)],
        [Op("extend", 4, 3)],
    ), "§9.1 need_sort release list, merge+sort on a short alloc")


def v2_paged_layout(radix: bool) -> Scenario:
    """§9.2: ps=4, 64 tokens: extend r1 0->5 -> 4..8; batch r0 0->6, r1 5->11 ->
    12..17, 9,10,11, 20,21,22; decode to 7 and 12 -> 18, 23; decode to 9 -> 24 (new page)."""
    cfg = Cfg(pool_tokens=64, page_size=4, max_running=4, max_context_len=32, radix_cache=radix)
    return Scenario(f"v9.2-paged-layout-radix-{'on' if radix else 'off'}", cfg, _steps(
        [Op("extend", 1, 5, prompt_len=11)],
        [Op("extend", 0, 6), Op("extend", 1, 11)],
        [Op("decode", 0, 7), Op("decode", 1, 12)],
        [Op("decode", 0, 8)],
        [Op("decode", 0, 9)],
        [Op("finish", 0, 9), Op("finish", 1, 12)],
    ), "§9.2 paged extend parts 1-3, decode page boundaries")


def v3_finish_and_rematch(ps: int) -> Scenario:
    """§9.3: total 128, prompt 10, 3 decodes, finish at 13; prompt + outputs + 2 new re-matches 12 (ps=1: 13)."""
    cfg = Cfg(pool_tokens=128, page_size=ps, max_running=4, max_context_len=64)
    prompt = _toks(100, 10)
    follow = prompt + tuple(sc.unique_token(0, p) for p in range(10, 13)) + (7, 8)
    return Scenario(f"v9.3-finish-rematch-ps{ps}", cfg, _steps(
        [Op("extend", 0, 10, prompt_tokens=prompt)],
        [Op("decode", 0, 11)], [Op("decode", 0, 12)], [Op("decode", 0, 13)],
        [Op("finish", 0, 13)],
        [Op("extend", 1, 15, prompt_tokens=follow)],
        [Op("decode", 1, 16)],
        [Op("finish", 1, 16)],
    ), "§9.3 decode page boundary, finish keeps floor_align(owned), prefix re-match")


def v4_spec_reserve(ps: int, spec: Spec = STANDALONE_314) -> Scenario:
    """§9.4: reserve 8, committed 10: nxt 20, 20, 24 (ps=4); ps=1: 18, 20, 22; finish at 16."""
    cfg = Cfg(pool_tokens=128, page_size=ps, max_running=4, max_context_len=64, spec=spec)
    return Scenario(f"v9.4-spec-reserve-ps{ps}-{spec.algorithm}", cfg, _steps(
        [Op("extend", 0, 10, prompt_tokens=_toks(100, 10))],
        [Op("spec", 0, 12, accepted=2, draft=4)],
        [Op("spec", 0, 14, accepted=2, draft=4)],
        [Op("spec", 0, 16, accepted=2, draft=4)],
        [Op("finish", 0, 16)],
    ), "§9.4 speculative reserve, monotone allocated length, over-allocation freed at finish")


# --------------------------------------------------------------------------- §6 bug classes


def chunked_prefill_p16() -> Scenario:
    """Chunked prefill at page 16 with a second request sharing the prompt mid-way (#6888)."""
    cfg = Cfg(pool_tokens=512, page_size=16, max_running=6, max_context_len=256)
    prompt = _toks(1000, 100)
    twin = prompt[:70] + _toks(5000, 30)
    return Scenario("bug-chunked-prefill-p16", cfg, _steps(
        [Op("extend", 0, 32, prompt_len=100, prompt_tokens=prompt)],
        [Op("extend", 0, 64)],
        [Op("extend", 0, 96), Op("extend", 1, 48, prompt_len=100, prompt_tokens=twin)],
        [Op("extend", 0, 100), Op("extend", 1, 100)],
        [Op("decode", 0, 101), Op("decode", 1, 101)],
        [Op("extend", 2, 90, prompt_tokens=prompt[:90])],
        [Op("finish", 0, 101), Op("decode", 1, 102), Op("decode", 2, 91)],
        [Op("finish", 1, 102), Op("finish", 2, 91)],
    ), "chunk checkpoints leave the partial page in the row; a sharer matches published chunks")


def spec_finish_early_stop(ps: int, spec: Spec) -> Scenario:
    """Spec over-allocation freed at finish, stop landing before the last accepted token (#35694, #13741)."""
    cfg = Cfg(pool_tokens=1024, page_size=ps, max_running=4, max_context_len=200, spec=spec)
    return Scenario(f"bug-spec-finish-early-stop-ps{ps}-{spec.num_steps}{spec.topk}{spec.num_draft_tokens}", cfg, _steps(
        [Op("extend", 0, 21, prompt_tokens=_toks(300, 21)), Op("extend", 1, 37, prompt_tokens=_toks(300, 37))],
        [Op("spec", 0, 24, accepted=3, draft=4), Op("spec", 1, 38, accepted=1, draft=4)],
        [Op("spec", 0, 28, accepted=4, draft=4), Op("spec", 1, 41, accepted=3, draft=4)],
        [Op("finish", 0, 26), Op("spec", 1, 43, accepted=2, draft=4)],
        [Op("spec", 1, 44, accepted=1, draft=4)],
        [Op("finish", 1, 44)],
    ), "finish frees [ceil(owned), allocated); early stop keeps only owned tokens in the tree")


def spec_unaligned_nxt() -> Scenario:
    """Unaligned committed + reserve at ps=16: nxt rounds up to a page (#31616)."""
    cfg = Cfg(pool_tokens=512, page_size=16, max_running=4, max_context_len=128, spec=EAGLE_314)
    ops = [[Op("extend", 0, 13, prompt_tokens=_toks(10, 13)), Op("extend", 1, 30, prompt_tokens=_toks(10, 30))]]
    l0, l1 = 13, 30
    for acc0, acc1 in ((1, 4), (3, 2), (2, 4), (4, 1), (1, 3), (4, 4)):
        l0, l1 = l0 + acc0, l1 + acc1
        ops.append([Op("spec", 0, l0, accepted=acc0, draft=4), Op("spec", 1, l1, accepted=acc1, draft=4)])
    ops.append([Op("abort", 0, l0), Op("finish", 1, l1)])
    return Scenario("bug-spec-unaligned-nxt-p16", cfg, _steps(*ops), "page-aligned nxt, abort and finish of spec requests")


def retract_page16(ps: int = 16) -> Scenario:
    """Retraction at page>1 with an unaligned length and a cached prefix; re-extend from 0 (#4913, #9989)."""
    cfg = Cfg(pool_tokens=256, page_size=ps, max_running=6, max_context_len=160)
    shared = _toks(2000, 40)
    p0 = shared + _toks(3000, 11)
    p1 = shared + _toks(4000, 7)
    p2 = _toks(6000, 45)
    ops = [
        [Op("extend", 0, len(p0), prompt_tokens=p0)],
        [Op("extend", 1, len(p1), prompt_tokens=p1), Op("decode", 0, len(p0) + 1)],
        [Op("extend", 2, len(p2), prompt_tokens=p2), Op("decode", 0, len(p0) + 2), Op("decode", 1, len(p1) + 1)],
        [Op("decode", 0, len(p0) + 3), Op("decode", 1, len(p1) + 2), Op("decode", 2, len(p2) + 1)],
        [Op("retract", 2, len(p2) + 1), Op("retract", 1, len(p1) + 2)],
        [Op("decode", 0, len(p0) + 4)],
        [Op("extend", 1, len(p1) + 2), Op("decode", 0, len(p0) + 5)],
        [Op("extend", 2, len(p2) + 1), Op("decode", 0, len(p0) + 6), Op("decode", 1, len(p1) + 3)],
        [Op("finish", 0, len(p0) + 6), Op("decode", 1, len(p1) + 4), Op("decode", 2, len(p2) + 2)],
        [Op("finish", 1, len(p1) + 4), Op("abort", 2, len(p2) + 2)],
    ]
    return Scenario(f"bug-retract-p{ps}", cfg, _steps(*ops), "retract frees only the uncached tail, evicts remaining*20")


def double_free_patterns(ps: int) -> Scenario:
    """Same prompt twice in one batch (duplicate publish), a finish whose prefix the tree
    already has, and a chunk checkpoint over duplicates (#13801, #28702, #6888)."""
    cfg = Cfg(pool_tokens=512, page_size=ps, max_running=8, max_context_len=160)
    prompt = _toks(7000, 50)
    return Scenario(f"bug-double-free-ps{ps}", cfg, _steps(
        [Op("extend", 0, 50, prompt_tokens=prompt), Op("extend", 1, 50, prompt_tokens=prompt)],
        [Op("decode", 0, 51), Op("decode", 1, 51), Op("extend", 2, 32, prompt_len=60, prompt_tokens=prompt + _toks(8000, 10))],
        [Op("finish", 0, 51), Op("decode", 1, 52), Op("extend", 2, 60)],
        [Op("finish", 1, 52), Op("decode", 2, 61), Op("extend", 3, 55, prompt_tokens=prompt + _toks(9000, 5))],
        [Op("finish", 2, 61), Op("decode", 3, 56)],
        [Op("finish", 3, 56)],
    ), "duplicate KV freed by checkpoint/insert exactly once")


def eviction_small_pool(ps: int) -> Scenario:
    """Prefix sharing under a small pool: LRU eviction of unlocked leaves, split nodes."""
    pool = 128 if ps == 1 else 192
    cfg = Cfg(pool_tokens=pool, page_size=ps, max_running=8, max_context_len=128)
    base = _toks(500, 32)
    ops: list[list[Op]] = []
    rid = 0
    lens: dict[int, int] = {}
    for round_ in range(6):
        step_ops = []
        plen = 40 + 3 * round_
        prompt = base[: 16 + 4 * round_] + _toks(10_000 + 100 * round_, plen - (16 + 4 * round_))
        step_ops.append(Op("extend", rid, plen, prompt_tokens=prompt))
        lens[rid] = plen
        ops.append(step_ops)
        ops.append([Op("decode", rid, plen + 1)])
        ops.append([Op("finish", rid, plen + 1)])
        rid += 1
    # Two concurrent requests that force evicting most of the cache.
    big = _toks(20_000, 70 if ps == 1 else 80)
    ops.append([Op("extend", rid, len(big), prompt_tokens=big), Op("extend", rid + 1, 40, prompt_tokens=base + _toks(30_000, 8))])
    ops.append([Op("decode", rid, len(big) + 1), Op("decode", rid + 1, 41)])
    ops.append([Op("finish", rid, len(big) + 1), Op("finish", rid + 1, 41)])
    return Scenario(f"bug-eviction-small-pool-ps{ps}", cfg, _steps(*ops), "evict_to_free_tokens before each allocation")


def need_sort_paged() -> Scenario:
    """need_sort at ps=16: staged pages merged+sorted only when an upper bound exceeds free pages."""
    cfg = Cfg(pool_tokens=256, page_size=16, max_running=8, max_context_len=128, need_sort=True)
    return Scenario("mode-need-sort-p16", cfg, _steps(
        [Op("extend", 0, 20, prompt_tokens=_toks(1, 20)), Op("extend", 1, 40, prompt_tokens=_toks(100, 40)),
         Op("extend", 2, 33, prompt_tokens=_toks(200, 33))],
        [Op("decode", 0, 21), Op("decode", 1, 41), Op("decode", 2, 34)],
        [Op("finish", 1, 41), Op("abort", 0, 21)],
        [Op("extend", 3, 50, prompt_tokens=_toks(300, 50)), Op("decode", 2, 35)],
        [Op("finish", 2, 35), Op("decode", 3, 51)],
        [Op("extend", 4, 100, prompt_tokens=_toks(400, 100)), Op("decode", 3, 52)],
        [Op("finish", 3, 52), Op("finish", 4, 100)],
    ), "PD free-list mode")


def pd_prealloc(ps: int, radix: bool, spec: Spec | None = None) -> Scenario:
    """PD decode: prealloc (need_sort), decode/spec, finish; with the decode radix cache, prefix reuse."""
    cfg = Cfg(pool_tokens=512, page_size=ps, max_running=6, max_context_len=200, need_sort=True,
              radix_cache=radix, spec=spec)
    shared = _toks(40_000, 48)
    p0 = shared + _toks(41_000, 13)
    p1 = shared + _toks(42_000, 20)
    step_op = (lambda r, n: Op("spec", r, n + 2, accepted=2, draft=4)) if spec else (lambda r, n: Op("decode", r, n + 1))
    inc = 2 if spec else 1
    return Scenario(f"mode-pd-prealloc-ps{ps}-radix-{'on' if radix else 'off'}{'-spec' if spec else ''}", cfg, _steps(
        [Op("prealloc", 0, len(p0), prompt_tokens=p0)],
        [step_op(0, len(p0))],
        [Op("finish", 0, len(p0) + inc), Op("prealloc", 1, len(p1) + 3, prompt_len=len(p1), prompt_tokens=p1)],
        [step_op(1, len(p1) + 3), Op("prealloc", 2, len(p0), prompt_tokens=p0)],
        [step_op(1, len(p1) + 3 + inc), step_op(2, len(p0))],
        [Op("finish", 1, len(p1) + 3 + 2 * inc), Op("finish", 2, len(p0) + inc)],
    ), "alloc_for_decode_prealloc, PD publish of the transferred KV")


def oom_stall(ps: int) -> Scenario:
    """A batch that does not fit is all-or-nothing; its requests stall until they end."""
    cfg = Cfg(pool_tokens=64, page_size=ps, max_running=6, max_context_len=96)
    return Scenario(f"oom-stall-ps{ps}", cfg, _steps(
        [Op("extend", 0, 30, prompt_tokens=_toks(1, 30))],
        [Op("extend", 1, 20, prompt_tokens=_toks(100, 20)), Op("extend", 2, 20, prompt_tokens=_toks(200, 20))],
        [Op("decode", 0, 31), Op("extend", 3, 10, prompt_tokens=_toks(300, 10))],
        [Op("decode", 0, 32), Op("decode", 3, 11), Op("extend", 1, 20)],
        [Op("finish", 0, 32), Op("decode", 3, 12), Op("decode", 1, 21)],
        [Op("extend", 2, 20), Op("decode", 3, 13)],
        [Op("finish", 3, 13), Op("decode", 2, 21)],
        [Op("finish", 1, 21), Op("finish", 2, 21)],
    ), "OOM outcome and --on-oom skip semantics")


def rows_exhausted() -> Scenario:
    """More new requests than free rows: the extend batch fails as a whole."""
    cfg = Cfg(pool_tokens=256, page_size=1, max_running=2, max_context_len=64)
    return Scenario("oom-rows-exhausted", cfg, _steps(
        [Op("extend", 0, 5), Op("extend", 1, 5)],
        [Op("extend", 2, 5), Op("decode", 0, 6)],
        [Op("finish", 0, 6), Op("decode", 1, 6)],
        [Op("extend", 3, 7), Op("finish", 1, 6)],
        [Op("finish", 3, 7)],
    ), "alloc_req_slots exhaustion is an OOM outcome")


def row_overflow_topk() -> Scenario:
    """§10 row overflow: ps=1 EAGLE 5/4/8 reserve 40 > row headroom 12 near the context limit."""
    cfg = Cfg(pool_tokens=1024, page_size=1, max_running=4, max_context_len=64, spec=EAGLE_548)
    return Scenario("expected-row-overflow-ps1-topk4", cfg, _steps(
        [Op("extend", 0, 20, prompt_tokens=_toks(1, 20)), Op("extend", 1, 30, prompt_tokens=_toks(50, 30))],
        [Op("spec", 0, 25, accepted=5, draft=8), Op("spec", 1, 38, accepted=8, draft=8)],
        [Op("spec", 0, 30, accepted=5, draft=8), Op("spec", 1, 44, accepted=6, draft=8)],
        [Op("finish", 0, 30), Op("finish", 1, 44)],
    ), "SGLang writes past the row (bounded only at page>1); kvtrace clips and reports",
        tags=("row_overflow",))


def hand_written() -> list[Scenario]:
    out = [
        v1_token_fifo(), v1_token_need_sort(), v2_paged_layout(False), v2_paged_layout(True),
        v3_finish_and_rematch(4), v3_finish_and_rematch(1), v4_spec_reserve(4), v4_spec_reserve(1),
        v4_spec_reserve(4, EAGLE_314),
        chunked_prefill_p16(), spec_finish_early_stop(16, EAGLE_314), spec_finish_early_stop(1, EAGLE_314),
        spec_finish_early_stop(16, EAGLE_548), spec_unaligned_nxt(), retract_page16(16), retract_page16(1),
        double_free_patterns(1), double_free_patterns(16), eviction_small_pool(1), eviction_small_pool(16),
        need_sort_paged(), pd_prealloc(1, False), pd_prealloc(16, False), pd_prealloc(16, True),
        pd_prealloc(1, True), pd_prealloc(16, True, EAGLE_314), oom_stall(1), oom_stall(16), rows_exhausted(),
        row_overflow_topk(),
    ]
    return out


# --------------------------------------------------------------------------- random


@dataclass
class _Req:
    rid: int
    prompt: tuple[int, ...]
    max_new: int
    length: int = 0  # KV the scenario says it holds
    state: str = "waiting"  # waiting | prefill | prefilled | running | done
    outputs: int = 0
    target: int = 0  # where the current (re-)prefill ends
    last_accepted: int = 0  # tokens the last spec step committed (0: none since the prefill)


@dataclass(frozen=True, slots=True)
class RandomSpec:
    """Shape of a random scenario."""

    page_size: int = 1
    spec: Spec | None = None
    steps: int = 60
    pool_tokens: int | None = None
    max_running: int = 8
    max_context_len: int = 256
    chunk: int = 64
    radix_cache: bool = True
    need_sort: bool = False
    retract_prob: float = 0.06
    abort_prob: float = 0.01
    # PD decode: requests arrive (and come back after a retraction) by ``prealloc``
    # of their whole length instead of chunked ``extend``.
    pd: bool = False
    # A hybrid sliding-window model (radix cache off): the window, the SWA pool as a
    # fraction of the full pool (small enough that the SWA pool runs short too), the
    # eviction interval.
    swa_window: int = 0
    swa_fraction: float = 0.3
    swa_interval: int = 4
    swa_overlap: bool = False  # the overlap scheduler's extend-time rule (lag: the chunk size)
    swa_draft_window: int = 0  # a fused draft's SWA reads, larger than the window: swa_retain_window
    swa_release_prefill: bool = False  # SGLANG_OPT_RELEASE_PREFILL_SWA
    # Prompt lengths (shared families, tails, fresh prompts) times this: large pages
    # need prompts of several pages for a tree to branch, tombstone and split.
    prompt_scale: int = 1


RANDOM_CONFIGS: dict[str, RandomSpec] = {
    "p1-nospec": RandomSpec(page_size=1),
    "p16-nospec": RandomSpec(page_size=16),
    "p1-eagle314": RandomSpec(page_size=1, spec=EAGLE_314),
    "p16-eagle314": RandomSpec(page_size=16, spec=EAGLE_314),
    "p1-eagle548": RandomSpec(page_size=1, spec=EAGLE_548),
    # Reserve 256 at page 16 with topk 4: longer rows so requests have room to run.
    "p16-eagle548": RandomSpec(page_size=16, spec=EAGLE_548, max_context_len=768),
    # PD decode servers (need_sort free lists), with the decode radix cache on.
    "p1-pd": RandomSpec(page_size=1, pd=True, need_sort=True),
    "p16-pd-eagle314": RandomSpec(page_size=16, spec=EAGLE_314, pd=True, need_sort=True),
}

# Hybrid sliding-window models, radix cache off (SWA_RADIX_CONFIGS below has it on):
# window frees in decode, spec and chunked prefill, the release split, the PD SWA tail.
_SWA = dict(radix_cache=False, swa_window=24, max_context_len=384)
SWA_CONFIGS: dict[str, RandomSpec] = {
    "swa-p1-nospec": RandomSpec(page_size=1, **_SWA),
    "swa-p16-nospec": RandomSpec(page_size=16, **_SWA),
    "swa-p64-nospec": RandomSpec(page_size=64, **{**_SWA, "swa_window": 32, "max_context_len": 768}),
    "swa-p64-eagle314": RandomSpec(page_size=64, spec=EAGLE_314, **{**_SWA, "swa_window": 32, "max_context_len": 768}),
    "swa-p1-eagle314": RandomSpec(page_size=1, spec=EAGLE_314, **_SWA),
    "swa-p16-eagle314": RandomSpec(page_size=16, spec=EAGLE_314, **_SWA),
    "swa-p1-pd": RandomSpec(page_size=1, pd=True, need_sort=True, **_SWA),
    "swa-p16-pd": RandomSpec(page_size=16, pd=True, need_sort=True, **_SWA),
    "swa-p64-pd": RandomSpec(page_size=64, pd=True, need_sort=True, **{**_SWA, "swa_window": 32, "max_context_len": 768}),
    # prompts of several pages: most PD fills take an SWA tail past position 0 at page 64
    "swa-p64-pd-long": RandomSpec(page_size=64, pd=True, need_sort=True,
                                  **{**_SWA, "swa_window": 32, "max_context_len": 1536, "prompt_scale": 3, "chunk": 256}),
    "swa-p16-overlap": RandomSpec(page_size=16, swa_overlap=True, chunk=32, **_SWA),
    # DFLASH on an SWA model: its prepare_for_decode reserves two verify blocks
    "swa-p1-dflash": RandomSpec(page_size=1, spec=DFLASH_8, **_SWA),
    "swa-p16-pd-dflash": RandomSpec(page_size=16, spec=DFLASH_8, pd=True, need_sort=True, **_SWA),
    # a draft reading 40 tokens back in the SWA pool: frees keep 40, the PD tail the model's 24
    "swa-p16-pd-draftwin-eagle314": RandomSpec(page_size=16, spec=EAGLE_314, pd=True, need_sort=True,
                                               **{**_SWA, "swa_draft_window": 40}),
    "swa-p1-draftwin-eagle314": RandomSpec(page_size=1, spec=EAGLE_314, **{**_SWA, "swa_draft_window": 40}),
    # an SWA pool as large as the full pool: the full pool runs short first
    "swa-p16-eagle314-wide": RandomSpec(page_size=16, spec=EAGLE_314, **{**_SWA, "swa_fraction": 1.0}),
}

# Hybrid sliding-window models with the radix cache on (SGLang's UnifiedRadixCache(FULL,
# SWA)): shared prefixes longer than the window, so matches are SWA-gated, tombstones
# form, SWA-only leaves are deleted and tombstones recover on insert; small pools, so
# both pools evict often; PD decode too (the radix-aware SWA tail, page 1's FULL-only
# eviction).
_SWA_RADIX = dict(radix_cache=True, swa_window=24, max_context_len=384)
# page 64: prompts of several pages and a window of one and a half pages
_SWA_RADIX_64 = {**_SWA_RADIX, "swa_window": 96, "max_context_len": 1536, "prompt_scale": 4, "chunk": 256}
_SWA_RELEASE = {**_SWA_RADIX, "swa_window": 8, "swa_release_prefill": True}
SWA_RADIX_CONFIGS: dict[str, RandomSpec] = {
    "swa-radix-p1-nospec": RandomSpec(page_size=1, **_SWA_RADIX),
    "swa-radix-p16-nospec": RandomSpec(page_size=16, **_SWA_RADIX),
    "swa-radix-p64-nospec": RandomSpec(page_size=64, **_SWA_RADIX_64),
    "swa-radix-p1-eagle314": RandomSpec(page_size=1, spec=EAGLE_314, **_SWA_RADIX),
    "swa-radix-p16-eagle314": RandomSpec(page_size=16, spec=EAGLE_314, **_SWA_RADIX),
    "swa-radix-p64-eagle314": RandomSpec(page_size=64, spec=EAGLE_314, **_SWA_RADIX_64),
    "swa-radix-p1-pd": RandomSpec(page_size=1, pd=True, need_sort=True, **_SWA_RADIX),
    "swa-radix-p16-pd-eagle314": RandomSpec(page_size=16, pd=True, need_sort=True, spec=EAGLE_314, **_SWA_RADIX),
    "swa-radix-p64-pd": RandomSpec(page_size=64, pd=True, need_sort=True, **_SWA_RADIX_64),
    "swa-radix-p64-dflash": RandomSpec(page_size=64, spec=DFLASH_8, **_SWA_RADIX_64),
    "swa-radix-p16-pd-draftwin": RandomSpec(page_size=16, pd=True, need_sort=True,
                                            **{**_SWA_RADIX, "swa_draft_window": 40}),
    # SGLANG_OPT_RELEASE_PREFILL_SWA: a request 8 decode steps in releases its prefix's SWA lock
    "swa-radix-p1-release": RandomSpec(page_size=1, **_SWA_RELEASE),
    "swa-radix-p16-eagle314-release": RandomSpec(page_size=16, spec=EAGLE_314, **_SWA_RELEASE),
    "swa-radix-p16-pd-release": RandomSpec(page_size=16, pd=True, need_sort=True, **_SWA_RELEASE),
}


def random_scenario(seed: int, rs: RandomSpec, name: str | None = None) -> Scenario:
    """A valid op sequence: shared-prefix requests, chunked prefill, decode or spec,
    finish with early stop, retract + re-extend, abort; the pool is small enough
    that eviction and out-of-memory happen."""
    rng = np.random.default_rng(seed)
    ps = rs.page_size
    reserve = 0
    if rs.spec is not None:
        per = max(rs.spec.num_steps * rs.spec.topk, rs.spec.num_draft_tokens)
        if ps > 1 and rs.spec.topk > 1:
            per = max(((ps - 1) + rs.spec.num_steps + ps - 1) // ps * ps * rs.spec.topk, rs.spec.num_draft_tokens)
        reserve = 2 * per
    pool = rs.pool_tokens or int(rng.integers(6, 12)) * max(ps, 16) * 4 + 8 * reserve
    swa = None
    if rs.swa_window:
        pool = max(pool, rs.max_context_len + 8 * max(ps, 16))
        swa_pool = max(int(pool * rs.swa_fraction) // ps * ps, (rs.swa_window // ps + 2) * ps)
        swa = sc.SwaSpec(window=rs.swa_window, swa_pool_tokens=swa_pool, eviction_interval=rs.swa_interval,
                         overlap_chunked_prefill=rs.chunk if rs.swa_overlap else 0, draft_window=rs.swa_draft_window,
                         release_prefill_swa=rs.swa_release_prefill)
    cfg = Cfg(pool_tokens=pool // ps * ps, page_size=ps, max_running=rs.max_running,
              max_context_len=rs.max_context_len, need_sort=rs.need_sort, radix_cache=rs.radix_cache, spec=rs.spec,
              swa=swa)
    # Keep every request clear of the row end: topk>1 at page 1 overflows the row there.
    limit = rs.max_context_len - max(reserve, 8) - 8
    k = rs.prompt_scale
    families = [tuple(int(x) for x in rng.integers(1, 30_000, size=int(rng.integers(8, 80)) * k)) for _ in range(4)]
    reqs: dict[int, _Req] = {}
    finished_prompts: list[tuple[int, ...]] = []
    next_rid = 0
    steps: list[Step] = []
    seen: set[int] = set()

    def new_prompt() -> tuple[int, ...]:
        kind = rng.random()
        if kind < 0.55:
            fam = families[int(rng.integers(len(families)))]
            keep = int(rng.integers(1, len(fam) + 1))
            tail = tuple(int(x) for x in rng.integers(30_000, 60_000, size=int(rng.integers(1, 40)) * k))
            p = fam[:keep] + tail
        elif kind < 0.75 and finished_prompts:
            prev = finished_prompts[int(rng.integers(len(finished_prompts)))]
            p = prev + tuple(int(x) for x in rng.integers(60_000, 90_000, size=int(rng.integers(1, 20)) * k))
        else:
            p = tuple(int(x) for x in rng.integers(1, 90_000, size=int(rng.integers(2, 100)) * k))
        return p[: max(2, limit - 24)]

    for step_no in range(rs.steps):
        ops: list[Op] = []
        live = [r for r in reqs.values() if r.state in ("prefill", "running")]
        running = [r for r in live if r.state == "running"]
        # finishes
        for r in running:
            if r.outputs >= r.max_new or r.length >= limit:
                owned = r.length
                if rs.spec is not None and rng.random() < 0.5 and r.last_accepted > 1:
                    # A stop lands inside the last verify's accepted tokens (spec commits
                    # past it); never in tokens generated before, e.g. before a retraction.
                    owned = max(len(r.prompt), r.length - int(rng.integers(0, r.last_accepted)))
                ops.append(Op("finish", r.rid, owned))
                r.state = "done"
                finished_prompts.append(r.prompt + tuple(sc.unique_token(r.rid, p) for p in range(len(r.prompt), owned)))
        # aborts
        for r in live:
            if r.state != "done" and rng.random() < rs.abort_prob:
                ops.append(Op("abort", r.rid, r.length))
                r.state = "done"
        # retractions
        running = [r for r in reqs.values() if r.state == "running"]
        if len(running) >= 2 and rng.random() < rs.retract_prob:
            order = sorted(running, key=lambda r: (r.outputs, -len(r.prompt)), reverse=True)
            for r in order[-int(rng.integers(1, min(3, len(running)))):][::-1]:
                ops.append(Op("retract", r.rid, r.length))
                r.state = "waiting"
        # prefill: continuing chunks first, then new or re-admitted requests
        budget = rs.chunk
        nlive = sum(1 for r in reqs.values() if r.state in ("prefill", "running"))
        for r in [r for r in reqs.values() if r.state == "prefill"]:
            end = min(r.target, (r.length + budget) // ps * ps)
            if end <= r.length:
                end = r.target
            ops.append(Op("extend", r.rid, end))
            budget -= end - r.length
            r.length = end
        waiting = [r for r in reqs.values() if r.state == "waiting"]
        if rng.random() < 0.5 or not waiting:
            for _ in range(int(rng.integers(0, 3))):
                p = new_prompt()
                rq = _Req(next_rid, p, int(rng.integers(1, 40)))
                reqs[next_rid] = rq
                waiting.append(rq)
                next_rid += 1
        for r in waiting:
            if budget <= 0 or nlive >= rs.max_running:
                break
            target = len(r.prompt) + r.outputs  # re-admission recomputes outputs too
            first = r.rid not in seen
            seen.add(r.rid)
            r.target = target
            r.last_accepted = 0
            end = target
            if target > budget:
                end = max(ps, budget // ps * ps)
                end = min(end, target)
            extra: dict = {}
            if first:
                extra = {"prompt_len": len(r.prompt), "prompt_tokens": r.prompt}
            if rs.pd:  # the whole KV arrives from the prefill server
                end = target
            ops.append(Op("prealloc" if rs.pd else "extend", r.rid, end, **extra))
            budget -= end
            r.length = end
            r.state = "prefill" if end < target else "prefilled"
            nlive += 1
        # decode / spec of requests already running before this step
        for r in reqs.values():
            if r.state != "running":
                continue
            if rs.spec is None:
                r.length += 1
                r.outputs += 1
                ops.append(Op("decode", r.rid, r.length))
            else:
                acc = int(rng.integers(1, rs.spec.num_draft_tokens + 1))
                r.length += acc
                r.outputs += acc
                r.last_accepted = acc
                ops.append(Op("spec", r.rid, r.length, accepted=acc, draft=rs.spec.num_draft_tokens))
        for r in reqs.values():
            if r.state == "prefilled":
                r.state = "running"
            if r.state == "prefill" and r.length >= r.target:
                r.state = "running"
        steps.append(Step(step_no, tuple(ops)))
    # drain: finish everything still alive
    tail = [Op("finish", r.rid, r.length) for r in reqs.values() if r.state in ("running", "prefill")]
    steps.append(Step(rs.steps, tuple(tail)))
    label = name or f"random-seed{seed}-ps{ps}-{'nospec' if rs.spec is None else f'eagle{rs.spec.num_steps}{rs.spec.topk}{rs.spec.num_draft_tokens}'}"
    return Scenario(label, cfg, tuple(steps), f"random seed {seed}")


def random_scenarios(seeds: Iterable[int], configs: dict[str, RandomSpec] | None = None, steps: int | None = None) -> list[Scenario]:
    out = []
    for key, rs in (configs or RANDOM_CONFIGS).items():
        if steps is not None:
            rs = replace(rs, steps=steps)
        for seed in seeds:
            out.append(random_scenario(seed, rs, f"random-{key}-seed{seed}"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="write differential scenarios as JSON lines")
    ap.add_argument("out")
    ap.add_argument("--random", type=int, default=0, help="random seeds per configuration")
    ap.add_argument("--seed", type=int, default=0, help="first seed")
    ap.add_argument("--steps", type=int, default=None, help="steps per random scenario")
    ap.add_argument("--no-hand", action="store_true", help="random scenarios only")
    args = ap.parse_args(argv)
    scens = [] if args.no_hand else hand_written()
    scens += random_scenarios(range(args.seed, args.seed + args.random), steps=args.steps)
    sc.dump_scenarios(scens, args.out)
    print(f"{len(scens)} scenarios, {sum(s.num_ops() for s in scens)} ops -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
