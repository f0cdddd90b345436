"""A trace's serving configuration -> the allocator configuration that serves it, and
whether this machine has the memory to build it.

``allocator_config_for`` maps a trace's recorded serving config (with what-if
overrides) to an ``AllocatorConfig``; the scheduler model records with it and the
replay session replays with it, so both run the same allocator for the same trace.
``effective_config`` is the one place a replay's configuration is decided from the
trace, the allocator version (which may fix a page size) and the user's options.
The pool is rounded down to whole pages by ``allocator.sizing.pool_size_tokens``
only. ``check_memory`` refuses, before a pool is built, what the machine cannot hold.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

from allocator.base import HISPARSE_SWA_REFUSAL, AllocatorConfig, HiCacheConfig, MambaConfig, SpecConfig, SwaConfig
from allocator.sizing import PoolMemory, pool_memory, pool_size_tokens, req_to_token_width
from kvtrace.errors import ConfigError
from traces.checker import CHECKER_BYTES_PER_RID
from traces.mamba_layout import MambaLayout
from traces.metadata import AttentionLayout, ModelShape, SpecSettings, TraceMeta
from traces.tokens import TokenStore

# What a user calls each sizing field: where a replay takes it from (the trace's
# metadata, unless an option overrides it), and the options of ``kvtrace record``.
TRACE_FIELDS: dict[str, str] = {
    "pool_tokens": "metadata config.pool_tokens",
    "page_size": "metadata config.page_size",
    "max_running": "metadata config.max_running",
    "max_context_len": "metadata config.max_context_len",
}
RECORD_OPTIONS: dict[str, str] = {
    "pool_tokens": "--pool-tokens",
    "page_size": "--page-size",
    "max_running": "--max-running",
    "max_context_len": "--context-len",
}


def replay_names(*, pool_tokens: bool = False, page_size: bool = False) -> dict[str, str]:
    """``TRACE_FIELDS`` with the fields a replay's what-if options override named by them."""
    names = dict(TRACE_FIELDS)
    if pool_tokens:
        names["pool_tokens"] = "--pool-tokens"
    if page_size:
        names["page_size"] = "--page-size"
    return names


# The replay engine's per-request columns (seen, dropped, prefill target) and those
# of the op-sequence checker checking its steps.
_REPLAY_BYTES_PER_RID = 10 + CHECKER_BYTES_PER_RID


def spec_config_for(spec: SpecSettings | None) -> SpecConfig | None:
    """The allocator's speculative settings for a trace's (None: no speculative decoding).

    Args:
        spec: the recorded engine's speculative settings, or None.

    Returns:
        The same settings as an ``allocator.base.SpecConfig``, or None.
    """
    if spec is None:
        return None
    return SpecConfig(
        algorithm=spec.algorithm,
        num_steps=spec.num_steps,
        topk=spec.topk,
        num_draft_tokens=spec.num_draft_tokens,
    )


def swa_config_for(layout: AttentionLayout | None, *, resized: bool = False) -> SwaConfig | None:
    """The allocator's sliding-window pool for a trace's attention layout (None: a
    full-attention model, one pool).

    Args:
        layout: the trace's ``TraceMeta.attention``.
        resized: the full pool or the page size differs from the recorded one (a
            what-if): the SWA pool then follows the recorded ratio, as SGLang derives
            it, instead of the recorded size.
    """
    if layout is None:
        return None
    draft = getattr(layout, "draft_sliding_window", 0)
    release = getattr(layout, "release_prefill_swa", False)
    return SwaConfig(
        window=layout.sliding_window,
        swa_full_tokens_ratio=layout.swa_full_tokens_ratio,
        swa_pool_tokens=None if resized else layout.swa_pool_tokens,
        # an allocator version without these fields still builds when they are off
        **({"draft_window": draft} if draft else {}),
        **({"release_prefill_swa": True} if release else {}),
    )


