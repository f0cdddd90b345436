"""What the dashboard replays: a live ``ReplaySession`` or a saved state log.

Both give the driver the same few things: ``step()``, ``seek(step)``, the per-request
fold (``state``), the last snapshot, a description for the header, and the page map
(the live source asks the allocator's slot ownership through ``pagemap.pool_cells``;
a log has only the pool counters, laid out by state).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kvtrace.tui.pagemap import PageCells, SlotMap, composition_cells, pool_cells

if TYPE_CHECKING:
    from kvtrace.logsession import StateLogSession
    from kvtrace.session import ReplaySession
    from kvtrace.snapshot import StepSnapshot
    from kvtrace.state import ReplayState
    from kvtrace.statelog import StateLogWriter

__all__ = ["LiveSource", "LogSource", "ReplaySource", "SourceInfo", "trace_step_range"]


@dataclass(frozen=True, slots=True)
class SourceInfo:
    """What the header says about the replay."""

    name: str  # the trace or log as given
    source: str  # where the traffic came from
    config: str  # pool and page configuration
    version: str  # allocator version
    first_step: int | None
    last_step: int | None
    live: bool  # an allocator runs (False: a saved state log)


class ReplaySource(Protocol):
    """The interface the driver uses (``ReplaySession`` and ``StateLogSession`` behind it)."""

    info: SourceInfo
    state: ReplayState

    @property
    def last(self) -> StepSnapshot | None: ...
    @property
    def done(self) -> bool: ...
    def step(self) -> StepSnapshot | None: ...
    def seek(self, step: int) -> StepSnapshot | None: ...
    def page_map(self, num_cells: int, rid: int | None) -> tuple[SlotMap | None, PageCells] | None: ...
    def close(self) -> None: ...


def _config_line(page_size: int, pool_tokens: int, max_running: int | None, device: str | None) -> str:
    pages = pool_tokens // max(page_size, 1)
    parts = [f"pool {pool_tokens:,} tokens", f"page {page_size}", f"{pages:,} pages"]
    if max_running:
        parts.append(f"{max_running} running max")
    if device:
        parts.append(device)
    return " · ".join(parts)


def trace_step_range(path: str | Path) -> tuple[int, int] | None:
    """First and last step of a trace file (one pass over its record batches, about 0.2 s
    for the one-hour sample; None when the file cannot be read that way: the header then
    shows no total)."""
    import pyarrow as pa

    first = last = None
    try:
        for batch in pa.ipc.open_stream(pa.memory_map(str(path))):
            if batch.num_rows:
                steps = batch.column("step")
                first = int(steps[0].as_py()) if first is None else first
                last = int(steps[-1].as_py())
    except (OSError, pa.ArrowInvalid, KeyError):
        pass  # a damaged tail: what was read stands (the replay reports the damage)
    return (first, last) if first is not None and last is not None else None


class LiveSource:
    """A ``ReplaySession`` (built with ``track_state=True``) as a dashboard source."""

    def __init__(self, session: ReplaySession, log: StateLogWriter | None = None) -> None:
        assert session.state is not None, "the dashboard needs ReplaySession(track_state=True)"
        self.session = session
        self.log = log  # steps replayed for the first time are written here
        self._logged: int | None = None
        cfg = session.config
        src = session.meta.source
        opts = session.options
        rng = trace_step_range(session.reader.path)
        first, last = rng if rng is not None else (None, None)
        if opts.start_step is not None:
            first = opts.start_step if first is None else max(first, opts.start_step)
        if opts.stop_step is not None and last is not None:
            last = min(last, opts.stop_step - 1)
        self.info = SourceInfo(
            name=session.label,
            source=" · ".join(x for x in (src.engine, src.workload, session.meta.model.name) if x),
            config=_config_line(cfg.page_size, cfg.pool_tokens, cfg.max_running, cfg.device),
            version=session.version.spec,
            first_step=first,
            last_step=last,
            live=True,
        )

    @property
    def state(self) -> ReplayState:
        state = self.session.state
        assert state is not None
        return state

    @property
    def last(self) -> StepSnapshot | None:
        return self.session.last

    @property
    def done(self) -> bool:
        return self.session.done

    def step(self) -> StepSnapshot | None:
        snap = self.session.step()
        if snap is not None and self.log is not None and (self._logged is None or snap.step > self._logged):
            self.log.write(snap)
            self._logged = snap.step
        return snap

    def seek(self, step: int) -> StepSnapshot | None:
        frontier = self.state.timeline.last_step
        if self.log is None or frontier is None or step <= frontier:
            return self.session.seek(step)
        self.session.seek(frontier)  # past the frontier: step, so that every new step is logged
        while not self.session.done and self.session.last is not None and self.session.last.step < step:
            if self.step() is None:
                break
        return self.session.last

    def page_map(self, num_cells: int, rid: int | None) -> tuple[SlotMap | None, PageCells] | None:
        return pool_cells(self.session.allocator, num_cells, rid)

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
        self.session.close()


class LogSource:
    """A saved state log (``kvtrace view LOG``): no allocator, so the page map is the
    pool's composition by state."""

    def __init__(self, log: StateLogSession, label: str | None = None) -> None:
        self.log = log
        info: dict[str, Any] = log.info
        cfg = log.config
        self.info = SourceInfo(
            name=label if label is not None else str(log.path),
            source=f"state log of {info.get('trace', '?')}",
            config=_config_line(int(cfg.get("page_size", 1)), int(cfg.get("pool_tokens", 0)), cfg.get("max_running"),
                                cfg.get("device")),
            version=str(info.get("allocator", "?")),
            first_step=log.first_step,
            last_step=log.last_step,
            live=False,
        )

    @property
    def state(self) -> ReplayState:
        return self.log.state

    @property
    def last(self) -> StepSnapshot | None:
        return self.log.last

    @property
    def done(self) -> bool:
        return self.log.done

    def step(self) -> StepSnapshot | None:
        return self.log.step()

    def seek(self, step: int) -> StepSnapshot | None:
        return self.log.seek(step)

    def page_map(self, num_cells: int, rid: int | None) -> tuple[SlotMap | None, PageCells] | None:
        pool = self.log.state.pool
        if pool is None:
            return None
        return None, composition_cells(pool, num_cells)

    def close(self) -> None:
        self.log.close()
