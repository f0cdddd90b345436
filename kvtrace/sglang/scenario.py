"""Differential scenarios: the file format, token content and the engine contract both
drivers share (their step runner is ``runner.py``).

This module is imported by ``driver.py``, ``world.py`` and ``runner.py`` (inside SGLang's
own virtual environment) and by ``ours_driver.py``; it needs only the standard library and
numpy and imports nothing from kvtrace, allocator or traces.

Scenario file (JSON lines; several scenarios may follow one another)::

    {"scenario": "name", "description": "...", "config": {
        "pool_tokens": 256, "page_size": 16, "max_running": 8, "max_context_len": 512,
        "need_sort": false, "radix_cache": true, "extra_rows": 0,
        "spec": null | {"algorithm": "eagle", "num_steps": 3, "topk": 1, "num_draft_tokens": 4},
        "swa": absent | {"window": 32, "swa_pool_tokens": 512, "eviction_interval": 4},
        "mamba": absent | {"slots": 16, "strategy": "no_buffer"}}}
    {"step": 0, "ops": [{"op": "extend", "rid": 0, "seq_len": 40, "prompt_len": 64,
                          "prompt_tokens": [...]}, ...]}
    {"step": 1, "ops": [...]}

Ops (``seq_len`` meanings as in ``traces/schema.py``; ``L`` = the request's
length before the op):

* ``extend``   positions ``[L, seq_len)``; ``L`` is 0 for a new request or one
               coming back after ``retract``. ``prompt_len`` (first op of a
               request, default ``seq_len``) says where the prompt ends: the
               extend that reaches it completes the prefill (after a retraction:
               the extend that reaches the retract op's ``seq_len``, the length
               the scenario gives the request then, stalled or not).
* ``decode``   ``seq_len = L + 1``.
* ``spec``     ``accepted`` tokens committed (``seq_len = L + accepted``), ``draft``
               drafts verified (informative).
* ``prealloc`` PD decode: ``seq_len`` tokens of KV arrive (``L = 0``).
* ``finish``   ``seq_len`` = tokens owned at release (a stop may land early).
* ``retract``, ``abort``  ``seq_len = L``.

Token content of position ``p`` of request ``r``: the explicit id from the op
that appended it (``tokens``, one per appended position), else
``prompt_tokens[p]`` (first op of the request), else ``unique_token(r, p)``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Iterator, NamedTuple, Protocol, Sequence

import numpy as np

FORMAT_VERSION = 1
OPS: tuple[str, ...] = ("extend", "decode", "spec", "prealloc", "finish", "retract", "abort")
RELEASE_OPS = ("finish", "abort", "retract")
OP_ORDER: tuple[str, ...] = ("finish", "abort", "retract", "prealloc", "extend", "decode", "spec")
UNIQUE_TOKEN_BASE = 1 << 52


def unique_token(rid: int, pos: int) -> int:
    """Token id unique to ``(rid, pos)``, disjoint from explicit ids below 2**52."""
    return UNIQUE_TOKEN_BASE + (rid << 24) + pos


class ScenarioError(ValueError):
    """A scenario file or op sequence that cannot be run (message names line/step/rid)."""


@dataclass(frozen=True, slots=True)
class SpecSpec:
    algorithm: str = "eagle"
    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int = 4


@dataclass(frozen=True, slots=True)
class SwaSpec:
    """A hybrid sliding-window model's SWA pool: the window (SGLang's
    ``sliding_window_size``), the SWA pool's tokens and ``SGLANG_SWA_EVICTION_INTERVAL``."""

    window: int
    swa_pool_tokens: int
    eviction_interval: int = 128
    overlap_chunked_prefill: int = 0  # >0: the overlap scheduler with this chunked_prefill_size
    draft_window: int = 0  # >0: a fused draft's SWA reads (CacheInitParams.draft_swa_window)
    release_prefill_swa: bool = False  # SGLANG_OPT_RELEASE_PREFILL_SWA