def allocator_config_for(
    meta: TraceMeta,
    *,
    page_size: int | None = None,
    pool_tokens: int | None = None,
    device: str = "cpu",
    radix_cache: bool | None = None,
    debug_checks: bool = False,
    eviction_policy: str | None = None,
    hicache_ratio: float | None = None,
    hicache_write_policy: str | None = None,
) -> AllocatorConfig:
    """The allocator configuration a trace's serving config asks for, with what-if
    overrides. ``radix_cache`` and ``eviction_policy`` default to what the trace was
    recorded with; so does HiCache's host tier (``hicache_config_for``), which
    ``hicache_ratio`` / ``hicache_write_policy`` change or turn on; the pool
    is rounded down to whole pages. A trace with an attention layout gets the
    sliding-window pool too (``swa_config_for``), one with a Mamba layout the Mamba
    state pool (``mamba_config_for``).

    Raises:
        ConfigError: the resulting configuration is one no allocator can be built
            from (``AllocatorConfig.check``), e.g. a pool below two pages, or one the
            allocator does not serve yet (``unsupported_swa``, ``unserved_mamba``,
            ``unserved_hicache``).
    """
    cfg = meta.config
    unserved = unserved_mamba(
        meta, cfg.radix_cache if radix_cache is None else radix_cache, cfg.page_size if page_size is None else page_size
    )
    if unserved is not None:
        raise ConfigError(unserved)
    ps = cfg.page_size if page_size is None else page_size
    pool = cfg.pool_tokens if pool_tokens is None else pool_tokens
    if ps <= 0:
        raise ConfigError(f"page size must be positive, got {ps}")
    resized = ps != cfg.page_size or pool != cfg.pool_tokens
    policy = cfg.eviction_policy if eviction_policy is None else eviction_policy
    swa = swa_config_for(meta.attention, resized=resized)
    # Only a sliding-window trace names ``swa``: a version from before the field builds
    # every full-attention trace as it always did.
    if swa is not None and "swa" not in {f.name for f in dataclasses.fields(AllocatorConfig)}:
        raise ConfigError("this allocator version has no sliding-window (SWA) pool: it cannot replay a trace "
                          "with an attention layout (kvtrace info shows the trace's)")
    if policy != "lru" and "eviction_policy" not in {f.name for f in dataclasses.fields(AllocatorConfig)}:
        raise ConfigError(f"this allocator version has no eviction policies: it evicts by LRU only, not {policy!r}")
    radix = cfg.radix_cache if radix_cache is None else radix_cache
    hicache = hicache_config_for(meta, pool, ps, resized, hicache_ratio, hicache_write_policy)
    if hicache is not None and "hicache" not in {f.name for f in dataclasses.fields(AllocatorConfig)}:
        raise ConfigError(unserved_hicache(meta) or "this allocator version has no HiCache host tier")
    mamba = mamba_config_for(
        meta.mamba, pool if radix and pool != cfg.pool_tokens else None, meta.model, radix_cache=radix, page_size=ps
    )
    if mamba is not None and "mamba" not in {f.name for f in dataclasses.fields(AllocatorConfig)}:
        raise ConfigError("this allocator version has no Mamba state pool: it cannot replay a trace of a hybrid "
                          "linear-attention model (kvtrace info shows the trace's layout)")
    max_running = cfg.max_running
    if mamba is not None and radix:
        # SGLang caps the rows at the slots over 3 per request with the radix cache, 4
        # under extra_buffer (``_calculate_mamba_ratio``): fewer rows than the trace ran are OOMs of rows,
        # where more would let a checkpoint's state copy find no slot (an assert there).
        max_running = min(max_running, mamba.max_running_cap(radix_cache=True))
        if max_running < 1:
            raise ConfigError(
                f"{mamba.slots} Mamba state slot(s) serve no request with the radix cache "
                f"({mamba.slots_per_request()} per request); give a larger --pool-tokens"
            )
    config = AllocatorConfig(
        pool_tokens=pool,
        page_size=ps,
        max_running=max_running,
        max_context_len=cfg.max_context_len,
        device=device,
        need_sort=cfg.pd_decode,
        spec=spec_config_for(cfg.spec),
        hisparse=cfg.hisparse,
        radix_cache=cfg.radix_cache if radix_cache is None else radix_cache,
        debug_checks=debug_checks,
        **({} if swa is None else {"swa": swa}),
        # Passed only when not LRU: a version from before the field builds as it always did.
        **({} if policy == "lru" else {"eviction_policy": policy}),
        **({} if mamba is None else {"mamba": mamba}),
        **({} if hicache is None else {"hicache": hicache}),
    )
    config = dataclasses.replace(config, pool_tokens=pool_size_tokens(config))
    if config.pool_tokens < 2 * ps:
        raise ConfigError(_pool_below_two_pages(pool, ps, page_size is not None, pool_tokens is not None))
    try:
        config.check()
    except ValueError as exc:
        unsupported = unsupported_swa(config, exc)
        if unsupported is not None:
            raise ConfigError(unsupported) from None
        raise ConfigError(f"cannot build the allocator: {exc} (check --pool-tokens and --page-size)") from None
    unserved = unserved_sessions(meta, config) or unserved_namespaced_tier(meta, config)
    if unserved is not None:
        raise ConfigError(unserved)
    return config


