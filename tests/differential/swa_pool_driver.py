"""Runs SWA pool op lists through an ``SWATokenToKVPoolAllocator`` and dumps its state.

One op interpreter (``run_ops``) drives either allocator through a small adapter:
``OursAdapter`` (``allocator.swa``, numpy) or ``SGLangAdapter`` (SGLang 0.5.23's own
class on CPU, torch). Run by path with SGLang's interpreter it reads a JSON file of
cases and writes the SGLang states as JSON::

    $KVTRACE_SGLANG_PYTHON tests/differential/swa_pool_driver.py CASES.json OUT.json

At module level it imports only the standard library and numpy, so the test process
(kvtrace's venv) imports it too.

A case is ``{"size", "size_swa", "page_size", "need_sort", "ops"}``. Ops are symbolic:
they name requests, and each side keeps its own request rows (full slots) from its
own allocation results, so a divergence shows at the op that caused it:

* ``alloc {"reqs": [[rid, n], ...]}`` (page 1): one ``alloc(sum n)``, split in order.
* ``alloc_extend {"reqs": [[rid, n], ...]}``: extend each request by ``n`` tokens.
* ``alloc_decode {"rids": [...]}``: one token each.
* ``alloc_swa_tail {"rid", "n", "tail"}``: a new request, ``alloc_extend_swa_tail``.
* ``swa_window {"rid", "upto", "segment", "lo"?}``: free the SWA side of the row from
  the request's SWA cursor (or ``lo`` when none has been freed) up to ``upto``,
  through ``free_swa_segment`` or the set-shaped ``free_swa``.
* ``release {"rid"}``: ``common.free_kv_row_segments``' split: the SWA-freed range
  full-only first (``free_full_segments``), then the rest in both pools
  (``free_segments``).
* ``free {"rid"}``: a plain ``free`` of the whole row.
* ``group_begin`` / ``group_end`` / ``clear``.
* ``evict_window {"rid", "pre_len", "window", "sharing", "retain_floor", "interval",
  "protected"?, "floor"?}``: ``free_swa_out_of_window_slots`` on the request's
  bookkeeping (``ReqKvInfo`` / ``SwaKvInfo``, made at its first such op with
  ``cache_protected_len`` and ``swa_evict_floor``).
* ``release_kv {"rid", "owned", "evict_prefix"}``: ``release_kv_cache``'s frees (its own
  ``[protected, owned)``, then the overallocated rest of the row) through
  ``free_kv_row``; with ``evict_prefix`` the protected prefix is then freed as the
  tree would evict it.

Requests with bookkeeping add their SWA cursors to the state (``"cursors"``).

The state after each op: the op's result (``None`` for an out-of-memory), both
pools' free lists and staged frees, the mapping's non-zero entries and the
three available sizes; ``{"error"}`` for an op that raised (the case stops there).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np


class OursAdapter:
    """kvtrace's ``allocator.swa.SWATokenToKVPoolAllocator``."""

    def __init__(self, size: int, size_swa: int, page_size: int, need_sort: bool) -> None:
        from allocator.swa import SWATokenToKVPoolAllocator

        self.a = SWATokenToKVPoolAllocator(size, size_swa, page_size, need_sort)
        self.page_size = page_size

    def alloc(self, n: int) -> np.ndarray | None:
        return self.a.alloc(n)

    def alloc_extend(self, prefix: np.ndarray, seq: np.ndarray, last_loc: np.ndarray) -> np.ndarray | None:
        return self.a.alloc_extend(prefix, seq, last_loc, int((seq - prefix).sum()))

    def alloc_decode(self, seq: np.ndarray, last_loc: np.ndarray) -> np.ndarray | None:
        return self.a.alloc_decode(seq, last_loc)

    def alloc_swa_tail(self, prefix: np.ndarray, seq: np.ndarray, last_loc: np.ndarray, tail: int) -> Any:
        return self.a.alloc_extend_swa_tail(prefix, seq, last_loc, int((seq - prefix).sum()), tail)

    def call(self, name: str, slots: np.ndarray, **kw: Any) -> None:
        getattr(self.a, name)(slots, **kw)

    def segments(self, name: str, segments: list[tuple[np.ndarray, int]]) -> None:
        getattr(self.a, name)(segments)

    def group_begin(self) -> None:
        self.a.free_group_begin()

    def group_end(self) -> None:
        self.a.free_group_end()

    def clear(self) -> None:
        self.a.clear()

    def new_kv(self, protected: int, floor: int) -> Any:
        from allocator.swa_window import SwaKvInfo

        return SwaKvInfo(cache_protected_len=protected, swa_evict_floor=floor)

    def cursor(self, kv: Any) -> int:
        return int(kv.swa_evicted_seqlen)

    def evict_window(self, kv: Any, row: np.ndarray, op: dict[str, Any]) -> None:
        from allocator.swa_window import free_swa_out_of_window_slots

        free_swa_out_of_window_slots(
            kv, row, op["pre_len"], sliding_window_size=op["window"], allocator=self.a,
            supports_prefix_sharing=op["sharing"], retain_floor=op["retain_floor"], eviction_interval=op["interval"],
        )

    def release_kv(self, kv: Any, row: np.ndarray, owned: int) -> None:
        from allocator.swa_window import release_kv_row

        release_kv_row(self.a, kv, row, owned, int(row.shape[0]))

    def state(self) -> dict[str, Any]:
        a = self.a
        full, swa = a.full_attn_allocator, a.swa_attn_allocator

        def staged(pool: Any) -> list[int]:
            parts = pool._release if self.page_size == 1 else pool.staged_pages
            return np.concatenate(parts).tolist() if parts else []

        m = a.full_to_swa_index_mapping
        nz = np.flatnonzero(m[:-1])
        return {
            "full_free": full.free_pages_np().tolist(),
            "full_staged": staged(full),
            "swa_free": swa.free_pages_np().tolist(),
            "swa_staged": staged(swa),
            "map": [nz.tolist(), m[nz].tolist(), int(m[-1])],
            "avail": [a.available_size(), a.full_available_size(), a.swa_available_size()],
        }


