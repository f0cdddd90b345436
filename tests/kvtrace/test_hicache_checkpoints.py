"""Checkpoints of HiCache's tiered tree: a session that seeks back through them
(restore, then replay forward) reaches the same allocator state, snapshots and tier
split as a replay that went straight through."""

from __future__ import annotations

import numpy as np

from pathlib import Path

import pytest

from allocator.check.checkpoint import restore_allocator_state, save_allocator_state
from kvtrace.replay.engine import ReplayOptions
from kvtrace.replay.session import ReplaySession
from tests.helpers import make_meta, write_steps
from traces.batches import StepBatch

TARGETS = (61, 40, 95, 118)


def write_cycling(path: Path) -> Path:
    """Six prompts of 256 tokens asked in turn, two requests running at a time, on a
    1,024-token device pool: each prompt is evicted before it comes back, so with a host
    tier it comes back from the host (host hits, loads and writes in flight, host locks)."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 50_000, 256, dtype=np.int64) for _ in range(6)]
    rows: dict[int, list[tuple[str, int, int, int, np.ndarray | None]]] = {}
    for i in range(60):
        tokens = np.concatenate([prompts[i % 6], rng.integers(1, 50_000, 16, dtype=np.int64)])
        n = tokens.shape[0]
        rows.setdefault(2 * i, []).append(("extend", i, n, n, tokens))
        rows.setdefault(2 * i + 3, []).append(("finish", i, n, 0, None))
    steps = [
        StepBatch.from_columns(step, 0.1 * step, op=[r[0] for r in rs], rid=[r[1] for r in rs],
                               seq_len=[r[2] for r in rs], append_len=[r[3] for r in rs],
                               prompt_len=[r[2] if r[0] == "extend" else None for r in rs],
                               token_ids=[r[4] for r in rs])
        for step, rs in sorted(rows.items())
    ]  # fmt: skip
    return write_steps(path, steps, meta=make_meta(pool_tokens=1024, max_context_len=1024))


@pytest.fixture(scope="module")
def cycling(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_cycling(tmp_path_factory.mktemp("hicache") / "cycling.kvtrace")


def _session(path: Path, **kwargs: object) -> ReplaySession:
    return ReplaySession(path, hicache_ratio=4.0, checker="inline", options=ReplayOptions(), **kwargs)  # type: ignore[arg-type]


def _same(a, b) -> None:  # noqa: ANN001 - two StepSnapshots
    assert a.step == b.step and a.pool == b.pool and a.other_pools == b.other_pools
    for x, y in zip(a.requests, b.requests):
        np.testing.assert_array_equal(x, y)


def test_seeking_back_through_tier_checkpoints_gives_the_straight_run(cycling: Path) -> None:
    snaps, digests = {}, {}
    with _session(cycling, allocator_in_step=True) as straight:
        for snap in straight.snapshots():
            snaps[snap.step] = snap
            if snap.step in TARGETS:
                digests[snap.step] = straight.allocator.save_state().digest()
        summary = straight.result().to_dict()
    assert summary["hicache"]["prefix_tokens"]["host"] > 0  # the host tier served hits: the test covers it
    with _session(cycling, checkpoint_every=7, allocator_in_step=True) as s:
        s.run()
        assert s.num_checkpoints >= 10
        for target in TARGETS:
            snap = s.seek(target)
            assert snap is not None and snap.step == target
            _same(snap, snaps[target])
            assert s.allocator.save_state().digest() == digests[target], f"state differs after seek({target})"
        s.seek(TARGETS[1])
        rest = list(s.snapshots())
        for snap in rest:
            _same(snap, snaps[snap.step])
        assert rest[-1].step == max(snaps)
        assert s.result().to_dict()["hicache"] == summary["hicache"]


def test_a_restore_brings_back_host_values_locks_and_transfers_in_flight(cycling: Path) -> None:
    with _session(cycling, allocator_in_step=True) as s:
        s.seek(40)
        alloc = s.allocator
        saved = save_allocator_state(alloc)
        tree = alloc.tree_cache
        host_before = tree.host_tokens()
        assert host_before > 0
        s.seek(90)  # on: hits, evictions, transfers change both tiers
        assert save_allocator_state(alloc).digest() != saved.digest()
        restore_allocator_state(alloc, saved)
        assert alloc.tree_cache is tree  # in place: the context holds it
        assert tree.host_tokens() == host_before
        assert save_allocator_state(alloc).digest() == saved.digest()
        assert alloc.check_integrity() == []
