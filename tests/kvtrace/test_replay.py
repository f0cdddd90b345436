"""The replay engine on real traces: summaries, what-if, OOM, bad ops, determinism, state log."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.replay.engine import ReplayOptions
from kvtrace.replay.result import ReplayResult
from kvtrace.replay.session import ReplaySession
from kvtrace.statelog.log import STATE_LOG_SCHEMA, read_state_log
from tests.helpers import make_meta, write_steps
from traces.batches import StepBatch
from traces.synth import generate

runner = CliRunner()
TIMING_KEYS = {"wall_s", "allocator_s", "speedup_vs_realtime"}


def invoke(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def replay_json(*args: str) -> tuple[int, dict]:
    code, out, err = invoke("replay", *args, "--json")
    assert "Traceback" not in err, err
    return code, json.loads(out)


@pytest.fixture(scope="module")
def busy_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A synthetic trace with every op kind, shared prefixes, retractions and aborts."""
    path = tmp_path_factory.mktemp("replay") / "busy.kvtrace"
    generate(
        path, num_requests=60, seed=3, page_size=16, spec=True, pd_decode=True,
        retract_prob=0.05, abort_prob=0.03, prefix_groups=2, continue_prob=0.5,
    )
    return path


def open_session(path: Path, version: str = "builtin", **options: object) -> ReplaySession:
    overrides = {k: options.pop(k) for k in ("page_size", "pool_tokens") if k in options}
    return ReplaySession(path, version=version, options=ReplayOptions(**options), checker="inline", **overrides)  # type: ignore[arg-type]


def run_engine(path: Path, **options: object) -> ReplayResult:
    with open_session(path, **options) as session:
        return session.run()


def test_replay_json_has_the_design_keys_and_is_clean(busy_trace: Path) -> None:
    code, s = replay_json(str(busy_trace), "--check", "every")
    assert code == 0
    for key in (
        "steps", "requests", "device", "page_size", "pool_tokens", "wall_s", "allocator_s",
        "duration_s", "speedup_vs_realtime", "peak_used_tokens", "peak_step", "prefix_hit_rate",
        "evicted_tokens", "overalloc", "oom", "violations",
    ):
        assert key in s, key
    assert set(s["overalloc"]) >= {"allocated", "released", "held_at_end"}
    assert s["violations"] == [] and s["oom"] is None
    info = json.loads(invoke("info", str(busy_trace), "--json")[1])
    assert s["steps"] == info["steps"] and s["requests"] == info["requests"]
    assert s["tokens"]["decode"] == info["tokens"]["decode"]
    assert s["tokens"]["spec_accepted"] == info["tokens"]["spec_accepted"]
    # Every over-allocated slot is released by the end (all requests finish in this trace),
    # and the speculative steps over-allocated some.
    assert s["overalloc"]["allocated"] > 0
    assert s["finishes"] + s["aborts"] == info["ops"]["finish"] + info["ops"]["abort"]
    assert 0 < s["peak_used_tokens"] <= s["pool_tokens"]


def test_summaries_are_identical_across_runs(busy_trace: Path) -> None:
    _, first = replay_json(str(busy_trace))
    _, second = replay_json(str(busy_trace))
    for s in (first, second):
        for key in TIMING_KEYS:
            s.pop(key)
    assert first == second