class SGLangAdapter:
    """SGLang 0.5.23's ``SWATokenToKVPoolAllocator`` on CPU (torch fallbacks, no Triton).

    Its ``kvcache`` argument is an ``SWAKVPool`` made without ``__init__`` (no KV
    buffers): the allocator only registers its mapping there and translates
    ``last_loc`` through it.
    """

    def __init__(self, size: int, size_swa: int, page_size: int, need_sort: bool) -> None:
        import torch
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

        self.torch = torch
        pool = SWAKVPool.__new__(SWAKVPool)
        pool.full_kv_pool = None
        pool.swa_kv_pool = None
        pool.full_to_swa_index_mapping = None
        self.a = SWATokenToKVPoolAllocator(size, size_swa, page_size, torch.bfloat16, "cpu", pool, need_sort)
        self.page_size = page_size

    def _t(self, x: np.ndarray) -> Any:
        return self.torch.from_numpy(np.asarray(x, dtype=np.int64).copy())

    @staticmethod
    def _np(x: Any) -> np.ndarray | None:
        return None if x is None else x.numpy().astype(np.int64)

    def alloc(self, n: int) -> np.ndarray | None:
        return self._np(self.a.alloc(n))

    def alloc_extend(self, prefix: np.ndarray, seq: np.ndarray, last_loc: np.ndarray) -> np.ndarray | None:
        p, s = self._t(prefix), self._t(seq)
        return self._np(self.a.alloc_extend(p, p.clone(), s, s.clone(), self._t(last_loc), int((seq - prefix).sum())))

    def alloc_decode(self, seq: np.ndarray, last_loc: np.ndarray) -> np.ndarray | None:
        s = self._t(seq)
        return self._np(self.a.alloc_decode(s, s.clone(), self._t(last_loc)))

    def alloc_swa_tail(self, prefix: np.ndarray, seq: np.ndarray, last_loc: np.ndarray, tail: int) -> Any:
        p, s = self._t(prefix), self._t(seq)
        out = self.a.alloc_extend_swa_tail(
            p, p.clone(), s, s.clone(), self._t(last_loc), int((seq - prefix).sum()), tail
        )
        return self._np(out)

    def call(self, name: str, slots: np.ndarray, **kw: Any) -> None:
        getattr(self.a, name)(self._t(slots), **kw)

    def segments(self, name: str, segments: list[tuple[np.ndarray, int]]) -> None:
        getattr(self.a, name)([(self._t(s), p) for s, p in segments])

    def group_begin(self) -> None:
        self.a.free_group_begin()

    def group_end(self) -> None:
        self.a.free_group_end()

    def clear(self) -> None:
        self.a.clear()

    def new_kv(self, protected: int, floor: int) -> Any:
        from sglang.srt.managers.schedule_batch import ReqKvInfo

        return ReqKvInfo(req_pool_idx=0, cache_protected_len=protected, swa_evict_floor=floor)

    def cursor(self, kv: Any) -> int:
        from sglang.srt.mem_cache.base_prefix_cache import ComponentType

        return int(kv.get_evicted_seqlen(ComponentType.SWA))

    def _pool(self, row: np.ndarray) -> Any:
        from types import SimpleNamespace

        return SimpleNamespace(req_to_token=self._t(row)[None, :])  # the request's row is row 0

    def evict_window(self, kv: Any, row: np.ndarray, op: dict[str, Any]) -> None:
        from types import SimpleNamespace

        from sglang.srt.mem_cache.common import free_swa_out_of_window_slots

        free_swa_out_of_window_slots(
            SimpleNamespace(kv=kv), op["pre_len"], sliding_window_size=op["window"], page_size=self.page_size,
            req_to_token_pool=self._pool(row), token_to_kv_pool_allocator=self.a,
            supports_prefix_sharing=op["sharing"], retain_floor=op["retain_floor"], eviction_interval=op["interval"],
        )

    def release_kv(self, kv: Any, row: np.ndarray, owned: int) -> None:
        """``release_kv_cache`` after its checkpoint: ``BasePrefixCache.free_kv_row`` (SGLang's,
        on a stand-in ``self``) of ``[protected, owned)``, then of the overallocated rest
        as ``_release_overallocated_kv_indices`` bounds it."""
        from types import SimpleNamespace

        from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache

        cache = SimpleNamespace(token_to_kv_pool_allocator=self.a, req_to_token_pool=self._pool(row))
        BasePrefixCache.free_kv_row(cache, kv, [(kv.cache_protected_len, owned)])
        start, end = owned, int(row.shape[0])
        if self.page_size > 1:
            start = -(-start // self.page_size) * self.page_size
        if start < end:
            BasePrefixCache.free_kv_row(cache, kv, [(start, end)])

    def state(self) -> dict[str, Any]:
        torch = self.torch
        a = self.a
        full, swa = a.full_attn_allocator, a.swa_attn_allocator

        def staged(pool: Any) -> list[int]:
            if self.page_size == 1:
                return pool.release_pages.tolist()
            return torch.cat(pool.staged_pages).tolist() if pool.staged_pages else []

        m = a.full_to_swa_index_mapping
        nz = torch.nonzero(m[:-1]).flatten()
        return {
            "full_free": full.free_pages.tolist(),
            "full_staged": staged(full),
            "swa_free": swa.free_pages.tolist(),
            "swa_staged": staged(swa),
            "map": [nz.tolist(), m[nz].tolist(), int(m[-1])],
            "avail": [int(a.available_size()), int(a.full_available_size()), int(a.swa_available_size())],
        }


class Req:
    """One request's row of full slots and its SWA-freed range ``[swa_lo, swa_hi)``."""

    __slots__ = ("row", "swa_lo", "swa_hi", "kv")

    def __init__(self) -> None:
        self.row: list[int] = []
        self.swa_lo = 0
        self.swa_hi = 0
        self.kv: Any = None  # the side's SWA bookkeeping, for evict_window / release_kv


def apply_op(side: Any, reqs: dict[int, Req], op: dict[str, Any]) -> Any:
    """Apply one symbolic op to ``side`` (an adapter) and the request rows; returns
    the op's result: the slots allocated, ``None`` for out of memory, else 0."""
    kind = op["op"]
    arr = np.array
    if kind == "alloc":
        out = side.alloc(sum(n for _, n in op["reqs"]))
        if out is not None:
            i = 0
            for rid, n in op["reqs"]:
                reqs.setdefault(rid, Req()).row.extend(int(x) for x in out[i : i + n])
                i += n
        return None if out is None else out.tolist()
    if kind == "alloc_extend":
        rows = [reqs[rid].row if rid in reqs else [] for rid, _ in op["reqs"]]
        prefix = arr([len(r) for r in rows], dtype=np.int64)
        seq = prefix + arr([n for _, n in op["reqs"]], dtype=np.int64)
        last = arr([r[-1] if r else -1 for r in rows], dtype=np.int64)
        out = side.alloc_extend(prefix, seq, last)
        if out is not None:
            i = 0
            for rid, n in op["reqs"]:
                reqs.setdefault(rid, Req()).row.extend(int(x) for x in out[i : i + n])
                i += n
        return None if out is None else out.tolist()
    if kind == "alloc_decode":
        rows = [reqs[rid].row for rid in op["rids"]]
        seq = arr([len(r) + 1 for r in rows], dtype=np.int64)
        last = arr([r[-1] for r in rows], dtype=np.int64)
        out = side.alloc_decode(seq, last)
        if out is not None:
            for r, x in zip(rows, out):
                r.append(int(x))
        return None if out is None else out.tolist()
    if kind == "alloc_swa_tail":
        n, tail = op["n"], op["tail"]
        out = side.alloc_swa_tail(arr([0]), arr([n]), arr([-1]), tail)
        if out is not None:
            req = reqs.setdefault(op["rid"], Req())
            req.row.extend(int(x) for x in out)
            req.swa_lo, req.swa_hi = 0, n - tail
        return None if out is None else out.tolist()
    if kind == "swa_window":
        req = reqs[op["rid"]]
        if req.swa_hi == req.swa_lo:
            req.swa_lo = req.swa_hi = op.get("lo", req.swa_hi)
        lo, hi = req.swa_hi, op["upto"]
        slots = arr(req.row[lo:hi], dtype=np.int64)
        if op["segment"]:
            side.call("free_swa_segment", slots, start_pos=lo)
        else:
            side.call("free_swa", slots)
        req.swa_hi = hi
        return 0
    if kind == "release":
        req = reqs.pop(op["rid"])
        row = arr(req.row, dtype=np.int64)
        lo, hi = req.swa_lo, req.swa_hi
        if hi > lo:
            side.segments("free_full_segments", [(row[lo:hi], lo)])
            side.segments("free_segments", [(row[:lo], 0), (row[hi:], hi)])
        else:
            side.segments("free_segments", [(row, 0)])
        return 0
    if kind == "free":
        req = reqs.pop(op["rid"])
        side.call("free", arr(req.row, dtype=np.int64))
        return 0
    if kind == "evict_window":
        req = reqs[op["rid"]]
        if req.kv is None:
            req.kv = side.new_kv(op["protected"], op["floor"])
        side.evict_window(req.kv, arr(req.row, dtype=np.int64), op)
        return side.cursor(req.kv)
    if kind == "release_kv":
        req = reqs.pop(op["rid"])
        if req.kv is None:
            req.kv = side.new_kv(0, 0)
        row = arr(req.row, dtype=np.int64)
        side.release_kv(req.kv, row, op["owned"])
        if op["evict_prefix"] and req.kv.cache_protected_len:
            side.call("free", row[: req.kv.cache_protected_len])
        return 0
    if kind == "group_begin":
        side.group_begin()
        return 0
    if kind == "group_end":
        side.group_end()
        return 0
    if kind == "clear":
        side.clear()
        reqs.clear()
        return 0
    raise ValueError(f"unknown op {kind!r}")


def run_case(adapter_cls: type, case: dict[str, Any]) -> list[dict[str, Any]]:
    """Every op of one case through a fresh allocator; the state after each op."""
    side = adapter_cls(case["size"], case["size_swa"], case["page_size"], case["need_sort"])
    reqs: dict[int, Req] = {}
    states = []
    for op in case["ops"]:
        try:
            result = apply_op(side, reqs, op)
        except Exception as e:  # noqa: BLE001 - a divergence (e.g. a request the other side lacks)
            states.append({"error": f"{type(e).__name__}: {e}"})
            break  # the rest of the case means nothing once an op could not run
        state = side.state()
        state["result"] = result
        state["cursors"] = cursors(side, reqs)
        states.append(state)
    return states


def cursors(side: Any, reqs: dict[int, Req]) -> list[list[int]]:
    """``[rid, swa_evicted_seqlen]`` of every request with bookkeeping."""
    return [[rid, side.cursor(q.kv)] for rid, q in sorted(reqs.items()) if q.kv is not None]


def main(argv: list[str]) -> int:
    from case_driver import sglang_main  # beside this file, on sys.path[0] when run by path

    return sglang_main(argv, lambda cases: [run_case(SGLangAdapter, case) for case in cases])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