def unserved_namespaced_tier(meta: TraceMeta, config: AllocatorConfig) -> str | None:
    """The one line to say when a trace with cache namespaces would replay with a host
    tier, else None.

    NOTE: the tiered tree keys by tokens alone, so requests of two namespaces would
    share KV through it; refused rather than replayed wrong.
    """
    if meta.namespaces is None or getattr(config, "hicache", None) is None:
        return None
    return ("this trace has cache namespaces, which HiCache's host tier does not key by: replay it without the "
            "tier (drop --hicache-ratio and --hicache-write-policy; kvtrace info shows the trace's configuration)")


def unserved_sessions(meta: TraceMeta, config: AllocatorConfig) -> str | None:
    """The one line to say when a trace with streaming sessions would replay on pools
    sessions are not modelled for (a host tier, sliding-window or Mamba layers,
    HiSparse), else None.

    NOTE: SGLang's session slot holds a turn's device KV outside the tree; neither side
    models what a host tier, a second pool or HiSparse does to it, so such a replay is
    refused rather than replayed wrong.
    """
    if not meta.config.sessions:
        return None
    tier = getattr(config, "hicache", None) is not None
    what = next((name for name, on in (
        ("HiCache's host tier", tier),
        ("sliding-window layers", getattr(config, "swa", None) is not None),
        ("Mamba layers", getattr(config, "mamba", None) is not None),
        ("HiSparse", bool(getattr(config, "hisparse", False))),
    ) if on), None)  # fmt: skip
    if what is None:
        return None
    advice = ("drop --hicache-ratio and --hicache-write-policy" if tier and meta.config.hicache is None
              else "kvtrace info shows the trace's configuration")
    return f"this trace has streaming sessions, which are modelled for full-attention pools only, not with {what} " \
           f"({advice})"


def mamba_config_for(
    layout: MambaLayout | None, resized_pool: int | None = None, model: ModelShape | None = None,
    radix_cache: bool = False, page_size: int = 1,
) -> MambaConfig | None:
    """The allocator's Mamba state pool for a trace's layout (None: no linear-attention
    layers). Without the radix cache the recorded slot count is kept under a resized KV
    pool: SGLang sizes it by ``max_running_requests``, not by memory. With it
    (``resized_pool``: the replay's KV pool, when it differs from the trace's) SGLang
    sizes the slots from memory, so the slots of the memory that holds that pool
    (``MambaLayout.for_pool``). The strategy is the one SGLang's ``auto`` picks without
    the overlap scheduler: ``extra_buffer`` with the radix cache at a page size above 1
    (one tracking slot per request), else no buffer."""
    if layout is None:
        return None
    if resized_pool is not None and model is not None:
        layout = layout.for_pool(resized_pool, model)
    if radix_cache and page_size > 1:
        return MambaConfig(slots=layout.mamba_cache_size, strategy="extra_buffer")
    return MambaConfig(slots=layout.mamba_cache_size)


