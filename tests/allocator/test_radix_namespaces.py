"""Cache namespaces in the radix caches: equal tokens in two namespaces never share a
node (SGLang's ``RadixKey.extra_key``), and the namespace invariant."""

from __future__ import annotations

import numpy as np
import pytest

from allocator.base import AllocatorConfig, SwaConfig
from allocator.check.checkpoint import restore_allocator_state, save_allocator_state
from allocator.check.namespaces import check_tree_namespaces
from allocator.manager import KvAllocator
from allocator.radix_cache import RadixCache
from traces.namespaces import in_namespace

PROMPT = np.arange(500, 564, dtype=np.int64)


class _Sink:
    def free_segment(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("ps", [1, 16])
def test_equal_tokens_in_two_namespaces_never_share_a_node(ps: int) -> None:
    tree = RadixCache(ps, _Sink())  # type: ignore[arg-type]
    plain, a, b = (tree.make_key(in_namespace(PROMPT, ns)) for ns in (None, "lora-a", "lora-b"))
    tree.insert(a, np.arange(64, dtype=np.int32) + 1)
    assert tree.match_prefix(a[:40]).prefix_len == 40 // ps * ps  # a split inside lora-a's node
    assert tree.match_prefix(b).prefix_len == 0 and tree.match_prefix(plain).prefix_len == 0
    assert tree.peek_prefix_len(b) == 0 and tree.peek_match_lock([plain, b])[0].tolist() == [0, 0]
    assert tree.insert(b, np.arange(64, dtype=np.int32) + 100).prefix_len == 0
    assert tree.insert(plain[:32], np.arange(32, dtype=np.int32) + 200).prefix_len == 0
    assert tree.match_prefix(a).prefix_len == tree.match_prefix(b).prefix_len == 64
    assert len(tree.root_node.children) == 3 and not check_tree_namespaces(tree)
    assert tree.evict(1000) == 64 + 64 + 32 and not tree.root_node.children


def test_a_key_without_a_namespace_keys_the_tree_as_before() -> None:
    tree = RadixCache(16, _Sink())  # type: ignore[arg-type]
    key = tree.make_key(PROMPT)
    tree.insert(key, np.arange(64, dtype=np.int32))
    assert list(tree.root_node.children) == [key[:16].tobytes()]
    assert all(node.ns == b"" for node in tree.iter_nodes())


def test_eagle_bigram_keys_keep_the_namespace() -> None:
    tree = RadixCache(1, _Sink(), is_eagle=True)  # type: ignore[arg-type]
    tree.insert(tree.make_key(in_namespace(PROMPT, "x")), np.arange(63, dtype=np.int32))
    assert tree.match_prefix(tree.make_key(PROMPT)).prefix_len == 0
    assert tree.match_prefix(tree.make_key(in_namespace(PROMPT, "x"))).prefix_len == 63


def _run(alloc: KvAllocator, rid: int, ns: str | None) -> int:
    """Admit ``rid`` with the shared prompt in ``ns``; return its prefix hit."""
    toks = in_namespace(PROMPT, ns)
    res = alloc.extend(np.array([rid]), np.array([64]), [toks])
    alloc.end_step()
    return int(res.prefix_lens[0])  # type: ignore[union-attr]


def _finish(alloc: KvAllocator, rid: int, ns: str | None) -> None:
    alloc.release(np.array([rid]), np.array([64]), [in_namespace(PROMPT, ns)], "finish")
    alloc.end_step()


@pytest.mark.parametrize("swa", [False, True])
def test_the_allocator_reuses_kv_within_a_namespace_only(swa: bool) -> None:
    alloc = KvAllocator(AllocatorConfig(
        page_size=16, pool_tokens=2048, max_running=4, max_context_len=512,
        swa=SwaConfig(window=16, swa_pool_tokens=1024, eviction_interval=16) if swa else None,
    ))
    assert _run(alloc, 0, "lora-a") == 0
    _finish(alloc, 0, "lora-a")
    assert _run(alloc, 1, "lora-b") == 0  # another adapter's KV is not reused
    assert _run(alloc, 2, None) == 0
    assert _run(alloc, 3, "lora-a") == 48
    assert not alloc.check_integrity()
    state = save_allocator_state(alloc)
    _finish(alloc, 3, "lora-a")
    restore_allocator_state(alloc, state)  # the namespaces of nodes and requests come back
    assert alloc.request_namespaces == {1: "lora-b", 3: "lora-a"}
    assert not alloc.check_integrity() and not check_tree_namespaces(alloc.tree_cache)


def test_the_invariant_blames_a_request_holding_another_namespace_s_prefix() -> None:
    alloc = KvAllocator(AllocatorConfig(page_size=16, pool_tokens=2048, max_running=4, max_context_len=512))
    _run(alloc, 0, None)
    _finish(alloc, 0, None)
    # A namespace-blind match: request 1 (lora-a) locks the base model's prefix.
    keys = alloc.tree_cache.make_key
    alloc.tree_cache.make_key = lambda ids: keys(np.asarray(ids))  # type: ignore[method-assign]
    assert _run(alloc, 1, "lora-a") == 48
    found = [v for v in alloc.check_integrity() if v.check == "namespace"]
    assert [v.rid for v in found] == [1]
    assert "rid=1 (namespace 'lora-a') holds radix node" in found[0].detail
    assert "of namespace None" in found[0].detail
