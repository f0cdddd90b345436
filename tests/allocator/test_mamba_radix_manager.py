"""The built-in allocator with a Mamba pool and the radix cache on (``MambaRadixCache``,
no_buffer at page 1): a prompt's state is checkpointed into the tree at its publish (a
copy in a fresh slot) and at the finish (the request's own slot), a new request resumes
only where a state sits and copies it into a slot of its own, checkpoints are evicted
when admissions need their slots, a retraction frees the slot, and the counters, checks
and checkpoints see the cached states."""

from __future__ import annotations

import numpy as np

from allocator.base import AllocatorConfig, MambaConfig, SpecConfig
from allocator.check.checkpoint import restore_allocator_state, save_allocator_state
from allocator.manager import KvAllocator
from allocator.mamba_radix import MambaRadixCache


def make(slots: int = 12, max_running: int = 4, pool: int = 4000, spec: SpecConfig | None = None) -> KvAllocator:
    return KvAllocator(AllocatorConfig(pool_tokens=pool, page_size=1, max_running=max_running, max_context_len=1000,
                                       radix_cache=True, mamba=MambaConfig(slots=slots), spec=spec))


def ids(*ranges: tuple[int, int]) -> np.ndarray:
    return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in ranges])


def one(rid: int) -> np.ndarray:
    return np.array([rid], dtype=np.int64)


def prefill(a: KvAllocator, rid: int, toks: np.ndarray) -> int:
    res = a.extend(one(rid), np.array([toks.shape[0]]), [toks])
    a.end_step()
    return int(res.prefix_lens[0])  # type: ignore[union-attr]


def finish(a: KvAllocator, rid: int, toks: np.ndarray) -> None:
    a.release(one(rid), np.array([toks.shape[0]]), [toks], kind="finish")


def own_slot(a: KvAllocator, rid: int) -> int | None:
    return next((r.mamba_pool_idx for r in a.mamba_reqs() if r.rid == rid), None)


def test_the_tree_is_the_mamba_radix_cache_and_a_publish_copies_the_state() -> None:
    a = make()
    assert isinstance(a.tree_cache, MambaRadixCache)
    prefill(a, 1, ids((1, 101)))
    tree = a.tree_cache
    # the prompt's state: a copy in a slot of the tree's own, beside the request's
    assert len(tree.cached_states()) == 1 and tree.cached_states() != [own_slot(a, 1)]
    mamba = a.pool_counters()["mamba"]
    assert (mamba.available, mamba.evictable, mamba.protected, mamba.committed) == (10, 0, 1, 1)
    assert a.check_integrity() == []


def test_a_new_request_resumes_at_a_checkpoint_and_copies_its_state() -> None:
    a = make()
    t1 = ids((1, 101))
    prefill(a, 1, t1)
    a.decode(one(1))
    finish(a, 1, ids((1, 102)))
    tree = a.tree_cache
    assert isinstance(tree, MambaRadixCache)
    # prompt end (100) and finish end (101) both hold a state; none is the request's now
    assert len(tree.cached_states()) == 2 and a.mamba_reqs() == []
    assert prefill(a, 2, ids((1, 101), (500, 550))) == 100
    req = a.mamba_reqs()[0]
    assert req.mamba_cow_src in tree.cached_states() and req.mamba_pool_idx not in tree.cached_states()
    mamba = a.pool_counters()["mamba"]
    # two cached (one locked by rid 2's match, and its own publish at 150: 3), one held
    assert mamba.evictable + mamba.protected == 3 and mamba.committed == 1
    assert mamba.available + mamba.evictable + mamba.protected + mamba.committed == 12
    assert a.check_integrity() == []


def test_a_shared_prefix_without_a_state_is_not_reused() -> None:
    a = make()
    prefill(a, 1, ids((1, 101)))
    # the first 50 tokens are cached but hold no state: SGLang's match stops at the root
    assert prefill(a, 2, ids((1, 51), (700, 760))) == 0
    assert a.check_integrity() == []


def test_checkpoints_are_evicted_when_admissions_need_their_slots() -> None:
    a = make(slots=3, max_running=1)
    tree = a.tree_cache
    assert isinstance(tree, MambaRadixCache)
    for rid in range(1, 6):
        toks = ids((rid * 1000, rid * 1000 + 40))
        prefill(a, rid, toks)
        finish(a, rid, toks)
        assert a.check_integrity() == [], rid
    assert tree.mamba_evicted_total > 0
    mamba = a.pool_counters()["mamba"]
    assert mamba.available + mamba.evictable + mamba.protected == 3 and mamba.committed == 0


