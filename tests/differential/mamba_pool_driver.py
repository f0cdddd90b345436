"""Runs Mamba pool op lists through a hybrid request pool and dumps its state.

One op interpreter (``run_case``) drives either side through an adapter:
``OursAdapter`` (``allocator.mamba``, numpy) or ``SGLangAdapter`` (SGLang 0.5.23's
``HybridReqToTokenPool`` and ``MambaSlotAllocator`` on CPU, with its release and
lazy-tracking functions called as the scheduler calls them). Run by path with
SGLang's interpreter it reads a JSON file of cases and writes the SGLang states::

    $KVTRACE_SGLANG_PYTHON tests/differential/mamba_pool_driver.py CASES.json OUT.json

At module level it imports only the standard library, so the test process imports it too.

A case is ``{"rows", "mamba_size", "strategy", "overlap", "ops"}``. Ops name requests
by ``rid``; each side keeps its own request objects:

* ``group_begin {"n"}`` / ``group_end``: the scheduler's admission group.
* ``cow {"rid"}``: a new request takes its state slot before admission (the radix
  match's copy-on-write; result None when the pool is empty).
* ``reject {"rid"}``: the adder turned it down: its pre-admission slot goes back.
* ``admit {"rids"}``: ``HybridReqToTokenPool.alloc`` of new requests and of ones
  holding a row (continuing chunks).
* ``release {"rid"}``: a retraction (or a finish with no tree insert): the Mamba
  component's cleanup, then the row.
* ``finish_keep {"rid", "keep"}``: a finish whose state the tree took: no_buffer the
  request's slot, extra buffer its tracking entry ``keep`` (the slot joins ``tree``).
* ``donate {"rid"}``: an unfinished checkpoint: a fresh slot replaces the latest
  tracked one, which joins ``tree`` (result None when the pool is empty).
* ``tree_free {"i"}``: the tree evicts its ``i``-th checkpoint slot.
* ``lazy_pre`` / ``lazy_undo {"rid"}``, ``lazy_post {"rid", "track"}``: lazy tracking.
* ``clear``: the pool reset (requests and tree forgotten).

The state after each op: the op's result, the free list, the open group, free
rows, each request's row / slot / tracking entries, both mappings at held rows
and the tree's slots; ``{"error"}`` ends a case (``"exhausted"``: a short Mamba pool
at admission, which SGLang asserts on).
"""

from __future__ import annotations

import sys
from typing import Any


class Exhausted(Exception):
    """A short Mamba pool at admission."""


