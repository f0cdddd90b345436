"""SGLang 0.5.23's REAL allocator classes, driven one batched call at a time.

Runs INSIDE an SGLang environment (``tools/sglang_oracle/setup.sh``, or any
environment where ``sglang`` imports), loaded by ``driver.py`` as part of a
package of its own: it imports the standard library, numpy, torch, sglang and its
sibling ``scenario`` module, never kvtrace, allocator or traces. ``SGLangEngine``
is one SGLang world behind the ``scenario.Engine`` contract; ``driver.py`` runs
scenario files through it (the differential tests) and ``server.py`` serves the
``Allocator`` protocol of a kvtrace version from it (``kvtrace replay --allocator
sglang``).

What runs for real (SGLang's own code, unmodified): ``ReqToTokenPool``,
``TokenToKVPoolAllocator`` / ``PagedTokenToKVPoolAllocator`` (torch fallbacks:
no Triton on CPU), ``RadixCache`` (plain Python tree; ``--tree unified`` uses
``UnifiedRadixCache`` with its Python tree core, since the Rust core cannot be
deep-copied for the OOM rollback), ``Req`` with ``req.kv``, ``match_kv_cache``,
``checkpoint_kv_cache``, ``alloc_for_extend``, ``alloc_for_decode``,
``eagle_prepare_for_decode`` (which computes ``nxt`` and calls
``alloc_for_spec_decode``), ``release_kv_cache``, ``release_req`` (retraction),
``DecodePreallocQueue._match_prefix_and_lock`` / ``_pre_alloc`` (which calls
``alloc_for_decode_prealloc``), the allocators' free groups, and for a session trace
``StreamingSession`` (``take``, ``try_cache_finished_req``, ``try_match_prefix``,
``release_session``).

Emulation decisions (each mirrors the SGLang function named; the scheduler
itself is not run because a trace already fixes which requests run when):

1. Import: ``sglang.srt.multimodal.internvl_utils`` and
   ``sglang.srt.configs.deepseek_ocr`` import torchvision; a ``sys.meta_path``
   finder fabricates them (attribute access returns a fresh dummy class). Nothing
   on the allocation path uses them.
2. Runtime context: ``get_context().override_server_args(attention_backend=
   "torch_native", device="cpu", page_size=PS, speculative_*=...,
   disaggregation_decode_enable_radix_cache=...)``, installed per scenario. With
   ``torch_native`` and no ``SGLANG_USE_CPU_ENGINE``, ``get_last_loc`` and
   ``write_cache_indices`` take their torch paths.
3. ``allocation.assign_req_to_token_pool_func`` launches Triton; it is replaced
   by the loop of its kernel ``assign_req_to_token_pool`` (§5): it writes
   ``req_to_token`` as the kernel does, through the flat row-major buffer, so a
   reserve past the row width lands in the next row exactly as on a GPU; such a
   write is reported as ``row_overflow`` (rid, positions asked, row width) and
   clipped at the end of the tensor.
4. LRU clock: ``radix_cache.time.monotonic`` becomes a counter that increases by
   one per call (the real clock has ns resolution, so successive calls never tie;
   the counter makes the eviction order deterministic and identical to it).
5. Batches are ``SimpleNamespace`` objects carrying the fields the allocation
   functions read (``ScheduleBatch.prepare_for_extend`` / ``prepare_for_decode``
   set the same ones): ``reqs``, ``prefix_lens``, ``extend_lens``,
   ``extend_num_tokens``, ``seq_lens(_cpu)``, ``req_pool_indices(_cpu)``, pools,
   ``tree_cache``, ``device="cpu"``, no-op ``maybe_evict_swa``.
6. Step order (§10, ``Scheduler.event_loop_overlap``):
   a. finish + abort — ``process_batch_result_decode``: one allocator free group
      (``free_group_begin`` .. ``free_group_end``) around the releases, in op
      order. finish = ``release_kv_cache(checkpoint=True)`` with
      ``finished_reason`` set and ``finished_len`` = owned − prompt length (so
      ``owned_kv_len()`` is the op's ``seq_len``); abort =
      ``release_kv_cache(checkpoint=False)`` (kvtrace's abort caches nothing,
      like SGLang's chunked-abort and discard paths).
   b. retract — ``ScheduleBatch.retract_decode`` → ``release_req(req,
      remaing_req_count=remaining)``: ``release_kv_cache(checkpoint=False)``, evict
      ``remaining * SGLANG_RETRACT_DECODE_STEPS`` tokens, ``reset_for_retract``; no
      free group. The scheduler's ``check_decode_mem`` evictions around it are
      not emulated (the trace decides who is retracted).
   c. prealloc — ``DecodePreallocQueue.pop_preallocated``: with the radix cache,
      ``_match_prefix_and_lock`` on the prompt; then the real ``_pre_alloc``
      (row, ``fill_len``, eviction, ``alloc_for_decode_prealloc``, row write) on a
      bare ``DecodePreallocQueue`` object; ``cache_protected_len =
      total_prefix_len``. The transfer is taken as done in the same step:
      ``prepare_for_prebuilt`` / ``process_prebuilt`` → ``extend_end =
      kv_committed_len`` and ``checkpoint_kv_cache`` (no free group), in op order.
      ``output_ids`` holds the tokens past the prompt plus one pending token, so
      ``_pre_alloc_fill_len`` returns the op's ``seq_len``.
   d. extend — ``get_new_batch_prefill``: first every continuing chunk is
      checkpointed (``stash_chunked_request`` → ``checkpoint_kv_cache``), then each
      new request is matched (``init_next_round_input`` → ``match_kv_cache``;
      ``cache_protected_len = prefix_len``) and locked
      (``_commit_prefill_admission``: ``req.lock = tree.lock(last_node)``), with
      ``extend_end = seq_len``; then ONE ``alloc_for_extend`` for the batch in op
      order. The match is capped at ``min(input_len - 1, seq_len - 1)``: SGLang
      caps at ``input_len - 1`` and would then choose the chunk end itself; a
      trace fixes the chunk end, so a hit past it cannot be used.
   e. decode — ``prepare_for_decode`` → ``alloc_for_decode(batch, 1)`` with
      ``seq_lens = kv_committed_len``.
   f. spec — ``spec_prepare_for_decode`` → ``eagle_prepare_for_decode(batch)``
      (real: reserve, ``page_aligned_decode_alloc_lens``, ``alloc_for_spec_decode``;
      DFLASH: ``DFlashDraftInputV2.prepare_for_decode``, reserve ``2 * num_draft_tokens``),
      then the verify commit of ``process_batch_result_decode`` /
      ``_resolve_spec_v2_tokens``: ``kv_committed_len += accepted``.
   g. prompt publish — ``process_batch_result_prefill``: one free group around
      ``checkpoint_kv_cache`` of every request whose extend completed its prefill
      this step, in op order.
7. Token content: ``origin_input_ids`` = the prompt (ids not appended yet are
   placeholders that no match or insert can reach), ``output_ids`` = the ids past
   the prompt up to the request's length; ``full_untruncated_fill_ids`` is
   rebuilt from them before every call that reads it.
8. Out of memory: the world (pools, allocator, tree, and each request's KV record,
   match and lock references) is deep-copied before every allocation call; a
   ``RuntimeError`` whose text says "out of memory" (or ``_pre_alloc``'s "KV cache
   is full" assertion, or ``alloc_req_slots`` running out of rows) restores it and
   reports ``oom`` — the call leaves no trace, as ``--on-oom skip`` requires —
   except the checkpoint of continuing chunks (d.), which SGLang's
   ``stash_chunked_request`` makes at the top of the step whatever follows.
   SGLang's OOM tree dump goes to a discarded buffer. The copy shares
   ``req_to_token`` (a 131k-context pool is 134 MB) and saves each live row's
   ``[0, kv_allocated_len)``, the only part of it a dump or a later call reads.
   No copy is taken when the call cannot fail: its eviction target (SGLang's own
   bound of the demand: exact tokens at page 1, plus a page per request when
   paged; for spec the ``page_aligned_decode_alloc_lens`` total) is already free
   and the rows are there, so SGLang evicts nothing and allocates.
9. State dump: besides the sizes and lists, the plain ``RadixCache``'s shape
   (``scenario.tree_shape``: each node by its first slot, its parent, length, lock
   count and the rank of its access time), so a split or an access time that
   differs shows up before it changes an eviction.
10. Threads: ``torch.set_num_threads(1)`` at import. SGLang's torch fallbacks work on
   small tensors; with torch's default intra-op threads on a shared CPU they wait on
   each other longer than the work takes. Results are the same; only the speed of the
   replay, the tests and ``bench/sglang_allocator.py`` changes.
11. SWA (a scenario with ``swa``): SGLang 0.5.23 for a hybrid SWA model:
   ``SWATokenToKVPoolAllocator`` over an ``SWAKVPool`` made without
   ``__init__`` (no KV buffers), ``UnifiedRadixCache(FULL, SWA)`` (disabled unless the
   scenario has the radix cache on) with the
   scenario's ``sliding_window_size`` and ``draft_swa_window`` (Python tree core),
   ``SGLANG_SWA_EVICTION_INTERVAL`` and ``SGLANG_OPT_RELEASE_PREFILL_SWA`` from the scenario. Batches carry the real ``ScheduleBatch.maybe_evict_swa`` (with its
   ``_swa_eviction_trigger`` and ``_evict_swa``), ``forward_mode`` EXTEND or DECODE, and
   ``enable_overlap`` with ``chunked_prefill_size`` as the scenario's
   ``overlap_chunked_prefill`` says (0: the non-overlap scheduler; each extend ticks
   ``extend_batch_idx`` as ``prepare_for_extend`` does). Before a decode or spec call each request's
   ``output_ids`` is padded so ``seqlen == kv_committed_len + 1`` (the sampled token whose
   KV is not written yet). The PD prealloc queue sees the SWA pool and the window, so
   ``_pre_alloc`` takes the SWA tail at page > 1. With the radix cache on, the dump's
   ``tree`` is the unified tree's FULL shape and ``swa_tree`` each node's SWA side
   (``scenario.SWA_RADIX_STATE_FIELDS``).
12. KV events (``SGLangEngine(..., kv_events=True)``, asked by ``kvtrace diff --kv-events``):
   ``CacheInitParams.enable_kv_cache_events`` turns on the tree's own recorder, as
   ``--kv-events-config`` does; kvtrace's negative ids (tokens unique to a request) reach
   SGLang's hasher with their sign bit cleared (``install_event_hash_ids``), since it
   refuses negative ids.

13. Mamba (a scenario with ``mamba``): SGLang 0.5.23 for a hybrid linear-attention
   model: ``HybridReqToTokenPool`` (no_buffer, tiny Mamba2 state
   shapes: the states are never read) and ``UnifiedRadixCache(FULL, MAMBA)``; with the radix
   cache off it is disabled, as SGLang's ``create_unified_radix_cache`` builds it: a finish or
   retraction frees the state slot through the Mamba component's
   ``cleanup_after_caching_req``. A short Mamba pool at admission (an ``assert`` in
   ``HybridReqToTokenPool.alloc``, with rows already taken) rolls back as an OOM. The
   scheduler's admission group (``alloc_group_begin``) is not opened: a trace does not
   say how long the waiting queue was, and the built-in allocator opens none either.

14. Mamba with the radix cache (a scenario with ``mamba`` and the radix cache on): the tree
   of decision 13 is enabled (Python tree core; no_buffer at page 1, decision 16 below): the real
   ``match_kv_cache``, with ``cow_mamba`` as the scheduler's ``init_next_round_input`` passes it,
   copies a matched state into a slot of the request's own (``finalize_match_result_in_cache``), ``alloc_for_extend`` runs
   ``ensure_mamba_capacity`` (checkpoint eviction), ``checkpoint_kv_cache`` /
   ``release_kv_cache`` insert a copied or donated state, and the Mamba pool's
   ``evictable`` / ``protected`` are the Mamba component's ledgers (``readout``).
   Under EAGLE the tree keys by tokens: SGLang turns bigram keys off with a MAMBA component.
   A copy-on-write that finds no slot even after evicting (``Can not alloc mamba cache``,
   an assert) rolls back as an OOM (decision 8); an extend with fewer free Mamba slots
   than new requests is snapshotted first.
15. Streaming sessions (a trace with ``hold`` / ``close``; ``SGLangEngine(...,
   sessions=True)``): the unified tree (``UnifiedRadixCache(FULL)``, Python core), which
   owns SGLang's ``StreamingSession``; the scheduler's ``SessionController`` is not run
   (it needs the tokenizer's requests): a request's ``req.session`` is a stand-in
   (``_Session``: ``session_id`` = the rid, ``streaming``, no-op ``finish_req`` /
   ``abort_req``, what ``streaming_session.py`` reads). A trace opens a session at its
   first ``hold``, so the slot takes the first turn's record and tree lock there
   (``maybe_hand_to_session`` → ``take``, then ``publishes_prompt`` cleared) rather than
   at its first row allocation: the first turn's checkpoints then run the tree's own
   ``checkpoint_into_tree`` instead of ``try_checkpoint``'s, which is the same call with
   the lock moved to the slot after, so the pools and the tree end the same.
   hold = a finish in a free group (a.): ``release_kv_cache(checkpoint=True)`` with
   ``finished_len`` = held − prompt, which ``claim_kv_row`` → ``try_cache_finished_req``
   takes (``_trim_overshoot``); the request then becomes a fresh ``Req`` of the session
   (``create_req`` of the next turn). The next turn's extend matches through
   ``match_kv_cache`` → ``try_match_prefix`` (it borrows the slot's record; the virtual
   node's lock is a no-op). close = ``release_session(rid)``. An abort of a resumed turn
   is an abort (``try_cache_finished_req`` hands the record back and deletes the slot).

16. Mamba extra_buffer (a scenario whose ``mamba`` strategy is ``extra_buffer``: the radix
   cache at page > 1, no overlap scheduler): the pool and the tree are built with
   ``enable_mamba_extra_buffer`` and the server args name the strategy, so admission takes the
   ping-pong tracking slot and the real ``checkpoint_kv_cache`` / ``release_kv_cache`` cut the
   insert to the tracked length and donate the tracking slot. The forward passes' tracking
   runs SGLang's own code: each extend's ``ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend``,
   and after each decode or verify the result processor's ``_mamba_prefix_cache_update``,
   told of a crossed boundary by the verify mask of ``speculative/spec_utils.py`` (a decode
   is a verify of one token; without the overlap scheduler there is no lookahead). The
   pool class runs the mode on CPU although SGLang's server refuses it there.

17. HiCache (a scenario with ``hicache``: full attention, the radix cache on): SGLang's
   ``UnifiedRadixCache(FULL)`` in HiCache mode (Python tree core), built as
   ``tests/differential/hiradix_driver.py`` builds it, since ``init_hicache`` needs CUDA:
   the host pool is SGLang's ``HostKVCache`` free list made with ``is_dummy`` (no buffer;
   sized by its own ratio rule, or the scenario's host tokens as is), a synchronous
   ``_SyncController`` stands in for ``HybridCacheController`` with its allocation calls
   (a write takes ``mem_pool_host.alloc``, a load the device allocator's ``alloc``; no
   bytes move), and the attributes ``init_hicache`` sets are set by hand
   (``write_through_threshold``, ``is_write_back``, ``load_back_threshold`` = 10). A new
   request's extend matches on both tiers (``match_kv_cache``) and, when the match has a
   host hit, loads it back as ``PrefillAdder.add_one_req`` does (``init_load_back``;
   ``prefix_len`` grows by what was loaded, ``last_node`` becomes the anchor,
   ``cache_protected_len = prefix_len``) before it is locked. The scheduler's per-step
   ``check_hicache_events`` (every transfer done by the next poll) runs at the first
   extend, decode or eviction after ``end_step``: a step's releases come before it.
   ``readout.host_pool_counters`` reads the host pool as pool ``"host"``.

One concept, read top to bottom: one SGLang world behind the engine contract, and the
emulation decisions above that it implements, from importing SGLang (decisions 1, 4 and
10) to its runtime context and each batched call (2, 3, 5 to 9, 11 to 17); the code names its
decisions by number, so the list and what carries it out stay in one file.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.abc
import importlib.machinery
import io
import logging
import math
import os
import sys
import time
import types
import warnings
from array import array
from types import SimpleNamespace
from typing import Any, Sequence

import numpy as np

from . import scenario as sc

# --------------------------------------------------------------------------- import stubs

_TORCHVISION_MODULES = frozenset({"sglang.srt.multimodal.internvl_utils", "sglang.srt.configs.deepseek_ocr"})


class _DummyModule(types.ModuleType):
    """Stands in for a module that imports torchvision: any attribute is a fresh class."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        cls = type(name, (), {"model_type": f"kvtrace_stub_{name.lower()}"})
        setattr(self, name, cls)
        return cls


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname in _TORCHVISION_MODULES:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        return _DummyModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install_import_stubs() -> None:
    """Put the finder of decision 1 (modules that import torchvision) first on
    ``sys.meta_path``, once per process."""
    if not any(isinstance(finder, _StubFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _StubFinder())


def _import_sglang() -> SimpleNamespace:
    os.environ.pop("SGLANG_USE_CPU_ENGINE", None)
    install_import_stubs()
    warnings.filterwarnings("ignore")
    logging.disable(logging.CRITICAL)
    import torch

    from sglang.srt.disaggregation import decode as pd_decode
    from sglang.srt.managers import schedule_batch
    from sglang.srt.mem_cache import allocation, common, radix_cache
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.allocation_sizing import (
        get_alloc_reserve_per_decode,
        get_req_to_token_extra_context_len,
        page_aligned_decode_alloc_lens,
    )
    from sglang.srt.runtime_context import get_context
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative import eagle_utils

    logging.disable(logging.CRITICAL)
    return SimpleNamespace(
        torch=torch, pd_decode=pd_decode, schedule_batch=schedule_batch, allocation=allocation,
        common=common, radix_cache=radix_cache, Paged=PagedTokenToKVPoolAllocator,
        Token=TokenToKVPoolAllocator, CacheInitParams=CacheInitParams, ReqToTokenPool=ReqToTokenPool,
        extra_context_len=get_req_to_token_extra_context_len, get_context=get_context,
        alloc_reserve_per_decode=get_alloc_reserve_per_decode,
        page_aligned_decode_alloc_lens=page_aligned_decode_alloc_lens,
        SamplingParams=SamplingParams, eagle_utils=eagle_utils,
    )


SG: SimpleNamespace  # set by load_sglang()
_EVICTED = [0]  # tokens RadixCache.evict removed so far (all instances of this process)


def load_sglang(tree_kind: str = "radix") -> SimpleNamespace:
    """Import SGLang's allocator path once per process (decisions 1, 2 and 4), count the
    tokens ``RadixCache.evict`` removes (``evicted_tokens()``), and return the namespace
    of the SGLang names the engine uses (``SG``; ``SG.version`` is the installed
    version). SGLang prints (tree dumps): callers keep stdout for their own data.

    Raises:
        ImportError: sglang (or a module of its allocator path) does not import.
    """
    global SG
    if "SG" in globals():
        return SG
    # The Rust tree core cannot be deep-copied, and the OOM rollback needs that (the
    # unified tree: --tree unified, and every SWA scenario).
    os.environ.setdefault("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "python")
    import importlib.metadata

    SG = _import_sglang()
    SG.version = importlib.metadata.version("sglang")
    SG.torch.set_num_threads(1)  # decision 10
    SG.radix_cache.time = _LogicalClock()
    cls = SG.radix_cache.RadixCache
    original = cls.evict

    def evict(self: Any, params: Any) -> Any:
        res = original(self, params)
        _EVICTED[0] += int(getattr(res, "num_tokens_evicted", 0) or 0)
        return res

    cls.evict = evict
    # The unified (FULL + SWA) tree evicts through ``_evict`` on every path
    # (``evict`` and ``evict_for_alloc``); its full-attention tokens are the count.
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    unified_evict = UnifiedRadixCache._evict

    def _evict(self: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        res = unified_evict(self, params, *args, **kwargs)
        _EVICTED[0] += int(getattr(res, "num_tokens_evicted", 0) or 0)
        return res

    UnifiedRadixCache._evict = _evict
    return SG


def install_event_hash_ids() -> None:
    """Let SGLang's KV-event hasher take kvtrace's negative token ids, once per process.

    kvtrace's ids for tokens unique to a request are negative, and SGLang's native hasher
    refuses negative ids; each id ``x`` reaches it as ``x & (2**63 - 1)``, the map kvtrace's
    own events hash by (``kvtrace/events/blocks.py``, ``hash_ids``). The tree keeps the ids
    themselves, so matching and the events' ``token_ids`` are unchanged.
    """
    from sglang.srt.mem_cache import utils

    original = utils.get_native_hash
    if getattr(original, "kvtrace_hash_ids", False):
        return
    mask = np.int64(0x7FFFFFFFFFFFFFFF)

    def get_native_hash(token_ids: Any, prior_digest: Any, page_size: Any = None) -> Any:
        if not getattr(token_ids, "is_bigram", False):
            raw_of = getattr(token_ids, "raw_token_ids", None)
            raw = raw_of() if raw_of is not None else getattr(token_ids, "token_ids", token_ids)
            ids = np.asarray(raw[: len(token_ids)], dtype=np.int64)
            if ids.shape[0] and int(ids.min()) < 0:
                token_ids = array("q", (ids & mask).tobytes())
        return original(token_ids, prior_digest, page_size)

    get_native_hash.kvtrace_hash_ids = True  # type: ignore[attr-defined]
    utils.get_native_hash = get_native_hash


def evicted_tokens() -> int:
    """Tokens evicted from the radix cache by this process so far."""
    return _EVICTED[0]


class _LogicalClock(types.ModuleType):
    """``time`` for radix_cache: ``monotonic`` ticks by one per call (decision 4)."""

    def __init__(self) -> None:
        super().__init__("kvtrace_radix_clock")
        self._now = 0.0

    def monotonic(self) -> float:
        self._now += 1.0
        return self._now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


class _Overflow(Exception):
    pass


class _Session:
    """Stands in for SGLang's streaming ``Session`` on a request (decision 15): what
    ``session/streaming_session.py`` reads of it."""

    streaming = True

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id

    def finish_req(self, req: Any) -> None:
        """``Session.finish_req`` keeps the turn for the next one's input: the trace says it."""

    def abort_req(self) -> None:
        """``Session.abort_req`` rolls the session's history back: the trace says it."""


# --------------------------------------------------------------------------- HiCache (decision 17)


class _DoneEvent:
    """A transfer event that has completed already (the transfers are synchronous)."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


def _ack(node_ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(start_event=_DoneEvent(), finish_event=_DoneEvent(), node_ids=node_ids,
                           num_tokens_by_pool={}, num_bytes=0, timing_enabled=False)


class _SyncController:
    """``HybridCacheController`` with synchronous transfers: SGLang's allocation calls
    (host slots on write, device slots on load) and acks whose events are done. The pools
    are attributes, not closure cells, so the OOM rollback's deep copy (decision 8) copies
    them with the world."""

    def __init__(self, host: Any, alloc: Any, write_policy: str) -> None:
        self.host = host
        self.alloc = alloc
        self.mem_pool_host = SimpleNamespace(
            anchor_entry=SimpleNamespace(host_pool=SimpleNamespace(shared_allocation_domain=None), host_evict_fn=None),
            available_size=host.available_size)
        self.write_policy = write_policy
        self.enable_storage = False
        self.pp_prefetch_command_group = None
        self.write_queue: list[int] = []
        self.load_queue: list[int] = []
        self.ack_write_queue: list[Any] = []
        self.ack_load_queue: list[Any] = []

    def write(self, device_indices: Any, node_id: int = -1, extra_pools: Any = None, flush: bool = True,
              priority: Any = None, start_owner: Any = None) -> Any:
        host_indices = self.host.alloc(len(device_indices))
        if host_indices is None:
            return None
        self.write_queue.append(node_id)
        if flush:
            self.start_writing()
        return host_indices

    def start_writing(self) -> None:
        if self.write_queue:
            self.ack_write_queue.append(_ack(self.write_queue))
            self.write_queue = []

    def load(self, host_indices: Any, node_id: int = -1, extra_pools: Any = None, priority: Any = None) -> Any:
        device_indices = self.alloc.alloc(len(host_indices))
        if device_indices is None:
            return None
        self.load_queue.append(node_id)
        return device_indices

    def start_loading(self) -> int:
        if not self.load_queue:
            return -1
        self.ack_load_queue.append(_ack(self.load_queue))
        self.load_queue = []
        return 0

    def reset(self) -> None:
        return None


class _HostPoolGroup:
    """The host pool group facade the tree frees host slots through (its one KV pool)."""

    def __init__(self, host: Any) -> None:
        self.host = host

    def free(self, indices: Any, pool: Any = None) -> Any:
        return self.host.free(indices)

    def get_pool(self, name: Any) -> Any:
        from sglang.srt.mem_cache.hicache_storage import PoolName

        return self.host if name == PoolName.KV else None


_HOST_POOL_CLS: list[Any] = []


def _cpu_host_pool_cls() -> Any:
    """SGLang's ``HostKVCache`` with no buffer (``is_dummy``): its free list, alloc, free
    and sizing are SGLang's; the byte-layout methods never run."""
    if not _HOST_POOL_CLS:
        from sglang.srt.mem_cache.pool_host.base import HostKVCache

        class CpuHostKVCache(HostKVCache):
            def get_size_per_token(self) -> int:
                return 1

            def init_kv_buffer(self) -> None:
                return None

            load_to_device_per_layer = set_from_flat_data_page = backup_from_device_all_layer = None
            get_dummy_flat_data_page = get_data_page = None

            # The OOM rollback deep-copies the pool (decision 8): its RLock is not
            # copyable, and a copy gets a lock of its own.
            def __getstate__(self) -> dict[str, Any]:
                return {k: v for k, v in self.__dict__.items() if k != "lock"}

            def __setstate__(self, state: dict[str, Any]) -> None:
                import threading

                self.__dict__.update(state)
                self.lock = threading.RLock()

        CpuHostKVCache.__abstractmethods__ = frozenset()
        _HOST_POOL_CLS.append(CpuHostKVCache)
    return _HOST_POOL_CLS[0]


def _attach_hicache(tree: Any, alloc: Any, spec: sc.HiCacheSpec, device_tokens: int, ps: int) -> None:
    """Put ``tree`` (a ``UnifiedRadixCache(FULL)``) in HiCache mode on the CPU, as
    ``init_hicache`` would without its CUDA host pools (decision 17)."""
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    torch = SG.torch
    sized = spec.host_pool_tokens is not None
    host = _cpu_host_pool_cls()(
        dtype=torch.float32, device_capacity_tokens=device_tokens, size_per_token=1, start_layer=0, end_layer=1,
        host_to_device_ratio=float(spec.host_ratio), host_size=0, page_size=ps, layout="layer_first",
        pin_memory=False, device="cpu", is_dummy=True,
        **({"host_token_capacity": int(spec.host_pool_tokens)} if sized else {}),
    )
    tree.cache_controller = _SyncController(host, alloc, spec.write_policy)
    tree.host_pool_group = _HostPoolGroup(host)
    tree.components[ComponentType.FULL]._full_kv_pool_host = host
    tree.tree_core.set_hicache_enabled()
    tree.write_through_threshold = 1 if spec.write_policy == "write_through" else 2
    tree.is_write_back = spec.write_policy == "write_back"
    tree.load_back_threshold = 10
    tree.host_memory_mode = "cache"


# --------------------------------------------------------------------------- engine


class SGLangEngine:
    """One scenario's SGLang world behind the ``scenario.Engine`` contract."""

    SPEC_NAMES = {"eagle": "EAGLE", "eagle3": "EAGLE3", "standalone": "STANDALONE", "dflash": "DFLASH"}

    def __init__(
        self, config: sc.ScenarioConfig, tree_kind: str = "radix", kv_events: bool = False, sessions: bool = False,
    ) -> None:
        torch = SG.torch
        self.config = config
        self.ps = config.page_size
        fields: dict[str, Any] = dict(attention_backend="torch_native", device="cpu", page_size=self.ps)
        if config.spec is not None:
            algo = self.SPEC_NAMES.get(config.spec.algorithm)
            if algo is None:
                raise sc.ScenarioError(
                    f"spec algorithm {config.spec.algorithm!r} is not driven (eagle, eagle3, standalone, dflash)"
                )
            fields.update(
                speculative_algorithm=algo,
                speculative_num_steps=config.spec.num_steps,
                speculative_eagle_topk=config.spec.topk,
                speculative_num_draft_tokens=config.spec.num_draft_tokens,
            )
        if config.radix_cache:
            fields["disaggregation_decode_enable_radix_cache"] = True
        self.extra_buffer = config.mamba is not None and config.mamba.strategy == "extra_buffer"
        if self.extra_buffer:  # decision 16
            fields["mamba_radix_cache_strategy"] = "extra_buffer"
        if config.swa is not None and config.swa.overlap_chunked_prefill:
            fields["chunked_prefill_size"] = config.swa.overlap_chunked_prefill
        self._ctx = SG.get_context().override_server_args(**fields)
        self._ctx.install()
        self.is_eagle = config.spec is not None and config.spec.algorithm in ("eagle", "eagle3")

        pool_tokens = config.pool_tokens // self.ps * self.ps
        self.row_width = config.max_context_len + SG.extra_context_len()
        if config.mamba is not None:  # decision 13
            req_to_token_pool = self._hybrid_pool()
        else:
            req_to_token_pool = SG.ReqToTokenPool(
                size=config.max_running + config.extra_rows, max_context_len=self.row_width,
                device="cpu", enable_memory_saver=False,
            )
        self.swa_kv_pool: Any = None
        if config.swa is not None:
            allocator = self._swa_allocator(pool_tokens)
        elif self.ps == 1:
            allocator = SG.Token(pool_tokens, torch.int64, "cpu", None, config.need_sort)
        else:
            allocator = SG.Paged(pool_tokens, self.ps, torch.int64, "cpu", None, config.need_sort)
        params = SG.CacheInitParams(
            disable=not config.radix_cache, req_to_token_pool=req_to_token_pool,
            token_to_kv_pool_allocator=allocator, page_size=self.ps, is_eagle=self.is_eagle,
            enable_kv_cache_events=kv_events, eviction_policy=config.eviction_policy,
        )
        if self.extra_buffer:  # decision 16
            params.enable_mamba_extra_buffer = True
        if kv_events:  # decision 12
            install_event_hash_ids()
        if config.swa is not None:  # decision 11
            from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
            from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

            os.environ["SGLANG_SWA_EVICTION_INTERVAL"] = str(config.swa.eviction_interval)
            os.environ["SGLANG_OPT_RELEASE_PREFILL_SWA"] = "1" if config.swa.release_prefill_swa else "0"
            params.tree_components = (ComponentType.FULL, ComponentType.SWA)
            params.sliding_window_size = config.swa.window
            params.draft_swa_window = config.swa.draft_window  # swa_retain_window = max of the two
            tree = UnifiedRadixCache(params)
        elif config.mamba is not None:  # decision 13
            from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
            from sglang.srt.mem_cache.unified_cache.components import mamba as comp_mamba
            from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

            # The Mamba component reads the model's chunk size off its HF config (there is
            # none here): FLA's 64, or the page when larger, as SGLang derives it.
            chunk = max(64, self.ps)
            comp_mamba.mamba_cache_chunk_size = lambda: chunk
            comp_mamba.mamba_checkpoint_grid = lambda page: math.lcm(chunk, page)
            if self.extra_buffer:  # decision 16: the forward passes' tracking reads them too
                from sglang.srt.managers.scheduler_components import batch_result_processor as brp
                from sglang.srt.runtime_context import get_exec

                interval = get_exec().mamba.mamba_track_interval
                SG.schedule_batch.mamba_cache_chunk_size = lambda: chunk
                SG.schedule_batch.mamba_checkpoint_grid = lambda page: math.lcm(chunk, page)
                SG.schedule_batch.mamba_track_grid = lambda page: math.lcm(chunk, page, interval)
                brp.mamba_track_grid = SG.schedule_batch.mamba_track_grid
            params.tree_components = (ComponentType.FULL, ComponentType.MAMBA)
            tree = UnifiedRadixCache(params)  # enabled with the radix cache: decision 14
        elif config.hicache is not None:  # decision 17
            from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
            from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

            if not config.radix_cache or sessions:
                raise sc.ScenarioError("HiCache's host tier is driven with the radix cache on and no sessions")
            params.tree_components = (ComponentType.FULL,)
            tree = UnifiedRadixCache(params)
            _attach_hicache(tree, allocator, config.hicache, pool_tokens, self.ps)
        elif tree_kind == "unified" or sessions:  # decision 15: sessions live in the unified tree
            from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
            from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

            params.tree_components = (ComponentType.FULL,)
            tree = UnifiedRadixCache(params)
        else:
            tree = SG.radix_cache.RadixCache(params)
        self.world: dict[str, Any] = {"pool": req_to_token_pool, "alloc": allocator, "tree": tree}
        self.reqs: dict[int, Any] = {}
        self._stashed: dict[int, int] = {}  # per rid: the chunk end last stashed (d.)
        self.sessions = sessions  # decision 15
        # per rid: its cache namespace, SGLang's ``Req.extra_key`` (which keys its radix tree)
        self.namespaces: dict[int, str] = {}
        self.prompt_tokens: dict[int, np.ndarray] = {}
        self._overflow: list[tuple[int, int, int]] = []
        self._row_rid: dict[int, int] = {}
        # The pool's free + evictable slots when the last call ran out of memory (read
        # before the rollback: SGLang had matched, locked and evicted what it could).
        self.oom_budget = 0
        # (positions held before, positions after) per request of the last allocation
        # call: the match or held prefix and the target (extend, prealloc), the row's
        # allocated length and the reserve's end (spec). Survives a rollback.
        self.last_lens: tuple[list[int], list[int]] = ([], [])
        self.hicache = config.hicache is not None
        self._hicache_ack_due = False
        SG.allocation.assign_req_to_token_pool_func = self._assign_req_to_token_pool

    def _hybrid_pool(self) -> Any:
        """SGLang's ``HybridReqToTokenPool`` with the scenario's Mamba slots and tiny
        Mamba2 state shapes (decision 13)."""
        from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
        from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

        torch = SG.torch
        mamba = self.config.mamba
        assert mamba is not None
        shape = Mamba2StateShape.create(
            tp_world_size=1, intermediate_size=8, n_groups=1, num_heads=2, head_dim=4, state_size=4, conv_kernel=2
        )
        params = Mamba2CacheParams(
            shape=shape, layers=[0], dtype=Mamba2StateDType(conv=torch.float32, temporal=torch.float32)
        )
        return HybridReqToTokenPool(
            size=self.config.max_running + self.config.extra_rows, mamba_size=mamba.slots,
            mamba_spec_state_size=mamba.slots, max_context_len=self.row_width, device="cpu",
            enable_memory_saver=False, cache_params=params, mamba_layer_ids=[0],
            enable_mamba_extra_buffer=self.extra_buffer, enable_mamba_extra_buffer_lazy=False,
            enable_overlap_schedule=False,
        )

    def _mamba_slots_needed(self, reqs: list[Any]) -> int:
        """The Mamba slots admitting ``reqs`` takes (``ensure_mamba_capacity``'s count)."""
        needed = sum(1 for r in reqs if not r.kv.holds_mamba)
        if self.extra_buffer:
            needed += sum(self.pool.mamba_initial_tracking_slots for r in reqs if r.kv.mamba_ping_pong_track_buffer is None)
        return needed

    def _track_extend(self, reqs: list[Any]) -> None:
        """decision 16: each chunk's tracking, by SGLang's ``prepare_for_extend`` step."""
        from types import SimpleNamespace

        ns = SimpleNamespace(
            tree_cache=self.tree, req_to_token_pool=self.pool,
            model_config=SimpleNamespace(hf_text_config=SimpleNamespace(mamba_chunk_size=64)),
        )
        prepare = SG.schedule_batch.ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend
        for req in reqs:
            prepare(ns, req)

    def _track_verify(self, reqs: list[Any], pre_lens: list[int]) -> None:
        """decision 16: a decode's or verify's boundary crossing (``spec_utils`` mask from
        the committed lengths before and after), then SGLang's result-side update."""
        from types import SimpleNamespace

        from sglang.srt.managers.scheduler_components import batch_result_processor as brp

        grid = SG.schedule_batch.mamba_track_grid(self.ps)
        proc = SimpleNamespace(tree_cache=self.tree)
        update = brp.SchedulerBatchResultProcessor._mamba_prefix_cache_update
        for i, (req, pre) in enumerate(zip(reqs, pre_lens)):
            post = req.kv.kv_committed_len
            crossed = pre // grid != post // grid
            proc._mamba_check_track_boundary = lambda *_a, c=crossed, t=post // grid * grid: (c, t)
            batch = SimpleNamespace(
                req_to_token_pool=self.pool, mamba_track_buffer_indices=[req.kv.mamba_next_track_idx] * (i + 1),
            )
            update(proc, req, batch, None, i, known_boundary=False)

    def _swa_allocator(self, pool_tokens: int) -> Any:
        """SGLang's ``SWATokenToKVPoolAllocator`` over a buffer-less ``SWAKVPool`` (decision 11)."""
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

        swa = self.config.swa
        kv_pool = SWAKVPool.__new__(SWAKVPool)
        kv_pool.full_kv_pool = None
        kv_pool.swa_kv_pool = None
        kv_pool.full_to_swa_index_mapping = None
        self.swa_kv_pool = kv_pool
        swa_tokens = swa.swa_pool_tokens // self.ps * self.ps
        return SWATokenToKVPoolAllocator(
            pool_tokens, swa_tokens, self.ps, SG.torch.bfloat16, "cpu", kv_pool, self.config.need_sort
        )

    def _swa_seqlens(self, reqs: list[Any]) -> None:
        """Before a decode / spec step: ``seqlen == kv_committed_len + 1`` (decision 11)."""
        if self.config.swa is None:
            return
        for req in reqs:
            n = req.kv.kv_committed_len + 1 - len(req.origin_input_ids)
            if n >= 0 and len(req.output_ids) != n:
                rid = int(req.rid)
                pad = sc.UNIQUE_TOKEN_BASE + (rid << 24) + (1 << 22) + np.arange(n, dtype=np.int64)
                req.output_ids = array("q", pad.tolist())

    def close(self) -> None:
        self._ctx.restore()

    # -- HiCache's per-step poll (decision 17) ----------------------------------------
    def end_step(self) -> None:
        """The step ended: its prompt publishes run, and the host tier's poll is due."""
        self.publish()
        if self.hicache:
            self._hicache_ack_due = True

    def hicache_poll(self) -> None:
        """SGLang's ``check_hicache_events`` once after ``end_step`` (no-op otherwise):
        submit the queued backups, finish every write and load ack (all done)."""
        if not self._hicache_ack_due:
            return
        self._hicache_ack_due = False
        tree = self.tree
        cc = tree.cache_controller
        tree.flush_pending_backups()
        tree.writing_check(finish_count=len(cc.ack_write_queue))
        cc.start_loading()
        tree.loading_check(finish_count=len(cc.ack_load_queue))

    def _load_back(self, req: Any) -> None:
        """``PrefillAdder.add_one_req``'s load-back of a matched host hit (decision 17)."""
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

        if not req.needs_host_load_back():
            return
        loaded, node = self.tree.init_load_back(InitLoadBackParams(
            best_match_node=req.best_match_node, host_hit_length=req.host_hit_length, req=req))
        req.host_loaded_length, req.last_node = loaded, node
        req.prefix_len += loaded
        if self.tree.load_back_is_cache_owned():
            req.kv.cache_protected_len = req.prefix_len

    # -- accessors ---------------------------------------------------------------
    @property
    def pool(self) -> Any:
        return self.world["pool"]

    @property
    def alloc(self) -> Any:
        return self.world["alloc"]

    @property
    def tree(self) -> Any:
        return self.world["tree"]

    # -- requests ------------------------------------------------------------------
    def session_kv(self, rid: int) -> Any | None:
        """The KV record rid's session slot holds (decision 15), or None."""
        if not self.sessions:
            return None
        slot = self.tree.session.slots.get(str(rid))
        return slot.kv if slot is not None and slot.kv.holds_kv else None

    def kv_of(self, rid: int) -> Any | None:
        """The KV record rid holds: its request's, or its session's between turns; None."""
        req = self.reqs.get(rid)
        if req is not None and req.kv.holds_kv:
            return req.kv
        return self.session_kv(rid)

    def live_kvs(self) -> list[tuple[int, Any]]:
        """(rid, KV record) of every record holding a row: each request's, and each
        session's between turns."""
        return [(rid, kv) for rid in self.reqs if (kv := self.kv_of(rid)) is not None]

    def session_records(self) -> set[int]:
        """``id()`` of the records sessions own (SGLang's ``session_records``), running
        turns included."""
        if not self.sessions:
            return set()
        return {id(kv) for kv in self.tree.session_records().values() if kv.holds_kv}

    def _req(self, rid: int, prompt_len: int) -> Any:
        req = self.reqs.get(rid)
        if req is None:
            req = SG.schedule_batch.Req(
                rid=str(rid), origin_input_text="", origin_input_ids=array("q"),
                sampling_params=SG.SamplingParams(max_new_tokens=1 << 30),
                extra_key=self.namespaces.get(rid),
            )
            self.reqs[rid] = req
        return req

    def _set_tokens(self, req: Any, tokens: np.ndarray, prompt_len: int, pending: int = 0) -> None:
        """origin = prompt (placeholders past the known ids), output = the rest (+ pending ids)."""
        rid = int(req.rid)
        n = tokens.shape[0]
        if n >= prompt_len:
            origin = tokens[:prompt_len]
            output = tokens[prompt_len:]
        else:
            pos = np.arange(n, prompt_len, dtype=np.int64)
            origin = np.concatenate([tokens, sc.UNIQUE_TOKEN_BASE + (rid << 24) + pos + (1 << 23)])
            output = np.zeros(0, np.int64)
        if pending:
            extra = sc.UNIQUE_TOKEN_BASE + (rid << 24) + (1 << 23) - 1 - np.arange(pending, dtype=np.int64)
            output = np.concatenate([output, extra])
        req.origin_input_ids = array("q", origin.tolist())
        req.origin_input_ids_unpadded = req.origin_input_ids
        req.output_ids = array("q", output.tolist())
        req.full_untruncated_fill_ids = req.origin_input_ids + req.output_ids

    def _batch(self, reqs: list[Any], **kw: Any) -> SimpleNamespace:
        torch = SG.torch
        rows = [r.kv.req_pool_idx for r in reqs]
        ns = SimpleNamespace(
            reqs=reqs, tree_cache=self.tree, req_to_token_pool=self.pool,
            token_to_kv_pool_allocator=self.alloc, device="cpu", hisparse_coordinator=None,
            model_config=SimpleNamespace(is_encoder_decoder=False),
            maybe_evict_swa=lambda: None, is_dllm=lambda: False,
            sampling_info=SimpleNamespace(penalizer_orchestrator=SimpleNamespace(is_required=False)),
        )
        if self.config.swa is not None:  # decision 11: the real maybe_evict_swa
            from sglang.srt.model_executor.forward_batch_info import ForwardMode

            cls = SG.schedule_batch.ScheduleBatch
            ns.forward_mode = ForwardMode.EXTEND if "extend_lens" in kw else ForwardMode.DECODE
            ns.enable_overlap = self.config.swa.overlap_chunked_prefill > 0
            ns.forward_iter = 0
            for name in ("maybe_evict_swa", "_swa_eviction_trigger", "_evict_swa"):
                setattr(ns, name, types.MethodType(getattr(cls, name), ns))
        if all(r is not None for r in rows):
            ns.req_pool_indices = torch.tensor(rows, dtype=torch.int64)
            ns.req_pool_indices_cpu = ns.req_pool_indices.clone()
        for k, v in kw.items():
            setattr(ns, k, v)
        return ns

    # -- OOM rollback (decision 8) ---------------------------------------------------
    _REQ_REFS = ("kv", "last_node", "lock", "last_host_node", "best_match_node")

    def _snapshot(self) -> tuple[Any, dict[int, dict[str, Any]], list[tuple[int, Any]]]:
        refs = {rid: {a: getattr(r, a, None) for a in self._REQ_REFS} for rid, r in self.reqs.items()}
        # req_to_token is shared, not copied (257 rows x 131k positions is 134 MB):
        # only the live rows' [0, kv_allocated_len) is observable, and it is saved here.
        r2t = self.pool.req_to_token
        memo = {id(r2t): r2t}
        deep = copy.deepcopy({"world": self.world, "refs": refs}, memo)
        flat = {rid: dict(r.__dict__) for rid, r in self.reqs.items()}
        rows = []
        for r in self.reqs.values():
            kv = r.kv
            if kv.req_pool_idx is not None and kv.kv_allocated_len:
                n = min(kv.kv_allocated_len, r2t.shape[1])
                rows.append((kv.req_pool_idx, r2t[kv.req_pool_idx, :n].clone()))
        return deep, flat, rows

    def _restore(self, snap: tuple[Any, dict[int, dict[str, Any]], list[tuple[int, Any]]]) -> None:
        deep, flat, rows = snap
        self.world = deep["world"]
        r2t = self.pool.req_to_token
        for row, values in rows:
            r2t[row, : values.shape[0]] = values
        for rid in list(self.reqs):
            if rid not in flat:
                del self.reqs[rid]
                continue
            req = self.reqs[rid]
            req.__dict__.clear()
            req.__dict__.update(flat[rid])
            for a, v in deep["refs"][rid].items():
                setattr(req, a, v)

    def _fits_without_eviction(self, num_tokens: int, new_rows: int = 0) -> bool:
        """The call's eviction target (SGLang's own upper bound of its demand: exact
        tokens at page 1, plus one page per request when paged) is already free, so
        SGLang evicts nothing and the allocation cannot fail: no snapshot needed."""
        if new_rows and self.config.mamba is not None and not self.tree.disable:
            # decision 14: each new request takes a Mamba slot (its copy-on-write or its
            # own); short of free ones SGLang evicts checkpoints, and may assert
            per_row = 1 + (self.pool.mamba_initial_tracking_slots if self.extra_buffer else 0)
            if new_rows * per_row > int(self.pool.mamba_allocator.available_size()):
                return False
        return new_rows <= self.pool.available_size() and num_tokens <= self.alloc.available_size()

    def _guarded(self, fn: Any, cannot_fail: bool = False) -> sc.CallResult:
        self._overflow = []
        if cannot_fail:
            sink = io.StringIO()
            with contextlib.redirect_stdout(sink):
                fn()
            return sc.CallResult("ok", "", tuple(self._overflow))
        snap = self._snapshot()
        sink = io.StringIO()
        try:
            with contextlib.redirect_stdout(sink):
                fn()
        except RuntimeError as exc:
            text = str(exc)
            if "out of memory" not in text.lower() and "runs out of memory" not in text:
                raise
            self._rollback(snap)
            return sc.CallResult("oom", text.splitlines()[0])
        except AssertionError as exc:
            text = str(exc)
            if ("KV cache is full" in text or "req_pool_indices is full" in text or "space for mamba" in text
                    or "Can not alloc mamba cache" in text):  # decision 14: a match's copy-on-write
                self._rollback(snap)
                return sc.CallResult("oom", text.splitlines()[0])
            if "exceeds req_to_token row width" in text:
                # Paged topk>1 reserve past the row: SGLang fails fast (eagle_utils).
                self._restore(snap)
                return sc.CallResult("ok", "row overflow assertion", tuple(self._overflow) or ((-1, -1, self.row_width),))
            raise
        return sc.CallResult("ok", "", tuple(self._overflow))

    def _rollback(self, snap: tuple[Any, dict[int, dict[str, Any]], list[tuple[int, Any]]]) -> None:
        """Note the budget the failed call saw (``oom_budget``), then undo it."""
        self.oom_budget = int(self.alloc.available_size()) + int(self.tree.evictable_size())
        self._restore(snap)

    # -- the kernel replacement (decision 3) ---------------------------------------
    def _assign_req_to_token_pool(
        self, req_pool_indices: Any, req_to_token: Any, start_offset: Any, end_offset: Any,
        out_cache_loc: Any, batch_size: int,
    ) -> None:
        flat = req_to_token.view(-1)
        width = req_to_token.shape[1]
        rows = req_pool_indices.tolist()
        starts = start_offset.tolist()
        ends = end_offset.tolist()
        pt = 0
        for row, s, e in zip(rows, starts, ends):
            n = e - s
            if n <= 0:
                continue
            lo = row * width + s
            hi = min(lo + n, flat.numel())
            flat[lo:hi] = out_cache_loc[pt : pt + (hi - lo)].to(flat.dtype)
            if e > width:
                self._overflow.append((self._row_rid.get(row, -1), int(e), int(width)))
            pt += n

    # -- ops ---------------------------------------------------------------------------
    def extend(self, rids, seq_lens, token_ids, prompt_lens, prefill_done) -> sc.CallResult:
        self.hicache_poll()
        reqs = [self._req(rid, pl) for rid, pl in zip(rids, prompt_lens)]
        # d. checkpoint continuing chunks first (SGLang's ``stash_chunked_request`` runs
        # at the top of the step, before and regardless of the allocation, so an OOM of
        # the allocation does not undo it), then match + lock new requests.
        # A chunk is stashed once: an extend retried without a request that ran out of
        # memory (``--on-oom skip``) does not stash it again (SGLang stashes once a step;
        # with a Mamba tree a second stash would copy the state again, decision 14).
        for rid, req, toks, pl in zip(rids, reqs, token_ids, prompt_lens):
            if req.kv.holds_kv and self._stashed.get(rid) != req.extend_end:
                self._set_tokens(req, toks, pl)
                SG.common.checkpoint_kv_cache(req, self.tree)
                self._stashed[rid] = req.extend_end

        def run() -> None:
            common = SG.common
            for req, toks, pl, seq_len in zip(reqs, token_ids, prompt_lens, seq_lens):
                if req.kv.holds_kv:
                    req.extend_end = seq_len
                    continue
                self._set_tokens(req, toks, pl)
                fill = req.full_untruncated_fill_ids
                cap = min(req._compute_max_prefix_len(len(fill)), seq_len - 1)
                # SGLang's init_next_round_input copies a matched Mamba state (cow_mamba
                # defaults to the tree's supports_mamba() there, False in match_kv_cache)
                res = common.match_kv_cache(req, self.tree, fill, max_prefix_len=cap,
                                            cow_mamba=self.config.mamba is not None and not self.tree.disable)
                if res.cache_protected_len is None:
                    req.kv.cache_protected_len = req.prefix_len
                if self.hicache:
                    self._load_back(req)
                req.lock = self.tree.lock(req.last_node)
                req.extend_end = seq_len
            torch = SG.torch
            prefix_lens = [r.prefix_len for r in reqs]
            self.last_lens = (prefix_lens, list(seq_lens))
            extend_lens = [r.extend_end - r.prefix_len for r in reqs]
            batch = self._batch(
                reqs, prefix_lens=prefix_lens, extend_lens=extend_lens,
                extend_num_tokens=sum(extend_lens),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
                seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int64),
            )
            if self.config.swa is not None:
                for r in reqs:  # prepare_for_extend
                    r.extend_batch_idx += 1
            SG.allocation.alloc_for_extend(batch)
            for rid, req in zip(rids, reqs):
                self._row_rid[req.kv.req_pool_idx] = rid
            if self.extra_buffer:
                self._track_extend(reqs)

        held = [r.kv.kv_allocated_len if r.kv.holds_kv else 0 for r in reqs]
        bound = sum(n - h for n, h in zip(seq_lens, held)) + (len(reqs) * self.ps if self.ps > 1 else 0)
        new_rows = sum(1 for r in reqs if not r.kv.holds_kv)
        fits = self._fits_without_eviction(bound, new_rows)
        if self.hicache:  # decision 17: a new request's load-back takes device slots past the bound
            fits = fits and new_rows == 0
        if self.config.mamba is not None:  # decision 13: a short Mamba pool is an assert
            fits = fits and self._mamba_slots_needed(reqs) <= self.pool.mamba_allocator.available_size()
        res = self._guarded(run, fits)
        if res.outcome == "ok":
            self._publish = [r for r, d in zip(reqs, prefill_done) if d]
        return res

    def publish(self) -> None:
        """g. prompt publish of the requests whose prefill completed this step."""
        reqs, self._publish = getattr(self, "_publish", []), []
        if not reqs:
            return
        self.alloc.free_group_begin()
        for req in reqs:
            SG.common.checkpoint_kv_cache(req, self.tree)
        self.alloc.free_group_end()

    def decode(self, rids) -> sc.CallResult:
        self.hicache_poll()
        reqs = [self.reqs[rid] for rid in rids]

        self._swa_seqlens(reqs)

        def run() -> None:
            torch = SG.torch
            lens = [r.kv.kv_committed_len for r in reqs]
            batch = self._batch(
                reqs, seq_lens=torch.tensor(lens, dtype=torch.int64),
                seq_lens_cpu=torch.tensor(lens, dtype=torch.int64),
            )
            SG.allocation.alloc_for_decode(batch, token_per_req=1)
            for r in reqs:
                r.decode_batch_idx += 1
            if self.extra_buffer:
                self._track_verify(reqs, lens)

        return self._guarded(run, self._fits_without_eviction(len(reqs) * self.ps))

    def spec(self, rids, accepted) -> sc.CallResult:
        reqs = [self.reqs[rid] for rid in rids]
        self._swa_seqlens(reqs)

        dflash = self.config.spec is not None and self.config.spec.algorithm == "dflash"

        def run() -> None:
            torch = SG.torch
            lens = [r.kv.kv_committed_len for r in reqs]
            batch = self._batch(reqs, seq_lens_cpu=torch.tensor(lens, dtype=torch.int64), batch_size=lambda: len(reqs))
            if dflash:  # DFLASH's own prepare: a reserve of two verify blocks, maybe_evict_swa first
                from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2

                DFlashDraftInputV2.create_idle_input("cpu").prepare_for_decode(batch)
            else:
                SG.eagle_utils.eagle_prepare_for_decode(batch)
            for r, a in zip(reqs, accepted):
                r.kv.kv_committed_len += a
            if self.extra_buffer:
                self._track_verify(reqs, lens)

        reserve = 2 * self.config.spec.num_draft_tokens if dflash else SG.alloc_reserve_per_decode()
        cur, nxt, needed = SG.page_aligned_decode_alloc_lens(reqs, reserve=reserve, page_size=self.ps)
        self.last_lens = (list(cur), list(nxt))
        bound = needed + (len(reqs) * self.ps if self.ps > 1 else 0)
        # (a reserve past the row trips eagle_prepare_for_decode's assertion at page > 1)
        safe = self._fits_without_eviction(bound) and max(nxt, default=0) <= self.row_width
        return self._guarded(run, safe)

    def prealloc(self, rids, fill_lens, token_ids, prompt_lens) -> sc.CallResult:
        reqs = [self._req(rid, pl) for rid, pl in zip(rids, prompt_lens)]

        self.last_lens = ([], [])

        def run() -> None:
            q = object.__new__(SG.pd_decode.DecodePreallocQueue)
            q.req_to_token_pool = self.pool
            q.token_to_kv_pool_allocator = self.alloc
            q.token_to_kv_pool = self.swa_kv_pool
            q.tree_cache = self.tree
            swa = self.config.swa
            q.scheduler = SimpleNamespace(
                enable_hisparse=False, enable_decode_hicache=False,
                sliding_window_size=None if swa is None else swa.window,
                tp_worker=SimpleNamespace(is_hybrid_swa=swa is not None),
            )
            for rid, req, toks, pl, fill in zip(rids, reqs, token_ids, prompt_lens, fill_lens):
                pl = min(pl, fill)
                self._set_tokens(req, toks, pl, pending=1)
                if self.config.radix_cache:
                    match = q._match_prefix_and_lock(req)
                    prefix_indices, prefix_len = match.prefix_indices, match.l1_prefix_len
                    total = match.decode_prefix_len
                else:
                    prefix_indices, prefix_len, total = None, 0, 0
                self.last_lens[0].append(total)
                self.last_lens[1].append(fill)
                q._pre_alloc(req, prefix_indices, prefix_len, total)
                req.kv.cache_protected_len = total
                self._row_rid[req.kv.req_pool_idx] = rid
            for req in reqs:  # prepare_for_prebuilt / process_prebuilt
                req.extend_end = req.kv.kv_committed_len
                SG.common.checkpoint_kv_cache(req, self.tree)

        return self._guarded(run)

    def hold(self, rids, held_lens, token_ids, prompt_lens) -> sc.CallResult:
        """Decision 14: each turn ends and its session keeps the record (a finish that
        ``try_cache_finished_req`` takes); the rid becomes a fresh request of the session."""
        FIN = SG.schedule_batch
        self.alloc.free_group_begin()
        for rid, held, toks, pl in zip(rids, held_lens, token_ids, prompt_lens):
            req = self.reqs[rid]
            first = req.session is None
            if first:  # the trace opens the session here: the slot takes the first turn's record
                req.session = _Session(str(rid))
                self.tree.maybe_hand_to_session(req)
            pl_eff = min(pl, held)
            self._set_tokens(req, toks, pl_eff)
            req.finished_reason = FIN.FINISH_LENGTH(length=max(held - pl_eff, 0))
            req.finished_len = held - pl_eff
            SG.common.release_kv_cache(req, self.tree, checkpoint=True)
            assert not req.kv.holds_kv, f"rid={rid}: the session did not take the turn's record"
            nxt = SG.schedule_batch.Req(
                rid=str(rid), origin_input_text="", origin_input_ids=array("q"),
                sampling_params=SG.SamplingParams(max_new_tokens=1 << 30),
                extra_key=self.namespaces.get(rid),
            )
            nxt.session = req.session
            self.reqs[rid] = nxt
        self.alloc.free_group_end()
        return sc.CallResult("ok")

    def close_session(self, rids) -> sc.CallResult:
        """Decision 14: ``release_session`` of each rid's session; the request ends."""
        for rid in rids:
            self.tree.release_session(str(rid))
            del self.reqs[rid]
        return sc.CallResult("ok")

    def release(self, kind, rids, owned_lens, token_ids, prompt_lens, remaining) -> sc.CallResult:
        common = SG.common
        FIN = SG.schedule_batch
        if kind in ("finish", "abort"):
            self.alloc.free_group_begin()
        for rid, owned, toks, pl, rem in zip(rids, owned_lens, token_ids, prompt_lens, remaining):
            req = self.reqs[rid]
            if kind == "finish":
                pl_eff = min(pl, owned)
                self._set_tokens(req, toks, pl_eff)
                req.finished_reason = FIN.FINISH_LENGTH(length=max(owned - pl_eff, 0))
                req.finished_len = owned - pl_eff
                common.release_kv_cache(req, self.tree, checkpoint=True)
            elif kind == "abort":
                self._set_tokens(req, toks, pl)
                req.finished_reason = FIN.FINISH_ABORT()
                common.release_kv_cache(req, self.tree, checkpoint=False)
            else:
                self._set_tokens(req, toks, pl)
                FIN.release_req(
                    req=req, remaing_req_count=rem, req_to_token_pool=self.pool,
                    token_to_kv_pool_allocator=self.alloc, tree_cache=self.tree,
                    hisparse_coordinator=None,
                )
                req.output_ids = array("q")
                req.finished_reason = None
                req.finished_len = None
            self._stashed.pop(rid, None)
            if kind != "retract":
                del self.reqs[rid]
        if kind in ("finish", "abort"):
            self.alloc.free_group_end()
        return sc.CallResult("ok")

    # -- state -----------------------------------------------------------------------
    def dump(self, rids: Sequence[int], final: bool = True) -> dict[str, Any]:
        torch = SG.torch
        if final:
            self.publish()
        r2t = self.pool.req_to_token
        reqs = []
        for rid in rids:
            kv = self.reqs[rid].kv
            row = kv.req_pool_idx
            n = min(kv.kv_allocated_len, r2t.shape[1])
            reqs.append([rid, row, kv.kv_allocated_len, kv.kv_committed_len, kv.cache_protected_len,
                         sc.rle(r2t[row, :n].numpy())])
        alloc = self.alloc
        full = alloc if self.config.swa is None else alloc.full_attn_allocator
        if self.ps == 1:
            release = full.release_pages
        else:
            release = torch.cat(full.staged_pages) if full.staged_pages else torch.zeros(0, dtype=torch.int64)
        out = {
            "reqs": reqs,
            "free_pages": sc.rle(full.free_pages.numpy()),
            "release_pages": sc.rle(release.numpy()),
            "available": int(alloc.available_size()),
            "evictable": int(self.tree.evictable_size()),
            "protected": int(self.tree.protected_size()),
            "free_rows": sc.rle(self.pool.free_slots),
            "tree": self._tree_shape(),
        }
        if self.config.swa is not None:
            from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

            mapping = alloc.full_to_swa_index_mapping
            swa_reqs = []
            for rid, entry in zip(rids, reqs):
                kv = self.reqs[rid].kv
                slots = r2t[entry[1], : min(kv.kv_allocated_len, r2t.shape[1])].to(torch.int64)
                swa_reqs.append([rid, int(kv.get_evicted_seqlen(ComponentType.SWA)),
                                 sc.rle(mapping[slots].numpy())])
            out.update(swa_free_pages=sc.rle(alloc.swa_attn_allocator.free_pages.numpy()),
                       swa_available=int(alloc.swa_available_size()), swa_reqs=swa_reqs)
            if self.config.radix_cache:
                out.update(swa_evictable=int(self.tree.swa_evictable_size()),
                           swa_protected=int(self.tree.swa_protected_size()),
                           tree=self._swa_tree_shape(), swa_tree=self._swa_tree_sides())
        return out

    def _swa_nodes(self) -> list[tuple[Any, int]]:
        """Every node of the unified tree but the root, with its parent's first full slot."""
        out = []
        stack = [(child, -1) for child in self.tree.root_node.children.values()]
        while stack:
            node, parent = stack.pop()
            out.append((node, parent))
            first = int(node.component_data[0].value[0])
            stack.extend((child, first) for child in node.children.values())
        return out

    def _swa_tree_shape(self) -> list[list[int]]:
        """``scenario.tree_shape`` of the unified FULL + SWA tree (decision 9): FULL's
        value and lock per node."""
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        full = ComponentType.FULL
        return sc.tree_shape(
            (int(n.component_data[full].value[0]), parent, len(n.component_data[full].value),
             n.component_data[full].lock_ref, n.last_access_time)
            for n, parent in self._swa_nodes()
        )

    def _swa_tree_sides(self) -> list[list[int]]:
        """``scenario.swa_tree_sides`` of the unified tree: each node's SWA side."""
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        full, swa = ComponentType.FULL, ComponentType.SWA
        rows = []
        for n, _parent in self._swa_nodes():
            value = n.component_data[swa].value
            rows.append((int(n.component_data[full].value[0]), None if value is None else value.tolist(),
                         n.component_data[swa].lock_ref))
        return sc.swa_tree_sides(rows)

    def _tree_shape(self) -> list[list[int]] | None:
        """``scenario.tree_shape`` of the plain ``RadixCache`` (None for the unified tree,
        whose node boundaries differ by design)."""
        tree = self.tree
        if not isinstance(tree, SG.radix_cache.RadixCache):
            return None
        out = []
        stack = [(child, -1) for child in tree.root_node.children.values()]
        while stack:
            node, parent = stack.pop()
            first = int(node.value[0])
            out.append((first, parent, len(node.value), node.lock_ref, node.last_access_time))
            stack.extend((child, first) for child in node.children.values())
        return sc.tree_shape(out)


