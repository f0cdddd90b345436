"""check_integrity: every invariant of the built-in allocator's whole state, vectorised.

Checks (each violation names the request and the numbers):

* ``lengths``: ``0 <= cache_protected_len <= kv_committed_len <= kv_allocated_len <=
  row width`` and ``cache_protected_len`` page aligned, for every row in use; free
  rows hold zeros.
* ``rows``: free rows + rows in use == pool rows; no row free twice or free and in
  use; rid <-> row maps agree.
* ``counters``: the incrementally kept sums equal the recomputed ones.
* ``conservation``: ``available + evictable + protected + uncached == pool tokens``
  with ``uncached = sum(ceil_align(kv_allocated_len) - cache_protected_len)``.
* ``ownership``: every page (page 1: slot) of the pool is exactly one of: free,
  in the radix tree, owned by one request (its ``[cache_protected_len,
  ceil_align(kv_allocated_len))``); page 0 is nobody's.
* ``row``: entries ``[0, kv_allocated_len)`` are valid slots not on a free list;
  paged alignment ``row[pos] % ps == pos % ps`` and one page per page of positions;
  ``[0, cache_protected_len)`` equals the slots of the locked radix path.
* ``tree``: node lengths page aligned and positive; evictable / protected sizes and
  lock counts agree with the requests' locks.
* ``hisparse``: the device side of the HiSparse pair: every device page is free or
  mapped from exactly one live logical page, never both.
* ``device``: with a device table, its live entries equal the host copy.

These are the full pool's (``Violation.pool == "full"``); a hybrid sliding-window
allocator's SWA pool is checked by ``allocator.check.swa_invariants``, a Mamba pool by
``allocator.check.mamba_invariants`` (``check_mamba_pool``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from allocator.base import Violation
from allocator.pages import ceil_align
from allocator.ownership import PageHolders, full_side, page_holders
from allocator.token_to_kv import HiSparseTokenToKVPoolAllocator

if TYPE_CHECKING:
    from allocator.manager import KvAllocator
    from allocator.req_kv import ReqKvTable

__all__ = [
    "check_conservation",
    "check_counters",
    "check_hisparse",
    "check_integrity",
    "check_lengths",
    "check_pages",
]

# At most this many violations of one kind are itemised (the rest are counted).
_MAX_ITEMS = 8


def check_integrity(allocator: KvAllocator) -> list[Violation]:
    """Every broken invariant of ``allocator``'s state (empty when sound).

    Args:
        allocator: a ``KvAllocator`` (the built-in implementation).

    Returns:
        The violations found, each with the request (when one is at fault) and numbers.
    """
    out: list[Violation] = []
    pool = allocator.req_to_token_pool
    kv = allocator.req_kv
    tok = allocator.token_to_kv_pool_allocator
    ps = allocator.page_size
    width = pool.max_context_len
    rows = kv.rows_in_use()
    rids = kv.rid[rows]
    alloc = kv.kv_allocated_len[rows]
    committed = kv.kv_committed_len[rows]
    protected = kv.cache_protected_len[rows]

    check_lengths(out, kv, rows, rids, alloc, committed, protected, width, ps)
    _check_rows(out, allocator, rows, rids)
    ceil_alloc = ceil_align(alloc, ps)
    check_counters(out, kv, alloc, committed, protected, ceil_alloc)
    check_conservation(out, allocator, ceil_alloc, protected)
    check_session_held(out, allocator)
    if getattr(allocator.tree_cache, "host_pool", None) is None:
        _check_tree(out, allocator, rows, rids)  # (HiCache's tree: check_hicache, by the manager)
    ok_lengths = (protected >= 0) & (protected <= alloc) & (alloc <= width) & (protected % ps == 0)
    check_pages(out, allocator, rows[ok_lengths], rids[ok_lengths], alloc[ok_lengths], protected[ok_lengths])
    if isinstance(tok, HiSparseTokenToKVPoolAllocator):
        check_hisparse(out, tok, tok.logical_attn_allocator.get_all_free_pages(), ps)
    if pool.device_req_to_token is not None:
        _check_device(out, pool, rows, rids, alloc)
    if kv.swa:
        from allocator.check.swa_invariants import check_swa

        check_swa(out, allocator, rows[ok_lengths], rids[ok_lengths], alloc[ok_lengths], protected[ok_lengths])
    check_mamba_pool(out, allocator)
    return out


def check_mamba_pool(out: list[Violation], allocator: KvAllocator) -> None:
    """A hybrid linear-attention model's Mamba pool (``allocator.check.mamba_invariants``:
    conservation, double frees, ownership, leaks, the row -> slot mapping), each
    violation with ``pool="mamba"``; nothing without one. The pool holds a few slots
    per running request, so the whole of it is walked at every check. A violation
    about a slot no request holds (a leak, a double free) is blamed on the request
    the slot was last handed to (``KvAllocator.mamba_last_holder``)."""
    if allocator.ctx.mamba_reqs is None:
        return
    from allocator.check.mamba_invariants import check_mamba, check_mamba_tree
    from allocator.mamba_radix import MambaRadixCache

    last = allocator.mamba_last_holder
    tree = allocator.tree_cache
    found = []
    if isinstance(tree, MambaRadixCache):  # the radix cache's checkpointed states are a place too
        found = check_mamba(allocator.req_to_token_pool, allocator.mamba_reqs(), tree.cached_states())  # type: ignore[arg-type]
        # a copied state is checked while the request runs and its node still holds it
        # (later the slot may be evicted and reused for another prefix)
        # (node None: no node held the state at the match, reported once)
        matches = [(req, key, node) for req, key, node in allocator.mamba_matches
                   if node is None or (req.req_pool_idx is not None and node.parent is not None
                                       and node.mamba_value == req.mamba_cow_src)]
        allocator.mamba_matches = [m for m in matches if m[2] is not None]
        found += [v for v in check_mamba_tree(tree, reqs=[(req, key) for req, key, _ in matches])
                  if v.check in ("tree_ledger", "state_reuse")]
    else:
        found = check_mamba(allocator.req_to_token_pool, allocator.mamba_reqs())  # type: ignore[arg-type]
    for v in found:
        slot = v.values.get("slot")
        if v.rid is None and last is not None and slot is not None and 0 <= slot < last.shape[0] and last[slot] >= 0:
            v = dataclasses.replace(v, rid=int(last[slot]))
        out.append(v)


def check_conservation(out: list[Violation], allocator: KvAllocator, ceil_alloc: np.ndarray,
                       protected: np.ndarray) -> None:
    """``available + evictable + protected + uncached == pool tokens`` (``conservation``).

    Args:
        out: violations are appended here.
        allocator: the allocator checked.
        ceil_alloc, protected: int64 ``ceil_align(kv_allocated_len)`` and
            ``cache_protected_len`` of every row in use.
    """
    logical = full_side(allocator.token_to_kv_pool_allocator)
    tree = allocator.tree_cache
    available = logical.available_size()
    uncached = int((ceil_alloc - protected).sum())
    evictable = tree.evictable_size()
    prot_size = tree.protected_size()
    total = allocator.pool_tokens
    if available + evictable + prot_size + uncached != total:
        out.append(
            Violation(
                "conservation",
                f"available {available} + evictable {evictable} + protected {prot_size} + uncached {uncached} "
                f"= {available + evictable + prot_size + uncached}, pool holds {total}",
                None,
                {"available": available, "evictable": evictable, "protected": prot_size, "uncached": uncached,
                 "pool_tokens": total},
            )
        )


def check_hisparse(out: list[Violation], tok: HiSparseTokenToKVPoolAllocator, free_logical_pages: np.ndarray,
                   ps: int) -> None:
    """The HiSparse device side (``hisparse``): every device page free or mapped from
    exactly one live logical page, and no free logical slot still mapped."""
    mapping = tok.full_to_hisparse_device_index_mapping[:-1]
    mapped = np.flatnonzero(mapping > 0)
    if mapped.shape[0] == 0:
        device_pages = mapped
    else:
        logical_pages = mapped // ps
        stale = np.isin(logical_pages, free_logical_pages)
        if stale.any():
            out.append(Violation("hisparse", f"{int(stale.sum())} free logical slots still map to device slots, "
                                 f"e.g. {mapped[stale][:4].tolist()}", None, {"count": int(stale.sum())}))
        device_pages = np.unique(mapping[mapped] // ps)
        pairs = np.unique(np.stack([logical_pages, mapping[mapped] // ps]), axis=1)
        if pairs.shape[1] != device_pages.shape[0]:
            out.append(Violation("hisparse", f"{pairs.shape[1] - device_pages.shape[0]} device pages are mapped "
                                 f"from more than one logical page", None, {}))
    device = tok.hisparse_attn_allocator
    free_device = device.get_all_free_pages()
    counts = np.bincount(np.concatenate([device_pages, free_device]).astype(np.int64),
                         minlength=device.num_pages + 1)
    bad = np.flatnonzero(counts[1:] != 1) + 1
    if counts[0] or bad.shape[0]:
        out.append(Violation("hisparse", f"{bad.shape[0]} device pages are not exactly one of free / mapped "
                             f"(e.g. {bad[:_MAX_ITEMS].tolist()}), page 0 held {int(counts[0])} times", None,
                             {"count": int(bad.shape[0])}))


def _items(mask: np.ndarray) -> list[int]:
    return np.flatnonzero(mask)[:_MAX_ITEMS].tolist()


def check_lengths(out: list[Violation], kv: ReqKvTable, rows: np.ndarray, rids: np.ndarray, alloc: np.ndarray,
                  committed: np.ndarray, protected: np.ndarray, width: int, ps: int) -> None:
    """Lengths in order for rows in use, zeros in free rows (``lengths``).

    Args:
        out: violations are appended here.
        kv: the bookkeeping columns.
        rows, rids, alloc, committed, protected: int64 rows in use, their request ids
            and lengths.
        width: the row width.
        ps: the page size.
    """
    bad = (protected < 0) | (protected > committed) | (committed > alloc) | (alloc > width) | (protected % ps != 0)
    for i in _items(bad):
        out.append(
            Violation(
                "lengths",
                f"rid={int(rids[i])}: need 0 <= protected {int(protected[i])} <= committed {int(committed[i])} "
                f"<= allocated {int(alloc[i])} <= row width {width}, protected a multiple of {ps}",
                int(rids[i]),
                {"protected": int(protected[i]), "committed": int(committed[i]), "allocated": int(alloc[i]),
                 "width": width},
            )
        )
    free_rows = np.ones(kv.num_rows, dtype=bool)
    free_rows[rows] = False
    free_rows[0] = True
    stale = free_rows & ((kv.kv_allocated_len != 0) | (kv.kv_committed_len != 0) | (kv.cache_protected_len != 0))
    for row in _items(stale):
        out.append(
            Violation(
                "lengths",
                f"row {row} holds no request but has allocated {int(kv.kv_allocated_len[row])}, "
                f"committed {int(kv.kv_committed_len[row])}, protected {int(kv.cache_protected_len[row])}",
                None,
                {"row": row},
            )
        )
    locked_free = [row for row in np.flatnonzero(free_rows).tolist() if kv.lock_node[row] is not None]
    for row in locked_free[:_MAX_ITEMS]:
        out.append(Violation("lengths", f"row {row} holds no request but still holds a radix lock", None, {"row": row}))


def _check_rows(out, allocator, rows, rids) -> None:
    pool = allocator.req_to_token_pool
    free = np.array(pool.free_slots, dtype=np.int64)
    if free.shape[0] + rows.shape[0] != pool.size:
        out.append(
            Violation(
                "rows",
                f"free rows {free.shape[0]} + rows in use {rows.shape[0]} = {free.shape[0] + rows.shape[0]}, "
                f"pool has {pool.size}",
                None,
                {"free_rows": int(free.shape[0]), "rows_in_use": int(rows.shape[0]), "size": pool.size},
            )
        )
    counts = np.bincount(np.concatenate([free, rows]), minlength=pool.size + 1) if free.shape[0] + rows.shape[0] else np.zeros(pool.size + 1, dtype=np.int64)
    if counts.shape[0] > pool.size + 1 or counts[0] or (counts[1:] > 1).any():
        for row in _items(counts > 1):
            where = "free twice" if (free == row).sum() > 1 else "free and in use"
            out.append(Violation("rows", f"row {row} is {where}", None, {"row": int(row)}))
        if counts[0] or counts.shape[0] > pool.size + 1:
            out.append(Violation("rows", f"a row outside 1..{pool.size} is free or in use", None, {}))
    row_of_rid = allocator.rows_by_rid()
    mapped = np.flatnonzero(row_of_rid >= 0)
    if mapped.shape[0] != rows.shape[0] or not np.array_equal(np.sort(row_of_rid[mapped]), np.sort(rows)):
        out.append(
            Violation(
                "rows",
                f"{mapped.shape[0]} request ids map to a row but {rows.shape[0]} rows are in use",
                None,
                {"mapped": int(mapped.shape[0]), "rows_in_use": int(rows.shape[0])},
            )
        )
    else:
        wrong = row_of_rid[rids] != rows
        for i in _items(wrong):
            out.append(
                Violation("rows", f"rid={int(rids[i])} holds row {int(rows[i])} but maps to row "
                          f"{int(row_of_rid[rids[i]])}", int(rids[i]), {"row": int(rows[i])})
            )


def check_session_held(out: list[Violation], allocator: KvAllocator) -> None:
    """Streaming sessions (``session_held``): each request held between turns still
    holds its row and its session's count is its ``kv_committed_len -
    cache_protected_len``; the kept sum equals their total; the ``session_held`` counter
    is, over every row a session owns (from its first hold to its close, while a turn runs
    on it too: SGLang's ``kv_private_tokens``), ``ceil_align(kv_allocated_len, page) -
    cache_protected_len``; and the counters conserve the pool:
    ``available + evictable + protected + committed + overallocated + session_held ==
    pool tokens`` (``committed`` and ``overallocated`` then exclude the session rows:
    counted twice, it breaks)."""
    held_of = getattr(allocator, "_session_held", None)
    if held_of is None:
        return
    kv = allocator.req_kv
    held_rids = np.flatnonzero(held_of >= 0)
    total = 0
    for rid in held_rids.tolist():
        row = int(allocator.rows_by_rid()[rid])
        if row < 0 or int(kv.rid[row]) != rid:
            out.append(Violation("session_held", f"rid={rid}: held by its session but holds no row",
                                 rid, {"held": int(held_of[rid])}))
            continue
        real = int(kv.kv_committed_len[row] - kv.cache_protected_len[row])
        if int(held_of[rid]) != real:
            out.append(Violation(
                "session_held", f"rid={rid}: session holds {int(held_of[rid])} tokens, its row {real}",
                rid, {"held": int(held_of[rid]), "row": real},
            ))
        total += int(held_of[rid])
    kept = int(allocator.sum_session_held)
    if kept != total:
        out.append(Violation("session_held", f"sum_session_held kept as {kept}, recomputed {total}",
                             int(held_rids[0]) if held_rids.size == 1 else None,
                             {"kept": kept, "recomputed": total}))
    c = allocator.counters_now()
    turned = getattr(allocator, "_turned", None)
    if turned is not None:
        ps = allocator.page_size
        owned = 0
        for rid in np.flatnonzero(turned).tolist():
            row = int(allocator.rows_by_rid()[rid])
            if row >= 0 and int(kv.rid[row]) == rid:
                allocated = int(kv.kv_allocated_len[row])
                owned += -(-allocated // ps) * ps - int(kv.cache_protected_len[row])
        if owned != c.session_held:
            out.append(Violation("session_held", f"session_held counted as {c.session_held}, its session "
                                 f"rows hold {owned}", None, {"counted": c.session_held, "rows": owned}))
    # Only where sessions hold rows: elsewhere check_conservation says the same of the pool.
    in_sessions = held_rids.size > 0 or (turned is not None and bool(turned.any()))
    parts = c.available + c.evictable + c.protected + c.committed + c.overallocated + c.session_held
    if in_sessions and allocator.config.swa is None and not allocator.config.hisparse and parts != c.pool_tokens:
        out.append(Violation(
            "conservation",
            f"available {c.available} + evictable {c.evictable} + protected {c.protected} + committed "
            f"{c.committed} + overallocated {c.overallocated} + session_held {c.session_held} = {parts}, "
            f"pool holds {c.pool_tokens}",
            None,
            {"available": c.available, "evictable": c.evictable, "protected": c.protected,
             "committed": c.committed, "overallocated": c.overallocated, "session_held": c.session_held,
             "pool_tokens": c.pool_tokens},
        ))


def check_counters(out: list[Violation], kv: ReqKvTable, alloc: np.ndarray, committed: np.ndarray,
                   protected: np.ndarray, ceil_alloc: np.ndarray) -> None:
    """The incrementally kept sums equal the recomputed ones (``counters``)."""
    for name, kept, real in (
        ("sum_committed", kv.sum_committed, int(committed.sum())),
        ("sum_protected", kv.sum_protected, int(protected.sum())),
        ("sum_allocated_ceil", kv.sum_allocated_ceil, int(ceil_alloc.sum())),
    ):
        if kept != real:
            out.append(Violation("counters", f"{name} kept as {kept}, recomputed {real}", None,
                                 {"kept": int(kept), "recomputed": real}))


def _check_tree(out, allocator, rows, rids) -> None:
    tree = allocator.tree_cache
    kv = allocator.req_kv
    ps = allocator.page_size
    expected: dict[int, int] = {}
    for row, rid in zip(rows.tolist(), rids.tolist()):
        node = kv.lock_node[row]
        prot = int(kv.cache_protected_len[row])
        if node is None:
            if prot and not tree.disable:
                out.append(Violation("tree", f"rid={rid}: protected {prot} but holds no radix lock", rid,
                                     {"protected": prot}))
            continue
        path_len = 0
        cur = node
        while cur is not tree.root_node:
            if cur.parent is None:
                out.append(Violation("tree", f"rid={rid}: its locked node was evicted or detached", rid, {}))
                break
            expected[cur.id] = expected.get(cur.id, 0) + 1
            path_len += len(cur)
            cur = cur.parent
        if path_len < prot:
            out.append(Violation("tree", f"rid={rid}: locked path holds {path_len} tokens, protected is {prot}",
                                 rid, {"path_len": path_len, "protected": prot}))
    evictable = 0
    protected = 0
    bad_lock = 0
    for node in tree.iter_nodes():
        n = len(node)
        if n == 0 or n % ps or len(node.key) != 8 * n:
            out.append(Violation("tree", f"node {node.id}: length {n} (key {len(node.key) // 8} units), "
                                 f"page size {ps}", None, {"node": node.id, "len": n}))
        if node.lock_ref:
            protected += n
        else:
            evictable += n
        if node.lock_ref != expected.get(node.id, 0):
            bad_lock += 1
            if bad_lock <= _MAX_ITEMS:
                out.append(Violation("tree", f"node {node.id}: lock_ref {node.lock_ref}, requests lock it "
                                     f"{expected.get(node.id, 0)} times", None,
                                     {"node": node.id, "lock_ref": node.lock_ref}))
        leaf = node.lock_ref == 0 and not node.children
        if leaf != (node in tree.evictable_leaves):
            out.append(Violation("tree", f"node {node.id}: evictable leaf {leaf} but listed {not leaf}", None,
                                 {"node": node.id}))
    if evictable != tree.evictable_size() or protected != tree.protected_size():
        out.append(
            Violation(
                "tree",
                f"evictable_size {tree.evictable_size()} / protected_size {tree.protected_size()} kept, "
                f"nodes hold {evictable} unlocked / {protected} locked",
                None,
                {"evictable": evictable, "protected": protected},
            )
        )


def _segments(rows, starts, ends, width) -> tuple[np.ndarray, np.ndarray]:
    """Flat table indices and positions of ``[starts[i], ends[i])`` of each row."""
    counts = np.maximum(ends - starts, 0)
    total = int(counts.sum())
    offsets = np.cumsum(counts) - counts
    positions = np.repeat(starts - offsets, counts) + np.arange(total, dtype=np.int64)
    flat = np.repeat(rows * width, counts) + positions
    return flat, positions


def check_pages(out: list[Violation], allocator: KvAllocator, rows: np.ndarray, rids: np.ndarray,
                alloc: np.ndarray, protected: np.ndarray) -> None:
    """The ownership and row-entry passes over the whole pool (``ownership``, ``row``).

    Args:
        out: violations are appended here.
        allocator: the allocator checked.
        rows, rids, alloc, protected: int64 rows in use with sane lengths, their
            request ids, ``kv_allocated_len`` and ``cache_protected_len``.
    """
    holders = page_holders(allocator, rows, alloc, protected)
    _check_ownership(out, holders, rids)
    pool = allocator.req_to_token_pool
    _check_row_entries(out, allocator, pool.req_to_token_np, pool.max_context_len, rows, rids, alloc, protected,
                       holders.free_pages, holders.num_pages, allocator.page_size)


def _check_ownership(out: list[Violation], holders: PageHolders, rids: np.ndarray) -> None:
    free_pages, tree_pages, req_pages = holders.free_pages, holders.tree_pages, holders.req_pages
    owner = holders.req_index
    num_pages = holders.num_pages
    if holders.outside.shape[0]:
        bad = holders.outside
        out.append(Violation("ownership", f"page ids outside 0..{num_pages}: {bad[:_MAX_ITEMS].tolist()}", None,
                             {"count": int(bad.shape[0])}))
    counts = holders.counts
    if counts[0]:
        out.append(Violation("ownership", f"page 0 (reserved) is held {int(counts[0])} times", None,
                             {"count": int(counts[0])}))
    twice = np.flatnonzero(counts[1:] > 1) + 1
    for page in twice[:_MAX_ITEMS].tolist():
        holders_named = []
        n_free = int((free_pages == page).sum())
        if n_free:
            holders_named.append(f"free list x{n_free}")
        n_tree = int((tree_pages == page).sum())
        if n_tree:
            holders_named.append(f"radix tree x{n_tree}")
        for i in np.unique(owner[req_pages == page]).tolist():
            holders_named.append(f"rid={int(rids[i])}")
        rid = int(rids[owner[req_pages == page][0]]) if (req_pages == page).any() else None
        out.append(Violation("ownership", f"page {page} is held {int(counts[page])} times: "
                             f"{', '.join(holders_named)}", rid, {"page": page, "count": int(counts[page])}))
    if twice.shape[0] > _MAX_ITEMS:
        out.append(Violation("ownership", f"{twice.shape[0]} pages are held more than once", None,
                             {"count": int(twice.shape[0])}))
    lost = np.flatnonzero(counts[1:] == 0) + 1
    if lost.shape[0]:
        out.append(Violation("ownership", f"{lost.shape[0]} pages are held by nobody (leaked), e.g. "
                             f"{lost[:_MAX_ITEMS].tolist()}", None, {"count": int(lost.shape[0])}))


def _check_row_entries(out, allocator, table, width, rows, rids, alloc, protected, free_pages, num_pages, ps) -> None:
    flat, positions = _segments(rows, np.zeros_like(alloc), alloc, width)
    values = table.reshape(-1)[flat].astype(np.int64)
    owner = np.repeat(np.arange(rows.shape[0]), alloc)
    pages = values // ps
    bad_range = (pages < 1) | (pages > num_pages)
    for i in np.unique(owner[bad_range])[:_MAX_ITEMS].tolist():
        sel = bad_range & (owner == i)
        out.append(Violation("row", f"rid={int(rids[i])}: row positions {positions[sel][:4].tolist()} hold slots "
                             f"{values[sel][:4].tolist()} outside the pool", int(rids[i]), {}))
    is_free = np.zeros(num_pages + 1, dtype=bool)
    if free_pages.shape[0]:
        is_free[free_pages[(free_pages >= 0) & (free_pages <= num_pages)]] = True
    freed = ~bad_range & is_free[np.clip(pages, 0, num_pages)]
    for i in np.unique(owner[freed])[:_MAX_ITEMS].tolist():
        sel = freed & (owner == i)
        out.append(Violation("row", f"rid={int(rids[i])}: row positions {positions[sel][:4].tolist()} point at "
                             f"free slots {values[sel][:4].tolist()} (use after free)", int(rids[i]),
                             {"count": int(sel.sum())}))
    if ps > 1 and values.shape[0]:
        page_start = flat - positions % ps
        same_page = table.reshape(-1)[page_start].astype(np.int64)
        misaligned = (values % ps != positions % ps) | (values - same_page != positions % ps)
        for i in np.unique(owner[misaligned])[:_MAX_ITEMS].tolist():
            sel = misaligned & (owner == i)
            out.append(Violation("row", f"rid={int(rids[i])}: positions {positions[sel][:4].tolist()} hold slots "
                                 f"{values[sel][:4].tolist()}: not slot % {ps} == position % {ps} on one page",
                                 int(rids[i]), {"count": int(sel.sum())}))
    kv = allocator.req_kv
    tree = allocator.tree_cache
    for row, rid, prot in zip(rows.tolist(), rids.tolist(), protected.tolist()):
        if prot == 0:
            continue
        node = kv.lock_node[row]
        if node is None:
            continue
        path = tree.path_device_indices(node)[:prot]
        got = table[row, :prot].astype(np.int64)
        if path.shape[0] != prot or not np.array_equal(path, got):
            diff = np.flatnonzero(path != got[: path.shape[0]]) if path.shape[0] == prot else np.array([path.shape[0]])
            out.append(Violation("row", f"rid={rid}: row prefix [0, {prot}) differs from its locked radix path "
                                 f"(first at position {int(diff[0])})", rid, {"protected": prot}))


def _check_device(out, pool, rows, rids, alloc) -> None:
    device_rows = pool.device_req_to_token[rows.tolist()].cpu().numpy() if rows.shape[0] else None
    if device_rows is None:
        return
    host_rows = pool.req_to_token_np[rows]
    cols = np.arange(pool.max_context_len)
    live = cols[None, :] < alloc[:, None]
    diff = live & (device_rows != host_rows)
    for i in np.flatnonzero(diff.any(axis=1))[:_MAX_ITEMS].tolist():
        pos = np.flatnonzero(diff[i])
        out.append(Violation("device", f"rid={int(rids[i])}: device req_to_token differs from the host copy at "
                             f"{pos.shape[0]} positions, first {int(pos[0])} (device {int(device_rows[i, pos[0]])}, "
                             f"host {int(host_rows[i, pos[0]])})", int(rids[i]), {"count": int(pos.shape[0])}))
