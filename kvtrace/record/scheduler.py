"""An SGLang-style continuous-batching scheduler model that records workloads as traces.

It replays a request-level workload (``traces.workloads``) through a model of
SGLang 0.5.23's scheduler (``managers/scheduler.py``, ``schedule_policy.py``,
``schedule_batch.py``) running on a REAL allocator (``allocator.base.Allocator``),
and records every op it applies through :class:`kvtrace.record.recorder.Recorder`.

One step, as ``Scheduler.get_next_batch_to_run`` without mixed chunked prefill:

1. Requests that finished in the previous step are released (``finish``: the owned
   prefix is checkpointed into the radix cache), arrivals up to the clock join the
   waiting queue.
2. A prefill batch is formed (``PrefillAdder``): the continuing chunk first, then
   waiting requests in policy order (FCFS, or longest prefix match) while the token
   budget, the chunk budget, the request rows and the memory estimate allow. If one
   is formed, the step runs it (one batched ``extend``) and nothing else.
3. Otherwise the running batch decodes (``update_running_batch``): the decode memory
   check may retract requests (fewest outputs first, then longest prompt; at least
   one is kept; if even that one cannot fit it is aborted), then one batched
   ``decode`` (or speculative ``spec_decode``) for every running request.

The clock advances by the modelled step time (:mod:`kvtrace.record.step_time`); when
nothing can run it jumps to the next arrival.

Admission (SGLang ``PrefillAdder``, ``PrefillBudget``)::

    remaining = available + evictable - sum_running min(max_new - out, 4096) * ratio
                - sum_admitted (ceil_page(extend) + page + min(max_new, 4096))
    admit while  extend + min(max_new - out, 4096) + page  <  remaining

Decode memory check (``check_decode_mem``): ``page * #(running with seq_len % page
== 0)`` tokens (speculative: ``sum ceil_page(allocated + max(0, committed + reserve -
allocated)) - ceil_page(allocated)``) must fit ``available + evictable``.

A hybrid sliding-window model (the allocator's ``config.swa``) has a second pool, and
admission also charges each request's SWA need (SGLang ``SWAPrefillBudget``,
``estimate_swa_kv_tokens``) against the SWA pool::

    swa_need = max(extend - window, 0) + min(extend + max_new, window) + page
    admit while  swa_need  <  swa_available - sum_admitted swa_need

(a prompt whose need reaches the whole SWA pool is chunked down to what fits it); a
continuing chunk takes at most ``swa_remaining - page`` tokens and waits when that is
none. The decode memory check must fit every pool (``check_decode_capacity``: the
smaller of the two pools' free tokens).

A hybrid linear-attention model (``SchedulerConfig.mamba_slots``) keeps a Mamba state
slot per running request beside its KV. SGLang sizes the request rows from the slots
(``resolve_max_num_reqs``: ``max_running = min(max_running, slots // per_request)``,
3 slots per request with a radix cache for the states it checkpoints, 1 without), so
a request is admitted only while a row with its slots is free::

    admit while  rows_used < max_running  and  per_request * (rows_used + 1) <= slots

HiCache's host tier (``SchedulerConfig.hicache``): the allocator under the model is the
tiered one (``allocator.hiradix``), and admission follows SGLang 0.5.23's
``PrefillAdder.add_one_req`` (``managers/schedule_policy.py``) with a host hit:

* Each step polls the tier after the releases, before admission (SGLang's
  ``check_hicache_events`` in ``get_next_batch_to_run``): the previous step's backups
  and load-backs are acknowledged, so their locks no longer pin the cache. (Without it
  a write-through backup locked every cached prefix until the next allocation, which
  an idle engine never made: nothing was admitted again.)
* The match gives the device prefix and ``host_hit_length`` (a pure query,
  ``match_prefix_hi``). The fit charges the host part as extend: ``total_tokens =
  fill - device prefix + max_new + page`` (the load-back takes device slots).
* The load-back's device slots are not charged in the plain pool's budget
  (``PrefillBudget.prepare_load_back`` passes): ``init_load_back`` takes them, and the
  loaded nodes stay locked by the request, so the model takes them from ``available +
  evictable`` for the next candidates. The request is admitted with ``device prefix +
  host hit`` as its prefix: only the rest is extended and reserved.
* All or nothing: a load-back below ``load_back_threshold`` (10 tokens), or beyond the
  free plus evictable device slots, loads nothing, and the request is admitted with the
  host part recomputed (the fit above already charged it).
* The extend repeats the match and the load-back in batch order (what a replay does
  too, so the recorded prefix lengths are the replay's). A load-back that evicts device
  leaves ends the batch: the eviction could take a prefix a later candidate was
  matched against.
* Host copies stay after a load-back (duplicates); backups are written per
  ``write_policy`` on insert or eviction (docs/hicache-semantics.md).

Streaming sessions (``SchedulerConfig.sessions``, the conversations of
``kvtrace.record.sessions``): a session per conversation, one request id per session,
as SGLang 0.5.23's ``session/streaming_session.py`` keeps it:

* A turn that finishes is *held* (``hold``): its session keeps its KV and its request
  row (``try_cache_finished_req``); only the first turn's prompt is in the radix cache
  (``publishes_prompt``), nothing a later turn computes is.
* The next turn waits until the previous one is held (SGLang serves one request of a
  session at a time). Its prompt is the conversation so far: it extends the held KV
  from the held length to its own ``input_len`` (at least one new token), and is
  admitted like any request with the held length as its prefix match
  (``try_match_prefix`` lends the session's record), which pins nothing of the tree.
* The session closes (``close``: the held KV is freed, nothing cached) the step after
  its last turn is held: the client closes it once it has its last answer. SGLang
  also reaps a session whose optional ``timeout`` (``open_session``, none by default)
  passes; the model has no timeout, except that when nothing can run while sessions
  pin KV between turns it closes them all (``_abort_stuck``).
* A retracted turn gives its KV back and re-prefills (the trace's ``retract``); an
  aborted one ends its session, and the conversation's later turns start a new one.

``ratio`` (``new_token_ratio``) starts at 0.7, decays linearly to 0.7 * 0.14 = 0.098
over 600 decode steps, is set to ``min(1, (sum out + 20 n) / (sum max_new + 1))``
over the remaining requests after a retraction, and is reset to 0.7 when idle.

Modelling choices where the allocator protocol hides SGLang state:

* SGLang pins a candidate's matched prefix while it checks the budget (moving the
  unlocked part of it from evictable to protected). The protocol does not say how
  much of a match is unlocked, so the model charges the whole matched prefix
  against the evictable total (an upper bound: a prefix shared with a running
  request is already locked).
* Should a batched ``extend`` still not fit (the estimate above is not exact), the
  last admitted request goes back to the head of the waiting queue and the call is
  repeated; SGLang would raise instead. Counted as ``extend_retries``.
* Retraction releases one request per allocator call (each release changes what the
  next memory check sees); every other op is one batched call per op kind per step.
  The eviction SGLang runs after each retraction (the shortfall below ``remaining *
  20`` free tokens) is part of the allocator's retract release, so a replay of the
  trace repeats it.
* Requests generate exactly their recorded output length: ``max_new_tokens`` is the
  workload's output length (clipped as SGLang clips it to the context and the pool).
* A request whose prompt does not fit the context or the pool is rejected on arrival,
  as SGLang's ``validate_input_length`` rejects it: it never reaches the trace.
* LPM's in-batch prefix deprioritisation compares first prompt blocks (two waiting
  requests with equal first blocks share at least 32 tokens).
* PD decode: requests arrive with their prompt KV (``prealloc`` of
  ``input_len`` tokens, the prefill server's first token already generated);
  admission follows ``DecodePreallocQueue.pop_preallocated`` (512 decode tokens
  reserved per active request; the KV transfer is instantaneous); a step that
  pre-allocates runs no decode (SGLang runs the prebuilt batch instead). Retracted
  requests re-enter the pre-allocation queue first, with the KV they had committed.

Speculative decoding (EAGLE-style, ``num_steps``, ``topk``, ``num_draft_tokens``):
each step verifies ``num_draft_tokens`` drafts per request; the accepted length
(drafts accepted + the bonus token) is ``1 + K`` with ``K`` a truncated geometric
variable: each of at most ``num_draft_tokens - 1`` drafts is accepted with
probability ``alpha`` given the previous one was, so
``P(K = k) = alpha^k (1 - alpha)`` for ``k < m`` and ``P(K = m) = alpha^m`` where
``m = num_draft_tokens - 1``; mean accepted length ``(1 - alpha^(m+1)) / (1 - alpha)``
(2.53 for alpha 0.7 and 4 draft tokens).

One concept, read top to bottom: the scheduler model's step, in SGLang's order
(arrivals, releases, admission of a prefill batch or of PD pre-allocations, decode
with retraction), over one set of per-request arrays and queues that every part reads
and writes; admission and retraction depend on each other's bookkeeping (the new-token
ratio, the batch-is-full flag, the waiting order), so splitting them would spread one
step over modules that each need the whole state. What a recording reports is
``kvtrace.record.summary``.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

from allocator.base import RETRACT_DECODE_STEPS, AllocResult, OutOfMemory, PoolCounters
from allocator.hiradix import LOAD_BACK_THRESHOLD
from allocator.pages import ceil_align, floor_align, new_page_tokens
from allocator.sizing import reserve_per_decode
from kvtrace.replay.config import spec_config_for
from kvtrace.record.step_time import Percentiles, StepTimeModel
from kvtrace.record.summary import COUNTED, RecordProgress, RecordSummary
from traces.hicache_layout import HostTier
from traces.mamba_layout import mamba_slots_per_request
from traces.metadata import SpecSettings, TraceConfig
from traces.namespaces import in_namespace

if TYPE_CHECKING:
    from allocator.base import Allocator
    from kvtrace.record.recorder import Recorder
    from traces.workloads import WorkloadRequest

__all__ = [
    "CLIP_MAX_NEW_TOKENS",
    "Scheduler",
    "SchedulerConfig",
    "TokenSource",
    "max_req_input_len",
    "mean_accepted_len",
]

# SGLang constants (environ.py, schedule_policy.py).
CLIP_MAX_NEW_TOKENS = 4096  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
INIT_NEW_TOKEN_RATIO = 0.7  # SGLANG_INIT_NEW_TOKEN_RATIO
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14  # SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
NEW_TOKEN_RATIO_DECAY_STEPS = 600  # SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS
LPM_MAX_QUEUE = 128  # WAITING_QUEUE_PREFIX_MATCH_MAX: LPM falls back to FCFS above it
IN_BATCH_PREFIX_THRESHOLD = 32  # IN_BATCH_PREFIX_CACHING_CHECK/DEPRIORITIZE_THRESHOLD
NUM_RESERVED_DECODE_TOKENS = 512  # --num-reserved-decode-tokens (PD decode)
_CANDIDATE_TOKEN_CACHE = LPM_MAX_QUEUE + 32  # waiting requests whose token ids are kept

# Request states (_HELD: a streaming session holds its KV between turns).
_WAITING, _RUNNING, _CHUNKED, _FINISHING, _DONE, _HELD = range(6)

SchedulePolicy = Literal["fcfs", "lpm"]


def max_req_input_len(max_context_len: int, pool_tokens: int) -> int:
    """The longest prompt the modelled engine admits (SGLang's ``max_req_input_len``);
    a longer request is rejected and never gets a request id."""
    return min(max_context_len - 1, pool_tokens - 1) - 5


def mean_accepted_len(alpha: float, num_draft_tokens: int) -> float:
    """Mean accepted length (drafts + bonus token) of the truncated geometric model."""
    m = num_draft_tokens - 1
    if alpha >= 1.0:
        return float(m + 1)
    return (1.0 - alpha ** (m + 1)) / (1.0 - alpha)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Serving configuration of the modelled engine.

    Args:
        page_size: tokens per KV page (as the allocator's).
        pool_tokens: KV slots (as the allocator's).
        max_running: request rows (``max_running_requests``).
        max_context_len: the model's context length.
        chunk_size: ``chunked_prefill_size`` (None: no chunking).
        max_prefill_tokens: ``max_prefill_tokens`` (token budget of one prefill batch).
        policy: ``fcfs`` or ``lpm`` (longest prefix match).
        spec: speculative decoding settings, or None.
        spec_acceptance: per-draft acceptance probability ``alpha``.
        pd_decode: model a PD-disaggregated decode server (requests arrive with KV).
        hisparse: the PD decode server's allocator is HiSparse (recorded in the trace's config).
        radix_cache: the allocator keeps a radix cache (PD decode: off by default).
        seed: seed of the speculative acceptance draws.
        step_time: the step-time model (the clock).
        mamba_slots: a hybrid linear-attention model's Mamba state slots
            (``max_mamba_cache_size``; None: no linear layers).
        hicache: HiCache's host tier the engine is configured with (stored in the
            trace's config and served by the allocator; admission with host hits: the
            module docstring), or None.
        sessions: streaming sessions: a request with a ``session_id`` is a turn of its
            session (module docstring); the trace says ``config.sessions``.
    """

    page_size: int
    pool_tokens: int
    max_running: int
    max_context_len: int
    chunk_size: int | None = 8192
    max_prefill_tokens: int = 16384
    policy: SchedulePolicy = "fcfs"
    spec: SpecSettings | None = None
    spec_acceptance: float = 0.7
    pd_decode: bool = False
    hisparse: bool = False
    radix_cache: bool = True
    eviction_policy: str = "lru"
    seed: int = 0
    step_time: StepTimeModel = field(default_factory=StepTimeModel)
    mamba_slots: int | None = None
    hicache: HostTier | None = None
    sessions: bool = False

    def trace_config(self) -> TraceConfig:
        """The serving configuration a trace recorded under this one carries."""
        return TraceConfig(
            page_size=self.page_size,
            pool_tokens=self.pool_tokens,
            max_running=self.max_running,
            max_context_len=self.max_context_len,
            chunk_size=self.chunk_size,
            schedule_policy=self.policy,
            spec=self.spec,
            pd_decode=self.pd_decode,
            hisparse=self.hisparse,
            radix_cache=self.radix_cache,
            eviction_policy=self.eviction_policy,
            hicache=self.hicache,
            sessions=self.sessions,
        )


class TokenSource:
    """Token ids of a request's positions, as the trace will materialise them.

    Prompt positions come from the request's content-addressed blocks (equal block
    hashes give equal tokens, so equal leading blocks share a prefix); positions
    without a block (generated tokens, or every position of a workload without
    prefix information) get tokens unique to ``(rid, position)``. It delegates to
    ``traces.tokens`` so that the replay's radix cache sees the same content.
    """

    def __init__(self, block_size: int | None) -> None:
        from traces.tokens import block_token_ids, unique_token_ids

        self.block_size = block_size
        self._block = block_token_ids
        self._unique = unique_token_ids

    def tokens(self, rid: int, end: int, prompt_len: int, hashes: np.ndarray | None) -> np.ndarray:
        """int64 ids of positions ``[0, end)`` of request ``rid``."""
        if hashes is None or self.block_size is None:
            return self._unique(rid, 0, end)
        blocked = min(end, prompt_len)
        head = self._block(hashes, self.block_size, 0, blocked)
        if end <= blocked:
            return head
        return np.concatenate([head, self._unique(rid, blocked, end)])


class Scheduler:
    """The scheduler model. One instance records one workload.

    Args:
        allocator: a fresh allocator (``allocator.create_allocator``) configured like
            ``config`` (page size, pool, rows, speculative settings).
        recorder: where the ops go (``dense_ids=True``: request ids are 0, 1, 2, …
            in arrival order of the admitted requests).
        config: the modelled engine's settings.
        block_size: tokens per block of the workload's block hashes (None: none).
        session_turns: with ``config.sessions``, the number of turns of each session
            (``kvtrace.record.sessions.SessionPlan.turns``): its last turn closes it.
    """

    def __init__(
        self,
        allocator: Allocator,
        recorder: Recorder,
        config: SchedulerConfig,
        *,
        block_size: int | None = None,
        session_turns: dict[str, int] | None = None,
    ) -> None:
        self.alloc = allocator
        self.rec = recorder
        self.cfg = config
        self.ps = config.page_size
        self.model = config.step_time
        self.tokens = TokenSource(block_size)
        self.rng = np.random.default_rng(config.seed)
        # SGLang's request limits (tp_worker: max_req_len, max_req_input_len).
        self.max_req_len = min(config.max_context_len - 1, config.pool_tokens - 1)
        self.max_req_input_len = max_req_input_len(config.max_context_len, config.pool_tokens)
        # The allocator's own per-request speculative reserve (0 without speculative decoding).
        self.reserve = reserve_per_decode(spec_config_for(config.spec), self.ps)
        self.ratio_init = min(INIT_NEW_TOKEN_RATIO, 1.0)
        self.ratio_min = self.ratio_init * MIN_NEW_TOKEN_RATIO_FACTOR
        self.ratio_decay = (self.ratio_init - self.ratio_min) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.ratio = self.ratio_init
        # A hybrid sliding-window model's window and SWA pool (None: full attention only).
        swa = getattr(allocator.config, "swa", None)
        # the window the tree keeps (SGLang's prefill budget reads the tree's, swa_retain_window)
        self.swa_window: int | None = getattr(swa, "retain_window", swa.window) if swa is not None else None
        self.swa_pool_tokens = swa.pool_tokens(allocator.config.pool_tokens, self.ps) if swa is not None else 0
        # A hybrid linear-attention model's Mamba slots, and how many each request row is sized for.
        self.mamba_slots_per_req = mamba_slots_per_request(config.radix_cache, config.page_size)

        # Per-request state, struct of arrays indexed by rid (grown by doubling).
        cap = 1024
        self.arrival = np.zeros(cap, np.float64)
        self.input_len = np.zeros(cap, np.int64)
        self.content_len = np.zeros(cap, np.int64)  # the first turn's prompt: its block tokens
        self.max_new = np.zeros(cap, np.int64)
        self.out = np.zeros(cap, np.int64)  # generated tokens (the last has no KV yet)
        self.kv = np.zeros(cap, np.int64)  # kv_committed_len as recorded (0 when none)
        self.state = np.zeros(cap, np.int8)
        self.hashes: list[np.ndarray | None] = []
        self.namespaces: list[str | None] = []  # per rid: the cache namespace its prefix matches are keyed by
        self.num_requests = 0
        self._token_cache: dict[int, np.ndarray] = {}
        self._candidate_tokens: OrderedDict[int, np.ndarray] = OrderedDict()
        # Streaming sessions: turns per session, turns arrived, the live session's rid,
        # each session rid's id, the turns waiting for the previous one to be held, the
        # rids holding a row between turns (held, or a turn waiting), and the sessions
        # to close at the next step.
        self.session_turns = session_turns if config.sessions else None
        self._turns_seen: dict[str, int] = {}
        self._session_rid: dict[str, int] = {}
        self._session_of: dict[int, str] = {}
        self._next_turns: dict[int, list[WorkloadRequest]] = {}
        self._idle_rows: set[int] = set()
        self.closing: list[int] = []
        # later turns admitted, sessions closed, and of those closed because nothing could run
        self.session_stats = {"turns": 0, "closed": 0, "reaped": 0}

        self.waiting: list[int] = []  # policy order (FCFS: arrival order, retracted at the end)
        self.running = np.zeros(0, np.int64)  # decode batch, in batch order
        self.chunked: int | None = None  # the request in chunked prefill (holds a row)
        self.finishing = np.zeros(0, np.int64)  # finished last step, released next step
        self.batch_is_full = False

        self.clock = 0.0
        self.step = 0
        self._total: int | None = None
        self._stats = dict.fromkeys(COUNTED, 0)
        self._first_admitted = np.zeros(cap, np.bool_)
        self.first_scheduled_s = np.full(cap, np.nan)  # clock at the request's first admission
        self.first_token_s = np.full(cap, np.nan)  # clock when its first token was sampled

    # ------------------------------------------------------------------ requests

    def _grow(self) -> None:
        cap = self.arrival.shape[0] * 2
        for name in ("arrival", "input_len", "content_len", "max_new", "out", "kv", "state", "_first_admitted",
                     "first_scheduled_s", "first_token_s"):  # fmt: skip
            old = getattr(self, name)
            # Latency clocks start unknown (NaN): a request not scheduled yet has none.
            new = np.full(cap, np.nan) if name.startswith("first_") else np.zeros(cap, old.dtype)
            new[: old.shape[0]] = old
            setattr(self, name, new)

    def _arrive(self, req: WorkloadRequest) -> None:
        """Admit one workload request into the waiting queue (or reject it, as SGLang would)."""
        sid = req.session_id if self.session_turns is not None else None
        if sid is not None:
            self._turns_seen[sid] = self._turns_seen.get(sid, 0) + 1
            rid = self._session_rid.get(sid)
            if rid is not None:  # a later turn of a live session
                self._next_turns.setdefault(rid, []).append(req)
                if self.state[rid] == _HELD:
                    self._next_turn(rid)
                return
        if req.input_len >= self.max_req_input_len:
            self._stats["rejected"] += 1
            return
        max_new = max(0, min(req.output_len, self.max_req_len - req.input_len - 1))
        # allocator.max_new_tokens_for_memory: the prompt and its generation must fit the pool.
        paged_input = ceil_align(req.input_len, self.ps)
        max_new = max(0, min(max_new, self.cfg.pool_tokens - paged_input - self.ps - 1))
        rid = self.num_requests
        if rid == self.arrival.shape[0]:
            self._grow()
        self.num_requests += 1
        self.arrival[rid] = req.arrival_s
        self.input_len[rid] = req.input_len
        self.content_len[rid] = req.input_len
        self.max_new[rid] = max_new
        self.hashes.append(req.block_hashes)
        self.namespaces.append(req.namespace)
        self.state[rid] = _WAITING
        if self.cfg.pd_decode:
            # The prefill server generated the first token.
            self.out[rid] = 1
        self.waiting.append(rid)
        if sid is not None:
            self._session_rid[sid] = rid
            self._session_of[rid] = sid

    def _next_turn(self, rid: int) -> None:
        """A held session's next turn (if it has arrived) joins the waiting queue, with
        the conversation so far as its prompt; the session closes after its last turn."""
        sid = self._session_of[rid]
        queued = self._next_turns.get(rid)
        while queued:
            req = queued.pop(0)
            held = int(self.kv[rid])
            end = max(req.input_len, held + 1)
            if end >= self.max_req_input_len:
                self._stats["rejected"] += 1
                continue
            max_new = max(0, min(req.output_len, self.max_req_len - end - 1))
            max_new = max(0, min(max_new, self.cfg.pool_tokens - ceil_align(end, self.ps) - self.ps - 1))
            self.input_len[rid] = end
            self.max_new[rid] = max_new
            self.out[rid] = 0
            self.state[rid] = _WAITING
            self.waiting.append(rid)
            self.session_stats["turns"] += 1
            return
        assert self.session_turns is not None
        if self._turns_seen[sid] >= self.session_turns.get(sid, 0):
            self.closing.append(rid)

    def _end_session(self, rid: int) -> None:
        sid = self._session_of.pop(rid)
        if self._session_rid.get(sid) == rid:
            del self._session_rid[sid]
        dropped = self._next_turns.pop(rid, [])
        self._stats["rejected"] += len(dropped)
        self._idle_rows.discard(rid)

    def _held_prefix(self, rid: int) -> int | None:
        """A session turn's prefix: the KV its session holds (None: not a held turn)."""
        if rid in self._idle_rows:
            return int(self.kv[rid])
        return None

    def _fill_len(self, rid: int) -> int:
        """Tokens a (re-)prefill computes: prompt plus the outputs kept over a retraction."""
        return int(self.input_len[rid] + self.out[rid])

    def _token_ids(self, rid: int, end: int, *, cache: bool = True) -> np.ndarray:
        """Ids of positions ``[0, end)``. Admitted requests keep theirs (``cache``);
        waiting candidates, matched again at every prefill attempt, share a bounded
        cache (a waiting queue can hold thousands of long prompts)."""
        cached = self._token_cache.get(rid)
        if cached is None:
            cached = self._candidate_tokens.get(rid)
            if cached is not None and cache:
                del self._candidate_tokens[rid]
                self._token_cache[rid] = cached
        if cached is None or cached.shape[0] < end:
            prompt_len = int(self.content_len[rid])
            cached = in_namespace(
                self.tokens.tokens(rid, max(end, prompt_len), prompt_len, self.hashes[rid]), self.namespaces[rid]
            )
            if cache:
                self._token_cache[rid] = cached
            elif rid not in self._token_cache:
                self._candidate_tokens[rid] = cached
                if len(self._candidate_tokens) > _CANDIDATE_TOKEN_CACHE:
                    self._candidate_tokens.popitem(last=False)
        return cached[:end]

    # ------------------------------------------------------------------ main loop

    def run(
        self,
        requests: Iterable[WorkloadRequest],
        progress: Callable[[RecordProgress], None] | None = None,
        progress_every_s: float = 0.25,
        total: int | None = None,
    ) -> RecordSummary:
        """Record the whole workload; returns the summary.

        Raises:
            RuntimeError: the allocator refused an allocation the model had checked
                (a model or allocator bug), with the step and numbers.
        """
        self._total = total
        source: Iterator[WorkloadRequest] = iter(requests)
        pending = next(source, None)
        last_progress = time.monotonic()
        while True:
            while pending is not None and pending.arrival_s <= self.clock:
                self._arrive(pending)
                pending = next(source, None)
            idle = (
                self.running.shape[0] == 0
                and self.chunked is None
                and not self.waiting
                and self.finishing.shape[0] == 0
                and not self.closing
            )
            if idle:
                if pending is None:
                    if self._idle_rows:  # a session whose later turns never came: the client closes it
                        self.closing.extend(sorted(self._idle_rows))
                        continue
                    break
                # Nothing to run: jump to the next arrival (SGLang resets the ratio when idle).
                self.clock = max(self.clock, pending.arrival_s)
                self.ratio = self.ratio_init
                continue
            ran = self._step()
            if not ran:
                if pending is not None:
                    self.clock = max(self.clock, pending.arrival_s)
                    continue
                self._abort_stuck()
                continue
            if progress is not None:
                now = time.monotonic()
                if now - last_progress >= progress_every_s:
                    last_progress = now
                    progress(self.progress())
        if progress is not None:
            progress(self.progress())
        return self.summary()

    def progress(self) -> RecordProgress:
        return RecordProgress(
            steps=self.step,
            arrived=self.num_requests + self._stats["rejected"],
            waiting=len(self.waiting),
            running=int(self.running.shape[0]) + (self.chunked is not None),
            finished=self._stats["finished"] + self._stats["aborted"],
            sim_time_s=self.clock,
            total=self._total,
        )

    def summary(self) -> RecordSummary:
        s = self._stats
        prompt = s["prompt_tokens"]
        n = self.num_requests
        arrival = self.arrival[:n]
        return RecordSummary(
            steps=self.step,
            requests=n,
            prefix_hit_rate=s["prefix_hit_tokens"] / prompt if prompt else 0.0,
            duration_s=self.clock,
            queue_delay_s=Percentiles.of(self.first_scheduled_s[:n] - arrival),
            ttft_s=Percentiles.of(self.first_token_s[:n] - arrival),
            **s,
        )

    def _abort_stuck(self) -> None:
        """Nothing can ever run again: drop what waits, counted as rejected (a guard:
        every accepted prompt and its clipped generation fit an empty pool). While
        sessions hold KV between turns they are closed first (their waiting turns
        dropped), as SGLang's session timeout would reap them: the KV they pin can keep
        the head of the queue from ever fitting."""
        if self._idle_rows:
            self.closing.extend(sorted(self._idle_rows))
            self.session_stats["reaped"] += len(self._idle_rows)
            return
        self._stats["rejected"] += len(self.waiting)
        for rid in self.waiting:
            if rid in self._idle_rows:  # a session turn: its session still holds KV
                self.closing.append(rid)
                continue
            self.state[rid] = _DONE
            self._token_cache.pop(rid, None)
        self.waiting = []

    def _step(self) -> bool:
        """Run one scheduler step; False when it had nothing to do."""
        self.rec.begin_step(self.clock)
        released = self._release_finished()
        if self.cfg.hicache is not None:
            # SGLang's check_hicache_events: the previous step's backups and load-backs
            # finish before admission (their locks would otherwise pin the cache)
            self.alloc.poll_hicache()  # type: ignore[attr-defined]
        if self.cfg.pd_decode:
            duration = self._pd_prealloc()
            if duration is None:
                duration = self._decode()
        else:
            duration = self._prefill()
            if duration is None:
                duration = self._decode()
        # Apply the prompt publish of this step's prefill now (SGLang: same step).
        self.alloc.end_step()
        self.rec.end_step()
        if duration is None:
            if released:
                # The releases were a step of their own (results processed at its end).
                self.step += 1
                self._stats["release_steps"] += 1
                return True
            return False
        self.step += 1
        self.clock += duration
        s = self._stats
        used = self.alloc.counters().used_tokens
        if used > s["peak_used_tokens"]:
            s["peak_used_tokens"] = used
            s["peak_step"] = self.step - 1
        running = int(self.running.shape[0])
        if running > s["peak_running"]:
            s["peak_running"] = running
        if len(self.waiting) > s["peak_waiting"]:
            s["peak_waiting"] = len(self.waiting)
        return True

    # ------------------------------------------------------------------ release

    def _release_finished(self) -> bool:
        closed = self._close_sessions()
        rids = self.finishing
        if rids.shape[0] == 0:
            return closed
        self.finishing = np.zeros(0, np.int64)
        if self._session_of:
            in_session = np.fromiter((r in self._session_of for r in rids.tolist()), np.bool_, rids.shape[0])
            if in_session.any():
                self._hold(rids[in_session])
                rids = rids[~in_session]
                if rids.shape[0] == 0:
                    self.batch_is_full = False
                    return True
        # owned_kv_len(): min(committed, prompt + output through the stop).
        owned = np.minimum(self.kv[rids], self.input_len[rids] + self.max_new[rids])
        if self.cfg.radix_cache:
            token_ids = [self._token_ids(int(r), int(n)) for r, n in zip(rids.tolist(), owned.tolist())]
        else:
            token_ids = None
        self.alloc.release(rids, owned, token_ids, "finish")
        self.rec.finish(rids, owned)
        self.kv[rids] = 0
        self.state[rids] = _DONE
        for rid in rids.tolist():
            self._token_cache.pop(rid, None)
        self._stats["finished"] += int(rids.shape[0])
        self.batch_is_full = False
        return True

    def _hold(self, rids: np.ndarray) -> None:
        """Finished session turns: their sessions keep their KV (``hold``)."""
        held = np.minimum(self.kv[rids], self.input_len[rids] + self.max_new[rids])
        self.alloc.hold(rids, held)  # type: ignore[attr-defined]
        self.rec.hold(rids, held)
        self.kv[rids] = held
        self.state[rids] = _HELD
        self._stats["finished"] += int(rids.shape[0])
        self.batch_is_full = False
        for rid in rids.tolist():
            self._idle_rows.add(rid)
            self._next_turn(rid)

    def _close_sessions(self) -> bool:
        """Close the sessions whose conversation ended (``close``: their KV is freed)."""
        if not self.closing:
            return False
        rids = np.array(sorted(set(self.closing)), np.int64)
        self.closing = []
        res = self.alloc.close_session(rids)  # type: ignore[attr-defined]
        self._stats["evicted_tokens"] += res.evicted_tokens
        self.rec.close_session(rids)
        self.kv[rids] = 0
        self.state[rids] = _DONE
        for rid in rids.tolist():
            if rid in self.waiting:  # a turn waiting for a session reaped (_abort_stuck)
                self.waiting.remove(rid)
                self._stats["rejected"] += 1
            self._token_cache.pop(rid, None)
            self._end_session(rid)
        self.session_stats["closed"] += int(rids.shape[0])
        self.batch_is_full = False
        return True

    # ------------------------------------------------------------------ prefill

    def _lpm_sort(self) -> dict[int, int]:
        """Longest-prefix-match order (in place), SGLang ``calc_priority``; returns the matches."""
        matches: dict[int, int] = {}
        if len(self.waiting) > LPM_MAX_QUEUE:
            return matches  # SGLang turns LPM off for long queues (FCFS order kept)
        # (namespace, first block): SGLang's in-batch tree keys by RadixKey, extra_key included
        seen_first_blocks: set[tuple[str | None, int]] = set()
        deprioritized: set[int] = set()
        for rid in self.waiting:
            end = self._fill_len(rid)
            held = self._held_prefix(rid)
            prefix = self.alloc.match_prefix(self._token_ids(rid, end, cache=False)) if held is None else held
            matches[rid] = prefix
            if prefix <= IN_BATCH_PREFIX_THRESHOLD:
                hashes = self.hashes[rid]
                if hashes is None or self.input_len[rid] < IN_BATCH_PREFIX_THRESHOLD:
                    continue
                first = (self.namespaces[rid], int(hashes[0]))
                if first in seen_first_blocks:
                    deprioritized.add(rid)
                else:
                    seen_first_blocks.add(first)
        self.waiting.sort(key=lambda r: math.inf if r in deprioritized else -matches[r])
        return matches

    def _num_allocatable(self, running_bs: int, held_rows: int) -> int:
        # sessions' rows between turns are taken too (SGLang frees them on close)
        rows_used = running_bs + (1 if self.chunked is not None else 0) + len(self._idle_rows)
        free_rows = self.cfg.max_running - rows_used
        allocatable = min(self.cfg.max_running - running_bs, free_rows + held_rows)
        if self.cfg.mamba_slots is not None:
            # A hybrid model's request needs free Mamba slots too: SGLang sizes the
            # request rows from the slots (``resolve_max_num_reqs``), so a row is
            # free only while its slots are.
            free_slots = self.cfg.mamba_slots - self.mamba_slots_per_req * rows_used
            allocatable = min(allocatable, free_slots // self.mamba_slots_per_req + held_rows)
        return allocatable

    def _prefill(self) -> float | None:
        """Form and run a prefill batch (``get_new_batch_prefill``); None when none forms."""
        cfg = self.cfg
        ps = self.ps
        running_bs = int(self.running.shape[0])
        if running_bs == 0:
            self.batch_is_full = False
        if (self.batch_is_full or not self.waiting) and self.chunked is None:
            return None
        if self._num_allocatable(running_bs, 0) <= 0 and self.chunked is None:
            self.batch_is_full = True
            return None
        matches = self._lpm_sort() if cfg.policy == "lpm" else {}

        counters = self.alloc.counters()
        evictable = counters.evictable
        avail = counters.available
        if running_bs:
            left = self.max_new[self.running] - self.out[self.running]
            total_offset = float(np.minimum(left, CLIP_MAX_NEW_TOKENS).sum()) * self.ratio
        else:
            total_offset = 0.0
        current_offset = 0.0
        locked = 0  # matched prefixes charged against evictable (see module docstring)
        rem_input = cfg.max_prefill_tokens
        rem_chunk = cfg.chunk_size
        swa = self.swa_window is not None
        swa_avail = self._swa_available() if swa else 0
        swa_offset = 0

        def remaining_total() -> float:
            return avail + max(evictable - locked, 0) - total_offset

        def remaining_current() -> float:
            return avail + max(evictable - locked, 0) - current_offset

        def remaining_swa() -> int:
            return swa_avail - swa_offset

        def reserve(extend_len: int, max_new_reserve: int) -> None:
            nonlocal total_offset, current_offset, rem_input, rem_chunk, swa_offset
            paged = ceil_align(extend_len, ps)
            total_offset += paged + ps + max_new_reserve
            current_offset += paged + ps
            if swa:
                swa_offset += self._swa_need(paged, max_new_reserve, rem_chunk)
            rem_input -= paged
            if rem_chunk is not None:
                rem_chunk -= paged

        def budget_state() -> int:  # 0 CONTINUE, 1 NO_TOKEN, 2 OTHER
            if not (remaining_total() > 0 and remaining_current() > 0 and (not swa or remaining_swa() > 0)):
                return 1
            if rem_input <= 0 or (rem_chunk is not None and rem_chunk <= 0):
                return 2
            return 0

        # (rid, prefix_len (held length for a continuing chunk), seq_len, prefill_done)
        batch: list[tuple[int, int, int, bool]] = []
        new_chunked: int | None = None
        chunked = self.chunked
        if chunked is not None:
            held = int(self.kv[chunked])
            fill = self._fill_len(chunked)
            rem = rem_chunk if rem_chunk is not None else fill
            avail_chunk = min(rem, int(remaining_total()))
            if swa:  # SWA: the chunk waits while the SWA pool has no page to spare
                avail_chunk = min(avail_chunk, remaining_swa() - ps)
                if avail_chunk <= 0:
                    return None
            rem = avail_chunk if avail_chunk > 0 else rem
            cand = fill - held
            new_len = min(cand, rem)
            truncated = cand > rem
            batch.append((chunked, held, held + new_len, not truncated))
            max_new_res = 0 if truncated else int(min(self.max_new[chunked], CLIP_MAX_NEW_TOKENS))
            reserve(new_len, max_new_res)
            if truncated:
                new_chunked = chunked

        hicache = cfg.hicache is not None
        loaded_total = 0  # device slots the batch's load-backs take before its allocation
        admitted = 0
        for rid in self.waiting:
            if budget_state() == 2:
                break
            held_rows = 1 if chunked is not None else 0
            if len(batch) >= self._num_allocatable(running_bs, held_rows):
                self.batch_is_full = True
                break
            fill = self._fill_len(rid)
            held = self._held_prefix(rid)
            prefix = matches.get(rid) if held is None else held
            host_hit = 0
            if held is None and hicache:
                prefix, host_hit = self.alloc.match_prefix_hi(self._token_ids(rid, fill, cache=False))  # type: ignore[attr-defined]
            elif held is None and (prefix is None or not cfg.radix_cache):
                prefix = self.alloc.match_prefix(self._token_ids(rid, fill, cache=False)) if cfg.radix_cache else 0
            max_new = int(min(max(self.max_new[rid] - self.out[rid], 0), CLIP_MAX_NEW_TOKENS))
            # the fit counts a host hit as extend (SGLang's total_tokens: fill - device prefix)
            extend = fill - prefix
            # a session's held KV is its own, not the tree's: admitting the turn pins nothing
            pinned = 0 if held is not None else min(prefix, max(evictable - locked, 0))
            total_tokens = extend + max_new + ps
            if not total_tokens < remaining_total() - pinned:
                self.batch_is_full = bool(batch) or running_bs > 0
                break
            loaded, evicts = self._load_back(host_hit, avail - loaded_total, max(evictable - locked - pinned, 0))
            prefix += loaded
            extend -= loaded
            paged = ceil_align(extend, ps)
            chunk_limit = rem_chunk
            if swa:
                chunk_limit = self._swa_chunk_limit(paged, max_new, rem_chunk, remaining_swa())
                if chunk_limit == -1:  # SGLang's NO_TOKEN
                    self.batch_is_full = bool(batch) or running_bs > 0
                    break
            if rem_chunk is None and batch and paged >= rem_input:
                break
            if chunk_limit is not None and paged > chunk_limit:
                extend = floor_align(chunk_limit, ps)
                end = floor_align(prefix + extend, ps)
                extend = end - prefix
                if extend <= 0:
                    break
                new_chunked = rid
                max_new_res = 0
            else:
                max_new_res = int(min(self.max_new[rid], CLIP_MAX_NEW_TOKENS))
            locked += pinned
            batch.append((rid, prefix, prefix + extend, prefix + extend == fill))
            admitted += 1
            reserve(extend, max_new_res)
            if loaded:  # the loaded nodes are the request's, locked: gone from available + evictable
                loaded_total += loaded
                total_offset += loaded
                current_offset += loaded
            if evicts:  # its load-back evicts device leaves a later candidate's match may hold
                if budget_state() == 1:
                    self.batch_is_full = True
                break
            state = budget_state()
            if state != 0:
                if state == 1:
                    self.batch_is_full = bool(batch) or running_bs > 0
                break
            if new_chunked == rid:
                break

        if not batch:
            return None
        # Admitted requests are a prefix of the (policy-ordered) queue.
        del self.waiting[:admitted]
        return self._run_extend(batch, new_chunked)

    def _load_back(self, host_hit: int, free: int, evictable: int) -> tuple[int, bool]:
        """What the extend's ``init_load_back`` will do with a candidate's host hit:
        ``(tokens loaded, whether it evicts device leaves for them)``. All or nothing:
        nothing below ``load_back_threshold`` or beyond the ``free`` device slots (after
        the batch's earlier load-backs) plus the ``evictable`` ones (SGLang then admits
        the request with the host part recomputed)."""
        if host_hit < max(1, LOAD_BACK_THRESHOLD) or host_hit > free + evictable:
            return 0, False
        return host_hit, host_hit > free

    def _swa_available(self) -> int:
        """SWA tokens free or evictable now (SGLang ``SWAPrefillBudget.remaining_swa`` before offsets)."""
        swa = self.alloc.pool_counters()["swa"]  # type: ignore[attr-defined]
        return int(swa.available + swa.evictable)

    def _swa_need(self, extend_len: int, max_new: int, chunk_limit: int | None) -> int:
        """SWA tokens one admission reserves (SGLang ``estimate_swa_kv_tokens``): the part
        of the extend that slides out of the window while it is allocated, plus what stays
        in the window with the decode to come, plus a page."""
        assert self.swa_window is not None
        allocated = extend_len if chunk_limit is None else min(extend_len, chunk_limit)
        return max(allocated - self.swa_window, 0) + min(extend_len + max_new, self.swa_window) + self.ps

    def _swa_chunk_limit(self, paged: int, max_new: int, rem_chunk: int | None, remaining: int) -> int | None:
        """The chunk limit of a new request under the SWA budget (``SWAPrefillBudget.check_prefill``):
        ``rem_chunk`` when its need fits, a smaller chunk when the need reaches the
        whole SWA pool (only a window stays held between chunks), -1 when it must wait."""
        needed = self._swa_need(paged, max_new, rem_chunk)
        if needed < remaining:
            return rem_chunk
        cap = 0
        if needed >= self.swa_pool_tokens:
            cap = max(0, (remaining - self._swa_need(0, max_new, None)) // self.ps * self.ps)
        if rem_chunk is None or cap <= 0:
            return -1
        return min(rem_chunk, cap)

    def _run_extend(self, batch: list[tuple[int, int, int, bool]], new_chunked: int | None) -> float:
        while True:
            rids = np.fromiter((b[0] for b in batch), np.int64, len(batch))
            seq_lens = np.fromiter((b[2] for b in batch), np.int64, len(batch))
            done = np.fromiter((b[3] for b in batch), np.bool_, len(batch))
            token_ids = [self._token_ids(int(r), int(s)) for r, s in zip(rids.tolist(), seq_lens.tolist())]
            result = self.alloc.extend(rids, seq_lens, token_ids, done)
            if isinstance(result, AllocResult):
                break
            # The estimate admitted more than fits: give back the last new request.
            self._stats["extend_retries"] += 1
            last = batch[-1][0]
            if last == self.chunked or len(batch) == 1:
                raise RuntimeError(
                    f"step {self.step}: extend of request {result.rid} needs {result.needed} tokens, "
                    f"free {result.available}, evictable {result.evictable}, although the prefill "
                    "budget admitted it"
                )
            batch.pop()
            self.waiting.insert(0, last)
            if new_chunked == last:
                new_chunked = None
        prefix_lens = result.prefix_lens if result.prefix_lens is not None else np.zeros(len(batch), np.int64)
        prefix_lens = np.asarray(prefix_lens, np.int64)
        # a session's turn starts: it runs on its row again, and its extend says where its prompt ends
        turn = np.fromiter((r in self._idle_rows for r in rids.tolist()), np.bool_, rids.shape[0])
        self._idle_rows.difference_update(rids.tolist())
        self._stats["evicted_tokens"] += result.evicted_tokens
        self._stats["prefill_steps"] += 1

        fresh = self.kv[rids] == 0  # new or re-admitted requests start from position 0
        before = np.where(fresh, prefix_lens, self.kv[rids])
        first = fresh & ~self._first_admitted[rids]
        if first.any():
            self._first_admitted[rids[first]] = True
            self.first_scheduled_s[rids[first]] = self.clock
            self._stats["prefix_hit_tokens"] += int(prefix_lens[first].sum())
            self._stats["prompt_tokens"] += int(self.input_len[rids[first]].sum())
        prompt_lens = np.where(first | turn, self.input_len[rids], -1)
        hashes = [self.hashes[r] if f else None for r, f in zip(rids.tolist(), first.tolist())]
        self.rec.extend(
            rids,
            seq_lens,
            prefix_lens=prefix_lens,
            prompt_lens=prompt_lens,
            block_hashes=hashes if any(h is not None for h in hashes) else None,
            arrival_s=self.arrival[rids],
        )
        duration = self.model.prefill(before, seq_lens - before)
        self.kv[rids] = seq_lens

        # Requests whose prefill completed sampled their next token.
        self.chunked = new_chunked
        if new_chunked is not None:
            self.state[new_chunked] = _CHUNKED
        done_rids = rids[done]
        if done_rids.shape[0]:
            first_token = done_rids[np.isnan(self.first_token_s[done_rids])]
            self.first_token_s[first_token] = self.clock + duration
            self.out[done_rids] += 1
            finished = self.out[done_rids] >= self.max_new[done_rids]
            self._finish(done_rids[finished])
            joining = done_rids[~finished]
            if joining.shape[0]:
                self.state[joining] = _RUNNING
                self.running = np.concatenate([self.running, joining])
        return duration

    def _finish(self, rids: np.ndarray) -> None:
        if rids.shape[0]:
            self.state[rids] = _FINISHING
            self.finishing = np.concatenate([self.finishing, rids])

    # ------------------------------------------------------------------ decode

    def _decode_need(self, rids: np.ndarray, allocated: np.ndarray | None) -> int:
        """Tokens the next decode step of ``rids`` allocates (``new_tokens_required_next_decode``)."""
        ps = self.ps
        if self.cfg.spec is None:
            return ps * int(np.count_nonzero(self.kv[rids] % ps == 0))
        assert allocated is not None
        committed = self.kv[rids]
        nxt = allocated + np.maximum(0, committed + self.reserve - allocated)
        return int(new_page_tokens(allocated, nxt, ps).sum())

    def _fits(self, rids: np.ndarray, allocated: np.ndarray | None) -> bool:
        """The decode memory check: the step's need fits every KV pool (``check_decode_capacity``)."""
        need = self._decode_need(rids, allocated)
        return all(need <= c.available + c.evictable for c in self._pools())

    def _pools(self) -> list[PoolCounters]:
        """Every KV pool's counters now (the full pool, and a hybrid model's SWA pool)."""
        if self.swa_window is None:
            return [self.alloc.counters()]
        return list(self.alloc.pool_counters().values())  # type: ignore[attr-defined]

    def _decode(self) -> float | None:
        """The decode step (``update_running_batch``): memory check, retraction, decode."""
        if self.running.shape[0] == 0:
            return None
        spec = self.cfg.spec
        allocated = self.alloc.request_lens(self.running).allocated if spec is not None else None
        if not self._fits(self.running, allocated):
            self._retract(allocated)
            if self.running.shape[0] == 0:
                self._stats["retract_steps"] += 1
                return self.model.idle()
            allocated = self.alloc.request_lens(self.running).allocated if spec is not None else None
        else:
            self.ratio = max(self.ratio - self.ratio_decay, self.ratio_min)
        rids = self.running
        kv_before = self.kv[rids]
        if spec is None:
            result = self.alloc.decode(rids)
            accepted = None
        else:
            accepted = self._draw_accepted(rids.shape[0])
            result = self.alloc.spec_decode(rids, accepted)
        if isinstance(result, OutOfMemory):
            raise RuntimeError(
                f"step {self.step}: decode of request {result.rid} needs {result.needed} tokens, "
                f"free {result.available}, evictable {result.evictable}, although the decode "
                "memory check passed"
            )
        self._stats["evicted_tokens"] += result.evicted_tokens
        self._stats["row_overflows"] += len(result.row_overflow)
        self._stats["decode_steps"] += 1
        if spec is None:
            self.kv[rids] = kv_before + 1
            self.out[rids] += 1
            self.rec.decode(rids, kv_before + 1)
            duration = self.model.decode(kv_before)
        else:
            assert accepted is not None
            self.kv[rids] = kv_before + accepted
            self.out[rids] += accepted
            self.rec.spec(rids, accepted, spec.num_draft_tokens, kv_before + accepted)
            self._stats["spec_accepted_tokens"] += int(accepted.sum())
            self._stats["spec_steps"] += 1
            self._stats["spec_ops"] += int(rids.shape[0])
            duration = self.model.spec(kv_before, spec.num_draft_tokens, spec.num_steps)
        done = self.out[rids] >= self.max_new[rids]
        if done.any():
            self._finish(rids[done])
            self.running = rids[~done]
        return duration

    def _draw_accepted(self, n: int) -> np.ndarray:
        """Accepted lengths (drafts + bonus): 1 + truncated geometric (see the module docstring)."""
        spec = self.cfg.spec
        assert spec is not None
        m = spec.num_draft_tokens - 1
        alpha = self.cfg.spec_acceptance
        # Number of consecutive successes, each with probability alpha, capped at m.
        draws = self.rng.random((n, m)) < alpha
        run = np.cumprod(draws, axis=1).sum(axis=1) if m > 0 else np.zeros(n, np.int64)
        return (1 + run).astype(np.int32)

    def _retract(self, allocated: np.ndarray | None) -> None:
        """``retract_decode``: release requests until the decode step fits."""
        rids = self.running
        spec = self.cfg.spec
        # Keep-order: most outputs first; ties: shortest prompt first (retracted last).
        order = np.lexsort((self.input_len[rids], -self.out[rids]))
        sorted_rids = rids[order].tolist()
        alloc_of = dict(zip(rids.tolist(), allocated.tolist())) if allocated is not None else {}

        def fits(keep: list[int]) -> bool:
            keep_arr = np.array(keep, np.int64)
            lens = np.array([alloc_of[r] for r in keep], np.int64) if spec is not None else None
            return self._fits(keep_arr, lens)

        retracted: list[int] = []
        first_iter = True
        while first_iter or not fits(sorted_rids):
            if len(sorted_rids) == 1:
                break
            first_iter = False
            rid = sorted_rids.pop()
            # The allocator's retract evicts so that ``len(sorted_rids) * 20`` slots are free.
            self._release_one(rid, "retract")
            retracted.append(rid)
        aborted: list[int] = []
        if len(sorted_rids) <= 1 and not fits(sorted_rids):
            rid = sorted_rids.pop()
            self._release_one(rid, "abort")
            aborted.append(rid)
        self._stats["retractions"] += 1
        self._stats["retracted_requests"] += len(retracted)
        self._stats["aborted"] += len(aborted)
        self.batch_is_full = False
        # SGLang's filter_batch(keep_indices=sorted_indices) leaves the survivors in keep-order.
        self.running = np.array(sorted_rids, np.int64)
        for rid in retracted:
            self.state[rid] = _WAITING
        if self.cfg.pd_decode:
            self.waiting[:0] = retracted
        else:
            self.waiting.extend(retracted)
        for rid in aborted:
            self.state[rid] = _DONE
            self._token_cache.pop(rid, None)
        remaining = self.running
        if remaining.shape[0]:
            decoded = int(self.out[remaining].sum())
            budget = int(self.max_new[remaining].sum())
            self.ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * remaining.shape[0]) / (budget + 1))

    def _release_one(self, rid: int, kind: Literal["retract", "abort"]) -> None:
        rids = np.array([rid], np.int64)
        res = self.alloc.release(rids, self.kv[rids].copy(), None, kind)
        self._stats["evicted_tokens"] += res.evicted_tokens
        if kind == "retract":
            self.rec.retract(rids)
        else:
            self.rec.abort(rids)
            if rid in self._session_of:  # SGLang: an aborted turn ends its session's record
                self._end_session(rid)
        # A retracted request keeps its outputs: its re-prefill (or, in PD decode, its
        # re-pre-allocation) covers the prompt and outputs, the KV it had committed.
        self.kv[rid] = 0

    # ------------------------------------------------------------------ PD decode

    def _pd_prealloc(self) -> float | None:
        """Pre-allocate arriving requests (``DecodePreallocQueue.pop_preallocated``)."""
        if not self.waiting:
            return None
        ps = self.ps
        running = self.running
        retractable = int((self.input_len[running] + self.out[running]).sum()) if running.shape[0] else 0
        if running.shape[0]:
            need_single = int(
                (np.minimum(self.max_new[running], CLIP_MAX_NEW_TOKENS) + self.input_len[running]).max()
            ) - retractable
        else:
            need_single = 0
        # every pool must hold the pre-allocation (a hybrid model's SWA pool too)
        available = min(c.available + (c.evictable if self.cfg.radix_cache else 0) for c in self._pools())
        free_rows = self.cfg.max_running - int(running.shape[0])
        if self.cfg.mamba_slots is not None:  # a row is free only while its Mamba slots are
            free_slots = self.cfg.mamba_slots - self.mamba_slots_per_req * int(running.shape[0])
            free_rows = min(free_rows, free_slots // self.mamba_slots_per_req)
        admitted: list[int] = []
        fills: list[int] = []
        for rid in self.waiting:
            if free_rows <= 0:
                break
            fill = int(self.input_len[rid] + self.out[rid] - 1)
            alloc_tokens = ceil_align(fill, ps)
            required = max(
                alloc_tokens + NUM_RESERVED_DECODE_TOKENS,
                fill + int(min(self.max_new[rid], CLIP_MAX_NEW_TOKENS)) - retractable,
            )
            reserved = NUM_RESERVED_DECODE_TOKENS * (int(running.shape[0]) + len(admitted))
            if required > available - max(reserved, need_single):
                break
            admitted.append(rid)
            fills.append(fill)
            available -= alloc_tokens
            free_rows -= 1
        if not admitted:
            return None
        del self.waiting[: len(admitted)]
        rids = np.array(admitted, np.int64)
        fill_lens = np.array(fills, np.int64)
        token_ids = [self._token_ids(int(r), int(f)) for r, f in zip(admitted, fills)]
        result = self.alloc.prealloc(rids, fill_lens, token_ids)
        if isinstance(result, OutOfMemory):
            raise RuntimeError(
                f"step {self.step}: prealloc of request {result.rid} needs {result.needed} tokens, "
                f"free {result.available}, evictable {result.evictable}, although admission passed"
            )
        self._stats["evicted_tokens"] += result.evicted_tokens
        prefix_lens = (
            np.asarray(result.prefix_lens, np.int64) if result.prefix_lens is not None else np.zeros(len(admitted), np.int64)
        )
        first = ~self._first_admitted[rids]
        duration = self.model.idle()
        if first.any():
            self._first_admitted[rids[first]] = True
            self.first_scheduled_s[rids[first]] = self.clock
            self.first_token_s[rids[first]] = self.clock + duration
            self._stats["prefix_hit_tokens"] += int(prefix_lens[first].sum())
            self._stats["prompt_tokens"] += int(self.input_len[rids[first]].sum())
        hashes = [self.hashes[r] if f else None for r, f in zip(admitted, first.tolist())]
        self.rec.prealloc(
            rids,
            fill_lens,
            prefix_lens=prefix_lens,
            prompt_lens=np.where(first, self.input_len[rids], -1),
            block_hashes=hashes if any(h is not None for h in hashes) else None,
            arrival_s=self.arrival[rids],
        )
        self.kv[rids] = fill_lens
        done = self.out[rids] >= self.max_new[rids]
        self._finish(rids[done])
        joining = rids[~done]
        self.state[joining] = _RUNNING
        self.running = np.concatenate([self.running, joining])
        self._stats["prefill_steps"] += 1
        return duration