def unserved_mamba(meta: TraceMeta, radix_cache: bool, page_size: int | None = None) -> str | None:
    """The one line to say when a trace is of a hybrid linear-attention model served
    with a switch the Mamba pool is not wired for yet (PD decode; HiSparse; the radix
    cache at a page size above 1 for a model SGLang has no extra_buffer strategy for:
    Mamba2 layers, which SGLang then refuses to serve), else None. ``page_size``: the
    replay's (default the trace's).

    NOTE: such a trace replayed without what the switch does to the Mamba slots
    would drop them, so it is refused rather than replayed wrong.
    """
    layout = meta.mamba
    if layout is None:
        return None
    cfg = meta.config
    if page_size is None:
        page_size = cfg.page_size
    if radix_cache and page_size != 1 and layout.kind != "gdn" and not (cfg.pd_decode or cfg.hisparse):
        # SGLang's extra_buffer runs for gated-delta-net models only (_MAMBA_EXTRA_BUFFER_ARCHS)
        return (
            f"this trace is of a hybrid linear-attention model ({meta.model.name}: {len(layout.mamba_layer_ids)} "
            f"{layout.kind} layers, {layout.mamba_cache_size} Mamba state slots) served with the radix cache at "
            f"page size {page_size}: SGLang has no extra_buffer Mamba strategy for {layout.kind} layers and "
            f"serves them with the radix cache at page size 1 only: replay it with --no-radix-cache, or record "
            f"it at --page-size 1"
        )
    what = "PD decode" if cfg.pd_decode else "HiSparse" if cfg.hisparse else None
    if what is None:
        return None
    return (
        f"this trace is of a hybrid linear-attention model ({meta.model.name}: {len(layout.mamba_layer_ids)} "
        f"{layout.kind} layers, {layout.mamba_cache_size} Mamba state slots) served with {what}, which no "
        f"allocator serves beside the Mamba state pool yet: only hybrid linear-attention traces recorded with "
        f"{what} off replay (kvtrace info shows the trace's configuration)"
    )


def hicache_config_for(
    meta: TraceMeta, pool_tokens: int, page_size: int, resized: bool,
    ratio: float | None = None, write_policy: str | None = None,
) -> HiCacheConfig | None:
    """The allocator's host tier for a trace (None: none): the trace's own
    (``config.hicache``), sized again as SGLang sizes it when the device pool or page
    changed, with ``--hicache-ratio`` / ``--hicache-write-policy`` over it (either one
    turns the tier on for a trace recorded without).

    Raises:
        ConfigError: an option value the host tier refuses, naming the option.
    """
    from traces.hicache_layout import HostTierOptionError, resolve_host_tier

    hybrid = meta.attention is not None or meta.mamba is not None
    try:
        tier = resolve_host_tier(
            meta.config.hicache, enabled=None, ratio=ratio, size_gb=None, write_policy=write_policy,
            device_tokens=pool_tokens, page_size=page_size, bytes_per_token=meta.model.bytes_per_token,
            hybrid_model=meta.model.name if hybrid else None, resized=resized,
        )  # fmt: skip
    except HostTierOptionError as exc:
        raise ConfigError(f"{exc.option}: {exc}") from None
    if tier is None:
        return None
    return HiCacheConfig(host_pool_tokens=tier.host_pool_tokens, write_policy=tier.write_policy, page_size=page_size)


def unserved_hicache(meta: TraceMeta) -> str | None:
    """The one line to say when a trace has HiCache's host tier and the allocator
    version asked for has none, else None."""
    tier = meta.config.hicache
    if tier is None:
        return None
    return (
        f"this trace was recorded with HiCache's host tier ({tier.describe()}), and this allocator version has "
        "no host tier: it cannot be replayed (kvtrace info shows the trace's tier)"
    )


_REPLAY_ADVICE = "only SWA traces recorded with {what} off replay (kvtrace info shows the trace's configuration)"


