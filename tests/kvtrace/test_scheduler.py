"""The scheduler model on the real allocator: admission, chunking, retraction, abort,
PD decode, speculative acceptance, and end-to-end recordings that validate."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from allocator import create_allocator
from allocator.base import AllocatorConfig
from kvtrace.replay.config import spec_config_for
from kvtrace.record.recorder import Recorder
from kvtrace.record.scheduler import CLIP_MAX_NEW_TOKENS, Scheduler, SchedulerConfig, mean_accepted_len
from kvtrace.record.simulate import RecordOptions, record_workload
from traces.metadata import SpecSettings, TraceMeta
from traces.reader import TraceReader
from traces.schema import ABORT, DECODE, EXTEND, FINISH, OPS, PREALLOC, RETRACT, SPEC
from traces.workloads import WorkloadRequest

DATA = Path(__file__).resolve().parents[2] / "traces" / "workloads_data"
MOONCAKE = DATA / "mooncake-fast25" / "conversation_trace.jsonl"

HOG = 1_000_000  # a request id outside the workload, used to take memory away


class Rig:
    """A scheduler on a real allocator, writing a real trace."""

    def __init__(self, tmp_path: Path, config: SchedulerConfig, block_size: int | None = None) -> None:
        self.config = config
        self.path = tmp_path / "t.kvtrace"
        self.alloc = create_allocator(
            AllocatorConfig(
                pool_tokens=config.pool_tokens,
                page_size=config.page_size,
                max_running=config.max_running + 1,  # one row for the hog
                max_context_len=config.max_context_len,
                spec=spec_config_for(config.spec),
                radix_cache=config.radix_cache,
                need_sort=config.pd_decode,
            )
        )
        meta = TraceMeta(config=config.trace_config())
        self.rec = Recorder(self.path, meta, dense_ids=True)
        self.sched = Scheduler(self.alloc, self.rec, config, block_size=block_size)

    def arrive(self, *reqs: WorkloadRequest) -> None:
        for r in reqs:
            self.sched._arrive(r)

    def step(self) -> None:
        assert self.sched._step()

    def hog(self, tokens: int) -> None:
        """Take ``tokens`` slots away from the scheduler (another tenant of the pool)."""
        ids = np.arange(tokens, dtype=np.int64) + (1 << 40)
        res = self.alloc.extend(np.array([HOG]), np.array([tokens]), [ids], np.array([False]))
        assert not hasattr(res, "needed"), res

    def unhog(self) -> None:
        self.alloc.release(np.array([HOG]), self.alloc.request_lens(np.array([HOG])).committed, None, "abort")

    def steps(self) -> list:
        self.rec.flush()
        return list(TraceReader(self.path).steps())

    def close(self) -> None:
        self.rec.close()


def req(t: float, input_len: int, output_len: int, hashes: list[int] | None = None) -> WorkloadRequest:
    return WorkloadRequest(
        arrival_s=t,
        input_len=input_len,
        output_len=output_len,
        block_hashes=None if hashes is None else np.array(hashes, np.uint64),
        block_size=None if hashes is None else 512,
    )


def ops_of(batch) -> list[tuple[str, int, int]]:
    return [(OPS[o], int(r), int(s)) for o, r, s in zip(batch.op.tolist(), batch.rid.tolist(), batch.seq_len.tolist())]


# --------------------------------------------------------------------------- admission


def test_admission_stops_when_the_budget_is_spent(tmp_path: Path) -> None:
    # Pool 1000: each request asks 300 + 100 + 1 page; two fit (401 < 1000, 401 < 599), the third not (401 < 198).
    rig = Rig(tmp_path, SchedulerConfig(page_size=1, pool_tokens=1000, max_running=8, max_context_len=4096, chunk_size=None))
    rig.arrive(req(0, 300, 100), req(0, 300, 100), req(0, 300, 100))
    rig.step()
    first = rig.steps()[0]
    assert ops_of(first) == [("extend", 0, 300), ("extend", 1, 300)]
    assert rig.sched.waiting == [2] and rig.sched.batch_is_full
    rig.close()


@pytest.mark.parametrize("slack", [1, 0])
def test_admission_charges_running_requests_times_new_token_ratio(tmp_path: Path, slack: int) -> None:
    rig = Rig(tmp_path, SchedulerConfig(page_size=1, pool_tokens=1000, max_running=8, max_context_len=4096, chunk_size=None))
    rig.arrive(req(0, 100, 500))
    rig.step()  # prefill of request 0 (it has sampled 1 token)
    c = rig.alloc.counters()
    remaining = c.available + c.evictable - min(500 - 1, CLIP_MAX_NEW_TOKENS) * 0.7
    # Admitted iff input + max_new + page < remaining.
    output_len = int(np.ceil(remaining)) - 100 - 1 - 1 + slack
    fits = 100 + output_len + 1 < remaining
    assert fits == (slack == 0)
    rig.arrive(req(0.001, 100, output_len))
    rig.step()
    second = rig.steps()[1]
    if fits:
        assert ops_of(second) == [("extend", 1, 100)]
    else:
        assert ops_of(second) == [("decode", 0, 101)]
    rig.close()


# --------------------------------------------------------------------------- chunked prefill


def test_chunked_prefill_after_a_prefix_hit(tmp_path: Path) -> None:
    cfg = SchedulerConfig(page_size=16, pool_tokens=65536, max_running=8, max_context_len=65536, chunk_size=8192)
    rig = Rig(tmp_path, cfg, block_size=512)
    rig.arrive(req(0, 1024, 2, [1, 2]))
    for _ in range(3):  # prefill, decode, release
        rig.step()
    rig.arrive(req(1.0, 20000, 1, [1, 2] + list(range(3, 42))))
    while rig.sched.num_requests < 2 or rig.sched.state[1] != 4:
        rig.step()
    rows = [(b.step, op) for b in rig.steps() for op in ops_of(b) if op[1] == 1]
    seq = [op[2] for _, op in rows if op[0] == "extend"]
    # extend_len = floor((prefix + chunk) / page) * page - prefix with prefix 1024.
    assert seq == [1024 + 8192, 1024 + 2 * 8192, 20000]
    steps = [s for s, op in rows if op[0] == "extend"]
    assert steps == list(range(steps[0], steps[0] + 3))  # one chunk per step, nothing in between
    first_row = next(b for b in rig.steps() if 1 in b.rid.tolist())
    i = first_row.rid.tolist().index(1)
    assert first_row.prefix_len[i] == 1024 and first_row.prompt_len[i] == 20000
    assert rig.alloc.check_integrity() == []
    rig.close()


# --------------------------------------------------------------------------- retraction and abort


def test_retraction_takes_the_longest_prompt_among_equal_outputs(tmp_path: Path) -> None:
    rig = Rig(tmp_path, SchedulerConfig(page_size=1, pool_tokens=400, max_running=8, max_context_len=4096, chunk_size=None))
    rig.arrive(req(0, 10, 50), req(0, 12, 50), req(0, 8, 50))
    rig.step()  # all three prefilled
    rig.step()  # one decode
    rig.hog(rig.alloc.counters().available)
    rig.step()
    last = rig.steps()[-1]
    assert [op for op in ops_of(last) if op[0] == "retract"] == [("retract", 1, 13)]
    assert sorted(op[1] for op in ops_of(last) if op[0] == "decode") == [0, 2]
    assert rig.sched.waiting == [1] and rig.sched.summary().retractions == 1
    rig.unhog()
    rig.close()


def test_retraction_takes_fewest_outputs_first(tmp_path: Path) -> None:
    rig = Rig(tmp_path, SchedulerConfig(page_size=1, pool_tokens=400, max_running=8, max_context_len=4096, chunk_size=None))
    rig.arrive(req(0, 30, 50))
    rig.step()
    rig.step()
    rig.step()
    rig.arrive(req(0, 5, 50))  # short prompt, fewer outputs
    rig.step()
    rig.hog(rig.alloc.counters().available)
    rig.step()
    retracted = [op[1] for op in ops_of(rig.steps()[-1]) if op[0] == "retract"]
    assert retracted == [1]
    rig.unhog()
    rig.close()


def test_abort_when_even_the_last_request_cannot_fit(tmp_path: Path) -> None:
    rig = Rig(tmp_path, SchedulerConfig(page_size=16, pool_tokens=1024, max_running=8, max_context_len=4096, chunk_size=None))
    rig.arrive(req(0, 32, 50))
    rig.step()  # prefill: 32 tokens, the next decode needs a new page
    rig.hog(rig.alloc.counters().available)
    rig.step()
    last = rig.steps()[-1]
    assert ops_of(last) == [("abort", 0, 32)]
    summary = rig.sched.summary()
    assert summary.aborted == 1 and rig.sched.running.shape[0] == 0
    rig.unhog()
    assert rig.alloc.check_integrity() == []
    rig.close()


def test_step_kinds_add_up_when_a_step_only_aborts(tmp_path: Path) -> None:
    # The step that aborts the last request runs nothing: a retract step, counted.
    rig = Rig(tmp_path, SchedulerConfig(page_size=16, pool_tokens=1024, max_running=8, max_context_len=4096, chunk_size=None))
    rig.arrive(req(0, 32, 50))
    rig.step()
    rig.hog(rig.alloc.counters().available)
    rig.step()
    s = rig.sched.summary()
    assert (s.steps, s.prefill_steps, s.decode_steps, s.release_steps, s.retract_steps) == (2, 1, 0, 0, 1)
    rig.unhog()
    rig.close()


# --------------------------------------------------------------------------- PD decode and spec


def _azure_file(tmp_path: Path, rows: list[tuple[float, int, int]]) -> Path:
    path = tmp_path / "az.csv"
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for t, c, g in rows:
        sec = 3 + t
        lines.append(f"2023-11-16 18:17:{sec:010.7f},{c},{g}")
    path.write_text("\n".join(lines))
    return path


def test_pd_decode_preallocates_prompts_and_never_prefills(tmp_path: Path) -> None:
    wl = _azure_file(tmp_path, [(0.0, 100, 5), (0.0, 40, 1), (0.5, 64, 3)])
    out = tmp_path / "pd.kvtrace"
    res = record_workload(
        RecordOptions(workload=wl, fmt="azure", out=out, pool_tokens=4096, page_size=16, max_running=8, pd_decode=True)
    )
    assert res.violations == []
    rows = [op for b in TraceReader(out).steps() for op in ops_of(b)]
    kinds = {op[0] for op in rows}
    assert "extend" not in kinds and "prealloc" in kinds
    pre = [op for op in rows if op[0] == "prealloc"]
    assert pre[:2] == [("prealloc", 0, 100), ("prealloc", 1, 40)]
    finishes = {op[1]: op[2] for op in rows if op[0] == "finish"}
    # The prefill server sampled token 1; decode adds output - 1 tokens of KV.
    assert finishes == {0: 104, 1: 40, 2: 66}
    assert res.summary.finished == 3


def test_spec_acceptance_distribution_mean(tmp_path: Path) -> None:
    spec = SpecSettings(num_steps=3, topk=1, num_draft_tokens=4)
    rig = Rig(tmp_path, SchedulerConfig(page_size=16, pool_tokens=4096, max_running=8, max_context_len=4096, spec=spec, seed=7))
    draws = rig.sched._draw_accepted(200_000)
    assert draws.min() == 1 and draws.max() == 4
    assert draws.mean() == pytest.approx(mean_accepted_len(0.7, 4), abs=0.01)
    assert mean_accepted_len(0.7, 4) == pytest.approx(1 + 0.7 + 0.49 + 0.343)
    freq = np.bincount(draws, minlength=5)[1:] / draws.shape[0]
    assert freq == pytest.approx([0.3, 0.21, 0.147, 0.343], abs=0.005)
    rig.close()


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize(
    "spec",
    [
        SpecSettings("eagle", 3, 1, 4),
        SpecSettings("eagle3", 5, 4, 8),
        SpecSettings("standalone", 3, 2, 4),
        SpecSettings("dflash", 1, 1, 16),
        SpecSettings("uno", 3, 1, 4),  # type: ignore[arg-type]  (the allocator knows it; the CLI does not)
    ],
)
def test_scheduler_reserves_what_the_allocator_reserves(tmp_path: Path, page_size: int, spec: SpecSettings) -> None:
    """The decode memory check charges each request the allocator's own reserve."""
    config = SchedulerConfig(page_size=page_size, pool_tokens=8192, max_running=4, max_context_len=4096, spec=spec)
    rig = Rig(tmp_path, config)
    assert rig.sched.reserve == rig.alloc.ctx.spec_reserve > 0
    if spec.algorithm == "uno":
        assert rig.sched.reserve == 2 * (spec.num_draft_tokens + 1)
    rig.close()


