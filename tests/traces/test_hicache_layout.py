"""HiCache's host tier in a trace's metadata (``config.hicache``, format version 5):
written, read back, checked, absent from older traces; and SGLang's host pool sizing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from allocator.base import HiCacheConfig
from tests.helpers import make_meta, with_meta
from traces.errors import TraceMetadataError
from traces.hicache_layout import HostTier, host_pool_tokens_for, host_tokens_for_size
from traces.metadata import TraceMeta
from traces.reader import TraceReader
from traces.samples import sample_path

TIER = HostTier(host_pool_tokens=host_pool_tokens_for(4096, 16, 2.0), write_policy="write_back", host_ratio=2.0)


def _tier_json(**edits: Any) -> dict[str, Any]:
    data = json.loads(make_meta(hicache=TIER).to_json())
    data["config"]["hicache"].update(edits)
    return data["config"]["hicache"]


def test_the_tier_round_trips_as_version_4_and_is_left_out_when_absent() -> None:
    meta = make_meta(hicache=TIER)
    data = json.loads(meta.to_json())
    assert data["format_version"] == 5
    assert data["config"]["hicache"] == {
        "host_pool_tokens": 8208, "write_policy": "write_back", "host_ratio": 2.0, "host_size_gb": None,
    }  # fmt: skip
    assert TraceMeta.from_json(meta.to_json()) == meta
    plain = json.loads(make_meta().to_json())
    assert "hicache" not in plain["config"] and plain["format_version"] == 1


@pytest.mark.parametrize("name", ["tiny", "mooncake-gpt-oss"])
def test_traces_without_it_keep_their_bytes_and_version(name: str) -> None:
    import pyarrow as pa

    path = sample_path(name)
    with pa.OSFile(str(path)) as sink:
        is_file = sink.read(6) == b"ARROW1"
        sink.seek(0)
        raw = (pa.ipc.open_file(sink) if is_file else pa.ipc.open_stream(sink)).schema.metadata[b"kvtrace"]
    meta = TraceReader(path).meta
    assert meta.config.hicache is None and meta.format_version < 5
    assert meta.to_json().encode() == raw


def test_the_sizing_is_sglangs_host_kv_cache() -> None:
    # HostKVCache: int(device * ratio) rounded down to a page, plus one padding page.
    assert host_pool_tokens_for(4096, 16, 2.0) == 8208
    assert host_pool_tokens_for(1000, 1, 1.5) == 1501
    for device, page, ratio in ((4096, 16, 2.0), (1000, 1, 1.5), (920_000, 64, 0.3)):
        assert host_pool_tokens_for(device, page, ratio) == HiCacheConfig(host_ratio=ratio, page_size=page).pool_tokens(device)
    # --hicache-size 10 (GB) of Llama-3.1-8B (131,072 B per token): 76,293 tokens, one page more.
    assert host_tokens_for_size(10, 131_072, 1) == 76_294
    assert host_tokens_for_size(10, 131_072, 16) == (76_293 // 16 + 1) * 16


def test_for_pool_follows_the_ratio_or_keeps_the_size() -> None:
    assert TIER.for_pool(8192, 16, 131_072).host_pool_tokens == 16_400
    sized = HostTier(host_pool_tokens=76_294, host_ratio=None, host_size_gb=10)
    assert sized.for_pool(8192, 1, 131_072) == sized  # GB: the device pool does not change it


@pytest.mark.parametrize(
    ("tier", "message"),
    [
        (_tier_json(host_pool_tokens=8200), "'config.hicache.host_pool_tokens' must be a multiple of config.page_size (16)"),
        (_tier_json(host_pool_tokens=0), "'config.hicache.host_pool_tokens' must be a multiple"),
        (_tier_json(host_pool_tokens="8208"), "'config.hicache.host_pool_tokens' must be a multiple"),
        (_tier_json(write_policy="write_around"), "'config.hicache.write_policy' must be one of write_through, "),
        (_tier_json(host_ratio=0), "'config.hicache.host_ratio' must be a number in (0, 1000]"),
        (_tier_json(host_ratio=True), "'config.hicache.host_ratio' must be a number"),
        (_tier_json(host_size_gb=-3), "'config.hicache.host_size_gb' must be an integer in [1, "),
        (_tier_json(host_size_gb=4), "exactly one of host_ratio and host_size_gb"),
        (_tier_json(host_ratio=None), "exactly one of host_ratio and host_size_gb"),
        (_tier_json(mem_layout="layer_first"), "unexpected key 'config.hicache.mem_layout'"),
        ([1, 2], "'config.hicache' must be an object or null"),
    ],
)
def test_a_bad_tier_is_one_clear_error(tier: Any, message: str) -> None:
    data = json.loads(make_meta(hicache=TIER).to_json())
    data["config"]["hicache"] = tier
    with pytest.raises(ValueError) as info:
        TraceMeta.from_dict(data)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_version_4_trace_cannot_hold_it() -> None:
    data = json.loads(make_meta(hicache=TIER).to_json())
    data["format_version"] = 4
    with pytest.raises(ValueError, match=r"'config.hicache', which format version 4 does not have"):
        TraceMeta.from_dict(data)


def test_a_damaged_tier_fails_when_the_trace_is_opened(tmp_path: Path) -> None:
    def edit(data: dict[str, Any]) -> None:
        data["format_version"] = 5
        data["config"]["hicache"] = {"host_pool_tokens": -1, "host_ratio": 2.0}

    with pytest.raises(TraceMetadataError, match=r"invalid kvtrace metadata: metadata 'config.hicache.host_pool_tokens'"):
        TraceReader(with_meta(sample_path("tiny"), tmp_path / "bad.kvtrace", edit))


def test_resolving_the_options_over_a_traces_tier() -> None:
    from traces.hicache_layout import HostTierOptionError, resolve_host_tier

    sizes = dict(device_tokens=4100, page_size=16, bytes_per_token=131_072)  # 4,100 -> 4,096 whole pages
    engine = HostTier(host_pool_tokens=9600, write_policy="write_back", host_ratio=2.0)  # a real engine's figure
    keep = resolve_host_tier(engine, enabled=None, ratio=None, size_gb=None, write_policy="write_through", resized=False, **sizes)
    assert keep == HostTier(9600, "write_through", 2.0)  # the trace's pool kept, the policy changed
    again = resolve_host_tier(engine, enabled=None, ratio=None, size_gb=None, write_policy=None, resized=True, **sizes)
    assert again == HostTier(8208, "write_back", 2.0)  # resized: SGLang's sizing of the whole pages
    assert resolve_host_tier(engine, enabled=False, ratio=None, size_gb=None, write_policy=None, **sizes) is None
    assert resolve_host_tier(None, enabled=None, ratio=None, size_gb=None, write_policy=None, **sizes) is None
    assert resolve_host_tier(None, enabled=True, ratio=None, size_gb=None, write_policy=None, **sizes) == HostTier(8208)
    sized = resolve_host_tier(None, enabled=None, ratio=4.0, size_gb=1, write_policy=None, **sizes)
    assert sized == HostTier(host_tokens_for_size(1, 131_072, 16), "write_through", None, 1)  # the size wins
    with pytest.raises(HostTierOptionError) as info:
        resolve_host_tier(None, enabled=None, ratio=None, size_gb=1, write_policy=None, hybrid_model="gpt-oss-20b", **sizes)
    assert info.value.option == "--hicache-size" and "gpt-oss-20b is hybrid" in str(info.value)
