"""Trace -> scenario conversion, and the scenario runner on our allocator (no SGLang needed)."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from kvtrace.sglang import scenario as sc
from tests.differential import ours_driver, trace_adapter
from traces.reader import TraceReader
from traces.schema import OPS
from traces.synth import generate
from traces.tokens import TokenStore


@pytest.fixture(scope="module")
def pd_trace(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("traces") / "pd.kvtrace")
    generate(path, num_requests=16, seed=3, page_size=16, pool_tokens=4096, max_context_len=1024,
             pd_decode=True, block_size=16, retract_prob=0.05, abort_prob=0.02, explicit_fraction=0.3)
    return path


def test_every_row_becomes_one_op_with_the_trace_content(pd_trace: str) -> None:
    scen = trace_adapter.trace_to_scenario(pd_trace)
    reader = TraceReader(pd_trace)
    store = TokenStore(reader.meta.block_size)
    book = sc.TokenBook()
    batches = list(reader.steps())
    assert [s.step for s in scen.steps] == [int(b.step) for b in batches]
    assert scen.config.need_sort and scen.config.page_size == 16
    kinds_seen = set()
    for batch, step in zip(batches, scen.steps):
        store.ingest(batch)
        assert len(step.ops) == len(batch)
        for i, op in enumerate(step.ops):
            assert (op.op, op.rid, op.seq_len) == (OPS[int(batch.op[i])], int(batch.rid[i]), int(batch.seq_len[i]))
            kinds_seen.add(op.op)
            if op.op in ("extend", "decode", "spec", "prealloc"):
                book.note_first(op)
                start = op.seq_len - int(batch.append_len[i])
                book.append(op, start)
                # The scenario's own content rule reproduces the trace's ids exactly.
                assert np.array_equal(book.tokens(op.rid, op.seq_len), store.ids(op.rid, op.seq_len))
        store.drop([o.rid for o in step.ops if o.op in ("finish", "abort")])
    assert {"extend", "decode", "prealloc", "finish"} <= kinds_seen


def test_our_allocator_runs_the_converted_trace(pd_trace: str) -> None:
    scen = trace_adapter.trace_to_scenario(pd_trace)
    out = io.StringIO()
    assert ours_driver.run_scenarios([scen], out) == 0
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert lines[0]["scenario"] == scen.name and lines[-1]["steps"] == len(scen.steps)
    final = lines[-2]
    # Everything released at the end: the pool is free or cached.
    assert not final["reqs"]
    assert final["available"] + final["evictable"] == scen.config.pool_tokens
    assert final["protected"] == 0


def test_unreadable_trace_is_a_clean_error(tmp_path) -> None:
    from tests.differential import harness

    with pytest.raises(harness.HarnessError, match="no such file"):
        harness.load_inputs([str(tmp_path / "missing.kvtrace")], 0, 0, None)