def test_spec_trace_commits_accepted_tokens(tmp_path: Path) -> None:
    wl = _azure_file(tmp_path, [(0.0, 100, 200), (0.1, 50, 120)])
    out = tmp_path / "spec.kvtrace"
    spec = SpecSettings(num_steps=3, topk=1, num_draft_tokens=4)
    res = record_workload(
        RecordOptions(workload=wl, fmt="azure", out=out, pool_tokens=8192, page_size=16, max_running=8, spec=spec, seed=3)
    )
    assert res.violations == []
    reader = TraceReader(out)
    assert reader.meta.config.spec == spec
    last: dict[int, int] = {}
    accepted = []
    for b in reader.steps():
        for i in range(len(b)):
            rid, op = int(b.rid[i]), int(b.op[i])
            if op == SPEC:
                assert b.draft_len[i] == 4 and 1 <= b.accepted_len[i] <= 4
                assert b.seq_len[i] == last[rid] + b.accepted_len[i]
                accepted.append(int(b.accepted_len[i]))
            if op in (EXTEND, SPEC, DECODE):
                last[rid] = int(b.seq_len[i])
            if op == FINISH:
                # owned = min(committed, prompt + output): verify may run past the stop.
                assert b.seq_len[i] == min(last[rid], {0: 300, 1: 170}[rid])
    assert len(accepted) > 50 and 2.0 < np.mean(accepted) < 3.1


