"""The events log: every event up to the step shown (over-allocation releases,
evictions, retractions, aborts, streaming sessions' holds and closes, OOM, invariant
violations, impossible ops), newest last, optionally one kind only; choosing an event
seeks to its step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.style import Style
from textual.message import Message
from textual.strip import Strip

from kvtrace.tui.widgets.page_map import SESSION_COLOR
from kvtrace.tui.widgets.virtual_list import VirtualList, cells

if TYPE_CHECKING:
    from kvtrace.replay.state import StepEvent
    from kvtrace.tui.driver import Frame

__all__ = ["EVENT_KINDS", "EventsLog"]

EVENT_KINDS = ("overalloc_release", "evict", "retract", "abort", "finish", "hold", "close", "oom", "violation",
               "bad_op", "dropped", "row_overflow")
_KIND_STYLE = {
    "overalloc_release": Style(color="yellow"),
    "evict": Style(color="cyan"),
    "retract": Style(color="magenta"),
    "abort": Style(color="red"),
    "finish": Style(color="bright_black"),
    "hold": Style(color=SESSION_COLOR),
    "close": Style(color=SESSION_COLOR, dim=True),
    "oom": Style(color="bright_red", bold=True),
    "violation": Style(color="bright_red", bold=True),
    "bad_op": Style(color="red", bold=True),
    "dropped": Style(color="red"),
    "row_overflow": Style(color="bright_red"),
    "error": Style(color="white", bgcolor="red", bold=True),
    "warning": Style(color="yellow", bold=True),
}
_FAILURE_KINDS = ("error", "warning")  # add_failure's lines: the replay's own words, at a step or none
_HEADER = Style(bold=True, underline=True)


def describe(e: StepEvent) -> str:
    """One line for an event."""
    if e.kind in _FAILURE_KINDS:
        return e.detail or ""
    who = f"rid {e.rid}" if e.rid is not None else "pool"
    if e.detail:
        return f"{who}: {e.detail}"
    return f"{who}: {e.tokens:,} tokens" if e.tokens else who


class EventsLog(VirtualList):
    """The events of the replay up to the frame's step."""

    class Chosen(Message):
        """The user chose an event: seek to ``step``."""

        def __init__(self, log: EventsLog, step: int) -> None:
            super().__init__()
            self.log = log
            self.step = step

        @property
        def control(self) -> EventsLog:
            return self.log

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.kind: str | None = None  # show one kind only
        self._shown: list[StepEvent] = []
        self._failures: list[StepEvent] = []
        self._by_kind: dict[str | None, tuple[int, list[StepEvent], list[int]]] = {}  # scanned, events, steps
        self._upto_step: int | None = None
        self._num_events = 0
        self._rows: dict[tuple[StepEvent, bool, int], Strip] = {}  # drawn rows: the log scrolls by a few a frame

    def show(self, frame: Frame) -> None:
        """Show the events of steps up to the frame's step."""
        self._timeline = frame.timeline
        self._num_events = frame.num_events
        self._upto_step = frame.step
        self._select()

    def add_failure(self, step: int | None, message: str, kind: str = "error") -> None:
        """Log an error raised inside the replay, or a ``warning`` (shown after the events)."""
        from kvtrace.replay.state import StepEvent

        self._failures.append(StepEvent(step if step is not None else -1, kind, None, 0, message))
        self._select()

    def set_kind(self, kind: str | None) -> None:
        """Show only ``kind`` (None: every kind)."""
        self.kind = kind
        self._select()

    def _select(self) -> None:
        at_end = self.cursor < 0 or self.cursor >= self.num_rows - 1
        shown = self._of_kind(self.kind)
        self._shown = shown + self._failures if self._failures else shown
        self.num_rows = len(self._shown)
        self.refresh_rows()
        if at_end:
            self.scroll_to_end()

    def _of_kind(self, kind: str | None) -> list[StepEvent]:
        """The known events of ``kind`` (None: all) up to the step shown, scanning each event once."""
        import bisect

        timeline = getattr(self, "_timeline", None)
        if timeline is None or self._upto_step is None:
            return []
        scanned, events, steps = self._by_kind.get(kind, (0, [], []))
        new = timeline.events[scanned : self._num_events]
        if kind is not None:
            new = [e for e in new if e.kind == kind]
        events.extend(new)
        steps.extend(e.step for e in new)
        self._by_kind[kind] = (max(scanned, self._num_events), events, steps)
        return events[: bisect.bisect_right(steps, self._upto_step)]

    def view_signature(self) -> object:
        return self.kind

    def row_signatures(self, start: int, stop: int) -> list[object]:
        return list(self._shown[start:stop])

    @property
    def shown(self) -> list[StepEvent]:
        return self._shown

    def on_activated(self, index: int) -> None:
        step = self._shown[index].step
        if step >= 0:  # a failure at no step has nowhere to go
            self.post_message(self.Chosen(self, step))

    def render_header(self, width: int) -> Strip:
        title = f"events ({self.kind})" if self.kind else "events (all kinds)"
        return cells([("step", 8, _HEADER, ">"), ("  " + title, width - 8, _HEADER, "<")], width, self.base_style)

    def notify_style_update(self) -> None:
        self._rows = {}
        super().notify_style_update()

    def render_row(self, index: int, width: int, selected: bool) -> Strip:
        e = self._shown[index]
        key = (e, selected, width)
        strip = self._rows.get(key)
        if strip is None:
            if len(self._rows) > 4 * self.page_rows + 64:
                self._rows = {}
            base = self.base_style + Style(reverse=True) if selected else self.base_style
            strip = self._rows[key] = cells(
                [(str(e.step) if e.step >= 0 else "·", 8, None, ">"),
                 ("  " + e.kind + " ", 21, _KIND_STYLE.get(e.kind), "<"),
                 (describe(e), width, None, "<")],
                width,
                base,
            )
        return strip
