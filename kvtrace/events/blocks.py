"""SGLang 0.5.23's KV events: the event types and the block hashes they carry.

The wire schema (``sglang/srt/disaggregation/kv_events.py``, the same tagged encoding
as vLLM's ``KVCacheEvent``): a batch is the positional msgpack array ``[ts, events,
attn_dp_rank]``; an event is a msgpack map whose ``type`` key names its class and whose
other keys are its fields, optional fields left at ``None`` omitted.

Block hashes (``sglang/srt/mem_cache/utils.py``, ``cpp_utils/hash_binding.cpp``): a
page's digest is SHA-256 over the previous page's digest (none for a sequence's first
page) and the page's tokens, each a little-endian uint32; a page holding a token
outside ``[0, 2**32)`` is hashed as the byte ``0xff`` then its tokens as little-endian
64-bit words. The event carries the digest's first 8 bytes as a signed big-endian int64.
SGLang's hasher refuses negative ids, and kvtrace's synthetic ids for tokens unique to a
request are negative (``traces.tokens``): ``hash_ids`` maps each id ``x`` to ``x & (2**63 -
1)`` (a negative one loses its sign bit and lands in ``[2**62, 2**63)``; others are
unchanged) before hashing, and the SGLang side applies the same map before SGLang's
hasher sees the ids (``kvtrace/sglang/world.py``, ``install_event_hash_ids``), so both
hash the same words; events keep the ids themselves in ``token_ids``.
"""

from __future__ import annotations

import hashlib
from typing import Optional, Union

import msgspec
import numpy as np

__all__ = [
    "GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVCacheEvent",
    "KVEventBatch",
    "event_hash",
    "event_hashes",
    "hash_ids",
    "page_digests",
]

GPU = "GPU"  # the ``medium`` of blocks in device memory (SGLang's StorageMedium.GPU)
_U32_MAX = 0xFFFFFFFF
_I64_MAX = np.int64(0x7FFFFFFFFFFFFFFF)
_WIDE_TAG = b"\xff"


class KVCacheEvent(msgspec.Struct, frozen=True, omit_defaults=True, gc=False, tag=True):
    """One KV event: a tagged msgpack map (``type`` is the class name)."""


class BlockStored(KVCacheEvent, frozen=True):
    """Pages entered the cache: ``block_hashes`` in order, the first one's parent
    ``parent_block_hash`` (None at the root), every page's ``token_ids`` concatenated."""

    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None
    cache_salt: Optional[str] = None
    session_id: Optional[str] = None
    lora_name: Optional[str] = None


class BlockRemoved(KVCacheEvent, frozen=True):
    """Pages left the cache (evicted)."""

    block_hashes: list[int]
    medium: Optional[str] = None


class AllBlocksCleared(KVCacheEvent, frozen=True):
    """The cache was emptied (SGLang records one whenever its tree is reset, at start-up too)."""


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """What one publication carries: the events of one scheduler step, in order."""

    ts: float
    events: list[Event]
    attn_dp_rank: Optional[int] = None


def event_hash(digest: bytes) -> int:
    """The int64 an event carries for a page digest (its first 8 bytes, big-endian, signed)."""
    return int.from_bytes(digest[:8], "big", signed=True)


def event_hashes(digests: bytes) -> list[int]:
    """``event_hash`` of each 32-byte digest of a concatenation of them."""
    return np.frombuffer(digests, dtype=">i8")[::4].tolist()


def hash_ids(units: np.ndarray) -> np.ndarray:
    """The ids SGLang's hasher is given for ``units`` (int64): a negative id with its sign
    bit cleared (SGLang refuses negative ids), the others as they are."""
    return np.asarray(units, dtype=np.int64) & _I64_MAX


def page_digests(units: np.ndarray, page_size: int, prior: bytes | None) -> bytes:
    """SHA-256 digests of the whole pages of ``units``, chained from ``prior``.

    Args:
        units: int64 ``[n]`` token ids, ``n`` a multiple of ``page_size``.
        page_size: tokens per page.
        prior: the digest of the page before the first one (None: the first page of a sequence).

    Returns:
        The pages' 32-byte digests, concatenated in page order.
    """
    n = units.shape[0]
    num_pages = n // page_size
    assert num_pages * page_size == n, f"{n} tokens are not whole pages of {page_size}"
    units = np.ascontiguousarray(hash_ids(units))
    narrow = (units.view(np.uint64) <= _U32_MAX).reshape(num_pages, page_size).all(axis=1)
    # A void dtype's items come back as bytes, trailing zero bytes kept.
    narrow_all = bool(narrow.all())
    if narrow_all or narrow.any():
        narrow_pages = np.frombuffer(units.astype("<u4").tobytes(), dtype=f"V{page_size * 4}").tolist()
    if narrow_all:
        pages = narrow_pages
    else:
        wide = np.empty((num_pages, 1 + page_size * 8), dtype=np.uint8)
        wide[:, 0] = _WIDE_TAG[0]
        wide[:, 1:] = units.astype("<i8").view(np.uint8).reshape(num_pages, page_size * 8)
        pages = wide.view(f"V{1 + page_size * 8}").ravel().tolist()
        for p in np.flatnonzero(narrow).tolist():
            pages[p] = narrow_pages[p]
    sha256 = hashlib.sha256
    out = []
    append = out.append
    if prior is None:
        prior = sha256(pages[0]).digest()
        append(prior)
        pages = pages[1:]
    for page in pages:
        prior = sha256(prior + page).digest()
        append(prior)
    return b"".join(out)
