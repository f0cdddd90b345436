"""Regression test: out of memory in spec, on a trace shrunk by kvtrace shrink.

test_paged_spec_reserve.kvtrace (beside this file) holds 1 request in 3 steps (3 ops);
it was shrunk from sample:mooncake-eagle (918 requests, 4,185 steps, 131,197 ops), where
pre-encapsulation showed at step 136: out of memory in spec: request 77 needed 3,136,
free 3,088, evictable 0.

The test replays it through ALLOCATOR (stopping at an out-of-memory) and asserts that it
never runs out of memory in spec. KVTRACE_REGRESS_ALLOCATOR replaces ALLOCATOR for one
run (kvtrace versions lists the versions).

Made by: kvtrace shrink sample:mooncake-eagle --until oom --allocator pre-encapsulation --baseline builtin --emit-test tests/regress/test_paged_spec_reserve.py
"""

from __future__ import annotations

import os
from pathlib import Path

from kvtrace.replay.engine import ReplayOptions
from kvtrace.replay.session import ReplaySession

TRACE = Path(__file__).with_name("test_paged_spec_reserve.kvtrace")
ALLOCATOR = os.environ.get("KVTRACE_REGRESS_ALLOCATOR", "builtin")
OP = "spec"  # the op kind that ran out of KV slots


def test_paged_spec_reserve() -> None:
    options = ReplayOptions(check="never", on_oom="stop")
    with ReplaySession(TRACE, version=ALLOCATOR, options=options, checker="inline") as session:
        oom = session.run().stats.oom
    assert oom is None or oom.op != OP, (
        f"{ALLOCATOR}: out of memory in {OP} at step {oom.step}, request {oom.rid}: "
        f"needed {oom.needed}, free {oom.free}, evictable {oom.evictable}"
    )