@dataclass(frozen=True, slots=True)
class MambaSpec:
    """A hybrid linear-attention model's Mamba state pool: its slots (SGLang's
    ``max_mamba_cache_size``) and buffer mode (``--mamba-radix-cache-strategy``)."""

    slots: int
    strategy: str = "no_buffer"


@dataclass(frozen=True, slots=True)
class HiCacheSpec:
    """HiCache's host KV tier under the radix cache (world decision 17): the host pool
    sized by SGLang's ``HostKVCache`` from the ratio, or ``host_pool_tokens`` as is, and
    ``--hicache-write-policy``."""

    host_ratio: float = 2.0
    host_pool_tokens: int | None = None
    write_policy: str = "write_through"


@dataclass(frozen=True, slots=True)
class ScenarioConfig:
    pool_tokens: int
    page_size: int = 1
    max_running: int = 16
    max_context_len: int = 1024
    need_sort: bool = False
    radix_cache: bool = True
    extra_rows: int = 0
    spec: SpecSpec | None = None
    swa: SwaSpec | None = None
    eviction_policy: str = "lru"  # SGLang's --radix-eviction-policy
    mamba: MambaSpec | None = None
    hicache: HiCacheSpec | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if self.swa is None:
            del out["swa"]  # full attention: the header as before SWA existed
        else:  # fields at their defaults: the header as before they existed
            for key in ("draft_window", "release_prefill_swa"):
                if not out["swa"][key]:
                    del out["swa"][key]
        if self.eviction_policy == "lru":
            del out["eviction_policy"]  # the default: the header as before policies existed
        if self.mamba is None:
            del out["mamba"]  # no linear-attention layers: the header as before Mamba existed
        if self.hicache is None:
            del out["hicache"]  # no host tier: the header as before HiCache existed
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ScenarioConfig:
        data = dict(data)
        spec = data.pop("spec", None)
        swa = data.pop("swa", None)
        mamba = data.pop("mamba", None)
        hicache = data.pop("hicache", None)
        unknown = set(data) - {f for f in cls.__slots__}  # type: ignore[attr-defined]
        if unknown:
            raise ScenarioError(f"scenario config has unknown keys {sorted(unknown)}")
        return cls(spec=SpecSpec(**spec) if spec else None, swa=SwaSpec(**swa) if swa else None,
                   mamba=MambaSpec(**mamba) if mamba else None, hicache=HiCacheSpec(**hicache) if hicache else None,
                   **data)

    def label(self) -> str:
        spec = "off" if self.spec is None else (
            f"{self.spec.algorithm}{self.spec.num_steps},{self.spec.topk},{self.spec.num_draft_tokens}"
        )
        return (
            f"ps{self.page_size} pool{self.pool_tokens} rows{self.max_running} ctx{self.max_context_len} "
            f"spec={spec} radix={'on' if self.radix_cache else 'off'}{' need_sort' if self.need_sort else ''}"
            + (f" swa=w{self.swa.window},pool{self.swa.swa_pool_tokens},i{self.swa.eviction_interval}"
               + (f",d{self.swa.draft_window}" if self.swa.draft_window else "")
               if self.swa is not None else "")
            + (f" evict={self.eviction_policy}" if self.eviction_policy != "lru" else "")
            + (f" mamba={self.mamba.slots},{self.mamba.strategy}" if self.mamba is not None else "")
        )


