"""What kvtrace reads off an SGLang world: the pool counters (per pool), free lists,
the radix tree's nodes, and the physical-state digest ``kvtrace diff --exact`` compares.

Loaded with ``server.py`` inside the SGLang environment (standard library, numpy,
torch, sglang, and kvtrace's ``allocator/pages.py`` and ``allocator/check/digest.py``
loaded by path: they import numpy only). The digest is kvtrace's own, computed from
SGLang's rows, free lists and tree, so it equals the built-in allocator's
``state_digest()`` exactly when the states are equal.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from . import world

__all__ = [
    "IncrementalDigest", "allocator_module", "free_ids", "full_value", "host_pool_counters", "mamba_available", "mamba_pool_counters",
    "pool_counters", "side_ids", "state_digest", "swa_pool_counters", "token_allocators", "tree_nodes",
]


def allocator_module(name: str) -> ModuleType:
    """``allocator/<name>.py`` (``name`` dotted: ``check.digest``) of the kvtrace checkout
    holding this file, loaded by path (``pages`` and ``check.digest`` import numpy and the
    standard library only)."""
    key = f"kvtrace_sglang_allocator_{name.replace('.', '_')}"
    if key in sys.modules:
        return sys.modules[key]
    path = Path(__file__).resolve().parents[2] / "allocator" / f"{name.replace('.', '/')}.py"
    spec = importlib.util.spec_from_file_location(key, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path}: not found next to the driver")
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module


def pool_counters(eng: world.SGLangEngine) -> tuple[int, ...]:
    """The fields of kvtrace's ``PoolCounters`` (in order) read off an SGLang world. A
    record a streaming session owns (``session_records``, a running turn's too) counts
    whole as ``session_held``, ``ceil_align(kv_allocated_len) - cache_protected_len``
    (SGLang's ``pool_stats_observer.session_held_tokens``), the others as committed and
    overallocated."""
    pages = allocator_module("pages")
    committed = overallocated = session_held = 0
    owned = eng.session_records()
    for _rid, kv in eng.live_kvs():
        ceil = int(pages.ceil_align(int(kv.kv_allocated_len), eng.ps))
        if id(kv) in owned:
            session_held += ceil - int(kv.cache_protected_len)
        else:
            committed += int(kv.kv_committed_len) - int(kv.cache_protected_len)
            overallocated += ceil - int(kv.kv_committed_len)
    free_rows = int(eng.pool.available_size())
    full = token_allocators(eng)[0]  # a hybrid SWA model's counters are its full pool's
    return (
        int(full.size), int(full.available_size()), int(eng.tree.evictable_size()),
        int(eng.tree.protected_size()), committed, overallocated, int(eng.pool.size) - free_rows, free_rows,
        session_held,
    )


def swa_pool_counters(eng: world.SGLangEngine, full: tuple[int, ...]) -> tuple[int, ...]:
    """The SWA pool's ``PoolCounters`` fields read off an SGLang world, given the full
    pool's (``pool_counters``). As the built-in allocator reports them: the tree's SWA
    ledgers as evictable and protected (0 without a radix cache), the full pool's
    over-allocation, and the requests' window-kept KV (``committed``) the rest of the
    pool, so conservation holds exactly when SGLang's pool is sound."""
    alloc = eng.alloc
    size, available = int(alloc.size_swa), int(alloc.swa_available_size())
    tree = eng.tree
    cached = not getattr(tree, "disable", True) and hasattr(tree, "swa_evictable_size")
    evictable = int(tree.swa_evictable_size()) if cached else 0
    protected = int(tree.swa_protected_size()) if cached else 0
    overallocated = full[5]
    committed = size - available - evictable - protected - overallocated
    return (size, available, evictable, protected, committed, overallocated, full[6], full[7])


def host_pool_counters(eng: world.SGLangEngine, full: tuple[int, ...]) -> tuple[int, ...]:
    """HiCache's host pool's ``PoolCounters`` fields (in tokens) read off an SGLang world
    (decision 17), as the built-in allocator reports them: ``evictable`` the host-only
    unlocked leaves (the tree core's ``evictable_host_leaves``: what ``evict_host`` may
    free), ``protected`` every other host copy; requests hold no host slot."""
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    host = eng.tree.cache_controller.host
    core = eng.tree.tree_core
    size, available = int(host.size), int(host.available_size())
    evictable = sum(len(n.component_data[ComponentType.FULL].host_value) for n in core.evictable_host_leaves)
    return (size, available, evictable, size - available - evictable, 0, 0, full[6], full[7])


def mamba_available(eng: world.SGLangEngine) -> int:
    """The Mamba state slots an admission can take now (free list and an open group's;
    0 without a Mamba pool)."""
    mamba = getattr(eng.pool, "mamba_allocator", None)
    if mamba is None:
        return 0
    group = 0
    if mamba._alloc_iter is not None:
        rest = list(mamba._alloc_iter)
        mamba._alloc_iter = iter(rest)  # put back what was peeked
        group = len(rest)
    return int(mamba.available_size()) + group


def mamba_pool_counters(eng: world.SGLangEngine, full: tuple[int, ...]) -> tuple[int, ...]:
    """The Mamba pool's ``PoolCounters`` fields (in slots) read off an SGLang world, as
    the built-in allocator reports them: ``evictable`` / ``protected`` the Mamba
    component's ledgers of the unified tree (0 with the radix cache off),
    ``committed`` the state slots requests hold, nothing over-allocated (decision 14)."""
    mamba = eng.pool.mamba_allocator
    held = sum(1 for req in eng.reqs.values() if req.kv.mamba_pool_idx is not None)
    # extra_buffer (decision 16): the tracking slots are the requests' too
    held += sum(
        sum(1 for empty in req.kv.mamba_ping_pong_empty if not empty)
        for req in eng.reqs.values() if getattr(req.kv, "mamba_ping_pong_empty", None) is not None
    )
    evictable = protected = 0
    tree = eng.tree
    if not tree.disable and tree.supports_mamba():
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        core = tree.tree_core
        evictable = int(core.component_evictable_size_[ComponentType.MAMBA])
        protected = int(core.component_protected_size_[ComponentType.MAMBA])
    return (int(mamba.size), int(mamba.available_size()), evictable, protected, held, 0, full[6], full[7])


def _mamba_lists(eng: world.SGLangEngine, digest: Any, columns: tuple[np.ndarray, ...]) -> list[Any]:
    """The Mamba pool's part of the digest's lists (``check.digest.mamba_lists``), none without one."""
    mamba = getattr(eng.pool, "mamba_allocator", None)
    if mamba is None:
        return []
    mapping = eng.pool.req_index_to_mamba_index_mapping.numpy()
    return digest.mamba_lists(mamba.free_slots.numpy(), mapping, np.flatnonzero(columns[0] >= 0))


def token_allocators(eng: world.SGLangEngine) -> list[Any]:
    """The token allocators holding free lists, in the built-in digest's order
    (``allocator.check.digest``): the one allocator, or a hybrid SWA model's full pool's
    then its SWA pool's."""
    alloc = eng.alloc
    full = getattr(alloc, "full_attn_allocator", None)
    return [alloc] if full is None else [full, alloc.swa_attn_allocator]


def free_ids(eng: world.SGLangEngine, alloc: Any = None) -> np.ndarray:
    """A token allocator's free list in reuse order (slot ids at page 1, page ids
    otherwise); default: the (full pool's) first of ``token_allocators``."""
    alloc = token_allocators(eng)[0] if alloc is None else alloc
    return alloc.free_pages.numpy().astype(np.int64)


def side_ids(eng: world.SGLangEngine, alloc: Any = None) -> np.ndarray:
    """A token allocator's need-sort side list: ``release_pages`` at page 1, the staged
    pages otherwise; default: the (full pool's) first of ``token_allocators``."""
    alloc = token_allocators(eng)[0] if alloc is None else alloc
    if eng.ps == 1:
        return alloc.release_pages.numpy().astype(np.int64)
    staged = alloc.staged_pages
    return np.concatenate([s.numpy() for s in staged]).astype(np.int64) if staged else np.zeros(0, np.int64)


def full_value(node: Any) -> Any:
    """A tree node's full-attention slots: ``value`` of a radix node, the FULL
    component's value of a unified (FULL + SWA) node."""
    if hasattr(node, "component_data"):
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        return node.component_data[ComponentType.FULL].value
    return node.value


def tree_nodes(eng: world.SGLangEngine) -> list[Any]:
    """Every node of the radix tree but the root."""
    if not eng.config.radix_cache:
        return []
    stack = list(eng.tree.root_node.children.values())
    nodes = []
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.children.values())
    return nodes


def _digest_columns(eng: world.SGLangEngine, rid_of: Any = None) -> tuple[np.ndarray, ...]:
    """int64 ``[rows + 1]`` each: request id (-1 free; ``rid_of(rid)`` when given),
    allocated, committed, protected."""
    num_rows = int(eng.pool.req_to_token.shape[0])
    columns = tuple(np.zeros(num_rows, np.int64) for _ in range(4))
    columns[0][:] = -1
    for rid, kv in eng.live_kvs():  # a session's record between turns is its rid's
        row = kv.req_pool_idx
        columns[0][row] = rid if rid_of is None else rid_of(rid)
        columns[1][row] = kv.kv_allocated_len
        columns[2][row] = kv.kv_committed_len
        columns[3][row] = kv.cache_protected_len
    return columns


def state_digest(eng: world.SGLangEngine, rid_of: Any = None) -> str:
    """kvtrace's physical-state digest (``allocator/check/digest.py``) of an SGLang world
    between steps, from scratch: rows with their request ids and lengths, the free
    lists in order, the free request rows, the tree's sizes. Equal to the built-in
    allocator's ``state_digest()`` exactly when the states are equal. ``rid_of``: the
    id a trace gives each request (a recorder's dense ids), when not the world's own."""
    digest = allocator_module("check.digest")
    columns = _digest_columns(eng, rid_of)
    rows = np.flatnonzero(columns[0] >= 0)
    total = digest.rows_hash(eng.pool.req_to_token.numpy(), rows, columns[1][rows])
    lists = [(digest.seq_value(free_ids(eng, a)), digest.seq_value(side_ids(eng, a))) for a in token_allocators(eng)]
    lists += _mamba_lists(eng, digest, columns)
    return digest.compose_digest(total, columns, list(eng.pool.free_slots), lists,
                                 int(eng.tree.evictable_size()), int(eng.tree.protected_size()))


class IncrementalDigest:
    """``state_digest`` kept from what changed since the last call (a step of decode
    at page 1 must not hash a 900k-slot free list and every row again):

    * a row whose request is the same and whose length only grew, and that no
      checkpoint rewrote (``rewritten``: the server names the requests of every
      extend, prealloc and prompt publish), adds the terms of its new positions;
      any other row is hashed again;
    * the free list: when SGLang only took from its head (the tensor is a view of the
      one seen last, further along the same storage), the taken entries leave the
      hash; any other change (a free concatenates a new tensor) hashes it again.
    """

    def __init__(self, eng: world.SGLangEngine) -> None:
        self.eng = eng
        self.digest = allocator_module("check.digest")
        n = int(eng.pool.req_to_token.shape[0])
        self.rid = np.full(n, -1, np.int64)
        self.length = np.zeros(n, np.int64)
        self.row_hash = np.zeros(n, np.uint64)
        self.rewritten: set[int] = set()  # request ids whose rows a checkpoint may have rewritten
        # per token allocator (``token_allocators``): the free-list tensor hashed last, its hash
        self._free: list[Any] = [None, None]
        self._free_seq: list[Any] = [None, None]

    def value(self) -> str:
        eng, digest = self.eng, self.digest
        columns = _digest_columns(eng)
        rid, length = columns[0], columns[1] * (columns[0] >= 0)
        same = (rid == self.rid) & (length >= self.length)
        if self.rewritten:
            same &= ~np.isin(rid, np.fromiter(self.rewritten, np.int64, len(self.rewritten)))
            self.rewritten.clear()
        starts = np.where(same, self.length, 0)
        changed = np.flatnonzero((length != self.length) | ~same)
        if changed.shape[0]:
            terms = digest.row_terms(eng.pool.req_to_token.numpy(), changed, starts[changed], length[changed])
            base = np.where(same[changed], self.row_hash[changed], np.uint64(0))
            self.row_hash[changed] = base + terms
            self.rid[changed] = rid[changed]
            self.length[changed] = length[changed]
        total = int(self.row_hash.sum(dtype=np.uint64))
        lists = [
            (self._free_value(i, a), digest.seq_value(side_ids(eng, a))) for i, a in enumerate(token_allocators(eng))
        ]
        lists += _mamba_lists(eng, digest, columns)
        return digest.compose_digest(total, columns, list(eng.pool.free_slots), lists,
                                     int(eng.tree.evictable_size()), int(eng.tree.protected_size()))

    def _free_value(self, i: int, alloc: Any) -> tuple[int, int]:
        cur, prev = alloc.free_pages, self._free[i]
        if (
            prev is not None and cur.numel() <= prev.numel()
            and cur.untyped_storage().data_ptr() == prev.untyped_storage().data_ptr()
            and cur.storage_offset() + cur.numel() == prev.storage_offset() + prev.numel()
        ):
            taken = cur.storage_offset() - prev.storage_offset()
            if taken:
                self._free_seq[i].pop_front(prev[:taken].numpy())
        else:
            self._free_seq[i] = self.digest.SeqHash(cur.numpy())
        self._free[i] = cur
        return self._free_seq[i].value()
