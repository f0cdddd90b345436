"""Record a live SGLang's allocation and release calls into a kvtrace trace.

Enabled in an SGLang process by ``KVTRACE_SGLANG_RECORD=OUT.kvtrace`` and ``enable()``
(``python -m kvtrace.sglang.launch`` does both, around SGLang's server entry point).
An import hook wraps, as each SGLang module finishes executing (so every later
``from ... import`` takes the wrapper; no file on disk is touched):

====================================================  ==========================
``mem_cache.allocation.alloc_for_extend(batch)``      ``extend`` rows
``mem_cache.allocation.alloc_for_decode(batch, n)``   ``decode`` rows
``mem_cache.allocation.alloc_for_spec_decode(...)``   ``spec`` rows (accepted: below)
``disaggregation.decode.DecodePreallocQueue._pre_alloc``  ``prealloc`` rows
``mem_cache.common.release_kv_cache(req, tree, ...)`` ``finish`` (checkpoint) / ``abort``
``managers.schedule_batch.release_req(req=...)``      ``retract``
``mem_cache.common.checkpoint_kv_cache(req, tree)``   the prompt publish: ends a step
``managers.scheduler.run_scheduler_process``          enables recording in the scheduler
                                                      process it starts
====================================================  ==========================

Steps. kvtrace's step is the op order of ``traces.schema.OP_ORDER`` (releases, then
prealloc, extend, decode, spec, then the prompt publish of completed prefills):
a call opens a new step when it would break that order (a kind ranked before one
already in the step, a second batched allocation of the same kind, a request
already in the step) or when the step's prompts were published. This is SGLang's
own sequence: result processing (releases), scheduling (retraction, allocation),
result processing of a prefill (the publish).

Token ids and accepted counts arrive after the allocation: a decode's token is the
one sampled by the step before, a speculative step's accepted count is committed by
its verify. Each step is therefore written ``LAG_STEPS`` steps after it closes, its
ids read then from ``origin_input_ids + output_ids`` (None where still unknown: the
replay uses unique ids there) and each accepted count from the request's
``kv_committed_len`` at its next reserve or release. Every written step is flushed
(``Recorder(steps_per_batch=1)``): a process killed outright leaves a trace holding
every step written so far, marked interrupted. Recording never breaks SGLang: an
error inside it is printed once and recording stops.

Cost: per call, a few attribute reads and Python list appends per request; per
step, one Arrow record batch written and flushed (``bench/allocator.py`` measures
it).
"""

from __future__ import annotations

import atexit
import importlib
import json
import importlib.abc
import os
import sys
import threading
import time
from collections import deque
from typing import Any

import numpy as np

__all__ = ["ENV_VAR", "LAG_STEPS", "LiveRecorder", "active", "enable", "run_scheduler_process"]

ENV_VAR = "KVTRACE_SGLANG_RECORD"
LAG_STEPS = 2
_RANK = {"finish": 0, "abort": 0, "retract": 1, "prealloc": 2, "extend": 3, "decode": 4, "spec": 4}
_BATCHED = frozenset({"extend", "decode", "spec"})
_TARGETS: dict[str, tuple[str, ...]] = {
    "sglang.srt.mem_cache.allocation": ("alloc_for_extend", "alloc_for_decode", "alloc_for_spec_decode"),
    "sglang.srt.mem_cache.common": ("release_kv_cache", "checkpoint_kv_cache"),
    "sglang.srt.managers.schedule_batch": ("release_req",),
    "sglang.srt.disaggregation.decode": ("DecodePreallocQueue._pre_alloc",),
    "sglang.srt.managers.scheduler": ("run_scheduler_process",),
}


class _Step:
    """One step being recorded: its rows by kind, what decides where it ends."""

    __slots__ = ("time_s", "rank", "kinds", "rids", "prefilled", "published", "rows")

    def __init__(self, time_s: float) -> None:
        self.time_s = time_s
        self.rank = -1
        self.kinds: set[str] = set()
        self.rids: set[int] = set()
        self.prefilled: set[int] = set()  # extends of this step that completed their prefill
        self.published = False
        self.rows: dict[str, list[list[Any]]] = {}


