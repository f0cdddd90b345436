"""SwaRadixCache: the radix tree of a hybrid sliding-window model, as SGLang 0.5.23 runs it.

SGLang 0.5.23 has no separate SWA radix cache: a hybrid model runs
``UnifiedRadixCache`` with a FULL and an SWA component (``mem_cache/unified_radix_cache.py``,
``unified_cache/unified_tree_core.py``, ``unified_cache/components/{full,swa}.py``).
Each node keeps its FULL slots (``value``, as in ``RadixCache``) and, separately, the
SWA slots of the same tokens (``swa_value``, read through the allocator's full -> SWA
mapping) or None: a *tombstone*, whose full KV is still cached but whose SWA was
evicted or never kept (out of the inserting request's window)::

    root -- A [full, swa] -- B [full, None] -- C [full, swa]     B: a tombstone

What differs from the full-attention tree (``allocator.radix_cache``):

- match is SWA-gated: a node is a usable end only if the live SWA run ending there
  covers the retain window (a tombstone resets the run); the full hit past the usable
  end is reported as ``swa_branching_seqlen`` (page floored) so the request's next
  checkpoint inserts only up to it;
- two locks: FULL locks the whole path; SWA locks only the nodes covering the trailing
  window, up to a boundary node marked with a uuid (the lock's receipt);
- two evictable / protected ledgers, and two eviction walks per request (``evict``
  takes each pool's shortfall): FULL deletes LRU leaves (heap on access time); SWA
  walks its own LRU list, deleting a node whole when it is a leaf, else tombstoning it;
- insert frees what the request hands over: duplicates below the request's SWA cursor
  full-side only; a tombstoned node overlapped by the insert recovers SWA from the
  request's slots (unlocked: the node takes the request's full slots; locked: the SWA
  pages move under the node's full slots through the mapping);
- a fresh leaf longer than one page-aligned window is split so a lock pins one window.

Access times are floats from one counter, ticked where SGLang's
``get_and_increase_time_counter`` ticks (twice per new node, once per node touched by an
insert, once per split and once per match end), so both eviction orders are SGLang's.
Frees are applied in the order SGLang emits its cache actions.

Not mirrored: HiCache / host layers, sessions, Mamba, priorities other than 0, the
early window-lock release (``SGLANG_OPT_RELEASE_PREFILL_SWA``, off by default) and
the Rust tree core's internals (same semantics assumed).
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING, Iterator, NamedTuple

import numpy as np

from allocator.pages import ceil_align, floor_align
from allocator.radix_cache import InsertResult, MatchResult, RadixCache, TreeNode
from allocator.token_to_kv import SLOT_DTYPE
from traces.namespaces import key_prefix

if TYPE_CHECKING:
    from allocator.swa import SWATokenToKVPoolAllocator

__all__ = ["SwaInsertResult", "SwaMatchResult", "SwaRadixCache", "SwaTreeNode"]

_NO_SLOTS = np.empty(0, dtype=SLOT_DTYPE)


class SwaTreeNode(TreeNode):
    """A node with an SWA side: ``swa_value`` (SWA slots, None = tombstone), the SWA
    lock count, the window-boundary uuid, and its links in the SWA LRU list."""

    __slots__ = ("swa_value", "swa_lock_ref", "swa_uuid", "lru_prev", "lru_next")

    def __init__(self, node_id: int, access_time: float) -> None:
        super().__init__(node_id, access_time)  # type: ignore[arg-type]
        self.swa_value: np.ndarray | None = None
        self.swa_lock_ref = 0
        self.swa_uuid: int | None = None
        self.lru_prev: SwaTreeNode | None = None
        self.lru_next: SwaTreeNode | None = None

    def __repr__(self) -> str:
        swa = "tomb" if self.swa_value is None else len(self.swa_value)
        return f"SwaTreeNode(id={self.id}, len={len(self)}, swa={swa}, lock={self.lock_ref}/{self.swa_lock_ref})"


class SwaMatchResult(NamedTuple):
    prefix_len: int  # units usable (SWA-gated, page aligned)
    last_node: SwaTreeNode
    swa_branching_seqlen: int | None  # page-floored full hit past the usable end, else None


class SwaInsertResult(NamedTuple):
    prefix_len: int
    last_node: SwaTreeNode
    swa_branch_inserted: bool


class _SwaLru:
    """SGLang's ``UnifiedLRUList`` for one component: head = most recent."""

    def __init__(self) -> None:
        self.head = SwaTreeNode(-1, 0.0)
        self.tail = SwaTreeNode(-2, 0.0)
        self.head.lru_next = self.tail
        self.tail.lru_prev = self.head
        self.members: set[int] = set()

    def _link_after(self, prev: SwaTreeNode, node: SwaTreeNode) -> None:
        node.lru_prev = prev
        node.lru_next = prev.lru_next
        prev.lru_next.lru_prev = node  # type: ignore[union-attr]
        prev.lru_next = node

    @staticmethod
    def _unlink(node: SwaTreeNode) -> None:
        node.lru_prev.lru_next = node.lru_next  # type: ignore[union-attr]
        node.lru_next.lru_prev = node.lru_prev  # type: ignore[union-attr]
        node.lru_prev = node.lru_next = None

    def in_list(self, node: SwaTreeNode | None) -> bool:
        return node is not None and node.id in self.members

    def insert_mru(self, node: SwaTreeNode) -> None:
        assert node.id not in self.members
        self.members.add(node.id)
        self._link_after(self.head, node)

    def insert_after(self, prev: SwaTreeNode, node: SwaTreeNode) -> None:
        assert prev.id in self.members and node.id not in self.members
        self.members.add(node.id)
        self._link_after(prev, node)

    def remove(self, node: SwaTreeNode) -> None:
        self.members.remove(node.id)
        self._unlink(node)

    def reset_window_ancestors_mru(self, node: SwaTreeNode, root: SwaTreeNode, window: int) -> None:
        prev = self.head
        covered = 0
        while node is not root and covered < window:
            if node.swa_value is not None:
                self._unlink(node)
                self._link_after(prev, node)
                prev = node
            covered += len(node)
            node = node.parent  # type: ignore[assignment]

    def prev_unlocked(self, node: SwaTreeNode) -> SwaTreeNode | None:
        x = node.lru_prev
        while x is not self.head and x.swa_lock_ref > 0:  # type: ignore[union-attr]
            x = x.lru_prev  # type: ignore[union-attr]
        return None if x is self.head else x

    def lru_unlocked(self) -> SwaTreeNode | None:
        return self.prev_unlocked(self.tail)

    def __iter__(self) -> Iterator[SwaTreeNode]:
        x = self.head.lru_next
        while x is not self.tail:
            yield x  # type: ignore[misc]
            x = x.lru_next  # type: ignore[union-attr]


