"""Token-to-KV allocators: SGLang 0.5.23's free lists, slot for slot, on the host.

Three allocators, each the same reuse order as its SGLang namesake (so a replay
hands out the very slot indices SGLang would):

* ``TokenToKVPoolAllocator`` (page 1, ``mem_cache/allocator/token.py``): slots
  ``1..size`` (slot 0 is the dummy output of padded tokens). ``alloc`` takes from
  the head, all or nothing; ``free`` appends to the END: first freed, first reused::

      free_pages [6 7 8]   alloc(2) -> 6 7   free([2 1]) -> [8 2 1]

  With ``need_sort`` frees go to ``release_pages`` and are merged and sorted into
  ``free_pages`` when an allocation runs short.
* ``PagedTokenToKVPoolAllocator`` (``paged.py``): page ids ``1..num_pages`` (page 0
  reserved), slot = ``page * page_size + offset``. Freed pages are PREPENDED
  (last freed, first reused); ``free`` frees the whole page of every slot given
  (deduplicated, sorted); ``free_segment`` frees the pages of a page-aligned row
  segment in row order::

      free_pages [5 6]   free(slots of pages 3, 2) -> [2 3 5 6]   free_segment(page 9 then 4) -> [9 4 2 3 5 6]

  With ``need_sort`` freed pages are staged and merged + sorted only when an
  allocation's upper bound exceeds ``free_pages``.
* ``HiSparseTokenToKVPoolAllocator`` (``hisparse.py``): a logical paged allocator
  of ``size * ratio`` slots and a device paged allocator of ``size``, joined by a
  logical -> device mapping (0 = unmapped); ``alloc_logical_only`` leaves the
  mapping empty (device pages are bound later).

Free lists are numpy arrays kept in a double-ended buffer (O(1) amortised
take-from-head, append and prepend). With a ``journal`` attached (an incremental
checker, ``allocator.check.journal``) every page that leaves or enters a free list is
recorded there. Slots and page ids are int32 on the host (the
dtype of ``req_to_token``, so writing them into rows needs no conversion; a pool
is bounded by 2**31 slots like SGLang's int32 table). ``free_pages`` etc. return
int64 torch tensors for white-box comparison with SGLang's objects.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

# num_new_pages is defined in allocator.pages; re-exported here.
from allocator.pages import ceil_align, num_new_pages, num_pages

if TYPE_CHECKING:
    from allocator.check.digest import SeqHash
    from allocator.check.journal import Journal

__all__ = [
    "SLOT_DTYPE",
    "HiSparseTokenToKVPoolAllocator",
    "PagedTokenToKVPoolAllocator",
    "PageFreeList",
    "TokenToKVPoolAllocator",
    "alloc_extend_layout",
    "num_new_pages",
]

# Host dtype of slot indices and page ids (that of req_to_token).
SLOT_DTYPE = np.int32
_EMPTY = np.empty(0, dtype=SLOT_DTYPE)


class PageFreeList:
    """An int32 sequence with O(1) amortised head take, prepend and append.

    The live entries are ``_buf[_head:_tail]``; both ends have slack so that
    prepending (paged LIFO reuse) and appending (token FIFO reuse) never shift the
    whole list. After ``enable_hash(...)`` every change also updates ``_seq``, the
    incremental hash of the sequence (``allocator.check.digest.SeqHash``).
    """

    __slots__ = ("_buf", "_head", "_tail", "_seq", "journal")

    def __init__(self, values: np.ndarray) -> None:
        self.journal: Journal | None = None
        n = int(values.shape[0])
        self._buf = np.empty(2 * n + 64, dtype=SLOT_DTYPE)
        self._head = (self._buf.shape[0] - n) // 2
        self._tail = self._head + n
        self._buf[self._head : self._tail] = values
        self._seq: SeqHash | None = None

    def __len__(self) -> int:
        return self._tail - self._head

    def __deepcopy__(self, memo: dict) -> PageFreeList:
        """A copy of the live entries only (a checkpoint holds no slack and no hash; the
        copy grows its slack again on first use, which changes no order)."""
        clone = PageFreeList.__new__(PageFreeList)
        clone._buf = self.view().copy()
        clone._head, clone._tail = 0, clone._buf.shape[0]
        clone._seq = None  # a digest re-enables it on the copy it uses
        clone.journal = None  # a checker attaches to the live allocator, never to a copy
        return clone

    def enable_hash(self, seq_hash: type[SeqHash]) -> SeqHash:
        """Start keeping the sequence hash, a ``seq_hash`` of the live entries (the digest
        passes ``allocator.check.digest.SeqHash``: the core does not import the checks);
        returns it."""
        self._seq = seq_hash(self.view())
        return self._seq

    def view(self) -> np.ndarray:
        """The live entries (a view: valid until the next mutation)."""
        return self._buf[self._head : self._tail]

    def head(self, n: int) -> np.ndarray:
        """The first ``n`` entries (a view, nothing removed)."""
        return self._buf[self._head : self._head + n]

    def take(self, n: int) -> np.ndarray:
        """Remove and return the first ``n`` entries (a copy)."""
        head = self._head
        out = self._buf[head : head + n].copy()
        self._head = head + n
        if self._seq is not None:
            self._seq.pop_front(out)
        if self.journal is not None:
            self.journal.take(out)
        return out

    def drop(self, n: int) -> None:
        """Remove the first ``n`` entries (after reading them with ``head``)."""
        if self._seq is not None:
            self._seq.pop_front(self._buf[self._head : self._head + n])
        if self.journal is not None:
            self.journal.take(self._buf[self._head : self._head + n].copy())
        self._head += n

    def prepend(self, values: np.ndarray) -> None:
        if self.journal is not None:
            self.journal.give(np.array(values, dtype=SLOT_DTYPE))
        n = int(values.shape[0])
        if n > self._head:
            self._recentre(n, 0)
        self._head -= n
        self._buf[self._head : self._head + n] = values
        if self._seq is not None:
            self._seq.push_front(self._buf[self._head : self._head + n])

    def append(self, values: np.ndarray) -> None:
        if self.journal is not None:
            self.journal.give(np.array(values, dtype=SLOT_DTYPE))
        n = int(values.shape[0])
        if self._tail + n > self._buf.shape[0]:
            self._recentre(0, n)
        self._buf[self._tail : self._tail + n] = values
        self._tail += n
        if self._seq is not None:
            self._seq.push_back(self._buf[self._tail - n : self._tail])

    def replace(self, values: np.ndarray) -> None:
        """Make ``values`` the whole list (after a merge and sort: the staged pages
        were journaled when they were staged, so nothing is recorded here)."""
        n = int(values.shape[0])
        if 2 * n + 64 > self._buf.shape[0]:
            self._buf = np.empty(2 * n + 64, dtype=SLOT_DTYPE)
        self._head = (self._buf.shape[0] - n) // 2
        self._tail = self._head + n
        self._buf[self._head : self._tail] = values
        if self._seq is not None:
            self._seq.reset(self.view())

    def _recentre(self, need_front: int, need_back: int) -> None:
        live = self._buf[self._head : self._tail]
        n = live.shape[0]
        size = self._buf.shape[0]
        if n + need_front + need_back + 64 > size // 2:
            size = 2 * (n + need_front + need_back) + 64
        head = need_front + (size - n - need_front - need_back) // 2
        if size == self._buf.shape[0]:  # in place (numpy copies overlapping slices safely)
            self._buf[head : head + n] = live
        else:
            buf = np.empty(size, dtype=SLOT_DTYPE)
            buf[head : head + n] = live
            self._buf = buf
        self._head, self._tail = head, head + n


def alloc_extend_layout(
    prefix_lens: np.ndarray,
    seq_lens: np.ndarray,
    last_loc: np.ndarray,
    pages: np.ndarray,
    page_size: int,
) -> np.ndarray:
    """SGLang's three-part paged extend layout, vectorised over all tokens.

    Per request (``extend = seq - prefix``): part 1 continues the old partial page at
    ``last_loc + 1, last_loc + 2, ...`` (``min(seq, ceil_align(prefix)) - prefix``
    tokens); the rest fills the request's new pages in order from their first slot
    (whole pages, then the head of the last page). ``pages`` are the new pages of
    the whole batch, requests in order.

    Returns:
        int32 ``[sum(extend)]`` slots, requests in batch order.
    """
    ps = page_size
    ext = seq_lens - prefix_lens
    total = int(ext.sum())
    if total == 0:
        return _EMPTY.copy()
    num1 = np.minimum(seq_lens, ceil_align(prefix_lens, ps)) - prefix_lens
    pages_per_req = num_pages(seq_lens, ps) - num_pages(prefix_lens, ps)
    bs = ext.shape[0]
    if bs == 1:
        n1 = int(num1[0])
        out = np.empty(total, dtype=SLOT_DTYPE)
        if n1:
            start = int(last_loc[0]) + 1
            out[:n1] = np.arange(start, start + n1, dtype=SLOT_DTYPE)
        rest = total - n1
        if rest:
            slots = (pages[:, None] * ps + np.arange(ps, dtype=SLOT_DTYPE)).reshape(-1)
            out[n1:] = slots[:rest]
        return out
    # Slots of all new pages in order; request i's part 2+3 is the head of its pages.
    page_slots = (pages[:, None] * ps + np.arange(ps, dtype=SLOT_DTYPE)).reshape(-1)
    first_page = np.cumsum(pages_per_req) - pages_per_req
    start_tok = np.cumsum(ext) - ext
    owner = np.repeat(np.arange(bs, dtype=np.int64), ext)
    local = np.arange(total, dtype=np.int64) - start_tok[owner]
    n1_tok = num1[owner]
    in_part1 = local < n1_tok
    # Part 2/3 index into page_slots; clipped where the token is in part 1 (unused there).
    idx = first_page[owner] * ps + (local - n1_tok)
    if page_slots.shape[0] == 0:
        return (last_loc[owner] + 1 + local).astype(SLOT_DTYPE)
    np.clip(idx, 0, page_slots.shape[0] - 1, out=idx)
    out = page_slots[idx]
    if num1.any():
        part1 = last_loc[owner] + 1 + local
        out = np.where(in_part1, part1, out).astype(SLOT_DTYPE)
    return out


class _FreeGroupMixin:
    """SGLang's deferred free groups: frees between begin and end are applied at end."""

    free_group: list[np.ndarray] | None

    def free_group_begin(self) -> None:
        if self.free_group is not None:
            raise RuntimeError("free groups cannot be nested")
        self.free_group = []

    def is_free_group_open(self) -> bool:
        return self.free_group is not None


