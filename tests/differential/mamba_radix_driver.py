"""Runs op lists through a radix tree with a Mamba component and dumps its state.

One op interpreter (``run_case``) drives either side through an adapter: ``OursAdapter``
(``allocator.mamba_radix.MambaRadixCache`` on our pools) or ``SGLangAdapter`` (SGLang
0.5.23's ``UnifiedRadixCache`` with ``tree_components=(FULL, MAMBA)``, its Python tree
core, a ``HybridReqToTokenPool`` and a token / paged KV allocator, all on CPU). Run by
path with SGLang's interpreter it reads a JSON file of cases and writes SGLang's states::

    $KVTRACE_SGLANG_PYTHON tests/differential/mamba_radix_driver.py CASES.json OUT.json

At module level it imports only the standard library, so the test process imports it too.

A case is ``{"ps", "chunk", "pool", "mamba", "cap", "ops"}`` (page size, the model's Mamba
chunk size, full pool tokens, Mamba slots, states-per-path cap). Ops (requests by ``rid``):

* ``start {"rid", "tokens"}``: match with copy-on-write of the matched state, lock the
  match end, take full slots for the rest of the key (evicting the shortfall first) and a
  state slot unless the COW gave one (evicting one checkpoint first); result
  ``[prefix_len, branching_seqlen, cow_src, own_slot]`` or ``"oom"`` (all given back).
* ``checkpoint {"rid"}``: a chunk boundary: insert the key with a copy of the state in a
  fresh slot (no_buffer's copy; the slot is freed when the tree had a state there), then
  move the request's lock to the inserted node; its slots are all the tree's now.
* ``finish {"rid"}``: insert the key with the request's slots and state, free the state
  when the tree already had one there, unlock.
* ``abort {"rid"}``: unlock, free the request's own full slots and its state.
* ``match {"tokens"}``: a plain match (no request): splits and refreshes.
* ``evict {"full", "mamba", "targets"}``: ``evict_for_alloc`` (targets) or ``evict``.

The state after each op: the op's result, every node (by its path key: full slots,
state slot, both lock counts, access time since the case began), both ledgers, the
Mamba LRU order, both free lists.
"""

from __future__ import annotations

import sys
from typing import Any

# The message both sides give when a copy-on-write finds no Mamba slot even after evicting.
EXHAUSTED = "Can not alloc mamba cache"


class OursAdapter:
    """kvtrace's ``MambaRadixCache``."""

    def __init__(self, case: dict[str, Any]) -> None:
        from allocator.mamba import MambaSlotAllocator
        from allocator.mamba_radix import MambaRadixCache
        from allocator.token_to_kv import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

        ps = case["ps"]
        self.alloc = TokenToKVPoolAllocator(case["pool"]) if ps == 1 else PagedTokenToKVPoolAllocator(case["pool"], ps)
        self.mamba = MambaSlotAllocator(case["mamba"])
        self.tree = MambaRadixCache(ps, self.alloc, self.mamba, chunk_size=case["chunk"], extra_buffer=ps > 1,
                                    max_states_per_path=case["cap"])
        self.t0 = 0.0  # the clock starts at 0 (the root took ticks 0 and 1)

    def new_req(self, rid: int) -> Any:
        from allocator.mamba import MambaReqKv

        return MambaReqKv(rid)

    def match(self, tokens: list[int], req: Any) -> tuple[int, Any, int | None]:
        import numpy as np

        m = self.tree.match_prefix_mamba(np.asarray(tokens, dtype=np.int64))
        if req is not None:
            self.tree.cow_state(m.last_node, req)
        return m.prefix_len, m.last_node, m.branching_seqlen

    def node_value(self, node: Any) -> list[int]:
        return self.tree.path_device_indices(node).tolist()

    def lock(self, node: Any) -> Any:
        self.tree.inc_lock_ref(node)
        return node

    def unlock(self, node: Any, receipt: Any) -> None:
        self.tree.dec_lock_ref(node)

    def full_available(self) -> int:
        return self.alloc.available_size()

    def mamba_available(self) -> int:
        return self.mamba.available_size()

    def alloc_full(self, n: int) -> list[int] | None:
        r = self.alloc.alloc(n)
        return None if r is None else r.tolist()

    def alloc_state(self) -> int | None:
        r = self.mamba.alloc(1)
        return None if r is None else int(r[0])

    def free_full(self, slots: list[int]) -> None:
        import numpy as np

        if slots:
            self.alloc.free(np.asarray(slots, dtype=np.int32))

    def free_state(self, slot: int) -> None:
        import numpy as np

        self.mamba.free(np.asarray([slot], dtype=np.int64))

    def evict(self, full: int, mamba: int, targets: bool) -> None:
        self.tree.evict_pools(full, mamba, targets=targets)

    def insert(self, tokens: list[int], value: list[int], state: int, prev: int) -> bool:
        import numpy as np

        r = self.tree.insert_mamba(np.asarray(tokens, dtype=np.int64), np.asarray(value, dtype=np.int32), state, prev)
        return r.mamba_exist, r.last_node

    def cow_src(self, req: Any) -> int | None:
        return req.mamba_cow_src

    def own_state(self, req: Any) -> int | None:
        return req.mamba_pool_idx

    def set_own_state(self, req: Any, slot: int | None) -> None:
        req.mamba_pool_idx = slot

    def state(self) -> dict[str, Any]:
        t = self.tree
        nodes = []
        stack = [(t.root_node, ())]
        while stack:
            x, path = stack.pop()
            for c in x.children.values():
                stack.append((c, path + tuple(c.key_units().tolist())))
            nodes.append([list(path), x.value.tolist(), x.mamba_value, x.lock_ref, x.mamba_lock_ref,
                          round(x.last_access_time - self.t0, 6)])
        nodes.sort()
        return {
            "nodes": nodes,
            "ledgers": [t.evictable_size_, t.protected_size_, t.mamba_evictable_size_, t.mamba_protected_size_],
            "lru": [[len(t.path_key(n)), n.mamba_value] for n in t.mamba_lru],
            "full_free": self.alloc.free_pages_np().tolist(),
            "mamba_free": self.mamba.free_slots.tolist(),
        }


