"""Step-by-step comparison of two differential runs (SGLang's real classes vs ours).

Both sides write the same JSON-lines dump (``scenario.STATE_FIELDS`` per step,
see ``kvtrace/sglang/driver.py``); ``compare_scenario`` walks them in lockstep and returns
the FIRST divergence: the step, the op that touched the field, the request, the
field, both values and a few steps of context.

The step comparison itself is kvtrace's (``kvtrace.diff.compare``, the one ``kvtrace
diff`` uses): a dump becomes a ``StepView`` (call outcomes; per request its row,
lengths and ``req_to_token`` slots; the pool sizes and free lists in order; the
radix tree's shape) and ``compare_step`` lists what differs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from kvtrace.diff import compare as core

from kvtrace.sglang import scenario as sc

REQ_FIELDS = ("row", "kv_allocated_len", "kv_committed_len", "cache_protected_len", "req_to_token")
POOL_FIELDS = ("available", "evictable", "protected", "free_pages", "release_pages", "free_rows",
               "swa_available", "swa_free_pages",  # the SWA pool's are None without one
               "swa_evictable", "swa_protected")  # the SWA tree's are None with the radix cache off


@dataclass
class RunBlock:
    """One scenario's output from one driver."""

    name: str
    header: dict[str, Any]
    steps: list[dict[str, Any]] = field(default_factory=list)
    end: dict[str, Any] | None = None

    @property
    def error(self) -> str | None:
        if self.end is None:
            return "output ended before the scenario finished (driver crashed?)"
        return self.end.get("error")


def read_blocks(lines: Iterable[str]) -> dict[str, RunBlock]:
    blocks: dict[str, RunBlock] = {}
    cur: RunBlock | None = None
    for line in lines:
        line = line.strip()
        if not line:
            continue
        rec = json.loads(line)
        if "scenario" in rec:
            cur = RunBlock(rec["scenario"], rec)
            blocks[cur.name] = cur
        elif "end" in rec:
            blk = blocks.get(rec["end"])
            if blk is None:
                blk = blocks[rec["end"]] = RunBlock(rec["end"], {})
            blk.end = rec
            cur = None
        elif cur is not None:
            cur.steps.append(rec)
    return blocks


@dataclass(frozen=True, slots=True)
class Divergence:
    """A scenario's first divergence: ``kvtrace.diff.compare.Divergence`` (side A is SGLang,
    side B ours) with the scenario and, with ``--fine``, the call after which it shows."""

    scenario: str
    core: core.Divergence
    phase: str = ""  # --fine: the batched call after which the dumps differ

    def __getattr__(self, name: str) -> Any:
        return getattr(self.core, name)

    @property
    def sglang(self) -> Any:
        return self.core.a

    @property
    def ours(self) -> Any:
        return self.core.b

    def to_dict(self) -> dict[str, Any]:
        d = self.core.to_dict()
        d["sglang"], d["ours"] = d.pop("a"), d.pop("b")
        return {"scenario": self.scenario, **d, "phase": self.phase}

    def render(self) -> str:
        c = self.core
        who = f" rid {c.rid}" if c.rid is not None else ""
        after = f", after the {self.phase} call" if self.phase and self.phase != "end" else ""
        lines = [f"FIRST DIVERGENCE in {self.scenario!r} at step {c.step} ({c.op}{after}){who}: {c.field}"]
        lines += c.body("sglang:", "ours:")
        if c.context:
            lines.append("  context:")
            lines.extend(f"    {line}" for line in c.context)
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class ScenarioResult:
    scenario: str
    status: str  # identical | diverged | expected | error
    steps_compared: int
    divergence: Divergence | None = None
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario, "status": self.status, "steps_compared": self.steps_compared,
            "divergence": self.divergence.to_dict() if self.divergence else None, "note": self.note,
        }


def _ops_of_step(step: sc.Step | None) -> str:
    if step is None:
        return "(no ops)"
    return "; ".join(o.brief() for o in step.ops) or "(no ops)"


def _op_for(step: sc.Step | None, rid: int | None) -> str:
    if step is None:
        return "-"
    if rid is not None:
        kinds = [o.op for o in step.ops if o.rid == rid]
        if kinds:
            return "+".join(kinds)
    kinds = sorted({o.op for o in step.ops}, key=sc.OP_ORDER.index)
    return "+".join(kinds) if kinds else "-"


