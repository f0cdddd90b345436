"""KeyBar: the footer's key hints, fitted to the terminal's width.

Textual's ``Footer`` lays every shown binding out in a row and cuts whatever passes the right
edge: at 80 columns the dashboard's footer lost its last keys, ``?`` (the help) and ``q``
among them. This bar drops the least needed hints first (``HINT_ORDER``, last to go first)
and always keeps ``?`` and ``q``: whatever is dropped is in the ``?`` help. A click on a hint
presses its key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from rich.text import Text
from textual.widget import Widget

if TYPE_CHECKING:
    from textual import events
    from textual.binding import Binding

__all__ = ["HINT_ORDER", "Hint", "KeyBar", "fit_hints"]

# Actions by how much a user needs the hint, most first; an action not listed comes after
# these. ``help`` and ``quit`` are never dropped.
HINT_ORDER = ("help", "quit", "toggle_play", "step(1)", "step(-1)", "goto", "explain", "divergence(0)", "filter",
              "next_event(1)", "mute_alerts", "peak", "speed(1)", "speed(-1)")
_KEPT = ("help", "quit")


class Hint(NamedTuple):
    """One key's hint: what to press (``key``: the key name to simulate), what it does."""

    key: str
    key_display: str
    description: str
    action: str


def fit_hints(hints: list[Hint], width: int) -> list[Hint]:
    """The hints (in their order) that fit ``width`` cells, dropping the least needed first
    (``HINT_ORDER``) but never ``?`` or ``q``."""

    def rank(h: Hint) -> int:
        return HINT_ORDER.index(h.action) if h.action in HINT_ORDER else len(HINT_ORDER)

    kept = list(hints)
    by_need = sorted(kept, key=rank)
    while kept and _width(kept) > width:
        droppable = [h for h in reversed(by_need) if h in kept and h.action not in _KEPT]
        if not droppable:
            break
        kept.remove(droppable[0])
    return kept


def _width(hints: list[Hint]) -> int:
    return sum(len(h.key_display) + 1 + len(h.description) for h in hints) + 2 * max(len(hints) - 1, 0) + 1


class KeyBar(Widget):
    """The footer: the screen's shown key bindings, as many as fit, ``?`` and ``q`` always."""

    DEFAULT_CSS = """
    KeyBar {
        dock: bottom;
        height: 1;
        width: 1fr;
        background: $footer-background;
        color: $footer-foreground;
    }
    KeyBar > .keybar--key {
        color: $footer-key-foreground;
        text-style: bold;
    }
    """
    COMPONENT_CLASSES = {"keybar--key"}

    def __init__(self, *, id: str | None = None) -> None:  # noqa: A002
        super().__init__(id=id)
        self._spans: list[tuple[int, int, str]] = []  # (first cell, end cell, key) of each hint drawn

    def on_mount(self) -> None:
        self.screen.bindings_updated_signal.subscribe(self, lambda _screen: self.refresh())

    def on_unmount(self) -> None:
        self.screen.bindings_updated_signal.unsubscribe(self)

    def hints(self) -> list[Hint]:
        """Every shown binding of the screen now, once each, in the order they are bound."""
        seen: set[str] = set()  # actions: a binding of several keys is one per key here
        out: list[Hint] = []
        for key, active in self.screen.active_bindings.items():
            binding: Binding = active.binding
            if not binding.show or binding.action in seen:
                continue
            seen.add(binding.action)
            out.append(Hint(key, self.app.get_key_display(binding), binding.description, binding.action))
        return out

    def shown(self) -> list[Hint]:
        """The hints drawn at the bar's width now."""
        return fit_hints(self.hints(), self.size.width)

    def render(self) -> Text:
        text = Text(" ")
        self._spans = []
        key_style = self.get_component_rich_style("keybar--key", partial=True)
        for i, h in enumerate(self.shown()):
            if i:
                text.append("  ")
            start = text.cell_len
            text.append(h.key_display, style=key_style)
            text.append(" " + h.description)
            self._spans.append((start, text.cell_len, h.key))
        return text

    def on_click(self, event: events.Click) -> None:
        for start, end, key in self._spans:
            if start <= event.x < end:
                self.app.simulate_key(key)
                return
