"""MambaRadixCache: the radix tree of a hybrid linear-attention model, as SGLang 0.5.23 runs it.

SGLang 0.5.23 runs a hybrid Mamba / GDN model on ``UnifiedRadixCache`` with a FULL and a
MAMBA component (``mem_cache/unified_radix_cache.py``, ``unified_cache/unified_tree_core.py``,
``unified_cache/components/{full,mamba}.py``). Each node keeps its FULL slots (``value``, as
in ``RadixCache``) and optionally ONE checkpointed Mamba state slot (``mamba_value``): the
recurrent state after the node's last token. A node without one is a *tombstone* for the
Mamba side; its full KV is still cached::

    root -- A [full, s3] -- B [full, None] -- C [full, s7]     B: no state (tombstone)

A request can resume only where a state exists, so:

- match is state-gated: the usable end is the deepest matched node holding a state (C
  above, not B); the full hit past it is reported as ``branching_seqlen`` (floored to the
  checkpoint grid, ``lcm(chunk size, page)``) so the request's next checkpoint lands there;
- the matched state is copied (copy-on-write) into a slot of the request's own
  (``cow_state``), evicting one checkpoint when the Mamba pool is empty;
- insert attaches the request's state slot to the node its key ends at: a new leaf, a
  tombstone (the state is restored), or a node that already has one (``mamba_exist``: the
  caller frees the slot it offered);
- two locks: FULL locks the whole path, MAMBA only the end node;
- two evictable / protected ledgers (full tokens, Mamba slots), two eviction walks: FULL
  deletes LRU leaves whole (heap on access time, state freed with them); MAMBA walks its
  own LRU list of state-holding nodes (a match refreshes only the state it used), deleting
  a node whole when it is an evictable leaf, else tombstoning its state (the full KV stays);
- an optional cap on states per root path (``max_states_per_path``, SGLang's
  ``--mamba-max-states-per-path``, off = -1): after an insert the shallowest eligible
  interior states beyond the cap are tombstoned (not the tail, forks, locked nodes or leaves).

Access times are floats from one counter, ticked where SGLang's
``get_and_increase_time_counter`` ticks (twice per new node, once per node touched by an
insert, once per split, once per match end, once when an insert sets or refreshes an
existing node's state). Frees are applied in the order SGLang emits its cache actions
(per deleted node: full slots, then the state slot).

Namespaces (SGLang's ``extra_key``) key the tree as ``RadixCache`` keys it: a node keeps its
key's ``key_prefix`` in ``ns``, put before the first page in its parent's children, so equal
tokens in two namespaces never share a node (or a state).

Not mirrored: HiCache / host layers, sessions, the int8 checkpoint pool, shared-pool
(Full -> Mamba donor) allocators, priorities other than 0, the Rust tree core's internals
(same semantics assumed).
"""

from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING, Iterator, NamedTuple, Sequence

import numpy as np

from allocator.mamba import MAMBA_TRACK_INTERVAL
from allocator.pages import floor_align
from allocator.radix_cache import MatchResult, RadixCache, TreeNode
from allocator.token_to_kv import SLOT_DTYPE
from traces.namespaces import key_prefix

if TYPE_CHECKING:
    from allocator.mamba import MambaReqKv, MambaSlotAllocator

__all__ = ["MambaInsertResult", "MambaMatchResult", "MambaRadixCache", "MambaTreeNode", "MambaTreeState",
           "restore_mamba_tree", "save_mamba_tree"]

# SGLang's default ``mamba_cache_chunk_size`` (FLA's CHUNK_SIZE) when the model names none.
DEFAULT_CHUNK_SIZE = 64


class MambaTreeNode(TreeNode):
    """A node with a Mamba side: its checkpointed state slot (None = tombstone), the
    Mamba lock count, and its links in the Mamba LRU list."""

    __slots__ = ("mamba_value", "mamba_lock_ref", "lru_prev", "lru_next")

    def __init__(self, node_id: int, access_time: float) -> None:
        super().__init__(node_id, access_time)  # type: ignore[arg-type]
        self.mamba_value: int | None = None
        self.mamba_lock_ref = 0
        self.lru_prev: MambaTreeNode | None = None
        self.lru_next: MambaTreeNode | None = None

    def __repr__(self) -> str:
        return (f"MambaTreeNode(id={self.id}, len={len(self)}, state={self.mamba_value}, "
                f"lock={self.lock_ref}/{self.mamba_lock_ref})")


