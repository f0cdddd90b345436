"""The timeline as Trace Event Format JSON (chrome://tracing, Perfetto's legacy importer),
streamed event by event into a ``{"traceEvents": [...]}`` object.

One replay is one process (``ChromeProcess``): a counter event (``ph: C``) per pool with
its counters as series, a hit-rate counter, request slices as ``B`` / ``E`` pairs on one
thread per lane (``tid`` = lane + 1), and instants (``ph: i``) on thread 0, ``events``.
A flow (``--flows``) is a zero-length slice at each end (``X``) bound by ``s`` / ``f``.
Timestamps are microseconds of simulated serving time. Meant for small replays: the
format repeats every name in every event.
"""

from __future__ import annotations

import json
from typing import IO, Any

from kvtrace.export.timeline import COUNTERS, Counters, Flow, HitRate, Instant, Record, SliceBegin, SliceEnd

__all__ = ["ChromeFile", "ChromeProcess"]

_EVENTS_TID = 0


class ChromeFile:
    """A Trace Event Format file being written to ``file`` (text, open for writing);
    ``close()`` ends the JSON object."""

    def __init__(self, file: IO[str]) -> None:
        self._file = file
        self._first = True
        self._pids = 0
        file.write('{"displayTimeUnit": "ms", "traceEvents": [\n')

    def process(self, name: str, pid: int | None = None) -> ChromeProcess:
        """A new process in the file, named ``name`` (pid: 1, 2, ... in order of creation)."""
        self._pids += 1
        return ChromeProcess(self, name, pid=pid or self._pids)

    def event(self, event: dict[str, Any]) -> None:
        """Append one trace event."""
        if not self._first:
            self._file.write(",\n")
        self._first = False
        self._file.write(json.dumps(event, separators=(",", ":")))

    def close(self) -> None:
        self._file.write("\n]}\n")


class ChromeProcess:
    """The events of one replay in a Trace Event Format file; ``write`` one timeline record at a time."""

    def __init__(self, out: ChromeFile, name: str, *, pid: int) -> None:
        self._out = out
        self._pid = pid
        self._lanes = 0
        out.event({"ph": "M", "name": "process_name", "pid": pid, "tid": _EVENTS_TID, "args": {"name": name}})
        out.event({"ph": "M", "name": "thread_name", "pid": pid, "tid": _EVENTS_TID, "args": {"name": "events"}})
        self._dispatch = {
            Counters: self._counters,
            HitRate: self._hit,
            SliceBegin: self._begin,
            SliceEnd: self._end,
            Instant: self._instant,
            Flow: self._flow,
        }

    def write(self, record: Record) -> None:
        """Write one timeline record."""
        self._dispatch[type(record)](record)

    def marker(self, ts_ns: int, name: str, args: dict[str, Any]) -> None:
        """An instant named ``name`` on the events thread (the first divergence of a diff)."""
        self._out.event({"ph": "i", "s": "p", "name": name, "ts": ts_ns / 1000, "pid": self._pid,
                         "tid": _EVENTS_TID, "args": args})

    def _counters(self, rec: Counters) -> None:
        self._out.event({"ph": "C", "name": f"{rec.pool} pool (tokens)", "ts": rec.ts_ns / 1000, "pid": self._pid,
                         "tid": _EVENTS_TID, "args": dict(zip(COUNTERS, rec.values))})

    def _hit(self, rec: HitRate) -> None:
        self._out.event({"ph": "C", "name": "prefix hit rate (%)", "ts": rec.ts_ns / 1000, "pid": self._pid,
                         "tid": _EVENTS_TID, "args": {"hit rate": round(100.0 * rec.value, 4)}})

    def _tid(self, lane: int) -> int:
        while self._lanes <= lane:
            self._out.event({"ph": "M", "name": "thread_name", "pid": self._pid, "tid": self._lanes + 1,
                             "args": {"name": f"lane {self._lanes}"}})
            self._out.event({"ph": "M", "name": "thread_sort_index", "pid": self._pid, "tid": self._lanes + 1,
                             "args": {"sort_index": self._lanes + 1}})
            self._lanes += 1
        return lane + 1

    def _begin(self, rec: SliceBegin) -> None:
        self._out.event({"ph": "B", "name": rec.name, "ts": rec.ts_ns / 1000, "pid": self._pid,
                         "tid": self._tid(rec.lane), "args": rec.args})

    def _end(self, rec: SliceEnd) -> None:
        self._out.event({"ph": "E", "ts": rec.ts_ns / 1000, "pid": self._pid, "tid": self._tid(rec.lane),
                         "args": rec.args})

    def _instant(self, rec: Instant) -> None:
        args: dict[str, Any] = {"tokens": rec.tokens}
        if rec.rid is not None:
            args["rid"] = rec.rid
        if rec.detail:
            args["detail"] = rec.detail
        self._out.event({"ph": "i", "s": "t", "name": rec.kind, "ts": rec.ts_ns / 1000, "pid": self._pid,
                         "tid": _EVENTS_TID, "args": args})

    def _flow(self, rec: Flow) -> None:
        src_tid = _EVENTS_TID if rec.src_lane is None else self._tid(rec.src_lane)
        dst_tid = self._tid(rec.lane)
        flow = {"name": "eviction", "cat": "eviction", "id": rec.flow_id, "pid": self._pid}
        src_ts, dst_ts = rec.src_ts_ns / 1000, rec.ts_ns / 1000
        self._out.event({"ph": "X", "name": "evicted prefix", "ts": src_ts, "dur": 0, "pid": self._pid,
                         "tid": src_tid, "args": rec.src_args})
        self._out.event({"ph": "s", **flow, "ts": src_ts, "tid": src_tid})
        self._out.event({"ph": "X", "name": "missed evicted prefix", "ts": dst_ts, "dur": 0, "pid": self._pid,
                         "tid": dst_tid, "args": rec.args})
        self._out.event({"ph": "f", "bp": "e", **flow, "ts": dst_ts, "tid": dst_tid})
