"""``check_memory``: the estimate of what a pool needs, and the one-line refusal."""

from __future__ import annotations

import dataclasses

import pytest

from allocator import AllocatorConfig, SpecConfig, create_allocator
from allocator.sizing import pool_memory, req_to_token_width
from kvtrace.replay.config import RECORD_OPTIONS, TRACE_FIELDS, check_memory, estimate_memory, format_bytes, replay_names
from kvtrace.errors import ConfigError

GIB = 1 << 30


def test_the_estimate_counts_what_building_the_allocator_allocates() -> None:
    config = AllocatorConfig(pool_tokens=1 << 16, page_size=16, max_running=32, max_context_len=4096,
                             spec=SpecConfig())
    memory = pool_memory(config, num_rids=1000)
    alloc = create_allocator(config)
    table = alloc.req_to_token_pool.req_to_token
    assert memory.req_to_token == table.numel() * table.element_size()
    assert table.shape == (33, req_to_token_width(config))
    free_list = alloc.token_to_kv_pool_allocator._free._buf
    assert free_list.nbytes <= memory.free_lists
    assert memory.total == memory.req_to_token + memory.free_lists + memory.bookkeeping + memory.radix_cache
    assert pool_memory(config, num_rids=2000).bookkeeping > memory.bookkeeping


def test_the_estimate_grows_with_each_sizing_field() -> None:
    base = AllocatorConfig(pool_tokens=1 << 20, page_size=1, max_running=256, max_context_len=131072)
    small = estimate_memory(base, 10_000).total
    for change in ({"pool_tokens": 1 << 24}, {"max_running": 4096}, {"max_context_len": 1 << 20}):
        bigger = dataclasses.replace(base, **change)
        assert estimate_memory(bigger, 10_000).total > small, change
    assert estimate_memory(base, 1_000_000).total > small


@pytest.mark.parametrize(
    ("config", "names", "fragments"),
    [
        (
            AllocatorConfig(pool_tokens=1 << 30, page_size=1, max_running=8, max_context_len=4096),
            replay_names(pool_tokens=True),
            ["1,073,741,824 KV slots (--pool-tokens) need", "lower --pool-tokens, or pass --ignore-memory-check to try anyway"],
        ),
        (
            AllocatorConfig(pool_tokens=4096, page_size=16, max_running=1 << 20, max_context_len=131072),
            TRACE_FIELDS,
            ["1,048,576 rows (metadata config.max_running) x 131,076 positions (metadata config.max_context_len "
             "plus headroom) x 4 bytes = 512 GiB", "; pass --ignore-memory-check to try anyway"],
        ),
        (
            AllocatorConfig(pool_tokens=4096, page_size=16, max_running=1 << 20, max_context_len=131072),
            RECORD_OPTIONS,
            ["(--max-running) x", "(--context-len plus headroom)", "lower --max-running or --context-len, or pass"],
        ),
    ],
)
def test_a_pool_past_the_available_memory_is_refused_in_one_line(
    config: AllocatorConfig, names: dict[str, str], fragments: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        check_memory(config, num_rids=1000, names=names, available=4 * GIB)
    message = str(info.value)
    assert message.startswith("not enough memory: the allocator needs about ")
    assert "and this machine has 4 GiB available" in message and "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    forced = check_memory(config, num_rids=1000, names=names, available=4 * GIB, force=True)
    assert forced.total > 4 * GIB


def test_a_pool_that_fits_passes() -> None:
    config = AllocatorConfig(pool_tokens=1 << 16, page_size=16, max_running=32, max_context_len=4096)
    estimate = check_memory(config, num_rids=100, available=GIB)
    assert 0 < estimate.total < GIB


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (0, 1023, 1536, 1000 * 1024, 5 * GIB, 3 << 40)] == [
        "0 B", "1023 B", "1.5 KiB", "1000 KiB", "5 GiB", "3 TiB",
    ]


def test_the_memory_limit_variable_caps_what_a_pool_may_take(monkeypatch) -> None:
    """``$KVTRACE_MEMORY_LIMIT`` lowers what check_memory takes as available; a bad value is one line."""
    from allocator.base import AllocatorConfig
    from kvtrace.replay.config import MEMORY_LIMIT_VAR, check_memory, memory_limit
    from kvtrace.errors import ConfigError

    config = AllocatorConfig(page_size=16, pool_tokens=1 << 20, max_running=256, max_context_len=32_768)
    monkeypatch.delenv(MEMORY_LIMIT_VAR, raising=False)
    assert memory_limit() is None
    needed = check_memory(config, num_rids=1000, force=True).total
    monkeypatch.setenv(MEMORY_LIMIT_VAR, str(needed * 2))
    assert memory_limit() == needed * 2
    check_memory(config, num_rids=1000)  # fits under the limit
    monkeypatch.setenv(MEMORY_LIMIT_VAR, "1M")
    assert memory_limit() == 1 << 20
    with pytest.raises(ConfigError, match=r"at most \$KVTRACE_MEMORY_LIMIT=1 MiB"):
        check_memory(config, num_rids=1000)
    with pytest.raises(ConfigError, match=r"at most \$KVTRACE_MEMORY_LIMIT=1 MiB"):
        check_memory(config, num_rids=1000, available=1 << 40)  # the limit holds for a given figure too
    for bad in ("lots", "inf", "nan", "-2G", "9e30T"):
        monkeypatch.setenv(MEMORY_LIMIT_VAR, bad)
        with pytest.raises(ConfigError, match="is not a size"):
            memory_limit()