class SGLangAdapter:
    """SGLang 0.5.23's ``UnifiedRadixCache(FULL, MAMBA)`` on CPU (tiny Mamba2 state shapes).

    The model's Mamba chunk size (read from its HF config by SGLang) is the case's
    ``chunk``: the Mamba component's two module-level lookups of it are replaced."""

    def __init__(self, case: dict[str, Any]) -> None:
        import math

        import torch
        from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
        from sglang.srt.mem_cache.unified_cache.components import base as comp_base
        from sglang.srt.mem_cache.unified_cache.components import mamba as comp_mamba
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.runtime_context import get_context, get_exec

        self.torch = torch
        self.CT = ComponentType
        ps, chunk = case["ps"], case["chunk"]
        self._ctx = get_context().override_server_args(attention_backend="torch_native", device="cpu", page_size=ps)
        self._ctx.install()
        object.__setattr__(get_exec().mamba, "mamba_max_states_per_path", case["cap"])
        comp_mamba.mamba_cache_chunk_size = lambda: max(chunk, ps)
        comp_mamba.mamba_checkpoint_grid = lambda page: math.lcm(max(chunk, ps), page)
        shape = Mamba2StateShape.create(
            tp_world_size=1, intermediate_size=8, n_groups=1, num_heads=2, head_dim=4, state_size=4, conv_kernel=2
        )
        params = Mamba2CacheParams(
            shape=shape, layers=[0], dtype=Mamba2StateDType(conv=torch.float32, temporal=torch.float32)
        )
        self.pool = HybridReqToTokenPool(
            size=4, mamba_size=case["mamba"], mamba_spec_state_size=case["mamba"], max_context_len=8, device="cpu",
            enable_memory_saver=False, cache_params=params, mamba_layer_ids=[0],
            enable_mamba_extra_buffer=ps > 1, enable_mamba_extra_buffer_lazy=False, enable_overlap_schedule=False,
        )
        if ps == 1:
            self.alloc = TokenToKVPoolAllocator(case["pool"], torch.int64, "cpu", None, False)
        else:
            self.alloc = PagedTokenToKVPoolAllocator(case["pool"], ps, torch.int64, "cpu", None, False)
        p = CacheInitParams(disable=False, req_to_token_pool=self.pool, token_to_kv_pool_allocator=self.alloc,
                            page_size=ps, is_eagle=False, enable_mamba_extra_buffer=ps > 1)
        p.tree_components = (ComponentType.FULL, ComponentType.MAMBA)
        self.tree = UnifiedRadixCache(p)
        self.core = self.tree.tree_core
        # The clock as ours starts it: the root took ticks 0 (access) and 1 (creation).
        comp_base._LAST_ACCESS_TIME_COUNTER_FLOAT = 2.0
        self.core.root_node.last_access_time = 0.0
        self.t0 = 0.0
        assert self.tree.tree_core.components_by_type[ComponentType.MAMBA].mamba_max_states_per_path == case["cap"]

    def new_req(self, rid: int) -> Any:
        from types import SimpleNamespace

        from sglang.srt.managers.schedule_batch import ReqKvInfo

        return SimpleNamespace(rid=rid, kv=ReqKvInfo(), session=None)

    def _key(self, tokens: list[int]) -> Any:
        from sglang.srt.mem_cache.radix_cache import RadixKey

        return RadixKey(tokens)

    def match(self, tokens: list[int], req: Any) -> tuple[int, Any, int | None]:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        r = self.tree.match_prefix(MatchPrefixParams(key=self._key(tokens), req=req, cow_mamba=req is not None))
        node = self.core.node_by_id(r.best_match_node)
        return r.device_prefix_len, node, r.mamba_branching_seqlen

    def node_value(self, node: Any) -> list[int]:
        out: list[int] = []
        root = self.core.root_node
        while node is not root:
            out = node.component_data[self.CT.FULL].value.tolist() + out
            node = node.parent
        return out

    def lock(self, node: Any) -> Any:
        return self.tree.inc_lock_ref(node.id)

    def unlock(self, node: Any, receipt: Any) -> None:
        self.tree.dec_lock_ref(node.id, receipt.to_dec_params())

    def full_available(self) -> int:
        return int(self.alloc.available_size())

    def mamba_available(self) -> int:
        return int(self.pool.mamba_allocator.available_size())

    def alloc_full(self, n: int) -> list[int] | None:
        r = self.alloc.alloc(n)
        return None if r is None else r.tolist()

    def alloc_state(self) -> int | None:
        r = self.pool.mamba_allocator.alloc(1)
        return None if r is None else int(r[0])

    def free_full(self, slots: list[int]) -> None:
        if slots:
            self.alloc.free(self.torch.tensor(slots, dtype=self.torch.int64))

    def free_state(self, slot: int) -> None:
        self.pool.mamba_allocator.free(self.torch.tensor([slot], dtype=self.torch.int64))

    def evict(self, full: int, mamba: int, targets: bool) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        params = EvictParams(num_tokens=full, mamba_num=mamba)
        if targets:
            self.tree.evict_for_alloc(params)
        else:
            self.tree.evict(params)

    def insert(self, tokens: list[int], value: list[int], state: int, prev: int) -> bool:
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        t = self.torch
        r = self.tree.insert(InsertParams(key=self._key(tokens), value=t.tensor(value, dtype=t.int64),
                                          mamba_value=t.tensor([state], dtype=t.int64), prev_prefix_len=prev))
        return bool(r.mamba_exist), self.core.node_by_id(r.last_device_node)

    def cow_src(self, req: Any) -> int | None:
        s = req.kv.mamba_cow_src_index
        return None if s is None else int(s)

    def own_state(self, req: Any) -> int | None:
        s = req.kv.mamba_pool_idx
        return None if s is None else int(s)

    def set_own_state(self, req: Any, slot: int | None) -> None:
        req.kv.mamba_pool_idx = None if slot is None else self.torch.tensor(slot, dtype=self.torch.int64)

    def _path(self, node: Any) -> list[int]:
        out: list[int] = []
        root = self.core.root_node
        while node is not root:
            out = list(node.key.token_ids) + out
            node = node.parent
        return out

    def state(self) -> dict[str, Any]:
        CT = self.CT
        core = self.core
        nodes = []
        stack = [core.root_node]
        while stack:
            x = stack.pop()
            stack.extend(x.children.values())
            f, m = x.component_data[CT.FULL], x.component_data[CT.MAMBA]
            nodes.append([self._path(x), [] if f.value is None else [int(v) for v in f.value],
                          None if m.value is None else int(m.value.view(-1)[0]), f.lock_ref, m.lock_ref,
                          round(x.last_access_time - self.t0, 6)])
        nodes[0][3:5] = [1, 0]  # the root's locks as ours keeps them (never taken or released)
        nodes.sort()
        lru = core.lru_lists[CT.MAMBA]
        order = []
        pt = lru._pt
        x = lru.head.lru_next[pt]
        while x is not lru.tail:
            order.append([len(self._path(x)), int(x.component_data[CT.MAMBA].value.view(-1)[0])])
            x = x.lru_next[pt]
        return {
            "nodes": nodes,
            "ledgers": [core.component_evictable_size_[CT.FULL], core.component_protected_size_[CT.FULL],
                        core.component_evictable_size_[CT.MAMBA], core.component_protected_size_[CT.MAMBA]],
            "lru": order,
            "full_free": self.alloc.free_pages.tolist(),
            "mamba_free": self.pool.mamba_allocator.free_slots.tolist(),
        }