@dataclass(frozen=True, slots=True)
class Op:
    op: str
    rid: int
    seq_len: int
    accepted: int = 0
    draft: int = 0
    prompt_len: int | None = None
    tokens: tuple[int, ...] | None = None
    prompt_tokens: tuple[int, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"op": self.op, "rid": self.rid, "seq_len": self.seq_len}
        if self.op == "spec":
            out["accepted"] = self.accepted
            out["draft"] = self.draft
        if self.prompt_len is not None:
            out["prompt_len"] = self.prompt_len
        if self.tokens is not None:
            out["tokens"] = list(self.tokens)
        if self.prompt_tokens is not None:
            out["prompt_tokens"] = list(self.prompt_tokens)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Op:
        if data.get("op") not in OPS:
            raise ScenarioError(f"unknown op {data.get('op')!r}; expected one of {', '.join(OPS)}")
        tokens = data.get("tokens")
        prompt_tokens = data.get("prompt_tokens")
        return cls(
            op=data["op"],
            rid=int(data["rid"]),
            seq_len=int(data["seq_len"]),
            accepted=int(data.get("accepted", 0)),
            draft=int(data.get("draft", 0)),
            prompt_len=None if data.get("prompt_len") is None else int(data["prompt_len"]),
            tokens=None if tokens is None else tuple(int(t) for t in tokens),
            prompt_tokens=None if prompt_tokens is None else tuple(int(t) for t in prompt_tokens),
        )

    def brief(self) -> str:
        extra = f" acc={self.accepted}" if self.op == "spec" else ""
        return f"{self.op} r{self.rid}->{self.seq_len}{extra}"


@dataclass(frozen=True, slots=True)
class Step:
    step: int
    ops: tuple[Op, ...]


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    config: ScenarioConfig
    steps: tuple[Step, ...]
    description: str = ""
    # Steps whose divergence is expected (e.g. SGLang's row overflow), by reason.
    tags: tuple[str, ...] = ()

    def header(self) -> dict[str, Any]:
        return {
            "scenario": self.name,
            "version": FORMAT_VERSION,
            "description": self.description,
            "tags": list(self.tags),
            "config": self.config.to_dict(),
        }

    def num_ops(self) -> int:
        return sum(len(s.ops) for s in self.steps)


def dump_scenarios(scenarios: Iterable[Scenario], path: str) -> None:
    with open(path, "w") as f:
        for sc in scenarios:
            f.write(json.dumps(sc.header()) + "\n")
            for st in sc.steps:
                f.write(json.dumps({"step": st.step, "ops": [o.to_dict() for o in st.ops]}) + "\n")


def load_scenarios(path: str) -> list[Scenario]:
    """Read every scenario of a JSON-lines file. Raises ``ScenarioError`` naming the line."""
    out: list[Scenario] = []
    header: dict[str, Any] | None = None
    steps: list[Step] = []

    def close() -> None:
        if header is not None:
            out.append(
                Scenario(
                    name=str(header["scenario"]),
                    config=ScenarioConfig.from_dict(header["config"]),
                    steps=tuple(steps),
                    description=str(header.get("description", "")),
                    tags=tuple(header.get("tags", ())),
                )
            )

    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
                if "scenario" in rec:
                    close()
                    if rec.get("version", FORMAT_VERSION) != FORMAT_VERSION:
                        raise ScenarioError(f"format version {rec.get('version')} (this reader: {FORMAT_VERSION})")
                    header, steps = rec, []
                elif "step" in rec:
                    if header is None:
                        raise ScenarioError("step before any scenario header")
                    steps.append(Step(int(rec["step"]), tuple(Op.from_dict(o) for o in rec["ops"])))
                else:
                    raise ScenarioError("line is neither a scenario header nor a step")
            except (ScenarioError, KeyError, TypeError, ValueError) as exc:
                raise ScenarioError(f"{path}:{lineno}: {exc}") from None
    close()
    return out


# --------------------------------------------------------------------------- tokens


