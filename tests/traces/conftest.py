"""Shared builders for the trace-package tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from traces.io import TraceWriter
from traces.schema import SpecSettings, StepBatch, TraceConfig, TraceMeta


def make_meta(**config: object) -> TraceMeta:
    """A small valid metadata; keyword arguments override ``TraceConfig`` fields."""
    fields: dict[str, object] = dict(page_size=16, pool_tokens=4096, max_running=8, max_context_len=4096)
    block_size = config.pop("block_size", 32)
    fields.update(config)
    return TraceMeta(config=TraceConfig(**fields), block_size=block_size)  # type: ignore[arg-type]


def decode_steps(num_steps: int, rows: int = 6, first_step: int = 0) -> list[StepBatch]:
    """Deterministic steps: request ``i`` decodes to ``100 * step + i`` (content checkable)."""
    out = []
    for s in range(first_step, first_step + num_steps):
        rid = np.arange(rows, dtype=np.int64)
        out.append(
            StepBatch.from_columns(
                s,
                0.25 * s,
                op=np.full(rows, 1, np.int8),
                rid=rid,
                seq_len=100 * s + rid,
                append_len=np.ones(rows, np.int32),
                token_ids=[np.array([1000 * s + i]) if i % 3 == 0 else None for i in range(rows)],
            )
        )
    return out


def write_steps(path: Path, steps: list[StepBatch], **kwargs: object) -> Path:
    with TraceWriter(path, kwargs.pop("meta", None) or make_meta(), **kwargs) as writer:  # type: ignore[arg-type]
        for batch in steps:
            writer.write(batch)
    return path


@pytest.fixture
def meta() -> TraceMeta:
    return make_meta()


@pytest.fixture
def spec_meta() -> TraceMeta:
    return make_meta(spec=SpecSettings(), pd_decode=True)
