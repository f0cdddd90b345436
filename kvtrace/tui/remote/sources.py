"""What the dashboard replays: a live ``ReplaySession`` or a saved state log.

Both give the replayer (``kvtrace.tui.remote.replayer``) the same few things: ``step()``,
``seek(step)``, the per-request fold (``state``), the last snapshot, a description for
the header, and the page map (the live source asks the allocator's slot ownership
through ``pagemap.page_map``; a log has only the pool counters, laid out by state).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kvtrace.tui.remote.pagemap import PageCells, composition_cells, page_map

if TYPE_CHECKING:
    from allocator.ownership import SlotOwnership
    from kvtrace.explain.attribution import Attribution
    from kvtrace.statelog.session import StateLogSession
    from kvtrace.replay.session import ReplaySession
    from kvtrace.replay.snapshot import SnapshotBlock, StepSnapshot
    from kvtrace.replay.state import ReplayState
    from kvtrace.statelog.log import StateLogWriter

__all__ = ["LiveSource", "LogSource", "ReplaySource", "SourceInfo", "cache_line", "num_namespaces", "trace_step_range"]


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
    page_size: int = 1
    cache: str = ""  # the radix cache where it is not the default: 'slru · 3 namespaces' (``cache_line``)
    explain: bool = False  # the replay explains its misses (``LiveSource.explain``)
    # the trace has streaming sessions: the dashboard shows the KV they hold between turns
    sessions: bool = False


class ReplaySource(Protocol):
    """The interface the driver uses (``ReplaySession`` and ``StateLogSession`` behind it)."""

    info: SourceInfo
    state: ReplayState

    @property
    def last(self) -> StepSnapshot | None: ...
    @property
    def done(self) -> bool: ...
    @property
    def allocator_step(self) -> int | None:
        """The step the page map would show (a live replay's allocator may run ahead of
        ``last`` inside a run of decode steps replayed in one call)."""
        ...
    @property
    def end_note(self) -> str | None:
        """Once the replay is done: what it left out of a damaged input (None: nothing)."""
        ...
    def set_exact(self, exact: bool) -> None:
        """Keep the allocator at the step returned (paused: the page map is exact), or let
        runs of decode steps replay in one call (playing: as fast as ``kvtrace replay``)."""
        ...
    def step(self) -> StepSnapshot | None: ...
    def seek(self, step: int) -> StepSnapshot | None: ...
    def page_map(self, num_cells: int, rid: int | None,
                 pool: int = 0) -> tuple[SlotOwnership | None, PageCells] | None:
        """The page map of pool ``pool`` (an index into ``POOL_NAMES``), with the slot
        ownership it was reduced from when the source has slots; None when there is none
        (a version without ``slot_ownership()``, or without that pool's)."""
        ...
    def close(self) -> None: ...


def _config_line(page_size: int, pool_tokens: int, max_running: int | None, device: str | None) -> str:
    pages = pool_tokens // max(page_size, 1)
    parts = [f"pool {pool_tokens:,} tokens", f"page {page_size}", f"{pages:,} pages"]
    if max_running:
        parts.append(f"{max_running} running max")
    if device:
        parts.append(device)
    return " · ".join(parts)


def cache_line(eviction_policy: str | None, namespaces: int) -> str:
    """The radix cache where it is not the default one (LRU eviction, no namespace):
    'slru · 3 namespaces', 'lfu', '1 namespace'; '' for the default."""
    parts = []
    if eviction_policy is not None and eviction_policy != "lru":
        parts.append(eviction_policy)
    if namespaces:
        parts.append(f"{namespaces} namespace{'s' if namespaces > 1 else ''}")
    return " · ".join(parts)


def num_namespaces(meta: Any) -> int:
    """The cache namespaces a trace's requests use (``TraceMeta.namespaces``; 0: none), as a
    state log's info records them for ``kvtrace view`` (key ``namespaces``)."""
    table = getattr(meta, "namespaces", None)
    return 0 if table is None else len(table.names)


def trace_step_range(path: str | Path) -> tuple[int, int] | None:
    """First and last step of a trace file, an IPC stream or file (one pass over its record
    batches, cheap next to the replay; None when it cannot be read:
    the header then shows no total)."""
    from traces.arrow_arrays import numpy_view
    from traces.errors import TraceError
    from traces.ipc import IpcReader

    first = last = None
    try:
        for batch in IpcReader(path).iter_batches():
            if batch.num_rows:
                steps = numpy_view(batch.column("step"))
                first = int(steps[0]) if first is None else first
                last = int(steps[-1])
    except (OSError, KeyError, TraceError):
        pass  # a damaged tail: what was read stands (the replay reports the damage)
    return (first, last) if first is not None and last is not None else None


class LiveSource:
    """A ``ReplaySession`` (built with ``track_state=True``) as a dashboard source."""

    def __init__(self, session: ReplaySession, log: StateLogWriter | None = None, *, explain: bool = False) -> None:
        """``explain``: attribute every admission's missed tokens (``self.explain``, an
        ``Attribution`` watching the session; ``kvtrace replay --tui --explain``).

        Raises:
            ConfigError: ``explain`` with an allocator without a radix cache.
        """
        assert session.state is not None, "the dashboard needs ReplaySession(track_state=True)"
        self.session = session
        self.log = log  # steps replayed for the first time are written here
        self.explain: Attribution | None = None
        if explain:
            from kvtrace.explain.attribution import Attribution

            self.explain = Attribution.attach(session, keep_request_evictions=True)
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
            cache=cache_line(getattr(cfg, "eviction_policy", None), num_namespaces(session.meta)),
            version=session.version.spec,
            first_step=first,
            last_step=last,
            live=True,
            page_size=cfg.page_size,
            explain=explain,
            sessions=bool(session.meta.config.sessions),
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

    @property
    def allocator_step(self) -> int | None:
        return self.session.allocator_step

    @property
    def end_note(self) -> str | None:
        from kvtrace.replay.session import TRUNCATED_NOTE

        return TRUNCATED_NOTE if self.session.done and self.session.reader.truncated else None

    def set_exact(self, exact: bool) -> None:
        self.session.allocator_in_step = exact

    def step(self) -> StepSnapshot | None:
        snap = self.session.step()
        if snap is not None and self.log is not None and (self._logged is None or snap.step > self._logged):
            self.log.write(snap)
            self._logged = snap.step
        return snap

    def take_block(self) -> SnapshotBlock | None:
        """The steps returned since the last block, as one (``ReplaySession.take_block``)."""
        return self.session.take_block()

    def fill_checkpoints(self) -> bool:
        """Checkpoints up to the step shown at the session's full density
        (``ReplaySession.fill_checkpoints``)."""
        return self.session.fill_checkpoints()

    def seek(self, step: int) -> StepSnapshot | None:
        frontier = self.state.timeline.last_step
        if self.log is None or frontier is None or step <= frontier:
            return self.session.seek(step)
        self.session.seek(frontier)  # past the frontier: step, so that every new step is logged
        while not self.session.done and self.session.last is not None and self.session.last.step < step:
            if self.step() is None:
                break
        return self.session.last

    def page_map(self, num_cells: int, rid: int | None,
                 pool: int = 0) -> tuple[SlotOwnership | None, PageCells] | None:
        return page_map(self.session.allocator, num_cells, rid, pool)

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
        self.session.close()


def _has_sessions(log: StateLogSession) -> bool:
    """Whether a state log is of a trace with streaming sessions: its schema has the
    ``session_held`` counter (``kvtrace.statelog.log``: only such a log has it)."""
    from kvtrace.statelog.log import SESSION_HELD, open_state_log

    _, reader = open_state_log(log.path)
    return SESSION_HELD in reader.schema.names


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
            cache=cache_line(cfg.get("eviction_policy"), int(info.get("namespaces") or 0)),
            version=str(info.get("allocator", "?")),
            first_step=log.first_step,
            last_step=log.last_step,
            live=False,
            page_size=int(cfg.get("page_size", 1)),
            sessions=_has_sessions(log),
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

    @property
    def allocator_step(self) -> int | None:
        last = self.log.last
        return None if last is None else last.step

    @property
    def end_note(self) -> str | None:
        return None  # a log cut short reads to its last complete batch; its header says how far

    def set_exact(self, exact: bool) -> None:
        pass  # a log has no allocator

    def step(self) -> StepSnapshot | None:
        return self.log.step()

    def seek(self, step: int) -> StepSnapshot | None:
        return self.log.seek(step)

    def page_map(self, num_cells: int, rid: int | None,
                 pool: int = 0) -> tuple[SlotOwnership | None, PageCells] | None:
        state = self.log.state
        counters = (state.pool, *state.other_pools)
        if state.pool is None or pool >= len(counters):
            return None
        return None, composition_cells(counters[pool], num_cells)

    def close(self) -> None:
        self.log.close()
