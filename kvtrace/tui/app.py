"""KvtraceApp: the dashboard of one replay, or of two side by side (``kvtrace diff --tui``).

Each replay runs on the other side of a link (``kvtrace.tui.remote.link``: its own process, or a
thread); a ``Driver`` per replay, in a thread worker of the app, folds what it sends and
posts frames. The app routes frames to the widgets and the user's keys and clicks to the
replays: in a diff every key moves both sides together.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from textual import events
from textual.app import App
from textual.binding import Binding
from textual.widget import Widget
from textual.widgets import Input, Static

from kvtrace.replay.snapshot import PHASES
from kvtrace.replay.state import RequestRow
from kvtrace.tui.driver import ALERT_KINDS, DEFAULT_FPS, Driver, Frame
from kvtrace.tui.messages import CellInfoReady, ExplanationReady, FrameReady, HistoryReady, ReplayFailed, wrap
from kvtrace.tui.screens import (
    DiffScreen, ExplainScreen, GotoScreen, HelpScreen, HoldersScreen, ReplayScreen, RequestDetailScreen,
)
from kvtrace.tui.widgets.dashboard import Cadence, Dashboard
from kvtrace.tui.widgets.divergence import DivergenceBanner
from kvtrace.tui.widgets.events_log import EVENT_KINDS, EventsLog
from kvtrace.tui.widgets.page_map import PageMap
from kvtrace.tui.widgets.request_table import RequestTable
from kvtrace.tui.widgets.toasts import AlertToasts

if TYPE_CHECKING:
    from kvtrace.proc.contracts import CommandName
    from kvtrace.diff.diff import DiffReport
    from kvtrace.tui.driver import CellInfo, RequestColumns
    from kvtrace.tui.remote.link import ReplayLink

__all__ = ["KvtraceApp", "cell_text", "differing_requests"]

DIVERGENCE_COLOUR = "bold magenta"


class KvtraceApp(App[None]):
    """The live dashboard.

    Args:
        links: the replay (a ``ReplayLink``), or two for a diff (A, B); the app closes
            them when it exits.
        diff: what ``kvtrace diff`` found (with two links): the screen marks the
            divergence, selects its request and starts the sides at its step.
        fps: frames a second while playing.
        cadence: how often the occupancy chart and the events log are drawn while playing.
        clock: monotonic seconds (tests fix it: row flashes, achieved speed).
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
        Binding("d", "divergence(0)", "Divergence"),
        Binding("D", "divergence(1)", "Next divergence", show=False),
        Binding("g", "goto", "Go to"),
        Binding("n", "next_event(1)", "Next event"),
        Binding("N", "next_event(-1)", "Prev event", show=False),
        Binding("k", "cycle_kind", "Event kind", show=False),
        Binding("P", "peak", "Peak"),
        Binding("p", "cycle_pool", "Pool", show=False),
        Binding("o", "first_alert", "OOM/violation", show=False),
        Binding("m", "mute_alerts", "Mute alerts"),
        Binding("x", "export", "Export", show=False),
        Binding("T", "holders", "Top holders", show=False),
        Binding("slash", "filter", "Filter"),
        Binding("s", "sort", "Sort", show=False),
        Binding("r", "reverse", "Reverse", show=False),
        Binding("enter", "detail", "Detail", show=False),
        Binding("e", "explain", "Explain"),  # shown where the replay explains (--explain)
        Binding("question_mark", "help", "Keys"),
        Binding("q", "quit", "Quit"),
        # Textual's own ctrl+c only says "press ctrl+q to quit": here it quits, as a terminal user expects.
        Binding("ctrl+c", "quit", "Quit", show=False, priority=True),
    ]

    def __init__(
        self,
        links: ReplayLink | Sequence[ReplayLink],
        *,
        diff: DiffReport | None = None,
        fps: float = DEFAULT_FPS,
        cadence: Cadence = Cadence(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        links = list(links) if isinstance(links, (list, tuple)) else [links]  # type: ignore[list-item]
        if diff is not None and len(links) != 2:
            raise ValueError(f"a diff shows two replays, found {len(links)}")
        self.report = diff
        self.drivers = [Driver(link, self._post_from_driver, side=i, fps=fps, clock=clock) for i, link in enumerate(links)]
        self.frames: list[Frame | None] = [None] * len(links)
        self.frames_shown = 0
        self.draw_s: deque[float] = deque(maxlen=10_000)  # seconds from a frame's arrival to its screen update
        self.clock = clock
        self.main = ReplayScreen(cadence) if diff is None else DiffScreen(diff, cadence)
        self._detail: RequestDetailScreen | None = None
        self._holders: HoldersScreen | None = None
        self._explain: ExplainScreen | None = None
        self._divergence: int | None = None  # the divergence the sides were sent to
        self.replay_closed = threading.Event()  # every worker returned and closed its replay
        self._alerted: set[tuple[int, object]] = set()  # (side, event) notified
        self._dashboards: list[Dashboard] = []  # found once the main screen is composed

    # ------------------------------------------------------------------ lifetime
    @property
    def driver(self) -> Driver:
        """The (first) replay's driver."""
        return self.drivers[0]

    @property
    def frame(self) -> Frame | None:
        """The (first) replay's last frame shown."""
        return self.frames[0]

    @property
    def dashboards(self) -> list[Dashboard]:
        """The main screen's dashboards, by side (queried once: the screen is composed
        once, and a query walks the whole screen, too much for every frame)."""
        if not self._dashboards:
            self._dashboards = list(self.main.query(Dashboard))
        return self._dashboards

    async def on_mount(self) -> None:
        await self.push_screen(self.main)
        if self.report is not None:
            self._go_to_divergence(0)
        for driver in self.drivers:
            self.run_worker(lambda d=driver: self._replay(d), thread=True, name=f"replay-{driver.side}")

    def _replay(self, driver: Driver) -> None:
        try:
            driver.run()
        finally:
            if all(d.closed.is_set() for d in self.drivers):
                self.replay_closed.set()

    def _post_from_driver(self, item: object) -> None:
        self.post_message(wrap(item))

    def stop_replays(self) -> None:
        """Ask every driver to stop (each then closes its replay)."""
        for d in self.drivers:
            d.stop()

    async def action_quit(self) -> None:
        self.stop_replays()
        # a replay process that died is a failure, whatever key ends the screen
        self.exit(return_code=1 if self.replay_died() is not None else 0)

    def replay_died(self) -> str | None:
        """Why a replay process went away before the screen quit (None: none did)."""
        return next((d.died for d in self.drivers if d.died is not None), None)

    def on_unmount(self) -> None:
        self.stop_replays()

    # ------------------------------------------------------------------ frames
    def on_frame_ready(self, message: FrameReady) -> None:
        if self.main not in self.screen_stack:  # a frame that arrives while the app closes
            return
        t0 = time.perf_counter()
        frame = message.frame
        driver = self.drivers[frame.side]
        info = driver.info
        assert info is not None
        dash = self.dashboards[frame.side]
        if self.frames[frame.side] is None:
            dash.set_info(info)
            if info.explain:
                self.refresh_bindings()  # the explain key shows
        self.frames[frame.side] = frame
        self.frames_shown += 1
        dash.show(frame, info, self.clock())
        if self.report is not None:
            self._mark_differing()
        self.call_after_refresh(self._drawn, driver, frame.seq, t0)
        for e in frame.alerts:
            if (frame.side, e) in self._alerted:  # repeated by a frame drawn after it
                continue
            self._alerted.add((frame.side, e))
            self.main.query_one(AlertToasts).add(e, frame.side, self._side_label(frame.side))

    def _mark_differing(self) -> None:
        """A diff: mark on both request tables the requests whose phase or lengths differ
        between the sides, once both show the same step (else no marks: the sides are
        at different places and every row would differ)."""
        a, b = self.frames
        marks = None
        if a is not None and b is not None and a.step == b.step and a.step is not None:
            marks = differing_requests(a.requests, b.requests)
        for dash in self.dashboards:
            dash.query_one(RequestTable).set_differing(marks)

    def _drawn(self, driver: Driver, seq: int, t0: float) -> None:
        self.draw_s.append(time.perf_counter() - t0)
        driver.ack(seq)

    def _side_label(self, side: int) -> str:
        if self.report is None:
            return ""
        r = self.report.a if side == 0 else self.report.b
        return f"{'AB'[side]} ({r.label})"

    def on_replay_failed(self, message: ReplayFailed) -> None:
        side = message.failure.side
        frame = self.frames[side]
        step = frame.step if frame is not None else None
        severity = message.failure.severity
        self.dashboards[side].query_one(EventsLog).add_failure(step, message.failure.message, kind=severity)
        what = "failed" if severity == "error" else "warning"
        title = f"replay {self._side_label(side)} {what}" if self.report is not None else f"replay {what}"
        self.notify(message.failure.message, title=title, severity=severity, timeout=15)

    def on_cell_info_ready(self, message: CellInfoReady) -> None:
        self.dashboards[message.info.side].query_one("#cell-info", Static).update(cell_text(message.info))

    def on_history_ready(self, message: HistoryReady) -> None:
        h = message.history
        if self._detail is not None and self._detail.row.rid == h.rid and self._detail.side == h.side:
            self._detail.show_history(h)
        holders = self._holders
        if holders is not None and holders.side == h.side:
            holders.show_history(h)

    def on_explanation_ready(self, message: ExplanationReady) -> None:
        e = message.explanation
        screen = self._explain
        if screen is not None and screen.rid == e.rid and screen.side == e.side:
            screen.show(e)

    # ------------------------------------------------------------------ widget messages
    def _side_of(self, widget: Widget | None) -> int:
        node: Any = widget
        while node is not None:
            if isinstance(node, Dashboard):
                return node.side
            node = node.parent
        return 0

    def _all(self, name: CommandName, arg: int | None = None) -> None:
        for d in self.drivers:
            d.command(name, arg)

    def on_request_table_selected(self, message: RequestTable.Selected) -> None:
        self._all("select", message.rid)
        for dash in self.dashboards:  # a diff follows the request on both sides
            table = dash.query_one(RequestTable)
            if table is not message.table and table.selected_rid != message.rid:
                table.select_rid(message.rid)

    def on_request_table_opened(self, message: RequestTable.Opened) -> None:
        self._open_detail(self._side_of(message.table), message.rid)

    def on_page_map_resized(self, message: PageMap.Resized) -> None:
        self.drivers[self._side_of(message.page_map)].command("cells", message.num_cells)

    def on_page_map_cell_clicked(self, message: PageMap.CellClicked) -> None:
        self.drivers[self._side_of(message.page_map)].command("cell", message.index)

    def on_events_log_chosen(self, message: EventsLog.Chosen) -> None:
        self._all("seek", message.step)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id != "filter":
            return
        tables = [dash.query_one(RequestTable) for dash in self.dashboards]
        try:
            for table in tables:
                table.set_filter(event.value)
        except ValueError as exc:
            self.notify(str(exc), title="filter", severity="warning")
            return
        for dash in self.dashboards:
            dash.show_filter(tables[0].filter_text)
        event.input.display = False
        tables[self._side_of(event.input)].focus()

    def on_key(self, event: events.Key) -> None:
        if event.key != "escape":
            return
        for dash in self.dashboards:
            box = dash.query_one("#filter", Input)
            if box.display:
                box.display = False
                dash.query_one(RequestTable).focus()

    # ------------------------------------------------------------------ actions
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Typing in an input box is not a command; the divergence keys are a diff's."""
        if isinstance(self.focused, Input) and action not in ("quit", "help"):
            return False
        if action == "divergence" and self.report is None:
            return False  # not shown
        if action == "explain" and not any(d.info is not None and d.info.explain for d in self.drivers):
            return False  # a replay without --explain: not shown
        return True

    def _focused_side(self) -> int:
        return self._side_of(self.focused)

    def action_toggle_play(self) -> None:
        self._all("toggle")

    def action_step(self, n: int) -> None:
        self._all("step", n)

    def action_speed(self, delta: int) -> None:
        self._all("speed", delta)

    def action_goto(self) -> None:
        info = self.driver.info
        first, last = (info.first_step, info.last_step) if info is not None else (None, None)

        def go(step: int | None) -> None:
            if step is not None:
                self._all("seek", step)

        self.push_screen(GotoScreen(first, last), go)

    def action_divergence(self, which: int) -> None:
        """Both sides to the first divergence (0), or the next one (1)."""
        report = self.report
        if report is None:
            return
        if report.identical:
            self.notify(f"identical over {report.steps_compared:,} steps: no divergence", timeout=3)
            return
        index = 0 if which == 0 or self._divergence is None else (self._divergence + 1) % len(report.divergences)
        self._go_to_divergence(index)

    def _go_to_divergence(self, index: int) -> None:
        report = self.report
        assert report is not None
        if report.identical:
            return
        self._divergence = index
        d = report.divergences[index].divergence
        self.main.query_one(DivergenceBanner).show(report, index)
        for dash in self.dashboards:
            dash.mark("divergence", d.step, DIVERGENCE_COLOUR)
            if d.rid is not None:  # a pool counter's divergence keeps the selection
                dash.query_one(RequestTable).select_rid(d.rid)
        if d.rid is not None:
            self._all("select", d.rid)
        self._all("seek", d.step)

    def action_next_event(self, direction: int) -> None:
        side = self._focused_side()
        frame = self.frames[side]
        if frame is None or frame.step is None:
            return
        log = self.dashboards[side].query_one(EventsLog)
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
        self._all("seek", target)

    def action_cycle_kind(self) -> None:
        kinds = (None, *EVENT_KINDS)
        for dash in self.dashboards:
            log = dash.query_one(EventsLog)
            log.set_kind(kinds[(kinds.index(log.kind) + 1) % len(kinds)])

    def action_peak(self) -> None:
        side = self._focused_side()
        frame = self.frames[side]
        if frame is not None:
            peak = frame.peak(self.dashboards[side].pool)
            if peak is not None:
                self._all("seek", peak[0])

    def action_cycle_pool(self) -> None:
        """Show the next KV pool (a hybrid model's sliding-window pool) in the occupancy
        panel and the page map."""
        cycled = False
        for dash in self.dashboards:
            if dash.cycle_pool():
                cycled = True
                self.drivers[dash.side].command("pool", dash.pool)
        if not cycled:
            self.notify("this replay has one KV pool (full attention)", timeout=3)

    def action_first_alert(self) -> None:
        frame = self.frames[self._focused_side()]
        if frame is None:
            return
        for e in frame.events():
            if e.kind in ALERT_KINDS:
                self._all("seek", e.step)
                return
        self.notify("no OOM, violation or impossible op replayed so far", timeout=3)

    def action_mute_alerts(self) -> None:
        """Hide (or show again) the OOM / violation cards; they keep counting."""
        muted = self.main.query_one(AlertToasts).toggle_mute()
        self.notify("OOM and violation notifications muted (m shows them; the events log has every one)"
                    if muted else "OOM and violation notifications shown", timeout=3)

    def action_holders(self, count: int = 5) -> None:
        """The ``count`` requests allocating most at the step shown, their lengths over
        time (each one's life is replayed by its replay process, as the detail's); a
        click on the chart seeks there."""
        side = self._focused_side()
        frame = self.frames[side]
        if frame is None:
            return
        alloc = frame.requests.allocated
        live = np.flatnonzero(alloc > 0)
        if not live.shape[0]:
            self.notify("no request holds KV at this step", timeout=3)
            return
        rids = live[np.argsort(-alloc[live], kind="stable")[:count]].tolist()
        self._holders = HoldersScreen(rids, frame.step, side)

        def closed(step: int | None) -> None:
            self._holders = None
            if step is not None:
                self._all("seek", step)

        self.push_screen(self._holders, closed)
        for rid in rids:
            self.drivers[side].command("history", rid)

    def action_export(self) -> None:
        """Write the screen as SVG and the request table as CSV (numbered names, never
        over a file; ``kvtrace.tui.export``), and say where."""
        from kvtrace.tui.export import export_dir, export_view, table_csv

        side = self._focused_side()
        frame, info = self.frames[side], self.drivers[side].info
        if frame is None or info is None:
            self.notify("nothing to export yet", timeout=3)
            return
        table = table_csv(self.dashboards[side].query_one(RequestTable), frame)
        try:
            svg, csv = export_view(export_dir(info.name), info.name, frame.step, self.export_screenshot(), table)
        except OSError as exc:
            self.notify(f"export failed: {exc}", title="export", severity="error")
            return
        self.notify(f"view saved: {svg}\nrequests: {csv}", title="export", timeout=8)

    def action_filter(self) -> None:
        dash = self.dashboards[self._focused_side()]
        box = dash.query_one("#filter", Input)
        box.display = True
        box.value = dash.query_one(RequestTable).filter_text
        box.focus()

    def action_sort(self) -> None:
        for dash in self.dashboards:
            dash.query_one(RequestTable).cycle_sort()

    def action_reverse(self) -> None:
        for dash in self.dashboards:
            table = dash.query_one(RequestTable)
            table.set_sort(table.sort_key, not table.descending)

    def action_detail(self) -> None:
        side = self._focused_side()
        rid = self.dashboards[side].query_one(RequestTable).selected_rid
        if rid is None:
            self.notify("select a request first (click a row, or tab to the table and use ↑ ↓)", timeout=3)
            return
        self._open_detail(side, rid)

    def action_explain(self) -> None:
        """The selected request's missed prefix tokens by cause (its replay explains them:
        ``--explain``); ``j`` there goes to the eviction that cost it most and selects
        the request whose allocation forced it."""
        side = self._focused_side()
        rid = self.dashboards[side].query_one(RequestTable).selected_rid
        if rid is None:
            self.notify("select a request first (click a row, or tab to the table and use ↑ ↓)", timeout=3)
            return
        self._explain = ExplainScreen(rid, side)

        def closed(target: tuple[int, int] | None) -> None:
            self._explain = None
            if target is not None:
                step, evictor = target
                for dash in self.dashboards:
                    dash.query_one(RequestTable).select_rid(evictor)
                self._all("select", evictor)
                self._all("seek", step)

        self.push_screen(self._explain, closed)
        self.drivers[side].command("explain", rid)

    def _open_detail(self, side: int, rid: int) -> None:
        frame = self.frames[side]
        if frame is None:
            return
        try:
            row = _row_of(frame, rid)
        except KeyError:
            return
        self._detail = RequestDetailScreen(row, side, self._side_label(side), sessions=frame.sessions)

        def closed(_: None) -> None:
            self._detail = None

        self.push_screen(self._detail, closed)
        self.drivers[side].command("history", rid)

    def action_help(self) -> None:
        self.push_screen(HelpScreen(diff=self.report is not None))


def _row_of(frame: Frame, rid: int) -> RequestRow:
    req = frame.requests
    if not 0 <= rid < req.size or req.phase[rid] < 0:
        raise KeyError(rid)
    alloc, used = int(req.allocated[rid]), int(req.committed[rid])
    return RequestRow(rid, PHASES[int(req.phase[rid])], used, alloc, alloc - used, int(req.protected[rid]),
                      -(-alloc // req.page_size), int(req.prefix_hit[rid]), int(req.admitted_step[rid]),
                      int(req.ended_step[rid]), None if req.swa_evicted is None else int(req.swa_evicted[rid]),
                      None if req.mamba_slot is None else int(req.mamba_slot[rid]))


def differing_requests(a: RequestColumns, b: RequestColumns) -> np.ndarray:
    """bool ``[n]`` (index = request id): the requests whose phase, allocated, used or
    protected length differs between two sides' columns (one seen on a side only counts)."""
    n = max(a.phase.shape[0], b.phase.shape[0])
    out = np.zeros(n, bool)
    for name in ("phase", "allocated", "committed", "protected"):
        x, y = getattr(a, name), getattr(b, name)
        fill = -1 if name == "phase" else 0
        xa = np.full(n, fill, x.dtype)
        xa[: x.shape[0]] = x
        yb = np.full(n, fill, y.dtype)
        yb[: y.shape[0]] = y
        out |= xa != yb
    return out


def cell_text(info: CellInfo) -> str:
    """The cell-info line under the page map."""
    tokens = ", ".join(f"{k} {v:,}" for k, v in info.tokens.items())
    if info.detail is None:
        return f"cell: {tokens} (a state log has no slot positions)" if tokens else "no page map here"
    d = info.detail
    owners = ", ".join(f"rid {rid} ({n:,})" for rid, n in d.owners)
    pinned = ", ".join(f"rid {rid} ({n:,})" for rid, n in d.pinned)
    users = ", ".join(f"rid {rid} ({n:,})" for rid, n in d.last_users)
    held = "; ".join(part for part in (owners, pinned and f"pinned by lock: {pinned}",
                                       users and f"evictable, last locked by: {users}") if part)
    return f"pages {d.first_page:,}..{d.last_page:,} at step {info.step}: {tokens}\nowners: {held or 'no request'}"
