"""The attention layout in a trace's metadata (format version 2): written, read back,
checked, and absent in version 1 traces, which keep reading as before."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import make_meta, with_meta
from traces.errors import TraceMetadataError
from traces.metadata import AttentionLayout, ModelShape, TraceMeta, split_kv_bytes, swa_pool_tokens_for
from traces.reader import TraceReader
from traces.samples import sample_path
from traces.schema import SCHEMA_VERSION

# gpt-oss-20b's shape: 24 layers alternating sliding (even) and full (odd), 8 KV heads of 64.
GPT_OSS = ModelShape(name="gpt-oss-20b", num_layers=24, num_kv_heads=8, head_dim=64, dtype="bfloat16")
LAYOUT = AttentionLayout(
    full_layer_ids=tuple(range(1, 24, 2)), swa_layer_ids=tuple(range(0, 24, 2)), sliding_window=128, swa_pool_tokens=3168
)


def _swa_meta() -> TraceMeta:
    return dataclasses.replace(make_meta(pool_tokens=3968), model=GPT_OSS, attention=LAYOUT)


def _attention_json(**edits: Any) -> dict[str, Any]:
    data = json.loads(_swa_meta().to_json())
    data["attention"].update(edits)
    return {key: value for key, value in data["attention"].items() if value is not ...}


def test_the_layout_round_trips_and_is_left_out_when_absent() -> None:
    meta = _swa_meta()
    data = json.loads(meta.to_json())
    assert data["format_version"] == 2 and SCHEMA_VERSION >= 2
    assert data["attention"]["full_layer_ids"] == list(range(1, 24, 2)) and data["attention"]["sliding_window"] == 128
    assert TraceMeta.from_json(meta.to_json()) == meta
    # Full attention: no 'attention' key at all, written as version 1 (the lowest version
    # that holds it), so readers of version 1 read it.
    assert "attention" not in json.loads(make_meta().to_json())
    assert json.loads(make_meta().to_json())["format_version"] == 1
    assert TraceMeta.from_json(make_meta().to_json()).attention is None


def test_pool_costs_and_split_follow_sglang() -> None:
    # Full-attention shape: every layer in one pool, as before.
    assert ModelShape().bytes_per_token == 2 * 32 * 8 * 128 * 2
    # 12 full and 12 SWA layers of 2 x 8 x 64 x 2 bytes each.
    assert LAYOUT.full_bytes_per_token(GPT_OSS) == LAYOUT.swa_bytes_per_token(GPT_OSS) == 12 * 2048
    assert LAYOUT.layer_kinds(24) == "SF" * 12
    # SWA pool = int(full * ratio) floored to a page; the full pool floored first.
    assert swa_pool_tokens_for(3968, 16, 0.8) == 3168  # int(3174.4) = 3174 -> 3168
    assert swa_pool_tokens_for(3970, 1, 0.5) == 1985
    # 1 GiB of KV: full pool = 2**30 // (24576 + 0.8 * 24576) = 24,272 tokens (a whole
    # number of 16-token pages); SWA = int(24,272 * 0.8) = 19,417 -> 19,408.
    assert split_kv_bytes(1 << 30, GPT_OSS, LAYOUT.full_layer_ids, LAYOUT.swa_layer_ids, 16) == (24272, 19408)
    # All-SWA: one pool, the ratio does not apply.
    assert split_kv_bytes(1 << 20, GPT_OSS, (), tuple(range(24)), 1) == (0, (1 << 20) // (24 * 2048))


def test_version_1_samples_read_as_full_attention() -> None:
    reader = TraceReader(sample_path("tiny"))
    assert reader.meta.format_version == 1 and reader.meta.attention is None


def test_a_version_2_trace_without_layout_reads_as_version_1(tmp_path: Path) -> None:
    v1 = TraceReader(sample_path("tiny"))
    v2 = TraceReader(with_meta(sample_path("tiny"), tmp_path / "v2.kvtrace", lambda d: d.update(format_version=2)))
    assert dataclasses.replace(v2.meta, format_version=1) == v1.meta
    a, b = list(v1.steps()), list(v2.steps())
    assert len(a) == len(b) and all(x.equals(y) for x, y in zip(a, b))


@pytest.mark.parametrize(
    ("attention", "message"),
    [
        (_attention_json(sliding_window=0), "'attention.sliding_window' must be an integer in [1, 2147483647], found 0"),
        (_attention_json(swa_layer_ids=[0, 1]), "layer 1 is in both full_layer_ids and swa_layer_ids"),
        (_attention_json(full_layer_ids=[1, 24]), "'attention.full_layer_ids' must be a list of layer ids in [0, 24)"),
        (_attention_json(full_layer_ids=[3, 1]), "'attention.full_layer_ids' must be ascending without repeats"),
        (_attention_json(swa_layer_ids=[]), "'attention.swa_layer_ids' is empty"),
        (_attention_json(swa_full_tokens_ratio=0), "'attention.swa_full_tokens_ratio' must be a number in (0, 1], found 0"),
        (_attention_json(swa_full_tokens_ratio=1.5), "'attention.swa_full_tokens_ratio' must be a number in (0, 1]"),
        (_attention_json(swa_pool_tokens=None), "'attention.swa_pool_tokens' must be an integer in [16, "),
        (_attention_json(window=128), "unexpected key 'attention.window'"),
        ("full", "'attention' must be an object or null"),
    ],
)
def test_a_bad_layout_is_one_clear_error(attention: Any, message: str) -> None:
    data = json.loads(_swa_meta().to_json())
    data["attention"] = attention
    with pytest.raises(ValueError) as info:
        TraceMeta.from_dict(data)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_bad_layout_fails_when_the_trace_is_opened(tmp_path: Path) -> None:
    def edit(data: dict[str, Any]) -> None:
        data.update(format_version=2, attention=_attention_json(sliding_window=-5))

    with pytest.raises(TraceMetadataError, match=r"invalid kvtrace metadata: metadata 'attention.sliding_window'"):
        TraceReader(with_meta(sample_path("tiny"), tmp_path / "bad.kvtrace", edit))


def test_a_version_1_trace_cannot_hold_a_layout() -> None:
    data = json.loads(_swa_meta().to_json())
    data["format_version"] = 1
    with pytest.raises(ValueError, match="'attention', which format version 1 does not have"):
        TraceMeta.from_dict(data)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**40), max_value=2**40)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=200, deadline=None)
@given(key=st.sampled_from([*AttentionLayout.__dataclass_fields__, "other"]), value=_JSON)
def test_any_json_in_a_layout_field_is_accepted_or_one_value_error(key: str, value: Any) -> None:
    data = json.loads(_swa_meta().to_json())
    data["attention"][key] = value
    try:
        meta = TraceMeta.from_dict(data)
    except ValueError as exc:
        assert str(exc) and "\n" not in str(exc)
    else:
        assert meta.attention is not None and meta.attention.sliding_window >= 1
        assert TraceMeta.from_json(meta.to_json()) == meta


def test_an_unexpected_key_holding_a_newline_is_still_one_line() -> None:
    # Found by test_bounds' property test: the key was printed raw, a two-line error.
    data = json.loads(_swa_meta().to_json())
    data["model"]["\n"] = None
    with pytest.raises(ValueError) as info:
        TraceMeta.from_dict(data)
    assert str(info.value) == "metadata has an unexpected key 'model.\\n'"
