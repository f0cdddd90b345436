"""One replay's panels: header, occupancy chart and legend, page map, requests, events.

The replay screen shows one ``Dashboard``; the diff screen shows two side by side
(``compact``: no legend beside the chart, a smaller page map). ``show`` routes a frame
to every panel.

Where the dashboard is small (``is_small``: an 80x24 terminal, or a diff's half of a small
one) the panels side by side would be too narrow to show anything (the chart gave all its
width to its legend, the events only their kind, a diff's tables no row): each pair becomes
tabs instead (occupancy | page map above, requests | events below), one panel shown at the
full width, the other a click (or ``t``) away.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual import events
from textual.widgets import Input, Static, Tab, Tabs

from kvtrace.tui.widgets.events_log import EventsLog
from kvtrace.tui.widgets.header import ReplayHeader, sessions_text
from kvtrace.tui.widgets.occupancy import OccupancyChart, OccupancyLegend
from kvtrace.tui.widgets.page_map import PageMap, PageMapLegend, mamba_slots_text
from kvtrace.tui.widgets.request_table import RequestTable

if TYPE_CHECKING:
    from rich.text import Text

    from kvtrace.tui.driver import Frame
    from kvtrace.tui.remote.sources import SourceInfo

__all__ = ["Cadence", "Dashboard", "PanelTabs", "is_small", "side_numbers"]


class PanelTabs(Tabs, can_focus=False):
    """A small dashboard's tabs: clicked, or switched with ``t``; never focused, so that
    ← and → keep stepping the replay."""


def is_small(width: int, height: int, compact: bool) -> bool:
    """Whether a dashboard of ``width`` x ``height`` cells shows its panels as tabs
    (``compact``: a diff's side, whose chart has no legend beside it)."""
    if compact:
        return width < 56 or height < 34
    return width < 110 or height < 30


class Cadence(NamedTuple):
    """How often the costliest panels are drawn while the replay plays (every frame
    otherwise). At full speed each frame brings a new stretch of the chart and a screenful
    of new events: the events log, scrolled at every frame, is a large share of the screen's
    frame (bench/tui.py; bench/RESULTS.md), which two cores pay for in replay time. The
    legend's numbers change at every frame too: drawn at every frame they make Textual
    paint the widgets around them again (twice the widgets a frame). A frame with an OOM,
    a violation or an impossible op shows the log at once."""

    chart_s: float = 1.0  # the occupancy chart
    events_s: float = 0.25  # the events log, scrolled to its newest event
    legend_s: float = 0.25  # the occupancy legend's numbers


def side_numbers(frame: Frame, pool: int = 0) -> str:
    """One line of a diff side's occupancy (it has no legend beside its chart): used,
    over-allocated, session held (a trace with streaming sessions), cached locked and
    evictable, free, and the peak (pool ``pool``); the Mamba pool's in slots: held,
    checkpoints, free."""
    pools = (frame.pool, *frame.other_pools)
    index = pool if pool < len(pools) else 0
    p = pools[index]
    if p is None:
        return ""
    total = max(p.pool_tokens, 1)
    if index < len(frame.pool_names) and frame.pool_names[index] == "mamba":
        text = (f"slots held {p.committed:,} ({100 * p.committed / total:.1f}%) · "
                f"checkpoints {p.evictable + p.protected:,} · free {p.available:,} of {p.pool_tokens:,}")
    else:
        held = f"session held {p.session_held:,} · " if getattr(frame, "sessions", False) else ""
        text = (f"used {p.used_tokens:,} ({100 * p.used_tokens / total:.1f}%) · over {p.overallocated:,} · {held}"
                f"locked {p.protected:,} · evictable {p.evictable:,} · free {p.available:,}")
    peak = frame.peak(pool)
    return text + (f" · peak {peak[1]:,} @ {peak[0]:,}" if peak is not None else "")


class Dashboard(Vertical):
    """The panels of one replay (side ``side``).

    Args:
        side: which replay it shows (0; a diff: 0 for A, 1 for B).
        compact: the diff's layout (half a screen wide).
        cadence: how often the chart, the legend and the events log are drawn while playing.
    """

    def __init__(self, side: int = 0, *, compact: bool = False, cadence: Cadence = Cadence(), id: str | None = None) -> None:
        super().__init__(id=id, classes="compact" if compact else None)
        self.side = side
        self.compact = compact
        self.cadence = cadence
        self.frame: Frame | None = None
        self._info: SourceInfo | None = None
        self._drawn_at: dict[str, float] = {}  # a cadence's field -> when its panel was last drawn

    def compose(self) -> ComposeResult:
        yield ReplayHeader(id="header")
        yield PanelTabs(Tab("occupancy", id="tab-occupancy"), Tab("page map", id="tab-pages"), id="top-tabs")
        with Horizontal(id="top"):
            with Vertical(id="occupancy", classes="panel") as v:
                v.border_title = "occupancy"
                with Horizontal():
                    yield OccupancyChart(id="chart")
                    if not self.compact:
                        yield OccupancyLegend(id="legend")
            with Vertical(id="pages", classes="panel") as v:
                v.border_title = "page map"
                yield PageMap(id="pagemap")
                yield PageMapLegend(id="pagemap-legend")
                yield Static("click a cell to see its pages and owners", id="cell-info")
        yield PanelTabs(Tab("requests", id="tab-requests"), Tab("events", id="tab-events"), id="bottom-tabs")
        with Horizontal(id="bottom"):
            with Vertical(id="requests", classes="panel") as v:
                v.border_title = "requests"
                yield RequestTable(id="table")
                yield Input(placeholder="filter: phases, live, over, held, ids, A-B (enter applies, esc closes)", id="filter")
            with Vertical(id="events", classes="panel") as v:
                v.border_title = "events"
                yield EventsLog(id="events-log")

    def show_filter(self, text: str) -> None:
        """Name the request filter in force on the requests panel and its tab (none: the
        plain title), so a table showing some requests is not read as all of them."""
        title = f"requests · filter: {text}" if text else "requests"
        self.query_one("#requests").border_title = title
        self.query_one("#tab-requests", Tab).label = "requests (filtered)" if text else "requests"

    def on_resize(self, event: events.Resize) -> None:
        self.set_class(is_small(event.size.width, event.size.height, self.compact), "-small")

    def on_tabs_tab_activated(self, event: Tabs.TabActivated) -> None:
        event.stop()
        if event.tabs.id == "top-tabs":
            self.set_class(event.tab.id == "tab-pages", "-top-pages")
        else:
            self.set_class(event.tab.id == "tab-events", "-bottom-events")

    def switch_tabs(self) -> None:
        """Show the other panel of each pair (a small dashboard's ``t``)."""
        for tabs in self.query(PanelTabs):
            tabs.action_next_tab()

    def set_info(self, info: SourceInfo) -> None:
        """Say where the replay comes from (a state log has no slot positions)."""
        if not info.live:
            self.query_one("#pages").border_title = "pool by state (a log has no slot positions)"

    def show(self, frame: Frame, info: SourceInfo, now: float) -> None:
        """Draw ``frame`` in every panel (while playing, the chart, the legend and the
        events log at the ``cadence``; ``now``: the app's clock)."""
        self.frame = frame
        self._info = info
        header = self.query_one(ReplayHeader)
        hybrid = bool(frame.other_pools)
        header.set_class(hybrid, "-pools")
        header.show(info, frame, frame.pool_names[self.pool] if hybrid else None)
        if hybrid:
            occupancy = self.query_one("#occupancy")
            title = f"occupancy · {frame.pool_names[self.pool]} pool"
            if occupancy.border_title != title:
                occupancy.border_title = title
            pages_panel = self.query_one("#pages")
            mapped = frame.pool_names[frame.page_map_pool]  # the pool of the cells drawn (the next map may be another's)
            title = f"page map · {mapped} pool" if info.live else f"{mapped} pool by state (no positions)"
            if mapped == "mamba" and frame.requests.mamba_slot is not None:
                title = "state slots · mamba pool"  # no pages: which request holds which slot
            if pages_panel.border_title != title:
                pages_panel.border_title = title
        elif info.sessions and frame.requests is not None:  # sessions: a full-attention trace's
            occupancy = self.query_one("#occupancy")
            title = f"occupancy · {sessions_text(frame).plain}"
            if occupancy.border_title != title:
                occupancy.border_title = title
        if not self.compact and self._due("legend_s", frame, now):
            self.query_one(OccupancyLegend).show(frame)
        elif self.compact:  # a diff's side has no legend: its numbers under the chart
            numbers = side_numbers(frame, self.pool)
            occupancy = self.query_one("#occupancy")
            if occupancy.border_subtitle != numbers:
                occupancy.border_subtitle = numbers
        self.query_one(RequestTable).show(frame)
        if self._due("events_s", frame, now, urgent=bool(frame.alerts)):
            self.query_one(EventsLog).show(frame)
        pages = self.query_one(PageMap)
        pages.show(frame.page_cells)
        slots = self._mamba_slots(frame)
        self.query_one("#pages").set_class(slots is not None, "-slots")
        if slots is not None:  # the Mamba pool has no pages: its slots and their requests instead
            self.query_one("#cell-info", Static).update(slots)
        elif frame.page_map_note is not None:
            self.query_one("#cell-info", Static).update(frame.page_map_note)
        chart = self.query_one(OccupancyChart)
        if self._due("chart_s", frame, now, urgent=chart.shown_step is None):
            chart.show(frame)

    def _mamba_slots(self, frame: Frame) -> Text | None:
        """The text of the Mamba pool's slots when the page map panel shows that pool (and
        the frames carry the requests' slots), else None."""
        names = frame.pool_names
        if frame.requests is None or frame.requests.mamba_slot is None or frame.page_map_pool >= len(names) \
                or names[frame.page_map_pool] != "mamba":
            return None
        pool = frame.pools.get("mamba")
        if pool is None:
            return None
        cached = getattr(pool, "cached_checkpoints", None)
        cached = pool.evictable + pool.protected if cached is None else int(cached)
        return mamba_slots_text(frame.requests.mamba_slot, pool.pool_tokens, cached,
                                self.query_one("#cell-info").content_size.width or None)

    def _due(self, panel: str, frame: Frame, now: float, urgent: bool = False) -> bool:
        """Whether the panel whose cadence is the field ``panel`` of ``Cadence`` is drawn
        for ``frame`` (paused, ``urgent``, or its interval past while playing); when it is,
        ``now`` is noted as its last draw."""
        if frame.playing and not urgent and now - self._drawn_at.get(panel, -1e18) < getattr(self.cadence, panel):
            return False
        self._drawn_at[panel] = now
        return True

    @property
    def pool(self) -> int:
        """The pool the occupancy panel shows (an index into the frame's ``pool_names``)."""
        return self.query_one(OccupancyChart).pool

    def cycle_pool(self) -> bool:
        """Show the next KV pool in the occupancy panel (``p``); the page map follows once
        the replay maps that pool (the app asks it to: ``pool``). False for a replay of one pool."""
        frame = self.frame
        if frame is None or not frame.other_pools:
            return False
        index = (self.pool + 1) % (1 + len(frame.other_pools))
        self.query_one(OccupancyChart).pool = index
        for legend in self.query(OccupancyLegend):
            legend.pool = index
        self.query_one("#occupancy").border_title = f"occupancy · {frame.pool_names[index]} pool"
        page_map = self.query_one(PageMap)
        if page_map.selected_cell is not None:  # a cell of the other pool's map
            page_map.select_cell(None)
            self.query_one("#cell-info", Static).update("click a cell to see its pages and owners")
        if self._info is not None:
            self.query_one(ReplayHeader).show(self._info, frame, frame.pool_names[index])
        for legend in self.query(OccupancyLegend):
            legend.show(frame)
        self.query_one(OccupancyChart).show(frame)
        return True

    def mark(self, label: str, step: int | None, colour: str) -> None:
        """Mark ``step`` on the occupancy chart (None: remove the mark)."""
        chart = self.query_one(OccupancyChart)
        if step is None:
            chart.marks.pop(label, None)
        else:
            chart.marks[label] = (step, colour)
        if self.frame is not None:
            chart.show(self.frame)
