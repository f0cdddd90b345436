"""AlertToasts: the replay's alarms (OOM, violation, impossible op) as one notification per
kind, with a count that grows, instead of one toast per event.

A run with ``--on-oom skip`` on a small pool, or ``--check every`` on a faulty version, raises
hundreds of them: one toast each covered the page map and the events log for the whole run.
Here each kind (per side, in a diff) has one card: its count so far and its latest event. A
card leaves after ``timeout`` seconds without a new event of its kind (or on a click) and comes
back, count kept, with the next one. Muting hides the cards and keeps counting; the events log
is the full record either way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.text import Text
from textual.containers import Vertical
from textual.widgets import Static

from kvtrace.tui.widgets.events_log import describe

if TYPE_CHECKING:
    from textual import events
    from textual.timer import Timer

    from kvtrace.replay.state import StepEvent

__all__ = ["ALERT_TITLES", "AlertCard", "AlertToasts"]

ALERT_TITLES = {"oom": "out of memory", "violation": "invariant violation", "bad_op": "impossible op"}


class AlertCard(Static):
    """One kind's card: ``count`` events so far, the latest one in ``latest``."""

    def __init__(self, key: tuple[int, str], label: str) -> None:
        super().__init__(classes="alert-card")
        self.key = key
        self.label = label  # the side's label in a diff ("A (builtin)"), else ""
        self.count = 0
        self.latest: StepEvent | None = None
        self.timer: Timer | None = None

    def add(self, event: StepEvent) -> None:
        self.count += 1
        self.latest = event
        self.update(self._text())

    def _text(self) -> Text:
        e = self.latest
        assert e is not None
        kind = self.key[1]
        title = f"{self.label + ': ' if self.label else ''}{ALERT_TITLES.get(kind, kind)} ×{self.count:,}"
        text = Text(title, style="bold red")
        text.append(f"\nlatest: step {e.step:,}: {describe(e)}", style="")
        text.append("\nm: mute these · o: go to the first one", style="dim")
        return text

    def on_click(self, event: events.Click) -> None:
        event.stop()
        self.display = False


class AlertToasts(Vertical):
    """The cards, bottom right over the dashboard (clicks pass through where no card is).

    Args:
        timeout: seconds a card stays without a new event of its kind.
    """

    DEFAULT_CSS = """
    AlertToasts {
        dock: bottom;
        layer: alerts;
        width: 1fr;
        height: auto;
        max-height: 50%;
        margin-bottom: 1;
        align-horizontal: right;
        visibility: hidden;
    }
    AlertToasts.-muted {
        display: none;
    }
    AlertToasts > AlertCard {
        visibility: visible;
        width: 60;
        max-width: 60%;
        height: auto;
        margin-top: 1;
        padding: 0 1;
        background: $panel-lighten-1;
        border-left: outer $error;
    }
    """

    def __init__(self, timeout: float = 8.0, *, id: str | None = None) -> None:  # noqa: A002
        super().__init__(id=id)
        self.timeout = timeout
        self.muted = False
        self._cards: dict[tuple[int, str], AlertCard] = {}

    def add(self, event: StepEvent, side: int = 0, label: str = "") -> None:
        """Count ``event`` (of side ``side``, labelled ``label`` in a diff) and show its kind's card."""
        key = (side, event.kind)
        card = self._cards.get(key)
        if card is None:
            card = self._cards[key] = AlertCard(key, label)
            self.mount(card)
        card.add(event)
        card.display = True
        if card.timer is not None:
            card.timer.stop()
        card.timer = self.set_timer(self.timeout, lambda c=card: setattr(c, "display", False))

    def counts(self) -> dict[tuple[int, str], int]:
        """Events counted so far, by (side, kind)."""
        return {key: card.count for key, card in self._cards.items()}

    def shown(self) -> list[AlertCard]:
        """The cards on screen now (none while muted)."""
        if self.muted:
            return []
        return [card for card in self._cards.values() if card.display]

    def toggle_mute(self) -> bool:
        """Mute or unmute; whether muted now."""
        self.muted = not self.muted
        self.set_class(self.muted, "-muted")
        return self.muted
