"""KvtraceApp: the dashboard. Starts the replay driver in a thread worker and routes
its frames to the widgets and the user's keys and clicks to the driver."""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from textual import events
from textual.app import App
from textual.binding import Binding
from textual.widgets import Input, Static

from kvtrace.snapshot import PHASES
from kvtrace.state import RequestRow
from kvtrace.tui.driver import ALERT_KINDS, Frame, ReplayDriver
from kvtrace.tui.messages import CellInfoReady, FrameReady, HistoryReady, ReplayFailed, wrap
from kvtrace.tui.screens import GotoScreen, HelpScreen, ReplayScreen, RequestDetailScreen
from kvtrace.tui.widgets.events_log import EVENT_KINDS, EventsLog
from kvtrace.tui.widgets.header import ReplayHeader
from kvtrace.tui.widgets.occupancy import OccupancyChart, OccupancyLegend
from kvtrace.tui.widgets.page_map import PageMap
from kvtrace.tui.widgets.request_table import RequestTable

if TYPE_CHECKING:
    from kvtrace.tui.driver import CellInfo
    from kvtrace.tui.sources import ReplaySource

__all__ = ["KvtraceApp"]


class KvtraceApp(App[None]):
    """The live dashboard over a replay source.

    Args:
        source: a ``LiveSource`` (a replay session) or a ``LogSource`` (a state log);
            the app closes it when it exits.
        play: start playing at once (else paused at the first step).
        fps: frames a second while playing.
        chart_interval_s: seconds between redraws of the occupancy chart while playing.
        clock: monotonic seconds (tests fix it).
    """

    CSS_PATH = "kvtrace.tcss"
    TITLE = "kvtrace"
    BINDINGS = [
        Binding("space", "toggle_play", "Play/pause"),
        Binding("right", "step(1)", "Step"),
        Binding("left", "step(-1)", "Back"),
        Binding("shift+right", "step(100)", "+100", show=False),
        Binding("shift+left", "step(-100)", "-100", show=False),
        Binding("plus,equals_sign", "speed(1)", "Faster", key_display="+"),
        Binding("minus", "speed(-1)", "Slower", key_display="-"),
        Binding("g", "goto", "Go to"),
        Binding("n", "next_event(1)", "Next event"),
        Binding("N", "next_event(-1)", "Prev event", show=False),
        Binding("k", "cycle_kind", "Event kind", show=False),
        Binding("P", "peak", "Peak"),
        Binding("o", "first_alert", "OOM/violation", show=False),
        Binding("slash", "filter", "Filter"),
        Binding("s", "sort", "Sort", show=False),
        Binding("r", "reverse", "Reverse", show=False),
        Binding("enter", "detail", "Detail", show=False),
        Binding("question_mark", "help", "Keys"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(
        self,
        source: ReplaySource,
        *,
        play: bool = True,
        fps: float = 20.0,
        chart_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.source = source
        self.driver = ReplayDriver(source, self._post_from_driver, fps=fps, play=play, clock=clock)
        self.frame: Frame | None = None
        self.frames_shown = 0
        self.draw_s: deque[float] = deque(maxlen=10_000)  # seconds from a frame's arrival to its screen update
        self._chart_interval_s = chart_interval_s
        self._chart_at = -1e18
        self.clock = clock
        self._detail: RequestDetailScreen | None = None
        self.main = ReplayScreen()
        self.replay_closed = threading.Event()  # the worker returned and closed the source

    # ------------------------------------------------------------------ lifetime
    async def on_mount(self) -> None:
        await self.push_screen(self.main)
        if not self.source.info.live:
            self.main.query_one("#pages").border_title = "pool by state (a log has no slot positions)"
        self.run_worker(self._replay, thread=True, exclusive=True, name="replay")

    def _replay(self) -> None:
        try:
            self.driver.run()
        finally:
            self.source.close()
            self.replay_closed.set()

    def _post_from_driver(self, item: object) -> None:
        self.post_message(wrap(item))

    async def action_quit(self) -> None:
        self.driver.stop()
        self.exit()

    def on_unmount(self) -> None:
        self.driver.stop()

    # ------------------------------------------------------------------ frames
    def on_frame_ready(self, message: FrameReady) -> None:
        if self.main not in self.screen_stack:  # a frame that arrives while the app closes
            return
        t0 = time.perf_counter()
        frame = message.frame
        self.frame = frame
        self.frames_shown += 1
        screen = self.main
        screen.query_one(ReplayHeader).show(self.source.info, frame)
        screen.query_one(OccupancyLegend).show(frame)
        screen.query_one(RequestTable).show(frame)
        screen.query_one(EventsLog).show(frame)
        screen.query_one(PageMap).show(frame.page_cells)
        now = self.clock()
        chart = screen.query_one(OccupancyChart)
        if not frame.playing or now - self._chart_at >= self._chart_interval_s or chart.shown_step is None:
            chart.show(frame)
            self._chart_at = now
        self.call_after_refresh(self._drawn, frame.seq, t0)
        for e in frame.alerts:
            self.notify(f"step {e.step}: {e.kind} {e.detail}".strip(), title="replay", severity="error", timeout=8)

    def _drawn(self, seq: int, t0: float) -> None:
        self.draw_s.append(time.perf_counter() - t0)
        self.driver.ack(seq)

    def on_replay_failed(self, message: ReplayFailed) -> None:
        step = self.frame.step if self.frame is not None else None
        self.main.query_one(EventsLog).add_failure(step, message.failure.message)
        self.notify(message.failure.message, title="replay failed", severity="error", timeout=15)

    def on_cell_info_ready(self, message: CellInfoReady) -> None:
        self.main.query_one("#cell-info", Static).update(cell_text(message.info))

    def on_history_ready(self, message: HistoryReady) -> None:
        if self._detail is not None and self._detail.row.rid == message.history.rid:
            self._detail.show_history(message.history)

    # ------------------------------------------------------------------ widget messages
    def on_request_table_selected(self, message: RequestTable.Selected) -> None:
        self.driver.command("select", message.rid)

    def on_request_table_opened(self, message: RequestTable.Opened) -> None:
        self._open_detail(message.rid)

    def on_page_map_resized(self, message: PageMap.Resized) -> None:
        self.driver.command("cells", message.num_cells)

    def on_page_map_cell_clicked(self, message: PageMap.CellClicked) -> None:
        self.driver.command("cell", message.index)

    def on_events_log_chosen(self, message: EventsLog.Chosen) -> None:
        self.driver.command("seek", message.step)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id != "filter":
            return
        try:
            self.main.query_one(RequestTable).set_filter(event.value)
        except ValueError as exc:
            self.notify(str(exc), title="filter", severity="warning")
            return
        event.input.display = False
        self.main.query_one(RequestTable).focus()

    def on_key(self, event: events.Key) -> None:
        box = self.main.query_one("#filter", Input)
        if event.key == "escape" and box.display:
            box.display = False
            self.main.query_one(RequestTable).focus()

    # ------------------------------------------------------------------ actions
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Typing in an input box is not a command."""
        if isinstance(self.focused, Input) and action not in ("quit", "help"):
            return False
        return True

    def action_toggle_play(self) -> None:
        self.driver.command("toggle")

    def action_step(self, n: int) -> None:
        self.driver.command("step", n)

    def action_speed(self, delta: int) -> None:
        self.driver.command("speed", delta)

    def action_goto(self) -> None:
        info = self.source.info

        def go(step: int | None) -> None:
            if step is not None:
                self.driver.command("seek", step)

        self.push_screen(GotoScreen(info.first_step, info.last_step), go)

    def action_next_event(self, direction: int) -> None:
        frame = self.frame
        if frame is None or frame.step is None:
            return
        log = self.main.query_one(EventsLog)
        events = frame.events()
        if log.kind is not None:
            events = [e for e in events if e.kind == log.kind]
        steps = [e.step for e in events]
        if direction > 0:
            i = bisect.bisect_right(steps, frame.step)
            target = steps[i] if i < len(steps) else None
        else:
            i = bisect.bisect_left(steps, frame.step) - 1
            target = steps[i] if i >= 0 else None
        if target is None:
            what = log.kind or "event"
            self.notify(f"no {'later' if direction > 0 else 'earlier'} {what} replayed so far", timeout=3)
            return
        self.driver.command("seek", target)

    def action_cycle_kind(self) -> None:
        log = self.main.query_one(EventsLog)
        kinds = (None, *EVENT_KINDS)
        log.set_kind(kinds[(kinds.index(log.kind) + 1) % len(kinds)])

    def action_peak(self) -> None:
        if self.frame is not None:
            peak = self.frame.peak()
            if peak is not None:
                self.driver.command("seek", peak[0])

    def action_first_alert(self) -> None:
        if self.frame is None:
            return
        for e in self.frame.events():
            if e.kind in ALERT_KINDS:
                self.driver.command("seek", e.step)
                return
        self.notify("no OOM, violation or impossible op replayed so far", timeout=3)

    def action_filter(self) -> None:
        box = self.main.query_one("#filter", Input)
        box.display = True
        box.value = self.main.query_one(RequestTable).filter_text
        box.focus()

    def action_sort(self) -> None:
        self.main.query_one(RequestTable).cycle_sort()

    def action_reverse(self) -> None:
        table = self.main.query_one(RequestTable)
        table.set_sort(table.sort_key, not table.descending)

    def action_detail(self) -> None:
        rid = self.main.query_one(RequestTable).selected_rid
        if rid is None:
            self.notify("select a request first (click a row, or tab to the table and use ↑ ↓)", timeout=3)
            return
        self._open_detail(rid)

    def _open_detail(self, rid: int) -> None:
        try:
            row = self.source.state.row(rid) if self.frame is None else _row_of(self.frame, rid)
        except KeyError:
            return
        self._detail = RequestDetailScreen(row)

        def closed(_: None) -> None:
            self._detail = None

        self.push_screen(self._detail, closed)
        self.driver.command("history", rid)

    def action_help(self) -> None:
        self.push_screen(HelpScreen())


def _row_of(frame: Frame, rid: int) -> RequestRow:
    req = frame.requests
    if not 0 <= rid < req.size or req.phase[rid] < 0:
        raise KeyError(rid)
    alloc, used = int(req.allocated[rid]), int(req.committed[rid])
    return RequestRow(rid, PHASES[int(req.phase[rid])], used, alloc, alloc - used, int(req.protected[rid]),
                      -(-alloc // req.page_size), int(req.prefix_hit[rid]), int(req.admitted_step[rid]),
                      int(req.ended_step[rid]))


def cell_text(info: CellInfo) -> str:
    """The cell-info line under the page map."""
    tokens = ", ".join(f"{k} {v:,}" for k, v in info.tokens.items())
    if info.detail is None:
        return f"cell: {tokens} (a state log has no slot positions)" if tokens else "no page map here"
    d = info.detail
    owners = ", ".join(f"rid {rid} ({n:,})" for rid, n in d.owners) or "no request"
    return f"pages {d.first_page:,}..{d.last_page:,} at step {info.step}: {tokens}\nowners: {owners}"
