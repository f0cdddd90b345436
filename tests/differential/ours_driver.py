"""Run differential scenarios through kvtrace's allocator (``allocator.create_allocator``).

Runs in kvtrace's own environment and writes the same JSON-lines dump as
``kvtrace/sglang/driver.py`` (``scenario.STATE_FIELDS`` per step), from our state: the
batched ``Allocator`` protocol (``extend``, ``decode``, ``spec_decode``,
``prealloc``, ``release``, ``request_lens``, ``holds_kv``, ``row_slots``) plus the
SGLang-named attributes of the built-in allocator (``req_to_token_pool``,
``token_to_kv_pool_allocator``, ``tree_cache``).

    python -m tests.differential.ours_driver SCENARIOS.jsonl [-o OUT.jsonl] [--allocator MODULE]

``--allocator`` names the module whose ``create_allocator(AllocatorConfig)`` is
used (default ``allocator``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from typing import Any, Callable, Sequence, TextIO

import numpy as np

from kvtrace.sglang import runner, scenario as sc


def _to_np(values: Any) -> np.ndarray:
    if values is None:
        return np.zeros(0, np.int64)
    if hasattr(values, "detach"):  # torch tensor
        return values.detach().cpu().numpy().astype(np.int64, copy=False)
    if isinstance(values, (list, tuple)) and values and not np.isscalar(values[0]):
        parts = [_to_np(v) for v in values]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return np.asarray(values, dtype=np.int64).reshape(-1)


class OursEngine:
    """One scenario's kvtrace allocator behind the ``scenario.Engine`` contract."""

    def __init__(self, config: sc.ScenarioConfig, factory: Callable[[Any], Any], base: Any) -> None:
        spec = None
        if config.spec is not None:
            spec = base.SpecConfig(
                algorithm=config.spec.algorithm, num_steps=config.spec.num_steps,
                topk=config.spec.topk, num_draft_tokens=config.spec.num_draft_tokens,
            )
        self.base = base
        self.config = config
        extra = {}
        if config.swa is not None:
            extra["swa"] = base.SwaConfig(
                window=config.swa.window, swa_pool_tokens=config.swa.swa_pool_tokens,
                eviction_interval=config.swa.eviction_interval,
                overlap_chunked_prefill=config.swa.overlap_chunked_prefill,
                **({"draft_window": config.swa.draft_window} if config.swa.draft_window else {}),
                **({"release_prefill_swa": True} if config.swa.release_prefill_swa else {}),
            )
        if config.mamba is not None:
            extra["mamba"] = base.MambaConfig(slots=config.mamba.slots, strategy=config.mamba.strategy)  # type: ignore[arg-type]
        self.alloc = factory(base.AllocatorConfig(
            pool_tokens=config.pool_tokens, page_size=config.page_size, max_running=config.max_running,
            max_context_len=config.max_context_len, device="cpu", need_sort=config.need_sort, spec=spec,
            radix_cache=config.radix_cache, extra_rows=config.extra_rows, **extra,
        ))

    # -- outcomes -----------------------------------------------------------------
    def _result(self, res: Any) -> sc.CallResult:
        if isinstance(res, self.base.OutOfMemory):
            return sc.CallResult("oom", f"needed {res.needed}, available {res.available}, evictable {res.evictable}")
        overflow = tuple((int(r), int(a), int(w)) for r, a, w in getattr(res, "row_overflow", ()) or ())
        return sc.CallResult("ok", "", overflow)

    # -- ops ------------------------------------------------------------------------
    def extend(self, rids, seq_lens, token_ids, prompt_lens, prefill_done) -> sc.CallResult:
        return self._result(self.alloc.extend(
            np.asarray(rids, np.int64), np.asarray(seq_lens, np.int64), list(token_ids),
            np.asarray(prefill_done, np.bool_),
        ))

    def decode(self, rids) -> sc.CallResult:
        return self._result(self.alloc.decode(np.asarray(rids, np.int64)))

    def spec(self, rids, accepted) -> sc.CallResult:
        return self._result(self.alloc.spec_decode(np.asarray(rids, np.int64), np.asarray(accepted, np.int64)))

    def prealloc(self, rids, fill_lens, token_ids, prompt_lens) -> sc.CallResult:
        return self._result(self.alloc.prealloc(np.asarray(rids, np.int64), np.asarray(fill_lens, np.int64), list(token_ids)))

    def release(self, kind, rids, owned_lens, token_ids, prompt_lens, remaining) -> sc.CallResult:
        self.alloc.release(np.asarray(rids, np.int64), np.asarray(owned_lens, np.int64), list(token_ids), kind)
        return sc.CallResult("ok")

    # -- state ------------------------------------------------------------------------
    def _row_of(self, rid: int) -> int:
        alloc = self.alloc
        for name in ("row_of", "req_pool_idx", "req_pool_index"):
            fn = getattr(alloc, name, None)
            if callable(fn):
                return int(fn(rid))
        reqs = getattr(alloc, "reqs", None)
        if reqs is not None and rid in reqs:
            kv = reqs[rid]
            kv = getattr(kv, "kv", kv)
            return int(kv.req_pool_idx)
        raise RuntimeError("the allocator exposes no row index per request (req_pool_idx(rid) or reqs[rid].req_pool_idx)")

    def _req_entry_no_flush(self, rid: int) -> list[Any]:
        """One request's dump entry read from the white-box attributes: the protocol's
        reads apply the deferred publish, which a mid-step dump must not do."""
        alloc = self.alloc
        row = self._row_of(rid)
        kv = alloc.req_kv
        n = int(kv.kv_allocated_len[row])
        slots = np.asarray(alloc.req_to_token_pool.req_to_token[row, :n]).astype(np.int64)
        return [rid, row, n, int(kv.kv_committed_len[row]), int(kv.cache_protected_len[row]), sc.rle(slots)]

    def dump(self, rids: Sequence[int], final: bool = True) -> dict[str, Any]:
        alloc = self.alloc
        arr = np.asarray(list(rids), np.int64)
        reqs = []
        if final:
            end_step = getattr(alloc, "end_step", None)
            if callable(end_step):  # apply the step's deferred prompt publish before reading attributes
                end_step()
            if arr.size:
                lens = alloc.request_lens(arr)
                for i, rid in enumerate(arr.tolist()):
                    reqs.append([rid, self._row_of(rid), int(lens.allocated[i]), int(lens.committed[i]),
                                 int(lens.protected[i]), sc.rle(_to_np(alloc.row_slots(rid)))])
        else:
            reqs = [self._req_entry_no_flush(rid) for rid in arr.tolist()]
        kv = alloc.token_to_kv_pool_allocator
        swa = kv if self.config.swa is not None else None
        if swa is not None:
            kv = swa.full_attn_allocator
        if self.config.page_size == 1:
            release = _to_np(getattr(kv, "release_pages", None))
        else:
            release = _to_np(list(getattr(kv, "staged_pages", []) or []))
        tree = alloc.tree_cache
        pool = alloc.req_to_token_pool
        out = {
            "reqs": reqs,
            "free_pages": sc.rle(_to_np(kv.free_pages)),
            "release_pages": sc.rle(release),
            "available": int((swa or kv).available_size()),
            "evictable": int(tree.evictable_size()) if tree is not None else 0,
            "protected": int(tree.protected_size()) if tree is not None else 0,
            "free_rows": sc.rle(list(pool.free_slots)),
            "tree": _tree_shape(tree),
        }
        if swa is not None:
            rows = alloc.req_kv
            swa_reqs = []
            for entry in reqs:
                rid, row = entry[0], entry[1]
                slots = sc.unrle(entry[5])
                swa_reqs.append([rid, int(rows.swa_evicted_seqlen[row]),
                                 sc.rle(swa.full_to_swa_index_mapping[slots])])
            out.update(swa_free_pages=sc.rle(_to_np(swa.swa_attn_allocator.free_pages)),
                       swa_available=int(swa.swa_available_size()), swa_reqs=swa_reqs)
            if tree is not None and self.config.radix_cache:
                out.update(swa_evictable=int(tree.swa_evictable_size()),
                           swa_protected=int(tree.swa_protected_size()), swa_tree=_swa_tree_sides(tree))
        return out


