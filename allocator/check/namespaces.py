"""The cache-namespace invariants (SGLang's ``RadixKey.extra_key`` / ``cache_salt``):
KV of one namespace never serves a request of another.

Checks (kind ``namespace``):

* every node on a locked radix path is in the namespace of the node below the root it
  hangs from: no path mixes namespaces (a node's namespace prefix equals its parent's,
  the root's children aside);
* each live request's locked path is in the request's own namespace
  (``KvAllocator.request_namespaces``; none for a request without one): a request
  never matched, and never holds, a prefix cached for another namespace. The
  violation names the request and both namespaces.

Only paths some request locks are walked, so the cost is that of the live requests'
paths; the whole tree's nodes are walked by ``check_tree_namespaces`` (tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from allocator.base import Violation

if TYPE_CHECKING:
    from allocator.manager import KvAllocator
    from allocator.radix_cache import RadixCache, TreeNode

__all__ = ["check_namespaces", "check_tree_namespaces", "prefix_name"]

_MAX_ITEMS = 8


def prefix_name(ns: bytes) -> str | None:
    """The namespace name a node's prefix (``traces.namespaces.key_prefix``) stands for."""
    return ns[5:].decode(errors="replace") if ns else None


def _mixed(node: TreeNode, root: TreeNode) -> TreeNode | None:
    """The first node on the path ``node``..root whose namespace differs from its child's."""
    cur = node
    while cur.parent is not None and cur.parent is not root:
        if cur.parent.ns != cur.ns:
            return cur
        cur = cur.parent
    return None


def check_namespaces(out: list[Violation], allocator: KvAllocator, rows: np.ndarray, rids: np.ndarray) -> None:
    """Append the namespace violations of the requests in ``rows`` / ``rids``."""
    tree = allocator.tree_cache
    if tree.disable:
        return
    root = tree.root_node
    names = allocator.request_namespaces
    seen: set[int] = set()
    found = 0
    for row, rid in zip(rows.tolist(), rids.tolist()):
        node = allocator.req_kv.lock_node[row]
        if node is None or node is root:
            continue
        want = names.get(rid)
        have = prefix_name(node.ns)
        if have != want and found < _MAX_ITEMS:
            found += 1
            out.append(
                Violation(
                    "namespace",
                    f"rid={rid} (namespace {want!r}) holds radix node {node.id} of namespace {have!r}: "
                    "its cached prefix is shared with another namespace",
                    rid,
                    {"node": node.id},
                )
            )
        if node.id not in seen:
            seen.add(node.id)
            bad = _mixed(node, root)
            if bad is not None and found < _MAX_ITEMS:
                found += 1
                out.append(_mix_violation(bad))


def check_tree_namespaces(tree: RadixCache) -> list[Violation]:
    """Every node whose namespace differs from its parent's (the root's children aside)."""
    root = tree.root_node
    return [_mix_violation(n) for n in tree.iter_nodes() if n.parent is not root and n.parent.ns != n.ns]


def _mix_violation(node: TreeNode) -> Violation:
    parent = node.parent
    return Violation(
        "namespace",
        f"node {node.id} (namespace {prefix_name(node.ns)!r}) hangs under node {parent.id} "
        f"(namespace {prefix_name(parent.ns)!r}): a radix path mixes namespaces",
        None,
        {"node": node.id},
    )
