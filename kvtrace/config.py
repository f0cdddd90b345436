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
from traces.schema import TraceMeta


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
    spec = None
    if cfg.spec is not None:
        spec = SpecConfig(
            algorithm=cfg.spec.algorithm,
            num_steps=cfg.spec.num_steps,
            topk=cfg.spec.topk,
            num_draft_tokens=cfg.spec.num_draft_tokens,
        )
    config = AllocatorConfig(
        pool_tokens=pool,
        page_size=ps,
        max_running=cfg.max_running,
        max_context_len=cfg.max_context_len,
        device=device,
        need_sort=cfg.pd_decode,
        spec=spec,
        hisparse=cfg.hisparse,
        radix_cache=cfg.radix_cache if radix_cache is None else radix_cache,
        debug_checks=debug_checks,
    )
    config = dataclasses.replace(config, pool_tokens=pool_size_tokens(config))
    try:
        config.check()
    except ValueError as exc:
        raise ConfigError(f"cannot build the allocator: {exc} (check --pool-tokens and --page-size)") from None
    return config


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
