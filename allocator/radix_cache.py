"""RadixCache: SGLang 0.5.23's radix prefix cache (``mem_cache/radix_cache.py``) on numpy.

Keys are int64 arrays of *units*: token ids, or for EAGLE / EAGLE3 token bigrams
(unit ``i`` stands for the pair ``(t[i], t[i + 1])``, so a key is one unit shorter
than its tokens; a bigram is represented by a 64-bit mix of the pair, see
``bigram_units``). Values are KV slot arrays of the same length (int32, the dtype
of ``req_to_token``). Every key
stored or matched is page aligned (``floor_align(len, page_size)``).

A node holds its key as the bytes of its units, so prefix comparison is one
``bytes.startswith`` (a memcmp) per node, and children are keyed by the bytes of
their first page, after the node's namespace prefix. Matching or inserting a key that
ends inside a node splits the node there (the upper part keeps the lock count), as
SGLang does.

Namespaces (SGLang's ``RadixKey.extra_key`` / ``cache_salt``): a key made from token ids
tagged with a namespace (``traces.namespaces.in_namespace``) keeps it, and every node
stored for it holds ``key_prefix`` of it in ``ns``, which the node's entry in its
parent's children puts before the first page (SGLang's ``child_key``: ``(extra_key,
page)``). So equal tokens in two namespaces never reach one node; untagged keys have
an empty prefix and key the tree exactly as without namespaces.

Sizes: a node's length is *evictable* while no request locks it (``lock_ref == 0``)
and *protected* otherwise; ``lock`` / ``unlock`` walk to the root moving lengths
between the two when a count goes 0 <-> 1.

Eviction follows the configured policy (``allocator.evict_policy``; LRU by default):
repeatedly take the evictable leaf (unlocked, no children) with the smallest policy
key (LRU: the oldest access time), free its slots (``free_segment``, page
exact), delete it; a parent that becomes an unlocked leaf joins the candidates;
stop once at least the requested tokens are freed (whole nodes, may overshoot).
Access times come from a logical clock that ticks wherever SGLang reads
``time.monotonic()`` (once per match or insert, once per node created), so the
eviction order is SGLang's. Candidates sit in a lazily invalidated heap: an entry
is live while its node is an evictable leaf whose key still equals the entry's. A
node's key changes only when a walk stamps its access time (hit counts and
priorities change in the same walks), and such a node is pushed again then.

With a ``journal`` attached (an incremental checker, ``allocator.check.journal``) every
new leaf, split, eviction and lock / unlock is recorded there. With a ``listener``
attached (``TreeListener``: what publishes SGLang's KV events, ``kvtrace.events``) every
new leaf, split and eviction is told to it, in call order, where SGLang's radix cache
records its ``BlockStored`` / ``BlockRemoved`` events. Without either, each costs one
attribute test.
"""

from __future__ import annotations

import heapq
import sys
from typing import TYPE_CHECKING, Iterator, NamedTuple, Protocol, Sequence

import numpy as np

from allocator.evict_policy import EvictKey, eviction_key
from allocator.pages import floor_align
from allocator.token_to_kv import SLOT_DTYPE
from traces.namespaces import NamespacedIds, key_prefix

if TYPE_CHECKING:
    from allocator.check.journal import Journal
    from allocator.token_to_kv import (
        HiSparseTokenToKVPoolAllocator,
        PagedTokenToKVPoolAllocator,
        TokenToKVPoolAllocator,
    )

__all__ = ["InsertResult", "MatchResult", "RadixCache", "TreeListener", "TreeNode", "bigram_units"]

_EMPTY = np.empty(0, dtype=np.int64)
_NO_SLOTS = np.empty(0, dtype=SLOT_DTYPE)
# Odd 64-bit multiplier (golden ratio): unit = t[i] * C + t[i + 1] (mod 2**64).
_BIGRAM_MUL = np.uint64(0x9E3779B97F4A7C15)


