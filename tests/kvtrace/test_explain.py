"""kvtrace explain: attribution of missed prefix tokens on hand-built traces with known
answers (one per cause), the sum on a bundled sample, and the oracles."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtrace.explain.report import Explainer
from kvtrace.replay.session import ReplaySession
from traces.synth import synth_meta
from traces.writer import TraceWriter

PS = 4  # page size of the hand-built traces


def _trace(path: Path, steps: list[list[tuple[Any, ...]]], *, pool_tokens: int = 256,
           namespaces: dict[int, str] | None = None) -> Path:
    """A trace from steps of rows ``(op, rid, seq_len, append_len, token_ids, prompt_len)``
    (``namespaces``: request id -> its cache namespace)."""
    meta = synth_meta(page_size=PS, pool_tokens=pool_tokens, max_running=8, max_context_len=4096, block_size=None,
                      chunk_size=None, spec=None, pd_decode=False, workload="explain-test")
    if namespaces is not None:
        from dataclasses import replace

        from traces.namespaces import NamespaceTable

        meta = replace(meta, namespaces=NamespaceTable.of(namespaces))
    with TraceWriter(path, meta) as writer:
        for step, rows in enumerate(steps):
            writer.write_step(
                step, float(step),
                op=[r[0] for r in rows], rid=[r[1] for r in rows], seq_len=[r[2] for r in rows],
                append_len=[r[3] for r in rows], token_ids=[r[4] if len(r) > 4 else None for r in rows],
                prompt_len=[r[5] if len(r) > 5 else -1 for r in rows],
            )
    return path


def _prefill(rid: int, tokens: list[int]) -> tuple[Any, ...]:
    return ("extend", rid, len(tokens), len(tokens), tokens, len(tokens))


def _explain(path: Path, **kw: Any) -> dict[str, Any]:
    with ReplaySession(path, checker="inline", **kw) as session:
        explainer = Explainer(session)
        for _ in session.snapshots():
            pass
        result = session.result()
    report = explainer.report().to_dict()
    # the causes always sum to the replay's own missed tokens
    stats = result.stats
    assert report["missed_tokens"] == stats.admitted_tokens - stats.reused_tokens
    assert sum(report["causes"].values()) == report["missed_tokens"]
    return report


def _nonzero(report: dict[str, Any]) -> dict[str, int]:
    return {k: v for k, v in report["causes"].items() if v}


A = list(range(100, 110))  # 10 tokens


def test_cold(tmp_path: Path) -> None:
    report = _explain(_trace(tmp_path / "t.kvtrace", [[_prefill(0, A)]]))
    assert report["admissions"] == 1 and _nonzero(report) == {"cold": 10}


def test_page_size_floor(tmp_path: Path) -> None:
    # rid 0: A (10 tokens) + 1 decoded, finished: the cache keeps 8 (two pages).
    # rid 1 shares A's first 6 tokens: hits 4 (one page); tokens 4-5 were computed
    # before but sit in a partial page (floor 2); its other 4 are new (cold).
    b = A[:6] + [7, 8, 9, 10]
    steps = [[_prefill(0, A)], [("decode", 0, 11, 1)], [("finish", 0, 11, 0)], [_prefill(1, b)]]
    report = _explain(_trace(tmp_path / "t.kvtrace", steps))
    assert report["reused_tokens"] == 4
    assert _nonzero(report) == {"floor": 2, "cold": 10 + 4}


def test_evicted_names_the_step_trigger_and_request(tmp_path: Path) -> None:
    # 8 pages. rid 0 caches P (8 tokens); rid 1's 28-token prompt at step 3 needs 7
    # pages with 6 free: its admission evicts P. rid 2 (P + 1 token) then misses P.
    p = list(range(200, 208))
    big = list(range(300, 328))
    steps = [
        [_prefill(0, p)], [("decode", 0, 9, 1)], [("finish", 0, 9, 0)],
        [_prefill(1, big)], [("finish", 1, 28, 0)],
        [_prefill(2, [*p, 5])],
    ]
    report = _explain(_trace(tmp_path / "t.kvtrace", steps, pool_tokens=32))
    assert _nonzero(report) == {"cold": 8 + 28 + 1, "evicted": 8}
    (top,) = [e for e in report["top_evictors"] if e["missed_tokens"]]
    assert top == {"step": 3, "trigger": "admission", "rid": 1, "batch_size": 1, "evicted_tokens": 8,
                   "missed_tokens": 8}
    assert report["hit_rates"]["infinite"] > report["hit_rates"]["lru"]


def test_uncached_tokens_of_an_aborted_prefill(tmp_path: Path) -> None:
    # rid 0 computes the first 8 of its 16 prompt tokens, then is aborted before its
    # prefill is done: they were never cached. rid 1 shares them: 8 uncached.
    p = list(range(400, 416))
    steps = [[("extend", 0, 8, 8, p[:8], 16)], [("abort", 0, 8, 0)], [_prefill(1, [*p[:8], 1, 2, 3])]]
    report = _explain(_trace(tmp_path / "t.kvtrace", steps))
    assert _nonzero(report) == {"cold": 16 + 3, "uncached": 8}


def test_retraction_is_recomputation_with_its_cost(tmp_path: Path) -> None:
    # rid 0: 8-token prompt (cached as 8 when its prefill is done), 2 decoded, retracted at
    # length 10; back with the same 10 tokens it hits the 8 cached and recomputes 2.
    steps = [
        [_prefill(0, A[:8])], [("decode", 0, 9, 1)], [("decode", 0, 10, 1)], [("retract", 0, 10, 0)],
        [("extend", 0, 10, 10)],
    ]
    report = _explain(_trace(tmp_path / "t.kvtrace", steps))
    assert report["admissions"] == 2
    assert _nonzero(report) == {"cold": 8, "retraction": 2}
    assert report["retraction_cost"] == {"0": 2}


def test_out_of_the_swa_window(tmp_path: Path) -> None:
    # An SWA model with an 8-token window: rid 0 (24 tokens) keeps the SWA KV of its last
    # window only. rid 1 shares its first 12 tokens: their full KV is cached, but no
    # window of SWA KV ends there, so the hit is 0 and the 12 are out of the window.
    from tests.helpers import with_meta

    def swa(data: dict[str, Any]) -> None:
        data.update(format_version=2, attention={
            "full_layer_ids": [1, 3], "swa_layer_ids": [0, 2], "sliding_window": 8,
            "swa_full_tokens_ratio": 1.0, "swa_pool_tokens": 256})
        data["config"]["radix_cache"] = True
        data["model"]["num_layers"] = 4

    p = list(range(500, 524))
    steps = [[_prefill(0, p)], [("decode", 0, 25, 1)], [("finish", 0, 25, 0)], [_prefill(1, [*p[:12], 1, 2, 3, 4])]]
    trace = with_meta(_trace(tmp_path / "full.kvtrace", steps), tmp_path / "swa.kvtrace", swa)
    report = _explain(trace)
    assert report["reused_tokens"] == 0
    assert _nonzero(report) == {"cold": 24 + 4, "out_of_window": 12}


@pytest.mark.parametrize(("sample", "pool_tokens"), [("tiny", None), ("mooncake-tiny", None)])
def test_causes_sum_to_the_missed_tokens_on_samples(sample: str, pool_tokens: int | None) -> None:
    report = _explain(Path(f"sample:{sample}"), pool_tokens=pool_tokens)  # (_explain checks the sum)
    assert report["admissions"] > 0


@pytest.mark.parametrize("sample", ["tiny", "mooncake-tiny"])
def test_a_pool_that_never_evicts_has_no_evicted_cause_and_lru_is_infinite(sample: str) -> None:
    report = _explain(Path(f"sample:{sample}"), pool_tokens=4_000_000)
    assert report["causes"]["evicted"] == 0 and not report["by_trigger"]
    rates = report["hit_rates"]
    assert rates["lru"] == rates["infinite"]
    model = rates["model"]
    assert model["lru"] == model["belady"] == model["infinite"]


class _Calls:
    """A ``ReplayObserver`` that keeps what it is told."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.calls: list[tuple[str, int, list[int]]] = []
        self.admitted_tokens = 0

    def step_started(self, step: int) -> None:
        self.steps.append(step)

    def call_started(self, call: Any) -> None:
        self.calls.append((call.op, call.step, call.rids.tolist()))

    def call_ended(self, call: Any, result: Any) -> None:
        if call.op == "extend":
            self.admitted_tokens += int(call.prefill_targets[call.admitted].sum())


