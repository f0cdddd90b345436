"""A kvtrace trace (``.kvtrace``) as a differential scenario.

Reads with ``traces.reader.TraceReader`` and materialises token content with
``traces.tokens.TokenStore``; every op carries the explicit ids of the positions
it appends (so the scenario is self-contained and both drivers see exactly the
trace's content), and a request's first op carries its prompt length.

    python -m tests.differential.trace_adapter TRACE.kvtrace OUT.jsonl [--max-steps N]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from kvtrace.sglang import scenario as sc
from traces.metadata import TraceMeta
from traces.reader import TraceReader
from traces.schema import OPS
from traces.tokens import TokenStore


def config_of(meta: TraceMeta, *, radix_cache: bool = True) -> sc.ScenarioConfig:
    """The scenario configuration of a trace (PD decode traces use need_sort, as SGLang does)."""
    cfg = meta.config
    if cfg.hisparse:
        raise sc.ScenarioError("HiSparse traces are not driven by the SGLang side (no HiSparse pools on CPU)")
    spec = None
    if cfg.spec is not None:
        spec = sc.SpecSpec(cfg.spec.algorithm, cfg.spec.num_steps, cfg.spec.topk, cfg.spec.num_draft_tokens)
    return sc.ScenarioConfig(
        pool_tokens=cfg.pool_tokens, page_size=cfg.page_size, max_running=cfg.max_running,
        max_context_len=cfg.max_context_len, need_sort=cfg.pd_decode, radix_cache=radix_cache, spec=spec,
    )


def trace_to_scenario(
    path: str, *, name: str | None = None, max_steps: int | None = None, radix_cache: bool = True,
) -> sc.Scenario:
    """Convert a trace; ``max_steps`` keeps only the first N steps (requests still
    running then are left unreleased)."""
    reader = TraceReader(path)
    store = TokenStore(reader.meta.block_size)
    steps: list[sc.Step] = []
    for batch in reader.steps():
        if max_steps is not None and len(steps) >= max_steps:
            break
        store.ingest(batch)
        ops: list[sc.Op] = []
        ended: list[int] = []
        for i in range(len(batch)):
            kind = OPS[int(batch.op[i])]
            rid = int(batch.rid[i])
            seq_len = int(batch.seq_len[i])
            prompt_len = int(batch.prompt_len[i])
            extra: dict = {}
            if prompt_len >= 0:
                extra["prompt_len"] = prompt_len
            if kind in ("extend", "decode", "spec", "prealloc"):
                start = seq_len - int(batch.append_len[i])
                extra["tokens"] = tuple(np.asarray(store.ids(rid, seq_len)[start:seq_len]).tolist())
            if kind == "spec":
                extra["accepted"] = int(batch.accepted_len[i])
                extra["draft"] = int(batch.draft_len[i])
            if kind in ("finish", "abort"):
                ended.append(rid)
            ops.append(sc.Op(kind, rid, seq_len, **extra))
        if ended:
            store.drop(ended)
        steps.append(sc.Step(int(batch.step), tuple(ops)))
    label = name or os.path.splitext(os.path.basename(path))[0]
    return sc.Scenario(label, config_of(reader.meta, radix_cache=radix_cache), tuple(steps), f"trace {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="convert a .kvtrace trace to a differential scenario")
    ap.add_argument("trace")
    ap.add_argument("out")
    ap.add_argument("--max-steps", type=int)
    args = ap.parse_args(argv)
    scen = trace_to_scenario(args.trace, max_steps=args.max_steps)
    sc.dump_scenarios([scen], args.out)
    print(f"{scen.name}: {len(scen.steps)} steps, {scen.num_ops()} ops -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
