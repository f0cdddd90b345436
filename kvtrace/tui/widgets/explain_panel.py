"""ExplainPanel: the selected request's missed prefix tokens by cause (``kvtrace.explain``).

Each admission of the request (its first extend, or its first after a retraction) misses
the prompt tokens the cache did not give it; the replay (started with ``--explain``)
splits them into causes that sum exactly to the missed tokens, and names, for the
evicted ones, each eviction: its step, its trigger and the request whose allocation
forced it. The panel only renders what the replay answered (``RequestExplanation``);
``jump_target`` is where ``j`` goes: the eviction that cost the request most.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table
from rich.text import Text
from textual.widgets import Static

if TYPE_CHECKING:
    from kvtrace.tui.driver import RequestExplanation

__all__ = ["MAX_EVICTIONS_SHOWN", "ExplainPanel", "explanation_table"]

MAX_EVICTIONS_SHOWN = 8  # the evictions listed (most tokens first); the rest are counted


def explanation_table(e: RequestExplanation) -> Table | Text:
    """The causes (tokens, share) and the evictions behind the evicted ones, as a table;
    a note where the replay has none."""
    from kvtrace.explain.attribution import CAUSES
    from kvtrace.explain.report import CAUSE_LABELS

    if e.note is not None:
        return Text(e.note)
    table = Table(box=None, padding=(0, 1), show_header=True, header_style="bold", expand=False)
    table.add_column(f"request {e.rid}: {e.missed:,} prompt tokens missed", no_wrap=True)
    table.add_column("tokens", justify="right")
    table.add_column("share", justify="right")
    for cause in CAUSES:
        n = e.causes.get(cause, 0)
        share = f"{100 * n / e.missed:.1f}%" if e.missed else "-"
        table.add_row(CAUSE_LABELS.get(cause, cause), f"{n:,}", share, style=None if n else "dim")
        if cause == "evicted":
            _eviction_rows(table, e)
    return table


def _eviction_rows(table: Table, e: RequestExplanation) -> None:
    """Under the evicted tokens: each eviction behind them (step, trigger, the request
    whose allocation forced it), the one ``j`` goes to marked."""
    for i, (step, trigger, rid, batch, n) in enumerate(e.evictions[:MAX_EVICTIONS_SHOWN]):
        who = f"request {rid}" + (f" (+{batch - 1} in its batch)" if batch > 1 else "")
        mark = "▶" if i == 0 else " "
        table.add_row(Text(f"  {mark} step {step:,}, {trigger}, by {who}", style="bold" if i == 0 else ""),
                      f"{n:,}", "")
    rest = len(e.evictions) - MAX_EVICTIONS_SHOWN
    if rest > 0:
        table.add_row(Text(f"    … {rest:,} more evictions", style="dim"), "", "")


class ExplainPanel(Static):
    """One request's missed tokens by cause, and who evicted them (``show``)."""

    def __init__(self, *, id: str | None = None) -> None:  # noqa: A002
        super().__init__("asking the replay…", id=id)
        self.explanation: RequestExplanation | None = None

    def show(self, explanation: RequestExplanation) -> None:
        """Render ``explanation`` (the replay's answer)."""
        self.explanation = explanation
        self.update(explanation_table(explanation))

    @property
    def jump_target(self) -> tuple[int, int] | None:
        """(step, request) of the eviction that cost the request most (None: none)."""
        e = self.explanation
        if e is None or not e.evictions:
            return None
        step, _, rid, _, _ = e.evictions[0]
        return step, rid
