"""Runs op lists through a radix tree with HiCache's host tier and dumps its state.

One op interpreter (``run_case``) drives either side through an adapter: ``OursAdapter``
(``allocator.hiradix.HiRadixCache`` on our pools) or ``SGLangAdapter`` (SGLang 0.5.23's
``UnifiedRadixCache`` with ``tree_components=(FULL,)`` and HiCache on, its Python tree core,
a token / paged KV allocator, all on CPU). Run by path with SGLang's interpreter it reads a
JSON file of cases and writes SGLang's states::

    $KVTRACE_SGLANG_PYTHON tests/differential/hiradix_driver.py CASES.json OUT.json
    $KVTRACE_SGLANG_PYTHON tests/differential/hiradix_driver.py --sizes PAIRS.json OUT.json

At module level it imports only the standard library, so the test process imports it too.

CPU substitution (see docs/hicache-semantics.md): SGLang's ``HybridCacheController`` needs
CUDA streams and events; ``SyncController`` stands in for it with the same allocation calls
(``write``: ``mem_pool_host.alloc(len)``; ``load``: the device allocator's ``alloc(len)``)
and acks whose events are already done. The host pool is SGLang's own ``HostKVCache`` free
list built with ``is_dummy=True`` (no buffer). The tree, its eviction, backups, load-backs,
locks and ack handling are SGLang's code.

A case is ``{"ps", "pool", "host", "policy", "ops"}`` (page size, device pool tokens, host
pool tokens, write policy). Ops (requests by ``rid``):

* ``start {"rid", "tokens", "quota"?}``: match, load back the host part (``init_load_back``
  with ``mem_quota`` = quota when given), lock
  the node, take device slots for the rest (evicting the shortfall first); result
  ``[device_prefix, host_hit, loaded]`` or ``"oom"`` (all given back).
* ``finish {"rid"}``: insert the key with the request's slots, unlock.
* ``abort {"rid"}``: unlock, free the request's own slots.
* ``match {"tokens"}``: a plain match (splits and stamps; no load-back).
* ``evict {"n", "targets"}``: ``evict_for_alloc`` (targets) or ``evict``.
* ``evict_host {"n"}``: host eviction.
* ``ack``: one scheduler poll: submit backups, finish write and load acks.

The state after each op: the op's result, every node (by its path key: device slots, host
slots, both lock counts, hit count, in-flight marks, access time), the device ledgers, the
D-leaf and H-leaf sets, the tracked host duplicates (in order), the in-flight transfers and
both free lists.
"""

from __future__ import annotations

import sys
from typing import Any


class OursAdapter:
    """kvtrace's ``HiRadixCache``."""

    def __init__(self, case: dict[str, Any]) -> None:
        from allocator.hiradix import HiRadixCache
        from allocator.host_pool import HostKVPool
        from allocator.token_to_kv import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

        ps = case["ps"]
        self.alloc = TokenToKVPoolAllocator(case["pool"]) if ps == 1 else PagedTokenToKVPoolAllocator(case["pool"], ps)
        self.host = HostKVPool(case["host"], ps)
        self.tree = HiRadixCache(ps, self.alloc, self.host, case["policy"])

    def match(self, tokens: list[int], load: bool, quota: int | None = None) -> tuple[int, int, int, Any]:
        import numpy as np

        m = self.tree.match_prefix_hi(np.asarray(tokens, dtype=np.int64))
        if not load:
            return m.device_prefix_len, m.host_hit_len, 0, m.last_device_node
        loaded, node = self.tree.init_load_back(m, quota)
        return m.device_prefix_len, m.host_hit_len, loaded, node

    def node_value(self, node: Any) -> list[int]:
        return self.tree.path_device_indices(node).tolist()

    def lock(self, node: Any) -> Any:
        self.tree.inc_lock_ref(node)
        return node

    def unlock(self, node: Any, receipt: Any) -> None:
        self.tree.dec_lock_ref(node)

    def available(self) -> int:
        return self.alloc.available_size()

    def alloc_full(self, n: int) -> list[int] | None:
        r = self.alloc.alloc(n)
        return None if r is None else r.tolist()

    def free_full(self, slots: list[int]) -> None:
        import numpy as np

        if slots:
            self.alloc.free(np.asarray(slots, dtype=np.int32))

    def evict(self, n: int, targets: bool) -> None:
        if targets:
            self.tree.evict_for_alloc(n)
        else:
            self.tree.evict(n)

    def evict_host(self, n: int) -> int:
        return self.tree.evict_host(n)

    def insert(self, tokens: list[int], value: list[int], prev: int) -> int:
        import numpy as np

        return self.tree.insert(np.asarray(tokens, dtype=np.int64), np.asarray(value, dtype=np.int32), prev).prefix_len

    def ack(self) -> None:
        self.tree.ack()

    def state(self) -> dict[str, Any]:
        t = self.tree
        nodes = []
        stack = [(t.root_node, ())]
        while stack:
            x, path = stack.pop()
            for c in x.children.values():
                stack.append((c, path + tuple(c.key_units().tolist())))
            nodes.append([list(path), None if x.value is None else x.value.tolist(),
                          None if getattr(x, "host_value", None) is None else x.host_value.tolist(),
                          x.lock_ref, getattr(x, "host_lock_ref", 0), getattr(x, "hit_count", 0),
                          getattr(x, "write_through_pending_id", None) is not None,
                          getattr(x, "load_back_pending_id", None) is not None, round(x.last_access_time, 6)])
        nodes[0][1:9] = [[], None, 1, 0, 0, False, False, nodes[0][8]]  # the root as both keep it comparably
        nodes.sort(key=lambda r: r[0])
        def path(x: Any) -> list[int]:
            out: list[int] = []
            while x is not t.root_node:
                out = x.key_units().tolist() + out
                x = x.parent
            return out

        return {
            "nodes": nodes,
            "ledgers": [t.evictable_size_, t.protected_size_],
            "leaves": [sorted(path(x) for x in t.evictable_leaves), sorted(path(x) for x in t.evictable_host_leaves)],
            "dups": [path(x) for x in t.full_host_duplicates.values()],
            "inflight": [len(t.ongoing_write_through), len(t.ongoing_load_back)],
            "free": self.alloc.free_pages_np().tolist(),
            "host_free": self.host.free_view().tolist(),
        }


