"""``kvtrace shrink`` on hybrid (SWA) traces: an SWA fault shrinks to a small trace that
keeps the model's attention layout (its SWA pool following the shrunk full pool by the
recorded ratio) and still fails the same way, in the same pool; the parallel workers
can judge divergences; full-attention signatures and metadata stay as they were."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import multiprocessing
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.diff.diff import diff_trace
from kvtrace.replay.result import ViolationRecord
from kvtrace.shrink.signature import Signature
from kvtrace.shrink.table import with_config
from traces.metadata import swa_pool_tokens_for
from traces.reader import TraceReader
from traces.samples import resolve_trace

runner = CliRunner()
FAULTY = str(Path(__file__).with_name("faulty_allocators.py"))


def _shrink(*args: str) -> dict:
    result = runner.invoke(app, ["shrink", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.slow
def test_an_swa_divergence_shrinks_keeping_the_layout_and_reproduces(tmp_path: Path) -> None:
    """Two worker processes judge the candidates (each a diff of two versions in lockstep)."""
    out = tmp_path / "small.kvtrace"
    b = f"{FAULTY}:missed_window_free"
    res = _shrink("sample:mooncake-gpt-oss", "--until", "divergence", "--b", b, "--out", str(out), "--jobs", "2")
    assert res["reproduced"] and res["confirmed"] and res["signature"] == "divergence:swa_available"
    assert res["after"]["requests"] <= 2 and res["after"]["steps"] <= 10
    original = TraceReader(resolve_trace("sample:mooncake-gpt-oss")).meta
    meta = TraceReader(out).meta
    assert meta.attention is not None and meta.model == original.model
    assert dataclasses.replace(meta.attention, swa_pool_tokens=0) == dataclasses.replace(original.attention, swa_pool_tokens=0)
    cfg = meta.config
    assert meta.attention.swa_pool_tokens == swa_pool_tokens_for(cfg.pool_tokens, cfg.page_size, 0.8) < cfg.pool_tokens
    again = diff_trace(str(out), "builtin", b, jobs=1).to_dict()["first_divergence"]
    assert (again["field"], again["pool"]) == ("swa_available", "swa")


@pytest.mark.slow
def test_an_swa_violation_keeps_its_pool_and_its_emitted_test_holds(tmp_path: Path) -> None:
    test_file = tmp_path / "test_window.py"
    broken = f"{FAULTY}:missed_window_free"
    res = _shrink("sample:mooncake-gemma-3", "--until", "violation", "--allocator", broken, "--baseline", "builtin",
                  "--emit-test", str(test_file), "--jobs", "2")
    assert res["signature"] == "violation:conservation@swa" and res["confirmed"]
    assert TraceReader(test_file.with_suffix(".kvtrace")).meta.attention.sliding_window == 1024
    spec = importlib.util.spec_from_file_location("emitted_window", test_file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.ALLOCATOR = "builtin"
    module.test_window()  # the failure is gone with the built-in allocator
    module.ALLOCATOR = broken
    with pytest.raises(AssertionError):
        module.test_window()


def test_a_smaller_pool_sizes_the_swa_pool_by_the_ratio_and_leaves_full_attention_alone() -> None:
    swa = TraceReader(resolve_trace("sample:mooncake-gemma-3")).meta
    small = with_config(swa, pool_tokens=4_000)
    assert small.config.pool_tokens == 4_000 and small.attention.swa_pool_tokens == 3_200
    assert with_config(swa, max_running=1).attention == swa.attention  # the pools unchanged: as recorded
    full = TraceReader(resolve_trace("sample:tiny")).meta
    assert with_config(full, pool_tokens=1_000) == full.with_config(pool_tokens=1_000)


def test_a_violation_signature_tells_the_pools_apart() -> None:
    swa = ViolationRecord(3, None, "decode", "conservation", "...", pool="swa")
    full = ViolationRecord(3, None, "decode", "conservation", "...")
    sig = Signature.of_violation(swa)
    assert str(sig) == "violation:conservation@swa" and sig.describe().endswith("in the SWA pool")
    assert sig.matching_violation([full]) is None and sig.matching_violation([full, swa]) is swa
    plain = Signature.of_violation(full)
    assert str(plain) == "violation:conservation" and plain.matching_violation([swa, full]) is full


def _diff_in(queue: multiprocessing.Queue) -> None:
    try:
        queue.put(diff_trace("sample:tiny", "builtin", "builtin", jobs=1).identical)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        queue.put(f"{type(exc).__name__}: {exc}")


def test_a_lockstep_diff_runs_in_a_daemonic_process() -> None:
    """What ``kvtrace shrink --jobs N`` workers do for --until divergence."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_diff_in, args=(queue,), daemon=True)
    proc.start()
    try:
        assert queue.get(timeout=120) is True
    finally:
        proc.join(timeout=30)
