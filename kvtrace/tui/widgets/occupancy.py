"""Occupancy over time: the pool stacked by state (committed, over-allocated, cached
locked, cached evictable, free) step by step, drawn with textual-plot, the peak and
the current step marked; beside it the current values with percentages.

The chart spans every step replayed so far (the timeline is append-only), one bar
per column of the plot: each column shows the step of highest use in its range, so
no peak is lost to downsampling. ``marks`` adds labelled vertical lines (a diff view
marks its divergence step with one). A hybrid model's replay has a pool per attention
kind (``POOL_NAMES``): chart and legend show one of them, ``pool`` (the dashboard's ``p``
cycles it). The Mamba pool counts state slots, not tokens: its legend names its bands as
slots (held by requests; the radix cache's checkpointed states, when it keeps any). A trace
with streaming sessions adds a band above committed: the KV sessions hold between their
turns (``SESSION_BAND``); any other trace's chart and legend have none.

Where the panel is shorter than the legend (an 80x24 terminal; a hybrid model's header
takes a row more), the legend gives the peak's step on the peak's line instead of a line
of its own.
"""

from __future__ import annotations

from math import ceil, floor, log10
from typing import TYPE_CHECKING

import numpy as np
from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.containers import Grid
from textual.geometry import Region
from textual.strip import Strip
from textual_hires_canvas import Canvas
from textual_plot import PlotWidget
from textual_plot.axis_formatter import NumericAxisFormatter
from textual_plot.plot_widget import Legend

from allocator.ownership import SlotState
from kvtrace.tui.widgets.page_map import SESSION_COLOR, STATE_COLORS
from kvtrace.tui.widgets.text_lines import TextLines

if TYPE_CHECKING:
    from allocator.base import PoolCounters
    from kvtrace.replay.state import Timeline
    from kvtrace.tui.driver import Frame

__all__ = ["BANDS", "HOST_LABELS", "MAMBA_LABELS", "SESSION_BAND", "OccupancyChart", "OccupancyLegend", "QuietPlot", "StepsFormatter",
           "bands", "column_samples", "legend_lines"]

# (label, PoolCounters field, colour), bottom to top
BANDS = (
    ("committed", "committed", STATE_COLORS[SlotState.COMMITTED]),
    ("over-allocated", "overallocated", STATE_COLORS[SlotState.OVERALLOCATED]),
    ("cached locked", "protected", STATE_COLORS[SlotState.CACHED_LOCKED]),
    ("cached evictable", "evictable", STATE_COLORS[SlotState.CACHED_EVICTABLE]),
    ("free", "available", STATE_COLORS[SlotState.FREE]),
)

# Streaming sessions: KV a session holds between its turns (no running request's, not cached).
SESSION_BAND = ("session held", "session_held", SESSION_COLOR)


def bands(sessions: bool = False) -> tuple[tuple[str, str, str], ...]:
    """The chart's bands, bottom to top: ``BANDS``, with ``SESSION_BAND`` above committed for
    a trace with streaming sessions (``sessions``)."""
    return (BANDS[0], SESSION_BAND, *BANDS[1:]) if sessions else BANDS


# The Mamba pool's names for the same bands: a request holds a state slot (nothing is
# over-allocated), and the radix cache keeps checkpointed states ("ckpt") in slots of its own.
MAMBA_LABELS = {"committed": "held", "overallocated": "over-allocated", "protected": "ckpt locked",
                "evictable": "ckpt evictable", "available": "free"}

# HiCache's host pool's names for the bands: requests hold no host slot (nothing committed
# or over-allocated); a host copy is of a prefix also on the device (locked or in flight
# too: host eviction cannot free it) or of one only on the host (what host eviction frees).
HOST_LABELS = {"protected": "also on device", "evictable": "host only", "available": "free"}


def column_samples(timeline: Timeline, size: int, columns: int, pool: int = 0) -> np.ndarray:
    """Indices into the timeline's first ``size`` rows: per column, the row of highest use
    (of pool ``pool``, an index into ``POOL_NAMES``)."""
    if size <= columns:
        return np.arange(size)
    used = timeline.used_tokens(size, pool)
    edges = np.linspace(0, size, columns + 1).astype(np.int64)
    return np.array([lo + int(np.argmax(used[lo:hi])) for lo, hi in zip(edges[:-1], edges[1:]) if hi > lo])


class _TokensFormatter(NumericAxisFormatter):
    """Axis ticks as 920k / 1.2M."""

    def get_labels_for_ticks(self, ticks: list[float]) -> list[str]:  # noqa: D102
        return [_short(t) for t in ticks]


