"""The comparator on hand-built dumps (runs without SGLang)."""

from __future__ import annotations

import copy
import json

import pytest

from kvtrace.sglang import scenario as sc
from tests.differential import compare


def _dump(step: int, **over):
    base = {
        "step": step,
        "events": [{"op": "decode", "rids": [0, 1], "outcome": "ok"}],
        "reqs": [[0, 4, 13, 13, 8, sc.rle([4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16])],
                 [1, 3, 5, 5, 0, sc.rle([20, 21, 22, 23, 24])]],
        "free_pages": sc.rle([7, 8, 9, 10, 2, 3]),
        "release_pages": [],
        "available": 24, "evictable": 0, "protected": 8,
        "free_rows": sc.rle([1, 2]),
    }
    base.update(over)
    return base


def _scenario(n: int) -> sc.Scenario:
    cfg = sc.ScenarioConfig(pool_tokens=64, page_size=4)
    steps = tuple(sc.Step(i, (sc.Op("decode", 0, 10 + i), sc.Op("decode", 1, 2 + i))) for i in range(n))
    return sc.Scenario("synthetic", cfg, steps)


def _lines(dumps, name="synthetic", error=None):
    out = [json.dumps({"scenario": name, "config": {}})]
    out += [json.dumps(d) for d in dumps]
    end = {"end": name, "steps": len(dumps)}
    if error:
        end["error"] = error
    out.append(json.dumps(end))
    return out


def test_rle_round_trip_keeps_order():
    values = [5, 6, 7, 1, 2, 9, 3, 4]
    runs = sc.rle(values)
    assert runs == [[5, 3], [1, 2], [9, 1], [3, 2]]
    assert sc.unrle(runs).tolist() == values
    assert sc.rle([]) == [] and sc.unrle([]).tolist() == []


def test_identical_runs():
    dumps = [_dump(i) for i in range(3)]
    summary = compare.compare_runs([_scenario(3)], _lines(dumps), _lines(copy.deepcopy(dumps)))
    assert summary.identical and summary.steps() == 3
    assert summary.results[0].status == "identical"


def test_first_divergence_is_the_earliest_step_and_request_field():
    a = [_dump(i) for i in range(4)]
    b = copy.deepcopy(a)
    b[2]["reqs"][1][2] = 8  # kv_allocated_len of r1 at step 2
    b[3]["available"] = 0  # later difference must not be reported first
    res = compare.compare_runs([_scenario(4)], _lines(a), _lines(b)).results[0]
    assert res.status == "diverged"
    d = res.divergence
    assert (d.step, d.rid, d.field, d.sglang, d.ours, d.op) == (2, 1, "kv_allocated_len", 5, 8, "decode")
    text = d.render()
    assert "step 2" in text and "rid 1" in text and "kv_allocated_len" in text
    assert any("step 0:" in c for c in d.context)


def test_free_list_order_difference_shows_position():
    a = [_dump(0)]
    b = [_dump(0, free_pages=sc.rle([7, 8, 9, 10, 3, 2]))]
    d = compare.compare_runs([_scenario(1)], _lines(a), _lines(b)).results[0].divergence
    assert d.field == "free_pages" and d.rid is None
    assert "first difference at index 4" in d.detail
    assert d.sglang[-2:] == [2, 3] and d.ours[-2:] == [3, 2]


def test_row_slots_and_holds_kv():
    a = [_dump(0)]
    b = copy.deepcopy(a)
    b[0]["reqs"][0][5] = sc.rle([4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 17])
    d = compare.compare_runs([_scenario(1)], _lines(a), _lines(b)).results[0].divergence
    assert d.field == "req_to_token" and d.rid == 0 and "index 12" in d.detail
    c = copy.deepcopy(a)
    del c[0]["reqs"][1]
    d = compare.compare_runs([_scenario(1)], _lines(a), _lines(c)).results[0].divergence
    assert (d.field, d.rid, d.sglang, d.ours) == ("holds_kv", 1, True, False)


