"""Named model presets: the model shapes and attention layouts a trace may be recorded
for (``kvtrace record --model NAME``), as data.

Each preset follows one public model configuration (``source``: the Hugging Face
``config.json`` it copies, and which of its fields), as SGLang 0.5.23 reads it
(``configs/model_config.py`` ``get_hybrid_layer_ids``: ``layer_types`` for gpt-oss and
Gemma 3). A preset without sliding-window layers is a full-attention model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from traces.metadata import DEFAULT_SWA_FULL_TOKENS_RATIO, AttentionLayout, ModelShape, swa_pool_tokens_for

__all__ = ["DEFAULT_MODEL", "MODEL_PRESETS", "ModelPreset", "model_preset"]


@dataclass(frozen=True, slots=True)
class ModelPreset:
    """A model's KV shape and which of its layers attend through a sliding window.

    Attributes:
        shape: layers, KV heads, head dim, dtype (``shape.name`` is the model's name).
        swa_layer_ids: the sliding-window layers; empty for a full-attention model.
        sliding_window: the window in tokens (None for a full-attention model).
        source: the public configuration the numbers follow, in one line.
    """

    shape: ModelShape
    swa_layer_ids: tuple[int, ...]
    sliding_window: int | None
    source: str

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


def _every(num_layers: int, keep: Callable[[int], bool]) -> tuple[int, ...]:
    return tuple(i for i in range(num_layers) if keep(i))


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
