"""The requests table: one row per request seen, sortable, filterable, virtualised.

Columns: id, phase, an inline bar of used (committed) and over-allocated slots
scaled to the largest allocation shown, used, allocated, over-allocated, pages,
prefix hit, admitted step. A replay of a hybrid SWA model (its frames carry the
requests' SWA cursors) adds, after allocated, the SWA side: ``swa``, the tokens
past the request's SWA cursor (``allocated - swa_evicted_seqlen``: those the
sliding-window layers still hold), and ``swa evicted`` (``swa_evicted_seqlen``);
a replay of a hybrid linear-attention model (its frames carry the requests' Mamba state
slots) adds ``mamba`` there: the request's state slot (``mamba_pool_idx``), or "-" for a
request holding none; a full-attention replay's table has none of them. A trace with
streaming sessions shows a session held between its turns as "held" (its turn finished,
its KV kept): its used length is the KV its session holds, its bar in the session colour.
The selection follows its request across steps; a request whose over-allocation was just
released flashes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from rich.style import Style
from textual.message import Message
from textual.strip import Strip

from kvtrace.replay.snapshot import PHASES
from kvtrace.tui.widgets.page_map import SESSION_COLOR
from kvtrace.tui.widgets.virtual_list import VirtualList, cells

if TYPE_CHECKING:
    from kvtrace.tui.driver import Frame, RequestColumns

__all__ = ["MAMBA_SORT_KEYS", "SORT_KEYS", "RequestFilter", "RequestTable"]

SORT_KEYS = ("id", "phase", "used", "allocated", "over", "pages", "prefix", "admitted")
SWA_SORT_KEYS = ("swa", "swa evicted")  # an SWA replay's table sorts by these too, after "allocated"
_WIDTHS = (8, 10, 14, 9, 11, 8, 8, 8, 10)  # a value as wide as its column would touch the one before
_HEADERS = ("id", "phase", "used|over", "used", "allocated", "over", "pages", "prefix", "admitted")
_SORT_COLUMN = {0: "id", 1: "phase", 3: "used", 4: "allocated", 5: "over", 6: "pages", 7: "prefix", 8: "admitted"}
# An SWA replay's table: the SWA columns go after "allocated" (index 5 on), the rest move
# right; its bar is four cells narrower, so that both SWA columns and "over" fit an
# 80-column terminal.
_SWA_AT = 5
_SWA_WIDTHS = _WIDTHS[:2] + (_WIDTHS[2] - 4,) + _WIDTHS[3:_SWA_AT] + (8, 12) + _WIDTHS[_SWA_AT:]
_SWA_HEADERS = _HEADERS[:_SWA_AT] + SWA_SORT_KEYS + _HEADERS[_SWA_AT:]
_SWA_SORT_COLUMN = {c + 2 * (c >= _SWA_AT): k for c, k in _SORT_COLUMN.items()} | {5: "swa", 6: "swa evicted"}
# A Mamba replay's table: the ``mamba`` column at the same place, the bar four cells narrower.
MAMBA_SORT_KEYS = ("mamba",)
_MAMBA_WIDTHS = _WIDTHS[:2] + (_WIDTHS[2] - 4,) + _WIDTHS[3:_SWA_AT] + (7,) + _WIDTHS[_SWA_AT:]
_MAMBA_HEADERS = _HEADERS[:_SWA_AT] + MAMBA_SORT_KEYS + _HEADERS[_SWA_AT:]
_MAMBA_SORT_COLUMN = {c + (c >= _SWA_AT): k for c, k in _SORT_COLUMN.items()} | {5: "mamba"}
_PHASE_STYLE = {
    "waiting": Style(color="bright_black"),
    "prefill": Style(color="cyan"),
    "decode": Style(color="green"),
    "spec": Style(color="bright_green"),
    "finished": Style(color="bright_black"),
    "retracted": Style(color="yellow"),
    "aborted": Style(color="red"),
    "dropped": Style(color="bright_red"),
    "held": Style(color=SESSION_COLOR),  # a streaming session between turns
}
FLASH_S = 1.0
_USED = Style(color="green")
_HELD = Style(color=SESSION_COLOR)
_OVER = Style(color="yellow")
_DIFFERS = Style(color="bright_magenta", bold=True)  # a diff: this request differs on the other side
_CURSOR = Style(reverse=True)
_FLASH = Style(bgcolor="dark_orange3", color="white", bold=True)
_HEADER = Style(bold=True, underline=True)


class RequestFilter(NamedTuple):
    """A parsed ``/`` filter: phase names, ``live``, ``over`` (over-allocated > 0),
    ``held`` (streaming sessions held between turns), request ids and id ranges ``A-B``;
    a request matches every kind of term given (ids and phases: any of them)."""

    phases: frozenset[int]
    live: bool
    over: bool
    ids: tuple[tuple[int, int], ...]  # inclusive ranges
    held: bool = False

    @classmethod
    def parse(cls, text: str) -> RequestFilter:
        """Raises ValueError naming a term that is none of those."""
        phases: set[int] = set()
        ids: list[tuple[int, int]] = []
        live = over = held = False
        for term in text.lower().split():
            if term in PHASES:
                phases.add(PHASES.index(term))
            elif term == "live":
                live = True
            elif term == "over":
                over = True
            elif term == "held":
                held = True
            elif term.isdigit():
                ids.append((int(term), int(term)))
            elif "-" in term and all(p.isdigit() for p in term.split("-", 1)):
                lo, hi = (int(p) for p in term.split("-", 1))
                ids.append((min(lo, hi), max(lo, hi)))
            else:
                raise ValueError(f"'{term}' is not a phase ({', '.join(PHASES)}), live, over, held, an id or A-B")
        return cls(frozenset(phases), live, over, tuple(ids), held)

    def mask(self, req: RequestColumns) -> np.ndarray:
        """Bool per request id: seen and matching."""
        m = req.phase >= 0
        if self.phases:
            m &= np.isin(req.phase, list(self.phases))
        if self.live:
            m &= (req.allocated > 0) & (req.phase <= PHASES.index("spec"))
        if self.over:
            m &= req.allocated > req.committed
        if self.held:
            m &= req.held()
        if self.ids:
            rid = np.arange(req.size)
            m &= np.logical_or.reduce([(rid >= lo) & (rid <= hi) for lo, hi in self.ids])
        return m


class RequestTable(VirtualList):
    """The requests at the frame shown."""

    class Selected(Message):
        """The selection moved to request ``rid`` (None: cleared)."""

        def __init__(self, table: RequestTable, rid: int | None) -> None:
            super().__init__()
            self.table = table
            self.rid = rid

        @property
        def control(self) -> RequestTable:
            return self.table

    class Opened(Message):
        """Enter on request ``rid`` (show its detail)."""

        def __init__(self, table: RequestTable, rid: int) -> None:
            super().__init__()
            self.table = table
            self.rid = rid

        @property
        def control(self) -> RequestTable:
            return self.table

    def __init__(self, *, id: str | None = None, clock: Callable[[], float] | None = None) -> None:
        super().__init__(id=id)
        self.sort_key = "id"
        self.descending = False
        self.filter = RequestFilter.parse("")
        self.filter_text = ""
        self.selected_rid: int | None = None
        self._req: RequestColumns | None = None
        self._order = np.zeros(0, np.int64)
        self._scale = 1
        self._flash: dict[int, float] = {}
        self._clock_fn = clock
        self._differing: np.ndarray | None = None  # a diff: bool per request id, differs from the other side
        self._sessions = False  # the trace has streaming sessions: a held one reads "held"

    def _clock(self) -> float:
        """The app's clock (``KvtraceApp.clock``; tests fix it), else the monotonic one."""
        if self._clock_fn is not None:
            return self._clock_fn()
        return float(getattr(self.app, "clock", time.monotonic)())

    # ------------------------------------------------------------------ data
    def show(self, frame: Frame) -> None:
        """Show the requests of ``frame`` (keeping the selected request selected)."""
        self._req = frame.requests
        self._sessions = frame.sessions
        now = self._clock()
        for rid in frame.released:
            self._flash[rid] = now + FLASH_S
        self._resort()

    def set_sort(self, key: str, descending: bool | None = None) -> None:
        """Sort by ``key`` (one of ``SORT_KEYS``); the same key again reverses."""
        if descending is None:
            descending = (not self.descending) if key == self.sort_key else key != "id"
        self.sort_key, self.descending = key, descending
        self._resort()

    def cycle_sort(self) -> None:
        keys = self.sort_keys
        self.set_sort(keys[(keys.index(self.sort_key) + 1) % len(keys)] if self.sort_key in keys else keys[0])

    @property
    def swa(self) -> bool:
        """Whether the table shows the SWA columns (the frames carry SWA cursors)."""
        return self._req is not None and self._req.swa_evicted is not None

    @property
    def mamba(self) -> bool:
        """Whether the table shows the ``mamba`` column (the frames carry Mamba slots and
        no SWA cursors: a model has one kind of second pool)."""
        return self._req is not None and self._req.mamba_slot is not None and not self.swa

    @property
    def sort_keys(self) -> tuple[str, ...]:
        """The keys this table sorts by (``SORT_KEYS``, with ``SWA_SORT_KEYS`` after
        ``allocated`` for an SWA replay, ``MAMBA_SORT_KEYS`` for a Mamba one)."""
        extra = SWA_SORT_KEYS if self.swa else MAMBA_SORT_KEYS if self.mamba else ()
        at = SORT_KEYS.index("allocated") + 1
        return SORT_KEYS[:at] + extra + SORT_KEYS[at:]

    @property
    def _widths(self) -> tuple[int, ...]:
        return _SWA_WIDTHS if self.swa else _MAMBA_WIDTHS if self.mamba else _WIDTHS

    @property
    def _sort_column(self) -> dict[int, str]:
        return _SWA_SORT_COLUMN if self.swa else _MAMBA_SORT_COLUMN if self.mamba else _SORT_COLUMN

    def set_filter(self, text: str) -> None:
        """Raises ValueError for a term the filter does not know (the filter stays as it was)."""
        self.filter = RequestFilter.parse(text)
        self.filter_text = text.strip()
        self._resort()

    def _sort_values(self, req: RequestColumns, rids: np.ndarray) -> np.ndarray:
        key = self.sort_key
        if key == "id":
            return rids
        if key == "phase":
            return req.phase[rids]
        if key == "used":
            return req.committed[rids]
        if key == "allocated":
            return req.allocated[rids]
        if key == "over":
            return req.allocated[rids] - req.committed[rids]
        if key == "pages":
            return -(-req.allocated[rids] // req.page_size)
        if key == "prefix":
            return req.prefix_hit[rids]
        if key in SWA_SORT_KEYS and req.swa_evicted is not None:
            evicted = req.swa_evicted[rids]
            return evicted if key == "swa evicted" else np.maximum(req.allocated[rids] - evicted, 0)
        if key == "mamba" and req.mamba_slot is not None:
            return req.mamba_slot[rids]
        return req.admitted_step[rids]

    def _resort(self) -> None:
        req = self._req
        if req is None:
            return
        rids = np.flatnonzero(self.filter.mask(req))
        values = self._sort_values(req, rids)
        if self.sort_key == "id":
            order = rids[::-1] if self.descending else rids
        else:
            idx = np.lexsort((rids, -values if self.descending else values))
            order = rids[idx]
        self._order = order
        self._scale = max(int(req.allocated[order].max()) if order.shape[0] else 1, 1)
        self.num_rows = int(order.shape[0])
        self.refresh_rows()
        self._follow()

    def _follow(self) -> None:
        if self.selected_rid is None:
            self.cursor = -1
            return
        hit = np.flatnonzero(self._order == self.selected_rid)
        self.cursor = int(hit[0]) if hit.shape[0] else -1
        if self.cursor >= 0:
            self.scroll_to_row(self.cursor)

    def set_differing(self, marks: np.ndarray | None) -> None:
        """A diff: mark the requests ``marks`` (bool per request id) says differ from the
        other side's (None: no marks)."""
        same = marks is None and self._differing is None
        if not same:
            self._differing = marks
            self.refresh_rows()

    def differs(self, rid: int) -> bool:
        marks = self._differing
        return marks is not None and rid < marks.shape[0] and bool(marks[rid])

    def select_rid(self, rid: int | None) -> None:
        """Select request ``rid`` (and scroll to it when the filter shows it)."""
        self.selected_rid = rid
        self._follow()
        self._drawn = None
        self.refresh()
        self.post_message(self.Selected(self, rid))

    @property
    def shown_rids(self) -> np.ndarray:
        """Request ids in display order."""
        return self._order

    @property
    def flashing(self) -> set[int]:
        now = self._clock()
        return {rid for rid, until in self._flash.items() if until > now}

    # ------------------------------------------------------------------ VirtualList hooks
    def view_signature(self) -> object:
        req = self._req
        if req is None:
            return None
        return (self.sort_key, self.descending, req.page_size, self.swa, self.mamba)  # the header

    def row_signatures(self, start: int, stop: int) -> list[object]:
        req = self._req
        assert req is not None
        rids = self._order[start:stop]
        alloc, used = req.allocated[rids], req.committed[rids]
        n_used, n_over = _bar_cells(alloc, used, self._scale, self._widths[2] - 2)  # the bars, not their scale: it moves often
        now = self._clock()
        flash = self._flash
        ids = rids.tolist()
        swa = [None] * len(ids) if req.swa_evicted is None else req.swa_evicted[rids].tolist()
        mamba = [None] * len(ids) if req.mamba_slot is None else req.mamba_slot[rids].tolist()
        differs = [self.differs(r) for r in ids] if self._differing is not None else [False] * len(ids)
        return list(zip(ids, alloc.tolist(), used.tolist(), n_used.tolist(), n_over.tolist(),
                        req.phase[rids].tolist(), req.prefix_hit[rids].tolist(), req.admitted_step[rids].tolist(),
                        [flash.get(r, 0.0) > now for r in ids], swa, mamba, differs))

    def on_mount(self) -> None:
        self.set_interval(0.25, self.refresh_rows)  # flashes fade even when no frame comes

    def on_resize(self) -> None:
        self.call_after_refresh(self._follow)  # a selection made before the table had a size

    def on_cursor_moved(self, index: int) -> None:
        self.select_rid(int(self._order[index]))

    def on_activated(self, index: int) -> None:
        self.post_message(self.Opened(self, int(self._order[index])))

    def on_header_click(self, x: int) -> None:
        edge = 0
        sort_column = self._sort_column
        for col, w in enumerate(self._widths):
            edge += w
            if x < edge:
                if col in sort_column:
                    self.set_sort(sort_column[col])
                return

    def render_header(self, width: int) -> Strip:
        arrow = "↓" if self.descending else "↑"
        parts = []
        sort_column = self._sort_column
        headers = _SWA_HEADERS if self.swa else _MAMBA_HEADERS if self.mamba else _HEADERS
        for col, (name, w) in enumerate(zip(headers, self._widths)):
            label = name + (arrow if sort_column.get(col) == self.sort_key else "")
            parts.append((label, w, _HEADER, ">" if col >= 3 else "<"))
        return cells(parts, width, self.base_style)

    def render_row(self, index: int, width: int, selected: bool) -> Strip:
        req = self._req
        assert req is not None
        rid = int(self._order[index])
        alloc = int(req.allocated[rid])
        used = int(req.committed[rid])
        over = alloc - used
        phase = PHASES[int(req.phase[rid])]
        held = self._sessions and phase == "finished" and alloc > 0  # ``RequestColumns.held``
        if held:
            phase = "held"
        admitted = int(req.admitted_step[rid])
        until = self._flash.get(rid)
        base = self.base_style
        if until is not None and until > self._clock():  # type: ignore[operator]
            base = base + _FLASH
        if selected:
            base = base + _CURSOR
        w = self._widths
        n_used, over8 = (int(n) for n in _bar_cells(alloc, used, self._scale, w[2] - 2))
        over_bar = "█" * (over8 // 8) + _EIGHTHS[over8 % 8]
        n_over = len(over_bar)
        parts = [
            (f"{rid} ≠", _WIDTHS[0], _DIFFERS, "<") if self.differs(rid) else (str(rid), _WIDTHS[0], None, "<"),
            (phase, _WIDTHS[1], _PHASE_STYLE.get(phase), "<"),
            ("█" * n_used, n_used, _HELD if held else _USED, "<"),
            (over_bar, n_over, _OVER, "<"),
            ("", w[2] - n_used - n_over, None, "<"),
            (f"{used:,}", _WIDTHS[3], None, ">"),
            (f"{alloc:,}", _WIDTHS[4], None, ">"),
            (f"{over:,}" if over else "·", _WIDTHS[5], _OVER if over else None, ">"),
            (f"{-(-alloc // req.page_size):,}", _WIDTHS[6], None, ">"),
            (f"{int(req.prefix_hit[rid]):,}", _WIDTHS[7], None, ">"),
            (str(admitted) if admitted >= 0 else "·", _WIDTHS[8], None, ">"),
        ]
        if req.swa_evicted is not None:
            evicted = int(req.swa_evicted[rid])
            at = len(parts) - (len(_WIDTHS) - _SWA_AT)  # the parts of the columns after "allocated"
            parts[at:at] = [
                (f"{max(alloc - evicted, 0):,}", _SWA_WIDTHS[_SWA_AT], None, ">"),
                (f"{evicted:,}" if evicted else "·", _SWA_WIDTHS[_SWA_AT + 1], None, ">"),
            ]
        elif self.mamba:
            slot = int(req.mamba_slot[rid])  # type: ignore[index]
            at = len(parts) - (len(_WIDTHS) - _SWA_AT)
            parts[at:at] = [(str(slot) if slot >= 0 else "-", _MAMBA_WIDTHS[_SWA_AT], None, ">")]
        return cells(parts, width, base)


_BAR_W = _WIDTHS[2] - 2  # cells of the used|over bar


def _bar_cells(alloc: np.ndarray | int, used: np.ndarray | int, scale: int,
               bar_w: int = _BAR_W) -> tuple[np.ndarray, np.ndarray]:
    """The bar's used part in cells and its over-allocated part in eighths of a cell
    (arrays or single values), scaled so that ``scale`` slots fill the ``bar_w`` cells of
    the bar. The over part is in proportion (eighths: a few slots of a long request are
    a sliver, not a whole cell); any over-allocation shows at least one eighth."""
    alloc = np.asarray(alloc)
    used = np.asarray(used)
    n_used = np.clip(used * bar_w // scale, 0, bar_w)
    over8 = np.maximum(alloc * bar_w * 8 // scale - n_used * 8, alloc > used)
    return n_used, np.minimum(over8, (bar_w - n_used) * 8)


_EIGHTHS = ("", "▏", "▎", "▍", "▌", "▋", "▊", "▉")  # a cell's left 0/8..7/8
