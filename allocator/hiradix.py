"""HiRadixCache: the radix cache with HiCache's host tier, as SGLang 0.5.23 runs it.

SGLang 0.5.23 runs HiCache as a mode of ``UnifiedRadixCache`` (FULL component, tree core in
``mem_cache/unified_cache/unified_tree_core.py``, controller in
``mem_cache/hybrid_cache/hybrid_cache_controller.py``); the facts, with file:line, are in
``docs/hicache-semantics.md``. Each node keeps its device slots (``value``, None once
evicted) and its host slots (``host_value``, None until backed up)::

    root -- A [dev, host] -- B [dev, -]          A: both tiers (a host duplicate)
                        \\-- C [-, host]          C: host only (demoted); an H-leaf

- backup: under ``write_through`` (threshold 1) and ``write_through_selective`` (2) an
  insert counts a hit on every node past the request's inserted length; at the threshold
  an unbacked node is copied to host, with its unbacked ancestors (root side first). The
  node is locked and marked pending until the ack (``ack``). ``write_back`` backs up only
  on device eviction, synchronously.
- device eviction (LRU over D-leaves): a backed-up victim is demoted (device slots freed,
  host copy kept); an unbacked one is deleted (write_through*) or backed up first
  (write_back; its subtree is dropped when the host pool cannot take it).
- host eviction (LRU over H-leaves: evicted, backed up, unlocked, childless) deletes nodes;
  under write_back host copies of nodes still on device are reclaimed first.
- match walks through host-only nodes: ``best_match_node`` may be evicted; ``host_hit_len``
  counts the host tokens below the deepest device node. ``init_load_back`` allocates device
  slots for them (host slots kept), locks the anchor and its host copy until the ack.
- locks: ``lock_ref`` on the path (host-only nodes at the bottom are counted with no
  ledger move), ``host_lock_ref`` on one node (a split extends it to the new upper part).

Access times are floats from one counter ticked where SGLang's
``get_and_increase_time_counter`` ticks (twice per new node, once per node an insert walks,
once per split, once per match). Device and host frees happen in SGLang's order.

Not mirrored: storage (L3), buffer_only mode, SWA / Mamba host pools, sessions,
priorities, TP consensus, the external linker. Not yet wired: ``journal`` (incremental
checks), ``listener`` (KV events, which name the tier), checkpoints (``save_tree_state``)
and the ``peek_*`` admission helpers: they assume every node is on device.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Iterator, NamedTuple

import numpy as np

from allocator.host_pool import HOST_SLOT_DTYPE, HostKVPool
from allocator.pages import floor_align
from allocator.radix_cache import InsertResult, MatchResult, RadixCache, TreeNode
from allocator.token_to_kv import SLOT_DTYPE

if TYPE_CHECKING:
    from allocator.base import HiCacheConfig

__all__ = ["HiMatchResult", "HiRadixCache", "HiTreeNode", "LOAD_BACK_THRESHOLD"]

# SGLang's ``load_back_threshold``: a load-back of fewer host tokens is not worth it.
LOAD_BACK_THRESHOLD = 10
_EMPTY_HOST = np.empty(0, dtype=HOST_SLOT_DTYPE)


class HiTreeNode(TreeNode):
    """A node with both tiers: device slots (None: evicted), host slots (None: not backed
    up), the host lock, the hit count and the in-flight marks."""

    __slots__ = ("host_value", "host_lock_ref", "host_uuid", "hit_count", "creation_time",
                 "write_through_pending_id", "load_back_pending_id")

    def __init__(self, node_id: int, access_time: float) -> None:
        super().__init__(node_id, access_time)  # type: ignore[arg-type]
        self.value: np.ndarray | None  # type: ignore[assignment]
        self.host_value: np.ndarray | None = None  # int64 [len] host slots
        self.host_lock_ref = 0
        self.host_uuid: int | None = None  # host-lock boundary mark (SGLang's "host_uuid")
        self.hit_count = 0
        self.creation_time = 0.0
        self.write_through_pending_id: int | None = None
        self.load_back_pending_id: int | None = None

    def __len__(self) -> int:
        return len(self.key) // 8

    @property
    def evicted(self) -> bool:
        return self.parent is not None and self.value is None

    @property
    def backuped(self) -> bool:
        return self.host_value is not None

    def __repr__(self) -> str:
        return (f"HiTreeNode(id={self.id}, len={len(self)}, dev={self.value is not None}, "
                f"host={self.host_value is not None}, lock={self.lock_ref}/{self.host_lock_ref})")


class HiMatchResult(NamedTuple):
    device_prefix_len: int  # units on device, from the root
    last_device_node: HiTreeNode  # deepest matched node on device
    best_match_node: HiTreeNode  # deepest matched node on either tier
    host_hit_len: int  # host tokens between last_device_node and best_match_node


class _OngoingWrite(NamedTuple):
    node: HiTreeNode
    locked: bool  # write-through: the node is locked until the ack
    publish: list[HiTreeNode]  # nodes whose pending mark the ack clears (split fragments)


class _OngoingLoad(NamedTuple):
    node: HiTreeNode
    host_receipt: int | None


class HiRadixCache(RadixCache):
    """The radix cache with a host tier (see the module docstring).

    Args:
        page_size: units per page (both pools).
        token_to_kv_pool_allocator: the device KV allocator (``alloc``, ``free_segment``,
            ``available_size``).
        host_pool: the host free list.
        write_policy: ``write_through``, ``write_through_selective`` or ``write_back``.

    Attributes:
        stats: counters (tokens backed up, demoted, deleted unbacked, host evicted, host
            duplicates reclaimed, loaded back; load-backs refused, backups failed, write_back
            subtrees dropped for want of host room, splits of nodes with a write in flight).
    """

    def __init__(self, page_size: int, token_to_kv_pool_allocator, host_pool: HostKVPool,  # noqa: ANN001
                 write_policy: str = "write_through") -> None:
        if write_policy not in ("write_through", "write_through_selective", "write_back"):
            raise ValueError(f"HiRadixCache: unknown write policy {write_policy!r}")
        self.host_pool = host_pool
        self.write_policy = write_policy
        self.is_write_back = write_policy == "write_back"
        self.write_through_threshold = 1 if write_policy == "write_through" else 2
        self.load_back_threshold = LOAD_BACK_THRESHOLD
        super().__init__(page_size, token_to_kv_pool_allocator, disable=False, is_eagle=False)

    @classmethod
    def from_config(cls, config: HiCacheConfig, token_to_kv_pool_allocator, device_tokens: int) -> HiRadixCache:  # noqa: ANN001
        """Build the tree and its host pool from a ``HiCacheConfig``."""
        config.check()
        host = HostKVPool(config.pool_tokens(device_tokens), config.page_size)
        return cls(config.page_size, token_to_kv_pool_allocator, host, config.write_policy)

    def reset(self) -> None:
        self._clock = 0.0
        self._next_id = 0
        self._next_uuid = 0
        self.root_node = self._new_node()
        self.root_node.lock_ref = 1
        self.evictable_size_ = 0
        self.protected_size_ = 0
        self.evictable_leaves: set[TreeNode] = set()  # D-leaves
        self.evictable_host_leaves: set[HiTreeNode] = set()  # H-leaves
        # Nodes on both tiers with nothing in flight, in the order they became so (SGLang's
        # ``full_host_duplicates``: a dict, entries may be stale and are checked live).
        self.full_host_duplicates: dict[int, HiTreeNode] = {}
        self.evicted_tokens_total = 0
        self._heap = []
        self.ongoing_write_through: dict[int, _OngoingWrite] = {}
        self.ongoing_load_back: dict[int, _OngoingLoad] = {}
        self._write_queue: list[int] = []  # ack ids written but not yet submitted
        self._ack_write_queue: list[list[int]] = []
        self._load_queue: list[int] = []
        self._ack_load_queue: list[list[int]] = []
        self.stats = {"backed_up": 0, "demoted": 0, "deleted_unbacked": 0, "host_evicted": 0,
                      "host_reclaimed": 0, "loaded_back": 0, "load_back_refused": 0, "backup_failed": 0,
                      "dropped_no_host": 0, "split_in_flight": 0}

    def _tick(self) -> float:  # type: ignore[override]
        t = self._clock
        self._clock += 1.0
        return t

    def _new_node(self) -> HiTreeNode:  # type: ignore[override]
        self._next_id += 1
        node = HiTreeNode(self._next_id, self._tick())
        node.creation_time = self._tick()
        return node

    def host_evictable_size(self) -> int:
        return sum(len(n) for n in self.evictable_host_leaves)

    # ------------------------------------------------------------------ leaf sets

    def _is_device_leaf(self, node: HiTreeNode) -> bool:
        if node is self.root_node or node.value is None:
            return False
        if node.lock_ref > 0:  # (a host lock does not pin the device copy)
            return False
        return not any(c.value is not None for c in node.children.values())

    def _is_host_leaf(self, node: HiTreeNode) -> bool:
        if node is self.root_node or node.value is not None or node.host_value is None:
            return False
        return node.host_lock_ref == 0 and node.lock_ref == 0 and not node.children

    def _update_leaf_status(self, node: TreeNode) -> None:
        n: HiTreeNode = node  # type: ignore[assignment]
        if self._is_device_leaf(n):
            self.evictable_leaves.add(n)
        else:
            self.evictable_leaves.discard(n)
        if self._is_host_leaf(n):
            self.evictable_host_leaves.add(n)
        else:
            self.evictable_host_leaves.discard(n)

    def _update_duplicate_tracking(self, node: HiTreeNode) -> None:
        if (node is not self.root_node and node.value is not None and node.host_value is not None
                and node.write_through_pending_id is None and node.load_back_pending_id is None):
            self.full_host_duplicates.setdefault(node.id, node)
        else:
            self.full_host_duplicates.pop(node.id, None)

    def _remove_leaf_from_parent(self, node: HiTreeNode) -> None:
        psb = self.page_size * 8
        del node.parent.children[node.key[:psb]]  # type: ignore[union-attr]
        self.full_host_duplicates.pop(node.id, None)

    # ------------------------------------------------------------------ split

    def _split_node(self, child: TreeNode, split_len: int) -> HiTreeNode:  # type: ignore[override]
        """Split ``child`` after ``split_len`` units; both tiers' slots are cut there, the
        upper part takes the counts, the pending mark and the host-lock boundary."""
        psb = self.page_size * 8
        cut = split_len * 8
        c: HiTreeNode = child  # type: ignore[assignment]
        upper = self._new_node()
        upper.parent = c.parent
        upper.key = c.key[:cut]
        upper.hit_count = c.hit_count
        upper.creation_time = c.creation_time
        upper.load_back_pending_id = c.load_back_pending_id
        c.key = c.key[cut:]
        c.parent = upper
        upper.children = {c.key[:psb]: c}
        upper.lock_ref = c.lock_ref
        upper.host_lock_ref = c.host_lock_ref
        upper.host_uuid, c.host_uuid = c.host_uuid, None
        if c.value is not None:
            upper.value = c.value[:split_len].copy()
            c.value = c.value[split_len:].copy()
        else:
            upper.value = None
        if c.host_value is not None:
            upper.host_value = c.host_value[:split_len].copy()
            c.host_value = c.host_value[split_len:].copy()
        upper.parent.children[upper.key[:psb]] = upper
        ack_id = c.write_through_pending_id
        if ack_id is not None:
            self.stats["split_in_flight"] += 1
            upper.write_through_pending_id = ack_id
            pending = self.ongoing_write_through.get(ack_id)
            if pending is not None and c in pending.publish:
                i = pending.publish.index(c)
                pending.publish[i:i + 1] = [upper, c]
        c.last_access_time = self._tick()
        self._update_leaf_status(upper)
        self._update_leaf_status(c)
        self._update_duplicate_tracking(upper)
        return upper

    # ------------------------------------------------------------------ match

    def match_prefix(self, key: np.ndarray) -> MatchResult:
        """The device part of ``match_prefix_hi`` (RadixCache's result shape)."""
        m = self.match_prefix_hi(key)
        return MatchResult(m.device_prefix_len, m.last_device_node)

    def match_prefix_hi(self, key: np.ndarray) -> HiMatchResult:
        """Longest cached page-aligned prefix of ``key`` on either tier.

        Walks through host-only nodes (stops at a node on neither tier), splits the node
        where the match ends inside it, stamps the access time of ``best_match_node`` and
        its ancestors (one tick, 1e-5 less per level up).
        """
        ps = self.page_size
        n = floor_align(key.shape[0], ps)
        root: HiTreeNode = self.root_node  # type: ignore[assignment]
        if n == 0:
            return HiMatchResult(0, root, root, 0)
        kb = key[:n].tobytes()
        nb, psb = n * 8, ps * 8
        node = root
        pos = 0
        device_len = 0
        best, best_dev, best_dev_len = root, root, 0
        while pos < nb:
            child = node.children.get(kb[pos : pos + psb])
            if child is None:
                break
            if child.value is None and child.host_value is None:
                break
            m = len(child) if kb.startswith(child.key, pos) else self._matched_units(child.key, kb, pos)
            split = m < len(child)
            if split:
                child = self._split_node(child, m)
            node = child
            pos += m * 8
            best = node
            if node.value is not None:
                device_len += m
                best_dev, best_dev_len = node, device_len
            if split:
                break
        t = self._tick()
        x: HiTreeNode | None = best
        while x is not None:
            x.last_access_time = t  # type: ignore[assignment]
            t -= 0.00001
            x = x.parent  # type: ignore[assignment]
        host_hit = 0
        x = best
        while x is not best_dev and x is not root:
            if x.host_value is not None:
                host_hit += x.host_value.shape[0]
            x = x.parent  # type: ignore[assignment]
        return HiMatchResult(best_dev_len, best_dev, best, host_hit)

    # ------------------------------------------------------------------ insert

    def insert(self, key: np.ndarray, value: np.ndarray, prev_prefix_len: int = 0,  # type: ignore[override]
               inserted_len: int = 0) -> InsertResult:
        """Insert ``key`` -> ``value`` (device slots of the request).

        Args:
            prev_prefix_len: the request's protected length: its slots below it are the
                tree's already; overlapped slots at or past it are freed (duplicates).
            inserted_len: what this request inserted before (hits are counted past it).

        Returns:
            ``(prefix_len, last_node)``: units already in the tree, the node the key ends at.
        """
        ps = self.page_size
        n = floor_align(key.shape[0], ps)
        root: HiTreeNode = self.root_node  # type: ignore[assignment]
        root.last_access_time = self._tick()
        if n == 0:
            return InsertResult(0, root)
        alloc = self.token_to_kv_pool_allocator
        kb = key[:n].tobytes()
        nb, psb = n * 8, ps * 8
        node = root
        pos = 0
        while pos < nb:
            child = node.children.get(kb[pos : pos + psb])
            if child is None:
                break
            child.last_access_time = self._tick()
            m = len(child) if kb.startswith(child.key, pos) else self._matched_units(child.key, kb, pos)
            if m < len(child):
                child = self._split_node(child, m)
            total = pos // 8
            if child.value is None:
                self._unevict(child, value[total : total + m])
            else:
                dup_start = max(0, prev_prefix_len - total)
                if dup_start < m:
                    alloc.free_segment(np.asarray(value[total + dup_start : total + m], dtype=SLOT_DTYPE), 0)
            node = child
            pos += m * 8
            if pos // 8 > inserted_len and self._inc_hit_count_and_check(node):
                self._backup_chain(node)
        total = pos // 8
        if pos < nb:
            leaf = self._new_node()
            leaf.parent = node
            leaf.key = kb[pos:]
            leaf.value = np.array(value[total:n], dtype=SLOT_DTYPE)
            node.children[kb[pos : pos + psb]] = leaf
            self.evictable_size_ += n - total
            self._update_leaf_status(leaf)
            self._update_leaf_status(node)
            if n > inserted_len and self._inc_hit_count_and_check(leaf):
                self._backup_chain(leaf)
            return InsertResult(total, leaf)
        return InsertResult(total, node)

    def _unevict(self, node: HiTreeNode, fresh: np.ndarray) -> None:
        """An evicted node takes the inserting request's slots back (``_unevict_node_on_insert``)."""
        node.value = np.array(fresh, dtype=SLOT_DTYPE)
        if node.lock_ref > 0:
            self.protected_size_ += len(node)
        else:
            self.evictable_size_ += len(node)
        self._update_leaf_status(node)
        self._update_duplicate_tracking(node)
        self._update_leaf_status(node.parent)  # type: ignore[arg-type]

    def _inc_hit_count_and_check(self, node: HiTreeNode) -> bool:
        if node.value is None or self.is_write_back:
            return False
        node.hit_count += 1
        return node.host_value is None and node.hit_count >= self.write_through_threshold

    # ------------------------------------------------------------------ backup

    def _backup_chain(self, node: HiTreeNode) -> int:
        """Write-through backup of ``node`` and its unbacked ancestors, root side first;
        stops at the first that finds no host room. Returns the last written length."""
        chain = [node]
        x = node.parent
        while x is not None and x is not self.root_node and x.host_value is None:
            chain.append(x)  # type: ignore[arg-type]
            x = x.parent
        chain.reverse()
        return self._execute_backup(chain, write_back=False)

    def _execute_backup(self, chain: list[HiTreeNode], write_back: bool) -> int:
        written = 0
        for node in chain:
            assert node.value is not None
            if node.host_value is not None:
                continue
            need = node.value.shape[0]
            avail = self.host_pool.available_size()
            if avail < need and self.evict_host(need - avail) < need - avail:
                self.stats["backup_failed"] += 1
                return 0
            host = self.host_pool.alloc(need)
            if host is None:
                self.stats["backup_failed"] += 1
                return 0
            self._write_queue.append(node.id)
            node.host_value = host
            self.stats["backed_up"] += need
            locked = not write_back
            if locked:
                self.inc_lock_ref(node)
            node.write_through_pending_id = node.id
            self.ongoing_write_through[node.id] = _OngoingWrite(node, locked, [node])
            written = need
        return written

    def _writing_check(self, drain: bool) -> None:
        """Finish the write acks: all submitted ones (``drain``: submit and finish all)."""
        if drain:
            self._flush_writes()
        while self._ack_write_queue:
            for ack_id in self._ack_write_queue.pop(0):
                if ack_id in self.ongoing_write_through:
                    self._finish_write_ack(ack_id)

    def _flush_writes(self) -> None:
        if self._write_queue:
            self._ack_write_queue.append(self._write_queue)
            self._write_queue = []

    def _finish_write_ack(self, ack_id: int) -> None:
        op = self.ongoing_write_through.pop(ack_id)
        for x in op.publish:
            if x.write_through_pending_id == ack_id:
                x.write_through_pending_id = None
                self._update_duplicate_tracking(x)
        if op.locked:
            self.dec_lock_ref(op.node)

    def ack(self) -> None:
        """One scheduler step's HiCache poll (``check_hicache_events``): submit the queued
        backups, finish every write and load ack (transfers are synchronous here)."""
        self._flush_writes()
        self._writing_check(drain=False)
        if self._load_queue:
            self._ack_load_queue.append(self._load_queue)
            self._load_queue = []
        while self._ack_load_queue:
            for ack_id in self._ack_load_queue.pop(0):
                op = self.ongoing_load_back.pop(ack_id)
                self.dec_lock_ref(op.node)
                self.dec_host_lock_ref(op.node, op.host_receipt)
                self._finish_load_back(op.node)

    def _finish_load_back(self, anchor: HiTreeNode) -> None:
        x: HiTreeNode | None = anchor
        while x is not None and x is not self.root_node:
            if self.is_write_back:
                if x.load_back_pending_id != anchor.id:
                    x = x.parent  # type: ignore[assignment]
                    continue
                x.load_back_pending_id = None
            self._update_duplicate_tracking(x)
            x = x.parent  # type: ignore[assignment]

    # ------------------------------------------------------------------ locks

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock the path: host-only nodes at the bottom without a ledger move, then the
        device part (evictable -> protected). Returns the tokens moved (>= 0)."""
        root = self.root_node
        cur: HiTreeNode = node  # type: ignore[assignment]
        while cur is not root and cur.value is None:
            cur.lock_ref += 1
            cur = cur.parent  # type: ignore[assignment]
        delta = 0
        while cur is not root:
            if cur.lock_ref == 0:
                k = len(cur)
                self.evictable_size_ -= k
                self.protected_size_ += k
                delta += k
            cur.lock_ref += 1
            self.evictable_leaves.discard(cur)
            cur = cur.parent  # type: ignore[assignment]
        self._update_leaf_status(node)
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        root = self.root_node
        cur: HiTreeNode = node  # type: ignore[assignment]
        delta = 0
        while cur is not root:
            assert cur.lock_ref > 0, f"FULL release hit lock_ref=0 on node {cur.id}"
            if cur.lock_ref == 1 and cur.value is not None:
                k = len(cur)
                self.evictable_size_ += k
                self.protected_size_ -= k
                delta += k
            cur.lock_ref -= 1
            if cur.lock_ref == 0:
                self._update_leaf_status(cur)
            cur = cur.parent  # type: ignore[assignment]
        self._update_leaf_status(node)
        return delta

    def inc_host_lock_ref(self, node: HiTreeNode) -> int | None:
        """Pin ``node``'s host copy; returns the receipt (None: nothing was pinned)."""
        if node.host_value is None and not self.is_write_back:
            self._update_leaf_status(node)
            return None
        if node.host_uuid is None:
            self._next_uuid += 1
            node.host_uuid = self._next_uuid
        node.host_lock_ref += 1
        self._update_leaf_status(node)
        return node.host_uuid

    def dec_host_lock_ref(self, node: HiTreeNode, receipt: int | None) -> None:
        anchor = node
        if receipt is not None:
            x: HiTreeNode = node
            while True:
                if x.host_value is None and not self.is_write_back:
                    break
                assert x.host_lock_ref > 0, f"host release hit host_lock_ref=0 on node {x.id}"
                x.host_lock_ref -= 1
                self._update_leaf_status(x)
                if x.host_uuid == receipt:
                    break
                x = x.parent  # type: ignore[assignment]
        self._update_leaf_status(anchor)

    # ------------------------------------------------------------------ device eviction

    def evict(self, num_tokens: int) -> int:
        """``evict(EvictParams(num_tokens))``: stop once ``num_tokens`` are freed."""
        return self._evict(num_tokens, target=None)

    def evict_for_alloc(self, num_tokens: int) -> int:
        """``evict_for_alloc``: stop once the device pool has ``num_tokens`` more free."""
        if num_tokens <= 0:
            return 0
        return self._evict(num_tokens, target=self.token_to_kv_pool_allocator.available_size() + num_tokens)

    def _evict(self, request: int, target: int | None) -> int:
        alloc = self.token_to_kv_pool_allocator
        tracker = [0]
        if request > 0 and not (target is not None and alloc.available_size() >= target):
            quota = max(request, self.evictable_size_) if target is not None else request
            heap = [(n.last_access_time, n.id, n) for n in self.evictable_leaves]
            heapq.heapify(heap)
            last: HiTreeNode | None = None
            while True:
                if last is not None and last.parent is not None and last.parent in self.evictable_leaves:
                    p = last.parent
                    heapq.heappush(heap, (p.last_access_time, p.id, p))
                last = None
                victim = None
                while tracker[0] < quota and heap:
                    _, _, x = heapq.heappop(heap)
                    if x in self.evictable_leaves:
                        victim = x
                        break
                if victim is None:
                    break
                last = victim
                if victim.host_value is not None:
                    self._demote(victim, tracker)
                elif not self.is_write_back:
                    self._delete_unbacked_leaf(victim, tracker)
                elif self._execute_backup([victim], write_back=True) > 0:
                    self._writing_check(drain=True)
                    self._demote(victim, tracker)
                else:
                    self._drop_subtree_no_host(victim, tracker)
                if target is not None and alloc.available_size() >= target:
                    break
        if self.is_write_back:
            self._writing_check(drain=True)
        self.evicted_tokens_total += tracker[0]
        return tracker[0]

    def _demote(self, node: HiTreeNode, tracker: list[int]) -> None:
        """Free a backed-up node's device slots; it stays, host only."""
        k = node.value.shape[0]  # type: ignore[union-attr]
        self.evictable_size_ -= k
        tracker[0] += k
        self.token_to_kv_pool_allocator.free_segment(node.value, 0)
        node.value = None
        self.stats["demoted"] += k
        self._update_leaf_status(node)
        self._update_leaf_status(node.parent)  # type: ignore[arg-type]

    def _delete_unbacked_leaf(self, node: HiTreeNode, tracker: list[int]) -> None:
        k = node.value.shape[0]  # type: ignore[union-attr]
        self.evictable_size_ -= k
        tracker[0] += k
        self.stats["deleted_unbacked"] += k
        self.token_to_kv_pool_allocator.free_segment(node.value, 0)
        self.evictable_leaves.discard(node)
        self.evictable_host_leaves.discard(node)
        parent: HiTreeNode = node.parent  # type: ignore[assignment]
        self._remove_leaf_from_parent(node)
        self._update_leaf_status(parent)
        self._delete_tombstone_ancestors(parent)

    def _delete_tombstone_ancestors(self, cur: HiTreeNode) -> None:
        """Delete childless ancestors on neither tier (up to a live or locked node)."""
        root = self.root_node
        while cur is not root and not cur.children:
            if cur.lock_ref > 0 or cur.host_lock_ref > 0:
                break
            if cur.value is not None or cur.host_value is not None:
                self._update_leaf_status(cur)
                break
            self.evictable_host_leaves.discard(cur)
            parent: HiTreeNode = cur.parent  # type: ignore[assignment]
            self._remove_leaf_from_parent(cur)
            self._update_leaf_status(parent)
            cur = parent

    def _drop_subtree_no_host(self, node: HiTreeNode, tracker: list[int]) -> bool:
        """write_back with no host room: drop an unlocked subtree (its host-only
        descendants' host slots too) so device eviction keeps going."""
        if node.load_back_pending_id is not None or node.lock_ref > 0 or node.host_lock_ref > 0:
            return False
        desc: list[HiTreeNode] = []
        stack = list(node.children.values())
        while stack:
            x = stack.pop()
            if (x.write_through_pending_id is not None or x.load_back_pending_id is not None
                    or x.lock_ref > 0 or x.host_lock_ref > 0):
                return False
            desc.append(x)
            stack.extend(x.children.values())
        for x in reversed(desc):
            if x.host_value is not None:
                self.host_pool.free(x.host_value)
                x.host_value = None
            self.evictable_leaves.discard(x)
            self.evictable_host_leaves.discard(x)
            self._remove_leaf_from_parent(x)
        self._delete_unbacked_leaf(node, tracker)
        self.stats["dropped_no_host"] += 1
        return True

    # ------------------------------------------------------------------ host eviction

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host slots if it can: under write_back host copies
        of nodes still on device first, then LRU H-leaves (deleted). Returns host tokens freed."""
        freed = 0
        if self.is_write_back:
            freed = self._reclaim_host_duplicates(num_tokens)
        heap = [(n.last_access_time, n.id, n) for n in self.evictable_host_leaves]
        heapq.heapify(heap)
        while freed < num_tokens and heap:
            _, _, x = heapq.heappop(heap)
            if x not in self.evictable_host_leaves:
                continue
            k = x.host_value.shape[0]  # type: ignore[union-attr]
            self.host_pool.free(x.host_value)  # type: ignore[arg-type]
            x.host_value = None
            freed += k
            self.stats["host_evicted"] += k
            self.evictable_host_leaves.discard(x)
            parent: HiTreeNode = x.parent  # type: ignore[assignment]
            self._remove_leaf_from_parent(x)
            self._delete_tombstone_ancestors(parent)
            if parent is not None and parent in self.evictable_host_leaves:
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        return freed

    def _reclaim_host_duplicates(self, num_tokens: int) -> int:
        freed = 0
        swept: list[int] = []
        for spare_leaves in (True, False):
            if freed >= num_tokens:
                break
            for x in self.full_host_duplicates.values():
                if freed >= num_tokens:
                    break
                if x.value is None or x.host_value is None:
                    swept.append(x.id)
                    continue
                if spare_leaves and x in self.evictable_leaves:
                    continue
                if (x.write_through_pending_id is not None or x.load_back_pending_id is not None
                        or x.host_lock_ref > 0):
                    continue
                k = x.host_value.shape[0]
                self.host_pool.free(x.host_value)
                x.host_value = None
                freed += k
                self.stats["host_reclaimed"] += k
                swept.append(x.id)
        for i in swept:
            self.full_host_duplicates.pop(i, None)
        return freed

    # ------------------------------------------------------------------ load-back

    def init_load_back(self, m: HiMatchResult, mem_quota: int | None = None) -> tuple[int, HiTreeNode]:
        """Load the host-only part of a match back to device (``init_load_back``).

        Returns:
            ``(tokens loaded, node)``: the anchor ``m.best_match_node`` when something was
            loaded, else ``(0, m.last_device_node)``.
        """
        best = m.best_match_node
        if (best.evicted or m.host_hit_len > 0) and self.load_back(best, mem_quota):
            n = 0
            x = best
            while x is not m.last_device_node:
                n += x.value.shape[0]  # type: ignore[union-attr]
                x = x.parent  # type: ignore[assignment]
            if n == 0:
                return 0, m.last_device_node
            return n, best
        return 0, m.last_device_node

    def load_back(self, node: HiTreeNode, mem_quota: int | None = None) -> bool:
        """Allocate device slots for the evicted nodes from ``node`` up and give them the
        host copies' contents; host slots are kept. ``node`` stays locked (device and
        host) until the ack."""
        receipt = self.inc_host_lock_ref(node)
        delta = self.inc_lock_ref(node)
        nodes: list[HiTreeNode] = []
        x = node
        while x.evicted:
            assert x.host_value is not None
            nodes.append(x)
            x = x.parent  # type: ignore[assignment]
        nodes.reverse()
        if any(y.load_back_pending_id not in (None, node.id) for y in nodes):
            nodes = []
        need = sum(y.host_value.shape[0] for y in nodes)  # type: ignore[union-attr]
        alloc = self.token_to_kv_pool_allocator
        refuse = need < max(1, self.load_back_threshold) or (mem_quota is not None and need + delta > mem_quota)
        if not refuse and alloc.available_size() < need:
            self.evict_for_alloc(need - alloc.available_size())
            refuse = alloc.available_size() < need
        device = None if refuse else alloc.alloc(need)
        if refuse:
            self.dec_lock_ref(node)
            self.dec_host_lock_ref(node, receipt)
            self.stats["load_back_refused"] += 1
            return False
        self.dec_lock_ref(node)
        if device is None:  # pragma: no cover - available_size said it fits
            self.dec_host_lock_ref(node, receipt)
            return False
        self._load_queue.append(node.id)
        if self.is_write_back:
            for y in nodes:
                y.load_back_pending_id = node.id
        off = 0
        for y in nodes:
            k = y.host_value.shape[0]  # type: ignore[union-attr]
            y.value = np.array(device[off : off + k], dtype=SLOT_DTYPE)
            off += k
            if y.lock_ref > 0:
                self.protected_size_ += k
            else:
                self.evictable_size_ += k
            self._update_leaf_status(y)
        self._update_leaf_status(node)
        self.stats["loaded_back"] += need
        self.inc_lock_ref(node)
        self.ongoing_load_back[node.id] = _OngoingLoad(node, receipt)
        return True

    # ------------------------------------------------------------------ reads

    def peek_prefix_len(self, key: np.ndarray) -> int:
        """The device part of what ``match_prefix_hi`` would match (the prefix a request
        reuses without a load-back), touching and splitting nothing."""
        return self.peek_prefix_hi(key)[0]

    def peek_prefix_hi(self, key: np.ndarray) -> tuple[int, int]:
        """``(device_prefix_len, host_hit_len)`` that ``match_prefix_hi`` would return,
        touching and splitting nothing (the scheduler model's admission reads it)."""
        ps = self.page_size
        n = floor_align(key.shape[0], ps)
        if n == 0:
            return 0, 0
        kb = key[:n].tobytes()
        nb, psb = n * 8, ps * 8
        node: HiTreeNode = self.root_node  # type: ignore[assignment]
        pos = 0
        device_len = host_len = 0
        while pos < nb:
            child = node.children.get(kb[pos : pos + psb])
            if child is None or (child.value is None and child.host_value is None):
                break
            m = len(child) if kb.startswith(child.key, pos) else self._matched_units(child.key, kb, pos)
            # a device node's ancestors are on device: host-only nodes sit below them
            if child.value is not None:
                device_len += m
            else:
                host_len += m
            pos += m * 8
            if m < len(child):
                break
            node = child
        return device_len, host_len

    def peek_match_lock(self, keys):  # noqa: ANN001, ANN201
        raise NotImplementedError("HiRadixCache.peek_match_lock: not wired yet (a match may end on host)")

    def path_len(self, node: TreeNode) -> int:
        n = 0
        root = self.root_node
        while node is not root:
            n += len(node)
            node = node.parent  # type: ignore[assignment]
        return n

    def path_device_indices(self, node: TreeNode) -> np.ndarray:
        values = []
        root = self.root_node
        while node is not root:
            if node.value is not None:
                values.append(node.value)
            node = node.parent  # type: ignore[assignment]
        if not values:
            return np.empty(0, dtype=SLOT_DTYPE)
        values.reverse()
        return np.concatenate(values)

    def iter_nodes(self) -> Iterator[HiTreeNode]:  # type: ignore[override]
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            yield node  # type: ignore[misc]
            stack.extend(node.children.values())

    def all_values_flatten(self) -> np.ndarray:
        values = [n.value for n in self.iter_nodes() if n.value is not None]
        return np.concatenate(values) if values else np.empty(0, dtype=SLOT_DTYPE)

    def all_host_values_flatten(self) -> np.ndarray:
        values = [n.host_value for n in self.iter_nodes() if n.host_value is not None]
        return np.concatenate(values) if values else _EMPTY_HOST.copy()

    def device_tokens(self) -> int:
        return sum(n.value.shape[0] for n in self.iter_nodes() if n.value is not None)

    def host_tokens(self) -> int:
        return sum(n.host_value.shape[0] for n in self.iter_nodes() if n.host_value is not None)
