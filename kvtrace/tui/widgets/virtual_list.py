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

__all__ = ["VirtualList", "cells", "rows_height"]


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
        # The virtual height goes by steps (a change re-lays the screen out); rows past
        # num_rows draw blank.
        width = self.scrollable_content_region.width
        height = rows_height(self.num_rows + 1)
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
        """A new virtual size, telling only the scrollbars: the list's own size never
        depends on it, but Textual lays the whole screen out again for a new virtual
        size (some 25 ms of the screen's time, and every widget drawn again). A
        scrollbar shown or hidden by it still lays the screen out (its own reactive)."""
        update = getattr(self, "_scroll_update", None)  # Textual's: the scrollbars follow the virtual size
        if update is None or not self.container_size:
            self.virtual_size = size
            return
        self.set_reactive(VirtualList.virtual_size, size)
        update(size)

    def watch_scroll_y(self, old: float, new: float) -> None:
        self._drawn = None
        if self.show_vertical_scrollbar and self._same_thumb(new):
            # A list that follows its newest row scrolls at every frame, its scrollbar's
            # thumb a cell-eighth every dozen frames: keep the scrollbar's position
            # (dragging reads it) without drawing the scrollbar again.
            self.vertical_scrollbar.set_reactive(ScrollBar.position, new)
            if round(old) != round(new):
                self.refresh(self.size.region)
            return
        super().watch_scroll_y(old, new)

    def _same_thumb(self, position: float) -> bool:
        """Whether the scrollbar at ``position`` looks as it does now (drawn by its own
        renderer, as Textual draws it)."""
        bar = self.vertical_scrollbar
        height, thickness = bar.size.height, bar.size.width
        if not height or not thickness:
            return False
        virtual = bar.window_virtual_size
        shape = {"size": height, "virtual_size": ceil(virtual), "thickness": thickness, "vertical": True,
                 "window_size": ceil(bar.window_size if bar.window_size < virtual else 0)}
        render = bar.renderer.render_bar
        return render(position=bar.position, **shape).segments == render(position=position, **shape).segments

    @property
    def max_scroll_y(self) -> int:
        """The last row on the bottom line at most: the virtual height runs up to a
        quarter past the rows (``rows_height``), and a scrollbar dragged to its end would
        show blank lines below them."""
        return min(super().max_scroll_y, max(self.num_rows - self.page_rows, 0))

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


def rows_height(lines: int) -> int:
    """The virtual height of a list of ``lines`` lines: the first of 16, 21, 27, 34, ...
    (about 1.25 times apart) that holds them. The screen is laid out again only when a
    list passes one of them, and the height (hence the scrollbar) depends on the number
    of rows alone, not on the frames that led to it."""
    height = 16
    while height < lines:
        height = height * 5 // 4 + 1
    return height


def cells(parts: list[tuple[str, int, Style | None, str]], width: int, base: Style | None = None) -> Strip:
    """A line of fixed-width columns: (text, width, style, align '<' or '>')."""
    segments: list[Segment] = []
    used = 0
    for text, w, style, align in parts:
        if used >= width:
            break
        w = min(w, width - used)
        body = text[:w].rjust(w) if align == ">" else text[:w].ljust(w)
        segments.append(Segment(body, (base + style) if (base and style) else (style or base)))
        used += w
    if used < width:
        segments.append(Segment(" " * (width - used), base))
    return Strip(segments, width)