class LiveRecorder:
    """Turns SGLang's calls into trace steps and writes them (see the module doc).

    Args:
        path: the trace to write (``{pid}`` is replaced by the process id).
    """

    def __init__(self, path: str) -> None:
        self.path = path.replace("{pid}", str(os.getpid()))
        self.recorder: Any = None  # kvtrace.record.recorder.Recorder, made at the first call
        self.steps_closed = 0  # steps closed so far (the open one is number steps_closed)
        self.failed: str | None = None
        self.ids: dict[str, int] = {}  # SGLang's request id -> the trace's dense id (first call first)
        self._new_ids: list[tuple[str, int]] = []  # not yet in the rid map file
        self._t0 = time.monotonic()
        self._step: _Step | None = None
        self._closed: deque[_Step] = deque()
        self._lens: dict[int, int] = {}  # dense id -> length as recorded
        self._spec_open: dict[int, tuple[list[Any], int]] = {}  # dense id -> (spec row, committed at reserve)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ set-up
    def _start(self, tree_cache: Any, req_to_token_pool: Any, allocator: Any) -> None:
        from kvtrace.record.recorder import Recorder
        from traces.metadata import SpecSettings, TraceConfig, TraceMeta, TraceSource

        from sglang.srt.mem_cache.allocation_sizing import get_req_to_token_extra_context_len

        spec = None
        try:
            from sglang.srt.runtime_context import get_spec

            bag = get_spec()
            algo = bag.speculative_algorithm
            if algo:
                name = str(getattr(algo, "name", algo)).lower()
                spec = SpecSettings(name, int(bag.speculative_num_steps or 1), int(bag.speculative_eagle_topk or 1),
                                    int(bag.speculative_num_draft_tokens or 1))
        except Exception:  # an SGLang without the runtime context: no speculative settings known
            spec = None
        import importlib.metadata

        width = int(req_to_token_pool.req_to_token.shape[1])
        config = TraceConfig(
            page_size=int(allocator.page_size), pool_tokens=int(allocator.size),
            max_running=int(req_to_token_pool.size), max_context_len=width - int(get_req_to_token_extra_context_len()),
            spec=spec, pd_decode=bool(getattr(allocator, "need_sort", False)),
            radix_cache=not bool(getattr(tree_cache, "disable", False)),
        )
        version = importlib.metadata.version("sglang")
        meta = TraceMeta(config=config, source=TraceSource(engine=f"sglang {version}", workload="live"))
        self.recorder = Recorder(self.path, meta, steps_per_batch=1, dense_ids=True)
        self._rid_map = open(self.path + ".rids.jsonl", "w", encoding="utf-8")

    def dense_id(self, rid: Any) -> int:
        """The trace's id of an SGLang request id, given in the order requests first
        reach an allocation call (the order the trace writes them)."""
        key = str(rid)
        dense = self.ids.get(key)
        if dense is None:
            dense = self.ids[key] = len(self.ids)
            self._new_ids.append((key, dense))
        return dense

    # ------------------------------------------------------------------ steps
    def _open(self, kind: str, rids: list[int]) -> _Step:
        step = self._step
        rank = _RANK[kind]
        if (
            step is None or step.published or rank < step.rank or (kind in _BATCHED and kind in step.kinds)
            or any(r in step.rids for r in rids)
        ):
            if step is not None:
                self._close_step()
            step = self._step = _Step(time.monotonic() - self._t0)
        step.rank = max(step.rank, rank)
        step.kinds.add(kind)
        step.rids.update(rids)
        return step

    def _close_step(self) -> None:
        assert self._step is not None
        self._closed.append(self._step)
        self._step = None
        self.steps_closed += 1
        while len(self._closed) > LAG_STEPS:
            self._write(self._closed.popleft())

    def _write(self, step: _Step) -> None:
        rec = self.recorder
        rec.begin_step(step.time_s)
        rows = step.rows
        for kind in ("finish", "abort"):
            if kind in rows:
                getattr(rec, kind)([r[0] for r in rows[kind]], [r[1] for r in rows[kind]]) if kind == "finish" else \
                    rec.abort([r[0] for r in rows[kind]])
        if "retract" in rows:
            rec.retract([r[0] for r in rows["retract"]])
        for kind in ("prealloc", "extend"):
            if kind in rows:
                part = rows[kind]
                getattr(rec, kind)(
                    [r[0] for r in part], [r[1] for r in part], prefix_lens=[r[2] for r in part],
                    prompt_lens=[r[3] for r in part], token_ids=[r[4] for r in part],
                    namespaces=[r[5] for r in part],
                )
        if "decode" in rows:
            part = rows["decode"]
            rec.decode([r[0] for r in part], [r[1] for r in part], token_ids=[_ids(r[3], r[2], r[2] + 1) for r in part])
        if "spec" in rows:
            part = rows["spec"]
            accepted = [self._accepted(r) for r in part]
            rec.spec([r[0] for r in part], accepted, [r[4] for r in part],
                     token_ids=[_ids(r[3], r[2], r[2] + a) for r, a in zip(part, accepted)])
        rec.end_step()
        if self._new_ids:
            for key, dense in self._new_ids:
                self._rid_map.write(json.dumps({"id": key, "rid": dense}) + "\n")
            self._new_ids.clear()
            self._rid_map.flush()

    def _accepted(self, row: list[Any]) -> int:
        if row[5] is None:  # not resolved by a later reserve or release: read it now
            req = row[3]
            self._resolve_spec(row[0], int(req.kv.kv_committed_len) if req.kv.holds_kv else row[2])
        return int(row[5])

    def _resolve_spec(self, rid: int, committed: int) -> None:
        open_row = self._spec_open.pop(rid, None)
        if open_row is not None and open_row[0][5] is None:
            open_row[0][5] = max(committed - open_row[1], 0)

    # ------------------------------------------------------------------ the calls
    def extend(self, batch: Any) -> None:
        reqs = batch.reqs
        if self.recorder is None:
            self._start(batch.tree_cache, batch.req_to_token_pool, batch.token_to_kv_pool_allocator)
        rids = [self.dense_id(r.rid) for r in reqs]
        step = self._open("extend", rids)
        part = step.rows.setdefault("extend", [])
        for rid, req, prefix, extend in zip(rids, reqs, batch.prefix_lens, batch.extend_lens):
            seq = int(prefix) + int(extend)
            start = self._lens.get(rid, 0)
            prompt = len(req.origin_input_ids)
            ids = (list(req.origin_input_ids) + list(req.output_ids))[start:seq]
            part.append([rid, seq, int(prefix), prompt, np.asarray(ids, np.int64) if len(ids) == seq - start else None,
                         _namespace(req)])
            self._lens[rid] = seq
            if seq >= prompt:
                step.prefilled.add(rid)

    def decode(self, batch: Any) -> None:
        reqs = batch.reqs
        rids = [self.dense_id(r.rid) for r in reqs]
        step = self._open("decode", rids)
        part = step.rows.setdefault("decode", [])
        for rid, req in zip(rids, reqs):
            pos = self._lens.get(rid, 0)
            part.append([rid, pos + 1, pos, req])
            self._lens[rid] = pos + 1

    def spec(self, reqs: list[Any], draft: int) -> None:
        rids = [self.dense_id(r.rid) for r in reqs]
        step = self._open("spec", rids)
        part = step.rows.setdefault("spec", [])
        for rid, req in zip(rids, reqs):
            committed = int(req.kv.kv_committed_len)
            self._resolve_spec(rid, committed)
            self._lens[rid] = committed
            row = [rid, None, committed, req, draft, None]
            part.append(row)
            self._spec_open[rid] = (row, committed)

    def prealloc(self, queue: Any, req: Any, prefix: int) -> None:
        if self.recorder is None:
            self._start(queue.tree_cache, queue.req_to_token_pool, queue.token_to_kv_pool_allocator)
        rid = self.dense_id(req.rid)
        step = self._open("prealloc", [rid])
        fill = int(req.kv.kv_allocated_len)
        ids = (list(req.origin_input_ids) + list(req.output_ids))[:fill]
        step.rows.setdefault("prealloc", []).append(
            [rid, fill, int(prefix), len(req.origin_input_ids), np.asarray(ids, np.int64) if len(ids) == fill else None,
             _namespace(req)])
        self._lens[rid] = fill

    def release(self, kind: str, req: Any, owned: int, committed: int) -> None:
        """``committed``: the request's ``kv_committed_len`` before the release (which
        clears it) resolves its last speculative step."""
        rid = self.ids.get(str(req.rid), -1)
        if rid not in self._lens:
            return  # admitted before recording started
        self._resolve_spec(rid, committed)
        step = self._open(kind, [rid])
        step.rows.setdefault(kind, []).append([rid, owned])
        del self._lens[rid]

    def published(self, req: Any) -> None:
        step = self._step
        if step is not None and self.ids.get(str(req.rid), -1) in step.prefilled:
            step.published = True

    def close(self) -> None:
        """Write every step (the open one included) and close the trace."""
        if self.recorder is None:
            return
        if self._step is not None:
            self._close_step()
        while self._closed:
            self._write(self._closed.popleft())
        self.recorder.close()
        self.recorder = None
        self._rid_map.close()