def test_observer_api_replaces_the_wrappers(tmp_path: Path) -> None:
    # The engine tells observers of its calls; explain is one of them and swaps nothing in.
    path = _trace(tmp_path / "t.kvtrace", [[_prefill(0, A)], [("decode", 0, 11, 1)], [("finish", 0, 11, 0)],
                                           [_prefill(1, A + [7])]])
    with ReplaySession(path, checker="inline") as session:
        seen = _Calls()
        session.observers.append(seen)
        Explainer(session)
        assert session.engine.allocator is session.allocator
        assert type(session.engine).replay_step is type(session.engine).__dict__["replay_step"]
        assert "replay_step" not in vars(session.engine)
        for _ in session.snapshots():
            pass
        stats = session.result().stats
    assert seen.steps == [0, 1, 2, 3]
    assert [c[0] for c in seen.calls] == ["extend", "decode", "finish", "extend"]
    assert seen.calls[-1] == ("extend", 3, [1])
    assert seen.admitted_tokens == stats.admitted_tokens


def _evicting_steps() -> list[list[tuple[Any, ...]]]:
    # as test_evicted_names_the_step_trigger_and_request: rid 1's admission at step 3
    # evicts P, which rid 2 misses at step 5.
    p = list(range(200, 208))
    return [
        [_prefill(0, p)], [("decode", 0, 9, 1)], [("finish", 0, 9, 0)],
        [_prefill(1, list(range(300, 328)))], [("finish", 1, 28, 0)],
        [_prefill(2, [*p, 5])],
    ]


