"""The built-in allocator with a Mamba pool, the radix cache on and SGLang's non-overlap
``extra_buffer`` strategy (page > 1): each request holds a state slot and one tracking
slot; a chunk tracks ``prefix + whole checkpoint grids`` (or the match's branching point),
decode tracks each crossed ``lcm(grid, 256)`` boundary, and a publish, stash or finish
inserts only up to the tracked length, donating the tracking slot
(docs/mamba-semantics.md §12.8)."""

from __future__ import annotations

import numpy as np
import pytest

from allocator.base import AllocatorConfig, MambaConfig
from allocator.check.checkpoint import restore_allocator_state, save_allocator_state
from allocator.mamba import crossed_track_seqlen, extend_track_seqlen
from allocator.mamba_radix import MambaRadixCache
from allocator.manager import KvAllocator


def make(slots: int = 16, page: int = 16) -> KvAllocator:
    return KvAllocator(AllocatorConfig(
        pool_tokens=8000, page_size=page, max_running=4, max_context_len=2000, radix_cache=True,
        mamba=MambaConfig(slots=slots, strategy="extra_buffer"),
    ))  # fmt: skip


def one(rid: int) -> np.ndarray:
    return np.array([rid], dtype=np.int64)


def toks(n: int, start: int = 1) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int64)


def tree_of(a: KvAllocator) -> MambaRadixCache:
    tree = a.tree_cache
    assert isinstance(tree, MambaRadixCache)
    return tree


@pytest.mark.parametrize(
    ("prefix", "extend", "branching", "tracked"),
    [
        (0, 300, None, 256),  # whole 64-token grids of the chunk
        (0, 63, None, None),  # a chunk shorter than the grid tracks nothing
        (512, 88, None, 576),  # relative to the chunk's start
        (0, 300, 128, 128),  # the match's branching point inside the chunk wins
        (0, 300, 256, 256),  # ... unless it is not before the tracked end
    ],
)
def test_extend_tracks_whole_grids_or_the_branching_point(
    prefix: int, extend: int, branching: int | None, tracked: int | None
) -> None:
    assert extend_track_seqlen(prefix, extend, 64, 64, 64, branching) == tracked


def test_decode_tracks_the_last_boundary_crossed() -> None:
    assert crossed_track_seqlen(255, 256, 256) == 256
    assert crossed_track_seqlen(256, 257, 256) is None
    assert crossed_track_seqlen(250, 530, 256) == 512  # a verify (or run) crossing two


def test_admission_takes_a_tracking_slot_and_a_publish_donates_it_at_the_tracked_length() -> None:
    a = make()
    a.extend(one(1), np.array([300]), [toks(300)])
    (req,) = a.mamba_reqs()
    assert req.ping_pong is not None and len(req.held_slots()) == 2
    tracking = int(req.ping_pong[0])
    assert req.last_track_seqlen == 256
    a.end_step()  # the prompt publish
    tree = tree_of(a)
    # the tracking slot went to the tree at 256 (not 300), a fresh one replaced it
    assert tree.cached_states() == [tracking] and int(req.ping_pong[0]) != tracking
    assert req.last_track_seqlen is None
    assert a.match_prefix(toks(300)) == 256
    mamba = a.pool_counters()["mamba"]
    assert (mamba.committed, mamba.protected, mamba.available) == (2, 1, 13)
    assert a.check_integrity() == []


def test_a_publish_without_a_tracked_state_inserts_nothing() -> None:
    a = make()
    a.extend(one(1), np.array([40]), [toks(40)])  # shorter than the 64-token grid
    a.end_step()
    assert tree_of(a).cached_states() == [] and a.match_prefix(toks(40)) == 0
    assert a.check_integrity() == []


def test_decode_tracks_a_boundary_and_the_finish_donates_it() -> None:
    a = make()
    a.extend(one(1), np.array([300]), [toks(300)])
    a.end_step()
    for _ in range(220):
        a.decode(one(1))
    (req,) = a.mamba_reqs()
    assert req.last_track_seqlen == 512
    state = int(req.ping_pong[0])  # type: ignore[index]
    a.release(one(1), np.array([520]), [toks(520)], kind="finish")
    tree = tree_of(a)
    assert state in tree.cached_states() and a.mamba_reqs() == []
    # the finish inserted up to 512: its last 8 tokens are not cached
    assert a.match_prefix(toks(520)) == 512
    mamba = a.pool_counters()["mamba"]
    assert mamba.available + mamba.evictable + mamba.protected == 16 and mamba.committed == 0
    assert a.check_integrity() == []


def test_a_checkpoint_restores_the_tracking() -> None:
    a = make()
    a.extend(one(1), np.array([300]), [toks(300)])
    a.end_step()
    saved = save_allocator_state(a)
    digest = a.state_digest()
    for _ in range(220):
        a.decode(one(1))
    a.release(one(1), np.array([520]), [toks(520)], kind="finish")
    restore_allocator_state(a, saved)
    assert a.state_digest() == digest
    (req,) = a.mamba_reqs()
    assert req.last_track_seqlen is None and req.ping_pong is not None
    for _ in range(220):
        a.decode(one(1))
    a.release(one(1), np.array([520]), [toks(520)], kind="finish")
    assert a.check_integrity() == []


def test_the_overlap_modes_are_refused() -> None:
    with pytest.raises(ValueError, match="under the overlap scheduler is not implemented"):
        KvAllocator(AllocatorConfig(
            pool_tokens=8000, page_size=16, max_running=4, max_context_len=2000, radix_cache=True,
            mamba=MambaConfig(slots=16, strategy="extra_buffer_lazy", overlap_schedule=True),
        ))  # fmt: skip


@pytest.mark.parametrize("page", [1, 16])
def test_two_namespaces_sharing_tokens_share_no_node_or_state(page: int) -> None:
    from traces.namespaces import in_namespace

    if page == 1:
        a = KvAllocator(AllocatorConfig(pool_tokens=8000, page_size=1, max_running=4, max_context_len=2000,
                                        radix_cache=True, mamba=MambaConfig(slots=16)))  # fmt: skip
    else:
        a = make(page=page)
    lora_a, lora_b = in_namespace(toks(300), "lora-a"), in_namespace(toks(300), "lora-b")
    a.extend(one(1), np.array([300]), [lora_a])
    a.end_step()
    # (a query one token longer: a match is capped at len - 1)
    query_a, query_b = in_namespace(toks(301), "lora-a"), in_namespace(toks(301), "lora-b")
    assert a.match_prefix(query_a) > 0
    # the same tokens in another namespace (or none) reuse nothing, state or KV
    assert a.match_prefix(query_b) == 0 and a.match_prefix(toks(301)) == 0
    res = a.extend(one(2), np.array([300]), [lora_b])
    a.end_step()
    assert int(res.prefix_lens[0]) == 0  # type: ignore[union-attr]
    tree = tree_of(a)
    assert len(tree.cached_states()) == 2 and len(tree.root_node.children) == 2
    saved = save_allocator_state(a)
    restore_allocator_state(a, saved)
    assert a.match_prefix(query_b) == a.match_prefix(query_a) > 0 and a.match_prefix(toks(301)) == 0
    assert a.check_integrity() == []