def unsupported_swa(config: AllocatorConfig, exc: ValueError, advice: str = _REPLAY_ADVICE) -> str | None:
    """The one line to say when ``config.check()`` refused an SWA configuration only for
    a switch the SWA allocator does not serve yet (the radix cache), or for HiSparse,
    which SGLang 0.5.23 never combines with a sliding-window model; else None.

    NOTE: the rule is the allocator's own: the same configuration is checked again
    without the switch, so this refusal goes away by itself once the allocator serves
    the switch with SWA (no second copy of the allocator's limits here).

    Args:
        config: the configuration ``check()`` refused.
        exc: its error.
        advice: what to do instead, ``{what}`` naming the switch.
    """
    if config.swa is None:
        return None
    if config.hisparse:
        # Not a gap of ours: SGLang itself never pairs them (allocator.base.HISPARSE_SWA_REFUSAL).
        return f"{HISPARSE_SWA_REFUSAL}, and this configuration has both (kvtrace info shows the trace's)"
    for switch, what in (("radix_cache", "the radix cache"),):
        if not getattr(config, switch):
            continue
        try:
            dataclasses.replace(config, **{switch: False}).check()
        except ValueError:
            continue
        return (
            f"this sliding-window (SWA) model was served with {what}, which the SWA allocator does not "
            f"serve (the allocator says: {exc}); " + advice.format(what=what)
        )
    return None


class MemoryEstimate(NamedTuple):
    """Host memory a replay or a recording needs, in bytes, by part.

    ``pool``: the allocator (``allocator.sizing.pool_memory``); ``token_store``: the
    token content its radix cache is fed (``TokenStore.bytes_bound``); ``requests``:
    the per-request columns of the replay engine and of its step checker.
    """

    pool: PoolMemory
    token_store: int
    requests: int

    @property
    def total(self) -> int:
        return self.pool.total + self.token_store + self.requests


def estimate_memory(config: AllocatorConfig, num_rids: int) -> MemoryEstimate:
    """What serving ``config`` for ``num_rids`` request ids needs (nothing is allocated).

    Args:
        config: the allocator configuration.
        num_rids: request ids run below this (``TraceReader.rid_bound``, or the
            number of requests of a workload).
    """
    return MemoryEstimate(
        pool=pool_memory(config, num_rids),
        token_store=TokenStore.bytes_bound(pool_size_tokens(config), num_rids),
        requests=num_rids * _REPLAY_BYTES_PER_RID,
    )


def check_memory(
    config: AllocatorConfig,
    *,
    num_rids: int,
    names: Mapping[str, str] = TRACE_FIELDS,
    force: bool = False,
    available: int | None = None,
) -> MemoryEstimate:
    """Refuse, before anything is allocated, a configuration this machine cannot hold.

    One function for every command that builds a pool (``replay``, ``record``).

    Args:
        config: the allocator configuration about to be built.
        num_rids: request ids run below this.
        names: what the user calls ``pool_tokens``, ``page_size``, ``max_running``
            and ``max_context_len`` (an option, or a metadata field of the trace).
        force: only estimate; never refuse.
        available: bytes the machine can give (default: psutil's available memory);
            at most ``$KVTRACE_MEMORY_LIMIT`` when that is set (``memory_limit()``).

    Returns:
        The estimate.

    Raises:
        ConfigError: one line: the estimate, what is available, the part that needs
            the most and the option or metadata field behind it, and ``--ignore-memory-check``.
    """
    estimate = estimate_memory(config, num_rids)
    if force:
        return estimate
    if available is None:
        import psutil

        available = int(psutil.virtual_memory().available)
    limit = memory_limit()
    if limit is not None:
        available = min(available, limit)
    if estimate.total <= available:
        return estimate
    part, behind = _largest_part(config, estimate, num_rids, names)
    options = [name for name in behind if name.startswith("--")]
    advice = f"lower {' or '.join(options)}, or pass --ignore-memory-check" if options else "pass --ignore-memory-check"
    raise ConfigError(
        f"not enough memory: the allocator needs about {format_bytes(estimate.total)} and this machine "
        f"has {format_bytes(available)} available{_limit_note(limit)}; {part}; {advice} to try anyway"
    )


MEMORY_LIMIT_VAR = "KVTRACE_MEMORY_LIMIT"
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def memory_limit() -> int | None:
    """``$KVTRACE_MEMORY_LIMIT`` in bytes (``2G``, ``512M``, ``65536``; binary units), the
    most a pool may be estimated to need on a shared machine; None when unset.

    Raises:
        ConfigError: a value that is not a size.
    """
    import math
    import os

    text = os.environ.get(MEMORY_LIMIT_VAR, "").strip()
    if not text:
        return None
    number, unit = text.rstrip("kKmMgGtTiIbB"), text[len(text.rstrip("kKmMgGtTiIbB")) :].lower()
    unit = unit.removesuffix("b").removesuffix("i")
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or not (value > 0 and math.isfinite(value)) or value * _UNITS[unit] >= 1 << 63:
        raise ConfigError(f"${MEMORY_LIMIT_VAR}={text!r} is not a size; give bytes or a size such as 512M or 2G")
    return int(value * _UNITS[unit])


