"""Radix eviction policies: SGLang 0.5.23's ``mem_cache/evict_policy.py`` strategies.

A policy is a key function on a tree node; eviction repeatedly takes the evictable
leaf with the smallest key (SGLang builds a heap of ``(get_priority(node), node)``
and pops it). Each key here is SGLang's ``get_priority`` tuple, read off the node
fields SGLang's ``TreeNode`` carries:

- ``last_access_time``: the logical clock of the last match or insert through the
  node (``RadixCache._tick``);
- ``creation_time``: SGLang stamps it once when the node is made; node ids are
  issued in creation order, so ``node.id`` orders nodes exactly as it does;
- ``hit_count``: bumped by an insert through the node past what the inserting
  request had already inserted (``cache_inserted_len``), copied to the upper half
  of a split;
- ``priority``: the max of the priorities inserted through the node (a request's
  priority; the prompt part of a checkpoint is inserted at priority + 1).

Ties: SGLang breaks an equal key by ``TreeNode.__lt__`` (last access time). Every
key here already ends in the access time, or in the creation time (unique per
node), and no two evictable leaves share an access time (one walk stamps one
root-to-node path, holding at most one leaf), so the order is total and the same
as SGLang's. T-LRU (``tlru``) reads per-node tail lengths that only SGLang's
unified tree keeps; SGLang refuses it on the plain ``RadixCache``, as we do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Literal, Union, get_args

if TYPE_CHECKING:
    from allocator.radix_cache import TreeNode

__all__ = ["EVICTION_POLICIES", "EvictionPolicy", "EvictKey", "check_eviction_policy", "eviction_key"]

EvictionPolicy = Literal["lru", "lfu", "fifo", "mru", "filo", "priority", "slru"]
EVICTION_POLICIES: tuple[str, ...] = get_args(EvictionPolicy)
EvictKey = Union[int, float, tuple]

# SGLang's ``SLRUStrategy`` default: a node hit this often is in the protected segment.
SLRU_PROTECTED_THRESHOLD = 2


def _lfu(node: TreeNode) -> EvictKey:
    return (node.hit_count, node.last_access_time)


def _fifo(node: TreeNode) -> EvictKey:
    return node.id


def _mru(node: TreeNode) -> EvictKey:
    return -node.last_access_time


def _filo(node: TreeNode) -> EvictKey:
    return -node.id


def _priority(node: TreeNode) -> EvictKey:
    return (node.priority, node.last_access_time)


def _slru(node: TreeNode) -> EvictKey:
    # Segment 0 (probationary) goes before segment 1 (protected), LRU within each.
    return (1 if node.hit_count >= SLRU_PROTECTED_THRESHOLD else 0, node.last_access_time)


_KEYS: dict[str, Callable[[TreeNode], EvictKey] | None] = {
    "lru": None,  # the radix cache's own fast path: the key is ``last_access_time``
    "lfu": _lfu,
    "fifo": _fifo,
    "mru": _mru,
    "filo": _filo,
    "priority": _priority,
    "slru": _slru,
}


def check_eviction_policy(name: str) -> str:
    """``name`` lower-cased if it is a policy the radix cache runs.

    Raises:
        ValueError: naming the valid policies (and why ``tlru`` is not one).
    """
    policy = name.lower()
    if policy in _KEYS:
        return policy
    why = (" (tlru needs the per-node tail lengths of SGLang's unified tree; SGLang refuses it on "
           "the plain RadixCache too)" if policy == "tlru" else "")
    raise ValueError(f"unknown eviction policy {name!r}{why}; valid: {', '.join(EVICTION_POLICIES)}")


def eviction_key(name: str) -> Callable[[TreeNode], EvictKey] | None:
    """The key function of policy ``name`` (smallest evicted first); None for LRU, whose
    key is ``node.last_access_time`` (read inline on the hot path).

    Raises:
        ValueError: an unknown policy (``check_eviction_policy``).
    """
    return _KEYS[check_eviction_policy(name)]