class MambaMatchResult(NamedTuple):
    prefix_len: int  # units usable: depth of the deepest matched node holding a state
    last_node: MambaTreeNode
    branching_seqlen: int | None  # grid-floored full hit past the usable end, else None
    full_hit: int  # units of full KV matched


class MambaInsertResult(NamedTuple):
    prefix_len: int
    last_node: MambaTreeNode
    mamba_exist: bool  # the end node already had a state: the offered slot was not taken


class _MambaLru:
    """SGLang's ``UnifiedLRUList`` for the Mamba component: head = most recent."""

    def __init__(self) -> None:
        self.head = MambaTreeNode(-1, 0.0)
        self.tail = MambaTreeNode(-2, 0.0)
        self.head.lru_next = self.tail
        self.tail.lru_prev = self.head
        self.members: set[int] = set()

    def in_list(self, node: MambaTreeNode | None) -> bool:
        return node is not None and node.id in self.members

    def insert_mru(self, node: MambaTreeNode) -> None:
        assert node.id not in self.members
        self.members.add(node.id)
        node.lru_prev = self.head
        node.lru_next = self.head.lru_next
        self.head.lru_next.lru_prev = node  # type: ignore[union-attr]
        self.head.lru_next = node

    def remove(self, node: MambaTreeNode) -> None:
        self.members.remove(node.id)
        node.lru_prev.lru_next = node.lru_next  # type: ignore[union-attr]
        node.lru_next.lru_prev = node.lru_prev  # type: ignore[union-attr]
        node.lru_prev = node.lru_next = None

    def reset_mru(self, node: MambaTreeNode) -> None:
        self.remove(node)
        self.insert_mru(node)

    def prev_unlocked(self, node: MambaTreeNode) -> MambaTreeNode | None:
        x = node.lru_prev
        while x is not self.head and x.mamba_lock_ref > 0:  # type: ignore[union-attr]
            x = x.lru_prev  # type: ignore[union-attr]
        return None if x is self.head else x

    def lru_unlocked(self) -> MambaTreeNode | None:
        return self.prev_unlocked(self.tail)

    def __iter__(self) -> Iterator[MambaTreeNode]:
        x = self.head.lru_next
        while x is not self.tail:
            yield x  # type: ignore[misc]
            x = x.lru_next  # type: ignore[union-attr]


