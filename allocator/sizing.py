"""Sizes that follow from the configuration: speculative reserve, row headroom, pool pages.

Mirrors SGLang 0.5.23's ``mem_cache/allocation_sizing.py`` (and the DFlash / UNO
prepare steps), so a replay reserves exactly what SGLang reserves per decode step
and sizes ``req_to_token`` rows with the same headroom.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

# ceil_align / floor_align are defined in allocator.pages; re-exported here.
from allocator.pages import ceil_align, floor_align

if TYPE_CHECKING:
    from allocator.base import AllocatorConfig, SpecConfig

__all__ = [
    "PoolMemory",
    "alloc_len_per_decode",
    "ceil_align",
    "floor_align",
    "pool_memory",
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


# Host bytes per unit of what an allocator holds (see ``pool_memory``).
_SLOT_BYTES = 4  # int32 slot indices and page ids (the dtype of req_to_token)
_FREE_LIST_BYTES_PER_PAGE = 3 * _SLOT_BYTES  # a double-ended buffer of 2n + 64, plus the initial arange
_CACHED_BYTES_PER_TOKEN = 16  # radix keys (int64 token ids) and values (slot indices), whole pool cached
_BYTES_PER_ROW = 3 * 8 + 8 + 8 + 36  # ReqKvTable columns, rid, lock_node, a free_slots entry
_BYTES_PER_RID = 25  # KvAllocator's row, prompt, prefilling and stash columns, per request id


class PoolMemory(NamedTuple):
    """Host memory an allocator of a configuration needs, in bytes, by part.

    ``req_to_token`` and ``free_lists`` are allocated when it is built; ``bookkeeping``
    grows with the request rows and the largest request id; ``radix_cache`` is the
    tree's keys and values when the whole pool is cached (its most).
    """

    req_to_token: int
    free_lists: int
    bookkeeping: int
    radix_cache: int

    @property
    def total(self) -> int:
        return self.req_to_token + self.free_lists + self.bookkeeping + self.radix_cache


def pool_memory(config: AllocatorConfig, num_rids: int = 0) -> PoolMemory:
    """What the built-in allocator of ``config`` needs on the host (an estimate from the
    sizes, computed without allocating anything; the device copy of ``req_to_token``
    is not counted).

    Args:
        config: the allocator configuration.
        num_rids: the largest request id it will see, plus one (per-id columns).

    Returns:
        The bytes of each part (``PoolMemory.total`` is the sum).
    """
    rows = config.max_running + config.extra_rows
    pool = pool_size_tokens(config)
    pages = pool // config.page_size
    if config.hisparse:
        pages *= 1 + config.hisparse_ratio
        pool_pages_mapping = 8 * (pool * config.hisparse_ratio + config.page_size + 1)
    else:
        pool_pages_mapping = 0
    if config.swa is not None:
        # the SWA pool's free list and the full -> SWA mapping (int64 per full slot)
        pages += config.swa.pool_tokens(pool, config.page_size) // config.page_size
        pool_pages_mapping += 8 * (pool + config.page_size + 1)
    return PoolMemory(
        req_to_token=(rows + 1) * req_to_token_width(config) * _SLOT_BYTES,
        free_lists=pages * _FREE_LIST_BYTES_PER_PAGE + pool_pages_mapping,
        bookkeeping=(rows + 1) * _BYTES_PER_ROW + num_rids * _BYTES_PER_RID,
        radix_cache=0 if not config.radix_cache else pool * _CACHED_BYTES_PER_TOKEN,
    )
