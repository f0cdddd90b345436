"""A few lines of Rich ``Text`` drawn through Textual's line API, redrawing only the lines
that changed (base of the header and the occupancy legend).

A ``Static`` lays its whole content out again on every update, at every frame, while
most of these lines change a few digits, or nothing, from one frame to the next.
"""

from __future__ import annotations

from rich.style import Style
from rich.text import Text
from textual.geometry import Region
from textual.strip import Strip
from textual.widget import Widget

__all__ = ["TextLines"]


class TextLines(Widget):
    """Lines of ``Text``, one per row of the widget (a line longer than the widget is cut).

    Args:
        id: the widget's id.
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._lines: list[Text] = []
        self._strips: dict[int, Strip] = {}  # y -> the line drawn at the current width
        self._width = -1
        self._base: Style | None = None  # rich_style, cached (computing it per line is slow)

    @property
    def content(self) -> Text:
        """Every line, as one ``Text``."""
        return Text("\n").join(self._lines)

    def set_lines(self, lines: list[Text]) -> None:
        """Show ``lines`` (only those that differ from the lines shown are drawn again)."""
        old = self._lines
        self._lines = lines
        width = max(self.size.width, 1)
        for y in range(max(len(lines), len(old))):
            if y >= len(lines) or y >= len(old) or lines[y] != old[y]:
                self._strips.pop(y, None)
                self.refresh(Region(0, y, width, 1))

    def notify_style_update(self) -> None:
        self._base = None
        self._strips = {}
        super().notify_style_update()

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        if width != self._width:
            self._width = width
            self._strips = {}
        strip = self._strips.get(y)
        if strip is None:
            if self._base is None:
                self._base = self.rich_style
            base = self._base
            if y < len(self._lines):
                text = self._lines[y]
                console = self.app.console
                # Text.render leaves out the style of a line that has no spans: it goes under them all.
                style = base + console.get_style(text.style) if text.style else base
                strip = Strip(list(text.render(console))).apply_style(style).adjust_cell_length(width, base)
            else:
                strip = Strip.blank(width, base)
            self._strips[y] = strip
        return strip