class MambaRadixCache(RadixCache):
    """The radix cache with SGLang's Mamba component (see the module docstring).

    Args:
        page_size: units per page.
        token_to_kv_pool_allocator: the full KV allocator (``free_segment``, ``available_size``).
        mamba_allocator: the Mamba slot free list (``HybridReqToTokenPool.mamba_allocator``).
        chunk_size: the model's Mamba chunk size; the checkpoint grid is
            ``lcm(max(chunk_size, page_size), page_size)``.
        extra_buffer: the ``extra_buffer`` strategies; without it SGLang requires page 1.
        max_states_per_path: cap on states per root path, -1 = unlimited.
        is_eagle: key by token bigrams.

    Attributes:
        mamba_lru: state-holding nodes, most recent first.
        stats: counters (tombstoned states, leaves deleted by the Mamba walk, gated
            matches, copy-on-writes, states capped off a path).
    """

    def __init__(
        self,
        page_size: int,
        token_to_kv_pool_allocator,  # noqa: ANN001 - any full KV allocator
        mamba_allocator: MambaSlotAllocator,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        extra_buffer: bool = False,
        max_states_per_path: int = -1,
        is_eagle: bool = False,
    ) -> None:
        if not extra_buffer and page_size != 1:
            raise ValueError(f"MambaRadixCache: no_buffer needs page size 1, found {page_size}")
        if max_states_per_path == 0 or max_states_per_path < -1:
            raise ValueError(f"MambaRadixCache: max_states_per_path must be -1 or positive, found {max_states_per_path}")
        self.mamba_allocator = mamba_allocator
        cache_chunk = max(chunk_size, page_size)
        self.extra_buffer = extra_buffer
        self.state_chunk = chunk_size
        self.cache_chunk = cache_chunk
        self.checkpoint_grid = math.lcm(cache_chunk, page_size)
        # extra_buffer's decode tracking grid (SGLang ``mamba_track_grid``)
        self.track_grid = math.lcm(self.checkpoint_grid, MAMBA_TRACK_INTERVAL)
        self.max_states_per_path = max_states_per_path
        super().__init__(page_size, token_to_kv_pool_allocator, disable=False, is_eagle=is_eagle)

    def reset(self) -> None:
        self._clock = 0.0
        self._next_id = 0
        self.mamba_lru = _MambaLru()
        self.root_node = self._new_node()
        self.root_node.lock_ref = 1
        self.evictable_size_ = 0
        self.protected_size_ = 0
        self.mamba_evictable_size_ = 0
        self.mamba_protected_size_ = 0
        self.evictable_leaves: set[TreeNode] = set()
        self.evicted_tokens_total = 0
        self.mamba_evicted_total = 0
        self._heap = []
        self.stats = {"tombstoned": 0, "mamba_leaf_deleted": 0, "gated_match": 0, "cow": 0, "path_capped": 0}

    def _tick(self) -> float:  # type: ignore[override]
        t = self._clock
        self._clock += 1.0
        return t

    def _new_node(self) -> MambaTreeNode:  # type: ignore[override]
        self._next_id += 1
        node = MambaTreeNode(self._next_id, self._tick())
        self._tick()  # creation_time
        return node

    def mamba_evictable_size(self) -> int:
        return self.mamba_evictable_size_

    def mamba_protected_size(self) -> int:
        return self.mamba_protected_size_

    # ------------------------------------------------------------------ leaf sets

    def _is_device_leaf(self, node: MambaTreeNode) -> bool:
        return node is not self.root_node and node.lock_ref == 0 and node.mamba_lock_ref == 0 and not node.children

    def _update_leaf_status(self, node: TreeNode) -> None:
        if self._is_device_leaf(node):  # type: ignore[arg-type]
            self.evictable_leaves.add(node)
        else:
            self.evictable_leaves.discard(node)

    # ------------------------------------------------------------------ states

    def _set_state(self, node: MambaTreeNode, slot: int) -> None:
        """``set_component_device_value``: store, join the LRU as most recent, ledger."""
        node.mamba_value = slot
        self.mamba_lru.insert_mru(node)
        if node.mamba_lock_ref > 0:
            self.mamba_protected_size_ += 1
        else:
            self.mamba_evictable_size_ += 1

    def _drop_state(self, node: MambaTreeNode, tracker: dict[str, int]) -> int:
        """Take an unlocked node's state off it (``evict_component``); return the slot to free."""
        slot = node.mamba_value
        assert slot is not None
        self.mamba_evictable_size_ -= 1
        tracker["mamba"] += 1
        node.mamba_value = None
        if self.mamba_lru.in_list(node):
            self.mamba_lru.remove(node)
        return slot

    def _free_states(self, slots: list[int]) -> None:
        for s in slots:
            self.mamba_allocator.free(np.asarray([s], dtype=np.int64))

    # ------------------------------------------------------------------ split

    def _split_node(self, child: TreeNode, split_len: int) -> MambaTreeNode:  # type: ignore[override]
        """Split ``child`` after ``split_len`` units. The state (an end-of-node value)
        stays on the lower part; the upper part starts with none and no Mamba lock."""
        psb = self.page_size * 8
        cut = split_len * 8
        upper = self._new_node()
        c: MambaTreeNode = child  # type: ignore[assignment]
        upper.parent = c.parent
        upper.lock_ref = c.lock_ref
        upper.ns = c.ns
        upper.key = c.key[:cut]
        upper.value = c.value[:split_len]
        c.key = c.key[cut:]
        c.value = c.value[split_len:]
        c.parent = upper
        upper.children = {c.ns + c.key[:psb]: c}
        upper.parent.children[upper.ns + upper.key[:psb]] = upper
        c.last_access_time = self._tick()
        self._update_leaf_status(upper)
        self._update_leaf_status(c)
        if self.journal is not None:
            self.journal.split(upper, c)
        return upper

    # ------------------------------------------------------------------ match

    def match_prefix(self, key: np.ndarray) -> MatchResult:
        m = self.match_prefix_mamba(key)
        return MatchResult(m.prefix_len, m.last_node)

    def match_prefix_mamba(self, key: np.ndarray) -> MambaMatchResult:
        """State-gated longest prefix of ``key`` (units); see the module docstring.

        Splits the node where the full match ends inside it; moves the used state to the
        front of the Mamba LRU and stamps the access time of the usable end and its ancestors.
        """
        ps = self.page_size
        n = floor_align(key.shape[0], ps)
        root: MambaTreeNode = self.root_node  # type: ignore[assignment]
        if n == 0:
            return MambaMatchResult(0, root, None, 0)
        kb = key[:n].tobytes()
        nb, psb = n * 8, ps * 8
        ns = key_prefix(key)  # the namespace's prefix before each child's first page
        node = root
        pos = 0
        best, best_len = root, 0
        while pos < nb:
            child = node.children.get(ns + kb[pos : pos + psb])
            if child is None:
                break
            m = self._matched(child.key, kb, pos)
            if m < len(child):
                child = self._split_node(child, m)
            node = child  # type: ignore[assignment]
            pos += m * 8
            if node.mamba_value is not None:
                best, best_len = node, pos // 8
            # (after a split the next page differs from the lower part's: the walk ends)
        if best.mamba_value is not None:
            self.mamba_lru.reset_mru(best)
        t = self._tick()
        x: TreeNode | None = best
        while x is not None:
            x.last_access_time = t  # type: ignore[assignment]
            t -= 0.00001
            x = x.parent
        full_hit = pos // 8
        aligned = full_hit // self.checkpoint_grid * self.checkpoint_grid
        branching = aligned if aligned > best_len else None
        if branching is not None:
            self.stats["gated_match"] += 1
        return MambaMatchResult(best_len, best, branching, full_hit)

    def _matched(self, ckey: bytes, kb: bytes, pos: int) -> int:
        if kb.startswith(ckey, pos):
            return len(ckey) // 8
        return self._matched_units(ckey, kb, pos)

    def peek_prefix_len(self, key: np.ndarray) -> int:
        """Length ``match_prefix`` would return, without touching or splitting anything."""
        ps = self.page_size
        n = floor_align(key.shape[0], ps)
        if n == 0:
            return 0
        kb = key[:n].tobytes()
        nb, psb = n * 8, ps * 8
        ns = key_prefix(key)
        node, pos, best = self.root_node, 0, 0
        while pos < nb:
            child = node.children.get(ns + kb[pos : pos + psb])
            if child is None:
                break
            m = self._matched(child.key, kb, pos)
            pos += m * 8
            if m < len(child):
                break
            node = child
            if node.mamba_value is not None:  # type: ignore[attr-defined]
                best = pos // 8
        return best

    def peek_match_lock(self, keys: Sequence[np.ndarray]) -> tuple[np.ndarray, int]:
        """``RadixCache.peek_match_lock`` with the state gate: the prefix each key would
        match (``peek_prefix_len``) and the FULL tokens the locks of those match ends
        would protect (each unlocked node on a path up to its usable end, once)."""
        prefix, full_cost, _ = self.peek_match_lock_mamba(keys)
        return prefix, full_cost

    def peek_match_lock_mamba(self, keys: Sequence[np.ndarray]) -> tuple[np.ndarray, int, int]:
        """What matching and locking ``keys`` one after the other would do, without
        touching, splitting or locking anything.

        Returns:
            Each key's usable prefix (units), the FULL tokens the locks would move from
            evictable to protected, and the states they would (each usable end holding
            an unlocked state, once).
        """
        prefix = np.zeros(len(keys), dtype=np.int64)
        ps = self.page_size
        psb = ps * 8
        full_nodes: dict[int, int] = {}  # id of an unlocked node on a locked path -> its length
        state_nodes: set[int] = set()
        for i, key in enumerate(keys):
            n = floor_align(key.shape[0], ps)
            if n == 0:
                continue
            kb = key[:n].tobytes()
            nb = n * 8
            ns = key_prefix(key)
            node: MambaTreeNode = self.root_node  # type: ignore[assignment]
            pos = 0
            path: list[MambaTreeNode] = []
            best = 0  # nodes of ``path`` up to the usable end
            while pos < nb:
                child = node.children.get(ns + kb[pos : pos + psb])
                if child is None:
                    break
                m = self._matched(child.key, kb, pos)
                if m < len(child):
                    break  # the match ends inside: the lower part (and its state) is not reached
                node = child  # type: ignore[assignment]
                pos += m * 8
                path.append(node)
                if node.mamba_value is not None:
                    best = len(path)
                    prefix[i] = pos // 8
            for x in path[:best]:
                if x.lock_ref == 0:
                    full_nodes[x.id] = len(x)
            if best and path[best - 1].mamba_lock_ref == 0:
                state_nodes.add(path[best - 1].id)
        return prefix, sum(full_nodes.values()), len(state_nodes)

    def alloc_state_slot(self) -> int:
        """One Mamba slot for a state the tree is given (SGLang ``_alloc_mamba_slot``): the
        free list's head, else after evicting one checkpoint.

        Raises:
            MambaSlotsExhausted: none even after the eviction (SGLang asserts).
        """
        from allocator.mamba import MambaSlotsExhausted

        slot = self.mamba_allocator.alloc(1)
        if slot is None:
            self.evict_pools(0, 1)
            slot = self.mamba_allocator.alloc(1)
            if slot is None:
                raise MambaSlotsExhausted("Can not alloc mamba cache")
        return int(slot[0])

    def cow_state(self, node: MambaTreeNode, req: MambaReqKv) -> int | None:
        """Copy-on-write of a matched state (``finalize_match_result_in_cache``).

        When ``node`` holds a state, the request gets a slot of its own (unless it holds
        one already: a continuing chunk), taken from the free list or, when that is
        empty, after evicting one checkpoint with ``node`` locked; ``req.mamba_cow_src``
        names the state copied. Returns the source slot, or None (nothing to copy).

        Raises:
            MambaSlotsExhausted: no slot even after the eviction (SGLang asserts).
        """
        from allocator.mamba import MambaSlotsExhausted

        src = node.mamba_value if node is not self.root_node else None
        if src is None:
            return None
        if not req.holds_mamba:
            dst = self.mamba_allocator.alloc(1)
            if dst is None:
                self.inc_lock_ref(node)
                self.evict_pools(0, 1)
                dst = self.mamba_allocator.alloc(1)
                self.dec_lock_ref(node)
                if dst is None:
                    raise MambaSlotsExhausted("Can not alloc mamba cache")
            req.mamba_pool_idx = int(dst[0])
        req.mamba_cow_src = src
        self.stats["cow"] += 1
        return src

    # ------------------------------------------------------------------ insert

    def insert(self, key: np.ndarray, value: np.ndarray) -> MambaInsertResult:  # type: ignore[override]
        raise TypeError("MambaRadixCache.insert needs a state slot: use insert_mamba")

    def insert_mamba(self, key: np.ndarray, value: np.ndarray, mamba_value: int,
                     prev_prefix_len: int = 0) -> MambaInsertResult:
        """Insert ``key`` -> ``value`` with the request's state slot ``mamba_value``
        (``UnifiedTreeCore.begin_insert``).

        Args:
            prev_prefix_len: the request's ``cache_protected_len`` (its own slots start
                there): duplicates of tree slots at or past it are freed.

        Returns:
            ``mamba_exist`` True when the end node already had a state (or the key was
            empty): the tree did not take ``mamba_value``, the caller still owns it.
        """
        ps = self.page_size
        n = floor_align(key.shape[0], ps)
        root: MambaTreeNode = self.root_node  # type: ignore[assignment]
        root.last_access_time = self._tick()
        if n == 0:
            return MambaInsertResult(0, root, True)
        alloc = self.token_to_kv_pool_allocator
        kb = key[:n].tobytes()
        nb, psb = n * 8, ps * 8
        ns = key_prefix(key)
        node = root
        pos = 0
        while pos < nb:
            child = node.children.get(ns + kb[pos : pos + psb])
            if child is None:
                break
            child.last_access_time = self._tick()
            m = self._matched(child.key, kb, pos)
            if m < len(child):
                child = self._split_node(child, m)
            total = pos // 8
            dup_start = max(0, prev_prefix_len - total)
            if dup_start < m:
                alloc.free_segment(value[total + dup_start : total + m], 0)  # type: ignore[union-attr]
            node = child  # type: ignore[assignment]
            pos += m * 8
        total = pos // 8
        target = node
        is_new_leaf = False
        if pos < nb:
            leaf = self._new_node()
            leaf.parent = node
            leaf.ns = ns
            leaf.key = kb[pos:]
            leaf.value = np.array(value[total:n], dtype=SLOT_DTYPE)
            node.children[ns + kb[pos : pos + psb]] = leaf
            self.evictable_size_ += n - total
            self._update_leaf_status(leaf)
            self._update_leaf_status(node)
            if self.journal is not None:
                self.journal.insert(leaf)
            target, is_new_leaf = leaf, True
        if is_new_leaf:
            target.mamba_value = int(mamba_value)
            self.mamba_lru.insert_mru(target)
            self.mamba_evictable_size_ += 1
        elif target.mamba_value is None:
            self._set_state(target, int(mamba_value))
            target.last_access_time = self._tick()
        else:
            self.mamba_lru.reset_mru(target)
            target.last_access_time = self._tick()
            return MambaInsertResult(total, target, True)
        if self.max_states_per_path >= 0:
            self._evict_excess_path_states(target)
        return MambaInsertResult(total, target, False)

    def _evict_excess_path_states(self, tail: MambaTreeNode) -> None:
        """The path cap: tombstone the shallowest eligible states beyond it (not the
        tail, a fork, a locked state or an evictable leaf)."""
        root = self.root_node
        holders = []
        x: MambaTreeNode | None = tail
        while x is not None and x is not root:
            if x.mamba_value is not None:
                holders.append(x)
            x = x.parent  # type: ignore[assignment]
        excess = len(holders) - self.max_states_per_path
        if excess <= 0:
            return
        tracker = {"full": 0, "mamba": 0}
        frees = []
        for x in reversed(holders):
            if excess <= 0 or x is tail:
                break
            if x.mamba_lock_ref > 0 or len(x.children) != 1 or x in self.evictable_leaves:
                continue
            frees.append(self._drop_state(x, tracker))
            self._update_leaf_status(x)
            self.stats["path_capped"] += 1
            excess -= 1
        self.mamba_evicted_total += tracker["mamba"]
        self._free_states(frees)

    # ------------------------------------------------------------------ locks

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock FULL on the whole path and MAMBA on ``node`` alone."""
        if self.journal is not None:
            self.journal.lock(node)
        root = self.root_node
        delta = 0
        cur = node
        while cur is not root:
            if cur.lock_ref == 0:
                k = len(cur)
                self.evictable_size_ -= k
                self.protected_size_ += k
                delta -= k
            cur.lock_ref += 1
            self.evictable_leaves.discard(cur)
            cur = cur.parent
        if node is not root:
            m: MambaTreeNode = node  # type: ignore[assignment]
            if m.mamba_lock_ref == 0 and m.mamba_value is not None:
                self.mamba_evictable_size_ -= 1
                self.mamba_protected_size_ += 1
            m.mamba_lock_ref += 1
        self._update_leaf_status(node)
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Release a lock: MAMBA on ``node``, then FULL on the whole path."""
        if self.journal is not None:
            self.journal.lock(node)
        root = self.root_node
        if node is not root:
            m: MambaTreeNode = node  # type: ignore[assignment]
            assert m.mamba_lock_ref > 0, f"Mamba release hit lock_ref=0 on node {m.id}"
            if m.mamba_lock_ref == 1 and m.mamba_value is not None:
                self.mamba_evictable_size_ += 1
                self.mamba_protected_size_ -= 1
            m.mamba_lock_ref -= 1
            if m.mamba_lock_ref == 0:
                self._update_leaf_status(m)
        delta = 0
        cur = node
        while cur is not root:
            assert cur.lock_ref > 0, f"FULL release hit lock_ref=0 on node {cur.id}"
            if cur.lock_ref == 1:
                k = len(cur)
                self.evictable_size_ += k
                self.protected_size_ -= k
                delta += k
            cur.lock_ref -= 1
            if cur.lock_ref == 0:
                self._update_leaf_status(cur)
            cur = cur.parent
        self._update_leaf_status(node)
        return delta

    # ------------------------------------------------------------------ eviction

    def evict(self, num_tokens: int) -> int:
        """FULL-only eviction of ``num_tokens`` (LRU leaves, whole nodes)."""
        return self.evict_pools(num_tokens, 0, targets=False)

    def evict_pools(self, full_tokens: int, mamba_num: int, targets: bool = True) -> int:
        """SGLang's ``evict_for_alloc(EvictParams(num_tokens, mamba_num=...))`` (``targets``)
        or ``evict`` (not): the FULL walk, then the MAMBA walk.

        With ``targets`` each walk stops as soon as its pool has the shortfall free
        (``available at start + shortfall``), the FULL walk not capped by its count;
        without, each walk stops once it evicted its count.

        Returns:
            FULL tokens evicted (leaf deletions from either walk).
        """
        alloc = self.token_to_kv_pool_allocator
        mpool = self.mamba_allocator
        tracker = {"full": 0, "mamba": 0}
        full_target = alloc.available_size() + full_tokens if targets and full_tokens > 0 else None  # type: ignore[union-attr]
        mamba_target = mpool.available_size() + mamba_num if targets and mamba_num > 0 else None
        # FULL walk
        if full_tokens > 0 and not (full_target is not None and alloc.available_size() >= full_target):  # type: ignore[union-attr]
            quota = max(full_tokens, tracker["full"] + self.evictable_size_) if full_target is not None else full_tokens
            heap = [(n.last_access_time, n.id, n) for n in self.evictable_leaves]
            heapq.heapify(heap)
            # SGLang pushes the parent of the leaf it just deleted when that made it a leaf
            last: TreeNode | None = None
            while True:
                if last is not None and last in self.evictable_leaves:
                    heapq.heappush(heap, (last.last_access_time, last.id, last))
                last = None
                x = None
                while tracker["full"] < quota and heap:
                    _, _, cand = heapq.heappop(heap)
                    if cand in self.evictable_leaves:
                        x = cand
                        break
                if x is None:
                    break
                last = x.parent
                self._delete_leaf(x, tracker)  # type: ignore[arg-type]
                if full_target is not None and alloc.available_size() >= full_target:  # type: ignore[union-attr]
                    break
        # MAMBA walk
        mamba_done = (mamba_target is not None and mpool.available_size() >= mamba_target) or tracker["mamba"] >= mamba_num
        if mamba_num > 0 and not mamba_done:
            lru = self.mamba_lru
            cursor = lru.lru_unlocked()
            while True:
                if cursor is not None and not lru.in_list(cursor):
                    cursor = lru.lru_unlocked()
                if tracker["mamba"] >= mamba_num or cursor is None:
                    break
                x = cursor
                cursor = lru.prev_unlocked(x)
                if x in self.evictable_leaves:
                    self._delete_leaf(x, tracker)
                    self.stats["mamba_leaf_deleted"] += 1
                else:
                    slot = self._drop_state(x, tracker)
                    self._update_leaf_status(x)
                    self._free_states([slot])
                    self.stats["tombstoned"] += 1
                if mamba_target is not None and mpool.available_size() >= mamba_target:
                    break
        self.evicted_tokens_total += tracker["full"]
        self.mamba_evicted_total += tracker["mamba"]
        return tracker["full"]

    def _delete_leaf(self, x: MambaTreeNode, tracker: dict[str, int]) -> None:
        """Delete an unlocked device leaf whole: its full slots, then its state."""
        psb = self.page_size * 8
        if self.journal is not None:
            self.journal.evict(x, x.parent)
        if self.listener is not None:
            self.listener.removed(x)
        n = len(x)
        self.evictable_size_ -= n
        tracker["full"] += n
        slot = self._drop_state(x, tracker) if x.mamba_value is not None else None
        self.token_to_kv_pool_allocator.free_segment(x.value, 0)  # type: ignore[union-attr]
        if slot is not None:
            self._free_states([slot])
        parent = x.parent
        del parent.children[x.ns + x.key[:psb]]
        self.evictable_leaves.discard(x)
        x.parent = None
        self._update_leaf_status(parent)

    # ------------------------------------------------------------------ reads

    def mamba_nodes(self) -> Iterator[MambaTreeNode]:
        return self.iter_nodes()  # type: ignore[return-value]

    def cached_states(self) -> list[int]:
        """Every state slot the tree holds (depth-first node order)."""
        return [n.mamba_value for n in self.mamba_nodes() if n.mamba_value is not None]

    def path_key(self, node: TreeNode) -> np.ndarray:
        """The units on the path root..node, in key order."""
        parts = []
        root = self.root_node
        while node is not root:
            parts.append(node.key)
            node = node.parent  # type: ignore[assignment]
        parts.reverse()
        return np.frombuffer(b"".join(parts), dtype=np.int64)