def _namespace(req: Any) -> str | None:
    """A request's cache namespace: what SGLang keys its radix matches by beside the
    tokens, ``extra_key`` (the LoRA id already appended) and ``cache_salt``; one string
    that two requests share exactly when they share both (None: neither is set)."""
    from traces.namespaces import sglang_namespace  # (kvtrace's, imported only when recording)

    return sglang_namespace(getattr(req, "extra_key", None), None, getattr(req, "cache_salt", None))


def _ids(req: Any, lo: int, hi: int) -> np.ndarray | None:
    """Token ids of positions ``[lo, hi)`` of a request, None where not known yet."""
    n_origin = len(req.origin_input_ids)
    if hi > n_origin + len(req.output_ids):
        return None
    ids = [req.origin_input_ids[p] if p < n_origin else req.output_ids[p - n_origin] for p in range(lo, hi)]
    return np.asarray(ids, np.int64)


# ---------------------------------------------------------------------------- wrappers

_ACTIVE: LiveRecorder | None = None
_STATE = threading.local()


def active() -> LiveRecorder | None:
    """The recorder of this process (None when recording is off or stopped)."""
    return _ACTIVE


def _guard(what: str, fn: Any) -> None:
    """Run one piece of bookkeeping; a failure stops recording, never SGLang."""
    global _ACTIVE
    try:
        with _ACTIVE._lock:  # type: ignore[union-attr]
            fn()
    except Exception as exc:
        rec, _ACTIVE = _ACTIVE, None
        print(f"kvtrace: recording stopped ({what}: {type(exc).__name__}: {exc})", file=sys.stderr)
        if rec is not None:
            rec.failed = f"{what}: {exc}"
            try:
                rec.close()
            except Exception:
                pass