def test_oom_outcome_difference_is_reported_before_state():
    a = [_dump(0)]
    b = [_dump(0, events=[{"op": "decode", "rids": [0, 1], "outcome": "oom"}], available=0)]
    d = compare.compare_runs([_scenario(1)], _lines(a), _lines(b)).results[0].divergence
    assert d.field == "events.decode" and "oom" in d.ours and "ok" in d.sglang
    assert "available" in d.also


def test_row_overflow_is_an_expected_divergence_only_when_both_report_it():
    ev = [{"op": "spec", "rids": [0], "outcome": "ok", "row_overflow": [[0, 78, 76]]}]
    a = [_dump(0), _dump(1, events=ev, available=3)]
    b_same = [_dump(0), _dump(1, events=copy.deepcopy(ev), available=5)]
    res = compare.compare_runs([_scenario(2)], _lines(a), _lines(b_same)).results[0]
    assert res.status == "expected" and "78" in res.note
    b_silent = [_dump(0), _dump(1, available=5)]
    res = compare.compare_runs([_scenario(2)], _lines(a), _lines(b_silent)).results[0]
    assert res.status == "diverged" and res.divergence.field == "row_overflow"


def test_driver_error_and_missing_output():
    a = [_dump(0)]
    res = compare.compare_runs([_scenario(1)], _lines(a), _lines(a, error="RuntimeError: boom")).results[0]
    assert res.status == "error" and "boom" in res.note
    res = compare.compare_runs([_scenario(1)], _lines(a), []).results[0]
    assert res.status == "error" and "no ours output" in res.note
    summary = compare.compare_runs([_scenario(1)], _lines(a), [])
    assert summary.has_error and not summary.identical


@pytest.mark.parametrize("bad", ["{\"step\": 0, \"ops\": [{\"op\": \"fly\", \"rid\": 0, \"seq_len\": 1}]}"])
def test_scenario_loader_names_the_line(tmp_path, bad):
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps({"scenario": "x", "config": {"pool_tokens": 8}}) + "\n" + bad + "\n")
    with pytest.raises(sc.ScenarioError, match=r"s\.jsonl:2: unknown op 'fly'"):
        sc.load_scenarios(str(path))


def test_tree_shape_ranks_access_times_and_names_nodes_by_first_slot():
    nodes = [(40, -1, 8, 0, 17.0), (4, -1, 16, 1, 3.0), (20, 4, 4, 1, 3.0), (48, 40, 4, 0, 90.0)]
    assert sc.tree_shape(nodes) == [[4, -1, 16, 1, 0], [20, 4, 4, 1, 0], [40, -1, 8, 0, 1], [48, 40, 4, 0, 2]]
    assert sc.tree_shape([]) == []


def test_tree_shape_difference_is_a_divergence_and_a_missing_tree_is_not_compared():
    tree = sc.tree_shape([(4, -1, 16, 0, 1.0), (40, -1, 8, 0, 2.0)])
    split = sc.tree_shape([(4, -1, 8, 0, 1.0), (12, 4, 8, 0, 1.0), (40, -1, 8, 0, 2.0)])
    a = [_dump(0, tree=tree)]
    res = compare.compare_runs([_scenario(1)], _lines(a), _lines([_dump(0, tree=split)])).results[0]
    assert res.status == "diverged"
    d = res.divergence
    assert d.field == "tree" and d.sglang == [4, -1, 16, 0, 0] and d.ours == [4, -1, 8, 0, 0]
    assert "slot 4" in d.detail
    # the LRU order alone differs: still a divergence
    swapped = sc.tree_shape([(4, -1, 16, 0, 2.0), (40, -1, 8, 0, 1.0)])
    res = compare.compare_runs([_scenario(1)], _lines(a), _lines([_dump(0, tree=swapped)])).results[0]
    assert res.status == "diverged" and res.divergence.field == "tree"
    res = compare.compare_runs([_scenario(1)], _lines(a), _lines([_dump(0, tree=None)])).results[0]
    assert res.status == "identical"