# ---------------------------------------------------------------------- save / restore


class MambaTreeState(NamedTuple):
    """A frozen copy of a ``MambaRadixCache`` (nodes, states, locks, ledgers, LRU order,
    clock) for checkpoints; the pools are saved by their owners."""

    nodes: tuple[tuple[int, int, bytes, np.ndarray, int | None, int, int, float], ...]  # id, parent id, key, value, state, locks, t
    lru: tuple[int, ...]  # node ids, most recent first
    sizes: tuple[int, int, int, int]
    clock: float
    next_id: int
    totals: tuple[int, int]
    stats: tuple[tuple[str, int], ...]
    namespaces: tuple[bytes, ...] = ()  # each node's namespace prefix, in ``nodes`` order; () when all b""


def save_mamba_tree(tree: MambaRadixCache) -> MambaTreeState:
    nodes = []
    order: list[MambaTreeNode] = []
    stack = [tree.root_node]
    while stack:
        x: MambaTreeNode = stack.pop()  # type: ignore[assignment]
        order.append(x)
        v = x.value.copy()
        v.flags.writeable = False
        nodes.append((x.id, -1 if x.parent is None else x.parent.id, x.key, v, x.mamba_value, x.lock_ref,
                      x.mamba_lock_ref, x.last_access_time))
        stack.extend(x.children.values())  # type: ignore[arg-type]
    namespaces = tuple(x.ns for x in order)
    return MambaTreeState(
        tuple(nodes), tuple(n.id for n in tree.mamba_lru),
        (tree.evictable_size_, tree.protected_size_, tree.mamba_evictable_size_, tree.mamba_protected_size_),
        tree._clock, tree._next_id, (tree.evicted_tokens_total, tree.mamba_evicted_total), tuple(tree.stats.items()),
        namespaces if any(namespaces) else (),
    )