class SGLangAdapter:
    """SGLang 0.5.23's ``UnifiedRadixCache(FULL)`` with HiCache, on CPU (``SyncController``)."""

    def __init__(self, case: dict[str, Any]) -> None:
        from types import SimpleNamespace

        import torch
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.hicache_storage import PoolName
        from sglang.srt.mem_cache.pool_host.base import HostKVCache
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
        from sglang.srt.mem_cache.unified_cache.components import base as comp_base
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.runtime_context import get_context

        self.torch = torch
        self.CT = ComponentType
        ps, policy = case["ps"], case["policy"]
        self._ctx = get_context().override_server_args(attention_backend="torch_native", device="cpu", page_size=ps)
        self._ctx.install()
        if ps == 1:
            self.alloc = TokenToKVPoolAllocator(case["pool"], torch.int64, "cpu", None, False)
        else:
            self.alloc = PagedTokenToKVPoolAllocator(case["pool"], ps, torch.int64, "cpu", None, False)

        class CpuHostKVCache(HostKVCache):
            """SGLang's host free list with no buffer (is_dummy): the layout methods never run."""

            def get_size_per_token(self) -> int:
                return 1

            def init_kv_buffer(self) -> None:
                return None

            load_to_device_per_layer = set_from_flat_data_page = backup_from_device_all_layer = None
            get_dummy_flat_data_page = get_data_page = None

        CpuHostKVCache.__abstractmethods__ = frozenset()
        self.host = CpuHostKVCache(
            dtype=torch.float32, device_capacity_tokens=case["pool"], size_per_token=1, start_layer=0, end_layer=1,
            host_to_device_ratio=1.0, host_size=0, page_size=ps, layout="layer_first", pin_memory=False,
            device="cpu", is_dummy=True, host_token_capacity=case["host"],
        )
        host = self.host

        class Done:
            def synchronize(self) -> None:
                pass

            def query(self) -> bool:
                return True

        def ack(node_ids: list[int]) -> Any:
            return SimpleNamespace(start_event=Done(), finish_event=Done(), node_ids=node_ids, num_tokens_by_pool={},
                                   num_bytes=0, timing_enabled=False)

        alloc = self.alloc

        class SyncController:
            """``HybridCacheController`` with synchronous transfers (allocation calls kept)."""

            def __init__(self) -> None:
                self.mem_pool_host = SimpleNamespace(
                    anchor_entry=SimpleNamespace(host_pool=SimpleNamespace(shared_allocation_domain=None),
                                                 host_evict_fn=None),
                    available_size=host.available_size)
                self.write_policy = policy
                self.enable_storage = False
                self.pp_prefetch_command_group = None
                self.write_queue: list[int] = []
                self.load_queue: list[int] = []
                self.ack_write_queue: list[Any] = []
                self.ack_load_queue: list[Any] = []

            def write(self, device_indices, node_id=-1, extra_pools=None, flush=True, priority=None,  # noqa: ANN001
                      start_owner=None):  # noqa: ANN001, ANN202
                h = host.alloc(len(device_indices))
                if h is None:
                    return None
                self.write_queue.append(node_id)
                if flush:
                    self.start_writing()
                return h

            def start_writing(self) -> None:
                if self.write_queue:
                    self.ack_write_queue.append(ack(self.write_queue))
                    self.write_queue = []

            def load(self, host_indices, node_id=-1, extra_pools=None, priority=None):  # noqa: ANN001, ANN202
                d = alloc.alloc(len(host_indices))
                if d is None:
                    return None
                self.load_queue.append(node_id)
                return d

            def start_loading(self) -> int:
                if not self.load_queue:
                    return -1
                self.ack_load_queue.append(ack(self.load_queue))
                self.load_queue = []
                return 0

            def reset(self) -> None:
                pass

        class Group:
            def free(self, indices, pool=None):  # noqa: ANN001, ANN202
                return host.free(indices)

            def get_pool(self, name):  # noqa: ANN001, ANN202
                return host if name == PoolName.KV else None

        p = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=self.alloc,
                            page_size=ps, is_eagle=False)
        p.tree_components = (ComponentType.FULL,)
        self.tree = UnifiedRadixCache(p)
        self.cc = SyncController()
        # What init_hicache sets up, without attach_hybrid_pool_to_unified_cache's CUDA pools.
        self.tree.cache_controller = self.cc
        self.tree.host_pool_group = Group()
        self.tree.components[ComponentType.FULL]._full_kv_pool_host = host
        self.tree.tree_core.set_hicache_enabled()
        self.tree.write_through_threshold = 1 if policy == "write_through" else 2
        self.tree.is_write_back = policy == "write_back"
        self.tree.load_back_threshold = 10
        self.tree.host_memory_mode = "cache"
        self.core = self.tree.tree_core
        # The clock as ours starts it: the root took ticks 0 (access) and 1 (creation).
        comp_base._LAST_ACCESS_TIME_COUNTER_FLOAT = 2.0
        self.core.root_node.last_access_time = 0.0

    def _key(self, tokens: list[int]) -> Any:
        from sglang.srt.mem_cache.radix_cache import RadixKey

        return RadixKey(tokens)

    def match(self, tokens: list[int], load: bool, quota: int | None = None) -> tuple[int, int, int, Any]:
        from types import SimpleNamespace

        from sglang.srt.managers.schedule_batch import ReqKvInfo
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, MatchPrefixParams

        m = self.tree.match_prefix(MatchPrefixParams(key=self._key(tokens)))
        if not load:
            return m.device_prefix_len, m.host_hit_length, 0, self.core.node_by_id(m.last_device_node)
        req = SimpleNamespace(rid="r", kv=ReqKvInfo(), session=None, last_node=m.last_device_node,
                              swa_host_hit_length=0, mamba_host_hit_length=0)
        loaded, node_id = self.tree.init_load_back(
            InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=m.host_hit_length, req=req,
                               mem_quota=quota))
        return m.device_prefix_len, m.host_hit_length, loaded, self.core.node_by_id(node_id)

    def node_value(self, node: Any) -> list[int]:
        out: list[int] = []
        root = self.core.root_node
        while node is not root:
            v = node.component_data[self.CT.FULL].value
            out = (v.tolist() if v is not None else []) + out
            node = node.parent
        return out

    def lock(self, node: Any) -> Any:
        return self.tree.inc_lock_ref(node.id)

    def unlock(self, node: Any, receipt: Any) -> None:
        self.tree.dec_lock_ref(node.id, receipt.to_dec_params())

    def available(self) -> int:
        return int(self.alloc.available_size())

    def alloc_full(self, n: int) -> list[int] | None:
        r = self.alloc.alloc(n)
        return None if r is None else r.tolist()

    def free_full(self, slots: list[int]) -> None:
        if slots:
            self.alloc.free(self.torch.tensor(slots, dtype=self.torch.int64))

    def evict(self, n: int, targets: bool) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        if targets:
            self.tree.evict_for_alloc(EvictParams(num_tokens=n))
        else:
            self.tree.evict(EvictParams(num_tokens=n))

    def evict_host(self, n: int) -> int:
        return int(self.tree.evict_host(n))

    def insert(self, tokens: list[int], value: list[int], prev: int) -> int:
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        t = self.torch
        r = self.tree.insert(InsertParams(key=self._key(tokens), value=t.tensor(value, dtype=t.int64),
                                          prev_prefix_len=prev))
        return int(r.prefix_len)

    def ack(self) -> None:
        self.tree.flush_pending_backups()
        self.tree.writing_check(finish_count=len(self.cc.ack_write_queue))
        self.cc.start_loading()
        self.tree.loading_check(finish_count=len(self.cc.ack_load_queue))

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
            f = x.component_data[CT.FULL]
            nodes.append([self._path(x), None if f.value is None else [int(v) for v in f.value],
                          None if f.host_value is None else [int(v) for v in f.host_value], f.lock_ref,
                          f.host_lock_ref, x.hit_count, x.write_through_pending_id is not None,
                          x.load_back_pending_id is not None, round(x.last_access_time, 6)])
        nodes.sort(key=lambda r: r[0])
        nodes[0][1:8] = [[], None, 1, 0, 0, False, False]
        host_free = self.host.free_slots.tolist()
        for chunk in self.host.release_slots:
            host_free += chunk.tolist()
        return {
            "nodes": nodes,
            "ledgers": [core.component_evictable_size_[CT.FULL], core.component_protected_size_[CT.FULL]],
            "leaves": [sorted(self._path(x) for x in core.evictable_device_leaves),
                       sorted(self._path(x) for x in core.evictable_host_leaves)],
            "dups": [self._path(x) for x in core.full_host_duplicates.values()],
            "inflight": [len(self.tree.ongoing_write_through), len(self.tree.ongoing_load_back)],
            "free": self.alloc.free_pages.tolist(),
            "host_free": host_free,
        }