def test_what_if_page_size_and_pool_change_hits_and_evictions(busy_trace: Path) -> None:
    base = run_engine(busy_trace)
    paged = run_engine(busy_trace, page_size=64)
    assert base.stats.oom is None and paged.stats.oom is None
    # Larger pages match fewer prefix tokens (hits are page aligned).
    assert paged.stats.reused_tokens < base.stats.reused_tokens
    small = run_engine(busy_trace, pool_tokens=base.stats.peak_used_tokens // 2, on_oom="skip")
    assert small.stats.evicted_tokens > base.stats.evicted_tokens or small.stats.num_ooms > 0


def test_oom_stops_with_step_request_need_free_evictable(busy_trace: Path) -> None:
    code, s = replay_json(str(busy_trace), "--pool-tokens", "512")
    assert code == 1
    oom = s["oom"]
    assert oom is not None and s["stopped_early"] is True
    assert {"step", "rid", "op", "needed", "free", "evictable"} <= set(oom)
    # An allocation fails only when even evicting every unlocked cached token cannot serve it.
    assert oom["needed"] > oom["free"] + oom["evictable"]
    assert s["steps"] == oom["step"] + 1  # the OOM step is the last one replayed (steps start at 0)


def test_oom_skip_drops_requests_and_finishes_clean(busy_trace: Path) -> None:
    code, s = replay_json(str(busy_trace), "--pool-tokens", "512", "--on-oom", "skip", "--check", "every")
    assert code == 0, s
    assert s["num_ooms"] >= 1 and s["dropped_requests"] >= 1
    assert s["violations"] == [] and s["stopped_early"] is False
    info = json.loads(invoke("info", str(busy_trace), "--json")[1])
    assert s["steps"] == info["steps"]


def test_impossible_op_is_one_line_with_step_and_request(tmp_path: Path) -> None:
    # Step 0 prefills request 0; step 1 decodes request 5, which never existed.
    steps = [
        StepBatch.from_columns(0, 0.0, op=["extend"], rid=[0], seq_len=[40], append_len=[40], prompt_len=[40]),
        StepBatch.from_columns(1, 0.1, op=["decode", "decode"], rid=[0, 5], seq_len=[41, 9], append_len=[1, 1]),
    ]
    path = write_steps(tmp_path / "bad.kvtrace", steps, meta=make_meta())
    code, out, err = invoke("replay", str(path))
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err
    assert "step 1" in lines[0] and "request 5" in lines[0]
    code, s = replay_json(str(path), "--on-bad-op", "skip")
    assert code == 1 and s["bad_ops"] == 1 and s["violations"] == []


def test_steps_range_replays_the_prefix_silently(busy_trace: Path, tmp_path: Path) -> None:
    log = tmp_path / "window.arrow"
    code, s = replay_json(str(busy_trace), "--steps", "10:30", "--out", str(log))
    assert code == 0
    _, snaps = read_state_log(log)
    steps = [snap.step for snap in snaps]
    assert steps and min(steps) >= 10 and max(steps) < 30
    assert s["steps_reported"] == len(steps) == 20
    code, out, err = invoke("replay", str(busy_trace), "--steps", "100000:100010", "--json")
    assert code == 0 and json.loads(out)["steps_reported"] == 0
    assert "no step of" in err and "falls in that window" in err


def test_state_log_round_trips_and_opens_with_plain_pyarrow(busy_trace: Path, tmp_path: Path) -> None:
    log = tmp_path / "state.arrow"
    code, s = replay_json(str(busy_trace), "--out", str(log))
    assert code == 0 and s["state_log"] == str(log)
    table = pa.ipc.open_file(pa.memory_map(str(log))).read_all()  # an IPC file: footer, random access
    assert table.schema.remove_metadata() == STATE_LOG_SCHEMA
    assert table.num_rows == s["steps"]
    used = (table["pool_tokens"].to_numpy() - table["available"].to_numpy() - table["evictable"].to_numpy())
    assert int(used.max()) == s["peak_used_tokens"]
    parts = sum(table[c].to_numpy() for c in ("available", "evictable", "protected", "committed", "overallocated"))
    assert (parts == s["pool_tokens"]).all()  # conservation, step by step
    info, snaps = read_state_log(log)
    assert info["allocator"] == "builtin"
    snaps = list(snaps)
    assert [x.step for x in snaps] == table["step"].to_pylist()
    events = [e for x in snaps for e in x.events]
    assert sum(e.tokens for e in events if e.kind == "evict") == s["evicted_tokens"]
    assert sum(e.tokens for e in events if e.kind == "overalloc_release") == s["overalloc"]["released"]


def test_bad_options_are_usage_errors(busy_trace: Path) -> None:
    for args, fragment in (
        (["--check", "sometimes"], "--check"),
        (["--steps", "9:3"], "--steps"),
        (["--steps", "x"], "--steps"),
        (["--page-size", "0"], "--page-size"),
        (["--pool-tokens", "16"], "below two pages"),  # one rule, the allocator's, named by option
        (["--allocator", "nosuch"], "unknown allocator"),
        (["--allocator", "nosuch.module:make"], "cannot import"),
    ):
        code, out, err = invoke("replay", str(busy_trace), *args)
        assert code == 2, (args, out, err)
        assert fragment in err and "Traceback" not in err, (args, err)


def test_missing_trace_is_one_line(tmp_path: Path) -> None:
    code, out, err = invoke("replay", str(tmp_path / "nope.kvtrace"))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "nope.kvtrace" in err


def test_cuda_without_gpu_is_a_clear_error(busy_trace: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    code, out, err = invoke("replay", str(busy_trace), "--device", "cuda")
    assert code == 2 and "no CUDA GPU" in err


def test_engine_snapshots_conserve_the_pool(busy_trace: Path) -> None:
    last = None
    for snap in open_session(busy_trace).snapshots():
        p = snap.pool
        assert p.available + p.evictable + p.protected + p.committed + p.overallocated == p.pool_tokens
        assert np.all(snap.requests.committed <= np.maximum(snap.requests.allocated, snap.requests.committed))
        last = snap
    assert last is not None and last.pool.running_requests == 0


# -- injected faults: the replay catches them with the right step and request ----------

FAULTY = "tests/kvtrace/faulty_allocators.py"


@pytest.fixture(scope="module")
def spec_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Speculative decoding at page 16 (over-allocation to leak), plain decode too."""
    path = tmp_path_factory.mktemp("faults") / "spec.kvtrace"
    generate(path, num_requests=40, seed=11, page_size=16, spec=True, spec_fraction=0.7, early_stop_prob=0.3)
    return path


@pytest.mark.parametrize("factory", ["leaky_overalloc", "double_free", "stale_row"])
def test_injected_fault_is_blamed_on_its_step_and_request(spec_trace: Path, factory: str) -> None:
    session = open_session(spec_trace, f"{FAULTY}:{factory}", check="every")
    alloc = session.allocator
    fault_step = None
    for snap in session.snapshots():
        if fault_step is None and alloc.fault_rid is not None:  # type: ignore[attr-defined]
            fault_step = snap.step
    assert fault_step is not None, "the fault never fired on this trace"
    violations = session.result().stats.violations
    assert violations, "the checker missed the injected fault"
    first = violations[0]
    assert first.step == fault_step
    assert first.rid == alloc.fault_rid  # type: ignore[attr-defined]
    expected_op = {"leaky_overalloc": "finish", "double_free": "finish", "stale_row": "decode"}[factory]
    assert first.op == expected_op
    # The good allocator is clean on the same trace.
    clean = run_engine(spec_trace, check="every")
    assert clean.stats.violations == []


def test_injected_fault_through_the_cli_exits_1_with_blame(spec_trace: Path) -> None:
    code, s = replay_json(str(spec_trace), "--allocator", f"{FAULTY}:leaky_overalloc", "--check", "every")
    assert code == 1
    assert s["num_violations"] >= 1 and s["allocator"] == f"{FAULTY}:leaky_overalloc"
    v = s["violations"][0]
    assert {"step", "rid", "op", "check", "detail"} <= set(v) and v["rid"] is not None and v["op"] == "finish"
    # With --check end the leak is still found, at the end.
    code, s = replay_json(str(spec_trace), "--allocator", f"{FAULTY}:leaky_overalloc")
    assert code == 1 and s["num_violations"] >= 1


@pytest.fixture(scope="module")
def churn_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Speculative and plain decoding with retractions and aborts (faults on every release path)."""
    path = tmp_path_factory.mktemp("faults") / "churn.kvtrace"
    generate(path, num_requests=40, seed=11, page_size=16, spec=True, spec_fraction=0.7, early_stop_prob=0.3,
             retract_prob=0.05, abort_prob=0.05)
    return path


_FAULT_OPS = {
    "leaky_overalloc": {"finish", "abort"},
    "double_free": {"finish"},
    "stale_row": {"decode"},
    "leak_on_retract": {"retract"},
    "overwritten_row": {"decode"},
    "lock_leak": {"abort", "retract"},
    "counters_off": {"decode"},
}


@pytest.mark.parametrize("factory", sorted(_FAULT_OPS))
def test_incremental_and_full_checks_blame_a_fault_alike(churn_trace: Path, factory: str) -> None:
    firsts = []
    for mode in ("every", "full"):
        session = open_session(churn_trace, f"{FAULTY}:{factory}", check=mode)
        alloc = session.allocator
        fault_step = None
        for snap in session.snapshots():
            if fault_step is None and alloc.fault_rid is not None:  # type: ignore[attr-defined]
                fault_step = snap.step
        assert fault_step is not None, f"{factory} never fired on this trace"
        first = session.result().stats.violations[0]
        assert (first.step, first.rid) == (fault_step, alloc.fault_rid), (mode, first)  # type: ignore[attr-defined]
        assert first.op in _FAULT_OPS[factory]
        firsts.append((first.step, first.rid, first.op, first.check))
    assert firsts[0] == firsts[1]


@pytest.mark.parametrize("factory", sorted(_FAULT_OPS))
def test_runs_checked_in_one_call_report_a_fault_as_step_by_step(churn_trace: Path, factory: str) -> None:
    """--check every replays runs of decode steps in one call while nothing is broken; the
    violations (each step, request, op and detail) are those of every step by itself."""
    reports = []
    for runs in (True, False):
        result = run_engine(churn_trace, version=f"{FAULTY}:{factory}", check="every", decode_runs=runs)
        reports.append((result.stats.num_violations, result.stats.violations))
    assert reports[0][0] > 0
    assert reports[0] == reports[1]