def restore_mamba_tree(tree: MambaRadixCache, state: MambaTreeState) -> dict[int, MambaTreeNode]:
    """Rebuild ``tree`` from ``state`` (the tree's pools are not touched); returns the
    new nodes by id."""
    psb = tree.page_size * 8
    by_id: dict[int, MambaTreeNode] = {}
    tree.mamba_lru = _MambaLru()
    namespaces = state.namespaces or (b"",) * len(state.nodes)
    for (nid, pid, key, value, slot, lock, mlock, t), ns in zip(state.nodes, namespaces):  # parents first
        x = MambaTreeNode(nid, t)
        x.key, x.value, x.mamba_value, x.lock_ref, x.mamba_lock_ref = key, value.copy(), slot, lock, mlock
        x.ns = ns
        by_id[nid] = x
        if pid >= 0:
            x.parent = by_id[pid]
            x.parent.children[ns + key[:psb]] = x
    tree.root_node = by_id[state.nodes[0][0]]
    for nid in reversed(state.lru):
        tree.mamba_lru.insert_mru(by_id[nid])
    (tree.evictable_size_, tree.protected_size_, tree.mamba_evictable_size_, tree.mamba_protected_size_) = state.sizes
    tree._clock, tree._next_id = state.clock, state.next_id
    tree.evicted_tokens_total, tree.mamba_evicted_total = state.totals
    tree.stats = dict(state.stats)
    tree._heap = []
    tree.evictable_leaves = set()
    for x in by_id.values():
        tree._update_leaf_status(x)
    return by_id
