"""Synthetic traces are valid, deterministic, and exercise every op kind."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from traces.checker import OpSequenceChecker
from traces.metadata import SpecSettings
from traces.reader import TraceReader
from traces.schema import OPS, SESSION_OPS
from traces.synth import generate, generate_mooncake_shaped, synth_meta
from traces.tokens import TokenStore
from traces.writer import TraceWriter

EVERYTHING = dict(
    num_requests=40, spec=True, pd_decode=True, retract_prob=0.06, abort_prob=0.04, explicit_fraction=0.2
)


def check(path: Path) -> tuple[list[str], OpSequenceChecker, TraceReader]:
    reader = TraceReader(path)
    checker = OpSequenceChecker(reader.meta)
    problems = [str(p) for batch in reader.steps() for p in checker.check(batch)]
    return problems, checker, reader


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_every_op_kind_and_a_clean_validation(tmp_path: Path, seed: int) -> None:
    summary = generate(tmp_path / "t.kvtrace", seed=seed, **EVERYTHING)  # type: ignore[arg-type]
    sessionless = {name for code, name in enumerate(OPS) if code not in SESSION_OPS}  # synth writes no sessions
    assert set(k for k, v in summary.ops.items() if v) == sessionless, summary.ops
    problems, checker, reader = check(tmp_path / "t.kvtrace")
    assert problems == []
    end = checker.finish()
    assert end.steps == summary.steps and end.rows == summary.rows
    assert end.requests == 40 and end.ended == 40 and end.holding_kv == 0
    assert summary.repeated_block_refs > 0  # prompts share leading blocks
    assert not reader.truncated


def test_chunks_cross_pages_and_spec_stops_early(tmp_path: Path) -> None:
    generate(tmp_path / "t.kvtrace", seed=5, **EVERYTHING)  # type: ignore[arg-type]
    reader = TraceReader(tmp_path / "t.kvtrace")
    page = reader.meta.config.page_size
    crossing, early_stops, lengths = 0, 0, {}
    for batch in reader.steps():
        for op, rid, seq, app in zip(batch.op, batch.rid, batch.seq_len, batch.append_len):
            if OPS[op] == "extend" and seq % page and (seq - app) // page != (seq - 1) // page:
                crossing += 1
            if OPS[op] == "finish" and seq < lengths.get(rid, 0):
                early_stops += 1
            lengths[rid] = seq
    assert crossing > 0 and early_stops > 0


def test_same_seed_same_bytes_other_seed_other_trace(tmp_path: Path) -> None:
    a = generate(tmp_path / "a.kvtrace", seed=9, **EVERYTHING)  # type: ignore[arg-type]
    generate(tmp_path / "b.kvtrace", seed=9, **EVERYTHING)  # type: ignore[arg-type]
    c = generate(tmp_path / "c.kvtrace", seed=10, **EVERYTHING)  # type: ignore[arg-type]
    assert (tmp_path / "a.kvtrace").read_bytes() == (tmp_path / "b.kvtrace").read_bytes()
    assert a != c


def test_a_window_leaves_requests_holding_kv(tmp_path: Path) -> None:
    summary = generate(tmp_path / "w.kvtrace", seed=1, max_steps=40, **EVERYTHING)  # type: ignore[arg-type]
    problems, checker, _ = check(tmp_path / "w.kvtrace")
    assert problems == [] and summary.steps <= 40
    assert checker.finish().holding_kv > 0


def test_explicit_ids_reach_the_token_store(tmp_path: Path) -> None:
    generate(tmp_path / "t.kvtrace", seed=2, **EVERYTHING)  # type: ignore[arg-type]
    reader = TraceReader(tmp_path / "t.kvtrace")
    store = TokenStore(reader.meta.block_size)
    checked = 0
    for batch in reader.steps():
        store.ingest(batch)
        for i in np.flatnonzero(batch.token_ids.valid).tolist():
            ids = batch.token_ids.row(i)
            end = int(batch.seq_len[i])
            assert store.ids(int(batch.rid[i]), end)[end - ids.shape[0] :].tolist() == ids.tolist()
            checked += 1
        finished = batch.rid[(batch.op == OPS.index("finish")) | (batch.op == OPS.index("abort"))]
        store.drop(finished)
    assert checked > 20 and store.num_live == 0


def test_generate_into_an_open_writer(tmp_path: Path) -> None:
    meta = synth_meta(
        page_size=16, pool_tokens=8192, max_running=8, max_context_len=2048, block_size=32,
        chunk_size=43, spec=SpecSettings(), pd_decode=False, workload="test",
    )
    with TraceWriter(tmp_path / "t.kvtrace", meta) as writer:
        summary = generate(writer, num_requests=5, spec=True, pool_tokens=8192)
        assert not writer.closed
    assert check(tmp_path / "t.kvtrace")[0] == [] and summary.requests == 5
    with pytest.raises(ValueError, match="does not match"):
        with TraceWriter(tmp_path / "u.kvtrace", meta) as writer:
            generate(writer, num_requests=5)


def test_mooncake_shaped_generator_at_small_scale(tmp_path: Path) -> None:
    summary = generate_mooncake_shaped(tmp_path / "m.kvtrace", num_requests=300, duration_s=90.0)
    assert summary.requests == 300 and summary.ops["finish"] == 300
    assert 0.2 < summary.repeated_block_fraction < 0.5
    problems, checker, reader = check(tmp_path / "m.kvtrace")
    assert problems == []
    assert reader.meta.block_size == 512
    assert summary.prompt_tokens / summary.requests > 5_000  # Mooncake-like prompt lengths
