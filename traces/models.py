"""Named model presets: the model shapes and attention layouts a trace may be recorded
for (``kvtrace record --model NAME``), as data.

Each preset follows one public model configuration (``source``: the Hugging Face
``config.json`` it copies, and which of its fields), as SGLang 0.5.23 reads it
(``configs/model_config.py`` ``get_hybrid_layer_ids``: ``layer_types`` for gpt-oss and
Gemma 3; ``configs/qwen3_next.py`` and ``configs/nemotron_h.py`` for the hybrid
linear-attention models). A preset without sliding-window or linear layers is a
full-attention model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from traces.mamba_layout import DEFAULT_MAMBA_FULL_MEMORY_RATIO, MambaKind, MambaLayout
from traces.metadata import DEFAULT_SWA_FULL_TOKENS_RATIO, AttentionLayout, ModelShape, swa_pool_tokens_for

__all__ = ["DEFAULT_MODEL", "MODEL_PRESETS", "ModelPreset", "model_preset"]


@dataclass(frozen=True, slots=True)
class LinearLayers:
    """A hybrid linear-attention model's layers and per-request state.

    Attributes:
        full_layer_ids: the full-attention layers (KV in the token pool).
        mamba_layer_ids: the linear-attention (Mamba2 / GDN) layers.
        conv_state_bytes: one request's conv state in one linear layer.
        temporal_state_bytes: one request's temporal (SSM) state in one linear layer.
        kind: ``gdn`` or ``mamba2``.
    """

    full_layer_ids: tuple[int, ...]
    mamba_layer_ids: tuple[int, ...]
    conv_state_bytes: int
    temporal_state_bytes: int
    kind: MambaKind


def _mamba2_state_bytes(
    *, num_heads: int, head_dim: int, state_size: int, n_groups: int, conv_kernel: int
) -> tuple[int, int]:
    """Conv and temporal state bytes of one layer at TP 1 (``Mamba2StateShape.create``):
    conv ``(num_heads * head_dim + 2 * n_groups * state_size, conv_kernel - 1)`` in
    bfloat16, temporal ``(num_heads, head_dim, state_size)`` in float32 (SGLang's
    default state dtypes, ``mamba2_state_dtype``)."""
    conv_dim = num_heads * head_dim + 2 * n_groups * state_size
    return conv_dim * (conv_kernel - 1) * 2, num_heads * head_dim * state_size * 4


@dataclass(frozen=True, slots=True)
class ModelPreset:
    """A model's KV shape and which of its layers attend through a sliding window.

    Attributes:
        shape: layers, KV heads, head dim, dtype (``shape.name`` is the model's name).
        swa_layer_ids: the sliding-window layers; empty for a full-attention model.
        sliding_window: the window in tokens (None for a full-attention model).
        source: the public configuration the numbers follow, in one line.
        linear: a hybrid linear-attention model's layers and state (None: none).
    """

    shape: ModelShape
    swa_layer_ids: tuple[int, ...]
    sliding_window: int | None
    source: str
    linear: LinearLayers | None = None

    @property
    def has_swa(self) -> bool:
        return bool(self.swa_layer_ids)

    def layout(
        self, pool_tokens: int, page_size: int, ratio: float = DEFAULT_SWA_FULL_TOKENS_RATIO
    ) -> AttentionLayout | None:
        """The trace's attention layout for a full pool of ``pool_tokens`` (None: full attention).

        The SWA pool is the one SGLang derives from the full pool (``swa_pool_tokens_for``).
        """
        if not self.swa_layer_ids:
            return None
        assert self.sliding_window is not None, self.shape.name
        swa = set(self.swa_layer_ids)
        return AttentionLayout(
            full_layer_ids=tuple(i for i in range(self.shape.num_layers) if i not in swa),
            swa_layer_ids=self.swa_layer_ids,
            sliding_window=self.sliding_window,
            swa_pool_tokens=swa_pool_tokens_for(pool_tokens, page_size, ratio),
            swa_full_tokens_ratio=ratio,
        )


    def mamba_layout(
        self, pool_tokens: int, ratio: float = DEFAULT_MAMBA_FULL_MEMORY_RATIO
    ) -> MambaLayout | None:
        """The trace's Mamba layout beside a KV pool of ``pool_tokens`` (None: no linear
        layers): the slots are those SGLang gives the memory that holds this pool
        (``mamba_slots_for_pool``)."""
        lin = self.linear
        if lin is None:
            return None
        layout = MambaLayout(
            full_layer_ids=lin.full_layer_ids,
            mamba_layer_ids=lin.mamba_layer_ids,
            conv_state_bytes=lin.conv_state_bytes,
            temporal_state_bytes=lin.temporal_state_bytes,
            mamba_cache_size=1,
            mamba_full_memory_ratio=ratio,
            kind=lin.kind,
        )
        return layout.for_pool(pool_tokens, self.shape)


def _every(num_layers: int, keep: Callable[[int], bool]) -> tuple[int, ...]:
    return tuple(i for i in range(num_layers) if keep(i))


_NEMOTRON_H_8B = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"

MODEL_PRESETS: dict[str, ModelPreset] = {
    "llama-3.1-8b": ModelPreset(
        ModelShape(name="Llama-3.1-8B", num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16"),
        swa_layer_ids=(),
        sliding_window=None,
        source="meta-llama/Llama-3.1-8B config.json: 32 layers, 8 KV heads, head_dim 4096/32 = 128 "
        "(the recorder's default shape)",
    ),
    "gpt-oss-20b": ModelPreset(
        ModelShape(name="gpt-oss-20b", num_layers=24, num_kv_heads=8, head_dim=64, dtype="bfloat16"),
        swa_layer_ids=_every(24, lambda i: i % 2 == 0),
        sliding_window=128,
        source="openai/gpt-oss-20b config.json: 24 layers, layer_types alternating sliding_attention "
        "(even) / full_attention (odd), sliding_window 128, 8 KV heads, head_dim 64",
    ),
    "gpt-oss-120b": ModelPreset(
        ModelShape(name="gpt-oss-120b", num_layers=36, num_kv_heads=8, head_dim=64, dtype="bfloat16"),
        swa_layer_ids=_every(36, lambda i: i % 2 == 0),
        sliding_window=128,
        source="openai/gpt-oss-120b config.json: 36 layers, layer_types alternating sliding_attention "
        "(even) / full_attention (odd), sliding_window 128, 8 KV heads, head_dim 64",
    ),
    "gemma-3-27b": ModelPreset(
        ModelShape(name="gemma-3-27b", num_layers=62, num_kv_heads=16, head_dim=128, dtype="bfloat16"),
        swa_layer_ids=_every(62, lambda i: (i + 1) % 6 != 0),
        sliding_window=1024,
        source="google/gemma-3-27b-it config.json text_config: 62 layers, sliding_window_pattern 6 "
        "(5 sliding_attention then 1 full_attention), sliding_window 1024, 16 KV heads, head_dim 128",
    ),
    # Qwen3-Next: every 4th layer full attention (``full_attention_interval`` 4), the
    # others gated delta net; state per GDN layer (TP 1): conv (8192, 3) bfloat16 =
    # 49,152 B, temporal (32, 128, 128) float32 = 2,097,152 B.
    "qwen3-next-80b-a3b": ModelPreset(
        ModelShape(name="Qwen3-Next-80B-A3B", num_layers=48, num_kv_heads=2, head_dim=256, dtype="bfloat16"),
        swa_layer_ids=(),
        sliding_window=None,
        source="Qwen/Qwen3-Next-80B-A3B-Instruct config.json: 48 layers, full_attention_interval 4 "
        "(12 full_attention, 36 linear_attention), 2 KV heads, head_dim 256, linear_num_value_heads 32, "
        "linear_num_key_heads 16, linear_key/value_head_dim 128, linear_conv_kernel_dim 4",
        linear=LinearLayers(
            full_layer_ids=_every(48, lambda i: (i + 1) % 4 == 0),
            mamba_layer_ids=_every(48, lambda i: (i + 1) % 4 != 0),
            conv_state_bytes=_mamba2_state_bytes(num_heads=32, head_dim=128, state_size=128, n_groups=16, conv_kernel=4)[0],
            temporal_state_bytes=_mamba2_state_bytes(
                num_heads=32, head_dim=128, state_size=128, n_groups=16, conv_kernel=4
            )[1],
            kind="gdn",
        ),
    ),
    # Nemotron-H 8B: hybrid_override_pattern "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
    # (M Mamba2, * attention, - MLP: 24 Mamba2, 4 attention, 24 MLP layers); state per
    # Mamba2 layer (TP 1): conv (10240, 3) bfloat16 = 61,440 B, temporal (128, 64, 128)
    # float32 = 4,194,304 B.
    "nemotron-h-8b": ModelPreset(
        ModelShape(name="Nemotron-H-8B", num_layers=52, num_kv_heads=8, head_dim=128, dtype="bfloat16"),
        swa_layer_ids=(),
        sliding_window=None,
        source="nvidia/Nemotron-H-8B-Base-8K config.json (SGLang NemotronHConfig's defaults): 52 layers, "
        "hybrid_override_pattern with 24 M / 4 * / 24 -, 8 KV heads, head_dim 128, mamba_num_heads 128, "
        "mamba_head_dim 64, ssm_state_size 128, n_groups 8, conv_kernel 4",
        linear=LinearLayers(
            full_layer_ids=tuple(i for i, c in enumerate(_NEMOTRON_H_8B) if c == "*"),
            mamba_layer_ids=tuple(i for i, c in enumerate(_NEMOTRON_H_8B) if c == "M"),
            conv_state_bytes=_mamba2_state_bytes(num_heads=128, head_dim=64, state_size=128, n_groups=8, conv_kernel=4)[0],
            temporal_state_bytes=_mamba2_state_bytes(
                num_heads=128, head_dim=64, state_size=128, n_groups=8, conv_kernel=4
            )[1],
            kind="mamba2",
        ),
    ),
}
DEFAULT_MODEL = "llama-3.1-8b"


def model_preset(name: str) -> ModelPreset:
    """The preset called ``name`` (case-insensitive).

    Raises:
        ValueError: an unknown name; the message lists the known ones.
    """
    preset = MODEL_PRESETS.get(name.strip().lower())
    if preset is None:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODEL_PRESETS)}")
    return preset
