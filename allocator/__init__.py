"""kvtrace's KV allocator library: SGLang 0.5.23's KV allocation, importable on its own.

``create_allocator(config)`` builds the built-in ``Allocator`` (``KvAllocator``);
the pieces it composes are public for white-box use and tests.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Public name -> the module defining it. Attributes load on first use (PEP 562), so
# ``import allocator.base`` (the contract: configs, results, the protocol) does not
# import torch; ``allocator.create_allocator`` and the pools do.
_LAZY: dict[str, str] = {
    # allocator.allocation
    "KvContext": "allocator.allocation",
    "alloc_for_decode": "allocator.allocation",
    "alloc_for_decode_prealloc": "allocator.allocation",
    "alloc_for_decode_prealloc_hisparse": "allocator.allocation",
    "alloc_for_extend": "allocator.allocation",
    "alloc_for_spec_decode": "allocator.allocation",
    "checkpoint_kv_cache": "allocator.allocation",
    "commit_accepted_tokens": "allocator.allocation",
    "evict_from_tree_cache": "allocator.allocation",
    "prepare_spec_decode": "allocator.allocation",
    "release_kv_cache": "allocator.allocation",
    # allocator.base
    "AllocatorConfig": "allocator.base",
    "Allocator": "allocator.base",
    "AllocOutcome": "allocator.base",
    "AllocResult": "allocator.base",
    "OutOfMemory": "allocator.base",
    "PoolCounters": "allocator.base",
    "ReleaseResult": "allocator.base",
    "RequestLens": "allocator.base",
    "SpecConfig": "allocator.base",
    "SwaConfig": "allocator.base",
    "Violation": "allocator.base",
    # allocator.check.incremental
    "IncrementalChecker": "allocator.check.incremental",
    # allocator.check.invariants
    "check_integrity": "allocator.check.invariants",
    # allocator.manager
    "KvAllocator": "allocator.manager",
    "create_allocator": "allocator.manager",
    # allocator.ownership
    "SlotOwnership": "allocator.ownership",
    "SlotState": "allocator.ownership",
    "cell_pages": "allocator.ownership",
    "reduce_cells": "allocator.ownership",
    "request_slots": "allocator.ownership",
    # allocator.radix_cache
    "RadixCache": "allocator.radix_cache",
    "TreeNode": "allocator.radix_cache",
    "bigram_units": "allocator.radix_cache",
    # allocator.req_kv
    "ReqKvInfo": "allocator.req_kv",
    "ReqKvTable": "allocator.req_kv",
    # allocator.req_to_token
    "ReqToTokenPool": "allocator.req_to_token",
    # allocator.token_to_kv
    "HiSparseTokenToKVPoolAllocator": "allocator.token_to_kv",
    "PagedTokenToKVPoolAllocator": "allocator.token_to_kv",
    "TokenToKVPoolAllocator": "allocator.token_to_kv",
    "SWATokenToKVPoolAllocator": "allocator.swa",  # hybrid sliding-window pools
}

if TYPE_CHECKING:
    from allocator.allocation import (
        KvContext,
        alloc_for_decode,
        alloc_for_decode_prealloc,
        alloc_for_decode_prealloc_hisparse,
        alloc_for_extend,
        alloc_for_spec_decode,
        checkpoint_kv_cache,
        commit_accepted_tokens,
        evict_from_tree_cache,
        prepare_spec_decode,
        release_kv_cache,
    )
    from allocator.base import (
        AllocatorConfig,
        Allocator,
        AllocOutcome,
        AllocResult,
        OutOfMemory,
        PoolCounters,
        ReleaseResult,
        RequestLens,
        SpecConfig,
        Violation,
    )
    from allocator.check.incremental import IncrementalChecker
    from allocator.check.invariants import check_integrity
    from allocator.manager import KvAllocator, create_allocator
    from allocator.ownership import SlotOwnership, SlotState, cell_pages, reduce_cells, request_slots
    from allocator.radix_cache import RadixCache, TreeNode, bigram_units
    from allocator.req_kv import ReqKvInfo, ReqKvTable
    from allocator.req_to_token import ReqToTokenPool
    from allocator.token_to_kv import (
        HiSparseTokenToKVPoolAllocator,
        PagedTokenToKVPoolAllocator,
        TokenToKVPoolAllocator,
    )


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'allocator' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "AllocOutcome",
    "AllocResult",
    "Allocator",
    "AllocatorConfig",
    "HiSparseTokenToKVPoolAllocator",
    "IncrementalChecker",
    "KvAllocator",
    "KvContext",
    "OutOfMemory",
    "PagedTokenToKVPoolAllocator",
    "PoolCounters",
    "RadixCache",
    "ReleaseResult",
    "ReqKvInfo",
    "ReqKvTable",
    "ReqToTokenPool",
    "RequestLens",
    "SlotOwnership",
    "SlotState",
    "SpecConfig",
    "SwaConfig",
    "TokenToKVPoolAllocator",
    "TreeNode",
    "Violation",
    "alloc_for_decode",
    "alloc_for_decode_prealloc",
    "alloc_for_decode_prealloc_hisparse",
    "alloc_for_extend",
    "alloc_for_spec_decode",
    "bigram_units",
    "cell_pages",
    "check_integrity",
    "checkpoint_kv_cache",
    "commit_accepted_tokens",
    "create_allocator",
    "evict_from_tree_cache",
    "prepare_spec_decode",
    "reduce_cells",
    "release_kv_cache",
    "request_slots",
]