class TokenBook:
    """Token content of every request, materialised as ops append positions."""

    def __init__(self) -> None:
        self._tokens: dict[int, np.ndarray] = {}
        self._prompt: dict[int, np.ndarray] = {}
        self.prompt_len: dict[int, int] = {}

    def note_first(self, op: Op) -> None:
        if op.rid in self.prompt_len:
            return
        self.prompt_len[op.rid] = op.prompt_len if op.prompt_len is not None else op.seq_len
        if op.prompt_tokens is not None:
            self._prompt[op.rid] = np.asarray(op.prompt_tokens, dtype=np.int64)

    def append(self, op: Op, start: int) -> None:
        """Record the content of positions ``[start, op.seq_len)`` appended by ``op``."""
        rid, end = op.rid, op.seq_len
        cur = self._tokens.get(rid, np.zeros(0, np.int64))
        if end > cur.shape[0]:
            grown = np.empty(end, np.int64)
            grown[: cur.shape[0]] = cur
            pos = np.arange(cur.shape[0], end, dtype=np.int64)
            grown[cur.shape[0] :] = UNIQUE_TOKEN_BASE + (rid << 24) + pos
            prompt = self._prompt.get(rid)
            if prompt is not None:
                lo, hi = cur.shape[0], min(end, prompt.shape[0])
                if hi > lo:
                    grown[lo:hi] = prompt[lo:hi]
            cur = grown
        if op.tokens is not None:
            if len(op.tokens) != end - start:
                raise ScenarioError(
                    f"r{rid} {op.op}: {len(op.tokens)} explicit tokens for {end - start} appended positions"
                )
            cur[start:end] = op.tokens
        self._tokens[rid] = cur

    def tokens(self, rid: int, end: int) -> np.ndarray:
        """Ids of positions ``[0, end)`` (positions never appended get their default id)."""
        cur = self._tokens.get(rid, np.zeros(0, np.int64))
        if end <= cur.shape[0]:
            return cur[:end].copy()
        fake = Op("extend", rid, end)
        self.append(fake, cur.shape[0])
        return self._tokens[rid][:end].copy()

    def prompt(self, rid: int) -> np.ndarray:
        """The whole prompt: known ids, defaults where not appended yet."""
        n = self.prompt_len[rid]
        cur = self._tokens.get(rid, np.zeros(0, np.int64))
        out = np.empty(n, np.int64)
        k = min(n, cur.shape[0])
        out[:k] = cur[:k]
        pos = np.arange(k, n, dtype=np.int64)
        out[k:] = UNIQUE_TOKEN_BASE + (rid << 24) + pos
        prompt = self._prompt.get(rid)
        if prompt is not None and prompt.shape[0] > k:
            hi = min(n, prompt.shape[0])
            out[k:hi] = prompt[k:hi]
        return out


# --------------------------------------------------------------------------- engine contract


class CallResult(NamedTuple):
    """Outcome of one batched engine call."""

    outcome: str  # "ok" | "oom"
    detail: str = ""
    # (rid, positions asked, row width) for each speculative reserve past the row.
    row_overflow: tuple[tuple[int, int, int], ...] = ()


class Engine(Protocol):
    """What a driver implements so ``run_scenario`` can drive it."""

    def extend(
        self, rids: list[int], seq_lens: list[int], token_ids: list[np.ndarray],
        prompt_lens: list[int], prefill_done: list[bool],
    ) -> CallResult: ...

    def decode(self, rids: list[int]) -> CallResult: ...

    def spec(self, rids: list[int], accepted: list[int]) -> CallResult: ...

    def prealloc(
        self, rids: list[int], fill_lens: list[int], token_ids: list[np.ndarray], prompt_lens: list[int]
    ) -> CallResult: ...

    def release(
        self, kind: str, rids: list[int], owned_lens: list[int], token_ids: list[np.ndarray],
        prompt_lens: list[int], remaining: list[int],
    ) -> CallResult: ...

    def dump(self, rids: Sequence[int], final: bool = True) -> dict[str, Any]:
        """State now: see ``STATE_FIELDS``; ``reqs`` for the given live rids. ``final``:
        the step is over (apply deferred end-of-step work first); False: a dump between
        two calls of one step (``--fine``), which must not apply it."""
        ...


