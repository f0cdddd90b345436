"""A hybrid linear-attention model's layout (``MambaLayout``: its full-attention and
Mamba layers, the state each request keeps) and how SGLang 0.5.23 splits GPU memory
between the Mamba state slots and the KV pool (``split_mamba_memory``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal, NamedTuple

if TYPE_CHECKING:
    from traces.metadata import ModelShape


# SGLang's default mamba/full memory ratio (``--mamba-full-memory-ratio``, schedule.py fallback).
DEFAULT_MAMBA_FULL_MEMORY_RATIO = 0.9
# Mamba state slots a running request is sized for with a radix cache: its own state and
# the checkpoints the cache keeps (``MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO``); 1 without.
MAMBA_SLOTS_PER_REQUEST_RADIX = 3
MambaKind = Literal["gdn", "mamba2"]
MAMBA_KINDS: tuple[str, ...] = ("gdn", "mamba2")
# The largest state one linear layer may keep for one request, in bytes: a bound on untrusted input.
MAX_STATE_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class MambaLayout:
    """Which layers attend to the whole sequence and which are linear attention (Mamba2
    or gated delta net), and the Mamba state pool SGLang 0.5.23 serves them with.

    Full-attention layers keep KV in the token pool (``config.pool_tokens``, KV heads
    and head dim of ``model``); each linear layer keeps, per request, a fixed-size
    state in a Mamba slot: a conv state and a temporal (SSM) state
    (``Mamba2CacheParams.mamba_cache_per_req`` in ``configs/mamba_utils.py``). A request
    holds one slot while it runs; with a radix cache, SGLang sizes
    ``MAMBA_SLOTS_PER_REQUEST_RADIX`` slots per running request (``_calculate_mamba_ratio``)
    for the states its cache checkpoints. Layers in neither list (MLP-only layers of
    Nemotron-H) keep nothing.

    Attributes:
        full_layer_ids: the full-attention layers (``full_attention_layer_ids``), ascending.
        mamba_layer_ids: the linear-attention layers (``mamba2_cache_params.layers``),
            ascending; at least one.
        conv_state_bytes: one request's conv state in one linear layer.
        temporal_state_bytes: one request's temporal (SSM) state in one linear layer.
        mamba_cache_size: the Mamba slots of the recording engine
            (``max_mamba_cache_size``; the pool's padding slot not counted).
        mamba_full_memory_ratio: Mamba state memory / KV memory SGLang split the budget
            by (``--mamba-full-memory-ratio``).
        kind: ``gdn`` (gated delta net, Qwen3-Next) or ``mamba2`` (Nemotron-H).
    """

    full_layer_ids: tuple[int, ...]
    mamba_layer_ids: tuple[int, ...]
    conv_state_bytes: int
    temporal_state_bytes: int
    mamba_cache_size: int
    mamba_full_memory_ratio: float = DEFAULT_MAMBA_FULL_MEMORY_RATIO
    kind: MambaKind = "gdn"

    @property
    def state_bytes_per_request(self) -> int:
        """One request's Mamba slot: conv and temporal state in every linear layer."""
        return (self.conv_state_bytes + self.temporal_state_bytes) * len(self.mamba_layer_ids)

    def full_bytes_per_token(self, model: ModelShape) -> int:
        """Bytes of one token in the KV pool: K and V in every full-attention layer."""
        return len(self.full_layer_ids) * model.layer_bytes_per_token

    def for_pool(self, pool_tokens: int, model: ModelShape) -> MambaLayout:
        """This layout beside another KV pool: the slots SGLang gives the memory that
        holds it (``mamba_slots_for_pool``)."""
        slots = mamba_slots_for_pool(
            pool_tokens, self.full_bytes_per_token(model), self.state_bytes_per_request, self.mamba_full_memory_ratio
        )
        return replace(self, mamba_cache_size=slots)

    def layer_kinds(self, num_layers: int) -> str:
        """One letter per layer, ``F`` full attention, ``M`` linear (Mamba), ``-`` neither."""
        full, mamba = set(self.full_layer_ids), set(self.mamba_layer_ids)
        return "".join("F" if i in full else "M" if i in mamba else "-" for i in range(num_layers))


def mamba_slots_per_request(radix_cache: bool, page_size: int = 1) -> int:
    """Mamba slots SGLang sizes per running request (``_calculate_mamba_ratio``): 1
    without a radix cache; with one 3, plus the tracking slot of the ``extra_buffer``
    strategy SGLang serves a page size above 1 with (no overlap scheduler: one slot)."""
    if not radix_cache:
        return 1
    return MAMBA_SLOTS_PER_REQUEST_RADIX + (1 if page_size > 1 else 0)


class MambaSplit(NamedTuple):
    """SGLang's split of a memory budget between Mamba slots and the KV pool.

    Attributes:
        mamba_cache_size: Mamba slots (``max_mamba_cache_size``).
        pool_tokens: KV pool tokens (``max_total_num_tokens``), whole pages.
        max_running: request rows (``max_running_requests``), capped by the slots.
    """

    mamba_cache_size: int
    pool_tokens: int
    max_running: int


def split_mamba_memory(
    rest_bytes: int,
    state_bytes_per_request: int,
    kv_bytes_per_token: int,
    page_size: int,
    *,
    ratio: float = DEFAULT_MAMBA_FULL_MEMORY_RATIO,
    radix_cache: bool = True,
    max_running: int | None = None,
    num_draft_tokens: int | None = None,
    context_len: int | None = None,
) -> MambaSplit:
    """The Mamba slots, KV pool and request rows SGLang 0.5.23 makes of ``rest_bytes``
    of GPU memory left after the weights (``KVCacheConfigurator._handle_max_mamba_cache``,
    then ``DefaultPoolConfigurator.calculate_pool_sizes`` and ``resolve_max_num_reqs``).

    The Mamba share is ``rest * ratio / (1 + ratio)``; it buys ``K`` slots and the pool's
    padding slot. Without a radix cache and with ``max_running`` given, ``K`` is
    ``max_running`` instead. With speculative decoding (``num_draft_tokens``, which
    needs ``max_running``) each slot also reserves ``num_draft_tokens / slots per
    request`` intermediate states, and the intermediate states of the running rows
    come out of the rest. What is left after the slots is the KV pool, a whole
    number of pages of ``kv_bytes_per_token``. Rows are ``min(max_running (or
    SGLang's estimate from context_len), pool // 2, K // slots per request)``.

    One GPU, no pipeline parallelism, no extra-buffer modes, no unified pool, the
    Mamba size not set by hand. GiB amounts are floats, as SGLang keeps them.

    Raises:
        ValueError: the budget buys no Mamba slot or no request row.
    """
    gib = 1 << 30
    rest = rest_bytes / gib
    per = state_bytes_per_request
    slots_per_req = mamba_slots_per_request(radix_cache, page_size)
    if not radix_cache and max_running is not None:
        size = max(1, max_running)
        if num_draft_tokens is not None:
            rest -= per * (size + 1) * num_draft_tokens / gib
    else:
        budget = rest * ratio / (1 + ratio) * gib
        if num_draft_tokens is not None:
            if max_running is None:
                raise ValueError("speculative decoding needs max_running to size the Mamba states")
            d = num_draft_tokens
            size = int((budget - per * (1 + d)) // (per * (1 + d / slots_per_req)))
            capped = min(max(1, max_running), size // slots_per_req)
            rest -= per * (capped + 1) * d / gib
        else:
            size = int((budget - per) // per)
    if size <= 0:
        raise ValueError(f"the memory budget buys no Mamba state slot ({per} bytes each)")
    rest -= (size + 1) * per / gib
    kv_bytes = max(int(rest * gib), 0)
    tokens = kv_bytes // kv_bytes_per_token // page_size * page_size
    if max_running is not None:
        rows = min(max(1, max_running), tokens // 2)
    else:
        estimated = int(tokens / context_len * 512) if context_len else 4096
        rows = min(max(min(estimated, 4096), 2048), tokens // 2)
    rows = min(rows, size // slots_per_req)
    if rows <= 0:
        raise ValueError(f"{size} Mamba slots and {tokens} KV tokens serve no request")
    return MambaSplit(mamba_cache_size=size, pool_tokens=tokens, max_running=rows)


def mamba_slots_for_pool(
    pool_tokens: int, kv_bytes_per_token: int, state_bytes_per_request: int,
    ratio: float = DEFAULT_MAMBA_FULL_MEMORY_RATIO,
) -> int:
    """The Mamba slots SGLang gives the memory that holds a KV pool of ``pool_tokens``:
    that pool's bytes times ``1 + ratio`` split as ``split_mamba_memory`` does (at
    least one slot). What a recording with ``--pool-tokens`` and a hybrid preset keeps."""
    rest = pool_tokens * kv_bytes_per_token * (1 + ratio)
    per = state_bytes_per_request
    return max(int((rest / (1 << 30) * ratio / (1 + ratio) * (1 << 30) - per) // per), 1)