def host_pool_sizes(pairs: list[list[Any]]) -> list[int]:
    """SGLang's ``HostKVCache`` size for each ``[device tokens, ratio, page size]`` (no buffer)."""
    import torch
    from sglang.srt.mem_cache.pool_host.base import HostKVCache

    class Sizer(HostKVCache):
        def get_size_per_token(self) -> int:
            return 1

        def init_kv_buffer(self) -> None:
            return None

    Sizer.__abstractmethods__ = frozenset()
    out = []
    for device, ratio, ps in pairs:
        pool = Sizer(dtype=torch.float32, device_capacity_tokens=device, size_per_token=1, start_layer=0,
                     end_layer=1, host_to_device_ratio=ratio, host_size=0, page_size=ps, layout="layer_first",
                     pin_memory=False, device="cpu", is_dummy=True)
        out.append(int(pool.size))
    return out


def apply_op(side: Any, reqs: dict[int, dict[str, Any]], op: dict[str, Any]) -> Any:
    """Apply one op to ``side``; ``reqs`` maps rid -> {tokens, prefix, node, receipt, own, value}."""
    kind = op["op"]
    if kind == "start":
        tokens = op["tokens"]
        dev, host_hit, loaded, node = side.match(tokens, True, op.get("quota"))
        prefix = dev + loaded
        receipt = side.lock(node)
        need = len(tokens) - prefix
        own: list[int] | None = []
        if need > 0:
            if side.available() < need:
                side.evict(need - side.available(), True)
            own = side.alloc_full(need)
        if own is None:
            side.unlock(node, receipt)
            return "oom"
        reqs[op["rid"]] = {"tokens": tokens, "prefix": prefix, "node": node, "receipt": receipt, "own": own,
                           "value": side.node_value(node) + own}
        return [dev, host_hit, loaded]
    if kind == "finish":
        r = reqs.pop(op["rid"])
        got = side.insert(r["tokens"], r["value"], r["prefix"])
        side.unlock(r["node"], r["receipt"])
        return got
    if kind == "abort":
        r = reqs.pop(op["rid"])
        side.unlock(r["node"], r["receipt"])
        side.free_full(r["own"])
        return None
    if kind == "match":
        dev, host_hit, _, _ = side.match(op["tokens"], False)
        return [dev, host_hit]
    if kind == "evict":
        side.evict(op["n"], op["targets"])
        return None
    if kind == "evict_host":
        return side.evict_host(op["n"])
    if kind == "ack":
        side.ack()
        return None
    raise ValueError(f"unknown op {kind!r}")


def run_case(adapter_cls: Any, case: dict[str, Any]) -> list[dict[str, Any]]:
    side = adapter_cls(case)
    reqs: dict[int, dict[str, Any]] = {}
    states = []
    for op in case["ops"]:
        try:
            result = apply_op(side, reqs, op)
        except Exception as e:  # noqa: BLE001 - an assertion on either side ends the case
            states.append({"error": f"{type(e).__name__}: {e}"})
            break
        s = side.state()
        s["result"] = result
        states.append(s)
    return states


def main(argv: list[str]) -> int:
    from case_driver import sglang_main  # beside this file, on sys.path[0] when run by path

    if argv[:1] == ["--sizes"]:
        return sglang_main(argv[1:], host_pool_sizes, python_tree_core=True)
    return sglang_main(argv, lambda cases: [run_case(SGLangAdapter, case) for case in cases], python_tree_core=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