class TokenToKVPoolAllocator(_FreeGroupMixin):
    """Page-size-1 allocator (SGLang ``TokenToKVPoolAllocator``).

    Args:
        size: allocatable slots (``1..size``).
        need_sort: PD-disaggregation mode: frees go to ``release_pages`` and are
            merged and sorted into the free list when an allocation runs short.
        device: where the KV would live (informational; the free list is on the host).
    """

    page_size = 1

    def __init__(self, size: int, need_sort: bool = False, device: str = "cpu") -> None:
        self.size = size
        self.need_sort = need_sort
        self.device = device
        self.journal: Journal | None = None  # records staged frees (the free list records its own)
        self.clear()

    def clear(self) -> None:
        self._free = PageFreeList(np.arange(1, self.size + 1, dtype=SLOT_DTYPE))
        self._release: list[np.ndarray] = []
        self._num_release = 0
        self.free_group = None

    # ------------------------------------------------------------------ inspection

    @property
    def free_pages(self) -> torch.Tensor:
        """int64 free slots in reuse order (a copy)."""
        return torch.from_numpy(self._free.view().astype(np.int64))

    @property
    def release_pages(self) -> torch.Tensor:
        """int64 freed slots waiting for the next merge (need_sort only; a copy)."""
        return torch.from_numpy((np.concatenate(self._release) if self._release else _EMPTY).astype(np.int64))

    def free_pages_np(self) -> np.ndarray:
        return self._free.view().copy()

    def get_all_free_pages(self) -> np.ndarray:
        """Every free slot: free list then release list (int32 numpy copy)."""
        return np.concatenate([self._free.view(), *self._release])

    def num_free_pages(self) -> int:
        return len(self._free)

    def available_size(self) -> int:
        return len(self._free) + self._num_release

    # ------------------------------------------------------------------ alloc

    def merge_and_sort_free(self) -> None:
        if self._num_release:
            merged = np.sort(np.concatenate([self._free.view(), *self._release]))
            self._free.replace(merged)
            self._release = []
            self._num_release = 0

    def alloc(self, need_size: int) -> np.ndarray | None:
        """The first ``need_size`` free slots (removed), or None if there are fewer."""
        free = self._free
        if self.need_sort and need_size > len(free):
            self.merge_and_sort_free()
        if need_size > len(free):
            return None
        return free.take(need_size)

    def alloc_view(self, need_size: int) -> np.ndarray | None:
        """Like ``alloc`` but returns a view of the free-list buffer: the caller must
        consume it before the next free (hot paths write it straight into a row)."""
        free = self._free
        if self.need_sort and need_size > len(free):
            self.merge_and_sort_free()
        if need_size > len(free):
            return None
        out = free.head(need_size)
        free.drop(need_size)
        return out

    def unalloc(self, slots: np.ndarray) -> None:
        """Undo the allocation that returned ``slots`` (puts them back at the head)."""
        if slots.shape[0]:
            self._free.prepend(slots)

    # ------------------------------------------------------------------ free

    def free(self, free_index: np.ndarray) -> None:
        """Return slots: appended to the end of the free list (FIFO reuse)."""
        if free_index.shape[0] == 0:
            return
        if self.free_group is not None:
            self.free_group.append(np.array(free_index, dtype=SLOT_DTYPE))
        elif self.need_sort:
            staged = np.array(free_index, dtype=SLOT_DTYPE)
            self._release.append(staged)
            self._num_release += int(free_index.shape[0])
            if self.journal is not None:
                self.journal.give(staged)
        else:
            self._free.append(free_index)

    def free_segment(self, free_index: np.ndarray, start_pos: int = 0) -> None:
        """Free ``row[start_pos : start_pos + n]`` of one request (page 1: a plain free)."""
        self.free(free_index)

    def free_page_ids(self, page_ids: np.ndarray) -> None:
        self.free(page_ids)

    def free_group_end(self) -> None:
        pending, self.free_group = self.free_group, None
        if pending:
            self.free(np.concatenate(pending))