def _overflow_set(events: Sequence[dict[str, Any]]) -> set[tuple[int, int]]:
    out = set()
    for ev in events:
        for rid, asked, _width in ev.get("row_overflow", ()):
            out.add((int(rid), int(asked)))
    return out


def _event_key(ev: dict[str, Any]) -> tuple:
    return (ev.get("op"), tuple(ev.get("rids", ())), ev.get("outcome"), tuple(ev.get("skipped", ())))


def step_view(d: dict[str, Any]) -> core.StepView:
    """One driver's dump of a step as the comparator reads it."""
    reqs = d["reqs"]
    n = len(reqs)
    slots = np.empty(n, dtype=object)
    for i, r in enumerate(reqs):
        slots[i] = tuple(sc.unrle(r[5]).tolist())
    requests = {name: np.array([r[k] for r in reqs], dtype=np.int64) for k, name in enumerate(REQ_FIELDS[:-1], start=1)}
    requests["req_to_token"] = slots
    pool: dict[str, Any] = {}
    for name in POOL_FIELDS:
        value = d.get(name)
        pool[name] = tuple(sc.unrle(value).tolist()) if isinstance(value, list) else value
    return core.StepView(
        step=int(d.get("step", 0)),
        events=[_event_key(e) for e in d.get("events", ())],
        rids=np.array([r[0] for r in reqs], dtype=np.int64),
        requests=requests,
        pool=pool,
        physical={"tree": d.get("tree"), "swa_reqs": d.get("swa_reqs"), "swa_tree": d.get("swa_tree")},
        presence="holds_kv",
    )


def compare_step(a: dict[str, Any], b: dict[str, Any]) -> list[core.FieldDiff]:
    """Every differing field of one step: (field, rid, sglang value, ours value, detail)."""
    return core.compare_step(
        step_view(a), step_view(b), describe={"tree": _tree_diff},
        event_text=_event_str, event_detail="call outcome (ok / oom / skipped)",
    )


def _tree_diff(a: list[list[int]], b: list[list[int]]) -> tuple[Any, Any, str]:
    """The first differing node of two ``scenario.tree_shape`` lists."""
    by_a = {n[0]: n for n in a}
    by_b = {n[0]: n for n in b}
    for first in sorted(set(by_a) | set(by_b)):
        x, y = by_a.get(first), by_b.get(first)
        if x != y:
            return x, y, (
                f"radix tree: {len(a)} vs {len(b)} nodes; first differing node starts at slot {first} "
                "([first_slot, parent_first_slot, length, lock_ref, access-time rank])"
            )
    return a[:4], b[:4], "radix tree: same nodes, different order"


def _event_str(key: tuple | None) -> str:
    if key is None:
        return "(no call)"
    op, rids, outcome, skipped = key
    text = f"{op} {list(rids)} -> {outcome}" if rids else f"{op}"
    return text + (f", skipped {list(skipped)}" if skipped else "")


def _state_line(d: dict[str, Any]) -> str:
    reqs = " ".join(f"r{r[0]}:{r[2]}/{r[3]}/{r[4]}" for r in d["reqs"])
    return (f"avail={d['available']} evictable={d['evictable']} protected={d['protected']} "
            f"free_rows={len(sc.unrle(d['free_rows']))} reqs(alloc/commit/protected)=[{reqs}]")


