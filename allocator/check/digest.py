"""Per-step digests of the built-in allocator's physical state, kept incrementally.

``KvAllocator.state_digest()`` (the optional ``Digestible`` protocol of
``allocator.base``) hashes what two allocator versions must agree on slot for slot:

* every request row: ``req_to_token[row, 0:kv_allocated_len]`` (the physical slot of
  each position), its request id and its three lengths;
* the free lists in reuse order (the token / page free list, the need-sort release
  or staged lists; HiSparse: the logical and the device lists, not the mapping between
  them) and the free request rows in order;
* the radix cache's evictable and protected sizes (the tree owns the remaining slots).

Hashing the whole state after every step would cost milliseconds (a 920k-slot free
list); the digest is kept up to date from what changed since the last call instead:

* a free list is a sequence changed only at its ends (take from the head, prepend,
  append) or replaced whole (a need-sort merge). Its hash is polynomial,
  ``sum((s_i + 1) * B**i)`` over positions relative to the head, kept as
  ``G = sum((s + 1) * B**v)`` over *virtual* positions ``v`` (which never move), so
  an end change costs what it adds or removes and the hash is ``G * B**-head``
  (modulo 2**64, ``B`` odd).
  ``PageFreeList`` calls the ``SeqHash`` hooks once ``enable_hash(SeqHash)`` was called;
* a row's hash is additive, ``sum(mix(row, pos, slot))`` over ``[0, kv_allocated_len)``.
  The table writer records the lowest position written per row since the last
  digest; a row that only grew (decode, a speculative reserve, the next prefill
  chunk) adds the terms of its new positions, any other change (a new request in
  the row, a checkpoint rewriting duplicates, a release) recomputes that row.

Both are sums modulo 2**64 (the row terms mixed by splitmix64's finaliser), folded
with the rows' lengths and the free rows by blake2b.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from allocator.manager import KvAllocator
    from allocator.token_to_kv import PageFreeList

__all__ = ["SeqHash", "StateDigest", "compose_digest", "full_digest", "row_terms", "rows_hash", "seq_value"]

_MOD64 = 1 << 64
_B = 0x9E3779B97F4A7C15  # odd: invertible mod 2**64
_B_INV = pow(_B, -1, _MOD64)
_ONE = np.uint64(1)
_powers = np.ones(1, dtype=np.uint64)  # B**j mod 2**64, j < len, grown on demand


def _power_table(n: int) -> np.ndarray:
    """uint64 ``[>= n]``: ``B**j mod 2**64``."""
    global _powers
    while _powers.shape[0] < n:
        m = _powers.shape[0]
        _powers = np.concatenate([_powers, _powers * np.uint64(pow(_B, m, _MOD64))])
    return _powers


def _poly(values: np.ndarray, v0: int) -> int:
    """``sum((values[j] + 1) * B**(v0 + j)) mod 2**64``."""
    n = int(values.shape[0])
    if n == 0:
        return 0
    terms = values.astype(np.uint64)
    terms += _ONE
    terms *= _power_table(n)[:n]
    return int(terms.sum(dtype=np.uint64)) * pow(_B, v0, _MOD64) % _MOD64


class SeqHash:
    """Polynomial hash of an int sequence changed at its ends (see the module doc).

    ``vh`` / ``vt`` are the virtual positions of the head and one past the tail.
    """

    __slots__ = ("g", "vh", "vt")

    def __init__(self, values: np.ndarray) -> None:
        self.reset(values)

    def reset(self, values: np.ndarray) -> None:
        """The sequence is now ``values``."""
        self.vh = 0
        self.vt = int(values.shape[0])
        self.g = _poly(values, 0)

    def pop_front(self, values: np.ndarray) -> None:
        """``values`` (the first entries) were removed."""
        self.g = (self.g - _poly(values, self.vh)) % _MOD64
        self.vh += int(values.shape[0])

    def push_front(self, values: np.ndarray) -> None:
        """``values`` were put before the head, in order."""
        self.vh -= int(values.shape[0])
        self.g = (self.g + _poly(values, self.vh)) % _MOD64

    def push_back(self, values: np.ndarray) -> None:
        """``values`` were appended, in order."""
        self.g = (self.g + _poly(values, self.vt)) % _MOD64
        self.vt += int(values.shape[0])

    def value(self) -> tuple[int, int]:
        """(hash, length): equal for equal sequences, whatever their history."""
        vh = self.vh
        shift = pow(_B_INV, vh, _MOD64) if vh >= 0 else pow(_B, -vh, _MOD64)
        return self.g * shift % _MOD64, self.vt - vh


_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_ROW = np.uint64(0x9E3779B97F4A7C15)
_POS = np.uint64(0xC2B2AE3D27D4EB4F)
_S27, _S30, _S31 = np.uint64(27), np.uint64(30), np.uint64(31)


def _finalise(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, in place on a uint64 array."""
    x ^= x >> _S30
    x *= _M1
    x ^= x >> _S27
    x *= _M2
    x ^= x >> _S31
    return x


