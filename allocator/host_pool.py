"""HostKVPool: HiCache's host KV pool free list, as SGLang 0.5.23's ``HostKVCache`` keeps it.

SGLang (``mem_cache/pool_host/base.py``) keeps host *token* slots, allocated in whole
pages, in two parts: ``free_slots`` (taken from the front) and ``release_slots`` (the
chunks freed since the last merge, in free order). A merge appends the chunks to
``free_slots`` only when ``free_slots`` alone cannot serve an alloc, so slots freed
recently are reused last::

    free_slots:     [ 40 41 42 43 ... 63 ]          <- alloc takes the head
    release_slots:  [ [8 9 10 11], [0 1 2 3] ]      <- free appends a chunk
    alloc(24): 20 free < 24 -> merge -> [40..63, 8..11, 0..3] -> take 24

A ``slot_used`` bitmap catches a double alloc or a double free (SGLang asserts both).
Only the bookkeeping is modelled: there is no host buffer.
"""

from __future__ import annotations

import numpy as np

__all__ = ["HostDoubleFree", "HostKVPool", "HOST_SLOT_DTYPE"]

# SGLang's host indices are int64 tensors.
HOST_SLOT_DTYPE = np.int64


class HostDoubleFree(ValueError):
    """A host slot was freed (or allocated) while not in the expected state."""


class HostKVPool:
    """The host pool's free list (SGLang ``HostKVCache.alloc`` / ``free`` / ``clear``).

    Args:
        size: host token slots (page aligned; see ``HiCacheConfig.pool_tokens``).
        page_size: tokens per page; every alloc is a whole number of pages.
    """

    def __init__(self, size: int, page_size: int = 1) -> None:
        if size <= 0 or size % page_size:
            raise ValueError(f"HostKVPool: size must be positive and page aligned, found {size} (page {page_size})")
        self.size = size
        self.page_size = page_size
        self.clear()

    def clear(self) -> None:
        self.free_slots: np.ndarray = np.arange(self.size, dtype=HOST_SLOT_DTYPE)  # int64 [n]
        self.release_slots: list[np.ndarray] = []  # freed chunks, in free order
        self.num_release_slots = 0
        self.slot_used = np.zeros(self.size, dtype=bool)  # [size] slot is allocated

    def available_size(self) -> int:
        return int(self.free_slots.shape[0]) + self.num_release_slots

    def used_size(self) -> int:
        return self.size - self.available_size()

    def _merge_release_slots(self) -> None:
        if self.num_release_slots == 0:
            return
        if self.free_slots.shape[0] == 0 and len(self.release_slots) == 1:
            self.free_slots = self.release_slots[0]
        else:
            self.free_slots = np.concatenate([self.free_slots, *self.release_slots])
        self.release_slots = []
        self.num_release_slots = 0

    def alloc(self, need_size: int) -> np.ndarray | None:
        """Take ``need_size`` slots (a multiple of the page); None when too few are free.

        Raises:
            ValueError: ``need_size`` is not page aligned (SGLang asserts).
            HostDoubleFree: a slot handed out is marked in use (a corrupted free list).
        """
        if need_size % self.page_size:
            raise ValueError(f"HostKVPool.alloc: {need_size} is not a multiple of the page size {self.page_size}")
        if need_size > self.available_size():
            return None
        if need_size > self.free_slots.shape[0]:
            self._merge_release_slots()
        select = self.free_slots[:need_size]
        self.free_slots = self.free_slots[need_size:]
        if self.slot_used[select].any():
            raise HostDoubleFree(f"host double alloc: slots {select[self.slot_used[select]].tolist()} in use")
        self.slot_used[select] = True
        return select.copy()

    def free(self, indices: np.ndarray) -> int:
        """Give ``indices`` back; returns their count.

        Raises:
            HostDoubleFree: a slot is not allocated (SGLang asserts "Double-free detected").
        """
        idx = np.asarray(indices, dtype=HOST_SLOT_DTYPE)
        if idx.shape[0] == 0:
            return 0
        used = self.slot_used[idx]
        if not used.all() or np.unique(idx).shape[0] != idx.shape[0]:
            bad = idx[~used].tolist() or idx.tolist()
            raise HostDoubleFree(f"host double free: slots {bad} not allocated")
        self.slot_used[idx] = False
        self.release_slots.append(idx.copy())
        self.num_release_slots += idx.shape[0]
        return int(idx.shape[0])

    def free_view(self) -> np.ndarray:
        """Every free slot in the order allocs would take them (free list, then chunks)."""
        if not self.release_slots:
            return self.free_slots.copy()
        return np.concatenate([self.free_slots, *self.release_slots])