class StepsFormatter(NumericAxisFormatter):
    """Step ticks as 20k / 1.2M, a round interval (1, 2 or 5 times a power of ten) wide
    enough for their labels to stand apart on ``columns`` cells (the plot's default put
    seven five-digit labels on 24 cells: '100200030040050060070000')."""

    def __init__(self) -> None:
        super().__init__()
        self.columns = 80  # the plot's width in cells (``QuietPlot`` keeps it)

    def get_ticks_and_labels(self, min_: float, max_: float, max_ticks: int = 8) -> tuple[list[float], list[str]]:
        span = max(max_ - min_, 1e-9)
        power = 10.0 ** floor(log10(span / max_ticks)) if span > max_ticks else 1.0
        while True:
            for m in (1, 2, 5):
                interval = m * power
                first = ceil(min_ / interval) * interval
                ticks = [first + k * interval for k in range(int((max_ - first) // interval) + 1)]
                labels = self.get_labels_for_ticks(ticks)
                apart = self.columns * interval / span  # cells from one tick to the next
                if len(ticks) <= 1 or (len(ticks) <= max_ticks and apart >= max(map(len, labels)) + 1):
                    return ticks, labels
            power *= 10

    def get_labels_for_ticks(self, ticks: list[float]) -> list[str]:  # noqa: D102
        return [_short(t) for t in ticks]


def _short(value: float) -> str:
    v = abs(value)
    if v >= 1e6:
        return f"{value / 1e6:.3g}M"
    if v >= 1e3:
        return f"{value / 1e3:.3g}k"
    return f"{value:.0f}"


class _CachedCanvas(Canvas):
    """A plot canvas that keeps its drawn lines until it changes: the screen redraws the
    box around whatever changed, and a chart inside that box need not be drawn again."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self._strips: dict[int, Strip] = {}

    def refresh(self, *regions: Region, **kw: bool) -> _CachedCanvas:  # type: ignore[override]
        self._strips = {}
        return super().refresh(*regions, **kw)  # type: ignore[return-value]

    def notify_style_update(self) -> None:
        self._strips = {}
        super().notify_style_update()

    def render_line(self, y: int) -> Strip:
        strip = self._strips.get(y)
        if strip is None:
            strip = self._strips[y] = super().render_line(y)
        return strip


class QuietPlot(PlotWidget, can_focus=False, inherit_bindings=False):
    """A plot that takes no keys and no focus (the dashboard's keys stay the dashboard's)
    and draws its canvases from a cache."""

    BINDINGS = []

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, allow_pan_and_zoom=False)
        self.steps = StepsFormatter()  # its x axis is steps
        self.set_x_formatter(self.steps)

    def on_resize(self, event: events.Resize) -> None:
        self.steps.columns = max(event.size.width - self.margin_left, 8)

    def compose(self) -> ComposeResult:
        # PlotWidget's own layout, with caching canvases.
        with Grid():
            for canvas_id in ("margin-top", "margin-left", "plot", "margin-bottom"):
                yield _CachedCanvas(1, 1, id=canvas_id)
        yield Legend(id="legend")


class OccupancyChart(QuietPlot):
    """The stacked occupancy chart."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.marks: dict[str, tuple[int, str]] = {}  # label -> (step, colour)
        self.shown_step: int | None = None
        self.pool = 0  # the pool shown (an index into POOL_NAMES)

    def on_mount(self) -> None:
        self.set_y_formatter(_TokensFormatter())
        self.set_xlabel("step")

    def show(self, frame: Frame) -> None:
        """Draw the timeline of ``frame`` (its pool ``self.pool``) with its step marked."""
        timeline, size = frame.timeline, frame.timeline_size
        self.shown_step = frame.step
        self.clear()
        pool_index = self.pool if self.pool < timeline.num_pools else 0
        if size == 0:
            return
        idx = column_samples(timeline, size, max(self.size.width - 10, 8), pool_index)
        steps = timeline.steps[idx].astype(np.float64)
        width = float(max((steps[-1] - steps[0]) / max(len(steps) - 1, 1), 1.0))
        pool = int(timeline.column("pool_tokens", size, pool_index).max())
        # Bars are drawn in whole cells: a band thinner than a row (an EAGLE replay's
        # over-allocation, a small share of its pool) would vanish into the one below. A nonzero band
        # is drawn at least a row thick; the legend beside gives the exact numbers.
        rows = self.query_one("#plot").size.height
        least = pool / rows if rows > 0 else 0.0
        stacked = np.zeros(len(idx), np.float64)
        tops = []
        for _, field, colour in bands(frame.sessions):
            band = timeline.column(field, size, pool_index)[idx].astype(np.float64)
            stacked = stacked + np.where(band > 0, np.maximum(band, least), 0.0)
            tops.append((np.minimum(stacked, pool), colour))
        for top, colour in reversed(tops):  # tallest first: each band drawn over the one above
            self.bar(steps, top, width=width, bar_style=colour)
        self.set_ylimits(0, pool)
        self.set_xlimits(float(steps[0]) - width / 2, float(steps[-1]) + width / 2)
        peak = frame.peak(pool_index)
        if peak is not None:
            self.add_v_line(peak[0], "bold red")
        for step, colour in self.marks.values():
            self.add_v_line(step, colour)
        if frame.step is not None:
            self.add_v_line(frame.step, "bold white")


class OccupancyLegend(TextLines):
    """Current occupancy by state, with percentages, and the peak so far (of pool ``pool``,
    an index into ``POOL_NAMES``)."""

    pool = 0
    _frame: Frame | None = None

    def on_resize(self, event: events.Resize) -> None:
        if self._frame is not None:  # the legend's lines depend on its height
            self.show(self._frame)

    def show(self, frame: Frame) -> None:
        self._frame = frame
        pools = (frame.pool, *frame.other_pools)
        index = self.pool if self.pool < len(pools) else 0
        pool = pools[index]
        if pool is None:
            self.set_lines([Text("no step replayed yet")])
            return
        names = frame.pool_names
        self.set_lines(legend_lines(pool, frame.peak(index), names[index] if index < len(names) else "full",
                                    sessions=frame.sessions, rows=self.size.height or None))


def legend_lines(pool: PoolCounters, peak: tuple[int, int] | None, name: str = "full", *,
                 sessions: bool = False, rows: int | None = None) -> list[Text]:
    """The legend: one line per band (``bands(sessions)``), then used, the peak and the
    running requests; where that is more lines than ``rows`` (None: no bound), the peak's
    step goes on the peak's line ('peak @865') instead of one of its own. The
    Mamba pool (``name`` "mamba") counts slots: its bands are named by ``MAMBA_LABELS``,
    its over-allocated band (always empty) is left out, its checkpoint bands and a line
    of its cached checkpoints (``cached_checkpoints`` where the counters carry it, else
    the tree's evictable + locked slots) come when it has any (a replay with the radix
    cache off has none: the legend keeps to what a short panel shows). HiCache's host
    pool (``name`` "host") holds prefix copies, no request's KV: its bands are named by
    ``HOST_LABELS``, its committed and over-allocated bands (always empty) left out."""
    total = max(pool.pool_tokens, 1)
    mamba = name == "mamba"
    host = name == "host"
    cached = 0
    if mamba:
        named = getattr(pool, "cached_checkpoints", None)
        cached = pool.evictable + pool.protected if named is None else int(named)
    lines = []
    for label, field, colour in reversed(bands(sessions and not mamba)):
        value = getattr(pool, field)
        if host:
            if field not in HOST_LABELS:
                continue
            label = HOST_LABELS[field]
        if mamba:
            if field == "overallocated" and not value:
                continue
            if field in ("evictable", "protected") and not (cached or pool.evictable or pool.protected):
                continue
            label = MAMBA_LABELS[field]
        lines.append(Text.assemble(("█ ", colour), f"{label:<17}{value:>10,} {100 * value / total:6.1f}%"))
    if mamba:
        if cached:
            lines.append(Text(f"{'cached ckpts':<19}{cached:>10,} {100 * cached / total:6.1f}%"))
    used = pool.used_tokens
    lines.append(Text(f"{'used slots' if mamba else 'used':<19}{used:>10,} {100 * used / total:6.1f}%", style="bold"))
    short = rows is not None and len(lines) + (3 if peak is not None else 1) > rows
    if peak is not None:
        at = f" @{peak[0]:,}" if short else ""
        lines.append(Text.assemble(("peak", "bold red"), (at, "red"),
                                   f"{'':<{max(15 - len(at), 0)}}{peak[1]:>10,} {100 * peak[1] / total:6.1f}%"))
        if not short:
            lines.append(Text(f"{'  at step':<19}{peak[0]:>10,}", style="red"))
    if not host:  # no request holds a host slot
        lines.append(Text(f"{'running':<19}{pool.running_requests:>10,}"))
    return lines