def _largest_part(
    config: AllocatorConfig, estimate: MemoryEstimate, num_rids: int, names: Mapping[str, str]
) -> tuple[str, list[str]]:
    """The part of the estimate that needs the most, in words, and the names behind it."""
    pool = estimate.pool
    table = pool.req_to_token
    slots = pool.free_lists + pool.radix_cache + estimate.token_store
    ids = estimate.requests + pool.bookkeeping
    if table >= slots and table >= ids:
        rows = config.max_running + config.extra_rows
        behind = [names["max_running"], names["max_context_len"]]
        return (
            f"its request table alone is {rows:,} rows ({behind[0]}) x {req_to_token_width(config):,} "
            f"positions ({behind[1]} plus headroom) x 4 bytes = {format_bytes(table)}"
        ), behind
    if slots >= ids:
        return (
            f"its {pool_size_tokens(config):,} KV slots ({names['pool_tokens']}) need "
            f"{format_bytes(slots)} of free lists, radix cache and token content"
        ), [names["pool_tokens"]]
    return f"its {num_rids:,} request ids need {format_bytes(ids)} of per-request state", []


def _limit_note(limit: int | None) -> str:
    return "" if limit is None else f" (at most ${MEMORY_LIMIT_VAR}={format_bytes(limit)})"


def format_bytes(num_bytes: int) -> str:
    """``1536`` -> ``"1.5 KiB"``: binary units, three significant digits."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            return f"{value:.3g} {unit}" if unit != "B" and value < 1000 else f"{value:.0f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _pool_below_two_pages(pool: int, page_size: int, page_given: bool, pool_given: bool) -> str:
    """One line naming the option that leaves fewer than two pages in the pool."""
    if page_given and (not pool_given or page_size > pool // 2 > 0):
        where = "the --pool-tokens" if pool_given else "the trace's"
        return (
            f"--page-size {page_size:,}: two pages of {page_size:,} tokens do not fit {where} pool of {pool:,} tokens; "
            f"give a --page-size of at most {max(1, pool // 2):,} or a larger --pool-tokens"
        )
    what = f"--pool-tokens {pool:,}" if pool_given else f"the trace's pool of {pool:,} tokens"
    return f"{what} is below two pages of {page_size:,} tokens; give --pool-tokens {2 * page_size:,} or more"


def effective_config(
    meta: TraceMeta,
    *,
    version_spec: str = "builtin",
    version_page_size: int | None = None,
    page_size: int | None = None,
    pool_tokens: int | None = None,
    device: str = "cpu",
    eviction_policy: str | None = None,
    hicache_ratio: float | None = None,
    hicache_write_policy: str | None = None,
) -> AllocatorConfig:
    """The configuration a replay's allocator runs with.

    The page size is, in order: the version's own (``token``, ``paged:N``), the
    ``--page-size`` option, the trace's. A version that fixes a page size and a
    ``--page-size`` that asks for another conflict.

    Raises:
        ConfigError: the options conflict, or no allocator can be built from the result.
    """
    if version_page_size is not None and page_size is not None and page_size != version_page_size:
        raise ConfigError(
            f"--page-size {page_size} conflicts with --allocator {version_spec}, which replays with page size "
            f"{version_page_size}; drop one of the two"
        )
    chosen = version_page_size if version_page_size is not None else page_size
    return allocator_config_for(
        meta, page_size=chosen, pool_tokens=pool_tokens, device=device, eviction_policy=eviction_policy,
        hicache_ratio=hicache_ratio, hicache_write_policy=hicache_write_policy,
    )


def config_dict(config: AllocatorConfig) -> dict[str, Any]:
    """An allocator configuration as a JSON-able dict (None fields left out)."""
    return {k: v for k, v in dataclasses.asdict(config).items() if v is not None}