def _conservation_excess(d: dict[str, Any], page_size: int, pool_tokens: int) -> int:
    """Slots a dump accounts for beyond the pool: available + evictable + protected +
    each request's private pages (``ceil_align(allocated) - protected``) - pool size.
    Positive means some slot is counted twice (free AND referenced): a double free."""
    private = sum(-(-r[2] // page_size) * page_size - r[4] for r in d["reqs"])
    return d["available"] + d["evictable"] + d["protected"] + private - pool_tokens


def compare_scenario(
    scenario: sc.Scenario | None, sglang: RunBlock | None, ours: RunBlock | None, context_steps: int = 3
) -> ScenarioResult:
    """Compare one scenario's two runs; a row overflow reported by SGLang (topk>1 at page 1,
    §10) ends the comparison as an expected divergence when ours reports it too."""
    name = (scenario.name if scenario else None) or (sglang.name if sglang else ours.name if ours else "?")
    if sglang is None or ours is None:
        missing = "sglang" if sglang is None else "ours"
        return ScenarioResult(name, "error", 0, note=f"no {missing} output for this scenario")
    for side, blk in (("sglang", sglang), ("ours", ours)):
        if blk.error:
            return ScenarioResult(name, "error", 0, note=f"{side} driver: {blk.error}")
    steps_by_no = {s.step: s for s in scenario.steps} if scenario else {}
    n = min(len(sglang.steps), len(ours.steps))
    for i in range(n):
        a, b = sglang.steps[i], ours.steps[i]
        step_no = a.get("step", i)
        sstep = steps_by_no.get(step_no)
        ova, ovb = _overflow_set(a.get("events", ())), _overflow_set(b.get("events", ()))
        if ova:
            if ova <= ovb or {r for r, _ in ova} <= {r for r, _ in ovb}:
                return ScenarioResult(
                    name, "expected", i,
                    note=(f"step {step_no}: SGLang wrote past the req_to_token row for {sorted(ova)} "
                          f"(rid, positions asked); ours reported {sorted(ovb)}; comparison stops here (§10)"),
                )
            return ScenarioResult(name, "diverged", i, Divergence(name, core.Divergence(
                step_no, _op_for(sstep, None), sorted(ova)[0][0], "row_overflow",
                sorted(ova), sorted(ovb), "SGLang overflowed the row; ours did not report it",
            )))
        diffs = compare_step(a, b)
        if not diffs:
            continue
        if scenario is not None:
            cfg = scenario.config
            excess = _conservation_excess(a, cfg.page_size, cfg.pool_tokens)
            if excess > 0 and _conservation_excess(b, cfg.page_size, cfg.pool_tokens) == 0:
                return ScenarioResult(
                    name, "expected", i,
                    note=(f"step {step_no}: SGLang's state counts {excess} slots twice (free and still "
                          "referenced by the radix tree: a release whose owned length is below its "
                          "cache_protected_len frees tree slots); ours conserves the pool; comparison stops here"),
                )
        rid = diffs[0].rid
        phase = str(a.get("phase", ""))
        ctx = []
        seen: list[int] = []
        for j in range(i, -1, -1):
            sn = sglang.steps[j].get("step", j)
            if sn not in seen:
                seen.insert(0, sn)
            if len(seen) > context_steps:
                break
        for sn in seen:
            ctx.append(f"step {sn}: {_ops_of_step(steps_by_no.get(sn))}")
        ctx.append(f"sglang after step {step_no}: {_state_line(a)}")
        ctx.append(f"ours   after step {step_no}: {_state_line(b)}")
        op = phase if phase and phase != "end" else _op_for(sstep, rid)
        return ScenarioResult(name, "diverged", i + 1, Divergence(
            name, core.Divergence.of(step_no, op, diffs, ctx, max_also=7), phase,
        ))
    if len(sglang.steps) != len(ours.steps):
        return ScenarioResult(name, "error", n, note=f"step counts differ: sglang {len(sglang.steps)}, ours {len(ours.steps)}")
    return ScenarioResult(name, "identical", n)


@dataclass
class Summary:
    results: list[ScenarioResult]

    @property
    def identical(self) -> bool:
        return all(r.status in ("identical", "expected") for r in self.results)

    @property
    def has_error(self) -> bool:
        return any(r.status == "error" for r in self.results)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.results:
            out[r.status] = out.get(r.status, 0) + 1
        return out

    def steps(self) -> int:
        return sum(r.steps_compared for r in self.results)

    def render(self) -> str:
        lines = []
        for r in self.results:
            if r.status == "diverged" and r.divergence is not None:
                lines.append(r.divergence.render())
            elif r.status in ("error", "expected"):
                lines.append(f"{r.status.upper()} {r.scenario}: {r.note}")
        c = self.counts()
        ok = c.get("identical", 0)
        lines.append(
            f"{len(self.results)} scenarios, {self.steps()} steps compared: {ok} identical"
            + "".join(f", {c[k]} {k}" for k in ("expected", "diverged", "error") if c.get(k))
        )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "identical": self.identical, "scenarios": len(self.results), "steps_compared": self.steps(),
            "counts": self.counts(), "results": [r.to_dict() for r in self.results],
            "first_divergence": next((r.divergence.to_dict() for r in self.results if r.divergence), None),
        }


def compare_runs(scenarios: Sequence[sc.Scenario], sglang_lines: Iterable[str], ours_lines: Iterable[str]) -> Summary:
    a, b = read_blocks(sglang_lines), read_blocks(ours_lines)
    return Summary([compare_scenario(s, a.get(s.name), b.get(s.name)) for s in scenarios])
