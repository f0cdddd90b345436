"""Deliberately broken allocator versions, loaded by the replay tests as
``tests/kvtrace/faulty_allocators.py:FACTORY`` (a file version spec).

Each reproduces a bug class SGLang has shipped, on top of the built-in allocator:

* ``leaky_overalloc``: a release forgets the speculative over-allocation
  (bookkeeping says ``kv_allocated_len == kv_committed_len``), so the slots of
  ``[committed, allocated)`` are never freed (SGLang #13741/#13826).
* ``double_free``: a finish frees the request's uncached tail a second time
  ("committed KV cache already freed", SGLang #13801/#28702).
* ``stale_row``: a decode returns the slot it just wrote to the free list, so the
  request's ``req_to_token`` row points at a free slot (stale page tails, #35401).

Each fault fires once, on the first request it can hit, and records that
request (``fault_rid``) so a test can check the replay blames exactly it.

``without_digest`` is not broken: the built-in allocator behind the ``Allocator``
protocol alone (no ``state_digest``, no checkpoints), for the paths that need the
optional protocols.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from allocator import AllocatorConfig, KvAllocator
from allocator.base import AllocOutcome, AllocResult, ReleaseKind, ReleaseResult


class _Faulty(KvAllocator):
    def __init__(self, config: AllocatorConfig) -> None:
        super().__init__(config)
        self.fault_rid: int | None = None

    def _fired(self) -> bool:
        return self.fault_rid is not None


class LeakyOveralloc(_Faulty):
    def release(
        self, rids: np.ndarray, owned_lens: np.ndarray, token_ids: Sequence[np.ndarray] | None, kind: ReleaseKind
    ) -> ReleaseResult:
        if not self._fired():
            self.end_step()
            kv, ps = self.req_kv, self.page_size
            for rid in np.asarray(rids).tolist():
                row = self.row_of(rid)
                allocated, committed = int(kv.kv_allocated_len[row]), int(kv.kv_committed_len[row])
                if -(-allocated // ps) > -(-committed // ps):  # whole pages of slack to strand
                    kv.sum_allocated_ceil -= (-(-allocated // ps) + (committed // -ps)) * ps
                    kv.kv_allocated_len[row] = committed
                    self.fault_rid = rid
                    break
        return super().release(rids, owned_lens, token_ids, kind)


class DoubleFree(_Faulty):
    def release(
        self, rids: np.ndarray, owned_lens: np.ndarray, token_ids: Sequence[np.ndarray] | None, kind: ReleaseKind
    ) -> ReleaseResult:
        victim = None
        if not self._fired() and kind == "finish":
            for rid in np.asarray(rids).tolist():
                lens = self.request_lens(np.array([rid]))
                if lens.committed[0] > lens.protected[0] + self.page_size:
                    victim = (rid, self.row_slots(rid)[int(lens.committed[0]) - 1 : int(lens.committed[0])])
                    break
        out = super().release(rids, owned_lens, token_ids, kind)
        if victim is not None:
            self.fault_rid = victim[0]
            self.token_to_kv_pool_allocator.free(victim[1])
        return out


class StaleRow(_Faulty):
    def decode(self, rids: np.ndarray) -> AllocOutcome:
        out = super().decode(rids)
        if not self._fired() and isinstance(out, AllocResult) and len(rids) > 1:
            rid = int(rids[-1])
            slot = self.row_slots(rid)[-1:]
            self.token_to_kv_pool_allocator.free(slot)
            self.fault_rid = rid
        return out


class WithoutDigest:
    """The built-in allocator without the optional protocols (``Digestible``, ``Checkpointable``)."""

    _HIDDEN = frozenset({"state_digest", "save_state", "restore_state"})

    def __init__(self, config: AllocatorConfig) -> None:
        self._inner = KvAllocator(config)
        self.config = config

    def __getattr__(self, name: str) -> object:
        if name in self._HIDDEN:
            raise AttributeError(name)
        return getattr(self._inner, name)


def without_digest(config: AllocatorConfig) -> WithoutDigest:
    return WithoutDigest(config)


def leaky_overalloc(config: AllocatorConfig) -> KvAllocator:
    return LeakyOveralloc(config)


def double_free(config: AllocatorConfig) -> KvAllocator:
    return DoubleFree(config)


def stale_row(config: AllocatorConfig) -> KvAllocator:
    return StaleRow(config)
