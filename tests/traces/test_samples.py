"""Bundled samples: found by name, valid, and what their recipe regenerates."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from traces.checker import OpSequenceChecker
from traces.errors import UnknownSampleError
from traces.reader import TraceReader
from traces.samples import RECIPES, RECORDED, list_samples, regenerate, resolve_trace, sample_path
from traces.schema import OPS, SESSION_OPS


def test_names_and_paths() -> None:
    assert list_samples() == sorted([*RECIPES, *RECORDED]) and "tiny" in list_samples()
    assert sample_path("tiny").name == "tiny.kvtrace" and sample_path("tiny").is_file()
    assert resolve_trace("sample:tiny") == sample_path("tiny")
    assert resolve_trace("some/file.kvtrace") == Path("some/file.kvtrace")
    with pytest.raises(UnknownSampleError, match="unknown sample 'big'; bundled samples: azure-code, "):
        resolve_trace("sample:big")


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_sample_is_valid_and_matches_its_recipe(tmp_path: Path, name: str) -> None:
    bundled = TraceReader(sample_path(name))
    checker = OpSequenceChecker(bundled.meta)
    steps = list(bundled.steps())
    assert [str(p) for s in steps for p in checker.check(s)] == []
    assert not bundled.truncated
    fresh = TraceReader(regenerate(name, tmp_path))
    # A full-attention trace is written as format version 1, the lowest that holds it:
    # the fresh sample's metadata is the bundled one's.
    assert bundled.meta.format_version == fresh.meta.format_version == 1
    assert fresh.meta == bundled.meta
    again = list(fresh.steps())
    assert len(again) == len(steps) and all(a.equals(b) for a, b in zip(again, steps))


def test_tiny_exercises_every_op_with_page_size_16() -> None:
    reader = TraceReader(sample_path("tiny"))
    seen = {OPS[o] for s in reader.steps() for o in s.op}
    assert seen == {name for code, name in enumerate(OPS) if code not in SESSION_OPS}  # no sessions in it
    assert reader.meta.config.page_size == 16 and reader.meta.config.pool_tokens < 10_000
    assert reader.file_bytes < 200_000