class OursAdapter:
    """kvtrace's ``allocator.mamba.HybridReqToTokenPool``."""

    def __init__(self, rows: int, mamba_size: int, strategy: str, overlap: bool) -> None:
        from allocator.base import MambaConfig
        from allocator.mamba import HybridReqToTokenPool

        self.pool = HybridReqToTokenPool(rows, 8, MambaConfig(mamba_size, strategy, overlap))  # type: ignore[arg-type]

    def new_req(self, rid: int) -> Any:
        from allocator.mamba import MambaReqKv

        return MambaReqKv(rid)

    def admit(self, reqs: list[Any]) -> list[int] | None:
        from allocator.mamba import MambaSlotsExhausted

        try:
            return self.pool.alloc_reqs(reqs)
        except MambaSlotsExhausted as e:
            raise Exhausted(str(e)) from e

    def cow(self, req: Any) -> int | None:
        return req.mamba_pool_idx if self.pool.alloc_state_slot(req) else None

    def reject(self, req: Any) -> None:
        self.pool.free_state_slot(req)

    def release(self, req: Any) -> None:
        self.pool.release(req)

    def finish_keep(self, req: Any, keep: int | None) -> int:
        return self.pool.release_checkpointed(req, keep)

    def donate(self, req: Any) -> int | None:
        new = self.pool.mamba_allocator.alloc(1)
        if new is None:
            return None
        return self.pool.donate_mamba_ping_pong_slot(req, int(new[0]))

    def tree_free(self, slot: int) -> None:
        import numpy as np

        self.pool.mamba_allocator.free(np.asarray([slot], dtype=np.int64))

    def lazy_pre(self, req: Any) -> None:
        self.pool.lazy_prealloc_at_boundary(req)

    def lazy_post(self, req: Any, track: int) -> None:
        self.pool.lazy_post_decode_at_boundary(req, track)

    def lazy_undo(self, req: Any) -> None:
        self.pool.lazy_undo_prealloc_at_boundary(req)

    def group_begin(self, n: int) -> None:
        self.pool.mamba_allocator.alloc_group_begin(n)

    def group_end(self) -> None:
        self.pool.mamba_allocator.alloc_group_end()

    def clear(self) -> None:
        self.pool.clear()

    def state(self) -> dict[str, Any]:
        p = self.pool
        return {
            "free": p.mamba_allocator.free_slots.tolist(),
            "group": p.mamba_allocator.group_remaining(),
            "group_open": p.mamba_allocator.is_group_open(),
            "rows_free": list(p.free_slots),
        }

    def req_state(self, req: Any) -> list[Any]:
        p = self.pool
        row = req.req_pool_idx
        pp_map = p.req_index_to_mamba_ping_pong_track_buffer_mapping
        return [
            row,
            req.mamba_pool_idx,
            None if req.ping_pong is None else req.ping_pong.tolist(),
            None if req.ping_pong_empty is None else list(req.ping_pong_empty),  # a copy: the list changes later
            req.next_track_idx,
            req.last_track_idx,
            None if row is None else int(p.req_index_to_mamba_index_mapping[row]),
            None if row is None or pp_map is None else pp_map[row].tolist(),
        ]