def bigram_units(token_ids: np.ndarray) -> np.ndarray:
    """EAGLE bigram units of a token sequence: ``len(token_ids) - 1`` int64 values.

    ``unit[i] = t[i] * 0x9E3779B97F4A7C15 + t[i + 1]`` modulo 2**64: equal pairs give
    equal units; for a fixed first token the map is injective in the second, and
    two different pairs collide only when their first tokens differ by a
    multiple that the odd multiplier maps into the range of second-token
    differences, which does not happen for vocabulary-sized token ids.
    """
    t = np.ascontiguousarray(token_ids, dtype=np.int64)
    if t.shape[0] < 2:
        return _EMPTY.copy()
    u = t.view(np.uint64)
    return (u[:-1] * _BIGRAM_MUL + u[1:]).view(np.int64)


class TreeNode:
    """One radix-tree node: a run of units and the KV slots that hold them."""

    __slots__ = (
        "children", "parent", "key", "value", "lock_ref", "last_access_time", "id", "hit_count", "priority", "ns",
    )

    def __init__(self, node_id: int, access_time: int) -> None:
        self.children: dict[bytes, TreeNode] = {}
        self.parent: TreeNode | None = None
        self.key: bytes = b""  # int64 units, native byte order
        self.value: np.ndarray = _NO_SLOTS  # int32 [len] KV slots
        self.lock_ref = 0
        self.last_access_time = access_time
        self.id = node_id  # issued in creation order: FIFO / FILO read it as the creation time
        self.hit_count = 0  # inserts through the node past the inserter's own (LFU, SLRU)
        self.priority = 0  # max priority inserted through the node (priority policy)
        self.ns = b""  # namespace prefix (traces.namespaces.key_prefix): b"" for none

    def __len__(self) -> int:
        return self.value.shape[0]

    def key_units(self) -> np.ndarray:
        return np.frombuffer(self.key, dtype=np.int64)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self)}, lock_ref={self.lock_ref}, t={self.last_access_time})"


class MatchResult(NamedTuple):
    prefix_len: int  # units matched (page aligned)
    last_node: TreeNode


class InsertResult(NamedTuple):
    prefix_len: int  # units of the key that were already in the tree
    last_node: TreeNode


class TreeListener(Protocol):
    """What is told of the changes to the tree's contents (``RadixCache.listener``)."""

    def stored(self, leaf: TreeNode) -> None:
        """``leaf`` is new: its key entered the tree under ``leaf.parent``."""

    def split(self, upper: TreeNode, child: TreeNode) -> None:
        """``child`` was cut in two: ``upper`` is its new first part (its parent's child)."""

    def removed(self, node: TreeNode) -> None:
        """``node`` (a leaf, still linked to its parent) is being evicted."""