def _tree_shape(tree: Any) -> list[list[int]] | None:
    """``scenario.tree_shape`` of the built-in ``RadixCache`` (None for a tree without
    its node API, e.g. another ``--allocator``)."""
    root = getattr(tree, "root_node", None)
    if root is None:
        return None
    out = []
    stack = [(child, -1) for child in root.children.values()]
    while stack:
        node, parent = stack.pop()
        first = int(node.value[0])
        out.append((first, parent, int(node.value.shape[0]), int(node.lock_ref), node.last_access_time))
        stack.extend((child, first) for child in node.children.values())
    return sc.tree_shape(out)


def _swa_tree_sides(tree: Any) -> list[list[Any]]:
    """``scenario.swa_tree_sides`` of the built-in ``SwaRadixCache``."""
    rows = []
    stack = list(tree.root_node.children.values())
    while stack:
        node = stack.pop()
        swa = node.swa_value
        rows.append((int(node.value[0]), None if swa is None else np.asarray(swa).tolist(), int(node.swa_lock_ref)))
        stack.extend(node.children.values())
    return sc.swa_tree_sides(rows)


def load_factory(module: str) -> tuple[Callable[[Any], Any], Any]:
    """``module`` (default ``allocator``) -> (create_allocator, allocator.base)."""
    mod = importlib.import_module(module)
    factory = getattr(mod, "create_allocator", None)
    if factory is None:
        raise RuntimeError(f"module {module!r} has no create_allocator")
    base = importlib.import_module("allocator.base")
    return factory, base


def run_scenarios(
    scenarios: Sequence[sc.Scenario], out: TextIO, module: str = "allocator", fine: bool = False,
) -> int:
    """Run every scenario, writing dumps to ``out``; returns the number that crashed."""
    factory, base = load_factory(module)
    failures = 0
    for scen in scenarios:
        t0 = time.perf_counter()
        try:
            eng = OursEngine(scen.config, factory, base)
            out.write(json.dumps({"scenario": scen.name, "engine": f"kvtrace/{module}",
                                  "config": scen.config.to_dict()}) + "\n")
            stats = runner.run_scenario(scen, eng, lambda d: out.write(json.dumps(d) + "\n"), fine=fine)
            out.write(json.dumps({"end": scen.name, "steps": stats.steps, "ops": stats.ops,
                                  "wall_s": round(time.perf_counter() - t0, 4)}) + "\n")
        except Exception as exc:
            failures += 1
            out.write(json.dumps({"end": scen.name, "error": f"{type(exc).__name__}: {exc}",
                                  "traceback": traceback.format_exc(limit=8)}) + "\n")
        out.flush()
    return failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="run differential scenarios through kvtrace's allocator")
    ap.add_argument("scenarios")
    ap.add_argument("-o", "--out")
    ap.add_argument("--allocator", default="allocator", help="module exposing create_allocator")
    ap.add_argument("--fine", action="store_true", help="also dump after every batched call")
    args = ap.parse_args(argv)
    scens = sc.load_scenarios(args.scenarios)
    if args.out:
        with open(args.out, "w") as f:
            failures = run_scenarios(scens, f, args.allocator, args.fine)
    else:
        failures = run_scenarios(scens, sys.stdout, args.allocator, args.fine)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