class SGLangAdapter:
    """SGLang 0.5.23's ``HybridReqToTokenPool`` on CPU (tiny Mamba2 state shapes).

    Releases go through ``MambaComponent.cleanup_after_caching_req`` and lazy tracking
    through ``ScheduleBatch`` / ``SchedulerBatchResultProcessor``'s own functions, each bound to
    a stand-in holding just the fields they read.
    """

    def __init__(self, rows: int, mamba_size: int, strategy: str, overlap: bool) -> None:
        import torch
        from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
        from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

        self.torch = torch
        shape = Mamba2StateShape.create(
            tp_world_size=1, intermediate_size=8, n_groups=1, num_heads=2, head_dim=4, state_size=4, conv_kernel=2
        )
        params = Mamba2CacheParams(
            shape=shape, layers=[0], dtype=Mamba2StateDType(conv=torch.float32, temporal=torch.float32)
        )
        self.pool = HybridReqToTokenPool(
            size=rows,
            mamba_size=mamba_size,
            mamba_spec_state_size=mamba_size,
            max_context_len=8,
            device="cpu",
            enable_memory_saver=False,
            cache_params=params,
            mamba_layer_ids=[0],
            enable_mamba_extra_buffer=strategy != "no_buffer",
            enable_mamba_extra_buffer_lazy=strategy == "extra_buffer_lazy",
            enable_overlap_schedule=overlap,
        )
        self.extra_buffer = strategy != "no_buffer"

    def new_req(self, rid: int) -> Any:
        from types import SimpleNamespace

        from sglang.srt.managers.schedule_batch import ReqKvInfo

        return SimpleNamespace(rid=rid, kv=ReqKvInfo(), decode_batch_idx=0)

    def admit(self, reqs: list[Any]) -> list[int] | None:
        try:
            rows = self.pool.alloc(reqs)
        except AssertionError as e:
            if "Not enough space for mamba" in str(e):
                raise Exhausted(str(e)) from e
            raise
        if rows is not None:
            for req in reqs:
                req.kv.kv_allocated_len = max(req.kv.kv_allocated_len, 1)  # a held row carries KV
        return None if rows is None else [int(r) for r in rows]

    def cow(self, req: Any) -> int | None:
        dst = self.pool.mamba_allocator.alloc(1)
        if dst is None:
            return None
        req.kv.mamba_pool_idx = dst[0]
        return int(dst[0])

    def reject(self, req: Any) -> None:
        # scheduler.get_new_batch_prefill's revert of a request the adder turned down
        if req.kv.holds_mamba:
            self.pool.mamba_allocator.free(req.kv.mamba_pool_idx.unsqueeze(-1))
            req.kv.mamba_pool_idx = None

    def _component(self) -> Any:
        from types import SimpleNamespace

        from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent

        comp = SimpleNamespace(
            cache=SimpleNamespace(req_to_token_pool=self.pool, enable_mamba_extra_buffer=self.extra_buffer),
            int8_ckpt_pool=None,
        )
        comp._free_mamba_value = lambda v: self.pool.mamba_allocator.free(v)
        return comp, MambaComponent

    def _release(self, req: Any, insert_result: Any = None, insert_params: Any = None) -> None:
        if not req.kv.holds_kv:
            # common.release_kv_cache on a request that never got a row
            if req.kv.holds_mamba:
                self.pool.mamba_allocator.free(req.kv.mamba_pool_idx.unsqueeze(-1))
                req.kv.mamba_pool_idx = None
            return
        comp, cls = self._component()
        cls.cleanup_after_caching_req(comp, req, True, insert_result, insert_params)
        self.pool.free(req)
        req.kv.kv_allocated_len = 0

    def release(self, req: Any) -> None:
        self._release(req)

    def finish_keep(self, req: Any, keep: int | None) -> int:
        from types import SimpleNamespace

        if self.extra_buffer:
            donated = int(req.kv.mamba_ping_pong_track_buffer[keep])
        else:
            donated = int(req.kv.mamba_pool_idx)
        self._release(
            req,
            SimpleNamespace(mamba_exist=False),
            SimpleNamespace(mamba_keep_idx=keep, mamba_value=None),
        )
        return donated

    def donate(self, req: Any) -> int | None:
        new = self.pool.mamba_allocator.alloc(1)
        if new is None:
            return None
        return int(self.pool.donate_mamba_ping_pong_slot(req, new)[0])

    def tree_free(self, slot: int) -> None:
        self.pool.mamba_allocator.free(self.torch.tensor([slot], dtype=self.torch.int64))

    def lazy_pre(self, req: Any) -> None:
        from types import SimpleNamespace

        from sglang.srt.managers.schedule_batch import ScheduleBatch

        # One request at a track boundary (seq_len a multiple of the interval).
        batch = SimpleNamespace(reqs=[req], seq_lens_cpu=self.torch.tensor([4]), req_to_token_pool=self.pool)
        ScheduleBatch.mamba_lazy_prealloc_at_boundary(batch, 4)

    def lazy_post(self, req: Any, track: int) -> None:
        from types import SimpleNamespace

        from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor

        fn = SchedulerBatchResultProcessor.mamba_lazy_post_decode_at_boundary
        fn(None, req, SimpleNamespace(req_to_token_pool=self.pool), track)

    def lazy_undo(self, req: Any) -> None:
        from types import SimpleNamespace

        from sglang.srt.managers.schedule_batch import ScheduleBatch

        batch = SimpleNamespace(reqs=[req], mamba_track_mask_cpu=[True], req_to_token_pool=self.pool)
        ScheduleBatch.mamba_lazy_undo_prealloc_at_boundary(batch)

    def group_begin(self, n: int) -> None:
        self.pool.mamba_allocator.alloc_group_begin(n)

    def group_end(self) -> None:
        self.pool.mamba_allocator.alloc_group_end()

    def clear(self) -> None:
        self.pool.clear()

    def state(self) -> dict[str, Any]:
        a = self.pool.mamba_allocator
        group: list[int] = []
        if a._alloc_iter is not None:
            rest = list(a._alloc_iter)
            a._alloc_iter = iter(rest)  # put back what we peeked
            group = [int(t[0]) for t in rest]
        return {
            "free": a.free_slots.tolist(),
            "group": group,
            "group_open": a._alloc_iter is not None,
            "rows_free": [int(r) for r in self.pool.free_slots],
        }

    def req_state(self, req: Any) -> list[Any]:
        kv = req.kv
        row = kv.req_pool_idx
        pp = kv.mamba_ping_pong_track_buffer
        pp_map = getattr(self.pool, "req_index_to_mamba_ping_pong_track_buffer_mapping", None)
        return [
            None if row is None else int(row),
            None if kv.mamba_pool_idx is None else int(kv.mamba_pool_idx),
            None if pp is None else [int(x) for x in pp.tolist()],
            None if kv.mamba_ping_pong_empty is None else list(kv.mamba_ping_pong_empty),
            kv.mamba_next_track_idx,
            kv.mamba_last_track_idx,
            None if row is None else int(self.pool.req_index_to_mamba_index_mapping[row]),
            None if row is None or pp_map is None else [int(x) for x in pp_map[row].tolist()],
        ]