class PagedTokenToKVPoolAllocator(_FreeGroupMixin):
    """Paged allocator (SGLang ``PagedTokenToKVPoolAllocator``).

    Args:
        size: pool slots; ``num_pages = size // page_size`` pages ``1..num_pages``.
        page_size: tokens per page.
        need_sort: PD-disaggregation mode: freed pages are staged and merged + sorted
            into the free list when an allocation's upper bound exceeds it.
        device: informational.
    """

    def __init__(self, size: int, page_size: int, need_sort: bool = False, device: str = "cpu") -> None:
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self.need_sort = need_sort
        self.device = device
        self._page_offsets = np.arange(page_size, dtype=SLOT_DTYPE)
        self.journal: Journal | None = None  # records staged frees (the free list records its own)
        self.clear()

    def clear(self) -> None:
        self._free = PageFreeList(np.arange(1, self.num_pages + 1, dtype=SLOT_DTYPE))
        self.staged_pages: list[np.ndarray] = []
        self.num_staged_pages = 0
        self.free_group = None
        self.free_page_ids_group: list[np.ndarray] = []

    # ------------------------------------------------------------------ inspection

    @property
    def free_pages(self) -> torch.Tensor:
        """int64 free page ids in reuse order (a copy)."""
        return torch.from_numpy(self._free.view().astype(np.int64))

    def free_pages_np(self) -> np.ndarray:
        return self._free.view().copy()

    def get_all_free_pages(self) -> np.ndarray:
        """Every free page: free list then staged pages (int32 numpy copy)."""
        return np.concatenate([self._free.view(), *self.staged_pages])

    def num_free_pages(self) -> int:
        return len(self._free)

    def available_size(self) -> int:
        return (len(self._free) + self.num_staged_pages) * self.page_size

    # ------------------------------------------------------------------ alloc

    def merge_and_sort_free(self) -> None:
        if self.staged_pages:
            self._free.replace(np.sort(self.get_all_free_pages()))
            self.staged_pages = []
            self.num_staged_pages = 0

    def alloc(self, need_size: int) -> np.ndarray | None:
        """``need_size // page_size`` whole pages from the head, as contiguous slots."""
        num_pages = need_size // self.page_size
        free = self._free
        if num_pages > len(free):
            self.merge_and_sort_free()
        if num_pages > len(free):
            return None
        pages = free.take(num_pages)
        return (pages[:, None] * self.page_size + self._page_offsets).reshape(-1)

    def alloc_extend(
        self,
        prefix_lens: np.ndarray,
        seq_lens: np.ndarray,
        last_loc: np.ndarray,
        extend_num_tokens: int | None = None,
        num_new_pages_hint: int | None = None,
    ) -> np.ndarray | None:
        """Slots for extending each request from ``prefix_lens`` to ``seq_lens``.

        New pages come from the head of the free list in request order (layout:
        ``alloc_extend_layout``). The merge of staged pages happens when SGLang's
        upper bound ``extend_num_tokens // ps + bs + 1`` exceeds the free list.

        Returns:
            int32 ``[sum(seq - prefix)]`` slots, or None if the pages do not fit.
        """
        ps = self.page_size
        if extend_num_tokens is None:
            extend_num_tokens = int((seq_lens - prefix_lens).sum())
        bs = prefix_lens.shape[0]
        free = self._free
        if extend_num_tokens // ps + bs + 1 > len(free):
            self.merge_and_sort_free()
        need = num_new_pages_hint if num_new_pages_hint is not None else num_new_pages(prefix_lens, seq_lens, ps)
        if need > len(free):
            return None
        pages = free.head(need)
        out = alloc_extend_layout(prefix_lens, seq_lens, last_loc, pages, ps)
        free.drop(need)
        return out

    def alloc_decode(self, seq_lens: np.ndarray, last_loc: np.ndarray) -> np.ndarray | None:
        """One slot per request; ``seq_lens`` are the lengths AFTER the new token.

        A request whose new token starts a page (``seq % ps == 1``) gets the next free
        page (batch order); the others get ``last_loc + 1``.
        """
        ps = self.page_size
        bs = seq_lens.shape[0]
        free = self._free
        if bs > len(free):
            self.merge_and_sort_free()
        need_page = seq_lens % ps == 1
        need = int(np.count_nonzero(need_page))
        if need > len(free):
            return None
        out = (last_loc + 1).astype(SLOT_DTYPE)
        if need:
            out[need_page] = free.head(need) * ps
            free.drop(need)
        return out

    def unalloc_pages(self, pages: np.ndarray) -> None:
        """Undo an allocation that took ``pages`` from the head (puts them back)."""
        if pages.shape[0]:
            self._free.prepend(pages)

    # ------------------------------------------------------------------ free

    def free(self, free_index: np.ndarray) -> None:
        """Free the whole page of every slot given (pages deduplicated, ascending)."""
        if free_index.shape[0] == 0:
            return
        if self.free_group is None:
            self._release_page_ids(np.unique(free_index // self.page_size))
        else:
            self.free_group.append(np.array(free_index, dtype=SLOT_DTYPE))

    def free_segment(self, free_index: np.ndarray, start_pos: int = 0) -> None:
        """Free the pages of ``row[start_pos : start_pos + n]`` (start page aligned):
        ``free_index[::ps] // ps``, in row order, each page once."""
        if free_index.shape[0] == 0:
            return
        ps = self.page_size
        if start_pos % ps:
            raise ValueError(f"free_segment: segment start {start_pos} is not page aligned (page size {ps})")
        self.free_page_ids(free_index[::ps] // ps)

    def free_page_ids(self, page_ids: np.ndarray) -> None:
        """Free exactly these pages (no duplicates, not deduplicated)."""
        if page_ids.shape[0] == 0:
            return
        if self.free_group is None:
            self._release_page_ids(page_ids)
        else:
            self.free_page_ids_group.append(np.array(page_ids, dtype=SLOT_DTYPE))

    def _release_page_ids(self, page_ids: np.ndarray) -> None:
        if self.need_sort:
            staged = np.array(page_ids, dtype=SLOT_DTYPE)
            self.staged_pages.append(staged)
            self.num_staged_pages += int(page_ids.shape[0])
            if self.journal is not None:
                self.journal.give(staged)
        else:
            self._free.prepend(page_ids)

    def free_group_begin(self) -> None:
        super().free_group_begin()
        self.free_page_ids_group = []

    def free_group_end(self) -> None:
        pending, self.free_group = self.free_group, None
        if pending:
            self.free(np.concatenate(pending))
        if self.free_page_ids_group:
            group, self.free_page_ids_group = self.free_page_ids_group, []
            self._release_page_ids(np.concatenate(group))


class HiSparseTokenToKVPoolAllocator:
    """HiSparse logical + device allocator pair (SGLang ``HiSparseTokenToKVPoolAllocator``).

    Both sides are paged allocators (also at page size 1). Request rows hold logical
    slots; ``full_to_hisparse_device_index_mapping[logical]`` is the device slot or 0.
    ``available_size`` is the smaller side. Frees are never deferred.

    Args:
        size: device pool slots; the logical pool has ``size * host_to_device_ratio``.
        page_size: tokens per page.
        need_sort: as for the paged allocator.
        host_to_device_ratio: logical / device size.
        device: informational.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        need_sort: bool = False,
        host_to_device_ratio: int = 2,
        device: str = "cpu",
    ) -> None:
        self.page_size = page_size
        self.need_sort = need_sort
        self.device = device
        self.size_full = size * host_to_device_ratio
        self.size = self.size_full
        self.size_hisparse = size
        self.logical_attn_allocator = PagedTokenToKVPoolAllocator(self.size_full, page_size, need_sort, device)
        self.hisparse_attn_allocator = PagedTokenToKVPoolAllocator(size, page_size, need_sort, device)
        self.num_pages = self.logical_attn_allocator.num_pages
        # int64 [size_full + page_size + 1]; the trailing -1 is what last_loc -1 maps to.
        self.full_to_hisparse_device_index_mapping = np.zeros(self.size_full + page_size + 1, dtype=np.int64)
        self.full_to_hisparse_device_index_mapping[-1] = -1
        self.free_group = None

    def clear(self) -> None:
        self.logical_attn_allocator.clear()
        self.hisparse_attn_allocator.clear()
        self.full_to_hisparse_device_index_mapping[:-1] = 0

    @property
    def free_pages(self) -> torch.Tensor:
        """The logical allocator's free pages (what request rows draw from)."""
        return self.logical_attn_allocator.free_pages

    def free_pages_np(self) -> np.ndarray:
        return self.logical_attn_allocator.free_pages_np()

    def get_all_free_pages(self) -> np.ndarray:
        return self.logical_attn_allocator.get_all_free_pages()

    def num_free_pages(self) -> int:
        return self.logical_attn_allocator.num_free_pages()

    def available_size(self) -> int:
        return min(self.logical_attn_allocator.available_size(), self.hisparse_attn_allocator.available_size())

    def logical_available_size(self) -> int:
        return self.logical_attn_allocator.available_size()

    def merge_and_sort_free(self) -> None:
        self.logical_attn_allocator.merge_and_sort_free()
        self.hisparse_attn_allocator.merge_and_sort_free()

    def alloc(self, need_size: int) -> np.ndarray | None:
        """Page size 1 only: logical and device slots, mapped."""
        if self.page_size != 1:
            raise NotImplementedError("HiSparse alloc() is for page size 1; use alloc_extend")
        logical = self.logical_attn_allocator.alloc(need_size)
        if logical is None:
            return None
        device = self.hisparse_attn_allocator.alloc(need_size)
        if device is None:
            self.logical_attn_allocator.free(logical)
            return None
        self.full_to_hisparse_device_index_mapping[logical] = device
        return logical

    def alloc_logical_only(
        self,
        prefix_lens: np.ndarray,
        seq_lens: np.ndarray,
        last_loc: np.ndarray,
        extend_num_tokens: int | None = None,
    ) -> np.ndarray | None:
        """Logical slots only (mapping left 0: device pages are bound later)."""
        return self.logical_attn_allocator.alloc_extend(prefix_lens, seq_lens, last_loc, extend_num_tokens)

    def alloc_extend(
        self,
        prefix_lens: np.ndarray,
        seq_lens: np.ndarray,
        last_loc: np.ndarray,
        extend_num_tokens: int | None = None,
    ) -> np.ndarray | None:
        """Logical and device slots for an extend, mapped; None if either side is short."""
        ps = self.page_size
        need = num_new_pages(prefix_lens, seq_lens, ps)
        if need > self.logical_attn_allocator.available_size() // ps:
            return None
        if need > self.hisparse_attn_allocator.available_size() // ps:
            return None
        logical = self.logical_attn_allocator.alloc_extend(prefix_lens, seq_lens, last_loc, extend_num_tokens)
        if logical is None:
            raise RuntimeError("HiSparse: logical allocation failed after the capacity check")
        device_last_loc = self.full_to_hisparse_device_index_mapping[last_loc]
        device = self.hisparse_attn_allocator.alloc_extend(
            prefix_lens, seq_lens, device_last_loc, int(logical.shape[0]), num_new_pages_hint=need
        )
        if device is None:
            raise RuntimeError("HiSparse: device allocation failed after the capacity check")
        self.full_to_hisparse_device_index_mapping[logical] = device
        return logical

    def alloc_decode(self, seq_lens: np.ndarray, last_loc: np.ndarray) -> np.ndarray | None:
        """Logical slots only (as SGLang: the coordinator binds device pages)."""
        return self.logical_attn_allocator.alloc_decode(seq_lens, last_loc)

    def free(self, free_index: np.ndarray) -> None:
        """Free logical pages and the device pages mapped from them; clear the mapping."""
        if free_index.shape[0] == 0:
            return
        self.logical_attn_allocator.free(free_index)
        mapping = self.full_to_hisparse_device_index_mapping
        device = mapping[free_index]
        device = device[device >= self.page_size]
        if device.shape[0]:
            self.hisparse_attn_allocator.free(device)
        mapping[free_index] = 0

    def free_segment(self, free_index: np.ndarray, start_pos: int = 0) -> None:
        if start_pos % self.page_size:
            raise ValueError(
                f"free_segment: segment start {start_pos} is not page aligned (page size {self.page_size})"
            )
        self.free(free_index)

    def free_group_begin(self) -> None:
        """No deferred frees: ``free`` must clear the mapping at once."""

    def free_group_end(self) -> None:
        """No deferred frees."""

    def is_free_group_open(self) -> bool:
        return False