class SwaRadixCache(RadixCache):
    """The radix cache with SGLang's SWA component (see the module docstring).

    Args:
        page_size: units per page.
        token_to_kv_pool_allocator: the hybrid allocator (``SWATokenToKVPoolAllocator``).
        window: the retain window in tokens (``swa_retain_window``).
        is_eagle: key by token bigrams.

    Attributes:
        last_lock_uuid: the receipt of the latest ``lock``: the uuid of its window
            boundary node, None when the window reached the root. ``unlock`` needs it.
        stats: counters of what the tree did (tombstones made, SWA-walk leaf deletions,
            gated matches, insert-overlap recoveries, locked recoveries, fresh leaves split
            to one window).
    """

    # The incremental checker's SWA pool journal (``allocator.check.incremental_swa``), None unless attached.
    swa_journal = None

    def __init__(
        self,
        page_size: int,
        token_to_kv_pool_allocator: SWATokenToKVPoolAllocator,
        window: int,
        is_eagle: bool = False,
    ) -> None:
        self.window = window
        super().__init__(page_size, token_to_kv_pool_allocator, disable=False, is_eagle=is_eagle)  # type: ignore[arg-type]

    def reset(self) -> None:
        self._clock = 0.0
        self._next_id = 0
        self._uuids = itertools.count(1)
        self.swa_lru = _SwaLru()
        self.root_node = self._new_node()
        self.root_node.lock_ref = 1
        self.evictable_size_ = 0
        self.protected_size_ = 0
        self.swa_evictable_size_ = 0
        self.swa_protected_size_ = 0
        self.evictable_leaves: set[TreeNode] = set()
        self.evicted_tokens_total = 0
        self.swa_evicted_tokens_total = 0
        self._heap = []
        self.last_lock_uuid: int | None = None
        self.stats = {"tombstoned": 0, "swa_leaf_deleted": 0, "gated_match": 0, "recovered": 0, "recovered_locked": 0,
                      "window_split": 0}

    def _tick(self) -> float:  # type: ignore[override]
        t = self._clock
        self._clock += 1.0
        return t

    def _new_node(self) -> SwaTreeNode:  # type: ignore[override]
        self._next_id += 1
        node = SwaTreeNode(self._next_id, self._tick())
        self._tick()  # creation_time
        return node

    def swa_evictable_size(self) -> int:
        return self.swa_evictable_size_

    def swa_protected_size(self) -> int:
        return self.swa_protected_size_

    @property
    def _alloc(self) -> SWATokenToKVPoolAllocator:
        return self.token_to_kv_pool_allocator  # type: ignore[return-value]

    # ------------------------------------------------------------------ leaf sets

    def _is_device_leaf(self, node: SwaTreeNode) -> bool:
        return node is not self.root_node and node.lock_ref == 0 and node.swa_lock_ref == 0 and not node.children

    def _update_leaf_status(self, node: TreeNode) -> None:
        if self._is_device_leaf(node):  # type: ignore[arg-type]
            self.evictable_leaves.add(node)
        else:
            self.evictable_leaves.discard(node)

    # ------------------------------------------------------------------ SWA values

    def _set_swa_value(self, node: SwaTreeNode, swa_value: np.ndarray) -> None:
        """``set_component_device_value``: store, join the SWA LRU as most recent, ledger."""
        node.swa_value = swa_value
        if self.swa_journal is not None:
            self.swa_journal.swa_cache(swa_value)
        self.swa_lru.insert_mru(node)
        if node.swa_lock_ref > 0:
            self.swa_protected_size_ += len(swa_value)
        else:
            self.swa_evictable_size_ += len(swa_value)

    def _swa_rebuild(self, node: SwaTreeNode) -> None:
        self._set_swa_value(node, self._alloc.translate_loc_from_full_to_swa(node.value).astype(np.int64))

    def _tombstone(self, node: SwaTreeNode) -> int:
        """Free a node's SWA side (through its full slots) and drop it from the SWA LRU."""
        n = len(node.swa_value)  # type: ignore[arg-type]
        self._alloc.free_swa_segment(node.value, start_pos=0)
        if node.swa_lock_ref == 0:
            self.swa_evictable_size_ -= n
        node.swa_value = None
        if self.swa_lru.in_list(node):
            self.swa_lru.remove(node)
        return n

    # ------------------------------------------------------------------ split

    def _split_node(self, child: TreeNode, split_len: int) -> SwaTreeNode:  # type: ignore[override]
        psb = self.page_size * 8
        cut = split_len * 8
        upper = self._new_node()
        c: SwaTreeNode = child  # type: ignore[assignment]
        upper.parent = c.parent
        upper.lock_ref = c.lock_ref
        upper.swa_lock_ref = c.swa_lock_ref
        upper.ns = c.ns
        upper.key = c.key[:cut]
        upper.value = c.value[:split_len]
        c.key = c.key[cut:]
        c.value = c.value[split_len:]
        if c.swa_value is not None:
            upper.swa_value = c.swa_value[:split_len]
            c.swa_value = c.swa_value[split_len:]
        upper.swa_uuid, c.swa_uuid = c.swa_uuid, None
        c.parent = upper
        upper.children = {c.ns + c.key[:psb]: c}
        upper.parent.children[upper.ns + upper.key[:psb]] = upper
        if upper.swa_value is not None and not self.swa_lru.in_list(upper):
            self.swa_lru.insert_after(c, upper)
        c.last_access_time = self._tick()
        self._update_leaf_status(upper)
        self._update_leaf_status(c)
        if self.journal is not None:
            self.journal.split(upper, c)
        if self.listener is not None:
            self.listener.split(upper, c)
        return upper

    # ------------------------------------------------------------------ match

    def _matched(self, ckey: bytes, kb: bytes, pos: int) -> int:
        if kb.startswith(ckey, pos):
            return len(ckey) // 8
        return self._matched_units(ckey, kb, pos)

    def match_prefix(self, key: np.ndarray) -> MatchResult:
        m = self.match_prefix_swa(key)
        return MatchResult(m.prefix_len, m.last_node)

    def match_prefix_swa(self, key: np.ndarray) -> SwaMatchResult:
        """SWA-gated longest prefix of ``key`` (units); see the module docstring.

        Splits the node where the full match ends inside it; stamps the access time of
        the usable end and its ancestors, and refreshes the SWA LRU over its window.
        """
        ps = self.page_size
        n = floor_align(key.shape[0], ps)
        root = self.root_node
        if n == 0:
            return SwaMatchResult(0, root, None)  # type: ignore[arg-type]
        kb = key[:n].tobytes()
        nb = n * 8
        psb = ps * 8
        ns = key_prefix(key)
        node = root
        pos = 0
        full_hit = 0
        run = float("inf")
        best = root
        best_len = 0
        while pos < nb:
            child = node.children.get(ns + kb[pos : pos + psb])
            if child is None:
                break
            m = self._matched(child.key, kb, pos)
            full_hit += m
            if m < len(child):
                child = self._split_node(child, m)
            node = child
            pos += m * 8
            # the SWA validator: a tombstone resets the live run and is never an end
            if node.swa_value is None:  # type: ignore[attr-defined]
                run = 0
            else:
                run += len(node)
                if run >= self.window:
                    best = node
                    best_len = pos // 8
            # (after a split the next page differs from the lower part's: the walk ends)
        self.swa_lru.reset_window_ancestors_mru(best, root, self.window + ps)  # type: ignore[arg-type]
        t = self._tick()
        x: TreeNode | None = best
        while x is not None:
            x.last_access_time = t  # type: ignore[assignment]
            t -= 0.00001
            x = x.parent
        aligned = full_hit // ps * ps
        branching = aligned if aligned > best_len else None
        if branching is not None:
            self.stats["gated_match"] += 1
        return SwaMatchResult(best_len, best, branching)  # type: ignore[arg-type]

    def peek_prefix_len(self, key: np.ndarray) -> int:
        """Length ``match_prefix`` would return, without touching or splitting anything."""
        ps = self.page_size
        n = floor_align(key.shape[0], ps)
        if n == 0:
            return 0
        kb = key[:n].tobytes()
        nb, psb = n * 8, ps * 8
        ns = key_prefix(key)
        node, pos, run, best = self.root_node, 0, float("inf"), 0
        while pos < nb:
            child = node.children.get(ns + kb[pos : pos + psb])
            if child is None:
                break
            m = self._matched(child.key, kb, pos)
            pos += m * 8
            if child.swa_value is None:  # type: ignore[attr-defined]
                run = 0
            else:
                run += m
                if run >= self.window:
                    best = pos // 8
            if m < len(child):
                break
            node = child
        return best

    def peek_match_lock(self, keys):  # type: ignore[no-untyped-def]
        """Prefix lengths ``match_prefix`` would give and the FULL lock's cost (see
        ``peek_match_lock_swa``)."""
        prefix, full_cost, _swa_cost = self.peek_match_lock_swa(keys)
        return prefix, full_cost

    def peek_match_lock_swa(self, keys: list[np.ndarray]) -> tuple[np.ndarray, int, int]:
        """What matching and locking ``keys`` one after the other would do, without
        touching, splitting or locking anything.

        Returns:
            The prefix length ``match_prefix_swa`` would give per key, and the tokens
            the locks would move from evictable to protected in each ledger: FULL, each
            unlocked node from the root to the usable end; SWA, each SWA-live node
            without an SWA lock over the trailing window. A node counts once, up to the
            deepest unit any key uses of it (a match ending inside it splits it).
        """
        ps = self.page_size
        prefix = np.zeros(len(keys), dtype=np.int64)
        full_deep: dict[int, int] = {}
        swa_deep: dict[int, int] = {}
        for i, key in enumerate(keys):
            n = floor_align(key.shape[0], ps)
            if n == 0:
                continue
            kb = key[:n].tobytes()
            nb, psb = n * 8, ps * 8
            ns = key_prefix(key)
            node, pos, run = self.root_node, 0, float("inf")
            path: list[tuple[SwaTreeNode, int]] = []  # (node, units used) root -> usable end
            best = -1
            walked: list[tuple[SwaTreeNode, int]] = []
            while pos < nb:
                child = node.children.get(ns + kb[pos : pos + psb])
                if child is None:
                    break
                m = self._matched(child.key, kb, pos)
                pos += m * 8
                walked.append((child, m))  # type: ignore[arg-type]
                if child.swa_value is None:  # type: ignore[attr-defined]
                    run = 0
                else:
                    run += m
                    if run >= self.window:
                        best = len(walked) - 1
                        prefix[i] = pos // 8
                if m < len(child):
                    break
                node = child
            path = walked[: best + 1]
            for x, m in path:
                if x.lock_ref == 0 and full_deep.get(x.id, 0) < m:
                    full_deep[x.id] = m
            covered = 0
            for x, m in reversed(path):
                if covered >= self.window:
                    break
                if x.swa_lock_ref == 0 and x.swa_value is not None and swa_deep.get(x.id, 0) < m:
                    swa_deep[x.id] = m
                covered += m
        return prefix, sum(full_deep.values()), sum(swa_deep.values())

    # ------------------------------------------------------------------ insert

    def insert(self, key: np.ndarray, value: np.ndarray) -> InsertResult:
        r = self.insert_swa(key, value)
        return InsertResult(r.prefix_len, r.last_node)

    def insert_swa(
        self,
        key: np.ndarray,
        value: np.ndarray,
        prev_prefix_len: int = 0,
        swa_evicted_seqlen: int = 0,
        swa_branching_seqlen: int | None = None,
    ) -> SwaInsertResult:
        """Insert ``key`` -> ``value`` for a request (``UnifiedTreeCore.begin_insert``).

        Args:
            prev_prefix_len: the request's ``cache_protected_len`` (its own slots start there).
            swa_evicted_seqlen: the request's SWA cursor: positions below it have no SWA
                (the new leaf is a tombstone there; duplicates there free full-side only).
            swa_branching_seqlen: the request's pending branch point, if any.

        Frees the duplicates it takes over and applies the SWA recoveries.
        """
        ps = self.page_size
        n = floor_align(key.shape[0], ps)
        root: SwaTreeNode = self.root_node  # type: ignore[assignment]
        root.last_access_time = self._tick()
        if n == 0:
            return SwaInsertResult(0, root, False)
        alloc = self._alloc
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
            consumed_from = m
            # SWA: recover a tombstone the request still holds live SWA for
            if prev_prefix_len < total + m:
                frag: SwaTreeNode = child  # type: ignore[assignment]
                if frag.swa_value is None:
                    live_start = max(total, swa_evicted_seqlen)
                    if live_start < total + m:
                        if live_start > total:
                            self._split_node(frag, live_start - total)
                        incoming = np.array(value[live_start : total + m], dtype=SLOT_DTYPE)
                        self._recover(frag, incoming)
                        consumed_from = min(consumed_from, live_start - total)
            dup_start = max(0, prev_prefix_len - total)
            if dup_start < consumed_from:
                dup = value[total + dup_start : total + consumed_from]
                abs_start = total + dup_start
                k = min(max(swa_evicted_seqlen - abs_start, 0), dup.shape[0])
                if k > 0:
                    alloc.free_full_segment(dup[:k], start_pos=0)
                if k < dup.shape[0]:
                    alloc.free_segment(dup[k:], start_pos=0)
            node = child
            pos += m * 8
        total = pos // 8
        branch_inserted = swa_branching_seqlen is not None and n >= swa_branching_seqlen
        target = node
        if pos < nb:
            leaf = self._new_node()
            leaf.parent = node
            leaf.key = kb[pos:]
            leaf.value = np.array(value[total:n], dtype=SLOT_DTYPE)
            leaf.ns = ns
            node.children[ns + kb[pos : pos + psb]] = leaf
            self.evictable_size_ += n - total
            self._update_leaf_status(leaf)
            self._update_leaf_status(node)
            if self.journal is not None:
                self.journal.insert(leaf)
            if self.listener is not None:
                self.listener.stored(leaf)
            target = leaf
            # SWA commit: a tombstone below the cursor, live SWA above it, capped at a window
            live_start = max(total, swa_evicted_seqlen)
            if live_start < n:
                if live_start > total:
                    self._split_node(leaf, live_start - total)
                parent = self._split_for_lock(leaf)
                if parent is not None:
                    self._swa_rebuild(parent)
                self._swa_rebuild(leaf)
        if target is not root:
            self.swa_lru.reset_window_ancestors_mru(target, root, self.window + ps)
        return SwaInsertResult(total, target, branch_inserted)

    def _recover(self, node: SwaTreeNode, incoming: np.ndarray) -> None:
        """Give a tombstoned node the request's SWA for the same tokens."""
        alloc = self._alloc
        if node.lock_ref > 0:
            # RecoverSWAWithLockedFull: the request's SWA pages move under the node's full slots
            swa = alloc.translate_loc_from_full_to_swa(incoming).astype(np.int64)
            alloc.clear_full_to_swa_mapping(incoming)
            alloc.set_full_to_swa_mapping(node.value, swa)
            alloc.free_full_segment(incoming, start_pos=0)
            self._set_swa_value(node, swa)
            self.stats["recovered_locked"] += 1
            return
        old = node.value
        node.value = incoming
        if self.journal is not None:
            self.journal.recover(node, old)
        alloc.free_full_segment(old, start_pos=0)
        self._swa_rebuild(node)
        self.stats["recovered"] += 1

    def _split_for_lock(self, leaf: SwaTreeNode) -> SwaTreeNode | None:
        if leaf.swa_lock_ref > 0:
            return None
        ps = self.page_size
        tail = ceil_align(self.window, ps)
        if len(leaf) <= tail:
            return None
        self.stats["window_split"] += 1
        return self._split_node(leaf, len(leaf) - tail)

    # ------------------------------------------------------------------ locks

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock FULL on the whole path and SWA over the trailing window; the receipt
        (window boundary uuid) is left in ``last_lock_uuid``."""
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
        covered = 0
        uuid = None
        cur = node
        while cur is not root and covered < self.window:
            if cur.swa_lock_ref == 0 and cur.swa_value is not None:
                k = len(cur.swa_value)
                self.swa_evictable_size_ -= k
                self.swa_protected_size_ += k
            cur.swa_lock_ref += 1
            covered += len(cur)
            if covered >= self.window:
                if cur.swa_uuid is None:
                    cur.swa_uuid = next(self._uuids)
                uuid = cur.swa_uuid
            cur = cur.parent
        self._update_leaf_status(node)
        self.last_lock_uuid = uuid
        return delta

    def release_swa_lock(self, node: TreeNode, swa_uuid: int) -> None:
        """SGLang ``release_swa``: the SWA part of a lock released early, up to the node
        holding ``swa_uuid``; FULL stays locked. No node on the path is a device leaf
        (FULL is locked), so nothing is evicted here."""
        if self.journal is not None:
            self.journal.lock(node)
        self._dec_swa_lock(node, swa_uuid)

    def dec_lock_ref(self, node: TreeNode, swa_uuid: int | None = None, skip_swa: bool = False) -> int:  # type: ignore[override]
        """Release a lock: SWA up to the node holding ``swa_uuid`` (the root when None;
        none with ``skip_swa``: released early), then FULL on the whole path."""
        if self.journal is not None:
            self.journal.lock(node)
        if not skip_swa:
            self._dec_swa_lock(node, swa_uuid)
        root = self.root_node
        delta = 0
        cur = node
        while cur is not root:
            if cur.lock_ref == 1:
                k = len(cur)
                self.evictable_size_ += k
                self.protected_size_ -= k
                delta += k
            cur.lock_ref -= 1
            self._update_leaf_status(cur)
            cur = cur.parent
        self._update_leaf_status(node)
        return delta

    def _dec_swa_lock(self, node: TreeNode, swa_uuid: int | None) -> None:
        root = self.root_node
        cur = node
        while cur is not root:
            ref = cur.swa_lock_ref
            assert ref > 0, f"SWA lock release hit swa_lock_ref=0 on node {cur.id}"
            if ref == 1 and cur.swa_value is not None:
                k = len(cur.swa_value)
                self.swa_evictable_size_ += k
                self.swa_protected_size_ -= k
            cur.swa_lock_ref = ref - 1
            if ref == 1:
                self._update_leaf_status(cur)
            if swa_uuid is not None and cur.swa_uuid == swa_uuid:
                break
            cur = cur.parent

    def peek_swa_release(self, nodes: list[tuple[TreeNode, int]]) -> int:
        """SWA tokens that ``release_swa_lock`` of each (node, uuid) in turn would make
        evictable. Changes nothing."""
        root = self.root_node
        dec: dict[int, int] = {}
        freed = 0
        for node, swa_uuid in nodes:
            cur = node
            while cur is not root:
                d = dec.get(id(cur), 0) + 1
                dec[id(cur)] = d
                if cur.swa_lock_ref == d and cur.swa_value is not None:
                    freed += len(cur.swa_value)
                if cur.swa_uuid == swa_uuid:
                    break
                cur = cur.parent
        return freed

    def unlock(self, node: TreeNode | None, swa_uuid: int | None = None, skip_swa: bool = False) -> None:  # type: ignore[override]
        if node is not None:
            self.dec_lock_ref(node, swa_uuid, skip_swa)

    # ------------------------------------------------------------------ eviction

    def evict(self, num_tokens: int) -> int:
        """FULL-only eviction of ``num_tokens`` (LRU leaves, whole nodes)."""
        return self.evict_pools(num_tokens, 0, targets=False)

    def evict_pools(self, full_tokens: int, swa_tokens: int, targets: bool = True) -> int:
        """SGLang ``evict_for_alloc(EvictParams(full, swa))``: the FULL walk for the full
        pool's shortfall, then the SWA walk for the SWA pool's.

        With ``targets`` each walk stops as soon as its pool has the shortfall free
        (``available at start + shortfall``), the FULL walk is not capped by its count.

        Returns:
            FULL tokens evicted (leaf deletions from either walk).
        """
        alloc = self._alloc
        tracker = {"full": 0, "swa": 0}
        full_target = alloc.full_available_size() + full_tokens if targets and full_tokens > 0 else None
        swa_target = alloc.swa_available_size() + swa_tokens if targets and swa_tokens > 0 else None
        # FULL walk
        if full_tokens > 0 and not (full_target is not None and alloc.full_available_size() >= full_target):
            quota = max(full_tokens, tracker["full"] + self.evictable_size_) if full_target is not None else full_tokens
            heap = [(n.last_access_time, n.id, n) for n in self.evictable_leaves]
            heapq.heapify(heap)
            # the parent of the last leaf deleted (``_delete_leaf`` detaches the leaf):
            # SGLang pushes it when the deletion left it an evictable leaf
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
                if full_target is not None and alloc.full_available_size() >= full_target:
                    break
        # SWA walk
        swa_done = (swa_target is not None and alloc.swa_available_size() >= swa_target) or tracker["swa"] >= swa_tokens
        if swa_tokens > 0 and not swa_done:
            lru = self.swa_lru
            cursor = lru.lru_unlocked()
            while True:
                if cursor is not None and not lru.in_list(cursor):
                    cursor = lru.lru_unlocked()
                if tracker["swa"] >= swa_tokens or cursor is None:
                    break
                x = cursor
                if x in self.evictable_leaves:
                    cursor = lru.prev_unlocked(x)
                    self._delete_leaf(x, tracker)
                    self.stats["swa_leaf_deleted"] += 1
                else:
                    cursor = lru.prev_unlocked(x)
                    tracker["swa"] += self._tombstone(x)
                    self.stats["tombstoned"] += 1
                if swa_target is not None and alloc.swa_available_size() >= swa_target:
                    break
        self.evicted_tokens_total += tracker["full"]
        self.swa_evicted_tokens_total += tracker["swa"]
        return tracker["full"]

    def _delete_leaf(self, x: SwaTreeNode, tracker: dict[str, int]) -> None:
        """Delete an unlocked device leaf whole (full side, then SWA side), then any
        childless unlocked ancestors left behind (none in a device-only tree)."""
        alloc = self._alloc
        psb = self.page_size * 8
        if self.journal is not None:
            self.journal.evict(x, x.parent)
        if self.listener is not None:  # the full side goes: a tombstone is no removal
            self.listener.removed(x)
        n = len(x)
        self.evictable_size_ -= n
        tracker["full"] += n
        swa_n = 0
        if x.swa_value is not None:
            swa_n = len(x.swa_value)
            self.swa_evictable_size_ -= swa_n
            tracker["swa"] += swa_n
            self.swa_lru.remove(x)
        # device_frees drain in component order: FULL (full pool only), then SWA
        alloc.full_attn_allocator.free_segment(x.value, 0)
        if x.swa_value is not None:
            alloc.free_swa_segment(x.value, start_pos=0)
            x.swa_value = None
        parent = x.parent
        del parent.children[x.ns + x.key[:psb]]
        self.evictable_leaves.discard(x)
        x.parent = None
        self._update_leaf_status(parent)

    # ------------------------------------------------------------------ trial copy

    def trial_copy(self) -> SwaRadixCache:
        """An independent copy of the tree and its allocator, to try a call on and
        throw away (no journal). Nodes are copied one by one (no recursion through
        the LRU links); slot arrays are copied too."""
        import copy

        new = copy.copy(self)
        new.journal = None
        new.token_to_kv_pool_allocator = copy.deepcopy(self.token_to_kv_pool_allocator)
        old_nodes: list[SwaTreeNode] = [self.swa_lru.head, self.swa_lru.tail]
        stack: list[SwaTreeNode] = [self.root_node]  # type: ignore[list-item]
        while stack:
            x = stack.pop()
            old_nodes.append(x)
            stack.extend(x.children.values())  # type: ignore[arg-type]
        twin: dict[int, SwaTreeNode] = {id(x): copy.copy(x) for x in old_nodes}
        for x in old_nodes:
            y = twin[id(x)]
            y.parent = None if x.parent is None else twin[id(x.parent)]
            y.children = {k: twin[id(c)] for k, c in x.children.items()}
            y.lru_prev = None if x.lru_prev is None else twin[id(x.lru_prev)]
            y.lru_next = None if x.lru_next is None else twin[id(x.lru_next)]
            if x.value is not None:
                y.value = x.value.copy()
            if x.swa_value is not None:
                y.swa_value = x.swa_value.copy()
        new.root_node = twin[id(self.root_node)]
        lru = copy.copy(self.swa_lru)
        lru.head, lru.tail = twin[id(self.swa_lru.head)], twin[id(self.swa_lru.tail)]
        lru.members = set(self.swa_lru.members)
        new.swa_lru = lru
        new.evictable_leaves = {twin[id(x)] for x in self.evictable_leaves}
        new._heap = []
        new._uuids = itertools.count(1 << 40)  # receipts of the trial's own locks: never the live ones
        new.stats = dict(self.stats)
        return new

    # ------------------------------------------------------------------ reads

    def swa_nodes(self) -> Iterator[SwaTreeNode]:
        return self.iter_nodes()  # type: ignore[return-value]