def apply_op(side: Any, reqs: dict[int, Any], tree: list[int], op: dict[str, Any]) -> Any:
    """Run one op on ``side``; its result (JSON-able)."""
    kind = op["op"]
    if kind == "group_begin":
        side.group_begin(op["n"])
        return None
    if kind == "group_end":
        side.group_end()
        return None
    if kind == "clear":
        side.clear()
        reqs.clear()
        tree.clear()
        return None
    if kind == "tree_free":
        side.tree_free(tree.pop(op["i"]))
        return None
    if kind == "admit":
        batch = []
        for rid in op["rids"]:
            if rid not in reqs:
                reqs[rid] = side.new_req(rid)
            batch.append(reqs[rid])
        return side.admit(batch)
    rid = op["rid"]
    if kind == "cow":
        reqs[rid] = side.new_req(rid)
        return side.cow(reqs[rid])
    req = reqs[rid]
    if kind == "reject":
        side.reject(reqs.pop(rid))
        return None
    if kind == "release":
        side.release(reqs.pop(rid))
        return None
    if kind == "finish_keep":
        slot = side.finish_keep(reqs.pop(rid), op["keep"])
        tree.append(slot)
        return slot
    if kind == "donate":
        slot = side.donate(req)
        if slot is not None:
            tree.append(slot)
        return slot
    if kind == "lazy_pre":
        side.lazy_pre(req)
        return None
    if kind == "lazy_post":
        side.lazy_post(req, op["track"])
        return None
    if kind == "lazy_undo":
        side.lazy_undo(req)
        return None
    raise ValueError(f"unknown op {kind!r}")


def run_case(adapter_cls: type, case: dict[str, Any]) -> list[dict[str, Any]]:
    """Every op of one case through a fresh pool; the state after each op."""
    side = adapter_cls(case["rows"], case["mamba_size"], case["strategy"], case["overlap"])
    reqs: dict[int, Any] = {}
    tree: list[int] = []
    states = []
    for op in case["ops"]:
        try:
            result = apply_op(side, reqs, tree, op)
        except Exhausted:
            states.append({"error": "exhausted"})
            break
        except Exception as e:  # noqa: BLE001 - a divergence (e.g. a request the other side lacks)
            states.append({"error": f"{type(e).__name__}: {e}"})
            break
        state = side.state()
        state["result"] = result
        state["reqs"] = {str(rid): side.req_state(q) for rid, q in sorted(reqs.items())}
        state["tree"] = list(tree)
        states.append(state)
    return states


def main(argv: list[str]) -> int:
    from case_driver import sglang_main  # beside this file, on sys.path[0] when run by path

    return sglang_main(argv, lambda cases: [run_case(SGLangAdapter, case) for case in cases])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
