"""Fixtures of the trace-package tests (the builders they use live in ``tests/helpers.py``)."""

from __future__ import annotations

import pytest

from tests.helpers import make_meta
from traces.metadata import SpecSettings, TraceMeta


@pytest.fixture
def meta() -> TraceMeta:
    return make_meta()


@pytest.fixture
def spec_meta() -> TraceMeta:
    return make_meta(spec=SpecSettings(), pd_decode=True)
