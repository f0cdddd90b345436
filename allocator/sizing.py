"""Sizes that follow from the configuration: speculative reserve, row headroom, pool pages.

Mirrors SGLang 0.5.23's ``mem_cache/allocation_sizing.py`` (and the DFlash / UNO
prepare steps), so a replay reserves exactly what SGLang reserves per decode step
and sizes ``req_to_token`` rows with the same headroom.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# ceil_align / floor_align are defined in allocator.pages; re-exported here.
from allocator.pages import ceil_align, floor_align

if TYPE_CHECKING:
    from allocator.base import AllocatorConfig, SpecConfig

__all__ = [
    "alloc_len_per_decode",
    "ceil_align",
    "floor_align",
    "pool_size_tokens",
    "req_to_token_width",
    "reserve_per_decode",
    "row_extra_len",
    "uses_bigram_keys",
]


def alloc_len_per_decode(spec: SpecConfig | None, page_size: int) -> int:
    """KV positions one request may take in one decode step (SGLang ``get_alloc_len_per_decode``).

    EAGLE / EAGLE3 / STANDALONE / DFlash with page 1 or topk 1:
    ``max(num_steps * topk, num_draft_tokens)``; page > 1 with topk > 1 (#26972):
    ``max(ceil((ps - 1 + num_steps) / ps) * ps * topk, num_draft_tokens)``;
    UNO: ``num_draft_tokens + 1``.
    """
    if spec is None:
        return 1
    steps = spec.num_steps or 1
    topk = spec.topk or 1
    tokens = spec.num_draft_tokens
    if spec.algorithm == "uno":
        return tokens + 1
    if page_size == 1 or topk == 1:
        return max(steps * topk, tokens)
    return max(ceil_align(page_size - 1 + steps, page_size) * topk, tokens)


def reserve_per_decode(spec: SpecConfig | None, page_size: int) -> int:
    """Positions reserved beyond ``kv_committed_len`` by each speculative prepare.

    ``2 * alloc_len_per_decode`` (the 2x absorbs the one-verify lag of the committed
    length under the overlap scheduler); DFlash reserves ``2 * num_draft_tokens``
    (its verify block). 0 without speculative decoding.
    """
    if spec is None:
        return 0
    if spec.algorithm == "dflash":
        return 2 * spec.num_draft_tokens
    return 2 * alloc_len_per_decode(spec, page_size)


def row_extra_len(spec: SpecConfig | None, page_size: int) -> int:
    """Row headroom beyond the context length (SGLang ``get_req_to_token_extra_context_len``).

    ``4 + num_draft_tokens``; with speculative decoding at page > 1 (or UNO at any
    page size) at least ``2 * alloc_len_per_decode + page_size - 1``.
    """
    extra = 4 + (spec.num_draft_tokens if spec is not None else 0)
    if spec is not None and (page_size > 1 or spec.algorithm == "uno"):
        extra = max(extra, 2 * alloc_len_per_decode(spec, page_size) + page_size - 1)
    return extra


def req_to_token_width(config: AllocatorConfig) -> int:
    """Row width of ``req_to_token``: ``max_context_len`` plus SGLang's headroom."""
    return config.max_context_len + row_extra_len(config.spec, config.page_size)


def pool_size_tokens(config: AllocatorConfig) -> int:
    """KV slots the allocator hands out: ``pool_tokens`` rounded down to a whole page."""
    return floor_align(config.pool_tokens, config.page_size)


def uses_bigram_keys(spec: SpecConfig | None) -> bool:
    """EAGLE and EAGLE3 key the radix tree by token bigrams (SGLang ``is_eagle``)."""
    return spec is not None and spec.algorithm in ("eagle", "eagle3")
