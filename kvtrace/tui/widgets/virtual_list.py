"""A virtualised list with a pinned header line and a cursor (base of the request table
and the events log): only the rows on screen are rendered, so 12,000 rows scroll as
fast as 12."""

from __future__ import annotations

from math import ceil

from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding
from textual.geometry import Region, Size
from textual.scroll_view import ScrollView
from textual.scrollbar import ScrollBar
from textual.strip import Strip

__all__ = ["VirtualList", "cells"]


class VirtualList(ScrollView, can_focus=True, inherit_bindings=False):
    """Rows ``0..num_rows`` drawn by ``render_row``; line 0 is the header (``render_header``).

    Subclasses set ``num_rows`` (then ``refresh_rows()``) and implement the two render
    methods; ``cursor`` is the selected row (-1: none); ``on_cursor_moved`` and
    ``on_activated`` (enter, or a click on the selected row) are the hooks.
    """

    DEFAULT_CSS = """
    VirtualList {
        overflow-x: hidden;  /* rows fit the width: no horizontal scrolling */
    }
    """

    BINDINGS = [
        Binding("up", "cursor(-1)", "Up", show=False),
        Binding("down", "cursor(1)", "Down", show=False),
        Binding("pageup", "cursor(-20)", "Page up", show=False),
        Binding("pagedown", "cursor(20)", "Page down", show=False),
        Binding("home", "cursor_to(0)", "First", show=False),
        Binding("end", "cursor_to(-1)", "Last", show=False),
    ]

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.num_rows = 0
        self.cursor = -1
        # What is on screen: ((top row, width, view_signature()), [(row signature, cursor
        # on it) per line]); None: unknown (the next refresh_rows redraws every line).
        self._drawn: tuple[tuple[int, int, object], list[tuple[object, bool]]] | None = None
        self._base: Style | None = None  # rich_style, cached (computing it per line is slow)

    # ------------------------------------------------------------------ subclass hooks
    def render_header(self, width: int) -> Strip:
        return Strip.blank(width)

    def render_row(self, index: int, width: int, selected: bool) -> Strip:
        return Strip.blank(width)

    def view_signature(self) -> object:
        """A value that changes whenever every line would look different (the header,
        a scale the rows share); None: always redraw every line."""
        return None

    def row_signatures(self, start: int, stop: int) -> list[object] | None:
        """One value per row ``start .. stop - 1`` that changes whenever the row would look
        different (the cursor aside: the list adds it); None: redraw every line.
        ``refresh_rows`` redraws only the lines whose value changed."""
        return None

    def on_cursor_moved(self, index: int) -> None:
        """The cursor moved to ``index`` (by key or mouse)."""

    def on_activated(self, index: int) -> None:
        """Enter on, or a second click of, row ``index``."""

    # ------------------------------------------------------------------ rows
    def refresh_rows(self) -> None:
        """Call after ``num_rows`` or the rows' content changed: redraws the lines on
        screen that changed (all of them when the list scrolled, or the view changed)."""
        width = self.scrollable_content_region.width
        height = self.num_rows + 1  # the header line, then the rows
        if height != self.virtual_size.height:
            self._set_virtual_size(Size(width, height))
        if self.cursor >= self.num_rows:
            self.cursor = self.num_rows - 1
        top = int(self.scroll_y)
        stop = min(self.num_rows, top + self.page_rows)
        view = self.view_signature()
        rows = self.row_signatures(top, stop) if view is not None else None
        if rows is None:
            self._drawn = None
            self.refresh()
            return
        cursor = self.cursor - top
        lines = [(row, y == cursor) for y, row in enumerate(rows)]
        drawn, self._drawn = self._drawn, ((top, width, view), lines)
        if drawn is None or drawn[0] != self._drawn[0]:
            self.refresh()
            return
        before = drawn[1]
        for y in range(max(len(before), len(lines))):
            if y >= len(before) or y >= len(lines) or before[y] != lines[y]:
                self.refresh(Region(0, y + 1, width, 1))  # line 0 is the header

    def _set_virtual_size(self, size: Size) -> None:
        """A new virtual size, telling only the scrollbar, and only when its thumb looks
        different: the list's own size never depends on it, but Textual lays the whole
        screen out again for a new virtual size (and draws every widget again), and a
        list that gains rows at every frame would draw its scrollbar at every frame. A scrollbar shown or hidden by it still lays the
        screen out (its own reactive)."""
        update = getattr(self, "_scroll_update", None)  # Textual's: the scrollbars follow the virtual size
        if update is None or not self.container_size:
            self.virtual_size = size
            return
        same = self.show_vertical_scrollbar and self._same_thumb(virtual=size.height)
        self.set_reactive(VirtualList.virtual_size, size)
        if same:  # the scrollbar keeps the new height (dragging reads it) without a redraw
            self.vertical_scrollbar.set_reactive(ScrollBar.window_virtual_size, size.height)
            self.scroll_y = self.validate_scroll_y(self.scroll_y)  # fewer rows: the end may be nearer
        else:
            update(size)

    def watch_scroll_y(self, old: float, new: float) -> None:
        self._drawn = None
        if self.show_vertical_scrollbar and self._same_thumb(position=new):
            # A list that follows its newest row scrolls at every frame, its scrollbar's
            # thumb a cell-eighth every dozen frames: keep the scrollbar's position
            # (dragging reads it) without drawing the scrollbar again.
            self.vertical_scrollbar.set_reactive(ScrollBar.position, new)
            if round(old) != round(new):
                self.refresh(self.size.region)
            return
        super().watch_scroll_y(old, new)

    def _same_thumb(self, *, position: float | None = None, virtual: int | None = None) -> bool:
        """Whether the scrollbar at ``position`` over a virtual height of ``virtual`` (None:
        the scrollbar's own) looks as it does now (drawn by its own renderer, as Textual
        draws it)."""
        bar = self.vertical_scrollbar
        height, thickness = bar.size.height, bar.size.width
        if not height or not thickness:
            return False
        render = bar.renderer.render_bar

        def look(at: float, of: float) -> object:
            window = ceil(bar.window_size if bar.window_size < of else 0)
            return render(size=height, virtual_size=ceil(of), window_size=window, position=at, thickness=thickness,
                          vertical=True).segments

        now = look(bar.position, bar.window_virtual_size)
        return now == look(bar.position if position is None else position,
                           bar.window_virtual_size if virtual is None else virtual)

    @property
    def page_rows(self) -> int:
        return max(self.scrollable_content_region.height - 1, 1)

    def scroll_to_row(self, index: int) -> None:
        """Scroll so that row ``index`` is visible."""
        top = int(self.scroll_y)
        if index < top:
            self.scroll_to(y=index, animate=False)
        elif index >= top + self.page_rows:
            self.scroll_to(y=index - self.page_rows + 1, animate=False)

    def scroll_to_end(self) -> None:
        """Scroll so that the last row is on the bottom line."""
        self.scroll_to(y=max(self.num_rows - self.page_rows, 0), animate=False)

    def move_cursor(self, index: int, notify: bool = True) -> None:
        """Put the cursor on row ``index`` (clamped) and keep it visible."""
        if self.num_rows == 0:
            self.cursor = -1
            return
        index = min(max(index, 0), self.num_rows - 1)
        changed = index != self.cursor
        self.cursor = index
        self.scroll_to_row(index)
        self._drawn = None
        self.refresh()
        if changed and notify:
            self.on_cursor_moved(index)

    def action_cursor(self, delta: int) -> None:
        self.move_cursor((self.cursor if self.cursor >= 0 else 0) + delta if self.cursor >= 0 else 0)

    def action_cursor_to(self, index: int) -> None:
        self.move_cursor(self.num_rows - 1 if index < 0 else index)

    def key_enter(self, event: events.Key) -> None:
        if self.cursor >= 0:
            event.stop()
            self.on_activated(self.cursor)

    def on_click(self, event: events.Click) -> None:
        if event.y == 0:
            self.on_header_click(event.x)
            return
        index = int(self.scroll_y) + event.y - 1
        if 0 <= index < self.num_rows:
            again = index == self.cursor
            self.move_cursor(index)
            if again or event.chain > 1:
                self.on_activated(index)

    def on_header_click(self, x: int) -> None:
        """A click on the header at column ``x``."""

    def on_resize(self) -> None:
        self._drawn = None
        self.refresh_rows()

    # ------------------------------------------------------------------ Line API
    @property
    def base_style(self) -> Style:
        """The widget's Rich style (cached until the CSS changes)."""
        if self._base is None:
            self._base = self.rich_style
        return self._base

    def notify_style_update(self) -> None:
        self._base = None
        super().notify_style_update()

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width
        if y == 0:
            return self.render_header(width)
        index = int(self.scroll_y) + y - 1
        if index >= self.num_rows:
            return Strip([Segment(" " * width, self.base_style)], width)
        return self.render_row(index, width, index == self.cursor)


def cells(parts: list[tuple[str, int, Style | None, str]], width: int, base: Style | None = None) -> Strip:
    """A line of fixed-width columns: (text, width, style, align '<' or '>'). A column the
    line has no room for whole is cut at the line's end, blank if right-aligned: a number
    cut short would read as another number (73976 as 7397)."""
    segments: list[Segment] = []
    used = 0
    for text, w, style, align in parts:
        if used >= width:
            break
        room = min(w, width - used)
        if align == ">":
            body = text[:room].rjust(room) if room == w else " " * room
        else:
            body = text[:room].ljust(room)
        segments.append(Segment(body, (base + style) if (base and style) else (style or base)))
        used += room
    if used < width:
        segments.append(Segment(" " * (width - used), base))
    return Strip(segments, width)
