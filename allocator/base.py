"""The allocator contract: configuration, the batched ``Allocator`` protocol, results.

Any allocator *version* (the built-in one, a module, a file, a git revision of a
repository holding an ``allocator`` package) exposes ``create_allocator(config)``
returning an object that satisfies ``Allocator``. The replay engine and the
scheduler model drive it only through this protocol, one batched call per op kind
per step, so two versions can be replayed on one trace and compared.

Requests are named by dense integer ids (``rids``, int64 numpy arrays). Token ids
(int64 numpy arrays) are passed only where the radix cache needs them: on extend
(prefix match, checkpoint of a continuing chunk), on prealloc and on release
(insert of the owned prefix). Decode and speculative steps need no token ids.

Running out of KV slots is a result (``OutOfMemory``), never an exception, and
leaves the allocator exactly as it was before the call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol, Sequence, runtime_checkable

from allocator.evict_policy import EvictionPolicy, check_eviction_policy

if TYPE_CHECKING:
    import numpy as np

    from allocator.ownership import SlotOwnership

# SGLang keeps this many decode steps' worth of slots free per request still
# running after a retraction (``SGLANG_RETRACT_DECODE_STEPS``).
RETRACT_DECODE_STEPS = 20
# Slot indices and positions are int32 (the dtype of req_to_token).
MAX_SLOTS = (1 << 31) - 1

SpecAlgorithm = Literal["eagle", "eagle3", "standalone", "dflash", "uno"]


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """Speculative decoding settings (SGLang's ``speculative_*`` server arguments)."""

    algorithm: SpecAlgorithm = "eagle"
    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int = 4


@dataclass(frozen=True, slots=True)
class SwaConfig:
    """A hybrid sliding-window model's second KV pool (SGLang's ``SWATokenToKVPoolAllocator``).

    Args:
        window: tokens each sliding-window layer attends back (the model's
            ``sliding_window_size``; PD prealloc sizes its SWA tail by it).
        swa_full_tokens_ratio: SWA pool tokens per full pool token (SGLang's
            ``--swa-full-tokens-ratio``, default 0.8); the SWA pool holds
            ``floor_align(int(full_tokens * ratio), page_size)`` tokens.
        swa_pool_tokens: an explicit SWA pool size instead of the ratio (rounded
            down to a page), or None.
        eviction_interval: tokens that must slide out of the window before a decode
            step frees them (``SGLANG_SWA_EVICTION_INTERVAL``, default 128).
        overlap_chunked_prefill: with SGLang's overlap scheduler, its
            ``chunked_prefill_size``: a continuing prefill chunk frees the window
            behind ``prefix - this`` (the previous chunk may still be running). 0: the
            non-overlap scheduler's rule (behind ``prefix``).
        draft_window: tokens back from the committed length that a fused draft reads
            in the SWA pool (SGLang's ``draft_swa_window``: a multi-layer EAGLE
            draft's largest window plus its front tokens), 0 when none.
        release_prefill_swa: ``SGLANG_OPT_RELEASE_PREFILL_SWA`` (off by default in
            SGLang): once a request has decoded ``retain_window`` steps, the SWA part
            of its radix-tree lock is released early, leaving its prefix's SWA
            evictable (the FULL lock stays until the request ends).
    """

    window: int
    swa_full_tokens_ratio: float = 0.8
    swa_pool_tokens: int | None = None
    eviction_interval: int = 128
    overlap_chunked_prefill: int = 0
    draft_window: int = 0
    release_prefill_swa: bool = False

    @property
    def retain_window(self) -> int:
        """SWA history kept per request (SGLang ``swa_retain_window``): what every
        reader of the SWA pool needs, so out-of-window frees and the radix tree's SWA
        side use it; the model's own window stays ``window``."""
        return max(self.window, self.draft_window)

    def pool_tokens(self, full_tokens: int, page_size: int) -> int:
        """SWA pool tokens for a full pool of ``full_tokens`` (SGLang ``_solve_pool_sizes``)."""
        size = self.swa_pool_tokens if self.swa_pool_tokens is not None else int(full_tokens * self.swa_full_tokens_ratio)
        return size // page_size * page_size


MambaBufferMode = Literal["no_buffer", "extra_buffer", "extra_buffer_lazy"]

# SGLang's Mamba slots per running request with the radix cache on, before tracking
# slots (``MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO``); one less with
# ``SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK``, given back under no_buffer.
MAMBA_SLOTS_PER_REQUEST = 3


@dataclass(frozen=True, slots=True)
class MambaConfig:
    """A hybrid linear-attention model's Mamba state pool (SGLang's ``HybridReqToTokenPool``).

    Args:
        slots: state slots (SGLang ``max_mamba_cache_size``, per DP shard).
        strategy: ``--mamba-radix-cache-strategy``: "no_buffer" (one slot per request;
            page size 1, no overlap scheduler), "extra_buffer" (plus ping-pong
            tracking slots) or "extra_buffer_lazy" (the second tracking slot taken
            only at track boundaries). With the radix cache off SGLang runs no buffer.
        overlap_schedule: SGLang's overlap scheduler is on (2 tracking entries, else 1).
        skip_decode_lock: ``SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK`` (slot budget per request).
    """

    slots: int
    strategy: MambaBufferMode = "no_buffer"
    overlap_schedule: bool = False
    skip_decode_lock: bool = False

    @property
    def extra_buffer(self) -> bool:
        return self.strategy != "no_buffer"

    def ping_pong_size(self) -> int:
        """Entries of a request's tracking buffer (``mamba_ping_pong_track_buffer_size``)."""
        return 2 if self.overlap_schedule else 1

    def tracking_slots(self) -> int:
        """Tracking slots taken at admission (SGLang ``get_mamba_tracking_slots``)."""
        if not self.extra_buffer:
            return 0
        if self.strategy == "extra_buffer_lazy":
            return 1
        return 2 if self.overlap_schedule else 1

    def slots_per_request(self, radix_cache: bool = True) -> int:
        """Slots budgeted per running request (SGLang ``_calculate_mamba_ratio``)."""
        if not radix_cache:
            return 1
        base = MAMBA_SLOTS_PER_REQUEST - (1 if self.skip_decode_lock else 0)
        if self.extra_buffer:
            return base + self.tracking_slots()
        return base + (1 if self.skip_decode_lock else 0)

    def max_running_cap(self, radix_cache: bool = True) -> int:
        """The most running requests the pool lets SGLang configure (``slots // ratio``)."""
        return self.slots // self.slots_per_request(radix_cache)

    def check(self, page_size: int = 1, radix_cache: bool = True) -> None:
        """Refuse a configuration SGLang refuses (ValueError naming the field). The
        buffer mode's page-size and overlap rules hold only with the radix cache on:
        without it SGLang never resolves a Mamba radix strategy (``_mamba_radix_cache_resolution``)."""
        if self.slots < 1:
            raise ValueError(f"MambaConfig.slots must be >= 1, found {self.slots}")
        if self.strategy not in ("no_buffer", "extra_buffer", "extra_buffer_lazy"):
            raise ValueError(f"MambaConfig.strategy: unknown mode {self.strategy!r}")
        if self.strategy == "extra_buffer_lazy" and not self.overlap_schedule:
            raise ValueError("MambaConfig: extra_buffer_lazy needs the overlap scheduler (overlap_schedule=True)")
        if not radix_cache:
            return
        if self.strategy == "no_buffer" and page_size != 1:
            raise ValueError(f"MambaConfig: no_buffer runs at page size 1 only, found {page_size}")
        if self.strategy == "no_buffer" and self.overlap_schedule:
            raise ValueError("MambaConfig: no_buffer does not run with the overlap scheduler (overlap_schedule=False)")


HiCacheWritePolicy = Literal["write_through", "write_through_selective", "write_back"]


@dataclass(frozen=True, slots=True)
class HiCacheConfig:
    """HiCache's host KV tier under the radix cache (SGLang's ``--hicache-*`` options).

    Args:
        host_ratio: host pool tokens per device pool token (``--hicache-ratio``; SGLang's
            default in cache mode is 2.0).
        host_pool_tokens: an explicit host pool size in tokens instead of the ratio
            (page aligned, used as is: SGLang's ``host_token_capacity``), or None.
        write_policy: ``--hicache-write-policy`` (SGLang's default ``write_through``).
        page_size: tokens per page of both pools (the device pool's page size).
    """

    host_ratio: float = 2.0
    host_pool_tokens: int | None = None
    write_policy: HiCacheWritePolicy = "write_through"
    page_size: int = 1

    def pool_tokens(self, device_tokens: int) -> int:
        """Host pool tokens for a device pool of ``device_tokens`` (SGLang ``HostKVCache``:
        ``int(device * ratio)`` rounded down to a page, plus one padding page)."""
        ps = self.page_size
        if self.host_pool_tokens is not None:
            return self.host_pool_tokens
        return (int(device_tokens * self.host_ratio) // ps + 1) * ps

    def check(self) -> None:
        """Refuse a configuration SGLang refuses (ValueError naming the field)."""
        if self.page_size < 1:
            raise ValueError(f"HiCacheConfig.page_size must be >= 1, found {self.page_size}")
        if self.write_policy not in ("write_through", "write_through_selective", "write_back"):
            raise ValueError(f"HiCacheConfig.write_policy: unknown policy {self.write_policy!r}")
        if self.host_pool_tokens is not None and (
            self.host_pool_tokens <= 0 or self.host_pool_tokens % self.page_size
        ):
            raise ValueError(
                f"HiCacheConfig.host_pool_tokens must be positive and page aligned, found {self.host_pool_tokens}"
            )
        if self.host_pool_tokens is None and self.host_ratio <= 0:
            raise ValueError(f"HiCacheConfig.host_ratio must be > 0, found {self.host_ratio}")


@dataclass(frozen=True, slots=True)
class AllocatorConfig:
    """Sizes and switches of one allocator instance.

    Args:
        pool_tokens: KV slots in the pool (SGLang ``max_total_num_tokens``); rounded
            down to a multiple of ``page_size``.
        page_size: tokens per KV page; 1 selects the token allocator.
        max_running: request rows of ``req_to_token`` (SGLang ``max_running_requests``).
        max_context_len: longest request; a row is wider by SGLang's headroom.
        device: where ``req_to_token`` lives: ``"cpu"`` or ``"cuda"`` (Triton kernels).
        need_sort: PD-disaggregation free-list mode (sorted reuse through a release list).
        spec: speculative decoding settings, or None.
        hisparse: PD decode with a HiSparse logical/device allocator pair.
        hisparse_ratio: logical pool size as a multiple of ``pool_tokens`` (HiSparse).
        extra_rows: additional request rows (PD decode pre-allocation queue).
        radix_cache: keep a radix prefix cache (False: every request computes its prompt).
        eviction_policy: which unlocked leaf the radix cache evicts first (SGLang's
            ``--radix-eviction-policy``; ``allocator.evict_policy``).
        debug_checks: run expensive assertions inside the allocation functions.
        swa: the sliding-window pool of a hybrid model, or None (full attention only).
        mamba: the Mamba state pool of a hybrid linear-attention model, or None (no
            linear-attention layers): the request pool is then ``HybridReqToTokenPool``.
        hicache: HiCache's host tier under the radix cache, or None: the tree is then
            ``allocator.hiradix.HiRadixCache`` (full-attention models only).
    """

    pool_tokens: int
    page_size: int = 1
    max_running: int = 256
    max_context_len: int = 131_072
    device: str = "cpu"
    need_sort: bool = False
    spec: SpecConfig | None = None
    hisparse: bool = False
    hisparse_ratio: int = 2
    extra_rows: int = 0
    radix_cache: bool = True
    eviction_policy: EvictionPolicy = "lru"
    debug_checks: bool = False
    swa: SwaConfig | None = None
    mamba: MambaConfig | None = None
    hicache: HiCacheConfig | None = None

    def check(self) -> None:
        """Refuse a configuration no allocator can be built from.

        Raises:
            ValueError: naming the field, the value and the limit.
        """
        config = self
        ps = config.page_size
        if ps < 1:
            raise ValueError(f"AllocatorConfig.page_size must be >= 1, found {ps}")
        if config.pool_tokens < 2 * ps:
            raise ValueError(f"AllocatorConfig.pool_tokens {config.pool_tokens} is below two pages (page size {ps})")
        for name in ("pool_tokens", "max_context_len"):
            if getattr(config, name) > MAX_SLOTS:
                raise ValueError(
                    f"AllocatorConfig.{name} {getattr(config, name)} exceeds 2**31 - 1 "
                    "(slot indices and positions are int32, as in SGLang's req_to_token)"
                )
        if config.max_running < 1:
            raise ValueError(f"AllocatorConfig.max_running must be >= 1, found {config.max_running}")
        if config.max_context_len < 1:
            raise ValueError(f"AllocatorConfig.max_context_len must be >= 1, found {config.max_context_len}")
        if config.hisparse and config.radix_cache:
            raise ValueError("AllocatorConfig: HiSparse is incompatible with the radix cache (set radix_cache=False)")
        if config.hisparse and config.hisparse_ratio < 1:
            raise ValueError(f"AllocatorConfig.hisparse_ratio must be >= 1, found {config.hisparse_ratio}")
        try:
            check_eviction_policy(config.eviction_policy)
        except ValueError as exc:
            raise ValueError(f"AllocatorConfig.eviction_policy: {exc}") from None
        if config.eviction_policy != "lru" and config.swa is not None:
            raise ValueError(
                f"AllocatorConfig.eviction_policy {config.eviction_policy!r}: the SWA radix tree evicts by "
                "LRU only (SGLang's unified tree takes other policies; kvtrace's SWA tree does not yet)"
            )
        if config.swa is not None:
            _check_swa(config)
        if config.mamba is not None:
            _check_mamba(config)
        if config.hicache is not None:
            _check_hicache(config)


def _check_hicache(config: AllocatorConfig) -> None:
    """Refuse a host tier the built-in allocator cannot run (ValueError): the host tier
    sits under the full-attention radix tree only (``allocator.hiradix``)."""
    hicache = config.hicache
    assert hicache is not None
    hicache.check()
    if hicache.page_size != config.page_size:
        raise ValueError(
            f"AllocatorConfig: the host pool's page size {hicache.page_size} differs from the device pool's "
            f"{config.page_size} (SGLang gives both the same)"
        )
    for switch, what in (("swa", "an SWA pool"), ("mamba", "a Mamba pool"), ("spec", "speculative decoding"),
                         ("hisparse", "HiSparse"), ("need_sort", "PD decode (need_sort)")):
        if getattr(config, switch):
            raise ValueError(f"AllocatorConfig: the HiCache host tier with {what} is not implemented (set {switch} off)")
    if not config.radix_cache:
        raise ValueError("AllocatorConfig: the HiCache host tier needs the radix cache (set radix_cache=True)")
    if config.eviction_policy != "lru":
        raise ValueError(f"AllocatorConfig: the HiCache tree evicts by LRU only, not {config.eviction_policy!r}")


def _check_mamba(config: AllocatorConfig) -> None:
    """Refuse a Mamba configuration the built-in allocator cannot run (ValueError)."""
    mamba = config.mamba
    assert mamba is not None
    mamba.check(config.page_size, config.radix_cache)
    if config.radix_cache and (mamba.strategy == "extra_buffer_lazy" or mamba.overlap_schedule):
        # the overlap pipeline's lookahead decides those modes' tracking (docs/mamba-semantics.md §12.8)
        raise ValueError(f"AllocatorConfig: a Mamba radix cache with {mamba.strategy} under the overlap scheduler "
                         "is not implemented: use strategy='extra_buffer' (or 'no_buffer') with overlap_schedule=False")
    if config.radix_cache and config.eviction_policy != "lru":
        raise ValueError(f"AllocatorConfig.eviction_policy {config.eviction_policy!r}: the Mamba radix tree "
                         "evicts by LRU only")
    for switch, what in (("hisparse", "HiSparse"), ("need_sort", "PD decode (need_sort)")):
        if getattr(config, switch):
            raise ValueError(f"AllocatorConfig: a Mamba pool with {what} is not implemented (set {switch}=False)")
    if config.swa is not None:
        raise ValueError("AllocatorConfig: a Mamba pool beside an SWA pool is not implemented (set swa=None)")


HISPARSE_SWA_REFUSAL = "SGLang 0.5.23 does not serve HiSparse with sliding-window models"


def _check_swa(config: AllocatorConfig) -> None:
    """Refuse an SWA configuration the built-in allocator cannot run (ValueError)."""
    swa = config.swa
    assert swa is not None
    ps = config.page_size
    if swa.window < 1:
        raise ValueError(f"SwaConfig.window must be >= 1, found {swa.window}")
    if swa.overlap_chunked_prefill < 0:
        raise ValueError(f"SwaConfig.overlap_chunked_prefill must be >= 0, found {swa.overlap_chunked_prefill}")
    if swa.draft_window < 0:
        raise ValueError(f"SwaConfig.draft_window must be >= 0, found {swa.draft_window}")
    if swa.eviction_interval < 1:
        raise ValueError(f"SwaConfig.eviction_interval must be >= 1, found {swa.eviction_interval}")
    if swa.swa_pool_tokens is None and not 0 < swa.swa_full_tokens_ratio <= 1:
        raise ValueError(f"SwaConfig.swa_full_tokens_ratio must be in (0, 1], found {swa.swa_full_tokens_ratio}")
    swa_tokens = swa.pool_tokens(config.pool_tokens // ps * ps, ps)
    # SGLang's validate_swa_pool_size: a pool at or below window + page admits nothing.
    if swa.window + ps >= swa_tokens:
        raise ValueError(
            f"SwaConfig: the SWA pool ({swa_tokens} tokens) cannot hold one request: it must exceed "
            f"window {swa.window} + page size {ps}"
        )
    if swa_tokens > MAX_SLOTS:
        raise ValueError(f"SwaConfig: SWA pool tokens {swa_tokens} exceed 2**31 - 1")
    if config.hisparse:
        # SGLang builds SWATokenToKVPoolAllocator for a hybrid SWA model before it looks at
        # --enable-hisparse, whose validation admits DSA, DeepSeek V4 and MiniMax M3 only.
        raise ValueError(HISPARSE_SWA_REFUSAL)


class PoolCounters(NamedTuple):
    """Token counts of the pool at one instant. Conservation (checked by invariants):

    ``available + evictable + protected + committed + overallocated + session_held == pool_tokens``

    where ``committed`` is live requests' KV outside the tree
    (``sum(kv_committed_len - cache_protected_len)``) and ``overallocated`` the rest
    of what they physically hold (``sum(ceil_align(kv_allocated_len) - kv_committed_len)``:
    speculative slack and page tails).
    """

    pool_tokens: int
    available: int
    evictable: int
    protected: int
    committed: int
    overallocated: int
    running_requests: int
    free_rows: int
    # Streaming sessions: KV held between a conversation's turns, outside the tree
    # (``sum(kv_committed_len - cache_protected_len)`` of held requests; not in ``committed``).
    session_held: int = 0

    @property
    def used_tokens(self) -> int:
        """Tokens that cannot be handed out without releasing a request: neither free nor
        evictable (``committed + overallocated + protected``)."""
        return self.pool_tokens - self.available - self.evictable


class RequestLens(NamedTuple):
    """Per-request bookkeeping for the asked ``rids`` (0 for a request holding no KV)."""

    allocated: np.ndarray  # int64 [n] kv_allocated_len
    committed: np.ndarray  # int64 [n] kv_committed_len
    protected: np.ndarray  # int64 [n] cache_protected_len


@dataclass(frozen=True, slots=True)
class OutOfMemory:
    """An allocation that did not fit, even after evicting the radix cache.

    ``rid`` is the first request of the batch that could not be served (the batch
    is all-or-nothing, as in SGLang); ``needed`` the tokens the whole call needed.
    ``op`` is ``"extend"``, ``"decode"``, ``"spec"`` or ``"prealloc"`` for KV slots,
    ``"extend_rows"`` / ``"prealloc_rows"`` when request rows ran out (``needed``,
    ``available`` then count rows). Eviction of unlocked cache done before the
    attempt stays done (SGLang evicts first); nothing else changes.
    """

    op: str
    rid: int
    needed: int
    available: int
    evictable: int
    pool: str = "full"  # the pool that ran short: "full", "swa" (sliding window) or "mamba" (state slots)


@dataclass(frozen=True, slots=True)
class AllocResult:
    """A successful batched allocation.

    Attributes:
        num_tokens: KV slots handed out by this call.
        evicted_tokens: tokens evicted from the radix cache to make room.
        prefix_lens: extend/prealloc: prefix reused per request (radix hit for new
            requests, the already-held length for a continuing chunk); else empty.
        row_overflow: rids whose speculative reserve was clipped at the row width
            (an invariant violation SGLang does not catch; reported, never written).
    """

    num_tokens: int
    evicted_tokens: int = 0
    prefix_lens: np.ndarray | None = None
    row_overflow: tuple[tuple[int, int, int], ...] = ()  # (rid, positions asked, row width)
    # extend with a host tier: per request, the part of ``prefix_lens`` loaded back from
    # the host pool at admission (0 for a device hit, a miss or a continuing chunk); else None
    host_hit_lens: np.ndarray | None = None


@dataclass(frozen=True, slots=True)
class ReleaseResult:
    """What one batched release returned to the pool.

    Attributes:
        freed_tokens: slots returned to the free list.
        cached_tokens: tokens newly inserted into the radix cache (checkpoint).
        overalloc_released: per request, slots of ``[ceil_align(owned), allocated)``
            freed by the over-allocation helper (speculative slack).
        evicted_tokens: retract only: tokens evicted from the radix cache after each
            retracted request (SGLang's ``release_req`` keeps ``remaining * 20`` slots
            free for the requests still decoding).
    """

    freed_tokens: int
    cached_tokens: int
    overalloc_released: np.ndarray  # int64 [n], aligned with the rids released
    evicted_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken invariant, with the numbers that prove it."""

    check: str
    detail: str
    rid: int | None = None
    values: dict[str, int] = field(default_factory=dict)
    pool: str = "full"  # the pool the invariant is about: "full", "swa" or "mamba"


AllocOutcome = AllocResult | OutOfMemory
ReleaseKind = Literal["finish", "retract", "abort"]


@runtime_checkable
class Allocator(Protocol):
    """What the replay engine and the scheduler model call, one batch per op kind."""

    config: AllocatorConfig

    def extend(
        self,
        rids: np.ndarray,
        seq_lens: np.ndarray,
        token_ids: Sequence[np.ndarray],
        prefill_done: np.ndarray | None = None,
    ) -> AllocOutcome:
        """Prefill (or the next prefill chunk of) each request up to ``seq_lens[i]``.

        A request holding no KV is matched against the radix cache (hit capped so
        at least one token is computed, page aligned), locked, given a row; a
        request already holding KV continues its chunked prefill (its previous
        chunk is checkpointed into the tree first). ``token_ids[i]`` covers at
        least ``[0, seq_lens[i])``. Sets allocated = committed = seq_len.
        Where ``prefill_done[i]`` (default: all), this chunk completes the prefill
        and the prompt is published to the radix cache, as SGLang's result
        processing does after the last chunk: at the end of the step, i.e. after
        this step's ``decode`` / ``spec_decode`` (if any) and before any other call.
        """
        ...

    def decode(self, rids: np.ndarray) -> AllocOutcome:
        """One decode token per request: allocated and committed grow by one."""
        ...

    def spec_decode(self, rids: np.ndarray, accepted_lens: np.ndarray) -> AllocOutcome:
        """One speculative step: reserve up to ``ceil_align(committed + reserve)``
        (monotone allocated length), then commit ``accepted_lens[i]`` tokens."""
        ...

    def prealloc(self, rids: np.ndarray, fill_lens: np.ndarray, token_ids: Sequence[np.ndarray]) -> AllocOutcome:
        """PD decode: take a row and slots for ``fill_lens[i]`` tokens arriving from
        prefill (prefix reused from the local radix cache when enabled; HiSparse:
        logical-only allocation). With the radix cache, each request's KV is published
        in the call, as SGLang's ``process_prebuilt`` does before the step's decode."""
        ...

    def release(
        self,
        rids: np.ndarray,
        owned_lens: np.ndarray,
        token_ids: Sequence[np.ndarray] | None,
        kind: ReleaseKind,
    ) -> ReleaseResult:
        """Release each request's KV. ``finish`` checkpoints the owned prefix into the
        radix cache (``token_ids[i]`` covers ``[0, owned_lens[i])``); ``retract`` and
        ``abort`` cache nothing. Over-allocated slots are always freed. ``retract``
        releases the requests one at a time in the order given and, after each, evicts
        cache so that ``remaining * RETRACT_DECODE_STEPS`` slots are free, where
        ``remaining`` counts the requests still holding KV with their prefill done
        (SGLang ``release_req``)."""
        ...

    def end_step(self) -> None:
        """The step is over: apply what SGLang applies after the step's forward pass (the
        prompt publishes queued by this step's ``extend`` / ``prealloc``). The replay
        engine calls it once per step, after the step's last call."""
        ...

    def evict(self, num_tokens: int) -> int:
        """Evict at least ``num_tokens`` unlocked cached tokens (LRU); return tokens evicted."""
        ...

    def match_prefix(self, token_ids: np.ndarray) -> int:
        """Length the radix cache would reuse for this key (page aligned, capped at len-1)."""
        ...

    def counters(self) -> PoolCounters:
        """Pool token counts now (O(1))."""
        ...

    def request_lens(self, rids: np.ndarray) -> RequestLens:
        """Bookkeeping of the given requests."""
        ...

    def holds_kv(self, rids: np.ndarray) -> np.ndarray:
        """Bool per request: does it hold a row (and KV) now."""
        ...

    def row_slots(self, rid: int) -> np.ndarray:
        """Physical KV slots of ``req_to_token[row(rid), 0:kv_allocated_len]`` (host copy)."""
        ...

    def check_integrity(self, touched: np.ndarray | None = None) -> list[Violation]:
        """Every broken invariant (empty list when sound): of the whole state when
        ``touched`` is None, else of what the calls since the previous check changed
        (``touched``: the request ids of those calls). A version may take no
        ``touched`` argument: it is then always asked for the whole state."""
        ...


class RunResult(NamedTuple):
    """What a run of decode / speculative steps did, step by step."""

    counters: np.ndarray  # int64 [num_steps, len(PoolCounters._fields)] pool counters after each step
    allocated: np.ndarray  # int64 [num_steps, bs] kv_allocated_len of each request after each step
    # the counters of the pools after the full one (a hybrid model's SWA pool), each as ``counters``
    other_pools: tuple[np.ndarray, ...] = ()
    # int64 [num_steps, bs]: with a sliding-window pool, each request's SWA cursor
    # (``swa_evicted_seqlen``) after each step; None otherwise
    swa_evicted: np.ndarray | None = None


@runtime_checkable
class DecodeRuns(Protocol):
    """An allocator that can apply a run of plain decode (or speculative) steps of one
    batch in one call (the replay's fast path for decode-heavy traffic). Optional."""

    def decode_run(self, rids: np.ndarray, num_steps: int) -> RunResult | None:
        """Exactly what ``num_steps`` calls of ``decode(rids)`` do, in one call.

        Returns:
            The pool counters and allocated lengths after each step; or None when the
            allocator cannot do this run in one block (nothing changed: the caller
            decodes step by step).
        """
        ...

    def spec_decode_run(self, rids: np.ndarray, accepted: np.ndarray) -> RunResult | None:
        """Exactly what ``spec_decode(rids, accepted[j])`` for each row ``j`` of the int64
        ``[num_steps, len(rids)]`` array ``accepted`` does, in one call; returns as
        ``decode_run``."""
        ...


@runtime_checkable
class OwnershipQuery(Protocol):
    """An allocator that can say who holds each KV slot (the dashboard's page map).
    Optional: without it the page map is not shown."""

    def slot_ownership(self) -> SlotOwnership:
        """The state and owning request of every KV slot of the pool (``allocator.ownership``)."""
        ...


@runtime_checkable
class Checkpointable(Protocol):
    """An allocator whose whole state can be saved and restored (seek in a replay).

    ``save_state()`` returns an opaque object that no later call mutates;
    ``restore_state(state)`` puts the allocator back exactly as it was when the state
    was saved (so replaying the same calls from there gives the same results), and may
    be called any number of times with the same state. Optional: a version without it
    is sought by replaying from the start.
    """

    def save_state(self) -> object:
        """A snapshot of the whole state (memory proportional to what is live)."""
        ...

    def restore_state(self, state: object) -> None:
        """Go back to a state ``save_state`` returned."""
        ...


@runtime_checkable
class Digestible(Protocol):
    """An allocator that can digest its physical state (``kvtrace diff --exact``).

    ``state_digest()`` returns a string that is equal for two allocators exactly when
    their physical states are equal: each request's ``req_to_token`` row over
    ``[0, kv_allocated_len)`` with its lengths, the free lists in reuse order, the
    free request rows. Called after every step, so it must be cheap (the built-in
    one is kept incrementally: ``allocator.check.digest``). Optional: a version without it
    is compared on its counters and per-request lengths only.
    """

    def state_digest(self) -> str:
        """The digest of the state now (between steps)."""
        ...
