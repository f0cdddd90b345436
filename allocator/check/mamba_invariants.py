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
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from allocator.base import Violation
from allocator.mamba import HybridReqToTokenPool, MambaReqKv

__all__ = ["check_mamba"]

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
