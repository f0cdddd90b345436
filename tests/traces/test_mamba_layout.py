"""The Mamba (hybrid linear-attention) layout in a trace's metadata (format version 3):
written, read back, checked, absent from older traces; and SGLang's memory split."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.differential import harness
from tests.helpers import make_meta, with_meta
from traces.errors import TraceMetadataError
from traces.mamba_layout import MambaLayout, mamba_slots_for_pool, split_mamba_memory
from traces.metadata import ModelShape, TraceMeta
from traces.reader import TraceReader
from traces.samples import sample_path

# Qwen3-Next-80B-A3B: 48 layers, every 4th full attention (2 KV heads of 256), the others GDN.
QWEN3_NEXT = ModelShape(name="Qwen3-Next-80B-A3B", num_layers=48, num_kv_heads=2, head_dim=256, dtype="bfloat16")
LAYOUT = MambaLayout(
    full_layer_ids=tuple(range(3, 48, 4)),
    mamba_layer_ids=tuple(i for i in range(48) if i % 4 != 3),
    conv_state_bytes=49_152,
    temporal_state_bytes=2_097_152,
    mamba_cache_size=48,
)


def _mamba_meta() -> TraceMeta:
    return dataclasses.replace(make_meta(pool_tokens=8192), model=QWEN3_NEXT, mamba=LAYOUT)


def _mamba_json(**edits: Any) -> dict[str, Any]:
    data = json.loads(_mamba_meta().to_json())
    data["mamba"].update(edits)
    return data["mamba"]


def test_the_layout_round_trips_as_version_3_and_is_left_out_when_absent() -> None:
    meta = _mamba_meta()
    data = json.loads(meta.to_json())
    assert data["format_version"] == 3 and "attention" not in data
    assert data["mamba"]["mamba_layer_ids"][:4] == [0, 1, 2, 4] and data["mamba"]["mamba_cache_size"] == 48
    assert TraceMeta.from_json(meta.to_json()) == meta
    assert "mamba" not in json.loads(make_meta().to_json())
    assert LAYOUT.state_bytes_per_request == 36 * 2_146_304 and LAYOUT.layer_kinds(8) == "MMMFMMMF"


@pytest.mark.parametrize("name", ["tiny", "mooncake-gpt-oss"])
def test_traces_without_it_write_their_metadata_byte_for_byte_as_before(name: str) -> None:
    import pyarrow as pa

    path = sample_path(name)
    with pa.OSFile(str(path)) as sink:
        is_file = sink.read(6) == b"ARROW1"
        sink.seek(0)
        raw = (pa.ipc.open_file(sink) if is_file else pa.ipc.open_stream(sink)).schema.metadata[b"kvtrace"]
    meta = TraceReader(path).meta
    assert meta.mamba is None and meta.format_version < 3
    assert meta.to_json().encode() == raw


@pytest.mark.parametrize(
    ("mamba", "message"),
    [
        (_mamba_json(mamba_layer_ids=[0, 3]), "layer 3 is in both full_layer_ids and mamba_layer_ids"),
        (_mamba_json(mamba_layer_ids=[]), "'mamba.mamba_layer_ids' is empty"),
        (_mamba_json(full_layer_ids=[3, 48]), "'mamba.full_layer_ids' must be a list of layer ids in [0, 48)"),
        (_mamba_json(mamba_layer_ids=[2, 1]), "'mamba.mamba_layer_ids' must be ascending without repeats"),
        (_mamba_json(mamba_cache_size=0), "'mamba.mamba_cache_size' must be an integer in [1, "),
        (_mamba_json(temporal_state_bytes="2MiB"), "'mamba.temporal_state_bytes' must be an integer in [1, "),
        (_mamba_json(mamba_full_memory_ratio=-1), "'mamba.mamba_full_memory_ratio' must be a positive number"),
        (_mamba_json(kind="rwkv"), "'mamba.kind' must be one of gdn, mamba2, found 'rwkv'"),
        (_mamba_json(slots=3), "unexpected key 'mamba.slots'"),
        ([1, 2], "'mamba' must be an object or null"),
    ],
)
def test_a_bad_layout_is_one_clear_error(mamba: Any, message: str) -> None:
    data = json.loads(_mamba_meta().to_json())
    data["mamba"] = mamba
    with pytest.raises(ValueError) as info:
        TraceMeta.from_dict(data)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_version_2_trace_cannot_hold_it() -> None:
    data = json.loads(_mamba_meta().to_json())
    data["format_version"] = 2
    with pytest.raises(ValueError, match="'mamba', which format version 2 does not have"):
        TraceMeta.from_dict(data)


def test_a_damaged_layout_fails_when_the_trace_is_opened(tmp_path: Path) -> None:
    def edit(data: dict[str, Any]) -> None:
        data.update(format_version=3, model=json.loads(_mamba_meta().to_json())["model"])
        data["mamba"] = _mamba_json(conv_state_bytes=-1)

    with pytest.raises(TraceMetadataError, match=r"invalid kvtrace metadata: metadata 'mamba.conv_state_bytes'"):
        TraceReader(with_meta(sample_path("tiny"), tmp_path / "bad.kvtrace", edit))


QWEN3_NEXT_STATE = LAYOUT.state_bytes_per_request  # 77,266,944 B: SGLang's mamba_cache_per_req
QWEN3_NEXT_KV = LAYOUT.full_bytes_per_token(QWEN3_NEXT)  # 24,576 B per token in 12 full layers

# (case, SGLang's slots, KV pool tokens, request rows): what sglang_mamba_split.py printed
# under SGLang 0.5.23 for Qwen3-Next with these settings (``draft_tokens``: EAGLE with that
# many draft tokens per step; ``strategy``: the Mamba radix strategy, without the overlap
# scheduler, SGLang's at page > 1 with the radix cache: 3 + 1 tracking slots per request).
SGLANG_SPLITS = [
    ({"ratio": 0.9, "max_running": None, "radix_cache": True, "page_size": 16, "context_len": 262144,
      "rest_bytes": 40_000_000_000, "strategy": "extra_buffer"}, (244, 857_312, 61)),
    ({"ratio": 0.9, "max_running": 64, "radix_cache": False, "page_size": 16, "context_len": 262144,
      "rest_bytes": 40_000_000_000}, (64, 1_423_232, 64)),
    ({"ratio": 0.5, "max_running": 32, "radix_cache": True, "page_size": 1, "context_len": 262144,
      "rest_bytes": 40_000_000_000}, (171, 1_086_836, 32)),
    ({"ratio": 0.9, "max_running": None, "radix_cache": False, "page_size": 64, "context_len": 4096,
      "rest_bytes": 3_000_000_000}, None),
    ({"ratio": 0.9, "max_running": 48, "radix_cache": True, "page_size": 16, "context_len": 262144,
      "rest_bytes": 40_000_000_000, "draft_tokens": 4, "strategy": "extra_buffer"}, (120, 857_312, 30)),
    ({"ratio": 0.9, "max_running": 16, "radix_cache": False, "page_size": 64, "context_len": 262144,
      "rest_bytes": 20_000_000_000, "draft_tokens": 8}, (16, 332_736, 16)),
]  # fmt: skip


def _split(case: dict[str, Any]) -> tuple[int, int, int]:
    return tuple(split_mamba_memory(  # type: ignore[return-value]
        case["rest_bytes"], QWEN3_NEXT_STATE, QWEN3_NEXT_KV, case["page_size"], ratio=case["ratio"],
        radix_cache=case["radix_cache"], max_running=case["max_running"], context_len=case["context_len"],
        num_draft_tokens=case.get("draft_tokens"),
    ))  # fmt: skip


@pytest.mark.parametrize(("case", "expected"), [c for c in SGLANG_SPLITS if c[1] is not None])
def test_the_split_is_sglangs(case: dict[str, Any], expected: tuple[int, int, int]) -> None:
    assert _split(case) == expected


def test_a_budget_without_a_slot_is_refused() -> None:
    with pytest.raises(ValueError, match="buys no Mamba state slot"):
        split_mamba_memory(100_000_000, QWEN3_NEXT_STATE, QWEN3_NEXT_KV, 1)


def test_the_slots_for_a_pool_are_those_of_its_memory() -> None:
    # The budget that leaves a pool of P tokens: P's bytes times 1 + ratio.
    slots = mamba_slots_for_pool(857_312, QWEN3_NEXT_KV, QWEN3_NEXT_STATE)
    rest = 857_312 * QWEN3_NEXT_KV * 1.9
    assert slots == split_mamba_memory(int(rest), QWEN3_NEXT_STATE, QWEN3_NEXT_KV, 1, max_running=8).mamba_cache_size
    assert mamba_slots_for_pool(1, QWEN3_NEXT_KV, QWEN3_NEXT_STATE) == 1  # at least one


@pytest.mark.slow
@pytest.mark.parametrize(("case", "expected"), SGLANG_SPLITS)
def test_sglangs_own_code_splits_the_budget_so(case: dict[str, Any], expected: Any) -> None:
    # skipped unless $KVTRACE_SGLANG_PYTHON names an interpreter with SGLang 0.5.23
    python = harness.require_sglang()
    script = Path(__file__).with_name("sglang_mamba_split.py")
    done = subprocess.run([python, str(script), json.dumps(case)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    sglang = json.loads(done.stdout.strip().splitlines()[-1])
    assert sglang["state_bytes"] == QWEN3_NEXT_STATE and sglang["cell"] == QWEN3_NEXT_KV
    assert tuple(sglang["full"]) == LAYOUT.full_layer_ids and tuple(sglang["mamba"]) == LAYOUT.mamba_layer_ids
    assert (sglang["slots"], sglang["tokens"], sglang["rows"]) == _split(case)
    if expected is not None:
        assert _split(case) == expected


@pytest.mark.slow
def test_the_presets_state_and_layers_are_sglangs() -> None:
    # skipped unless $KVTRACE_SGLANG_PYTHON names an interpreter with SGLang 0.5.23
    from traces.models import model_preset

    python = harness.require_sglang()
    script = Path(__file__).with_name("sglang_mamba_split.py")
    # Each as kvtrace serves it with the radix cache: the GDN model above page 1 with
    # extra_buffer, the Mamba2 one (no extra_buffer in SGLang) at page 1 with no_buffer.
    for model, name, page, strategy in (("qwen3-next", "qwen3-next-80b-a3b", 16, "extra_buffer"),
                                        ("nemotron-h", "nemotron-h-8b", 1, None)):
        case = {"model": model, "ratio": 0.9, "max_running": 64, "radix_cache": True, "page_size": page,
                "context_len": 8192, "rest_bytes": 40_000_000_000, "strategy": strategy}  # fmt: skip
        done = subprocess.run([python, str(script), json.dumps(case)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        sglang = json.loads(done.stdout.strip().splitlines()[-1])
        preset = model_preset(name)
        layout = preset.mamba_layout(1000)
        assert layout is not None
        assert sglang["state_bytes"] == layout.state_bytes_per_request, name
        assert sglang["cell"] == layout.full_bytes_per_token(preset.shape), name
        assert tuple(sglang["full"]) == layout.full_layer_ids and tuple(sglang["mamba"]) == layout.mamba_layer_ids
        split = split_mamba_memory(case["rest_bytes"], layout.state_bytes_per_request,  # type: ignore[arg-type]
                                   sglang["cell"], page, max_running=64, context_len=8192)  # fmt: skip
        assert (sglang["slots"], sglang["tokens"], sglang["rows"]) == tuple(split), name
