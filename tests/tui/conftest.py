"""Fixtures of the dashboard tests (the helpers they use live in ``tests/helpers.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtrace.replay.session import ReplaySession
from kvtrace.statelog.log import StateLogWriter
from tests.helpers import TINY


@pytest.fixture(scope="session")
def tiny_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A state log of the tiny sample (small batches, so seeks cross several)."""
    path = tmp_path_factory.mktemp("logs") / "tiny.log"
    with ReplaySession(TINY, checker="inline") as s:
        info = {"trace": TINY, "allocator": s.version.spec, "config": {"page_size": s.config.page_size,
                                                                       "pool_tokens": s.config.pool_tokens}}
        with StateLogWriter(path, info, steps_per_batch=16) as log:
            for snap in s.snapshots():
                log.write(snap)
    return path
