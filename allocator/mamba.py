"""The Mamba state pool of hybrid linear-attention models (SGLang 0.5.23).

A hybrid model (full-attention layers and Mamba / linear-attention layers) gives
each running request one recurrent-state slot beside its KV. Slots are per
request, not per token: no pages, no ``req_to_token`` entries. Two pieces mirror
SGLang's:

* ``MambaSlotAllocator`` (``mem_cache/allocator/mamba.py``): a free list of slots
  ``1..size`` (slot 0 is the padded-token dummy); ``alloc`` takes from the head,
  ``free`` appends to the tail, unchecked (a slot freed twice is listed twice).
  A group (``alloc_group_begin(k)``) pre-takes ``k`` slots that ``alloc(1)`` hands
  out first; ``alloc_group_end`` appends the unused ones back.
* ``HybridReqToTokenPool`` (``memory_pool.HybridReqToTokenPool``): request rows
  (``allocator.req_to_token``) plus the row -> slot mapping. Admission
  (``alloc_reqs``) takes rows, then per request a slot unless it already holds
  one (a continuing chunk, a radix copy-on-write), then with an extra buffer its
  ping-pong tracking slots::

      rows free [1 2 3]          row 4 -> mamba slot 7, ping-pong [2 5]
      mamba free [3 6 8 ..]      row 5 -> mamba slot 1, ping-pong [9 -1]   (lazy: 2nd empty)

      req_index_to_mamba_index_mapping[row]                 int32 [rows + 1]
      req_index_to_mamba_ping_pong_track_buffer_mapping[row] int64 [rows + 1, 2 or 1]

``free_mamba_cache`` gives back the request's slot and its non-empty ping-pong
entries (all but a ``keep`` entry the radix tree took); the row goes separately
(``free_req``). Neither mapping is cleared on free: stale entries stay until the
row is reused, as SGLang's.

Buffer modes (``--mamba-radix-cache-strategy``): ``no_buffer`` (no tracking slots),
``extra_buffer`` (2 tracking slots with the overlap scheduler, else 1) and
``extra_buffer_lazy`` (1, the second taken at each track boundary and given back
after it). A SGLang server on CPU runs ``no_buffer`` only; the pool class runs all
three, and so does this one.

One difference, on purpose: a short Mamba pool at admission is an ``assert`` in
SGLang, raised with rows and earlier slots already taken; here ``alloc_reqs``
raises ``MambaSlotsExhausted`` before it takes anything. Rows short: None, both.

Not mirrored: the state tensors (``MambaPool``), the int8 checkpoint pool, the
PLE side pools, ReplaySSM cursors, the unified (byte-coordinated) memory pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from allocator.base import MambaBufferMode, MambaConfig
from allocator.req_to_token import ReqToTokenPool

__all__ = ["MAMBA_TRACK_INTERVAL", "HybridReqToTokenPool", "MambaReqKv", "MambaSlotAllocator", "MambaSlotsExhausted",
           "crossed_track_seqlen", "extend_track_seqlen"]

SLOT_DTYPE = np.int64


# SGLang's ``--mamba-track-interval`` default (``arg_groups/fields/exec_.py``): decode
# tracks a state every ``lcm(checkpoint grid, interval)`` tokens under extra_buffer.
MAMBA_TRACK_INTERVAL = 256


def extend_track_seqlen(
    prefix_len: int, extend_len: int, grid: int, cache_chunk: int, state_chunk: int, branching_seqlen: int | None
) -> int | None:
    """The length whose state an extend forward tracks under extra_buffer, or None
    (SGLang ``_mamba_radix_cache_v2_req_prepare_for_extend`` without DCP).

    Args:
        prefix_len, extend_len: the chunk's start and its new tokens.
        grid: the checkpoint grid (``lcm(cache_chunk, page)``).
        cache_chunk: ``max(model mamba chunk size, page)``.
        state_chunk: the model's mamba chunk size (where the kernel keeps a state).
        branching_seqlen: the match's branching point, or None.
    """
    if extend_len < grid:
        return None
    seq_end = prefix_len + extend_len
    aligned = prefix_len + extend_len // grid * grid
    # the seqlen the kernel is asked for: the last position, or one past an interior one
    asked = seq_end if prefix_len + extend_len // state_chunk * state_chunk == aligned else aligned + 1
    b = branching_seqlen
    if b is not None and prefix_len < b < asked and (b - prefix_len) % cache_chunk == 0:
        aligned = b
    return aligned


def crossed_track_seqlen(pre_len: int, post_len: int, track_grid: int) -> int | None:
    """The boundary a decode or verify from ``pre_len`` to ``post_len`` committed tokens
    tracks (the last multiple of ``track_grid`` in ``(pre_len, post_len]``), or None
    (SGLang ``prepare_for_decode``'s mask; ``spec_utils`` ``to_track_mask``)."""
    if post_len // track_grid == pre_len // track_grid:
        return None
    return post_len // track_grid * track_grid


class MambaSlotsExhausted(RuntimeError):
    """Admission found too few Mamba slots (SGLang: an assert in ``HybridReqToTokenPool.alloc``)."""


class MambaSlotAllocator:
    """Free list of Mamba state slots ``1..size``, SGLang 0.5.23's call for call.

    Attributes:
        size: usable slots.
        free_slots: int64 free slots in reuse order (head first).
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"MambaSlotAllocator: size must be >= 1, found {size}")
        self.size = size
        self.free_slots: np.ndarray
        # Slots pre-taken by an open group, not yet handed out (None: no group).
        self._group: list[int] | None = None
        self.clear()

    def available_size(self) -> int:
        """Slots on the free list (an open group's pre-taken slots do not count)."""
        return int(self.free_slots.shape[0])

    def group_remaining(self) -> list[int]:
        """An open group's slots not yet handed out, in hand-out order."""
        return [] if self._group is None else list(self._group)

    def is_group_open(self) -> bool:
        return self._group is not None

    def alloc_group_begin(self, num_reqs: int) -> None:
        """Pre-take ``num_reqs`` slots for the ``alloc(1)`` calls that follow (none if
        fewer are free). NOTE: as SGLang's, a group still open is dropped, and its
        unused slots with it (they leak)."""
        self._group = None
        if num_reqs > 0:
            taken = self._do_alloc(num_reqs)
            if taken is not None:
                self._group = taken.tolist()

    def alloc_group_end(self) -> None:
        """Give the group's unused slots back (appended, in order)."""
        if self._group:
            self.free(np.asarray(self._group, dtype=SLOT_DTYPE))
        self._group = None

    def alloc(self, need_size: int) -> np.ndarray | None:
        """``need_size`` slots (int64), or None (nothing taken); ``alloc(1)`` drains an
        open group first."""
        if self._group is not None and need_size == 1 and self._group:
            return np.asarray([self._group.pop(0)], dtype=SLOT_DTYPE)
        return self._do_alloc(need_size)

    def _do_alloc(self, need_size: int) -> np.ndarray | None:
        if need_size > self.free_slots.shape[0]:
            return None
        taken = self.free_slots[:need_size].copy()
        self.free_slots = self.free_slots[need_size:]
        return taken

    def free(self, free_index: np.ndarray) -> None:
        """Append slots to the free list (no check: a double free lists a slot twice)."""
        if free_index.shape[0] == 0:
            return
        self.free_slots = np.concatenate((self.free_slots, free_index.astype(SLOT_DTYPE)))

    def clear(self) -> None:
        self.free_slots = np.arange(1, self.size + 1, dtype=SLOT_DTYPE)
        self._group = None


@dataclass(slots=True)
class MambaReqKv:
    """One request's row and Mamba bookkeeping (SGLang's ``ReqKvInfo`` mamba fields).

    Attributes:
        rid: the request's id (for checks and messages).
        req_pool_idx: its row, or None.
        mamba_pool_idx: its state slot, or None.
        ping_pong: int64 ``[buffer size]`` tracking slots (-1 = empty), or None.
        ping_pong_empty: per entry, whether it holds no slot.
        next_track_idx, last_track_idx: the entry the next forward writes / the one
            holding the latest tracked state.
        last_track_seqlen: the length whose state ``last_track_idx`` holds (what an
            extra-buffer checkpoint donates), or None; ``prev_track_seqlen`` the one
            before it (the other entry of a 2-entry buffer).
        branching_seqlen: the radix match's grid-floored full hit past its usable end
            (``mamba_branching_seqlen``): a chunk reaching past it tracks it.
    """

    rid: int
    req_pool_idx: int | None = None
    mamba_pool_idx: int | None = None
    ping_pong: np.ndarray | None = None
    ping_pong_empty: list[bool] | None = None
    next_track_idx: int | None = None
    last_track_idx: int | None = None
    # The tree state slot its own slot was copied from at match (``MambaRadixCache.cow_state``).
    mamba_cow_src: int | None = None
    last_track_seqlen: int | None = None
    prev_track_seqlen: int | None = None
    branching_seqlen: int | None = None

    @property
    def holds_kv(self) -> bool:
        return self.req_pool_idx is not None

    @property
    def holds_mamba(self) -> bool:
        return self.mamba_pool_idx is not None

    def held_slots(self) -> list[int]:
        """Every Mamba slot this request holds: its state slot, then its tracking slots."""
        held = [] if self.mamba_pool_idx is None else [self.mamba_pool_idx]
        if self.ping_pong is not None and self.ping_pong_empty is not None:
            held += [int(s) for s, empty in zip(self.ping_pong.tolist(), self.ping_pong_empty) if not empty]
        return held


class HybridReqToTokenPool(ReqToTokenPool):
    """Request rows plus each request's Mamba slot and tracking slots.

    Args:
        size: request rows.
        max_context_len: row width of ``req_to_token``.
        mamba: slots and buffer mode (``MambaConfig``).
        device: where ``req_to_token`` lives (``ReqToTokenPool``).
        radix_cache: the radix cache is on (the buffer mode's rules apply).

    Attributes:
        mamba_allocator: the slot free list.
        req_index_to_mamba_index_mapping: int32 ``[size + 1]``: row -> state slot.
        req_index_to_mamba_ping_pong_track_buffer_mapping: int64
            ``[size + 1, ping_pong_size]``: row -> tracking slots (extra buffer only).
    """

    def __init__(self, size: int, max_context_len: int, mamba: MambaConfig, device: str = "cpu",
                 radix_cache: bool = True) -> None:
        super().__init__(size, max_context_len, device)
        mamba.check(radix_cache=radix_cache)
        self.mamba_config = mamba
        self.strategy: MambaBufferMode = mamba.strategy
        self.enable_mamba_extra_buffer = mamba.extra_buffer
        self.enable_mamba_extra_buffer_lazy = mamba.strategy == "extra_buffer_lazy"
        self.mamba_ping_pong_track_buffer_size = mamba.ping_pong_size()
        self.mamba_initial_tracking_slots = mamba.tracking_slots()
        self.mamba_allocator = MambaSlotAllocator(mamba.slots)
        self.req_index_to_mamba_index_mapping = np.zeros(size + 1, dtype=np.int32)
        self.req_index_to_mamba_ping_pong_track_buffer_mapping: np.ndarray | None = None
        if self.enable_mamba_extra_buffer:
            self.req_index_to_mamba_ping_pong_track_buffer_mapping = np.zeros(
                (size + 1, self.mamba_ping_pong_track_buffer_size), dtype=np.int64
            )

    # ------------------------------------------------------------------ admission

    def mamba_slots_needed(self, reqs: list[MambaReqKv]) -> int:
        """Slots ``alloc_reqs`` takes for ``reqs`` (SGLang ``ensure_mamba_capacity``'s count)."""
        needed = 0
        for req in reqs:
            if not req.holds_mamba:
                needed += 1
            if self.enable_mamba_extra_buffer and req.ping_pong is None:
                needed += self.mamba_initial_tracking_slots
        return needed

    def _mamba_fits(self, reqs: list[MambaReqKv]) -> bool:
        # alloc(1) drains the open group first; alloc(n > 1) and the rest take the list.
        group = len(self.mamba_allocator.group_remaining())
        free = self.mamba_allocator.available_size()
        for req in reqs:
            takes = [1] if not req.holds_mamba else []
            if self.enable_mamba_extra_buffer and req.ping_pong is None:
                takes.append(self.mamba_initial_tracking_slots)
            for n in takes:
                if n == 1 and group > 0:
                    group -= 1
                elif n > free:
                    return False
                else:
                    free -= n
        return True

    def alloc_reqs(self, reqs: list[MambaReqKv]) -> list[int] | None:
        """Admit ``reqs``: rows, then Mamba slots, then tracking slots, in request order.

        Returns:
            Each request's row, or None (nothing taken) when rows are short.

        Raises:
            MambaSlotsExhausted: too few Mamba slots (nothing taken).
        """
        fresh = [req for req in reqs if not req.holds_kv]
        if len(fresh) > self.available_size():
            return None
        if not self._mamba_fits(reqs):
            raise MambaSlotsExhausted(
                f"Mamba pool: {self.mamba_slots_needed(reqs)} slots needed for {len(reqs)} requests, "
                f"{self.mamba_allocator.available_size()} free"
            )
        rows = self.alloc(len(fresh))
        assert rows is not None
        for req, row in zip(fresh, rows):
            req.req_pool_idx = row
        for req in reqs:
            if not req.holds_mamba:
                slot = self.mamba_allocator.alloc(1)
                assert slot is not None
                req.mamba_pool_idx = int(slot[0])
            if self.enable_mamba_extra_buffer and req.ping_pong is None:
                self._alloc_ping_pong_buffer(req)
        selected = [int(req.req_pool_idx) for req in reqs]  # type: ignore[arg-type]
        self.req_index_to_mamba_index_mapping[selected] = [req.mamba_pool_idx for req in reqs]
        if self.req_index_to_mamba_ping_pong_track_buffer_mapping is not None:
            self.req_index_to_mamba_ping_pong_track_buffer_mapping[selected] = np.stack(
                [req.ping_pong for req in reqs]  # type: ignore[misc]
            )
        return selected

    def _alloc_ping_pong_buffer(self, req: MambaReqKv) -> None:
        n = self.mamba_initial_tracking_slots
        slots = self.mamba_allocator.alloc(n)
        assert slots is not None
        size = self.mamba_ping_pong_track_buffer_size
        buf = np.full(size, -1, dtype=np.int64)
        buf[:n] = slots
        req.ping_pong = buf
        req.ping_pong_empty = [False] * n + [True] * (size - n)
        req.prev_track_seqlen = None
        req.next_track_idx = 0
        req.last_track_idx = 0 if self.enable_mamba_extra_buffer_lazy else self.get_mamba_ping_pong_other_idx(0)

    def get_mamba_ping_pong_other_idx(self, idx: int) -> int:
        return 1 - idx if self.mamba_ping_pong_track_buffer_size == 2 else idx

    def alloc_state_slot(self, req: MambaReqKv) -> bool:
        """Give a request without a row its state slot ahead of admission (the radix
        match's copy-on-write); False (nothing taken) if the pool is empty."""
        if req.holds_mamba:
            raise ValueError(f"rid={req.rid} already holds Mamba slot {req.mamba_pool_idx}")
        slot = self.mamba_allocator.alloc(1)
        if slot is None:
            return False
        req.mamba_pool_idx = int(slot[0])
        return True

    # ------------------------------------------------------------------ tracking slots

    def set_mamba_ping_pong_slot(self, req: MambaReqKv, idx: int, value: int) -> None:
        """Set tracking entry ``idx`` to a slot, or to -1 (empty), and the row's mapping."""
        assert req.ping_pong is not None and req.ping_pong_empty is not None and req.req_pool_idx is not None
        req.ping_pong[idx] = value
        assert self.req_index_to_mamba_ping_pong_track_buffer_mapping is not None
        self.req_index_to_mamba_ping_pong_track_buffer_mapping[req.req_pool_idx] = req.ping_pong
        req.ping_pong_empty[idx] = value == -1

    def lazy_prealloc_at_boundary(self, req: MambaReqKv) -> bool:
        """Lazy mode, a track boundary: a transient slot for the other entry (no
        eviction; skipped while that entry is still held). True if one was taken."""
        assert req.ping_pong_empty is not None and req.next_track_idx is not None
        other = 1 - req.next_track_idx
        if not req.ping_pong_empty[other]:
            return False
        slot = self.mamba_allocator.alloc(1)
        if slot is None:
            return False
        self.set_mamba_ping_pong_slot(req, other, int(slot[0]))
        req.next_track_idx = other
        return True

    def lazy_post_decode_at_boundary(self, req: MambaReqKv, track_idx: int) -> None:
        """Lazy mode, after the boundary's forward: ``track_idx`` holds the state; the
        other entry's slot goes back."""
        assert req.ping_pong is not None and req.ping_pong_empty is not None
        req.last_track_idx = track_idx
        req.next_track_idx = track_idx
        other = 1 - track_idx
        if not req.ping_pong_empty[other]:
            self.mamba_allocator.free(req.ping_pong[other : other + 1].copy())
            self.set_mamba_ping_pong_slot(req, other, -1)

    def lazy_undo_prealloc_at_boundary(self, req: MambaReqKv) -> None:
        """Lazy mode: give back a boundary's transient slot when its batch rides a mixed
        forward (which writes no tracked state)."""
        assert req.ping_pong is not None and req.next_track_idx is not None
        nxt = req.next_track_idx
        if req.ping_pong[1 - nxt] == -1:
            return
        self.mamba_allocator.free(req.ping_pong[nxt : nxt + 1].copy())
        self.set_mamba_ping_pong_slot(req, nxt, -1)
        req.next_track_idx = 1 - nxt

    def track_extend(self, req: MambaReqKv, seqlen: int) -> None:
        """An extend forward tracked the state at ``seqlen`` into the next entry (SGLang
        ``_mamba_radix_cache_v2_req_prepare_for_extend``, non-lazy: the entries swap)."""
        assert req.next_track_idx is not None
        req.last_track_idx = req.next_track_idx
        if not self.enable_mamba_extra_buffer_lazy:
            req.next_track_idx = self.get_mamba_ping_pong_other_idx(req.next_track_idx)
        req.last_track_seqlen = seqlen

    def track_decode(self, req: MambaReqKv, seqlen: int) -> None:
        """A decode or verify forward crossed a track boundary at ``seqlen`` (SGLang's
        result processing, ``_handle_finish_state_updated_req`` then
        ``_mamba_prefix_cache_update``, non-lazy, no overlap lookahead)."""
        assert req.next_track_idx is not None
        track_idx = req.next_track_idx
        req.last_track_idx = track_idx
        req.prev_track_seqlen = req.last_track_seqlen
        req.last_track_seqlen = seqlen
        req.next_track_idx = self.get_mamba_ping_pong_other_idx(track_idx)

    def donate_mamba_ping_pong_slot(self, req: MambaReqKv, new_slot: int) -> int:
        """Hand the latest tracked state's slot to the radix tree; ``new_slot`` takes
        its entry. Returns the donated slot."""
        assert req.ping_pong is not None and req.last_track_idx is not None
        keep = req.last_track_idx
        donated = int(req.ping_pong[keep])
        self.set_mamba_ping_pong_slot(req, keep, new_slot)
        return donated

    # ------------------------------------------------------------------ release

    def free_mamba_cache(self, req: MambaReqKv, keep: int | None = None) -> None:
        """Give back the request's state slot and its tracking slots but ``keep`` (an
        entry the radix tree took). Does not free the row.

        Raises:
            ValueError: the request holds no state slot (a double free).
        """
        if req.mamba_pool_idx is None:
            raise ValueError(f"rid={req.rid}: free_mamba_cache of a request holding no Mamba slot (double free?)")
        self.mamba_allocator.free(np.asarray([req.mamba_pool_idx], dtype=SLOT_DTYPE))
        req.mamba_pool_idx = None
        if not self.enable_mamba_extra_buffer:
            return
        size = self.mamba_ping_pong_track_buffer_size
        if keep not in (None, 0, 1) or (keep == 1 and size != 2):
            raise ValueError(f"cannot keep ping-pong entry {keep} of {size}")
        assert req.ping_pong_empty is not None and req.req_pool_idx is not None
        assert self.req_index_to_mamba_ping_pong_track_buffer_mapping is not None
        positions = [p for p in range(size) if p != keep and not req.ping_pong_empty[p]]
        # SGLang reads the row's mapping here, not the request's own buffer.
        row = self.req_index_to_mamba_ping_pong_track_buffer_mapping[req.req_pool_idx]
        if len(positions) == size:
            self.mamba_allocator.free(row.copy())
        else:
            for p in positions:
                self.mamba_allocator.free(row[p : p + 1].copy())
        req.ping_pong = None
        req.ping_pong_empty = None
        req.next_track_idx = None
        req.last_track_idx = None
        req.last_track_seqlen = None
        req.prev_track_seqlen = None

    def free_req(self, req: MambaReqKv) -> None:
        """Give back the request's row (its Mamba slots are ``free_mamba_cache``'s)."""
        if req.req_pool_idx is None:
            raise ValueError(f"rid={req.rid}: freeing the row of a request holding none")
        self.free(req.req_pool_idx)
        req.req_pool_idx = None

    def release(self, req: MambaReqKv) -> None:
        """A finish without the radix cache, or a retraction: every Mamba slot, then the
        row (``release_kv_cache`` -> ``cleanup_after_caching_req`` -> ``free``). A
        request that never got a row gives back only its state slot."""
        if req.req_pool_idx is None:
            self.free_state_slot(req)
            return
        self.free_mamba_cache(req)
        self.free_req(req)

    def release_checkpointed(self, req: MambaReqKv, keep: int | None = None) -> int:
        """A finish whose state the radix tree took (``cleanup_after_caching_req`` after
        an insert that stored it), then the row: no_buffer, the tree takes the request's
        state slot; extra buffer, its tracking entry ``keep``, and the rest goes back.

        Returns:
            The slot the tree now owns.
        """
        if req.req_pool_idx is None or req.mamba_pool_idx is None:
            raise ValueError(f"rid={req.rid}: a checkpointed release needs a row and a Mamba slot")
        if not self.enable_mamba_extra_buffer:
            donated = req.mamba_pool_idx
            req.mamba_pool_idx = None
        else:
            if keep is None or req.ping_pong is None or req.ping_pong_empty is None or req.ping_pong_empty[keep]:
                raise ValueError(f"rid={req.rid}: no tracking slot at entry {keep} for the tree")
            donated = int(req.ping_pong[keep])
            self.free_mamba_cache(req, keep=keep)
        self.free_req(req)
        return donated

    def free_state_slot(self, req: MambaReqKv) -> None:
        """Give back only the state slot of a request that holds no row (rejected at
        admission, or released before its row was taken); no-op if it holds none."""
        if req.mamba_pool_idx is None:
            return
        self.mamba_allocator.free(np.asarray([req.mamba_pool_idx], dtype=SLOT_DTYPE))
        req.mamba_pool_idx = None

    def clear(self) -> None:
        """Rows and slots all free, both mappings zero."""
        super().clear()
        self.mamba_allocator.clear()
        self.req_index_to_mamba_index_mapping[:] = 0
        if self.req_index_to_mamba_ping_pong_track_buffer_mapping is not None:
            self.req_index_to_mamba_ping_pong_track_buffer_mapping[:] = 0

    # ------------------------------------------------------------------ inspection

    def mamba_free_slots_np(self) -> np.ndarray:
        """The free list in reuse order (int64 copy)."""
        return self.mamba_allocator.free_slots.copy()

    def mamba_available_size(self) -> int:
        return self.mamba_allocator.available_size()

    @property
    def mamba_size(self) -> int:
        return self.mamba_allocator.size
