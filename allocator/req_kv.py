"""Per-request KV bookkeeping as a struct of arrays indexed by ``req_to_token`` row.

SGLang keeps ``req.kv`` (``ReqKvInfo``) per request object; a decode step then walks
every request in Python. Here the same fields are columns indexed by the request's
row, so a decode step of 256 requests is a handful of vectorised operations::

    row r:  0 ........ cache_protected_len ........ kv_committed_len ...... kv_allocated_len ..| ceil_align
            |-- tree owns (locked prefix) --|-- the request's own KV --|-- reserved slack --|-- page tail --|

Invariants (``invariants.check_integrity``): ``0 <= protected <= committed <=
allocated <= row width``; ``protected`` is page aligned; row entries
``[0, allocated)`` are live slots. The request privately owns
``ceil_align(allocated, page_size) - protected`` slots.

The columns are CPU torch tensors (``*_t``) with zero-copy numpy views (the
attribute names without suffix) that the hot paths use. The three sums are kept
up to date by the allocation functions, so pool counters are O(1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from allocator.pages import ceil_align

if TYPE_CHECKING:
    from allocator.radix_cache import TreeNode

__all__ = ["ReqKvInfo", "ReqKvTable"]


class ReqKvTable:
    """Bookkeeping columns for ``num_rows`` request rows (row 0 is never used).

    Attributes:
        kv_allocated_len: int64 ``[num_rows]`` positions reserved (row entries valid).
        kv_committed_len: int64 ``[num_rows]`` positions holding real tokens' KV.
        cache_protected_len: int64 ``[num_rows]`` prefix owned by the radix tree.
        cache_inserted_len: int64 ``[num_rows]`` longest key the request inserted into
            the tree (its own inserts count no hits below it: LFU / SLRU eviction).
        rid: int64 ``[num_rows]`` request id holding the row, -1 when free.
        lock_node: radix node each row's request holds locked (None: no lock).
        sum_committed: sum of ``kv_committed_len`` over rows in use.
        sum_protected: sum of ``cache_protected_len`` over rows in use.
        sum_allocated_ceil: sum of ``ceil_align(kv_allocated_len, page_size)``.
        max_len_bound: an upper bound of every ``kv_allocated_len``.
        swa_evicted_seqlen: int64 ``[num_rows]`` SWA cursor (hybrid SWA models): the SWA
            slots of ``[swa_dead_lo, here)`` are freed (``allocator.swa_window``).
        swa_evict_floor: int64 ``[num_rows]`` ``[0, here)`` is never window-freed.
        decode_batch_idx: int64 ``[num_rows]`` decode steps the request ran since its
            prefill (SGLang's ``req.decode_batch_idx``: no window free on the first).
        sum_swa_freed: sum of ``max(0, swa_evicted_seqlen - swa_dead_lo)`` over rows in
            use (SWA tokens window-freed; kept only when ``swa``).
        swa: whether the SWA columns are kept (a hybrid sliding-window allocator).
    """

    def __init__(self, num_rows: int, page_size: int, swa: bool = False) -> None:
        self.num_rows = num_rows
        self.page_size = page_size
        self.kv_allocated_len_t = torch.zeros(num_rows, dtype=torch.int64)
        self.kv_committed_len_t = torch.zeros(num_rows, dtype=torch.int64)
        self.cache_protected_len_t = torch.zeros(num_rows, dtype=torch.int64)
        self.kv_allocated_len: np.ndarray = self.kv_allocated_len_t.numpy()
        self.kv_committed_len: np.ndarray = self.kv_committed_len_t.numpy()
        self.cache_protected_len: np.ndarray = self.cache_protected_len_t.numpy()
        self.cache_inserted_len = np.zeros(num_rows, dtype=np.int64)
        self.rid = np.full(num_rows, -1, dtype=np.int64)
        self.lock_node: list[TreeNode | None] = [None] * num_rows
        self.sum_committed = 0
        self.sum_protected = 0
        self.sum_allocated_ceil = 0
        # An upper bound of every kv_allocated_len (never below the true maximum):
        # row-width checks compute the exact maximum only when this reaches the width.
        self.max_len_bound = 0
        self.swa = swa
        self.swa_evicted_seqlen = np.zeros(num_rows, dtype=np.int64)
        self.swa_evict_floor = np.zeros(num_rows, dtype=np.int64)
        self.decode_batch_idx = np.zeros(num_rows, dtype=np.int64)
        self.sum_swa_freed = 0
        # With the SWA radix tree (``allocator.swa_radix``): each row's SWA lock receipt
        # (the window boundary's uuid, None: to the root) and pending branch point (-1 none).
        self.lock_swa_uuid: list[int | None] = [None] * num_rows
        self.swa_branching_seqlen = np.full(num_rows, -1, dtype=np.int64)

    def swa_dead_lo(self, rows: np.ndarray) -> np.ndarray:
        """``max(protected, floor)`` per row, page-aligned up only when above protected
        (SGLang ``ReqKvInfo.swa_dead_lo``)."""
        protected = self.cache_protected_len[rows]
        lo = np.maximum(protected, self.swa_evict_floor[rows])
        if self.page_size > 1:
            lo = np.where(lo > protected, ceil_align(lo, self.page_size), lo)
        return lo

    def swa_freed(self, rows: np.ndarray) -> np.ndarray:
        """SWA tokens each row's window frees gave back: ``max(0, evicted - dead_lo)``."""
        return np.maximum(self.swa_evicted_seqlen[rows] - self.swa_dead_lo(rows), 0)

    def set_swa_evicted(self, row: int, value: int) -> None:
        """Move one row's SWA cursor, keeping ``sum_swa_freed``."""
        rows = np.array([row], dtype=np.int64)
        before = int(self.swa_freed(rows)[0])
        self.swa_evicted_seqlen[row] = value
        self.sum_swa_freed += int(self.swa_freed(rows)[0]) - before

    def info(self, row: int) -> ReqKvInfo:
        """A read-only live view of one row's bookkeeping."""
        return ReqKvInfo(self, row)

    def rows_in_use(self) -> np.ndarray:
        return np.flatnonzero(self.rid >= 0)

    def clear_row(self, row: int) -> None:
        """The row's request is gone: its lengths leave the kept sums and the row's
        columns go back to zero (``rid`` -1). The lock and the slots are the caller's."""
        allocated = int(self.kv_allocated_len[row])
        self.sum_committed -= int(self.kv_committed_len[row])
        self.sum_protected -= int(self.cache_protected_len[row])
        self.sum_allocated_ceil -= ceil_align(allocated, self.page_size)
        if self.swa:
            self.sum_swa_freed -= int(self.swa_freed(np.array([row], dtype=np.int64))[0])
            self.swa_evicted_seqlen[row] = 0
            self.swa_evict_floor[row] = 0
            self.decode_batch_idx[row] = 0
            self.lock_swa_uuid[row] = None
            self.swa_branching_seqlen[row] = -1
        self.kv_allocated_len[row] = 0
        self.kv_committed_len[row] = 0
        self.cache_protected_len[row] = 0
        self.cache_inserted_len[row] = 0
        self.rid[row] = -1


class ReqKvInfo:
    """Read-only view of one request's bookkeeping with SGLang's ``req.kv`` field names."""

    __slots__ = ("_table", "_row")

    def __init__(self, table: ReqKvTable, row: int) -> None:
        self._table = table
        self._row = row

    @property
    def req_pool_idx(self) -> int | None:
        return self._row if self._table.rid[self._row] >= 0 else None

    @property
    def holds_kv(self) -> bool:
        return bool(self._table.rid[self._row] >= 0)

    @property
    def rid(self) -> int:
        return int(self._table.rid[self._row])

    @property
    def kv_allocated_len(self) -> int:
        return int(self._table.kv_allocated_len[self._row])

    @property
    def kv_committed_len(self) -> int:
        return int(self._table.kv_committed_len[self._row])

    @property
    def cache_protected_len(self) -> int:
        return int(self._table.cache_protected_len[self._row])

    @property
    def lock_node(self) -> TreeNode | None:
        return self._table.lock_node[self._row]

    @property
    def swa_evicted_seqlen(self) -> int:
        return int(self._table.swa_evicted_seqlen[self._row])

    @property
    def swa_evict_floor(self) -> int:
        return int(self._table.swa_evict_floor[self._row])

    def __repr__(self) -> str:
        return (
            f"ReqKvInfo(req_pool_idx={self.req_pool_idx}, kv_allocated_len={self.kv_allocated_len}, "
            f"kv_committed_len={self.kv_committed_len}, cache_protected_len={self.cache_protected_len})"
        )
