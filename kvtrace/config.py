"""A trace's serving configuration -> the allocator configuration that serves it."""

from __future__ import annotations

from allocator.base import AllocatorConfig, SpecConfig
from allocator.pages import floor_align
from kvtrace.errors import ConfigError
from traces.schema import SpecSettings, TraceMeta


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


def allocator_config_for(
    meta: TraceMeta,
    *,
    page_size: int | None = None,
    pool_tokens: int | None = None,
    device: str = "cpu",
    radix_cache: bool | None = None,
    debug_checks: bool = False,
) -> AllocatorConfig:
    """The allocator configuration a trace's serving config asks for, with what-if
    overrides. The scheduler model records with it and the replay engine replays
    with it, so both run the same allocator for the same trace. ``radix_cache``
    defaults to what the trace was recorded with.

    Raises:
        ConfigError: the resulting configuration is one no allocator can be built
            from (``AllocatorConfig.check``), e.g. a pool below two pages.
    """
    cfg = meta.config
    ps = cfg.page_size if page_size is None else page_size
    pool = cfg.pool_tokens if pool_tokens is None else pool_tokens
    if ps <= 0:
        raise ConfigError(f"page size must be positive, got {ps}")
    config = AllocatorConfig(
        pool_tokens=floor_align(pool, ps),
        page_size=ps,
        max_running=cfg.max_running,
        max_context_len=cfg.max_context_len,
        device=device,
        need_sort=cfg.pd_decode,
        spec=spec_config_for(cfg.spec),
        hisparse=cfg.hisparse,
        radix_cache=cfg.radix_cache if radix_cache is None else radix_cache,
        debug_checks=debug_checks,
    )
    try:
        config.check()
    except ValueError as exc:
        raise ConfigError(f"cannot build the allocator: {exc} (check --pool-tokens and --page-size)") from None
    return config
