"""The radix-tree half of the incremental checker: lock counts, new nodes, row prefixes.

``LockShadow`` keeps, for every node some live request locks, how many requests lock
it (``expected``: each request locks the path root..its lock node), and the tokens on
such nodes. After a call it updates the counts from the rows whose lock node changed
(old path -1, new path +1; a node split in the call inherits its lower part's count)
and compares ``lock_ref`` with them on every node of those paths and of the paths the
call locked or unlocked. Violations carry the full walk's check name, ``tree``; a row
prefix that differs from its locked path is a page anomaly, described by the full
row pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from allocator.base import Violation

if TYPE_CHECKING:
    from allocator.check.incremental import Changes
    from allocator.manager import KvAllocator
    from allocator.radix_cache import TreeNode

__all__ = ["LockShadow"]

_MAX_ITEMS = 8


class LockShadow:
    """Expected radix lock counts, kept from the rows' lock nodes.

    Args:
        allocator: the allocator whose tree and rows are watched.
    """

    def __init__(self, allocator: KvAllocator) -> None:
        self.allocator = allocator
        self.expected: dict[TreeNode, int] = {}
        self.protected_tokens = 0
        self.seen_lock: list[TreeNode | None] = []
        self.seen_prot = np.zeros(0, dtype=np.int64)

    def seed(self) -> None:
        """Recount from the live rows' lock nodes."""
        kv = self.allocator.req_kv
        self.seen_lock = [kv.lock_node[r] if kv.rid[r] >= 0 else None for r in range(kv.num_rows)]
        self.seen_prot = kv.cache_protected_len.copy()
        self.expected = {}
        self.protected_tokens = 0
        for node in self.seen_lock:
            self._count(node, 1, None, None)

    def split(self, upper: TreeNode, child: TreeNode) -> None:
        """``upper`` was cut off the top of ``child``: whoever locks child locks upper."""
        c = self.expected.get(child, 0)
        if c:
            self.expected[upper] = c

    def _count(self, node: TreeNode | None, delta: int, seen: set[TreeNode] | None,
               evicted: dict[TreeNode, TreeNode] | None) -> None:
        """Add ``delta`` requests locking the path root..node (``seen`` collects the path)."""
        root = self.allocator.tree_cache.root_node
        expected = self.expected
        while node is not None and node is not root:
            c = expected.get(node, 0)
            if c == 0 and delta > 0:
                self.protected_tokens += len(node)
            elif c > 0 and c + delta <= 0:
                self.protected_tokens -= len(node)
            if c + delta:
                expected[node] = c + delta
            else:
                expected.pop(node, None)
            if seen is not None:
                seen.add(node)
            parent = node.parent
            if parent is None and evicted is not None:
                parent = evicted.get(node)
            node = parent

    def check(self, ch: Changes, mapped: np.ndarray | None, cached_tokens: int) -> None:
        """Update the counts from what the call changed and compare them with the tree.

        Args:
            ch: the journal replay (violations go to ``ch.tree``).
            mapped: int64 rows of the requests touched (-1: holds none); None when the
                call moved no row and no lock.
            cached_tokens: tokens the page shadow says the tree holds.
        """
        a = self.allocator
        kv = a.req_kv
        seen: set[TreeNode] = set()
        changed: dict[int, TreeNode | None] = {}
        if ch.lock_nodes or ch.rows_changed:  # a row's lock node changes only with these
            cand = set(ch.rows_changed)
            if mapped is not None:
                cand.update(mapped[mapped >= 0].tolist())
            for row in cand:
                now = kv.lock_node[row] if kv.rid[row] >= 0 else None
                old = self.seen_lock[row]
                if now is not old:
                    self._count(old, -1, seen, ch.evicted_nodes)
                    self._count(now, 1, seen, ch.evicted_nodes)
                    self.seen_lock[row] = now
                    changed[row] = old
        for node in ch.lock_nodes:
            if node not in seen:  # else its path is walked already
                self._count(node, 0, seen, ch.evicted_nodes)
        if ch.new_nodes:
            self._check_new_nodes(ch, seen)
        if ch.evicted_nodes:
            for node in sorted(self.expected.keys() & ch.evicted_nodes.keys(), key=lambda n: n.id):
                if self.expected.pop(node) > 0:
                    ch.tree.append(Violation("tree", f"node {node.id} was evicted while requests lock it", None,
                                             {"node": node.id}))
            seen.update(ch.evicted_nodes.values())
            seen.difference_update(ch.evicted_nodes)
        if seen:
            self._check_nodes(ch, seen)
        prot_now = kv.cache_protected_len
        old_prot: dict[int, int] = {}
        if prot_now.tobytes() != self.seen_prot.tobytes():
            moved = np.flatnonzero(prot_now != self.seen_prot)
            old_prot = dict(zip(moved.tolist(), self.seen_prot[moved].tolist()))
            self.seen_prot[moved] = prot_now[moved]
        if changed or old_prot or ch.prefix_rows:
            for row in set(changed) | set(old_prot) | set(ch.prefix_rows):
                if kv.rid[row] >= 0:
                    start = old_prot.get(row, 0)
                    if row in ch.prefix_rows:
                        start = min(start, ch.prefix_rows[row])
                    self._check_path(ch, row, changed.get(row, kv.lock_node[row]), start)
        tree = a.tree_cache
        evictable, protected = tree.evictable_size(), tree.protected_size()
        if evictable + protected != cached_tokens or protected != self.protected_tokens:
            ch.tree.append(Violation("tree", f"evictable_size {evictable} / protected_size {protected} kept, the "
                                     f"tree holds {cached_tokens} tokens, {self.protected_tokens} of them locked by "
                                     f"requests", None, {"cached": cached_tokens, "protected": self.protected_tokens}))

    def _check_new_nodes(self, ch: Changes, seen: set[TreeNode]) -> None:
        ps = self.allocator.page_size
        for node in ch.new_nodes:
            n = len(node)
            if n == 0 or n % ps or len(node.key) != 8 * n:
                ch.tree.append(Violation("tree", f"node {node.id}: length {n} (key {len(node.key) // 8} units), "
                                         f"page size {ps}", None, {"node": node.id, "len": n}))
            seen.add(node)

    def _check_nodes(self, ch: Changes, nodes: set[TreeNode]) -> None:
        """Lock counts and evictable-leaf listing of the nodes on the touched paths (the
        violations in node id order, whatever the set's order)."""
        tree = self.allocator.tree_cache
        root = tree.root_node
        leaves = tree.evictable_leaves
        bad: list[tuple[int, TreeNode, int, bool]] = []  # (id, node, locks wanted, is an evictable leaf)
        for node in nodes:
            if node is root or node.parent is None:
                continue  # the root, or a node evicted in this call
            want = self.expected.get(node, 0)
            leaf = node.lock_ref == 0 and not node.children
            if node.lock_ref != want or leaf != (node in leaves):
                bad.append((node.id, node, want, leaf))
        bad_lock = 0
        for _, node, want, leaf in sorted(bad, key=lambda b: b[0]):
            if node.lock_ref != want:
                bad_lock += 1
                if bad_lock <= _MAX_ITEMS:
                    ch.tree.append(Violation("tree", f"node {node.id}: lock_ref {node.lock_ref}, requests lock it "
                                             f"{want} times", None, {"node": node.id, "lock_ref": node.lock_ref}))
            if leaf != (node in leaves):
                ch.tree.append(Violation("tree", f"node {node.id}: evictable leaf {leaf} but listed {not leaf}",
                                         None, {"node": node.id}))

    def _check_path(self, ch: Changes, row: int, old_node: TreeNode | None, start: int) -> None:
        """A touched row's lock is attached and long enough, and its row prefix equals the
        path: from ``start`` on when the old lock node is still on the path (the part
        before was compared when it was protected), else from 0."""
        a = self.allocator
        kv = a.req_kv
        tree = a.tree_cache
        rid = int(kv.rid[row])
        prot = int(kv.cache_protected_len[row])
        node = kv.lock_node[row]
        if node is None:
            if prot and not tree.disable:
                ch.tree.append(Violation("tree", f"rid={rid}: protected {prot} but holds no radix lock", rid,
                                         {"protected": prot}))
            return
        path: list[TreeNode] = []
        cur = node
        while cur is not tree.root_node:
            if cur.parent is None:
                ch.tree.append(Violation("tree", f"rid={rid}: its locked node was evicted or detached", rid, {}))
                ch.flag("a row prefix on a detached path")
                return
            path.append(cur)
            cur = cur.parent
        path_len = sum(len(n) for n in path)
        if path_len < prot:
            ch.tree.append(Violation("tree", f"rid={rid}: locked path holds {path_len} tokens, protected is {prot}",
                                     rid, {"path_len": path_len, "protected": prot}))
            ch.flag("a row prefix longer than its locked path")
            return
        if old_node is None or not any(n is old_node for n in path):
            start = 0
        start = min(start, prot)
        parts = []
        pos = 0
        for n in reversed(path):
            size = len(n)
            if pos + size > start and pos < prot:
                parts.append(n.value[max(start - pos, 0) : min(prot - pos, size)])
            pos += size
            if pos >= prot:
                break
        got = a.req_to_token_pool.req_to_token_np[row, start:prot]
        if got.shape[0]:
            want = parts[0] if len(parts) == 1 else np.concatenate(parts)
            if want.shape[0] != got.shape[0] or np.count_nonzero(want != got):
                ch.flag("a row prefix differs from its locked radix path")
