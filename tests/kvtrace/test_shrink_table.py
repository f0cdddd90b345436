"""The trace table and its candidates: the whole table rebuilds the trace; any cut the
units allow, with any shorter prefill chunks, is a trace ``kvtrace validate`` passes
(hypothesis, against the op-sequence checker as the reference)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtrace.shrink.runner import validate_steps
from kvtrace.shrink.signature import Signature, Target
from kvtrace.shrink.table import Candidate, TraceTable, build
from kvtrace.replay.session import open_trace
from kvtrace.errors import ConfigError
from kvtrace.replay.result import ViolationRecord
from traces.schema import EXTEND, FINISH, PREALLOC, RETRACT


@pytest.fixture(scope="module")
def tiny() -> TraceTable:
    reader = open_trace("sample:tiny")
    return TraceTable(reader.meta, list(reader.steps()))


def test_the_whole_table_rebuilds_the_trace(tiny: TraceTable) -> None:
    meta, steps = build(tiny, tiny.all_rows())
    original = list(open_trace("sample:tiny").steps())
    assert meta.config == tiny.meta.config and len(steps) == len(original)
    arrival = {}
    for batch in original:
        for r in batch.rid.tolist():
            arrival.setdefault(r, len(arrival))
    for mine, theirs in zip(steps, original):
        # requests are numbered by arrival (tiny's steps already count from 0)
        renumbered = np.array([arrival[r] for r in theirs.rid.tolist()], np.int64)
        assert np.array_equal(mine.rid, renumbered), mine.step
        assert mine.equals(replace(theirs, rid=renumbered)), mine.step
    assert validate_steps(meta, steps) == []


def test_units_keep_first_rows_and_tie_readmissions_to_their_retract(tiny: TraceTable) -> None:
    t = tiny
    assert (t.unit[t.first] == -1).all() and (t.unit[~t.first] >= 0).all()
    readmit = np.flatnonzero(t.readmit)
    assert readmit.size > 0, "tiny retracts and re-admits requests"
    assert (t.op[t.unit[readmit]] == RETRACT).all()
    assert (t.rid[t.unit[readmit]] == t.rid[readmit]).all()


def test_cuts_renumber_requests_and_steps_and_shrink_the_prompt(tiny: TraceTable) -> None:
    t = tiny
    rid = int(t.rid[np.flatnonzero(t.first & (t.op == EXTEND))[3]])
    rows = np.flatnonzero(t.rid == rid)
    chunk = next((r for r in rows if t.unit[r] == r and t.op[r] == EXTEND), None)
    cand = Candidate(rows, append={int(rows[0]): 1})
    meta, steps = build(t, cand)
    assert {int(b.rid[0]) for b in steps} == {0} and [b.step for b in steps] == list(range(len(steps)))
    assert validate_steps(meta, steps) == []
    first = steps[0]
    assert first.seq_len[0] == 1 and first.prompt_len[0] == t.prompt[rid] - (int(t.append_len[rows[0]]) - 1)
    if chunk is not None:
        cut = t.without_units(cand, np.array([chunk]))
        assert validate_steps(*build(t, cut)) == []


@st.composite
def cuts(draw: st.DrawFn, table: TraceTable) -> Candidate:
    """Any candidate the search could make: whole requests dropped, units removed, a
    prefix of steps kept, prefill chunks and pre-allocations shortened."""
    t = table
    cand = t.all_rows()
    rids = np.unique(t.rid)
    dropped = draw(st.lists(st.sampled_from(rids.tolist()), max_size=20))
    cand = t.without_requests(cand, np.array(dropped, np.int64))
    heads = np.unique(t.unit[cand.rows][t.unit[cand.rows] >= 0])
    if heads.size:
        gone = draw(st.lists(st.sampled_from(heads.tolist()), max_size=60))
        cand = t.without_units(cand, np.array(gone, np.int64))
    if draw(st.booleans()) and cand.rows.size:
        cand = t.up_to_step(cand, int(draw(st.sampled_from(t.step[cand.rows].tolist()))))
    a = t.appends(cand)
    can = np.flatnonzero(t.shortenable[cand.rows] & (a > 1))
    for i in draw(st.lists(st.sampled_from(can.tolist()), max_size=8, unique=True)) if can.size else ():
        cand.append[int(cand.rows[i])] = draw(st.integers(1, int(a[i]) - 1))
    return cand


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_cut_is_a_valid_trace(tiny: TraceTable, data: st.DataObject) -> None:
    cand = data.draw(cuts(tiny))
    meta, steps = build(tiny, cand)
    assert validate_steps(meta, steps) == []
    assert sum(len(b) for b in steps) == cand.rows.size
    size = tiny.size(cand)
    assert (size.ops, size.steps) == (cand.rows.size, len(steps))
    # a finish never owns more than the request holds
    for b in steps:
        assert (b.seq_len >= 0).all()
    assert tiny.peak_running(cand) >= 1 or cand.rows.size == 0


def test_finish_keeps_its_early_stop(tiny: TraceTable) -> None:
    t = tiny
    early = np.flatnonzero((t.op == FINISH) & (t.finish_tail > 0))
    if early.size == 0:
        pytest.skip("no early stop in tiny")
    row = int(early[0])
    rows = np.flatnonzero(t.rid == t.rid[row])
    meta, steps = build(t, Candidate(rows))
    last = steps[-1]
    assert last.op[0] == FINISH and last.seq_len[0] == t.seq_len[row]


def test_until_parses_and_refuses() -> None:
    assert Target.parse("violation") == Target("violation")
    assert Target.parse("violation:ownership") == Target("violation", "ownership")
    assert Target.parse("oom") == Target("oom") and str(Target.parse("divergence")) == "divergence"
    for bad in ("leak", "oom:spec", "violation:", ""):
        with pytest.raises(ConfigError, match="violation:CHECK"):
            Target.parse(bad)


def test_a_signature_names_the_counter_of_a_counters_violation() -> None:
    v = ViolationRecord(3, None, "finish", "counters", "sum_committed kept as 7, recomputed 5")
    sig = Signature.of_violation(v)
    assert str(sig) == "violation:counters.sum_committed"
    assert sig.matching_violation([ViolationRecord(9, 1, "decode", "counters", "sum_protected kept as 1, recomputed 0"), v]) is v
    assert str(Signature.of_violation(ViolationRecord(3, 1, "x", "ownership", "page 4 is held twice"))) == "violation:ownership"


def test_arrivals_stay_with_the_requests_kept() -> None:
    reader = open_trace("sample:tiny")
    steps = list(reader.steps())
    arrival = {}  # each request arrives 0.25 s per request id before its admission
    with_arrivals = []
    for b in steps:
        first = np.array([r not in arrival for r in b.rid.tolist()])
        for r in b.rid[first].tolist():
            arrival[r] = b.time_s - 0.25 * r
        with_arrivals.append(replace(b, arrival_s=np.where(first, [arrival.get(r, 0.0) for r in b.rid.tolist()], np.nan)))
    t = TraceTable(reader.meta, with_arrivals)
    rids = np.unique(t.rid)
    kept = rids[[2, 5, 11]]
    meta, out = build(t, t.without_requests(t.all_rows(), np.setdiff1d(rids, kept)))
    assert validate_steps(meta, out) == []
    got = [float(a) for b in out for a in b.arrivals() if not np.isnan(a)]
    assert sorted(got) == sorted(arrival[int(r)] for r in kept)  # one arrival per request, on its first row
    assert build(TraceTable(reader.meta, steps), t.all_rows())[1][0].arrival_s is None