def _outermost() -> bool:
    return getattr(_STATE, "depth", 0) == 0


class _Nested:
    def __enter__(self) -> None:
        _STATE.depth = getattr(_STATE, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _STATE.depth -= 1


def _wrap(module: Any, name: str, original: Any) -> Any:
    """The recording wrapper of one SGLang function (``original`` runs first: a call that
    raises records nothing)."""
    import functools

    if name == "run_scheduler_process":
        module._kvtrace_original_run_scheduler_process = original
        return run_scheduler_process

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _ACTIVE is None or not _outermost():
            return original(*args, **kwargs)
        rec = _ACTIVE
        before = None
        if name == "release_kv_cache":
            req = args[0]
            if req.kv.holds_kv:
                abort = type(getattr(req, "finished_reason", None)).__name__ == "FINISH_ABORT"
                checkpoint = kwargs.get("checkpoint", args[2] if len(args) > 2 else False)
                kind = "finish" if checkpoint and not abort else "abort"
                before = (kind, req, int(req.owned_kv_len()), int(req.kv.kv_committed_len))
        elif name == "release_req":
            req = kwargs["req"]
            if req.kv.holds_kv:
                before = ("retract", req, int(req.kv.kv_committed_len), int(req.kv.kv_committed_len))
        with _Nested():
            out = original(*args, **kwargs)
        if name == "alloc_for_extend":
            _guard(name, lambda: rec.extend(args[0] if args else kwargs["batch"]))
        elif name == "alloc_for_decode":
            _guard(name, lambda: rec.decode(args[0] if args else kwargs["batch"]))
        elif name == "alloc_for_spec_decode":
            from sglang.srt.runtime_context import get_spec

            draft = int(get_spec().speculative_num_draft_tokens or 1)
            _guard(name, lambda: rec.spec(list(kwargs["reqs"]), draft))
        elif name == "DecodePreallocQueue._pre_alloc":
            total = args[4] if len(args) > 4 else kwargs.get("total_prefix_len", 0)
            _guard(name, lambda: rec.prealloc(args[0], args[1], int(total or 0)))
        elif name == "checkpoint_kv_cache":
            _guard(name, lambda: rec.published(args[0]))
        elif before is not None:
            _guard(name, lambda: rec.release(*before))
        return out

    return wrapper


def _patch(module: Any) -> None:
    for dotted in _TARGETS.get(module.__name__, ()):
        owner, _, name = dotted.rpartition(".")
        holder = getattr(module, owner) if owner else module
        attr = name
        original = getattr(holder, attr, None)
        if original is None or getattr(original, "_kvtrace_wrapped", False):
            continue
        wrapped = _wrap(module, dotted, original)
        if wrapped is not run_scheduler_process:
            wrapped._kvtrace_wrapped = True  # type: ignore[attr-defined]
        setattr(holder, attr, wrapped)


class _PatchLoader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        _patch(module)


class _PatchFinder(importlib.abc.MetaPathFinder):
    """Wraps the SGLang functions of ``_TARGETS`` as their modules finish executing."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchLoader(spec.loader)
                return spec
        return None


def enable(path: str | None = None) -> LiveRecorder | None:
    """Start recording this process's SGLang calls to ``path`` (default:
    ``$KVTRACE_SGLANG_RECORD``; nothing happens when neither is set). Call it before
    SGLang's modules are imported: a module imported earlier is patched too, but
    functions other modules already imported by name from it are not.

    Returns:
        The recorder, or None when recording is off.
    """
    global _ACTIVE
    path = path or os.environ.get(ENV_VAR)
    if not path:
        return None
    if _ACTIVE is not None:
        return _ACTIVE
    if not any(isinstance(f, _PatchFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchFinder())
    for name in _TARGETS:
        if name in sys.modules:
            _patch(sys.modules[name])
    _ACTIVE = LiveRecorder(path)
    atexit.register(_close_active)
    return _ACTIVE


def _close_active() -> None:
    global _ACTIVE
    rec, _ACTIVE = _ACTIVE, None
    if rec is not None:
        rec.close()


def run_scheduler_process(*args: Any, **kwargs: Any) -> Any:
    """SGLang's ``run_scheduler_process`` with recording enabled first (it runs in a
    process SGLang starts; ``$KVTRACE_SGLANG_RECORD`` was inherited)."""
    enable()
    module = importlib.import_module("sglang.srt.managers.scheduler")
    return module._kvtrace_original_run_scheduler_process(*args, **kwargs)
