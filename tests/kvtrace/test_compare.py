"""The one step comparator (``kvtrace.diff.compare``) on hand-built steps."""

from __future__ import annotations

import numpy as np

from kvtrace.diff.compare import Divergence, FieldDiff, StepView, compare_step, sequence_diff


def view(**over: object) -> StepView:
    base: dict = dict(
        step=7,
        events=[("evict", None, 64), ("overalloc_release", 3, 8)],
        rids=np.array([3, 1, 2], dtype=np.int64),
        requests={
            "kv_allocated_len": np.array([40, 17, 9], dtype=np.int64),
            "kv_committed_len": np.array([32, 17, 9], dtype=np.int64),
        },
        pool={"available": 100, "free_pages": (5, 6, 7, 8)},
        physical={"state_digest": "aa"},
    )
    base.update(over)
    return StepView(**base)


def test_identical_steps_have_no_difference() -> None:
    assert compare_step(view(), view()) == []


def test_outcomes_come_first_then_requests_by_id_then_pool_then_physical() -> None:
    b = view(
        events=[("evict", None, 64), ("oom", 2, 16)],
        requests={
            "kv_allocated_len": np.array([40, 18, 9], dtype=np.int64),  # r1
            "kv_committed_len": np.array([32, 17, 8], dtype=np.int64),  # r2
        },
        pool={"available": 90, "free_pages": (5, 6, 7, 8)},
        physical={"state_digest": "bb"},
    )
    diffs = compare_step(view(), b)
    assert [(d.field, d.rid) for d in diffs] == [
        ("events.overalloc_release", 3), ("kv_allocated_len", 1), ("kv_committed_len", 2),
        ("available", None), ("state_digest", None),
    ]
    assert diffs[1] == FieldDiff("kv_allocated_len", 1, 17, 18, "")
    assert isinstance(diffs[1].a, int)  # numpy scalars come out as Python values


def test_requests_in_another_order_or_on_one_side_only() -> None:
    b = view(
        rids=np.array([2, 3], dtype=np.int64),
        requests={"kv_allocated_len": np.array([9, 41], dtype=np.int64), "kv_committed_len": np.array([9, 32], dtype=np.int64)},
        presence="changed",
    )
    diffs = compare_step(view(presence="changed"), b)
    assert diffs[0] == FieldDiff("changed", 1, True, False, "reported on one side only")
    assert diffs[1] == FieldDiff("kv_allocated_len", 3, 40, 41, "")


def test_a_list_difference_names_its_first_index_and_shows_a_window() -> None:
    b = view(pool={"available": 100, "free_pages": (5, 6, 8, 7)})
    (d,) = compare_step(view(), b)
    assert (d.field, d.rid) == ("free_pages", None)
    assert "first difference at index 2" in d.detail
    assert d.a == [5, 6, 7, 8] and d.b == [5, 6, 8, 7]
    a_win, b_win, detail = sequence_diff("row", list(range(100)), list(range(50)) + [0] + list(range(51, 100)))
    assert detail == "row: lengths 100 vs 100; first difference at index 50 (showing from index 47)"
    assert a_win[3] == 50 and b_win[3] == 0


def test_describe_and_event_text_shape_what_is_shown() -> None:
    b = view(events=[("evict", None, 32), ("overalloc_release", 3, 8)], step=7)
    diffs = compare_step(view(), b, event_text=lambda k: "none" if k is None else f"{k[0]}:{k[2]}", event_detail="x")
    assert diffs == [FieldDiff("events.evict", None, "evict:64", "evict:32", "x")]
    b = view(pool={"available": 101, "free_pages": (5, 6, 7, 8)})
    (d,) = compare_step(view(), b, describe={"available": lambda x, y: (x - 100, y - 100, "relative")})
    assert d == FieldDiff("available", None, 0, 1, "relative")


def test_a_missing_physical_value_is_not_compared_and_a_step_mismatch_is() -> None:
    assert compare_step(view(), view(physical={"state_digest": None})) == []
    assert compare_step(view(), view(step=8))[0].field == "step"


def test_a_divergence_lists_the_other_fields_and_renders_like_a_failed_assert() -> None:
    diffs = [FieldDiff("kv_allocated_len", 4, 48, 32), FieldDiff("available", None, 10, 26)]
    d = Divergence.of(136, "spec", diffs, context=["step 135: spec"])
    assert (d.step, d.op, d.rid, d.field, d.a, d.b, d.also) == (136, "spec", 4, "kv_allocated_len", 48, 32, ("available",))
    assert d.body("A builtin", "B legacy") == [
        "  A builtin  48", "  B legacy   32", "  also differing in this step: available",
    ]
    assert d.to_dict()["context"] == ["step 135: spec"]
