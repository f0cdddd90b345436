"""The page map: the pool as a grid, one cell per group of pages, coloured by the state
holding most of its slots; the selected request's cells stand out (the pages it owns,
and, drawn apart, the cached prefix pages it pins through its radix lock); clicking a
cell asks for its pages and owners."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import events
from textual.message import Message
from textual.strip import Strip
from textual.widget import Widget
from textual.widgets import Static

from allocator.ownership import SlotState
from kvtrace.tui.remote.pagemap import STATE_LABELS

if TYPE_CHECKING:
    from kvtrace.tui.remote.pagemap import PageCells

__all__ = ["SESSION_COLOR", "STATE_COLORS", "PageMap", "PageMapLegend", "legend", "mamba_slots_text"]

# The streaming sessions' KV held between turns (the occupancy band, the table's "held").
SESSION_COLOR = "dark_cyan"
STATE_COLORS = {
    SlotState.FREE: "grey23",
    SlotState.COMMITTED: "green",
    SlotState.OVERALLOCATED: "yellow",
    SlotState.PAGE_TAIL: "dark_khaki",
    SlotState.CACHED_EVICTABLE: "dodger_blue2",
    SlotState.CACHED_LOCKED: "purple",
    SlotState.RESERVED: "grey50",
    SlotState.UNOWNED: "bright_red",
}
_STYLES = {s: Style(color=c) for s, c in STATE_COLORS.items()}
_HIGHLIGHT = Style(color="bright_white", bgcolor="magenta", bold=True)
_PINNED = Style(color="bright_magenta", bgcolor="grey19")
_SELECTED = Style(color="black", bgcolor="bright_white", bold=True)
HIGHLIGHT_CHAR = "▒"  # a cell holding a page the selected request owns
PINNED_CHAR = "░"  # a cell holding only pages it pins through its radix lock
# the keys of the selection's marks, after the states'
MARKS = ((HIGHLIGHT_CHAR, _HIGHLIGHT, "selected"), (PINNED_CHAR, _PINNED, "pinned by it"))


def legend(states: tuple[SlotState, ...] = tuple(SlotState), width: int | None = None,
           marks: tuple[tuple[str, Style, str], ...] = MARKS) -> Text:
    """The colour key, an entry per state (leaked pages included) then the selection's
    ``marks`` (char, style, label), wrapped between entries to ``width`` cells (None:
    one line): a wrap inside an entry left a colour at a line's end and its name on the
    next."""
    entries = [("█", Style(color=STATE_COLORS[s]), STATE_LABELS[s]) for s in states] + list(marks)
    text = Text()
    used = 0
    for char, style, label in entries:
        entry = 2 + len(label)
        if used and width is not None and used + 2 + entry > width:
            text.append("\n")
            used = 0
        elif used:
            text.append("  ")
            used += 2
        text.append(char, style=style)
        text.append(" " + label)
        used += entry
    return text


def mamba_slots_text(slots: np.ndarray, total: int, cached: int = 0, width: int | None = None) -> Text:
    """The Mamba pool in place of a page map (it has no pages): which request holds which
    state slot, then the slots the radix cache's checkpoints hold and the free ones.

    Args:
        slots: int64, per request id, its state slot (-1: none; ``RequestColumns.mamba_slot``).
        total: the pool's slots.
        cached: slots holding checkpointed states (not a request's).
        width: wrap the list between its entries to this many cells (None: one line).
    """
    rids = np.flatnonzero(slots >= 0)
    order = rids[np.argsort(slots[rids], kind="stable")]
    text = Text("the mamba pool has no pages: a state slot per running request\n")
    used = 0
    for i, rid in enumerate(order.tolist()):
        slot, owner = f"slot {int(slots[rid])}", f" rid {rid}"
        entry = len(slot) + len(owner)
        if i and width is not None and used + 3 + entry > width:  # a wrap inside an entry would split it
            text.append("\n")
            used = 0
        elif i:
            text.append(" · ")
            used += 3
        text.append(slot, style=_STYLES[SlotState.COMMITTED])
        text.append(owner)
        used += entry
    held = int(order.shape[0])
    text.append("\n" if held else "")
    text.append(f"{held} held by requests", style="bold")
    if cached:
        text.append(f" · {cached} checkpoints")
    text.append(f" · {max(total - held - cached, 0)} free of {total}")
    return text


class PageMapLegend(Static):
    """The page map's colour key, wrapped to the width it is given."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(legend(), id=id)

    def on_resize(self, event: events.Resize) -> None:
        self.update(legend(width=self.content_size.width))


class PageMap(Widget):
    """A grid of ``PageCells``, one character per cell, row by row."""

    class Resized(Message):
        """The map now has room for ``num_cells`` cells."""

        def __init__(self, page_map: PageMap, num_cells: int) -> None:
            super().__init__()
            self.page_map = page_map
            self.num_cells = num_cells

        @property
        def control(self) -> PageMap:
            return self.page_map

    class CellClicked(Message):
        """The user clicked cell ``index``."""

        def __init__(self, page_map: PageMap, index: int) -> None:
            super().__init__()
            self.page_map = page_map
            self.index = index

        @property
        def control(self) -> PageMap:
            return self.page_map

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.cells: PageCells | None = None
        self.selected_cell: int | None = None
        self._chars: list[tuple[str, Style]] = []
        self._lines: dict[tuple[int, int], Strip] = {}  # (y, width) -> the line drawn

    def show(self, cells: PageCells | None) -> None:
        """Draw ``cells`` (None: nothing to draw yet)."""
        if cells is self.cells:
            return
        self.cells = cells
        self._chars = []
        if cells is not None:
            dominant = cells.dominant.tolist()
            marked = cells.highlight.tolist()
            pinned = [False] * len(marked) if cells.pinned is None else cells.pinned.tolist()
            self._chars = [(HIGHLIGHT_CHAR, _HIGHLIGHT) if hot else (PINNED_CHAR, _PINNED) if pin
                           else ("█", _STYLES[SlotState(d)]) for d, hot, pin in zip(dominant, marked, pinned)]
        self._lines = {}
        self.refresh()

    def select_cell(self, index: int | None) -> None:
        """Mark cell ``index`` as the one clicked (None: none)."""
        self.selected_cell = index
        self._lines = {}
        self.refresh()

    @property
    def num_cells(self) -> int:
        return self.size.width * self.size.height

    def on_resize(self, event: events.Resize) -> None:
        if self.num_cells:
            self.post_message(self.Resized(self, self.num_cells))

    def cell_at(self, x: int, y: int) -> int | None:
        """The cell index drawn at (x, y), if any."""
        index = y * self.size.width + x
        return index if 0 <= x < self.size.width and 0 <= index < len(self._chars) else None

    def on_click(self, event: events.Click) -> None:
        index = self.cell_at(event.x, event.y)
        if index is not None:
            self.selected_cell = index
            self._lines = {}
            self.refresh()
            self.post_message(self.CellClicked(self, index))

    def render_line(self, y: int) -> Strip:
        key = (y, self.size.width)
        line = self._lines.get(key)
        if line is None:
            line = self._lines[key] = self._render_line(y)
        return line

    def _render_line(self, y: int) -> Strip:
        width = self.size.width
        start = y * width
        row = list(self._chars[start : start + width])
        sel = self.selected_cell
        if sel is not None and start <= sel < start + len(row):
            row[sel - start] = ("◆", _SELECTED)
        segments: list[Segment] = []
        for char, style in row:  # one segment per run of a style
            if segments and segments[-1].style is style:
                segments[-1] = Segment(segments[-1].text + char, style)
            else:
                segments.append(Segment(char, style))
        if len(row) < width:
            segments.append(Segment(" " * (width - len(row))))
        return Strip(segments, width)
