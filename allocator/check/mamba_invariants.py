"""The Mamba pool's invariants (hybrid linear-attention models), each violation with ``pool="mamba"``.

Every slot ``1..size`` is in exactly one place::

    free list | open admission group | a request (state slot, tracking slots) | the tree

Checks:

* ``conservation``: ``available + group + held + tree == size`` (SGLang's busy check:
  ``available + evictable + protected + session_held == total``).
* ``double_free``: a slot listed twice on the free list (a slot freed twice).
* ``ownership``: a slot in two places (free and held, held by two requests, a
  request's slot also the tree's); slot 0 or one above ``size`` anywhere.
* ``leak``: slots in no place, listed as SGLang's ``leaked_mamba_pages`` lists them.
* ``mapping``: a held row whose ``req_index_to_mamba_index_mapping`` (or ping-pong
  mapping) disagrees with its request; two requests on one row.
* ``tracking``: a tracking entry marked empty that holds a slot, or the reverse.

With the radix tree (``check_mamba_tree``, ``allocator.mamba_radix``):

* ``conservation`` per pool: full ``available + held by requests + cached == size``
  (``pool="full"``); Mamba ``available + held + cached states == size``.
* ``ownership``: a state slot cached on two nodes, or cached and also free or held.
* ``leak``: state slots in no place (neither free, held nor cached).
* ``tree_ledger``: the tree's evictable / protected state counts disagree with its
  nodes (protected = states on Mamba-locked nodes), or its LRU list is not exactly
  the state-holding nodes.
* ``state_reuse``: a request copied a state (``mamba_cow_src``) that no node on its
  own key's path holds: a state handed across requests that share no prefix.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

from allocator.base import Violation
from allocator.mamba import HybridReqToTokenPool, MambaReqKv

if TYPE_CHECKING:
    import numpy as np

    from allocator.mamba_radix import MambaRadixCache

__all__ = ["check_mamba", "check_mamba_tree"]

_POOL = "mamba"
_MAX_ITEMS = 8


def _short(slots: Iterable[int]) -> str:
    s = sorted(slots)
    return str(s[:_MAX_ITEMS])[:-1] + (", ...]" if len(s) > _MAX_ITEMS else "]")


def check_mamba(
    pool: HybridReqToTokenPool, reqs: Iterable[MambaReqKv], tree_slots: Iterable[int] = ()
) -> list[Violation]:
    """Every broken Mamba pool invariant.

    Args:
        pool: the hybrid request pool.
        reqs: every request that may hold a row or a slot.
        tree_slots: slots the radix tree keeps as checkpoints.
    """
    out: list[Violation] = []
    reqs = list(reqs)
    tree = [int(s) for s in tree_slots]
    size = pool.mamba_size
    free = pool.mamba_allocator.free_slots.tolist()
    group = pool.mamba_allocator.group_remaining()
    held = {req.rid: req.held_slots() for req in reqs}
    num_held = sum(len(v) for v in held.values())

    accounted = len(free) + len(group) + num_held + len(tree)
    if accounted != size:
        out.append(Violation(
            "conservation",
            f"available {len(free)} + group {len(group)} + held {num_held} + tree {len(tree)} = {accounted}, "
            f"pool has {size} slots",
            None,
            {"available": len(free), "group": len(group), "held": num_held, "tree": len(tree), "total": size},
            _POOL,
        ))

    twice = sorted(s for s, n in Counter(free).items() if n > 1)
    if twice:
        out.append(Violation("double_free", f"slots on the free list more than once: {_short(twice)}",
                             None, {"slot": twice[0], "count": len(twice)}, _POOL))

    # Where each slot is: ("free" | "group" | "tree" | rid) per occurrence, free list deduplicated.
    places: dict[int, list[object]] = {}
    for s in set(free):
        places.setdefault(s, []).append("free")
    for s in group:
        places.setdefault(s, []).append("group")
    for s in tree:
        places.setdefault(s, []).append("tree")
    for rid, slots in held.items():
        for s in slots:
            places.setdefault(s, []).append(rid)
    for s in sorted(places):
        where = places[s]
        owners = [w for w in where if not isinstance(w, str)]
        if not 1 <= s <= size:
            out.append(Violation("ownership", f"slot {s} outside 1..{size} is {where}",
                                 owners[0] if owners else None, {"slot": s}, _POOL))  # type: ignore[arg-type]
        elif len(where) > 1:
            out.append(Violation("ownership", f"slot {s} is in {len(where)} places: {where}",
                                 owners[0] if owners else None, {"slot": s}, _POOL))  # type: ignore[arg-type]
    leaked = sorted(set(range(1, size + 1)) - set(places))
    if leaked:
        out.append(Violation("leak", f"leaked_mamba_pages={{{', '.join(map(str, leaked[:_MAX_ITEMS]))}"
                             f"{', ...' if len(leaked) > _MAX_ITEMS else ''}}}",
                             None, {"slot": leaked[0], "count": len(leaked)}, _POOL))

    rows: dict[int, int] = {}
    free_rows = set(pool.free_slots)
    pp_map = pool.req_index_to_mamba_ping_pong_track_buffer_mapping
    for req in reqs:
        row = req.req_pool_idx
        if row is None:
            continue
        if row in rows:
            out.append(Violation("mapping", f"rid={req.rid} and rid={rows[row]} share row {row}", req.rid,
                                 {"row": row}, _POOL))
        rows[row] = req.rid
        if row in free_rows:
            out.append(Violation("mapping", f"rid={req.rid}: its row {row} is on the free rows", req.rid,
                                 {"row": row}, _POOL))
        mapped = int(pool.req_index_to_mamba_index_mapping[row])
        if req.mamba_pool_idx is not None and mapped != req.mamba_pool_idx:
            out.append(Violation("mapping", f"rid={req.rid}: row {row} maps to slot {mapped}, the request holds "
                                 f"{req.mamba_pool_idx}", req.rid, {"row": row, "mapped": mapped}, _POOL))
        if pp_map is not None and req.ping_pong is not None and pp_map[row].tolist() != req.ping_pong.tolist():
            out.append(Violation("mapping", f"rid={req.rid}: row {row}'s ping-pong mapping {pp_map[row].tolist()} "
                                 f"!= the request's {req.ping_pong.tolist()}", req.rid, {"row": row}, _POOL))
    for req in reqs:
        if req.ping_pong is None or req.ping_pong_empty is None:
            continue
        for i, (slot, empty) in enumerate(zip(req.ping_pong.tolist(), req.ping_pong_empty)):
            if empty != (slot == -1):
                out.append(Violation("tracking", f"rid={req.rid}: ping-pong entry {i} holds {slot} but is marked "
                                     f"{'empty' if empty else 'held'}", req.rid, {"entry": i, "slot": slot}, _POOL))
    return out


def check_mamba_tree(
    tree: MambaRadixCache,
    held_full: int | None = None,
    held_states: Iterable[int] = (),
    reqs: Iterable[tuple[MambaReqKv, np.ndarray]] = (),
) -> list[Violation]:
    """The radix tree's Mamba invariants, and both pools' conservation around it.

    Args:
        tree: the radix tree with the Mamba component (and its two allocators).
        held_full: full KV tokens requests hold outside the tree (None: skip the full
            pool's conservation).
        held_states: state slots requests hold (their own slots, tracking slots).
        reqs: requests just matched, with their key (units): each one holding a copied
            state (``mamba_cow_src``) is checked against the node that state sits on.
            Only right after the match: the source may be evicted and its slot reused later.
    """
    out: list[Violation] = []
    if held_full is not None:
        alloc = tree.token_to_kv_pool_allocator
        avail, cached, size = alloc.available_size(), tree.evictable_size_ + tree.protected_size_, alloc.size
        if avail + held_full + cached != size:
            out.append(Violation(
                "conservation", f"full: available {avail} + held {held_full} + cached {cached} != {size}", None,
                {"available": avail, "held": held_full, "cached": cached, "total": size}, "full"))
    mpool = tree.mamba_allocator
    free = mpool.free_slots.tolist()
    group = mpool.group_remaining()
    held = [int(s) for s in held_states]
    cached_states = tree.cached_states()
    accounted = len(free) + len(group) + len(held) + len(cached_states)
    if accounted != mpool.size:
        out.append(Violation(
            "conservation", f"available {len(free)} + group {len(group)} + held {len(held)} + cached "
            f"{len(cached_states)} = {accounted}, pool has {mpool.size} slots", None,
            {"available": len(free), "held": len(held), "cached": len(cached_states), "total": mpool.size}, _POOL))
    elsewhere = Counter(free) + Counter(group) + Counter(held)
    for slot, n in sorted(Counter(cached_states).items()):
        if n > 1 or slot in elsewhere:
            where = f"{n} nodes" + (f" and {elsewhere[slot]} other place(s)" if slot in elsewhere else "")
            out.append(Violation("ownership", f"state slot {slot} is cached on {where}", None, {"slot": slot}, _POOL))
    leaked = sorted(set(range(1, mpool.size + 1)) - set(elsewhere) - set(cached_states))
    if leaked:
        out.append(Violation("leak", f"leaked_mamba_pages={{{', '.join(map(str, leaked[:_MAX_ITEMS]))}"
                             f"{', ...' if len(leaked) > _MAX_ITEMS else ''}}}",
                             None, {"slot": leaked[0], "count": len(leaked)}, _POOL))
    holders = {}
    protected = 0
    for node in tree.mamba_nodes():
        if node.mamba_value is not None:
            holders.setdefault(node.mamba_value, node)
            protected += node.mamba_lock_ref > 0
    states = sum(1 for n in tree.mamba_nodes() if n.mamba_value is not None)
    ev, pr = tree.mamba_evictable_size(), tree.mamba_protected_size()
    if ev + pr != states or pr != protected:
        out.append(Violation("tree_ledger", f"evictable {ev} + protected {pr} states, the nodes hold {states} "
                             f"({protected} locked)", None,
                             {"evictable": ev, "protected": pr, "states": states, "locked": protected}, _POOL))
    in_lru = {n.id for n in tree.mamba_lru}
    with_state = {n.id for n in tree.mamba_nodes() if n.mamba_value is not None}
    if in_lru != with_state:
        out.append(Violation("tree_ledger", f"LRU list {_short(in_lru)} != state-holding nodes {_short(with_state)}",
                             None, {"lru": len(in_lru), "states": len(with_state)}, _POOL))
    for req, key in reqs:
        src = req.mamba_cow_src
        if src is None:
            continue
        node = holders.get(src)
        if node is None:
            out.append(Violation("state_reuse", f"rid={req.rid} copied state slot {src}, which no tree node holds",
                                 req.rid, {"slot": src}, _POOL))
            continue
        path = tree.path_key(node)
        k = path.shape[0]
        if k > len(key) or not (key[:k] == path).all():
            out.append(Violation("state_reuse", f"rid={req.rid} copied state slot {src} of a {k}-unit prefix "
                                 f"its key does not start with", req.rid, {"slot": src, "prefix_len": k}, _POOL))
    return out
