"""The report of one explained replay: causes, evictors, oracle gaps, distributions.

``Explainer`` wires the gatherers into a ``ReplaySession`` before its first step;
``Explainer.report()`` after the last builds the ``ExplainReport``: one JSON object
(``kvtrace explain --json``, ``kvtrace replay --explain --json`` under ``"explain"``) and
its text rendering.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtrace.explain.attribution import CAUSES, Attribution
from kvtrace.explain.distributions import Histogram
from kvtrace.explain.oracle import OracleResult, OracleStream, simulate

if TYPE_CHECKING:
    from kvtrace.replay.session import ReplaySession

__all__ = ["CAUSE_LABELS", "ExplainReport", "Explainer", "build_report", "print_report", "render_lines"]

CAUSE_LABELS = {
    "cold": "cold (never computed before)",
    "floor": "page-size floor (partial page, match cap)",
    "uncached": "computed, never cached (in flight, aborted)",
    "evicted": "evicted earlier",
    "namespace": "cached in another namespace only",
    "out_of_window": "out of the SWA window",
    "retraction": "recomputed after retraction",
}
TOP_EVICTORS = 10
MIN_ORACLE_PAGE_TOKENS = 16
MAX_ORACLE_POOL_PAGES = 4096


def oracle_page_tokens(page_size: int, pool_tokens: int) -> int:
    """The oracle model's page: the smallest multiple of the replay's page holding at least
    ``MIN_ORACLE_PAGE_TOKENS`` tokens and ``1 / MAX_ORACLE_POOL_PAGES`` of the pool (the
    model runs one Python step per page: a finer one would cost more than the replay)."""
    need = max(MIN_ORACLE_PAGE_TOKENS, -(-pool_tokens // MAX_ORACLE_POOL_PAGES), page_size)
    return -(-need // page_size) * page_size


class Explainer:
    """Explain one replay session: attach before the first step, ``report()`` after the last.

    Args:
        session: the session (not yet stepped).
        oracles: also run the infinite / LRU / Belady page model (``belady=False``: LRU and
            infinite only).
    """

    def __init__(self, session: ReplaySession, *, oracles: bool = True, belady: bool = True) -> None:
        self.session = session
        self.belady = belady
        ps = session.config.page_size
        self.stream = OracleStream(oracle_page_tokens(ps, session.config.pool_tokens)) if oracles else None
        self.attribution = Attribution.attach(session, self.stream)

    def report(self) -> ExplainReport:
        """The report of everything replayed so far."""
        oracle = None
        hists: dict[str, Histogram] = {}
        if self.stream is not None:
            oracle, hists = simulate(self.stream, self.session.config.pool_tokens, belady=self.belady)
        return build_report(self.attribution, oracle, hists)


@dataclass(frozen=True, slots=True)
class ExplainReport:
    """One explained replay (see ``to_dict`` for the JSON keys)."""

    attribution: Attribution
    oracle: OracleResult | None
    histograms: dict[str, Histogram]

    @property
    def missed_tokens(self) -> int:
        return self.attribution.admitted_tokens - self.attribution.reused_tokens

    def top_evictors(self, n: int = TOP_EVICTORS) -> list[dict[str, Any]]:
        """The evictions that cost the most later misses, worst first."""
        a = self.attribution
        worst = sorted(a.record_missed.items(), key=lambda kv: (-kv[1], kv[0]))[:n]
        out = []
        for rec_id, missed in worst:
            r = a.records[rec_id - 1]
            out.append({
                "step": r.step, "trigger": r.trigger, "rid": r.rid, "batch_size": r.batch_size,
                "evicted_tokens": a.record_tokens[rec_id - 1], "missed_tokens": missed,
            })
        return out

    def by_trigger(self) -> dict[str, dict[str, int]]:
        """Tokens evicted, and later missed, by what triggered the eviction."""
        a = self.attribution
        out: dict[str, dict[str, int]] = {}
        for i, r in enumerate(a.records):
            row = out.setdefault(r.trigger, {"evictions": 0, "evicted_tokens": 0, "missed_tokens": 0})
            row["evictions"] += 1
            row["evicted_tokens"] += a.record_tokens[i]
            row["missed_tokens"] += a.record_missed.get(i + 1, 0)
        return out

    def to_dict(self) -> dict[str, Any]:
        """The JSON object: ``admissions``, ``admitted_tokens``, ``reused_tokens``,
        ``missed_tokens``, ``causes`` (tokens per cause; they sum to ``missed_tokens``),
        ``by_trigger``, ``top_evictors``, ``unknown_evictor_tokens``, ``retraction_cost``
        (``{rid: tokens}`` as strings), ``hit_rates`` (``lru`` the replay's, ``infinite``
        exact at the replay's page size; ``model`` the page model's ``infinite``, ``lru``,
        ``belady`` with its ``page_tokens`` and ``capacity_pages``), ``distributions``."""
        a = self.attribution
        admitted = a.admitted_tokens

        def rate(n: int | None) -> float | None:
            return None if n is None else (round(n / admitted, 6) if admitted else 0.0)

        model = None
        if self.oracle is not None:
            o = self.oracle
            model = {
                "page_tokens": o.page_tokens, "capacity_pages": o.capacity_pages,
                "infinite": rate(o.infinite_tokens), "lru": rate(o.lru_tokens), "belady": rate(o.belady_tokens),
            }
        ages = Histogram("age at eviction", "steps, per token")
        for age, n in a.eviction_ages:
            ages.add(age, n)
        dists = {name: h.to_dict() for name, h in self.histograms.items()}
        dists["age_at_eviction"] = ages.to_dict()
        return {
            "admissions": a.admissions,
            "admitted_tokens": admitted,
            "reused_tokens": a.reused_tokens,
            "missed_tokens": self.missed_tokens,
            "causes": dict(a.causes),
            "by_trigger": self.by_trigger(),
            "top_evictors": self.top_evictors(),
            "unknown_evictor_tokens": a.unknown_evictor_tokens,
            "retraction_cost": {str(rid): n for rid, n in sorted(a.retraction_cost.items())},
            "hit_rates": {"lru": rate(a.reused_tokens), "infinite": rate(a.infinite_tokens), "model": model},
            "distributions": dists,
        }


def render_lines(d: dict[str, Any]) -> list[str]:
    """An explain report (``ExplainReport.to_dict()``) as text, line by line."""
    missed = d["missed_tokens"]
    lines = [
        f"{d['admissions']:,} admissions, {d['admitted_tokens']:,} prompt tokens: "
        f"{d['reused_tokens']:,} reused, {missed:,} missed",
        "",
        f"{'missed tokens by cause':<44}{'tokens':>14}{'share':>8}",
    ]
    for cause in CAUSES:
        n = d["causes"][cause]
        share = f"{100 * n / missed:.1f}%" if missed else "-"
        lines.append(f"  {CAUSE_LABELS[cause]:<42}{n:>14,}{share:>8}")
    if d["by_trigger"]:
        lines += ["", f"{'evictions by trigger':<30}{'evictions':>11}{'evicted':>14}{'then missed':>14}"]
        for trigger, row in sorted(d["by_trigger"].items(), key=lambda kv: -kv[1]["missed_tokens"]):
            lines.append(f"  {trigger:<28}{row['evictions']:>11,}{row['evicted_tokens']:>14,}{row['missed_tokens']:>14,}")
    if d["top_evictors"]:
        lines += ["", "top evictors (the evictions that cost the most later misses)"]
        for e in d["top_evictors"]:
            who = f"request {e['rid']}" + (f" (+{e['batch_size'] - 1} in its batch)" if e["batch_size"] > 1 else "")
            lines.append(f"  step {e['step']:>8,}  {e['trigger']:<13} {who:<34} evicted {e['evicted_tokens']:>9,}"
                         f"  then missed {e['missed_tokens']:>9,}")
    if d["unknown_evictor_tokens"]:
        lines.append(f"  ({d['unknown_evictor_tokens']:,} evicted tokens name no evictor: the SWA tree reports none)")
    if d["retraction_cost"]:
        cost = d["retraction_cost"]
        lines += ["", f"retractions: {len(cost):,} requests recomputed {sum(cost.values()):,} tokens"]
    hr = d["hit_rates"]
    lines += ["", "hit rates (capacity vs policy)",
              f"  replay (LRU)     {_pct(hr['lru'])}",
              f"  infinite cache   {_pct(hr['infinite'])}"]
    model = hr["model"]
    if model is not None:
        lines.append(f"  page model ({model['page_tokens']}-token pages, {model['capacity_pages']:,} pages): "
                     f"LRU {_pct(model['lru'])}, Belady {_pct(model['belady'])}, infinite {_pct(model['infinite'])}")
        if model["belady"] is not None:
            lines.append(f"    policy gap (Belady - LRU) {_pts(model['belady'] - model['lru'])}, "
                         f"capacity gap (infinite - Belady) {_pts(model['infinite'] - model['belady'])}")
    for name, hist in d["distributions"].items():
        lines += ["", *_render_histogram(name.replace("_", " "), hist)]
    return lines


def print_report(report: dict[str, Any], console: Any, title: str) -> None:
    """Print an explain report (the JSON object) on a rich ``console``, as plain text."""
    console.print(title, markup=False)
    for line in render_lines(report):
        console.print(line, markup=False)


def _render_histogram(name: str, hist: dict[str, Any]) -> list[str]:
    h = Histogram(name, hist["unit"])
    for b in hist["buckets"]:
        h.add(b["lo"], b["count"])
    return h.render()


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:6.2f}%"


def _pts(x: float) -> str:
    return f"{100 * x:+.2f} points"


def build_report(attribution: Attribution, oracle: OracleResult | None, histograms: dict[str, Histogram]) -> ExplainReport:
    """The report of gathered attribution and, if run, the oracles."""
    return ExplainReport(attribution, oracle, histograms)