def _mix(rows: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """uint64 hash of each (row, position, slot)."""
    x = slots.astype(np.uint64)
    x += rows.astype(np.uint64) * _ROW
    x += positions.astype(np.uint64) * _POS
    return _finalise(x)


_NONE = np.zeros(0, dtype=np.int32)
_NOT_WRITTEN = np.iinfo(np.int64).max


class _ListHash:
    """Hash of a list of arrays that only grows until it is replaced (release / staged lists)."""

    __slots__ = ("owner", "count", "seq")

    def __init__(self) -> None:
        self.owner: list[np.ndarray] | None = None
        self.count = 0
        self.seq = SeqHash(_NONE)

    def value(self, arrays: list[np.ndarray]) -> tuple[int, int]:
        if arrays is not self.owner or len(arrays) < self.count:
            self.owner, self.count = arrays, 0
            self.seq.reset(_NONE)
        for a in arrays[self.count :]:
            self.seq.push_back(a)
        self.count = len(arrays)
        return self.seq.value()


def _free_list_objects(allocator: Any) -> list[tuple[PageFreeList, list[np.ndarray] | None]]:
    """(free list, its release/staged list) of each token allocator inside ``allocator``."""
    parts = []
    for sub in (allocator, getattr(allocator, "logical_attn_allocator", None),
                getattr(allocator, "hisparse_attn_allocator", None),
                # an SWA pair: the full pool's list, then the SWA pool's
                getattr(allocator, "full_attn_allocator", None), getattr(allocator, "swa_attn_allocator", None)):
        if sub is None or not hasattr(sub, "_free"):
            continue
        side = getattr(sub, "_release", None)
        if side is None:
            side = getattr(sub, "staged_pages", None)
        parts.append((sub, side))
    return parts


def compose_digest(
    rows_total: int,
    columns: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    free_rows: list[int],
    lists: list[tuple[tuple[int, int], tuple[int, int] | None]],
    evictable: int,
    protected: int,
) -> str:
    """The digest from its parts (any implementation that can read them computes the
    same one: ``kvtrace.sglang.server`` does it from SGLang's own objects).

    Args:
        rows_total: the sum of the row terms (``rows_hash``) mod 2**64.
        columns: int64 ``[num_rows + 1]`` per ``req_to_token`` row (row 0 unused): the
            request id holding it (-1 free), ``kv_allocated_len``, ``kv_committed_len``,
            ``cache_protected_len`` (0 for a free row).
        free_rows: the free request rows in order.
        lists: per token allocator, ``(seq_value(free list), seq_value(its release or
            staged list))`` (page ids when paged).
        evictable, protected: the radix cache's sizes.

    Returns:
        32 hex digits.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(rows_total.to_bytes(8, "little"))
    for a in columns:
        h.update(np.ascontiguousarray(a, dtype=np.int64))
    h.update(array("q", free_rows))
    h.update(repr((lists, int(evictable), int(protected))).encode())
    return h.hexdigest()


def seq_value(values: np.ndarray) -> tuple[int, int]:
    """``SeqHash(values).value()``: the (hash, length) of a whole sequence."""
    return _poly(np.asarray(values), 0), int(values.shape[0])


def row_terms(table: np.ndarray, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """uint64 per row: ``sum(mix(row, pos, table[row, pos]))`` over ``[starts[i], ends[i])``
    of each ``rows[i]`` (vectorised over all the positions at once; empty ranges sum to 0)."""
    rows = np.asarray(rows, dtype=np.int64)
    counts = np.asarray(ends, dtype=np.int64) - np.asarray(starts, dtype=np.int64)
    out = np.zeros(rows.shape[0], dtype=np.uint64)
    keep = np.flatnonzero(counts > 0)
    if keep.shape[0] == 0:
        return out
    rows_k, counts_k = rows[keep], counts[keep]
    cumsum = np.add.accumulate(counts_k)
    first = cumsum - counts_k
    positions = np.repeat(np.asarray(starts, dtype=np.int64)[keep] - first, counts_k)
    positions += np.arange(int(cumsum[-1]), dtype=np.int64)
    owner = np.repeat(rows_k, counts_k)
    flat = table.reshape(-1)
    terms = _mix(owner, positions, flat[owner * table.shape[1] + positions])
    out[keep] = np.add.reduceat(terms, first)
    return out


def rows_hash(table: np.ndarray, rows: np.ndarray, lens: np.ndarray) -> int:
    """``sum(mix(row, pos, table[row, pos]))`` mod 2**64 over ``[0, lens[i])`` of each
    ``rows[i]`` (the row part of the digest, from scratch)."""
    terms = row_terms(table, rows, np.zeros(len(rows), dtype=np.int64), lens)
    return int(terms.sum(dtype=np.uint64))


def mamba_lists(free_slots: np.ndarray, mapping: np.ndarray, rows_in_use: np.ndarray) -> list[tuple[Any, Any]]:
    """A Mamba pool's part of ``compose_digest``'s ``lists``: ``(seq_value(its free list
    in order), seq_value(the state slot of each row in use, by row))``."""
    held = np.asarray(mapping, dtype=np.int64)[np.asarray(rows_in_use, dtype=np.int64)]
    return [(seq_value(np.asarray(free_slots, dtype=np.int64)), seq_value(held))]


def _compose(alloc: KvAllocator, rows_total: int, lists: list[tuple[Any, Any]]) -> str:
    kv = alloc.req_kv
    tree = alloc.tree_cache
    mamba = getattr(alloc.req_to_token_pool, "mamba_allocator", None)
    if mamba is not None:
        mapping = alloc.req_to_token_pool.req_index_to_mamba_index_mapping  # type: ignore[attr-defined]
        lists = lists + mamba_lists(mamba.free_slots, mapping, np.flatnonzero(kv.rid >= 0))
    return compose_digest(
        rows_total, (kv.rid, kv.kv_allocated_len, kv.kv_committed_len, kv.cache_protected_len),
        alloc.req_to_token_pool.free_slots, lists, tree.evictable_size(), tree.protected_size(),
    )


def full_digest(alloc: KvAllocator) -> str:
    """The same digest as ``StateDigest.digest``, computed from scratch (the reference
    the incremental one is tested against; touches no hook)."""
    alloc.end_step()
    kv = alloc.req_kv
    rows = np.flatnonzero(kv.rid >= 0)
    total = rows_hash(alloc.req_to_token_pool.req_to_token_np, rows, kv.kv_allocated_len[rows])
    lists = []
    for sub, side in _free_list_objects(alloc.token_to_kv_pool_allocator):
        side_value = None
        if side is not None:
            side_value = seq_value(np.concatenate(side) if side else _NONE)
        lists.append((seq_value(sub._free.view()), side_value))
    return _compose(alloc, total, lists)


class StateDigest:
    """The incremental digest of one ``KvAllocator`` (created by its first ``state_digest()``).

    Call ``digest()`` between steps (no free group open, publishes applied).
    """

    def __init__(self, alloc: KvAllocator) -> None:
        self.alloc = alloc
        num_rows = alloc.req_kv.num_rows
        self.row_hash = np.zeros(num_rows, dtype=np.uint64)
        self.hashed_len = np.zeros(num_rows, dtype=np.int64)
        self.rows_total = 0  # sum of row_hash mod 2**64
        self._list_hashes: dict[int, _ListHash] = {}
        writer = alloc.writer
        writer.dirty_lo = np.zeros(writer.table.shape[0], dtype=np.int64)  # everything is new

    def digest(self) -> str:
        """The 32-hex-digit digest of the state now."""
        alloc = self.alloc
        self._update_rows()
        lists = []
        for i, (sub, side) in enumerate(_free_list_objects(alloc.token_to_kv_pool_allocator)):
            free = sub._free
            seq = free._seq if free._seq is not None else free.enable_hash(SeqHash)
            side_value = None
            if side is not None:
                side_value = self._list_hashes.setdefault(i, _ListHash()).value(side)
            lists.append((seq.value(), side_value))
        return _compose(alloc, self.rows_total, lists)

    def _update_rows(self) -> None:
        """Bring ``row_hash`` / ``rows_total`` to ``[0, kv_allocated_len)`` of every row in use."""
        kv = self.alloc.req_kv
        writer = self.alloc.writer
        lo = writer.dirty_lo
        new_len = kv.kv_allocated_len * (kv.rid >= 0)
        old_len = self.hashed_len
        changed = np.flatnonzero((new_len != old_len) | (lo != _NOT_WRITTEN))
        if changed.shape[0] == 0:
            return
        old_c, new_c = old_len[changed], new_len[changed]
        grows = (lo[changed] >= old_c) & (new_c >= old_c)
        if grows.all():
            starts = old_c
            counts = new_c - old_c
        else:  # rows that did not only grow are recomputed from position 0
            redo = changed[~grows]
            self.rows_total = (self.rows_total - int(self.row_hash[redo].sum(dtype=np.uint64))) % _MOD64
            self.row_hash[redo] = 0
            starts = np.where(grows, old_c, 0)
            counts = new_c - starts
        old_len[changed] = new_c
        lo[changed] = _NOT_WRITTEN
        if int(counts.max()) == 1 and int(counts.min()) == 1:  # a decode step
            rows, positions = changed, starts
            per_row = terms = _mix(rows, positions, writer._flat[writer.row_base[rows] + positions])
        else:
            keep = counts > 0
            rows, starts, counts = changed[keep], starts[keep], counts[keep]
            if rows.shape[0] == 0:
                return
            cumsum = np.add.accumulate(counts)
            first = cumsum - counts
            positions = np.repeat(starts - first, counts)
            positions += np.arange(int(cumsum[-1]), dtype=np.int64)
            owner = np.repeat(rows, counts)
            terms = _mix(owner, positions, writer._flat[writer.row_base[owner] + positions])
            per_row = np.add.reduceat(terms, first)
        self.row_hash[rows] += per_row
        self.rows_total = (self.rows_total + int(terms.sum(dtype=np.uint64))) % _MOD64
