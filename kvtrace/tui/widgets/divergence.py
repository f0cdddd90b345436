"""The diff screen's banner: what ``kvtrace diff`` found (``DiffReport``) and which
divergence the sides are at."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.text import Text
from textual.widgets import Static

if TYPE_CHECKING:
    from kvtrace.diff.diff import DiffReport

__all__ = ["DivergenceBanner", "divergence_text"]


def _value(value: Any, width: int = 40) -> str:
    text = f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def divergence_text(report: DiffReport, index: int | None) -> Text:
    """Two lines: the verdict, then divergence ``index`` (None: the first) with both values."""
    a, b = f"A {report.a.label}", f"B {report.b.label}"
    if report.identical:
        return Text.assemble(("identical", "bold green"), f" over {report.steps_compared:,} steps: {a} and {b}\n",
                             ("keys move both sides together; ? lists them", "dim"))
    n = len(report.divergences)
    i = 0 if index is None else index
    d = report.divergences[i].divergence
    head = "FIRST DIVERGENCE" if i == 0 else f"DIVERGENCE {i + 1} of {n}"
    who = f", request {d.rid}" if d.rid is not None else ""
    more = f"  ({n} found; D: the next)" if n > 1 else ""
    line1 = Text.assemble((head, "bold red"), f" at step {d.step:,} ({d.op}){who}: ", (d.field, "bold"), more)
    line2 = Text.assemble((a, "cyan"), f" {_value(d.a)}   ", (b, "magenta"), f" {_value(d.b)}",
                          (f"   {d.detail}" if d.detail else "", "dim"), ("   d: go there", "dim"))
    return Text("\n").join([line1, line2])


class DivergenceBanner(Static):
    """The verdict of a diff and the divergence shown."""

    def show(self, report: DiffReport, index: int | None) -> None:
        self.update(divergence_text(report, index))