def apply_op(side: Any, reqs: dict[int, dict[str, Any]], op: dict[str, Any]) -> Any:
    """Apply one op to ``side``; ``reqs`` maps rid -> {req, tokens, prefix, node, receipt, own}."""
    kind = op["op"]
    if kind == "start":
        req = side.new_req(op["rid"])
        tokens = op["tokens"]
        prefix, node, branching = side.match(tokens, req)
        receipt = side.lock(node)
        need = len(tokens) - prefix
        own: list[int] | None = []
        if need > 0:
            if side.full_available() < need:
                side.evict(need - side.full_available(), 0, True)
            own = side.alloc_full(need)
        state = side.own_state(req)
        if own is not None and state is None:
            if side.mamba_available() < 1:
                side.evict(0, 1, True)
            state = side.alloc_state()
            side.set_own_state(req, state)
        if own is None or state is None:
            side.unlock(node, receipt)
            if own:
                side.free_full(own)
            if state is not None:
                side.free_state(state)
            return "oom"
        reqs[op["rid"]] = {"req": req, "tokens": tokens, "prefix": prefix, "node": node, "receipt": receipt,
                           "own": own, "value": side.node_value(node) + own}
        return [prefix, branching, side.cow_src(req), state]
    if kind == "checkpoint":
        r = reqs[op["rid"]]
        slot = side.alloc_state()
        if slot is None:
            side.evict(0, 1, True)
            slot = side.alloc_state()
        if slot is None:
            return "oom"
        exist, node = side.insert(r["tokens"], r["value"], slot, r["prefix"])
        if exist:
            side.free_state(slot)
        side.unlock(r["node"], r["receipt"])
        r.update(node=node, receipt=side.lock(node), prefix=len(r["tokens"]), own=[], value=side.node_value(node))
        return exist
    if kind == "finish":
        r = reqs.pop(op["rid"])
        exist, _node = side.insert(r["tokens"], r["value"], side.own_state(r["req"]), r["prefix"])
        if exist:
            side.free_state(side.own_state(r["req"]))
        side.unlock(r["node"], r["receipt"])
        return exist
    if kind == "abort":
        r = reqs.pop(op["rid"])
        side.unlock(r["node"], r["receipt"])
        side.free_full(r["own"])
        side.free_state(side.own_state(r["req"]))
        return None
    if kind == "match":
        prefix, _node, branching = side.match(op["tokens"], None)
        return [prefix, branching]
    if kind == "evict":
        side.evict(op["full"], op["mamba"], op["targets"])
        return None
    raise ValueError(f"unknown op {kind!r}")


def run_case(adapter_cls: Any, case: dict[str, Any]) -> list[dict[str, Any]]:
    side = adapter_cls(case)
    reqs: dict[int, dict[str, Any]] = {}
    states = []
    for op in case["ops"]:
        try:
            result = apply_op(side, reqs, op)
        except Exception as e:  # noqa: BLE001 - SGLang asserts; ours raises MambaSlotsExhausted
            states.append({"error": "exhausted" if EXHAUSTED in str(e) else f"{type(e).__name__}: {e}"})
            break
        s = side.state()
        s["result"] = result
        states.append(s)
    return states


def main(argv: list[str]) -> int:
    from case_driver import sglang_main  # beside this file, on sys.path[0] when run by path

    return sglang_main(argv, lambda cases: [run_case(SGLangAdapter, case) for case in cases], python_tree_core=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
