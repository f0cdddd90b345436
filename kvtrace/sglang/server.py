"""Serve kvtrace's ``Allocator`` protocol from SGLang's real classes (runs in the driver).

``AllocatorServer`` is the SGLang side of the versions ``sglang`` and
``sglang:PYTHON``: kvtrace's replay engine (in the parent) makes its batched
calls (``extend``, ``decode``, ``spec_decode``, ``prealloc``, ``release``,
``end_step``, ``counters``, ``request_lens``, ``state_digest``, ...) and this
server answers each through one ``world.SGLangEngine`` call, with the emulation
decisions of ``world.py``. What the protocol leaves to the allocator is decided
as kvtrace's built-in allocator decides it (``allocator/manager.py``), since SGLang's
scheduler would decide it from the same facts:

* the prompt a checkpoint splits at is where the request's prefill first completed
  (its first ``prealloc`` fill, or the ``extend`` whose ``prefill_done`` is set), kept
  across a retraction and forgotten at finish / abort;
* ``remaining`` of a retraction (SGLang's ``release_req(remaing_req_count=...)``):
  after each retracted request, the requests still holding KV whose prefill is done;
* an allocation that does not fit is rolled back (decision 8) and reported as
  ``OutOfMemory`` naming the first request whose cumulative page need exceeds the
  free + evictable slots SGLang saw when it failed (``needed``: the batch's need;
  ``prealloc``: the request SGLang failed on and its own need; rows: the first new
  request without one) — SGLang itself names no request.

What it reads off SGLang's state (counters, free lists, the tree, the physical-state
digest for ``kvtrace diff --exact``) is ``readout.py``.

    python driver.py --serve      # requests on stdin, replies on stdout (wire.Channel)
"""

from __future__ import annotations

import copy
import traceback
from typing import Any

import numpy as np

from . import scenario as sc
from . import wire
from . import world
from .readout import IncrementalDigest, allocator_module, free_ids, full_value, pool_counters, side_ids, state_digest
from .readout import host_pool_counters, mamba_available, mamba_pool_counters, swa_pool_counters, tree_nodes

__all__ = ["AllocatorServer", "IncrementalDigest", "pool_counters", "serve", "state_digest"]


def _swa_spec(config: dict[str, Any]) -> sc.SwaSpec | None:
    """The scenario's SWA pool from kvtrace's ``AllocatorConfig.swa`` (a dict, or None):
    its window, its SWA pool in tokens (``SwaConfig.pool_tokens``: an explicit size or
    the ratio of the full pool, rounded down to a page), the eviction interval, the
    overlap scheduler's chunk and a draft's SWA window."""
    swa = config.get("swa")
    if swa is None:
        return None
    ps = int(config["page_size"])
    full = int(config["pool_tokens"]) // ps * ps
    size = swa.get("swa_pool_tokens")
    tokens = int(size) if size is not None else int(full * float(swa["swa_full_tokens_ratio"]))
    return sc.SwaSpec(
        window=int(swa["window"]), swa_pool_tokens=tokens // ps * ps,
        eviction_interval=int(swa.get("eviction_interval", 128)),
        overlap_chunked_prefill=int(swa.get("overlap_chunked_prefill", 0)),
        draft_window=int(swa.get("draft_window", 0)),
        release_prefill_swa=bool(swa.get("release_prefill_swa", False)),
    )  # fmt: skip


def _mamba_spec(config: dict[str, Any]) -> sc.MambaSpec | None:
    """The scenario's Mamba state pool from kvtrace's ``AllocatorConfig.mamba`` (a dict, or None)."""
    mamba = config.get("mamba")
    if mamba is None:
        return None
    strategy = mamba.get("strategy", "no_buffer")
    if strategy not in ("no_buffer", "extra_buffer") or mamba.get("overlap_schedule"):
        raise sc.ScenarioError(
            "a Mamba pool is driven on SGLang's side with no_buffer or extra_buffer and no overlap scheduler only"
        )
    return sc.MambaSpec(slots=int(mamba["slots"]), strategy=strategy)


