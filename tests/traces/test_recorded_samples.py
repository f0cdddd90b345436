"""Samples recorded from real workloads: valid, attributed, small, and regenerated exactly."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

from traces.checker import OpSequenceChecker
from traces.reader import TraceReader
from traces.samples import RECORDED, resolve_trace, sample_path
from traces.schema import ABORT, OPS, RETRACT, SPEC

ROOT = Path(__file__).resolve().parents[2]


def _make_samples():
    spec = importlib.util.spec_from_file_location("make_samples", ROOT / "bench" / "make_samples.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules.setdefault("make_samples", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(RECORDED))
@pytest.mark.slow
def test_recorded_sample_is_valid_attributed_and_small(name: str) -> None:
    path = resolve_trace(f"sample:{name}")
    reader = TraceReader(path)
    checker = OpSequenceChecker(reader.meta)
    problems = [str(p) for s in reader.steps() for p in checker.check(s)]
    assert problems == [] and not reader.truncated
    summary = checker.finish()
    assert summary.holding_kv == 0  # every request released by the end
    src = reader.meta.source
    assert src.repository and src.path and src.license and src.citation
    assert src.engine == "kvtrace-scheduler"
    # The one-hour production trace must stay under 50 MB; the windows are small.
    assert reader.file_bytes < (50_000_000 if name == "mooncake-conversation" else 5_000_000)
    assert name in (ROOT / "traces" / "README.md").read_text()


def test_samples_total_under_30_mb() -> None:
    assert sum(sample_path(n).stat().st_size for n in RECORDED) < 30_000_000


@pytest.mark.slow
def test_the_hour_sample_is_the_whole_mooncake_hour() -> None:
    reader = TraceReader(resolve_trace("sample:mooncake-conversation"))
    assert reader.meta.source.path.endswith("conversation_trace.jsonl")
    assert reader.meta.extra["duration_s"] is None  # recorded without a --duration window
    checker = OpSequenceChecker(reader.meta)
    for batch in reader.steps():
        checker.check(batch)
    assert checker.finish().requests == 12_031  # every request of the source file


def test_make_samples_lists_every_recorded_sample() -> None:
    names = {s.name.removesuffix(".kvtrace") for s in _make_samples().SAMPLES_SPEC}
    assert names == set(RECORDED)


def test_special_samples_hold_what_they_promise() -> None:
    eagle = TraceReader(sample_path("mooncake-eagle"))
    assert eagle.meta.config.spec is not None and eagle.meta.config.page_size == 16
    assert any((s.op == SPEC).any() for s in eagle.steps())
    pressure = TraceReader(sample_path("mooncake-pressure"))
    ops = {OPS[o] for s in pressure.steps() for o in set(s.op.tolist())}
    assert {"retract", "abort"} <= ops
    azure = TraceReader(sample_path("azure-code"))
    assert azure.meta.config.page_size == 16 and azure.meta.source.repository == "Azure/AzurePublicDataset"


@pytest.mark.parametrize("name", ["mooncake-tiny", pytest.param("mooncake-pressure", marks=pytest.mark.slow)])
def test_sample_regenerates_exactly(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The recording is deterministic: bench/make_samples.py writes the same trace (and for
    the pressure sample the recording evicted, retracted and aborted)."""
    make_samples = _make_samples()
    monkeypatch.setattr(make_samples, "SAMPLES", tmp_path)
    sample = next(s for s in make_samples.SAMPLES_SPEC if s.name == f"{name}.kvtrace")
    report = make_samples.make(sample)
    fresh = TraceReader(tmp_path / sample.name)
    bundled = TraceReader(sample_path(name))
    # The same content and settings; the creation time and the recording's own
    # provenance (when it finished) are this run's, and so is the format version (the
    # bundled samples stay version 1).
    assert fresh.ipc_format == bundled.ipc_format == "file" and fresh.meta.recording.status == "complete"
    assert fresh.meta.recording.command.startswith("kvtrace record ")
    assert dataclasses.replace(fresh.meta, created_at=None, recording=None, format_version=1) == dataclasses.replace(
        bundled.meta, created_at=None, recording=None
    )
    a, b = list(fresh.steps()), list(bundled.steps())
    assert len(a) == len(b) and all(x.equals(y) for x, y in zip(a, b))
    assert report["integrity_violations"] == []
    if name == "mooncake-pressure":
        assert report["evicted_tokens"] > 0 and report["retractions"] > 0 and report["aborts"] >= 1
        assert any((s.op == ABORT).any() for s in b) and any((s.op == RETRACT).any() for s in b)
