"""A trace's serving configuration -> the allocator configuration that serves it.

``allocator_config_for`` maps a trace's recorded serving config (with what-if
overrides) to an ``AllocatorConfig``; the scheduler model records with it and the
replay session replays with it, so both run the same allocator for the same trace.
``effective_config`` is the one place a replay's configuration is decided from the
trace, the allocator version (which may fix a page size) and the user's options.
The pool is rounded down to whole pages by ``allocator.sizing.pool_size_tokens``
only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from allocator.base import AllocatorConfig, SpecConfig
from allocator.sizing import pool_size_tokens
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
    overrides. ``radix_cache`` defaults to what the trace was recorded with; the pool
    is rounded down to whole pages.

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
        pool_tokens=pool,
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
    config = dataclasses.replace(config, pool_tokens=pool_size_tokens(config))
    if config.pool_tokens < 2 * ps:
        raise ConfigError(_pool_below_two_pages(pool, ps, page_size is not None, pool_tokens is not None))
    try:
        config.check()
    except ValueError as exc:
        raise ConfigError(f"cannot build the allocator: {exc} (check --pool-tokens and --page-size)") from None
    return config


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
    return allocator_config_for(meta, page_size=chosen, pool_tokens=pool_tokens, device=device)


def config_dict(config: AllocatorConfig) -> dict[str, Any]:
    """An allocator configuration as a JSON-able dict (None fields left out)."""
    return {k: v for k, v in dataclasses.asdict(config).items() if v is not None}
