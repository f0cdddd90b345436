"""Token content: block and unique tokens, TokenStore materialisation, explicit overrides."""

from __future__ import annotations

import numpy as np
import pytest

import traces.tokens as tokens_module
from traces.batches import StepBatch
from traces.tokens import (
    BLOCK_TOKEN_BIT,
    TokenStore,
    block_token_ids,
    splitmix64,
    unique_token_ids,
)


def first_row(rid: int, prompt_len: int, hashes: list[int] | None, seq_len: int | None = None,
              token_ids: list[int] | None = None, step: int = 0) -> StepBatch:
    seq = prompt_len if seq_len is None else seq_len
    return StepBatch.from_columns(
        step, 0.0, op=["extend"], rid=[rid], seq_len=[seq], append_len=[seq],
        prompt_len=[prompt_len], block_hashes=[hashes], token_ids=[token_ids],
    )


def test_splitmix64_is_a_bijection_on_a_sample() -> None:
    x = np.arange(100_000, dtype=np.uint64)
    assert np.unique(splitmix64(x)).shape[0] == x.shape[0]
    assert splitmix64(np.array([0], np.uint64))[0] == np.uint64(0xE220A8397B1DCDAF)  # reference value


def test_block_tokens_depend_on_hash_and_offset_only() -> None:
    a = block_token_ids(np.array([7, 8], np.uint64), 4, 0, 8)
    b = block_token_ids(np.array([7, 9], np.uint64), 4, 0, 8)
    assert np.array_equal(a[:4], b[:4]) and not np.any(a[4:] == b[4:])
    assert np.unique(a).shape[0] == 8
    assert np.array_equal(block_token_ids(np.array([7, 8], np.uint64), 4, 3, 6), a[3:6])
    assert ((a >= 1 << 62) & (a.view(np.uint64) < np.uint64(1 << 63))).all()
    with pytest.raises(ValueError, match="outside the 2 blocks of 4 tokens"):
        block_token_ids(np.array([7, 8], np.uint64), 4, 0, 9)


def test_unique_tokens_are_distinct_and_never_block_tokens() -> None:
    u = np.concatenate([unique_token_ids(r, 0, 1000) for r in (0, 1, 2**31 - 1)])
    assert np.unique(u).shape[0] == u.shape[0]
    assert (u < 0).all() and (u >= -(1 << 62)).all()  # block tokens are >= 2**62, explicit ids >= 0
    assert unique_token_ids(3, 5, 7).tolist() == [-1 - (3 << 31 | 5), -1 - (3 << 31 | 6)]
    with pytest.raises(ValueError, match="2\\*\\*31"):
        unique_token_ids(2**31, 0, 1)
    assert BLOCK_TOKEN_BIT == np.uint64(1 << 62)


def test_equal_leading_hashes_share_a_prefix_and_the_rest_is_unique() -> None:
    store = TokenStore(block_size=4)
    # request 0: 3 blocks, prompt 10 (last block partial); request 1 shares the first 2 blocks
    store.ingest(first_row(0, 10, [100, 101, 102], seq_len=10))
    store.ingest(first_row(1, 12, [100, 101, 555], seq_len=12, step=1))
    a, b = store.ids(0, 14), store.ids(1, 14)
    assert np.array_equal(a[:8], b[:8])
    assert not np.any(a[8:] == b[8:])
    # past the prompt (position 10 of request 0, inside its last block) tokens are unique
    assert a[10:].tolist() == unique_token_ids(0, 10, 14).tolist()
    assert a[8:10].tolist() == block_token_ids(np.array([100, 101, 102], np.uint64), 4, 8, 10).tolist()


def test_incremental_materialisation_matches_one_shot() -> None:
    rng = np.random.default_rng(0)
    hashes = rng.integers(0, 2**63, 30).astype(np.uint64).tolist()
    one = TokenStore(16)
    one.ingest(first_row(4, 470, hashes))
    full = one.ids(4, 900).copy()
    step_by_step = TokenStore(16)
    step_by_step.ingest(first_row(4, 470, hashes))
    got = [step_by_step.ids(4, end).copy() for end in (0, 17, 200, 470, 471, 600, 900)]
    for part in got:
        assert np.array_equal(part, full[: part.shape[0]])


def test_explicit_ids_override_and_survive_retraction() -> None:
    store = TokenStore(4)
    # first chunk with hashes, then an explicit chunk, then explicit decode ids
    store.ingest(first_row(2, 12, [1, 2, 3], seq_len=6))
    store.ingest(StepBatch.from_columns(1, 0.0, op=["extend"], rid=[2], seq_len=[12], append_len=[6],
                                        token_ids=[[90, 91, 92, 93, 94, 95]]))
    store.ingest(StepBatch.from_columns(2, 0.0, op=["decode"], rid=[2], seq_len=[13], append_len=[1],
                                        token_ids=[[77]]))
    ids = store.ids(2, 14)
    default = block_token_ids(np.array([1, 2, 3], np.uint64), 4, 0, 12)
    assert np.array_equal(ids[:6], default[:6])
    assert ids[6:13].tolist() == [90, 91, 92, 93, 94, 95, 77]
    assert ids[13] == unique_token_ids(2, 13, 14)[0]
    # a retracted request comes back with the same content (nothing is dropped)
    store.ingest(StepBatch.from_columns(3, 0.0, op=["retract"], rid=[2], seq_len=[13], append_len=[0]))
    store.ingest(StepBatch.from_columns(4, 0.0, op=["extend"], rid=[2], seq_len=[13], append_len=[13],
                                        prompt_len=[12]))  # repeating the prompt length changes nothing
    assert np.array_equal(store.ids(2, 14), ids)


def test_ids_are_read_only_views() -> None:
    store = TokenStore(None)
    store.ingest(first_row(0, 5, None))
    with pytest.raises(ValueError, match="read-only"):
        store.ids(0, 5)[0] = 1


def test_explicit_ids_fold_in_bulk_and_drop_releases_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokens_module, "_LOG_FOLD_ENTRIES", 64)
    store = TokenStore(None)
    n = 20
    store.ingest(StepBatch.from_columns(
        0, 0.0, op=["extend"] * n, rid=np.arange(n), seq_len=np.full(n, 3), append_len=np.full(n, 3),
        prompt_len=np.full(n, 3),
    ))
    for s in range(1, 10):  # 20 explicit decode ids per step: folds after the 4th step
        store.ingest(StepBatch.from_columns(
            s, 0.0, op=["decode"] * n, rid=np.arange(n), seq_len=np.full(n, 3 + s),
            append_len=np.ones(n, np.int32), token_ids=[[1000 * s + r] for r in range(n)],
        ))
    assert store._log_entries < 64
    for r in (0, 7, 19):
        ids = store.ids(r, 12)
        assert ids[:3].tolist() == unique_token_ids(r, 0, 3).tolist()
        assert ids[3:12].tolist() == [1000 * s + r for s in range(1, 10)]
    assert store.num_live == n and store.nbytes > 0
    store.drop(np.arange(n))
    assert store.num_live == 0 and store.nbytes == 0
    assert store.prompt_len(0) == -1


def test_a_request_never_ingested_reads_as_unique_tokens() -> None:
    store = TokenStore(8)
    assert store.ids(9, 3).tolist() == unique_token_ids(9, 0, 3).tolist()
    with pytest.raises(ValueError, match="2\\*\\*31"):
        store.ids(-1, 3)
