"""The step comparator: two sides' state after one step -> every field that differs.

One implementation for ``kvtrace diff`` (two allocator versions replaying one trace,
``kvtrace.diff.diff``) and for the SGLang differential tests (SGLang's real classes
against ours; ``tests/differential/compare.py`` turns their JSON dumps into
``StepView``s). Both describe a side's step the same way:

* ``events``: the outcomes of the step's calls, in order (an OOM, a drop, an
  eviction and how much, an over-allocation release...), each a tuple whose first
  item names it and whose second is the request it concerns (or not an int);
* per-request fields of the requests the step reports (``rids`` and aligned columns);
* pool-wide fields (counters, free lists);
* physical fields (state digests, slot-level dumps), compared last.

``compare_step`` returns the differing fields in that order (outcomes first: an OOM
on one side explains the rest), requests by id; ``Divergence`` is what a report
shows for one of them. Imports numpy only.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

__all__ = ["Divergence", "FieldDiff", "StepView", "compare_step", "sequence_diff"]

# ``describe`` callbacks: (a value, b value) -> (a shown, b shown, detail)
Describe = Callable[[Any, Any], tuple[Any, Any, str]]


@dataclass(frozen=True, slots=True)
class StepView:
    """One side's state after a step, as the comparator reads it.

    Attributes:
        step: the step number.
        events: outcome keys in call order (``(name, rid or anything, ...)``).
        rids: int64 ``[n]`` the requests the step reports.
        requests: per-request columns, each ``[n]`` aligned with ``rids`` (numeric, or
            object arrays of hashables), compared in this order.
        pool: pool-wide fields, compared in this order.
        physical: slot-level fields (digests, free lists), compared last.
        presence: the field name a request reported on one side only is shown under.
    """

    step: int
    events: Sequence[tuple[Any, ...]]
    rids: np.ndarray
    requests: Mapping[str, np.ndarray]
    pool: Mapping[str, Any]
    physical: Mapping[str, Any] = field(default_factory=dict)
    presence: str = "present"


class FieldDiff(NamedTuple):
    """One differing field: its name, the request (None: pool-wide), both values shown,
    and a detail line (where in a list the first difference is, ...)."""

    field: str
    rid: int | None
    a: Any
    b: Any
    detail: str = ""


def _plain(value: Any) -> Any:
    """numpy scalars -> Python values (JSON, rendering)."""
    return value.item() if isinstance(value, np.generic) else value


def _is_sequence(value: Any) -> bool:
    return isinstance(value, (list, tuple, np.ndarray))


def sequence_diff(name: str, a: Sequence[Any], b: Sequence[Any], window: int = 3) -> tuple[list[Any], list[Any], str]:
    """Where two sequences first differ: both sides around that index, and a detail line."""
    xa, xb = list(a), list(b)
    n = min(len(xa), len(xb))
    i = next((k for k in range(n) if xa[k] != xb[k]), n)
    lo = max(0, i - window)
    detail = f"{name}: lengths {len(xa)} vs {len(xb)}; first difference at index {i}"
    if lo:
        detail += f" (showing from index {lo})"
    return [_plain(v) for v in xa[lo : i + 2 * window]], [_plain(v) for v in xb[lo : i + 2 * window]], detail


def _value_diff(name: str, rid: int | None, x: Any, y: Any, describe: Mapping[str, Describe]) -> FieldDiff:
    if name in describe:
        return FieldDiff(name, rid, *describe[name](x, y))
    if _is_sequence(x) and _is_sequence(y):
        return FieldDiff(name, rid, *sequence_diff(name if rid is None else f"{name} of request {rid}", x, y))
    return FieldDiff(name, rid, _plain(x), _plain(y))


def _differs(x: Any, y: Any) -> bool:
    if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
        return not np.array_equal(np.asarray(x), np.asarray(y))
    return bool(x != y)


def _compare_events(
    a: Sequence[tuple[Any, ...]], b: Sequence[tuple[Any, ...]], event_text: Callable[[Any], str], detail: str
) -> FieldDiff | None:
    if len(a) == len(b) and all(x == y for x, y in zip(a, b)):
        return None
    for i in range(max(len(a), len(b))):
        x = a[i] if i < len(a) else None
        y = b[i] if i < len(b) else None
        if x != y:
            key = x if x is not None else y
            rid = key[1] if len(key) > 1 and isinstance(key[1], (int, np.integer)) else None
            return FieldDiff(f"events.{key[0]}", None if rid is None else int(rid), event_text(x), event_text(y), detail)
    return None


def _compare_requests(a: StepView, b: StepView, describe: Mapping[str, Describe]) -> list[FieldDiff]:
    names = list(a.requests)
    if a.rids.shape == b.rids.shape and np.array_equal(a.rids, b.rids):
        hits: list[tuple[int, int]] = []  # (position in rids, column)
        for c, name in enumerate(names):
            x, y = a.requests[name], b.requests.get(name)
            if y is None:
                continue
            neq = np.flatnonzero(np.asarray(x != y, dtype=bool))
            hits.extend((int(i), c) for i in neq)
        hits.sort(key=lambda h: (int(a.rids[h[0]]), h[1]))
        return [
            _value_diff(names[c], int(a.rids[i]), a.requests[names[c]][i], b.requests[names[c]][i], describe)
            for i, c in hits
        ]
    out = []
    pos_a = {int(r): i for i, r in enumerate(a.rids.tolist())}
    pos_b = {int(r): i for i, r in enumerate(b.rids.tolist())}
    for rid in sorted(pos_a.keys() | pos_b.keys()):
        i, j = pos_a.get(rid), pos_b.get(rid)
        if i is None or j is None:
            out.append(FieldDiff(a.presence, rid, i is not None, j is not None, "reported on one side only"))
            continue
        for name in names:
            x, y = a.requests[name][i], b.requests[name][j]
            if _differs(x, y):
                out.append(_value_diff(name, rid, x, y, describe))
    return out


def compare_step(
    a: StepView,
    b: StepView,
    *,
    describe: Mapping[str, Describe] | None = None,
    event_text: Callable[[Any], str] = lambda key: "(none)" if key is None else str(key),
    event_detail: str = "",
) -> list[FieldDiff]:
    """Every field of one step that differs between side ``a`` and side ``b``.

    Args:
        a, b: the two sides after the same step.
        describe: per field name, how to show a difference (default: the values, and
            for sequences the window around their first difference).
        event_text: how to show one outcome key (``None``: none at that position).
        event_detail: the detail line of an outcome difference.

    Returns:
        The step number (when it differs), the first differing outcome, the request
        fields (by request id, then column order), the pool fields, the physical
        fields; empty when the step is identical.
    """
    describe = describe or {}
    out: list[FieldDiff] = []
    if a.step != b.step:
        out.append(FieldDiff("step", None, a.step, b.step, "the sides replayed different steps"))
    ev = _compare_events(a.events, b.events, event_text, event_detail)
    if ev is not None:
        out.append(ev)
    out.extend(_compare_requests(a, b, describe))
    for group_a, group_b in ((a.pool, b.pool), (a.physical, b.physical)):
        for name, x in group_a.items():
            if name not in group_b:
                continue
            y = group_b[name]
            if x is not None and y is not None and _differs(x, y):
                out.append(_value_diff(name, None, x, y, describe))
    return out


def _short(value: Any, limit: int = 240) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True, slots=True)
class Divergence:
    """One divergence as a report shows it: where (step, the op that touched the field,
    the request), what (field, both values, a detail line), the other fields that
    differ in the same step (``also``) and lines of context before it."""

    step: int
    op: str
    rid: int | None
    field: str
    a: Any
    b: Any
    detail: str = ""
    also: tuple[str, ...] = ()
    context: tuple[str, ...] = ()

    @classmethod
    def of(cls, step: int, op: str, diffs: Sequence[FieldDiff], context: Sequence[str] = (), max_also: int = 8) -> Divergence:
        """The divergence reported for ``diffs[0]``; the other fields are listed as
        ``also``, grouped by field (``kv_allocated_len[r1, r2, r3 +5 more]``)."""
        first = diffs[0]
        groups: dict[str, list[int]] = {}
        for d in diffs[1:]:
            rids = groups.setdefault(d.field, [])
            if d.rid is not None:
                rids.append(d.rid)
        also = []
        for name, rids in list(groups.items())[:max_also]:
            if not rids:
                also.append(name)
                continue
            more = f" +{len(rids) - 3} more" if len(rids) > 3 else ""
            also.append(f"{name}[{', '.join(f'r{r}' for r in rids[:3])}{more}]")
        return cls(step, op, first.rid, first.field, first.a, first.b, first.detail, tuple(also), tuple(context))

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step, "op": self.op, "rid": self.rid, "field": self.field, "a": self.a, "b": self.b,
            "detail": self.detail, "also": list(self.also), "context": list(self.context),
        }

    def body(self, label_a: str = "A", label_b: str = "B") -> list[str]:
        """The lines under a report's headline, the way pytest shows a failed comparison."""
        width = max(len(label_a), len(label_b))
        lines = [f"  {label_a:<{width}}  {_short(self.a)}", f"  {label_b:<{width}}  {_short(self.b)}"]
        if self.detail:
            lines.append(f"  {self.detail}")
        if self.also:
            lines.append(f"  also differing in this step: {', '.join(self.also)}")
        return lines
