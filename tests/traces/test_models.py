"""Named model presets: data the recorder's --model names, each a valid layout."""

from __future__ import annotations

import dataclasses

import pytest

from kvtrace.record.serving import MODEL_NAMES
from kvtrace.record.simulate import DEFAULT_MODEL_SHAPE
from tests.helpers import make_meta
from traces.metadata import TraceMeta
from traces.models import DEFAULT_MODEL, MODEL_PRESETS, model_preset


def test_the_command_line_names_every_preset() -> None:
    assert MODEL_NAMES == tuple(MODEL_PRESETS)
    assert model_preset(DEFAULT_MODEL).shape == DEFAULT_MODEL_SHAPE  # what record assumes unless told
    assert model_preset(" GPT-OSS-20B ") is MODEL_PRESETS["gpt-oss-20b"]
    with pytest.raises(ValueError, match="unknown model 'llama'; known models: llama-3.1-8b, gpt-oss-20b"):
        model_preset("llama")


def test_gpt_oss_alternates_one_to_one_with_a_128_token_window() -> None:
    layout = model_preset("gpt-oss-20b").layout(pool_tokens=100_000, page_size=16)
    assert layout is not None and layout.sliding_window == 128
    assert layout.layer_kinds(24) == "SF" * 12
    assert layout.swa_pool_tokens == 80_000 and layout.swa_full_tokens_ratio == 0.8


def test_gemma_3_has_five_local_layers_per_global_with_a_1024_token_window() -> None:
    preset = model_preset("gemma-3-27b")
    layout = preset.layout(pool_tokens=4096, page_size=64)
    assert layout is not None and layout.sliding_window == 1024
    assert layout.layer_kinds(62) == ("S" * 5 + "F") * 10 + "SS"
    assert len(layout.full_layer_ids) == 10 and len(layout.swa_layer_ids) == 52
    assert layout.swa_pool_tokens == 3264  # int(4096 * 0.8) = 3276 -> 51 pages of 64


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_every_preset_is_a_valid_trace_model(name: str) -> None:
    preset = MODEL_PRESETS[name]
    assert preset.source and "\n" not in preset.source and "config" in preset.source
    assert preset.has_swa == (preset.sliding_window is not None)
    meta = dataclasses.replace(make_meta(), model=preset.shape, attention=preset.layout(4096, 16))
    assert TraceMeta.from_json(meta.to_json()) == meta


def test_qwen3_next_has_three_gdn_layers_per_full_one() -> None:
    preset = model_preset("qwen3-next-80b-a3b")
    layout = preset.mamba_layout(pool_tokens=920_000)
    assert layout is not None and layout.kind == "gdn" and preset.layout(4096, 16) is None
    assert layout.layer_kinds(48) == "MMMF" * 12
    # Per GDN layer: conv (8192, 3) bfloat16 + temporal (32, 128, 128) float32.
    assert (layout.conv_state_bytes, layout.temporal_state_bytes) == (49_152, 2_097_152)
    assert layout.state_bytes_per_request == 36 * (49_152 + 2_097_152)
    assert layout.full_bytes_per_token(preset.shape) == 12 * 2 * 2 * 256 * 2  # 12 full layers, 2 KV heads of 256
    # The slots of 0.9 x the pool's bytes: int(0.9 * 920,000 * 24,576 / 77,266,944) - 1.
    assert layout.mamba_cache_size == 262


def test_nemotron_h_keeps_kv_in_4_layers_and_state_in_24() -> None:
    preset = model_preset("nemotron-h-8b")
    layout = preset.mamba_layout(pool_tokens=100_000)
    assert layout is not None and layout.kind == "mamba2"
    assert layout.layer_kinds(52).count("F") == 4 and layout.layer_kinds(52).count("M") == 24
    assert layout.layer_kinds(52).startswith("M-M-M-MF-M")
    # Per Mamba2 layer: conv (128 * 64 + 2 * 8 * 128, 3) bfloat16 + temporal (128, 64, 128) float32.
    assert (layout.conv_state_bytes, layout.temporal_state_bytes) == (61_440, 4_194_304)


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_every_preset_round_trips_its_mamba_layout(name: str) -> None:
    preset = MODEL_PRESETS[name]
    meta = dataclasses.replace(make_meta(), model=preset.shape, mamba=preset.mamba_layout(4096))
    assert TraceMeta.from_json(meta.to_json()) == meta
    assert (meta.mamba is not None) == (preset.linear is not None)