# Fields of a step dump (besides "step" and "events"):
#   reqs            [[rid, row, kv_allocated_len, kv_committed_len, cache_protected_len, row_rle], ...]
#                   for every request holding KV, by rid; row_rle = rle(req_to_token[row, :allocated])
#   free_pages      rle of the allocator's free list in order (slot ids at page 1, page ids otherwise)
#   release_pages   rle of the need_sort side list (release_pages at page 1, staged pages otherwise)
#   available       allocator available_size()
#   evictable       tree evictable size
#   protected       tree protected size
#   free_rows       rle of ReqToTokenPool free_slots in order
#   tree            the radix tree's shape (``tree_shape``), or None where a side cannot give it
# With an SWA pool (``ScenarioConfig.swa``), ``free_pages`` / ``release_pages`` are the full
# pool's, ``available`` is the allocator's (the smaller pool's), and besides:
#   swa_free_pages  rle of the SWA pool's free list in order
#   swa_available   the SWA pool's available size
#   swa_reqs        [[rid, swa_evicted_seqlen, rle(full_to_swa_index_mapping[row[:allocated]])], ...]
STATE_FIELDS = ("reqs", "free_pages", "release_pages", "available", "evictable", "protected", "free_rows", "tree")
SWA_STATE_FIELDS = ("swa_free_pages", "swa_available", "swa_reqs")
# With the radix cache on, an SWA dump also has the tree's SWA ledgers and sides:
#   swa_evictable   tree SWA evictable size;  swa_protected   tree SWA protected size
#   swa_tree        swa_tree_sides(...): per node, its SWA slots (None: tombstone) and SWA lock
SWA_RADIX_STATE_FIELDS = ("swa_evictable", "swa_protected", "swa_tree")


def tree_shape(nodes: Iterable[tuple[int, int, int, int, float]]) -> list[list[int]]:
    """Canonical shape of a radix tree, comparable across implementations.

    ``nodes``: one ``(first_slot, parent_first_slot, length, lock_ref, last_access_time)``
    per node except the root (``parent_first_slot`` -1 under the root). A node is
    named by the KV slot of its first unit (tree slots are distinct while the pool
    is consistent). Access times become dense ranks (their order is what LRU
    eviction reads; the clocks' absolute values differ). Returns
    ``[[first_slot, parent_first_slot, length, lock_ref, time_rank], ...]`` sorted
    by first slot.
    """
    rows = sorted(nodes)
    if not rows:
        return []
    times = np.array([r[4] for r in rows], dtype=np.float64)
    _, rank = np.unique(times, return_inverse=True)
    return [[int(a), int(b), int(n), int(lk), int(t)] for (a, b, n, lk, _), t in zip(rows, rank.tolist())]


def swa_tree_sides(nodes: Iterable[tuple[int, Sequence[int] | None, int]]) -> list[list[Any]]:
    """Canonical SWA side of a FULL + SWA radix tree, comparable across implementations.

    ``nodes``: one ``(first_full_slot, swa_slots or None, swa_lock_ref)`` per node except
    the root; None is a tombstone (full KV cached, SWA KV gone). Returns
    ``[[first_full_slot, swa_rle or None, swa_lock_ref], ...]`` sorted by first slot:
    which nodes are SWA-live, on which SWA slots, and how the window lock pins them.
    """
    return [[int(a), None if v is None else rle(v), int(lk)] for a, v, lk in sorted(nodes, key=lambda r: r[0])]


def rle(values: Sequence[int] | np.ndarray) -> list[list[int]]:
    """Runs of consecutive ascending ints: ``[[start, length], ...]`` (order kept)."""
    arr = np.asarray(values, dtype=np.int64).reshape(-1)
    if arr.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(arr) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [arr.size]))
    return [[int(arr[s]), int(e - s)] for s, e in zip(starts, ends)]


def unrle(runs: Sequence[Sequence[int]]) -> np.ndarray:
    if not runs:
        return np.zeros(0, np.int64)
    return np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in runs])


def iter_jsonl(path: str) -> Iterator[dict[str, Any]]:
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                yield json.loads(line)