def test_steps_replayed_again_count_once_and_a_restart_keeps_listening(tmp_path: Path) -> None:
    # A dashboard seeks back: without checkpoints the session starts again with a fresh
    # allocator (a new radix tree). Steps replayed again are not counted twice; the steps
    # past the highest seen are, evictions on the new tree included.
    from kvtrace.explain.attribution import Attribution

    path = _trace(tmp_path / "t.kvtrace", _evicting_steps(), pool_tokens=32)
    with ReplaySession(path, checker="inline", track_state=True, checkpoint_every=None) as session:
        attribution = Attribution.attach(session, keep_request_evictions=True)
        session.seek(2)
        session.seek(0)  # a fresh allocator
        session.seek(5)
        session.seek(1)
        session.seek(5)
        stats = session.result().stats
    assert attribution.admissions == 3
    assert attribution.per_request[2] == {**dict.fromkeys(attribution.causes, 0), "cold": 1, "evicted": 8}
    assert [(r.step, r.trigger, r.rid, n) for r, n in attribution.evictions_of(2)] == [(3, "admission", 1, 8)]
    assert sum(attribution.causes.values()) == stats.admitted_tokens - stats.reused_tokens == 8 + 28 + 9


def test_namespace_cause_on_the_namespaced_trace(tmp_path: Path) -> None:
    # tests/namespaced.py: one 64-token prompt, requests 0 (lora-a), 1 (lora-b), 2
    # (lora-a), 3 (none), 4 (lora-b); pages of 16, so a hit is at most 48 (the match cap
    # 63, page aligned). 0 is cold (64). 1 and 3 find it only in another namespace: 48
    # namespace, 16 floor each. 2 and 4 hit 48 in their own: 16 floor each.
    from tests.namespaced import write_namespaced_trace

    report = _explain(write_namespaced_trace(tmp_path / "ns.kvtrace"))
    assert report["reused_tokens"] == 2 * 48
    assert _nonzero(report) == {"cold": 64, "namespace": 2 * 48, "floor": 4 * 16}
    # no cache shares KV across namespaces, an infinite one or the page model's either
    assert report["hit_rates"]["infinite"] == report["hit_rates"]["lru"] == 0.3
    assert report["hit_rates"]["model"]["infinite"] == 0.3


def test_evictions_and_namespaces_are_told_apart(tmp_path: Path) -> None:
    # The eviction of _evicting_steps in namespace "a" (rid 2 misses P: 8 evicted, 1
    # cold), then rid 3 in "b" with rid 2's tokens: computed in "a" only, 8 namespace
    # (two pages, up to the match cap) and 1 floor, though they are cached.
    p = list(range(200, 208))
    steps = [*_evicting_steps(), [("finish", 2, 9, 0)], [_prefill(3, [*p, 5])]]
    report = _explain(_trace(tmp_path / "t.kvtrace", steps, pool_tokens=32,
                             namespaces={0: "a", 1: "a", 2: "a", 3: "b"}))
    assert report["reused_tokens"] == 0
    assert _nonzero(report) == {"cold": 8 + 28 + 1, "evicted": 8, "namespace": 8, "floor": 1}
