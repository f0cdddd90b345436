"""Screens (layout only): the replay dashboard, the diff of two replays, the key help,
go-to-step, request detail."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table
from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen, Screen
from textual.widgets import Input, Static
from textual_plot import HiResMode

from kvtrace.tui.widgets.dashboard import Cadence, Dashboard
from kvtrace.tui.widgets.divergence import DivergenceBanner, divergence_text
from kvtrace.tui.widgets.events_log import describe
from kvtrace.tui.widgets.explain_panel import ExplainPanel
from kvtrace.tui.widgets.keybar import KeyBar
from kvtrace.tui.widgets.occupancy import QuietPlot
from kvtrace.tui.widgets.toasts import AlertToasts

if TYPE_CHECKING:
    from kvtrace.diff.diff import DiffReport
    from kvtrace.replay.state import RequestRow
    from kvtrace.tui.driver import RequestExplanation, RequestHistory

__all__ = ["DIFF_KEYS", "KEYS", "DiffScreen", "ExplainScreen", "GotoScreen", "HelpScreen", "HoldersScreen",
           "ReplayScreen", "RequestDetailScreen"]

KEYS = (
    ("space", "play / pause"),
    ("→ / ←", "one step forward / back"),
    ("shift+→ / shift+←", "100 steps forward / back"),
    ("+ / -", "replay faster / slower"),
    ("g", "go to a step"),
    ("n / N", "next / previous event (of the kind the events log shows)"),
    ("k", "events log: next kind (all, overalloc_release, evict, …)"),
    ("P", "jump to the peak occupancy (of the pool shown)"),
    ("p", "occupancy and page map: the next pool (full, swa, mamba, host)"),
    ("o", "jump to the first OOM or violation"),
    ("m", "mute / show the OOM and violation alerts (the events log keeps all)"),
    ("T", "timeline of the top holders' allocated / used (click it: go to that step)"),
    ("x", "export the view: an SVG of the screen and the request table as CSV"),
    ("/", "filter requests: phases, live, over, held, ids, A-B"),
    ("s / r", "sort requests by the next column / reverse"),
    ("enter", "detail of the selected request (history chart)"),
    ("e", "the selected request's missed prefix by cause (--explain); j: go to its evictor"),
    ("tab", "next panel; click a row, cell or event to select it"),
    ("t", "small terminal: the other panel of each tab pair (or click a tab)"),
    ("?", "this help"),
    ("q", "quit"),
)
DIFF_KEYS = (
    ("d", "both sides to the first divergence (its request selected)"),
    ("D", "both sides to the next divergence (kvtrace diff --all N)"),
    ("tab", "the other side's panels"),
)


class _PanelsScreen(Screen):
    """A screen of dashboards: ``t`` switches their panel tabs where they are small."""

    BINDINGS = [Binding("t", "switch_tabs", "Panels", show=False)]

    def action_switch_tabs(self) -> None:
        for dash in self.query(Dashboard):
            if dash.has_class("-small"):
                dash.switch_tabs()


class ReplayScreen(_PanelsScreen):
    """The dashboard of one replay (``cadence``: how often its costliest panels are drawn
    while playing)."""

    def __init__(self, cadence: Cadence = Cadence()) -> None:
        super().__init__()
        self.cadence = cadence

    def compose(self) -> ComposeResult:
        yield Dashboard(0, cadence=self.cadence, id="side-0")
        yield AlertToasts(id="alerts")
        yield KeyBar(id="keybar")


class DiffScreen(_PanelsScreen):
    """Two replays side by side (``kvtrace diff --tui``): what the diff found, then the
    dashboards of A and B."""

    def __init__(self, report: DiffReport, cadence: Cadence = Cadence()) -> None:
        super().__init__()
        self.report = report
        self.cadence = cadence

    def compose(self) -> ComposeResult:
        yield DivergenceBanner(divergence_text(self.report, None), id="divergence")
        with Horizontal(id="sides"):
            for side, r in enumerate((self.report.a, self.report.b)):
                dash = Dashboard(side, compact=True, cadence=self.cadence, id=f"side-{side}")
                dash.border_title = f"{'AB'[side]}  {r.label}"
                yield dash
        yield AlertToasts(id="alerts")
        yield KeyBar(id="keybar")


class HelpScreen(ModalScreen[None]):
    """The key reference (with the diff's keys in a diff)."""

    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "Close")]

    def __init__(self, diff: bool = False) -> None:
        super().__init__()
        self.diff = diff

    def compose(self) -> ComposeResult:
        title = "kvtrace diff keys (both sides move together)" if self.diff else "kvtrace dashboard keys"
        table = Table(title=title, show_header=False, box=None, padding=(0, 2))
        table.add_column(style="bold cyan", no_wrap=True)
        table.add_column()
        for key, what in (DIFF_KEYS + KEYS) if self.diff else KEYS:
            table.add_row(key, what)
        # Its descriptions wrap, and it scrolls, where the terminal is too small for the table.
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
    """One request: its row, its lengths over its life (a chart), its events. In a trace with
    streaming sessions (``sessions``) a session held between turns reads "held", with the
    KV its session keeps and the step its last turn ended."""

    BINDINGS = [Binding("escape,enter,q", "close", "Close")]

    def __init__(self, row: RequestRow, side: int = 0, label: str = "", *, sessions: bool = False) -> None:
        super().__init__()
        self.row = row
        self.side = side
        self.label = label
        self.sessions = sessions

    def compose(self) -> ComposeResult:
        r = self.row
        held = self.sessions and r.phase == "finished" and r.allocated > 0  # ``RequestColumns.held``
        with Vertical(id="detail-body") as v:
            v.border_title = f"request {r.rid}" + (f" ({self.label})" if self.label else "")
            ended = f"ended at step {r.ended_step if r.ended_step >= 0 else '-'}"
            if held:
                ended = (f"its turn ended at step {r.ended_step}\n"
                         f"held: its session keeps {r.used:,} tokens of KV until its next turn")
            yield Static(
                f"phase {'held' if held else r.phase} · used {r.used:,} · allocated {r.allocated:,} · "
                f"over-allocated {r.overallocated:,} · "
                f"pages {r.pages:,} · prefix hit {r.prefix_hit:,} · admitted at step {r.admitted_step} · "
                + ended
                + ("" if r.swa_evicted is None else
                   f"\nSWA: {r.swa_len:,} tokens past the window's cursor · swa_evicted_seqlen {r.swa_evicted:,}")
                + ("" if r.mamba_slot is None else
                   f"\nMamba: state slot {r.mamba_slot if r.mamba_slot >= 0 else '- (none held)'}"),
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
            # a broken version can report used > allocated: its values go below zero, shown
            chart.set_ylimits(min(int(history.committed.min()), 0) * 1.05, max(int(history.allocated.max()), 1) * 1.05)
            slack = history.allocated - history.committed
            over.plot(history.steps, slack, line_style="dark_orange", hires_mode=HiResMode.BRAILLE)
            over.set_ylimits(min(int(slack.min()), 0) * 1.1, max(int(slack.max()), 1) * 1.1)
            over.set_xlabel("step")
        lines = [f"step {e.step:>8}  {e.kind:<18} {describe(e)}" for e in history.events[-12:]]
        note = " (the last steps only)" if history.clipped else ""
        self.query_one("#detail-events", Static).update(
            f"{history.steps.shape[0]} steps changed it{note}; events:\n" + ("\n".join(lines) or "none")
        )

    def action_close(self) -> None:
        self.dismiss(None)


HOLDER_COLOURS = ("yellow", "cyan", "magenta", "green", "bright_red")


class HoldersScreen(ModalScreen[int | None]):
    """The requests holding most of the pool at the step shown, each one's allocated
    (solid) and used (dotted) tokens over its life; a click on the chart closes it at
    that step (the dashboard seeks there)."""

    BINDINGS = [Binding("escape,q,T", "close", "Close")]

    def __init__(self, rids: list[int], step: int | None, side: int = 0) -> None:
        super().__init__()
        self.rids = rids
        self.step = step
        self.side = side
        self.histories: dict[int, RequestHistory] = {}

    def compose(self) -> ComposeResult:
        with Vertical(id="holders-body") as v:
            v.border_title = f"top {len(self.rids)} holders at step {self.step}: allocated (━) and used (·)"
            yield QuietPlot(id="holders-chart")
            yield Static("replaying their lives…", id="holders-key")

    def show_history(self, history: RequestHistory) -> None:
        """Add one holder's lengths (the others' stay)."""
        if history.rid not in self.rids:
            return
        self.histories[history.rid] = history
        chart = self.query_one("#holders-chart", QuietPlot)
        chart.clear()
        top = 1
        key = Text()
        for i, rid in enumerate(self.rids):
            h = self.histories.get(rid)
            colour = HOLDER_COLOURS[i % len(HOLDER_COLOURS)]
            key.append("━ ", style=colour)
            key.append(f"rid {rid}" + ("" if h is not None else " (…)") + "   ")
            if h is None or not h.steps.shape[0]:
                continue
            chart.plot(h.steps, h.allocated, line_style=colour, hires_mode=HiResMode.BRAILLE)
            chart.scatter(h.steps, h.committed, marker_style=colour, marker="·")
            top = max(top, int(h.allocated.max()))
        chart.set_ylimits(0, top * 1.05)
        chart.set_xlabel("step (click: go there)")
        if self.step is not None:
            chart.add_v_line(self.step, "bold white")
        self.query_one("#holders-key", Static).update(key)

    def on_click(self, event: events.Click) -> None:
        chart = self.query_one("#holders-chart", QuietPlot)
        canvas = chart.query_one("#plot")
        x = event.screen_x - canvas.region.x
        y = event.screen_y - canvas.region.y
        if not self.histories or not (0 <= x < canvas.region.width and 0 <= y < canvas.region.height):
            return
        step, _ = chart.get_coordinate_from_pixel(x, y)
        self.dismiss(max(int(round(step)), 0))

    def action_close(self) -> None:
        self.dismiss(None)


class ExplainScreen(ModalScreen["tuple[int, int] | None"]):
    """The selected request's missed prefix tokens by cause (an ``ExplainPanel``); ``j``
    closes it at the eviction that cost the request most: ``(step, evicting request)``,
    where the dashboard goes."""

    BINDINGS = [
        Binding("j", "jump", "Go to the eviction"),
        Binding("escape,q,e", "close", "Close"),
    ]

    def __init__(self, rid: int, side: int = 0) -> None:
        super().__init__()
        self.rid = rid
        self.side = side

    def compose(self) -> ComposeResult:
        with Vertical(id="explain-body") as v:
            v.border_title = f"why request {self.rid} missed"
            v.border_subtitle = "j: go to the eviction · esc: close"
            yield ExplainPanel(id="explain-panel")

    def show(self, explanation: RequestExplanation) -> None:
        """Show the replay's answer."""
        self.query_one(ExplainPanel).show(explanation)

    def action_jump(self) -> None:
        target = self.query_one(ExplainPanel).jump_target
        if target is None:
            self.notify("nothing this request missed was evicted", timeout=3)
            return
        self.dismiss(target)

    def action_close(self) -> None:
        self.dismiss(None)