# --------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_mooncake_window_records_validates_and_stays_sound(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from kvtrace.cli import app

    out = tmp_path / "m.kvtrace"
    res = record_workload(
        RecordOptions(
            workload=MOONCAKE, fmt="mooncake", out=out, pool_tokens=200_000, page_size=16, duration_s=20.0
        )
    )
    s = res.summary
    assert res.violations == []
    assert s.requests > 40 and s.finished == s.requests
    assert 0.0 < s.prefix_hit_rate < 1.0
    result = CliRunner().invoke(app, ["validate", str(out), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["ok"] and report["steps"] == s.steps and report["ended"] == s.requests
    reader = TraceReader(out)
    assert reader.meta.source.repository == "kvcache-ai/Mooncake"
    assert reader.meta.block_size == 512
    assert sum(1 for _ in reader.steps()) == s.steps


@pytest.mark.slow
def test_mooncake_prefix_hits_match_the_source_reuse_when_nothing_is_evicted(tmp_path: Path) -> None:
    """Recorded token-level hits vs the source's 512-token block reuse (first 3 minutes).

    With a pool that never evicts, the radix cache reuses exactly the prompt blocks the
    source says repeat (as whole-block tokens, capped at len - 1). With the default
    H200 pool (920k tokens) LRU eviction drops most prefixes before the next turn: the
    10-minute Mooncake window pushes ~24M prompt tokens through it.
    """
    from traces.block_reuse import block_reuse
    from traces.workloads import read_workload

    window = 180.0
    source = block_reuse(read_workload(MOONCAKE, "mooncake", duration_s=window))
    rates = {}
    for pool in (30_000_000, 920_000):
        res = record_workload(
            RecordOptions(
                workload=MOONCAKE, fmt="mooncake", out=tmp_path / f"m{pool}.kvtrace", pool_tokens=pool,
                page_size=16, duration_s=window,
            )
        )
        assert res.violations == []
        rates[pool] = res.summary
    unbounded, default = rates[30_000_000], rates[920_000]
    print(
        f"\nMooncake first {window:.0f} s: source block reuse {source.repeated_fraction:.3f} of 512-token block "
        f"references ({source.token_hit_fraction:.3f} of prompt tokens in reused whole blocks); recorded "
        f"token-level prefix hits {unbounded.prefix_hit_rate:.3f} with a pool that never evicts "
        f"({unbounded.evicted_tokens} evicted), {default.prefix_hit_rate:.3f} with the default 920k-token pool "
        f"({default.evicted_tokens:,} tokens evicted). Token level differs from block level: partial last blocks, "
        "the len-1 cap, and (default pool) LRU eviction."
    )
    assert unbounded.evicted_tokens == 0
    assert unbounded.prefix_hit_rate == pytest.approx(source.token_hit_fraction, abs=0.01)
    assert abs(source.token_hit_fraction - source.repeated_fraction) < 0.02
    assert default.prefix_hit_rate < unbounded.prefix_hit_rate


# --------------------------------------------------------------------------- policies


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_lpm_admits_the_longest_cached_prefix_first(tmp_path: Path, policy: str) -> None:
    cfg = SchedulerConfig(page_size=16, pool_tokens=65536, max_running=8, max_context_len=8192, policy=policy)
    rig = Rig(tmp_path, cfg, block_size=512)
    rig.arrive(req(0, 1024, 2, [1, 2]))
    for _ in range(3):  # prefill, decode, release: blocks 1, 2 are cached
        rig.step()
    rig.arrive(req(1, 1000, 5, [50, 51]), req(1, 1500, 5, [1, 2, 3]))
    rig.step()
    batch = rig.steps()[-1]
    order = [op[1] for op in ops_of(batch) if op[0] == "extend"]
    assert order == ([1, 2] if policy == "fcfs" else [2, 1])
    hit = batch.prefix_len[batch.rid.tolist().index(2)]
    assert hit == 1024
    rig.close()


def test_lpm_defers_a_second_request_sharing_an_uncached_first_block(tmp_path: Path) -> None:
    cfg = SchedulerConfig(page_size=16, pool_tokens=65536, max_running=8, max_context_len=8192, policy="lpm")
    rig = Rig(tmp_path, cfg, block_size=512)
    # Nothing cached: requests 0 and 1 share their first block, 2 does not.
    rig.arrive(req(0, 1000, 5, [7, 8]), req(0, 1000, 5, [7, 9]), req(0, 100, 5, [20]))
    rig.step()
    order = [op[1] for op in ops_of(rig.steps()[0]) if op[0] == "extend"]
    assert order == [0, 2, 1]  # SGLang's in-batch prefix caching: 1 goes last
    rig.close()