def test_a_retraction_frees_the_slot_and_keeps_the_checkpoint() -> None:
    a = make()
    prefill(a, 1, ids((1, 101)))
    slot = own_slot(a, 1)
    a.release(one(1), np.array([100]), None, kind="retract")
    pool = a.req_to_token_pool
    assert slot in pool.mamba_free_slots_np().tolist()  # type: ignore[attr-defined]
    assert len(a.tree_cache.cached_states()) == 1  # type: ignore[attr-defined]
    assert a.pool_counters()["mamba"].committed == 0 and a.check_integrity() == []


def test_a_checkpoint_round_trips_the_tree_with_its_states() -> None:
    a = make()
    prefill(a, 1, ids((1, 101)))
    finish(a, 1, ids((1, 101)))
    prefill(a, 2, ids((1, 101), (300, 320)))
    saved = save_allocator_state(a)
    digest = a.state_digest()
    prefill(a, 3, ids((1, 101), (900, 950)))
    finish(a, 2, ids((1, 101), (300, 320)))
    assert a.state_digest() != digest
    restore_allocator_state(a, saved)
    assert a.state_digest() == digest and save_allocator_state(a).digest() == saved.digest()
    # the restored tree still gates and copies: rid 3 resumes at the checkpoint as before
    assert prefill(a, 3, ids((1, 101), (900, 950))) == 100
    assert a.check_integrity() == []


def test_under_eagle_the_tree_is_keyed_by_tokens_not_bigrams() -> None:
    # SGLang turns the bigram keys off in a tree with a MAMBA component: the whole
    # prompt is cached and protected, not one unit less
    a = make(spec=SpecConfig())
    assert not a.tree_cache.is_eagle
    prefill(a, 1, ids((1, 101)))
    assert a.request_lens(one(1)).protected.tolist() == [100]
    assert a.pool_counters()["full"].protected == 100 and a.check_integrity() == []


# ---------------------------------------------------------------------------- property test

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_BLOCKS = [np.arange(100 * b + 1, 100 * b + 1 + n, dtype=np.int64) for b, n in enumerate((30, 17, 45, 8, 60))]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.lists(st.integers(0, 4), min_size=1, max_size=3),
                          st.integers(0, 3)), min_size=15, max_size=30))
def test_any_schedule_keeps_both_pools_whole(plan: list[tuple[int, list[int], int]]) -> None:
    """Admissions of prompts built from shared blocks (so matches hit and miss states),
    chunked or not, decodes, finishes, retractions and aborts, in any order: after
    every call the checks find nothing and every Mamba slot is free, held or cached."""
    a = make(slots=9, max_running=3, pool=320)
    live: dict[int, np.ndarray] = {}  # rid -> its tokens so far
    prefilling: dict[int, int] = {}  # rid -> prompt length still to prefill to
    rid = 0
    for action, blocks, extra in plan:
        if action <= 1 and len(live) < 3:  # admit, in one chunk (0) or two (1)
            rid += 1
            # a unique last token (odd ``extra``) or none: a later prompt may then extend
            # this one and resume at its state
            tail = [np.array([-rid], np.int64)] if extra % 2 else []
            toks = np.concatenate([_BLOCKS[b] for b in blocks] + tail)
            first = toks.shape[0] if action == 0 or toks.shape[0] < 4 else toks.shape[0] // 2
            res = a.extend(one(rid), np.array([first]), [toks], prefill_done=np.array([first == toks.shape[0]]))
            if hasattr(res, "prefix_lens"):
                live[rid] = toks
                if first < toks.shape[0]:
                    prefilling[rid] = toks.shape[0]
        elif action == 2 and prefilling:  # the next chunk
            r, n = next(iter(prefilling.items()))
            a.extend(one(r), np.array([n]), [live[r]])
            if a.row_of(r) >= 0:
                del prefilling[r]
        elif action == 3 and live:  # a decode of every request past its prefill
            rids = np.array([r for r in live if r not in prefilling], np.int64)
            if rids.shape[0] and hasattr(a.decode(rids), "num_tokens"):
                for r in rids.tolist():
                    live[r] = np.concatenate([live[r], np.array([-1000 * r - live[r].shape[0]], np.int64)])
        elif action >= 4 and live:  # finish, retract or abort one
            r = sorted(live)[extra % len(live)]
            n = int(a.request_lens(one(r)).committed[0])
            kind = ("finish", "retract", "abort")[extra % 3] if r not in prefilling else "abort"
            a.release(one(r), np.array([n]), [live[r][:n]] if kind == "finish" else None, kind=kind)  # type: ignore[arg-type]
            del live[r]
            prefilling.pop(r, None)
        a.end_step()
        assert a.check_integrity() == []
        m = a.pool_counters()["mamba"]
        assert m.available + m.evictable + m.protected + m.committed == 9
        assert m.committed == len(a.mamba_reqs())