def _hicache_spec(config: dict[str, Any]) -> sc.HiCacheSpec | None:
    """The scenario's host tier from kvtrace's ``AllocatorConfig.hicache`` (a dict, or None;
    world decision 17)."""
    tier = config.get("hicache")
    if tier is None:
        return None
    if config.get("swa") is not None or config.get("mamba") is not None or config.get("spec") is not None:
        raise sc.ScenarioError("HiCache's host tier is driven on SGLang's side for full-attention pools only")
    size = tier.get("host_pool_tokens")
    return sc.HiCacheSpec(host_ratio=float(tier.get("host_ratio", 2.0)),
                          host_pool_tokens=None if size is None else int(size),
                          write_policy=str(tier.get("write_policy", "write_through")))


def _ints(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i8").astype(np.int64)


class AllocatorServer:
    """One SGLang world answering the ``Allocator`` protocol (see the module doc).

    Args:
        config: the fields of kvtrace's ``AllocatorConfig`` (a dict; ``spec`` a dict or None).

    Raises:
        sc.ScenarioError: a configuration the driver does not run (HiSparse, a
            speculative algorithm it does not drive, a CUDA device).
    """

    def __init__(self, config: dict[str, Any]) -> None:
        if config.get("hisparse"):
            raise sc.ScenarioError("HiSparse is not driven on SGLang's side (its pools need a GPU)")
        if config.get("device", "cpu") != "cpu":
            raise sc.ScenarioError("SGLang's allocator is driven on the CPU only (--device cpu)")
        world.load_sglang()
        spec = config.get("spec")
        self.config = sc.ScenarioConfig(
            pool_tokens=int(config["pool_tokens"]), page_size=int(config["page_size"]),
            max_running=int(config["max_running"]), max_context_len=int(config["max_context_len"]),
            need_sort=bool(config.get("need_sort", False)), radix_cache=bool(config.get("radix_cache", True)),
            extra_rows=int(config.get("extra_rows", 0)),
            spec=None if spec is None else sc.SpecSpec(
                spec["algorithm"], int(spec["num_steps"]), int(spec["topk"]), int(spec["num_draft_tokens"])),
            swa=_swa_spec(config),
            eviction_policy=str(config.get("eviction_policy", "lru")),
            mamba=_mamba_spec(config),
            hicache=_hicache_spec(config),
        )
        self.eng = world.SGLangEngine(self.config)
        self.ps = self.config.page_size
        self.pages = allocator_module("pages")
        self.digest: IncrementalDigest | None = None  # from the first state_digest() on
        self.prompt: dict[int, int] = {}  # rid -> where its prefill first completed
        self.prefilling: set[int] = set()  # rids holding KV, prefill not complete

    # ------------------------------------------------------------------ helpers
    def _req_kv(self, rid: int) -> Any | None:
        return self.eng.kv_of(rid)

    def _held(self, rid: int) -> int:
        kv = self._req_kv(rid)
        return int(kv.kv_allocated_len) if kv is not None else 0

    def _oom(self, op: str, rids: list[int], held: list[int], target: list[int], available: int) -> tuple:
        """``("oom", ...)`` for a batch whose page need did not fit (see the module doc)."""
        need = self.pages.new_page_tokens(np.asarray(held, np.int64), np.asarray(target, np.int64), self.ps)
        budget = self.eng.oom_budget
        over = np.flatnonzero(np.cumsum(need) > budget)
        i = int(over[0]) if over.shape[0] else 0
        return ("oom", op, int(rids[i]), int(need.sum()), available, budget - available)

    def _mamba_oom(self, rids: list[int], new: list[int], available: int) -> tuple:
        """``("oom", ...)`` of pool "mamba": a state slot for each new request (no_buffer:
        one, none for a continuing chunk, which keeps its own), naming the first new
        request past the free slots (the built-in allocator's ``_mamba_unfit``)."""
        first = rids[new[available]] if available < len(new) else rids[new[0]]
        return ("oom", "extend", int(first), len(new), available, 0, "mamba")

    def _rows_oom(self, op: str, rids: list[int], new: list[int]) -> tuple:
        free_rows = int(self.eng.pool.available_size())
        first = new[free_rows] if free_rows < len(new) else new[-1]
        return ("oom", op, int(rids[first]), len(new), free_rows, 0)

    # ------------------------------------------------------------------ allocation calls
    def extend(self, rids_b: bytes, seq_b: bytes, token_ids: list[bytes], done_b: bytes) -> tuple:
        rids = _ints(rids_b).tolist()
        seq_lens = _ints(seq_b).tolist()
        done = [bool(x) for x in done_b]
        held = [self._held(r) for r in rids]
        toks = [_ints(t) for t in token_ids]
        plens = [self.prompt.get(r, s if d else s + 1) for r, s, d in zip(rids, seq_lens, done)]
        available = int(self.eng.alloc.available_size())
        mamba_free = mamba_available(self.eng)
        before = world.evicted_tokens()
        res = self.eng.extend(rids, seq_lens, toks, plens, done)
        self._rewritten(rids)  # stashes now, the prompt publish at the end of the step
        if res.outcome != "ok":
            new = [i for i, h in enumerate(held) if h == 0]
            if "alloc_req_slots" in res.detail:
                return self._rows_oom("extend_rows", rids, new)
            if "mamba" in res.detail:
                return self._mamba_oom(rids, new, mamba_free)
            matched = self.eng.last_lens[0]
            prefix = [h if h else int(m) for h, m in zip(held, matched)]
            return self._oom("extend", rids, prefix, seq_lens, available)
        prefix = [h if h else int(self.eng.reqs[r].prefix_len) for r, h in zip(rids, held)]
        for r, s, d in zip(rids, seq_lens, done):
            if d:
                self.prompt.setdefault(r, s)
                self.prefilling.discard(r)
            else:
                self.prefilling.add(r)
        num = sum(s - p for s, p in zip(seq_lens, prefix))
        return ("ok", num, world.evicted_tokens() - before, wire.pack_ints(prefix), list(res.row_overflow))

    def decode(self, rids_b: bytes) -> tuple:
        rids = _ints(rids_b).tolist()
        committed = [int(self.eng.reqs[r].kv.kv_committed_len) for r in rids]
        available = int(self.eng.alloc.available_size())
        before = world.evicted_tokens()
        res = self.eng.decode(rids)
        if res.outcome != "ok":
            return self._oom("decode", rids, committed, [c + 1 for c in committed], available)
        return ("ok", len(rids), world.evicted_tokens() - before, None, list(res.row_overflow))

    def spec_decode(self, rids_b: bytes, accepted_b: bytes) -> tuple:
        rids = _ints(rids_b).tolist()
        accepted = _ints(accepted_b).tolist()
        available = int(self.eng.alloc.available_size())
        before = world.evicted_tokens()
        res = self.eng.spec(rids, accepted)
        cur, nxt = self.eng.last_lens
        if res.outcome != "ok":
            return self._oom("spec", rids, cur, nxt, available)
        num = sum(int(n) - int(c) for c, n in zip(cur, nxt))
        return ("ok", num, world.evicted_tokens() - before, None, list(res.row_overflow))

    def prealloc(self, rids_b: bytes, fills_b: bytes, token_ids: list[bytes]) -> tuple:
        rids = _ints(rids_b).tolist()
        fills = _ints(fills_b).tolist()
        toks = [_ints(t) for t in token_ids]
        plens = [self.prompt.get(r, f) for r, f in zip(rids, fills)]
        available = int(self.eng.alloc.available_size())
        before = world.evicted_tokens()
        res = self.eng.prealloc(rids, fills, toks, plens)
        self._rewritten(rids)
        if res.outcome != "ok":
            if "req_pool_indices" in res.detail:
                return self._rows_oom("prealloc_rows", rids, list(range(len(rids))))
            prefix, fill = self.eng.last_lens
            k = len(prefix) - 1
            need = int(self.pages.ceil_align(fill[k], self.ps)) - int(prefix[k])
            evictable = self.eng.oom_budget - available
            return ("oom", "prealloc", int(rids[k]), need, available, evictable)
        for r, f in zip(rids, fills):
            self.prompt.setdefault(r, f)
            self.prefilling.discard(r)
        prefix = [int(p) for p in self.eng.last_lens[0]]
        num = sum(f - p for f, p in zip(fills, prefix))
        return ("ok", num, world.evicted_tokens() - before, wire.pack_ints(prefix), [])

    def release(self, rids_b: bytes, owned_b: bytes, token_ids: list[bytes] | None, kind: str) -> tuple:
        rids = _ints(rids_b).tolist()
        owned = _ints(owned_b).tolist()
        kvs = [self._req_kv(r) for r in rids]
        missing = [r for r, kv in zip(rids, kvs) if kv is None]
        if missing:
            raise ValueError(f"release: request rid={missing[0]} holds no KV")
        if kind != "abort" and (owned_ids := self.eng.session_records()):
            for r, kv in zip(rids, kvs):
                if id(kv) in owned_ids:  # SGLang keeps it in the slot, the built-in releases it
                    raise sc.ScenarioError(
                        f"{kind}: request rid={r} is a streaming session's turn (hold or abort it; "
                        f"a {kind} of it is not driven)"
                    )
        owned = [min(o, int(kv.kv_committed_len)) for o, kv in zip(owned, kvs)]
        overalloc = [
            max(int(kv.kv_allocated_len) - max(int(self.pages.ceil_align(o, self.ps)), int(kv.cache_protected_len)), 0)
            for o, kv in zip(owned, kvs)
        ]
        if token_ids is not None:
            toks = [_ints(t) for t in token_ids]
        else:
            toks = [self._tokens_of(r) for r in rids]
        plens = [self.prompt.get(r, o) for r, o in zip(rids, owned)]
        remaining = []
        if kind == "retract":
            pool = self.eng.pool
            in_use = int(pool.size) - int(pool.available_size())
            prefilling = set(self.prefilling)
            for r in rids:
                in_use -= 1
                prefilling.discard(r)
                remaining.append(in_use - len(prefilling))
        else:
            remaining = [0] * len(rids)
        available = int(self.eng.alloc.available_size())
        sizes = int(self.eng.tree.evictable_size()) + int(self.eng.tree.protected_size())
        before = world.evicted_tokens()
        self.eng.release(kind, rids, owned, toks, plens, remaining)
        evicted = world.evicted_tokens() - before
        for r in rids:
            self.prefilling.discard(r)
            if kind != "retract":
                self.prompt.pop(r, None)
        freed = int(self.eng.alloc.available_size()) - available - evicted
        cached = max(int(self.eng.tree.evictable_size()) + int(self.eng.tree.protected_size()) - sizes + evicted, 0)
        return (freed, cached, wire.pack_ints(overalloc), evicted)

    def enable_sessions(self) -> None:
        """Rebuild this (fresh) world for streaming sessions (world decision 15: the
        unified tree, which owns SGLang's session slots).

        Raises:
            sc.ScenarioError: the world already ran a step, or its pools are not full
                attention only (the built-in allocator models sessions there only).
        """
        if self.eng.reqs or self.digest is not None or int(self.eng.tree.evictable_size()):
            raise sc.ScenarioError("streaming sessions are switched on before the first step")
        if self.config.swa is not None or self.config.mamba is not None:
            raise sc.ScenarioError("streaming sessions are driven for full-attention pools only")
        self.eng.close()
        self.eng = world.SGLangEngine(self.config, sessions=True)

    def hold(self, rids_b: bytes, held_b: bytes) -> tuple:
        """Each turn ends; its session keeps the KV of its first ``held`` tokens
        (clipped to ``kv_committed_len``, at least the tree's prefix), as the built-in
        allocator's ``hold``. Returns ``ReleaseResult``'s fields."""
        rids = _ints(rids_b).tolist()
        kvs = [self._req_kv(r) for r in rids]
        for r, kv in zip(rids, kvs):
            if kv is None:
                raise ValueError(f"hold: request rid={r} holds no KV")
            if self.eng.session_kv(r) is kv and self.eng.reqs[r].kv is not kv:
                raise ValueError(f"hold: request rid={r} is already held by its session")
        held = [max(min(h, int(kv.kv_committed_len)), int(kv.cache_protected_len))
                for h, kv in zip(_ints(held_b).tolist(), kvs)]
        overalloc = [max(int(kv.kv_allocated_len) - int(self.pages.ceil_align(h, self.ps)), 0)
                     for h, kv in zip(held, kvs)]
        toks = [self._tokens_of(r) for r in rids]
        plens = [self.prompt.get(r, h) for r, h in zip(rids, held)]
        available = int(self.eng.alloc.available_size())
        self.eng.hold(rids, held, toks, plens)
        for r in rids:  # the next turn's prefill sets its own prompt
            self.prompt.pop(r, None)
            self.prefilling.discard(r)
        self._rewritten(rids)
        freed = int(self.eng.alloc.available_size()) - available
        return (freed, 0, wire.pack_ints(overalloc), 0)

    def close_session(self, rids_b: bytes) -> tuple:
        """Release the KV each request's session holds; the request ends. Returns
        ``ReleaseResult``'s fields."""
        rids = _ints(rids_b).tolist()
        for r in rids:
            req = self.eng.reqs.get(r)
            if self.eng.session_kv(r) is None or (req is not None and req.kv.holds_kv):
                raise ValueError(f"close: request rid={r} is not held by a session")
        available = int(self.eng.alloc.available_size())
        self.eng.close_session(rids)
        for r in rids:
            self.prompt.pop(r, None)
        freed = int(self.eng.alloc.available_size()) - available
        return (freed, 0, wire.pack_ints([0] * len(rids)), 0)

    def _tokens_of(self, rid: int) -> np.ndarray:
        req = self.eng.reqs[rid]
        return np.asarray(list(req.origin_input_ids) + list(req.output_ids), dtype=np.int64)

    def end_step(self) -> None:
        self.eng.end_step()

    # ------------------------------------------------------------------ reads
    def counters(self) -> tuple[int, ...]:
        """``PoolCounters`` fields, in order."""
        self.eng.publish()
        return pool_counters(self.eng)

    def pool_counters(self) -> dict[str, tuple[int, ...]]:
        """Each KV pool's ``PoolCounters`` fields: the full pool's, and a hybrid SWA
        model's SWA pool's (``swa_pool_counters``), or a hybrid linear-attention model's
        Mamba pool's (``mamba_pool_counters``), or HiCache's host pool
        (``host_pool_counters``)."""
        self.eng.publish()
        full = pool_counters(self.eng)
        if self.config.hicache is not None:
            return {"full": full, "host": host_pool_counters(self.eng, full)}
        if self.config.mamba is not None:
            return {"full": full, "mamba": mamba_pool_counters(self.eng, full)}
        if self.config.swa is None:
            return {"full": full}
        return {"full": full, "swa": swa_pool_counters(self.eng, full)}

    def request_lens(self, rids_b: bytes) -> tuple[bytes, bytes, bytes]:
        self.eng.publish()
        out: tuple[list[int], list[int], list[int]] = ([], [], [])
        for rid in _ints(rids_b).tolist():
            kv = self._req_kv(rid)
            values = (0, 0, 0) if kv is None else (kv.kv_allocated_len, kv.kv_committed_len, kv.cache_protected_len)
            for column, value in zip(out, values):
                column.append(int(value))
        return tuple(wire.pack_ints(c) for c in out)  # type: ignore[return-value]

    def holds_kv(self, rids_b: bytes) -> bytes:
        return bytes(self._req_kv(r) is not None for r in _ints(rids_b).tolist())

    def row_slots(self, rid: int) -> bytes:
        self.eng.publish()
        kv = self._req_kv(rid)
        if kv is None:
            return b""
        return wire.pack_ints(self.eng.pool.req_to_token[kv.req_pool_idx, : kv.kv_allocated_len].numpy())

    def evict(self, num_tokens: int) -> int:
        self.eng.publish()
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        self.eng.hicache_poll()
        before = world.evicted_tokens()
        self.eng.tree.evict(EvictParams(num_tokens=int(num_tokens)))
        return world.evicted_tokens() - before

    def set_namespaces(self, pairs: list[list[Any]]) -> None:
        """Requests' cache namespaces, ``[rid, name]`` pairs: each becomes the ``extra_key``
        of the request's ``Req`` (its radix key's namespace), sent before its first call."""
        for rid, name in pairs:
            self.eng.namespaces[int(rid)] = str(name)

    def match_prefix(self, token_ids: bytes, namespace: str | None = None) -> int:
        """SGLang's match of a new request with these fill ids (in ``namespace``), on a
        copy of the tree (a query must not touch access times or split nodes)."""
        self.eng.publish()
        toks = _ints(token_ids)
        if toks.shape[0] < 2 or not self.config.radix_cache:
            return 0
        tree = copy.deepcopy(self.eng.tree, {id(self.eng.pool.req_to_token): self.eng.pool.req_to_token})
        probe = world.SG.schedule_batch.Req(
            rid="kvtrace-probe", origin_input_text="", origin_input_ids=list(toks.tolist()),
            sampling_params=world.SG.SamplingParams(max_new_tokens=1), extra_key=namespace,
        )
        fill = probe.origin_input_ids
        world.SG.common.match_kv_cache(probe, tree, fill, max_prefix_len=len(fill) - 1)
        return int(probe.prefix_len)

    def check_integrity(self) -> list[dict[str, Any]]:
        """Conservation and single ownership of SGLang's pool (page ids when paged):
        every page is exactly one of free, cached in the tree, or held by one request
        (``[cache_protected_len, ceil_align(kv_allocated_len))`` of its row). A queued
        prompt publish stays queued (a check must not reorder the step)."""
        out: list[dict[str, Any]] = []
        counters = pool_counters(self.eng)
        pool_tokens, rest = counters[0], sum(counters[1:6]) + counters[8]
        if rest != pool_tokens:
            out.append({"check": "conservation", "rid": None, "detail": (
                f"available {counters[1]} + evictable {counters[2]} + protected {counters[3]} + committed "
                f"{counters[4]} + overallocated {counters[5]} + session_held {counters[8]} = {rest}, "
                f"not the pool's {pool_tokens}")})
        ps = self.ps
        parts = [free_ids(self.eng), side_ids(self.eng)]
        holders = ["free"] * parts[0].shape[0] + ["free (release list)"] * parts[1].shape[0]
        for node in tree_nodes(self.eng):
            value = full_value(node)
            if value is None:  # a node on the host tier only (decision 17) holds no device page
                continue
            value = value.numpy()
            ids = value[::ps] // ps if ps > 1 else value
            parts.append(np.asarray(ids, np.int64))
            holders += ["the radix tree"] * len(ids)
        table = self.eng.pool.req_to_token
        for rid, kv in self.eng.live_kvs():
            lo, hi = int(kv.cache_protected_len), int(kv.kv_allocated_len)
            slots = table[kv.req_pool_idx, lo:hi].numpy().astype(np.int64)
            ids = slots[::ps] // ps if ps > 1 else slots
            parts.append(ids)
            holders += [f"request {rid}"] * len(ids)
        ids = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        counts = np.bincount(ids, minlength=pool_tokens // ps + 1)
        twice = np.flatnonzero(counts[1:] > 1) + 1
        if twice.shape[0]:
            page = int(twice[0])
            who = sorted({holders[i] for i in np.flatnonzero(ids == page).tolist()})
            out.append({"check": "ownership", "rid": None, "detail": (
                f"{twice.shape[0]} pages are held more than once, e.g. page {page} by {', '.join(who)}")})
        lost = np.flatnonzero(counts[1:] == 0) + 1
        if lost.shape[0]:
            out.append({"check": "ownership", "rid": None, "detail": (
                f"{lost.shape[0]} pages are held by nobody (leaked), e.g. {lost[:5].tolist()}")})
        return out

    def state_digest(self) -> str:
        """kvtrace's digest (``allocator.check.digest.compose_digest``) of SGLang's state."""
        self.eng.publish()
        if self.digest is None:
            self.digest = IncrementalDigest(self.eng)
        return self.digest.value()

    # ------------------------------------------------------------------ KV events
    def enable_kv_events(self) -> bool:
        """Rebuild this (fresh) world with SGLang's own KV-event recorder on
        (``CacheInitParams.enable_kv_cache_events``), as ``--kv-events-config`` does.

        Returns:
            Whether the tree records events (a disabled radix cache publishes none).

        Raises:
            sc.ScenarioError: the world already ran a step, or its tree is SWA's unified one.
        """
        if self.eng.reqs or self.digest is not None or int(self.eng.tree.evictable_size()):
            raise sc.ScenarioError("KV events are switched on before the first step")
        if not self.config.radix_cache:  # SGLang's recorder stays off without a tree
            return False
        if self.config.swa is not None:
            raise sc.ScenarioError("KV events of SGLang's SWA (unified) radix tree are not driven")
        self.eng.close()
        self.eng = world.SGLangEngine(self.config, kv_events=True)
        return bool(self.eng.tree.kv_events.enabled)

    def take_kv_events(self) -> bytes:
        """The events SGLang's recorder queued since the last take (after this step's prompt
        publish), as ``msgspec.msgpack`` of the list of SGLang's own event objects."""
        import msgspec

        self.eng.publish()
        return msgspec.msgpack.encode(self.eng.tree.take_events())

    def _rewritten(self, rids: list[int]) -> None:
        if self.digest is not None:
            self.digest.rewritten.update(rids)


def _dispatch(server: AllocatorServer | None, call: wire.Call) -> Any:
    if call.method == "init":
        raise ValueError("init: not inside a batch")
    if server is None:
        raise ValueError(f"{call.method}: no init first")
    return getattr(server, call.method)(*call.args)


def serve(channel: wire.Channel) -> int:
    """Answer requests (``wire.Call`` / ``wire.Batch``) until the pipe closes. The first
    is ``Call("init", (config,))``; its value is ``{"sglang": VERSION, "row_width": N}``.
    A ``Batch`` makes several calls in one round trip (its value: theirs, in order).
    A failing request, or one that is not of the protocol, is answered
    ``wire.Error(text, traceback)``; the server goes on.

    Returns:
        The exit code (0 when the parent closed the pipe).
    """
    server: AllocatorServer | None = None
    while True:
        try:
            request = channel.recv_request()
        except wire.WireClosed:
            return 0
        except wire.WireError as exc:  # the frame was read whole: answer it and go on
            reply: wire.Reply = wire.Error(f"WireError: {exc}", "")
        else:
            try:
                if isinstance(request, wire.Batch):
                    value: Any = [_dispatch(server, c) for c in request.calls]
                elif request.method == "init":  # a new world (the driver may serve allocator after allocator)
                    if server is not None:
                        server.eng.close()
                        server = None
                    server = AllocatorServer(*request.args)
                    value = {"sglang": world.SG.version, "row_width": server.eng.row_width}
                else:
                    value = _dispatch(server, request)
                reply = wire.Ok(value)
            except Exception as exc:  # the parent decides what to print
                reply = wire.Error(f"{type(exc).__name__}: {exc}", traceback.format_exc(limit=12))
        try:
            channel.send(reply)
        except wire.WireClosed:  # the parent exited without waiting for the reply
            return 0
