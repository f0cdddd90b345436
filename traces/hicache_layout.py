"""HiCache's host tier in a trace (``HostTier``): the host KV pool SGLang 0.5.23 keeps
under the radix cache and its write policy, sized as SGLang sizes it
(``host_pool_tokens_for``, ``host_tokens_for_size``), the ``--hicache-*`` options
resolved to one (``resolve_host_tier``) and the check of the stored object
(``host_tier_from_dict``).

SGLang sizes the host pool in ``HostKVCache.__init__`` (``mem_cache/pool_host/base.py``):
``int(device_tokens * --hicache-ratio)`` tokens, or ``int(--hicache-size GB * 1e9 //
size_per_token)`` when ``--hicache-size`` is given, then rounded down to a page plus one
padding page. The host pool has the device pool's page size; ``--hicache-mem-layout``
and ``--hicache-io-backend`` say how bytes are laid out and moved, not how many slots
there are, so a trace does not keep them (docs/hicache-semantics.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Literal

from traces.schema import MAX_TOKENS

HiCacheWritePolicy = Literal["write_through", "write_through_selective", "write_back"]
WRITE_POLICIES: tuple[str, ...] = ("write_through", "write_through_selective", "write_back")
# SGLang's --hicache-ratio default in cache mode (``mem_cache/kv_cache_builder.py``).
DEFAULT_HICACHE_RATIO = 2.0
# The largest ratio a trace may hold: the host pool must stay below MAX_TOKENS anyway.
MAX_HICACHE_RATIO = 1000.0
# The largest --hicache-size a trace may hold, in GB (1 PB of host memory).
MAX_HICACHE_SIZE_GB = 1_000_000


@dataclass(frozen=True, slots=True)
class HostTier:
    """The host KV tier the recording engine had (SGLang's ``--enable-hierarchical-cache``).

    Attributes:
        host_pool_tokens: the host pool in tokens, padding page included (SGLang's
            ``HostKVCache.size``); a multiple of the page size.
        write_policy: ``--hicache-write-policy``: ``write_through`` (back up a node on
            its first hit), ``write_through_selective`` (on its second) or
            ``write_back`` (only when it is evicted from the device).
        host_ratio: ``--hicache-ratio``, host tokens per device token, when the pool
            was sized by it; None when sized by ``host_size_gb``.
        host_size_gb: ``--hicache-size`` in GB when the pool was sized by it, else None.
    """

    host_pool_tokens: int
    write_policy: HiCacheWritePolicy = "write_through"
    host_ratio: float | None = DEFAULT_HICACHE_RATIO
    host_size_gb: int | None = None

    def for_pool(self, device_tokens: int, page_size: int, bytes_per_token: int) -> HostTier:
        """This tier beside another device pool or page size, sized again as SGLang
        sizes it from the same options (a ratio follows the device pool)."""
        if self.host_size_gb is not None:
            return replace(self, host_pool_tokens=host_tokens_for_size(self.host_size_gb, bytes_per_token, page_size))
        ratio = DEFAULT_HICACHE_RATIO if self.host_ratio is None else self.host_ratio
        return replace(self, host_pool_tokens=host_pool_tokens_for(device_tokens, page_size, ratio))

    def describe(self) -> str:
        """One line: the pool, how it was sized and the write policy."""
        sized = f"--hicache-size {self.host_size_gb} GB" if self.host_size_gb is not None else f"ratio {self.host_ratio:g}"
        return f"host pool {self.host_pool_tokens:,} tokens ({sized}), {self.write_policy}"


def host_pool_tokens_for(device_tokens: int, page_size: int, ratio: float) -> int:
    """SGLang's host pool for a device pool of ``device_tokens`` and ``--hicache-ratio``:
    ``int(device * ratio)`` rounded down to a page, plus one padding page."""
    return (int(device_tokens * ratio) // page_size + 1) * page_size


def host_tokens_for_size(size_gb: int, bytes_per_token: int, page_size: int) -> int:
    """SGLang's host pool for ``--hicache-size`` GB (10**9 bytes) of a model whose host
    copy costs ``bytes_per_token`` (``HostKVCache.size_per_token``: K and V of every
    layer, the trace's ``model.bytes_per_token`` on one GPU), plus one padding page."""
    return (int(size_gb * 10**9 // bytes_per_token) // page_size + 1) * page_size


class HostTierOptionError(ValueError):
    """A ``--hicache-*`` value that is refused; ``option`` names the option."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


def resolve_host_tier(
    base: HostTier | None, *, enabled: bool | None, ratio: float | None, size_gb: int | None,
    write_policy: str | None, device_tokens: int, page_size: int, bytes_per_token: int,
    hybrid_model: str | None = None, resized: bool = True,
) -> HostTier | None:
    """The host tier of SGLang's ``--hicache-*`` options over ``base`` (a trace's tier,
    or None) over SGLang's defaults (ratio 2.0, ``write_through``), or None for no tier.

    Any option given turns the tier on; ``enabled`` False (``--no-hicache``) turns it
    off. As in SGLang, ``--hicache-size`` overrides the ratio and 0 means the ratio.
    The pool is sized from the device pool rounded down to a page; ``base``'s own
    pool is kept when neither the sizing options nor (``resized``) the device pool,
    page or model changed, so a real engine's figure survives ``--like``.

    Args:
        hybrid_model: the model's name when it has sliding-window or linear layers,
            whose host copy's bytes per token are not modelled (``--hicache-size``
            is then refused), else None.

    Raises:
        HostTierOptionError: a value out of bounds, ``--no-hicache`` with another
            option, ``--hicache-size`` for a hybrid model, or a pool above MAX_TOKENS.
    """
    given = ratio is not None or size_gb is not None or write_policy is not None
    if enabled is False:
        if given:
            raise HostTierOptionError("--no-hicache", "a --hicache-* option needs the host tier; leave out --no-hicache")
        return None
    if base is None and not given and not enabled:
        return None
    if ratio is not None and not 0 < ratio <= MAX_HICACHE_RATIO:
        raise HostTierOptionError("--hicache-ratio", f"must lie in (0, {MAX_HICACHE_RATIO:g}], found {ratio}")
    if size_gb is not None and not 0 <= size_gb <= MAX_HICACHE_SIZE_GB:
        raise HostTierOptionError("--hicache-size", f"must lie in [0, {MAX_HICACHE_SIZE_GB}] GB, found {size_gb}")
    if write_policy is not None and write_policy not in WRITE_POLICIES:
        raise HostTierOptionError("--hicache-write-policy", f"must be one of {', '.join(WRITE_POLICIES)}, found {write_policy!r}")
    if size_gb == 0:  # SGLang's 0: sized by the ratio
        size_gb = None
        if ratio is None:
            ratio = DEFAULT_HICACHE_RATIO if base is None or base.host_ratio is None else base.host_ratio
    if size_gb is None and ratio is None:
        if base is not None:
            size_gb, ratio = base.host_size_gb, base.host_ratio
        else:
            ratio = DEFAULT_HICACHE_RATIO
    policy = write_policy or (base.write_policy if base is not None else "write_through")
    if size_gb is not None:
        if hybrid_model is not None:
            raise HostTierOptionError(
                "--hicache-size",
                f"sizes the host pool of a full-attention model only ({hybrid_model} is hybrid: its host copy's "
                "bytes per token are not modelled); give --hicache-ratio",
            )
        tokens = host_tokens_for_size(size_gb, bytes_per_token, page_size)
        tier = HostTier(host_pool_tokens=tokens, write_policy=policy, host_ratio=None, host_size_gb=size_gb)  # type: ignore[arg-type]
    else:
        device = device_tokens // page_size * page_size
        tokens = host_pool_tokens_for(device, page_size, ratio)  # type: ignore[arg-type]
        tier = HostTier(host_pool_tokens=tokens, write_policy=policy, host_ratio=float(ratio))  # type: ignore[arg-type]
    if base is not None and not resized and (tier.host_ratio, tier.host_size_gb) == (base.host_ratio, base.host_size_gb):
        tier = replace(tier, host_pool_tokens=base.host_pool_tokens)  # the trace's own
    if tier.host_pool_tokens > MAX_TOKENS:
        raise HostTierOptionError(
            "--hicache-size" if size_gb is not None else "--hicache-ratio",
            f"makes a host pool of {tier.host_pool_tokens:,} tokens, above {MAX_TOKENS:,} (slot indices are int32)",
        )
    return tier


def host_tier_from_dict(obj: Any, page_size: int) -> HostTier:
    """The stored ``config.hicache`` object, every field checked.

    Raises:
        ValueError: naming the bad key, what it must be and what was found.
    """
    where = "config.hicache"
    if not isinstance(obj, dict):
        raise ValueError(f"metadata '{where}' must be an object or null, found {_found(obj)}")
    unknown = sorted(set(obj) - set(HostTier.__dataclass_fields__))  # type: ignore[attr-defined]
    if unknown:
        raise ValueError(f"metadata has an unexpected key {_found(where + '.' + unknown[0])}")
    tokens = obj.get("host_pool_tokens")
    if not _is_int(tokens) or not page_size <= tokens <= MAX_TOKENS or tokens % page_size:
        raise ValueError(
            f"metadata '{where}.host_pool_tokens' must be a multiple of config.page_size ({page_size}) "
            f"in [{page_size}, {MAX_TOKENS}], found {_found(tokens)}"
        )
    policy = obj.get("write_policy", "write_through")
    if policy not in WRITE_POLICIES:
        raise ValueError(f"metadata '{where}.write_policy' must be one of {', '.join(WRITE_POLICIES)}, found {_found(policy)}")
    ratio = obj.get("host_ratio")
    if ratio is not None and (
        not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0 < ratio <= MAX_HICACHE_RATIO
    ):
        raise ValueError(f"metadata '{where}.host_ratio' must be a number in (0, {MAX_HICACHE_RATIO:g}] or null, found {_found(ratio)}")
    size = obj.get("host_size_gb")
    if size is not None and (not _is_int(size) or not 1 <= size <= MAX_HICACHE_SIZE_GB):
        raise ValueError(f"metadata '{where}.host_size_gb' must be an integer in [1, {MAX_HICACHE_SIZE_GB}] or null, found {_found(size)}")
    if (ratio is None) == (size is None):
        raise ValueError(f"metadata '{where}' must hold exactly one of host_ratio and host_size_gb")
    return HostTier(
        host_pool_tokens=tokens,
        write_policy=policy,
        host_ratio=None if ratio is None else float(ratio),
        host_size_gb=size,
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _found(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