class RadixCache:
    """Radix prefix cache with lock counts and policy-ordered eviction.

    Args:
        page_size: units per page; keys are cut to whole pages.
        token_to_kv_pool_allocator: where evicted slots go (``free_segment``).
        disable: a disabled cache matches nothing, stores nothing, evicts nothing.
        is_eagle: key by token bigrams (``make_key``).
        eviction_policy: which evictable leaf goes first (``allocator.evict_policy``).

    Raises:
        ValueError: an unknown eviction policy.
    """

    def __init__(
        self,
        page_size: int,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator
        | PagedTokenToKVPoolAllocator
        | HiSparseTokenToKVPoolAllocator
        | None = None,
        disable: bool = False,
        is_eagle: bool = False,
        eviction_policy: str = "lru",
    ) -> None:
        # None: LRU, whose key (the access time) the heap reads inline.
        self._evict_key = eviction_key(eviction_policy)
        self.page_size = page_size
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.disable = disable
        self.is_eagle = is_eagle
        self.journal: Journal | None = None
        self.listener: TreeListener | None = None
        self.reset()

    # ------------------------------------------------------------------ state

    def reset(self) -> None:
        self._clock = 0
        self._next_id = 0
        self.root_node = self._new_node()
        self.root_node.lock_ref = 1
        self.root_node.priority = -sys.maxsize  # SGLang: any inserted priority overrides it
        self.evictable_size_ = 0
        self.protected_size_ = 0
        self.evictable_leaves: set[TreeNode] = set()
        self.evicted_tokens_total = 0
        # (eviction key, node id, node): evictable-leaf candidates, lazily invalidated.
        self._heap: list[tuple[int, int, TreeNode]] = []

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _new_node(self) -> TreeNode:
        self._next_id += 1
        return TreeNode(self._next_id, self._tick())

    def evictable_size(self) -> int:
        return self.evictable_size_

    def protected_size(self) -> int:
        return self.protected_size_

    def total_size(self) -> int:
        return self.evictable_size_ + self.protected_size_

    def supports_prefix_sharing(self) -> bool:
        return not self.disable

    def make_key(self, token_ids: np.ndarray) -> np.ndarray:
        """The unit key of a token sequence (bigram units for EAGLE; not yet page aligned),
        in the namespace of ``token_ids``."""
        key = bigram_units(token_ids) if self.is_eagle else np.ascontiguousarray(token_ids, dtype=np.int64)
        if type(token_ids) is NamespacedIds and token_ids.namespace is not None:
            key = key.view(NamespacedIds)
            key.namespace = token_ids.namespace
        return key

    def key_len(self, num_tokens: int) -> int:
        """Page-aligned key length (units) of a ``num_tokens``-token sequence."""
        units = max(num_tokens - 1, 0) if self.is_eagle else num_tokens
        return floor_align(units, self.page_size)

    # ------------------------------------------------------------------ match / insert

    def match_prefix(self, key: np.ndarray) -> MatchResult:
        """Longest cached page-aligned prefix of ``key`` (units).

        Touches the access time of every node on the path; splits the last node when
        the match ends inside it. An empty (or shorter than a page) key returns
        ``(0, root)`` without touching anything.
        """
        ps = self.page_size
        n = floor_align(key.shape[0], ps)
        if self.disable or n == 0:
            return MatchResult(0, self.root_node)
        kb = key[:n].tobytes()
        t = self._tick()
        self.root_node.last_access_time = t
        node, pos, touched = self._walk(kb, t, ns=key_prefix(key))
        if touched is not None and touched in self.evictable_leaves:
            self._push(touched)
        return MatchResult(pos // 8, node)

    def peek_prefix_len(self, key: np.ndarray) -> int:
        """Length ``match_prefix`` would return, without touching or splitting anything."""
        ps = self.page_size
        n = floor_align(key.shape[0], ps)
        if self.disable or n == 0:
            return 0
        kb = key[:n].tobytes()
        nb = n * 8
        psb = ps * 8
        ns = key_prefix(key)
        node = self.root_node
        pos = 0
        while pos < nb:
            child = node.children.get(ns + kb[pos : pos + psb] if ns else kb[pos : pos + psb])
            if child is None:
                break
            if kb.startswith(child.key, pos):
                pos += len(child.key)
                node = child
                continue
            pos += self._matched_units(child.key, kb, pos) * 8
            break
        return pos // 8

    def peek_match_lock(self, keys: Sequence[np.ndarray]) -> tuple[np.ndarray, int]:
        """What matching and locking ``keys`` one after the other would do, without
        touching, splitting or locking anything.

        Returns:
            The prefix length ``match_prefix`` would return for each key (units), and
            the tokens their locks would move from evictable to protected: each
            unlocked node on a matched path counted once, up to the deepest unit any
            key matches inside it (a match ending inside a node splits it, and only
            the upper part is locked).
        """
        prefix = np.zeros(len(keys), dtype=np.int64)
        if self.disable:
            return prefix, 0
        ps = self.page_size
        psb = ps * 8
        deepest: dict[int, int] = {}  # id of an unlocked node -> units matched in it
        for i, key in enumerate(keys):
            n = floor_align(key.shape[0], ps)
            if n == 0:
                continue
            kb = key[:n].tobytes()
            nb = n * 8
            ns = key_prefix(key)
            node = self.root_node
            pos = 0
            while pos < nb:
                child = node.children.get(ns + kb[pos : pos + psb] if ns else kb[pos : pos + psb])
                if child is None:
                    break
                if kb.startswith(child.key, pos):
                    m = child.value.shape[0]
                else:
                    m = self._matched_units(child.key, kb, pos)
                if child.lock_ref == 0 and deepest.get(child.id, 0) < m:
                    deepest[child.id] = m
                pos += m * 8
                if m < child.value.shape[0]:
                    break
                node = child
            prefix[i] = pos // 8
        return prefix, sum(deepest.values())

    def insert(self, key: np.ndarray, value: np.ndarray, inserted_len: int = 0, priority: int = 0) -> InsertResult:
        """Insert ``key`` -> ``value`` (page aligned); return the length already present.

        The new suffix (if any) becomes one leaf, evictable until locked. ``value``
        must cover at least the aligned key; it is copied.

        Args:
            inserted_len: units of ``key`` the inserting request already inserted
                (SGLang ``req.kv.cache_inserted_len``): a node ending past it counts
                a hit.
            priority: raised into every node on the path (max), the new leaf's own.
        """
        ps = self.page_size
        n = floor_align(key.shape[0], ps)
        if self.disable:
            return InsertResult(0, self.root_node)
        t = self._tick()
        node = self.root_node
        node.last_access_time = t
        if priority > node.priority:
            node.priority = priority
        if n == 0:
            return InsertResult(0, node)
        kb = key[:n].tobytes()
        nb = n * 8
        psb = ps * 8
        # Past ``pos`` the key differs from every child's first page (or from the
        # lower part of a node just split): the rest becomes a new leaf.
        ns = key_prefix(key)
        node, pos, touched = self._walk(kb, t, inserted_len * 8, priority, ns)
        if pos < nb:
            leaf = self._new_node()
            leaf.priority = priority
            if n > inserted_len:
                leaf.hit_count = 1
            leaf.parent = node
            leaf.key = kb[pos:]
            leaf.value = np.array(value[pos // 8 : n], dtype=SLOT_DTYPE)
            leaf.ns = ns
            node.children[ns + kb[pos : pos + psb]] = leaf
            if self.journal is not None:
                self.journal.insert(leaf)
            if self.listener is not None:
                self.listener.stored(leaf)
            self.evictable_size_ += n - pos // 8
            self._update_leaf_status(node)
            self._update_leaf_status(leaf)
            if touched is not None and touched is not node and touched in self.evictable_leaves:
                self._push(touched)
            return InsertResult(pos // 8, leaf)
        if touched is not None and touched in self.evictable_leaves:
            self._push(touched)
        return InsertResult(pos // 8, node)

    def _walk(
        self, kb: bytes, t: int, hits_past: int = -1, priority: int | None = None, ns: bytes = b""
    ) -> tuple[TreeNode, int, TreeNode | None]:
        """Follow key bytes ``kb`` down from the root, stamping access time ``t`` on each
        child entered (as SGLang's match and insert helpers do) and splitting the node
        where the match ends inside it.

        ``ns`` is the key's namespace prefix (``traces.namespaces.key_prefix``).
        An insert (``hits_past`` >= 0) also does what SGLang's insert helper does to
        each node it ends in (a full child, or the upper part of a split): a hit when
        the matched length passes ``hits_past`` bytes, and ``priority`` raised in.

        Returns:
            The deepest node reached, the matched length in bytes (8 per unit), and the
            last child entered (None if none).
        """
        psb = self.page_size * 8
        nb = len(kb)
        node = self.root_node
        pos = 0
        touched = None
        while pos < nb:
            child = node.children.get(ns + kb[pos : pos + psb] if ns else kb[pos : pos + psb])
            if child is None:
                break
            child.last_access_time = t
            touched = child
            ckey = child.key
            if kb.startswith(ckey, pos):
                pos += len(ckey)
                node = child
                if hits_past >= 0:
                    self._hit(node, pos > hits_past, priority)
                continue
            m = self._matched_units(ckey, kb, pos)
            node = self._split_node(child, m)
            pos += m * 8
            if hits_past >= 0:
                self._hit(node, pos > hits_past, priority)
            break
        return node, pos, touched

    @staticmethod
    def _hit(node: TreeNode, hit: bool, priority: int | None) -> None:
        if hit:
            node.hit_count += 1
        if priority is not None and priority > node.priority:
            node.priority = priority

    def _matched_units(self, ckey: bytes, kb: bytes, pos: int) -> int:
        """Units of ``ckey`` matching ``kb[pos:]``, rounded down to a page (>= 1 page)."""
        a = np.frombuffer(ckey, dtype=np.int64)
        k = min(a.shape[0], (len(kb) - pos) // 8)
        b = np.frombuffer(kb, dtype=np.int64, count=k, offset=pos)
        neq = a[:k] != b
        m = int(neq.argmax()) if neq.any() else k
        return floor_align(m, self.page_size)

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        """Split ``child`` after ``split_len`` units; return the new upper node."""
        psb = self.page_size * 8
        cut = split_len * 8
        upper = self._new_node()
        upper.parent = child.parent
        upper.lock_ref = child.lock_ref
        upper.hit_count = child.hit_count
        upper.priority = child.priority
        upper.ns = child.ns
        upper.key = child.key[:cut]
        upper.value = child.value[:split_len]
        child.key = child.key[cut:]
        child.value = child.value[split_len:]
        child.parent = upper
        upper.children = {child.ns + child.key[:psb]: child}
        upper.parent.children[upper.ns + upper.key[:psb]] = upper
        if self.journal is not None:
            self.journal.split(upper, child)
        if self.listener is not None:
            self.listener.split(upper, child)
        return upper

    # ------------------------------------------------------------------ locks

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock the path root..node; return the change of ``evictable_size`` (<= 0)."""
        if self.disable:
            return 0
        if self.journal is not None:
            self.journal.lock(node)
        delta = 0
        root = self.root_node
        while node is not root:
            if node.lock_ref == 0:
                n = node.value.shape[0]
                self.evictable_size_ -= n
                self.protected_size_ += n
                delta -= n
            node.lock_ref += 1
            self._update_leaf_status(node)
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Unlock the path root..node; return the change of ``evictable_size`` (>= 0)."""
        if self.disable:
            return 0
        if self.journal is not None:
            self.journal.lock(node)
        delta = 0
        root = self.root_node
        while node is not root:
            if node.lock_ref == 1:
                n = node.value.shape[0]
                self.evictable_size_ += n
                self.protected_size_ -= n
                delta += n
            node.lock_ref -= 1
            self._update_leaf_status(node)
            node = node.parent
        return delta

    def lock(self, node: TreeNode | None) -> TreeNode | None:
        if node is not None:
            self.inc_lock_ref(node)
        return node

    def unlock(self, node: TreeNode | None) -> None:
        if node is not None:
            self.dec_lock_ref(node)

    # ------------------------------------------------------------------ eviction

    def _key_of(self, node: TreeNode) -> EvictKey:
        key = self._evict_key
        return node.last_access_time if key is None else key(node)

    def _push(self, node: TreeNode) -> None:
        key = self._evict_key
        heapq.heappush(self._heap, (node.last_access_time if key is None else key(node), node.id, node))

    def _update_leaf_status(self, node: TreeNode) -> None:
        if node.lock_ref > 0 or node.children:
            self.evictable_leaves.discard(node)
            return
        if node not in self.evictable_leaves:
            self.evictable_leaves.add(node)
            self._push(node)

    def _pop_evictable(self) -> TreeNode | None:
        heap = self._heap
        leaves = self.evictable_leaves
        key = self._evict_key
        if len(heap) > 2 * len(leaves) + 1024:
            heap[:] = [(self._key_of(n), n.id, n) for n in leaves]
            heapq.heapify(heap)
        if key is None:
            while heap:
                t, _, node = heapq.heappop(heap)
                if node in leaves and node.last_access_time == t:
                    return node
            return None
        while heap:
            k, _, node = heapq.heappop(heap)
            if node in leaves and key(node) == k:
                return node
        return None

    def evict(self, num_tokens: int) -> int:
        """Evict unlocked leaves in policy order (LRU: least recently used first) until
        ``num_tokens`` are freed.

        Returns:
            Tokens evicted (whole nodes: may exceed ``num_tokens``; less if the tree
            runs out of evictable leaves).
        """
        if self.disable or num_tokens <= 0:
            return 0
        allocator = self.token_to_kv_pool_allocator
        psb = self.page_size * 8
        evicted = 0
        while evicted < num_tokens:
            x = self._pop_evictable()
            if x is None:
                break
            if self.journal is not None:
                self.journal.evict(x, x.parent)
            if self.listener is not None:
                self.listener.removed(x)
            allocator.free_segment(x.value, 0)
            n = x.value.shape[0]
            evicted += n
            parent = x.parent
            del parent.children[x.ns + x.key[:psb]]
            self.evictable_size_ -= n
            self.evictable_leaves.discard(x)
            x.parent = None
            self._update_leaf_status(parent)
        self.evicted_tokens_total += evicted
        return evicted

    # ------------------------------------------------------------------ reads

    def path_device_indices(self, node: TreeNode) -> np.ndarray:
        """KV slots on the path root..node, in key order (int32)."""
        values = []
        root = self.root_node
        while node is not root:
            values.append(node.value)
            node = node.parent
        if not values:
            return _NO_SLOTS.copy()
        if len(values) == 1:
            return values[0]
        values.reverse()
        return np.concatenate(values)

    def path_len(self, node: TreeNode) -> int:
        n = 0
        root = self.root_node
        while node is not root:
            n += node.value.shape[0]
            node = node.parent
        return n

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every node except the root (depth first)."""
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def all_values_flatten(self) -> np.ndarray:
        values = [node.value for node in self.iter_nodes()]
        return np.concatenate(values) if values else _NO_SLOTS.copy()

    def num_nodes(self) -> int:
        return sum(1 for _ in self.iter_nodes())


class RadixState(NamedTuple):
    """A radix tree flattened for a checkpoint (``RadixCache.save_state``).

    Nodes are listed depth first, root first, children in their dict order, so a
    restore rebuilds the same dicts in the same order. Keys (``bytes``) and values
    (slot arrays, read-only views) are shared with the tree, never copied: the tree
    only ever replaces a node's key or value, it never writes into one, so
    consecutive checkpoints share every node that did not change.
    """

    ids: np.ndarray  # int64 [n] node ids (root first)
    parents: np.ndarray  # int64 [n] position of each node's parent (-1: the root)
    keys: tuple[bytes, ...]  # each node's key
    values: tuple[np.ndarray, ...]  # each node's KV slots (read-only views)
    lock_refs: np.ndarray  # int64 [n]
    access_times: np.ndarray  # int64 [n] (float64 where the tree's clock is a float: the SWA tree)
    heap: np.ndarray  # int64 [m, 2] (access time, node id) of the live nodes' heap entries (LRU only)
    evictable_leaves: np.ndarray  # int64 node ids
    scalars: tuple[int, int, int, int, int]  # clock, next id, evictable, protected, evicted total
    hit_counts: np.ndarray  # int64 [n]
    priorities: np.ndarray  # int64 [n]
    namespaces: tuple[bytes, ...] = ()  # each node's namespace prefix; () when every one is b""


def _frozen(value: np.ndarray) -> np.ndarray:
    view = value.view()
    view.flags.writeable = False
    return view


def preorder(root: TreeNode) -> tuple[list[TreeNode], list[int]]:
    """The nodes under ``root`` (itself first) in pre-order, children in dict order (so a
    restore re-inserts them in the same order), and each node's parent's index (-1: root)."""
    nodes: list[TreeNode] = []
    parents: list[int] = []
    stack: list[tuple[TreeNode, int]] = [(root, -1)]
    while stack:
        node, parent = stack.pop()
        here = len(nodes)
        nodes.append(node)
        parents.append(parent)
        stack.extend((child, here) for child in reversed(list(node.children.values())))
    return nodes, parents


def save_tree_state(tree: RadixCache) -> RadixState:
    """Flatten ``tree`` (node metadata copied; keys and values shared read-only)."""
    nodes, parents = preorder(tree.root_node)
    live = {id(n) for n in nodes}
    # Another policy's keys are not (time, id) pairs: its heap is rebuilt from the leaves.
    lru = tree._evict_key is None
    heap = np.array([(t, i) for t, i, n in tree._heap if lru and id(n) in live], np.int64).reshape(-1, 2)
    return RadixState(
        ids=np.fromiter((n.id for n in nodes), np.int64, len(nodes)),
        parents=np.array(parents, np.int64),
        keys=tuple(n.key for n in nodes),
        values=tuple(n.value if not n.value.flags.writeable else _frozen(n.value) for n in nodes),
        lock_refs=np.fromiter((n.lock_ref for n in nodes), np.int64, len(nodes)),
        access_times=np.fromiter(
            (n.last_access_time for n in nodes), np.float64 if isinstance(tree._clock, float) else np.int64, len(nodes)
        ),
        heap=heap,
        evictable_leaves=np.fromiter((n.id for n in tree.evictable_leaves), np.int64),
        scalars=(tree._clock, tree._next_id, tree.evictable_size_, tree.protected_size_, tree.evicted_tokens_total),
        hit_counts=np.fromiter((n.hit_count for n in nodes), np.int64, len(nodes)),
        priorities=np.fromiter((n.priority for n in nodes), np.int64, len(nodes)),
        namespaces=tuple(n.ns for n in nodes) if any(n.ns for n in nodes) else (),
    )


def restore_tree_state(tree: RadixCache, state: RadixState) -> dict[int, TreeNode]:
    """Rebuild ``tree`` in place from ``state``; return its nodes by id.

    The lazily invalidated heap keeps only the entries of nodes still in the tree
    (entries of evicted nodes can never be valid again), re-heapified: the order in
    which valid entries pop is unchanged.
    """
    psb = tree.page_size * 8
    node_class = type(tree.root_node)  # a subclass's nodes (the SWA tree's) stay of its class
    by_id: dict[int, TreeNode] = {}
    nodes: list[TreeNode] = []
    namespaces = state.namespaces or (b"",) * len(state.keys)
    for node_id, parent, lock_ref, t, key, value, hits, priority, ns in zip(
        state.ids.tolist(), state.parents.tolist(), state.lock_refs.tolist(), state.access_times.tolist(),
        state.keys, state.values, state.hit_counts.tolist(), state.priorities.tolist(), namespaces,
    ):
        node = node_class(node_id, t)
        node.ns = ns
        node.key = key
        node.value = value
        node.lock_ref = lock_ref
        node.hit_count = hits
        node.priority = priority
        if parent >= 0:
            owner = nodes[parent]
            node.parent = owner
            owner.children[ns + key[:psb]] = node
        nodes.append(node)
        by_id[node_id] = node
    tree.root_node = nodes[0]
    tree._clock, tree._next_id, tree.evictable_size_, tree.protected_size_, tree.evicted_tokens_total = state.scalars
    tree.evictable_leaves = {by_id[i] for i in state.evictable_leaves.tolist()}
    if tree._evict_key is None:
        tree._heap = [(t, i, by_id[i]) for t, i in state.heap.tolist()]
    else:
        tree._heap = [(tree._key_of(n), n.id, n) for n in tree.evictable_leaves]
    heapq.heapify(tree._heap)
    return by_id
