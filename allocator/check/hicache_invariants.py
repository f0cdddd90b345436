"""HiCache's invariants (``allocator.hiradix``), each violation naming its tier:
``pool="full"`` (the device KV pool, as the other checks name it) or ``pool="host"``.

Every device slot and every host slot is in exactly one place::

    device:  free list | held by requests | a node's value (evictable or protected)
    host:    free list (free_slots + release chunks) | a node's host_value

Checks:

* ``conservation`` per tier: device ``available + held + cached == size`` (when the
  held count is given); host ``available + cached == size``.
* ``double_free``: a host slot on the host free list twice (a slot freed twice).
* ``ownership``: a slot on two nodes, or on a node and free; a host slot whose in-use
  bit disagrees with where it is; a slot outside the pool.
* ``leak`` (host): host slots in no place.
* ``residency``: a node whose device or host slots do not cover its key (e.g. marked
  host-resident with no host slots); a node on device under an evicted ancestor
  (device eviction goes leaf first); a childless node on neither tier.
* ``tree_ledger``: evictable + protected != device tokens on nodes, protected != tokens
  on locked device nodes, or the D-leaf / H-leaf sets differ from the nodes'.
* ``inflight``: a node marked pending a write or a load that no in-flight transfer names.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from allocator.base import Violation

if TYPE_CHECKING:
    from allocator.hiradix import HiRadixCache, HiTreeNode

__all__ = ["check_hicache"]

_MAX_ITEMS = 8


def _short(slots: Iterable[int]) -> str:
    s = sorted(slots)
    return str(s[:_MAX_ITEMS])[:-1] + (", ...]" if len(s) > _MAX_ITEMS else "]")


def check_hicache(tree: HiRadixCache, held_device: int | None = None) -> list[Violation]:
    """Every broken HiCache invariant of ``tree`` and its two pools.

    Args:
        tree: the radix tree with the host tier (its device allocator and host pool).
        held_device: device tokens requests hold outside the tree (None: skip the device
            pool's conservation).

    Returns:
        The violations, each with ``pool`` "full" (device) or "host".
    """
    out: list[Violation] = []
    nodes: list[HiTreeNode] = list(tree.iter_nodes())
    _check_device(out, tree, nodes, held_device)
    _check_host(out, tree, nodes)
    _check_residency(out, tree, nodes)
    return out


def _check_device(out: list[Violation], tree: HiRadixCache, nodes: list[HiTreeNode], held: int | None) -> None:
    alloc = tree.token_to_kv_pool_allocator
    cached = [n.value for n in nodes if n.value is not None]
    slots = np.concatenate(cached) if cached else np.empty(0, dtype=np.int64)
    num_cached = int(slots.shape[0])
    if held is not None:
        avail = alloc.available_size()
        if avail + held + num_cached != alloc.size:
            out.append(Violation(
                "conservation", f"device: available {avail} + held {held} + cached {num_cached} != {alloc.size}",
                None, {"available": avail, "held": held, "cached": num_cached, "total": alloc.size}, "full"))
    # counts by slot (bincount: no sort; slots outside the pool are left to the other checks)
    size = alloc.size + tree.page_size
    ok = slots[(slots >= 0) & (slots < size)]
    on_nodes = np.bincount(ok, minlength=size)
    twice = np.flatnonzero(on_nodes > 1).tolist()
    if twice:
        out.append(Violation("ownership", f"device slots on two nodes: {_short(twice)}", None,
                             {"slot": twice[0], "count": len(twice)}, "full"))
    ps = tree.page_size
    free_pages = alloc.get_all_free_pages().astype(np.int64)
    free = (free_pages[:, None] * ps + np.arange(ps)).ravel() if ps > 1 else free_pages
    free = free[(free >= 0) & (free < size)]
    both = np.flatnonzero((on_nodes > 0) & (np.bincount(free, minlength=size) > 0)).tolist()
    if both:
        out.append(Violation("ownership", f"device slots cached and free: {_short(both)}", None,
                             {"slot": both[0], "count": len(both)}, "full"))
    ev, pr = tree.evictable_size_, tree.protected_size_
    locked = sum(n.value.shape[0] for n in nodes if n.value is not None and n.lock_ref > 0)
    if ev + pr != num_cached or pr != locked:
        out.append(Violation("tree_ledger", f"device: evictable {ev} + protected {pr}, the nodes hold {num_cached} "
                             f"({locked} locked)", None,
                             {"evictable": ev, "protected": pr, "cached": num_cached, "locked": locked}, "full"))
    d_leaves = {n.id for n in nodes if tree._is_device_leaf(n)}
    if d_leaves != {n.id for n in tree.evictable_leaves}:
        out.append(Violation("tree_ledger", f"device leaf set {_short(n.id for n in tree.evictable_leaves)} != "
                             f"the D-leaves {_short(d_leaves)}", None, {"leaves": len(d_leaves)}, "full"))


def _check_host(out: list[Violation], tree: HiRadixCache, nodes: list[HiTreeNode]) -> None:
    # Slot-level checks on arrays (a host pool holds a few device pools' worth of slots).
    host = tree.host_pool
    size = host.size
    free = host.free_view().astype(np.int64)
    owners = [n for n in nodes if n.host_value is not None]
    cached = np.concatenate([n.host_value for n in owners]).astype(np.int64) if owners else np.empty(0, np.int64)
    accounted = int(free.shape[0] + cached.shape[0])
    if accounted != size or host.available_size() != free.shape[0]:
        out.append(Violation(
            "conservation", f"host: available {host.available_size()} (free list {free.shape[0]}) + cached "
            f"{cached.shape[0]} = {accounted}, pool has {size} slots", None,
            {"available": int(free.shape[0]), "cached": int(cached.shape[0]), "total": size}, "host"))
    free_in = free[(free >= 0) & (free < size)]
    on_free = np.bincount(free_in, minlength=size)
    twice = np.flatnonzero(on_free > 1).tolist()
    if twice:
        out.append(Violation("double_free", f"host slots on the free list more than once: {_short(twice)}", None,
                             {"slot": twice[0], "count": len(twice)}, "host"))
    # places per slot: the free list (once, however often listed) and each node holding it
    every = np.concatenate([free, cached])
    outside = sorted(set(every[(every < 0) | (every >= size)].tolist()))
    for s in outside[:_MAX_ITEMS]:
        out.append(Violation("ownership", f"host slot {s} outside 0..{size - 1} is {_places(s, free, owners)}", None,
                             {"slot": s}, "host"))
    cached_in = cached[(cached >= 0) & (cached < size)]
    on_nodes = np.bincount(cached_in, minlength=size)
    places = (on_free > 0) + on_nodes
    for s in np.flatnonzero(places > 1)[:_MAX_ITEMS].tolist():
        where = _places(s, free, owners)
        out.append(Violation("ownership", f"host slot {s} is in {len(where)} places: {where}", None,
                             {"slot": s}, "host"))
    wrong = np.flatnonzero((places == 1) & (host.slot_used[:size] != (on_nodes > 0)))
    for s in wrong[:_MAX_ITEMS].tolist():
        where = _places(s, free, owners)[0]
        out.append(Violation("ownership", f"host slot {s} is {where} but marked "
                             f"{'in use' if host.slot_used[s] else 'free'}", None, {"slot": s}, "host"))
    leaked = np.flatnonzero(places == 0).tolist()
    if leaked:
        out.append(Violation("leak", f"host slots in no place: {_short(leaked)}", None,
                             {"slot": leaked[0], "count": len(leaked)}, "host"))
    h_leaves = {n.id for n in nodes if tree._is_host_leaf(n)}
    if h_leaves != {n.id for n in tree.evictable_host_leaves}:
        out.append(Violation("tree_ledger", f"host leaf set {_short(n.id for n in tree.evictable_host_leaves)} != "
                             f"the H-leaves {_short(h_leaves)}", None, {"leaves": len(h_leaves)}, "host"))


def _places(slot: int, free: np.ndarray, owners: list[HiTreeNode]) -> list[str]:
    """Where host slot ``slot`` is: "free" and/or each node holding it (a violation's words)."""
    where = ["free"] if np.any(free == slot) else []
    return where + [f"node {n.id}" for n in owners if np.any(n.host_value == slot)]


def _check_residency(out: list[Violation], tree: HiRadixCache, nodes: list[HiTreeNode]) -> None:
    writing = {x.id for op in tree.ongoing_write_through.values() for x in op.publish}
    loading = set(tree.ongoing_load_back)
    for n in nodes:
        k = len(n)
        if n.value is not None and n.value.shape[0] != k:
            out.append(Violation("residency", f"node {n.id}: {n.value.shape[0]} device slots for {k} units", None,
                                 {"node": n.id, "slots": int(n.value.shape[0]), "len": k}, "full"))
        if n.host_value is not None and n.host_value.shape[0] != k:
            out.append(Violation("residency", f"node {n.id}: marked host-resident with {n.host_value.shape[0]} "
                                 f"host slots for {k} units", None,
                                 {"node": n.id, "slots": int(n.host_value.shape[0]), "len": k}, "host"))
        if n.value is not None and n.parent is not tree.root_node and n.parent.value is None:  # type: ignore[union-attr]
            out.append(Violation("residency", f"node {n.id} is on device under evicted node {n.parent.id}",  # type: ignore[union-attr]
                                 None, {"node": n.id}, "full"))
        if n.value is None and n.host_value is None and not n.children:
            out.append(Violation("residency", f"node {n.id} is on neither tier and has no children", None,
                                 {"node": n.id}, "host"))
        if n.write_through_pending_id is not None and n.id not in writing:
            out.append(Violation("inflight", f"node {n.id} is pending a write no transfer names", None,
                                 {"node": n.id}, "host"))
        if n.load_back_pending_id is not None and n.load_back_pending_id not in loading:
            out.append(Violation("inflight", f"node {n.id} is pinned by load-back {n.load_back_pending_id}, "
                                 "which is not in flight", None, {"node": n.id}, "full"))
