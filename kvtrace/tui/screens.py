"""Screens (layout only): the replay dashboard, the key help, go-to-step, request detail."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen, Screen
from textual.widgets import Footer, Input, Static
from textual_plot import HiResMode

from kvtrace.tui.widgets.events_log import describe
from kvtrace.tui.widgets.header import ReplayHeader
from kvtrace.tui.widgets.occupancy import OccupancyChart, OccupancyLegend, QuietPlot
from kvtrace.tui.widgets.page_map import PageMap, legend
from kvtrace.tui.widgets.request_table import RequestTable

if TYPE_CHECKING:
    from kvtrace.state import RequestRow
    from kvtrace.tui.driver import RequestHistory

__all__ = ["KEYS", "GotoScreen", "HelpScreen", "ReplayScreen", "RequestDetailScreen"]

KEYS = (
    ("space", "play / pause"),
    ("→ / ←", "one step forward / back"),
    ("shift+→ / shift+←", "100 steps forward / back"),
    ("+ / -", "replay faster / slower"),
    ("g", "go to a step"),
    ("n / N", "next / previous event (of the kind the events log shows)"),
    ("k", "events log: next kind (all, overalloc_release, evict, …)"),
    ("P", "jump to the peak occupancy"),
    ("o", "jump to the first OOM or violation"),
    ("/", "filter requests: phases, live, over, ids, A-B"),
    ("s / r", "sort requests by the next column / reverse"),
    ("enter", "detail of the selected request (history chart)"),
    ("tab", "next panel; click a row, cell or event to select it"),
    ("?", "this help"),
    ("q", "quit"),
)


class ReplayScreen(Screen):
    """The dashboard: header, occupancy chart and legend, page map, requests, events."""

    def compose(self) -> ComposeResult:
        from kvtrace.tui.widgets.events_log import EventsLog

        yield ReplayHeader(id="header")
        with Horizontal(id="top"):
            with Vertical(id="occupancy", classes="panel") as v:
                v.border_title = "occupancy"
                with Horizontal():
                    yield OccupancyChart(id="chart")
                    yield OccupancyLegend(id="legend")
            with Vertical(id="pages", classes="panel") as v:
                v.border_title = "page map"
                yield PageMap(id="pagemap")
                yield Static(legend(), id="pagemap-legend")
                yield Static("click a cell to see its pages and owners", id="cell-info")
        with Horizontal(id="bottom"):
            with Vertical(id="requests", classes="panel") as v:
                v.border_title = "requests"
                yield RequestTable(id="table")
                yield Input(placeholder="filter: phases, live, over, ids, A-B (enter applies, esc closes)", id="filter")
            with Vertical(id="events", classes="panel") as v:
                v.border_title = "events"
                yield EventsLog(id="events-log")
        yield Footer()


class HelpScreen(ModalScreen[None]):
    """The key reference."""

    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        table = Table(title="kvtrace dashboard keys", show_header=False, box=None, padding=(0, 2))
        table.add_column(style="bold cyan", no_wrap=True)
        table.add_column()
        for key, what in KEYS:
            table.add_row(key, what)
        yield Static(table, id="help-body")

    def action_dismiss(self) -> None:  # type: ignore[override]
        self.dismiss(None)


class GotoScreen(ModalScreen[int | None]):
    """Ask for a step number."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, first: int | None, last: int | None) -> None:
        super().__init__()
        self.first, self.last = first, last

    def compose(self) -> ComposeResult:
        span = f" ({self.first:,}..{self.last:,})" if self.first is not None and self.last is not None else ""
        with Vertical(id="goto-body"):
            yield Static(f"go to step{span}")
            yield Input(placeholder="step", id="goto-input", type="integer")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip().replace(",", "").replace("_", "")
        if not text.lstrip("-").isdigit():
            self.notify(f"'{event.value}' is not a step number", severity="warning")
            return
        self.dismiss(int(text))

    def action_cancel(self) -> None:
        self.dismiss(None)


class RequestDetailScreen(ModalScreen[None]):
    """One request: its row, its lengths over its life (a chart), its events."""

    BINDINGS = [Binding("escape,enter,q", "close", "Close")]

    def __init__(self, row: RequestRow) -> None:
        super().__init__()
        self.row = row

    def compose(self) -> ComposeResult:
        r = self.row
        with Vertical(id="detail-body") as v:
            v.border_title = f"request {r.rid}"
            yield Static(
                f"phase {r.phase} · used {r.used:,} · allocated {r.allocated:,} · over-allocated {r.overallocated:,} · "
                f"pages {r.pages:,} · prefix hit {r.prefix_hit:,} · admitted at step {r.admitted_step} · "
                f"ended at step {r.ended_step if r.ended_step >= 0 else '-'}",
                id="detail-row",
            )
            yield Static("[yellow]allocated[/] and [green]used[/] tokens", id="detail-caption")
            yield QuietPlot(id="detail-chart")
            yield Static("[dark_orange]over-allocated[/] slots (allocated - used)", id="detail-over-caption")
            yield QuietPlot(id="detail-over")
            yield Static("replaying the request's life…", id="detail-events")

    def show_history(self, history: RequestHistory) -> None:
        """Draw the lengths chart and list the events."""
        chart = self.query_one("#detail-chart", QuietPlot)
        over = self.query_one("#detail-over", QuietPlot)
        chart.clear()
        over.clear()
        if history.steps.shape[0]:
            chart.plot(history.steps, history.allocated, line_style="yellow", hires_mode=HiResMode.BRAILLE)
            chart.plot(history.steps, history.committed, line_style="green", hires_mode=HiResMode.BRAILLE)
            chart.set_ylimits(0, max(int(history.allocated.max()), 1) * 1.05)
            slack = history.allocated - history.committed
            over.plot(history.steps, slack, line_style="dark_orange", hires_mode=HiResMode.BRAILLE)
            over.set_ylimits(0, max(int(slack.max()), 1) * 1.1)
            over.set_xlabel("step")
        lines = [f"step {e.step:>8}  {e.kind:<18} {describe(e)}" for e in history.events[-12:]]
        note = " (the last steps only)" if history.clipped else ""
        self.query_one("#detail-events", Static).update(
            f"{history.steps.shape[0]} steps changed it{note}; events:\n" + ("\n".join(lines) or "none")
        )

    def action_close(self) -> None:
        self.dismiss(None)
