"""kvtrace's KV allocator library: SGLang 0.5.23's KV allocation, importable on its own.

``create_allocator(config)`` builds the built-in ``Allocator`` (``KvAllocator``);
the pieces it composes are public for white-box use and tests.
"""

from __future__ import annotations

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
from allocator.incremental import IncrementalChecker
from allocator.invariants import check_integrity
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
