"""What crosses a process boundary between kvtrace and the children it starts: jobs,
messages and commands, as frozen dataclasses with one serialisation each.

A contract's wire form is ``to_wire()``: a dict of plain values (numbers, strings,
lists, dicts, numpy arrays, nested contracts' wire forms) with its ``kind``;
``decode(wire)`` (or ``Cls.from_wire``) makes the object again and checks the dict at
the boundary: an unknown kind, an unknown field or a missing one raises
``ContractError`` naming it, rather than a ``KeyError`` somewhere later. Jobs travel as
the JSON of their wire form (a child's first argument); messages and commands travel
pickled over a ``multiprocessing.connection.Connection`` (``kvtrace.proc.channel``):
both ends run this same checkout.

* a ``kvtrace diff`` side (``kvtrace.proc.child``): ``SideJob``; the child answers
  ``Started`` then ``Ended`` (its replay summary) or ``Failed``;
* the dashboard's replay process (``kvtrace.tui.remote.process``): ``DashboardJob``; it
  answers ``Info``, ``Status``, ``Busy``, ``Position``, ``Cells``, ``Cell``,
  ``History``, ``ReplayError``, ``InputWarning`` and ``Explained`` (``DASHBOARD_MESSAGES``; see
  ``kvtrace.tui.remote.replayer``) and hears ``Command``s.

Nothing here imports ``allocator`` (the child imports this before installing its
version's package).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

__all__ = [
    "COMMAND_NAMES", "DASHBOARD_MESSAGES", "Busy", "Cell", "CellDetail", "Cells", "Command", "Contract", "ContractError",
    "DashboardJob", "Ended", "Explained", "Failed", "History", "Info", "InputWarning", "Position", "ReplayError", "SideJob",
    "Started", "Status", "decode",
]


class ContractError(ValueError):
    """A wire form that is not the contract it claims to be (a bug, or two checkouts
    that disagree): names the kind or field at fault and lists the valid ones."""


_KINDS: dict[str, type[Contract]] = {}


class Contract:
    """Base of every record that crosses a process boundary (a frozen dataclass).

    Subclasses set ``KIND`` (unique) and may set ``NESTED`` (field -> the contract its
    wire form holds) for fields that are contracts themselves.
    """

    __slots__ = ()
    KIND: ClassVar[str]
    NESTED: ClassVar[dict[str, type[Contract]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        kind = cls.__dict__.get("KIND")
        if kind is not None:  # (dataclass(slots=True) makes the class again: the last one stays)
            known = _KINDS.get(kind)
            assert known is None or known.__qualname__ == cls.__qualname__, f"two contracts of kind {kind!r}"
            _KINDS[kind] = cls

    def to_wire(self) -> dict[str, Any]:
        """This record as plain values, with its ``kind`` (``from_wire`` reverses it)."""
        wire: dict[str, Any] = {"kind": self.KIND}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            wire[f.name] = value.to_wire() if f.name in self.NESTED and value is not None else value
        return wire

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> Any:
        """The record ``to_wire`` made ``wire`` of.

        Raises:
            ContractError: another kind, an unknown field, or a required one missing.
        """
        if not isinstance(wire, dict):
            raise ContractError(f"a {cls.KIND} message must be a dict, not {type(wire).__name__}")
        kind = wire.get("kind", cls.KIND)
        if kind != cls.KIND:
            raise ContractError(f"expected a {cls.KIND!r} message, got kind {kind!r}")
        fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(k for k in wire if k != "kind" and k not in fields)
        if unknown:
            raise ContractError(f"{cls.KIND} message: unknown field(s) {', '.join(map(repr, unknown))} "
                                f"(valid: {', '.join(fields)})")
        missing = [n for n, f in fields.items() if n not in wire and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ContractError(f"{cls.KIND} message: missing field(s) {', '.join(map(repr, missing))}")
        values = {k: v for k, v in wire.items() if k != "kind"}
        for name, nested in cls.NESTED.items():
            if values.get(name) is not None:
                values[name] = nested.from_wire(values[name])
        return cls(**values)


def decode(wire: Any, expected: tuple[type[Contract], ...] | None = None) -> Any:
    """The contract whose wire form is ``wire`` (its ``kind`` picks the class).

    Args:
        wire: a ``to_wire()`` dict.
        expected: the classes this boundary carries (None: any contract).

    Raises:
        ContractError: not a wire form, an unknown kind (the valid ones listed), or a
            bad field (see ``Contract.from_wire``).
    """
    if not isinstance(wire, dict) or "kind" not in wire:
        raise ContractError(f"not a message (a dict with a 'kind'): {str(wire)[:80]}")
    valid = expected if expected is not None else tuple(_KINDS.values())
    cls = _KINDS.get(wire["kind"])
    if cls is None or cls not in valid:
        raise ContractError(f"unknown message kind {wire['kind']!r} (valid: {', '.join(c.KIND for c in valid)})")
    return cls.from_wire(wire)


# ---------------------------------------------------------------------------- a diff side


@dataclass(frozen=True, slots=True)
class SideJob(Contract):
    """One version replaying one trace in a child (``kvtrace.proc.child``).

    ``allocator_root``: a checkout whose ``allocator`` package the child imports first (a
    ``git:`` revision, a working tree), ``code`` its ``code_identity`` (the child checks
    it imported that); ``checker``: how the steps are checked (``background``,
    ``inline``), or ``checker_fd``: the pipe of an op-sequence checker the parent shares
    between the sides (``traces.checker_process.start_shared_checker``).
    """

    KIND: ClassVar[str] = "side_job"
    trace: str
    spec: str
    label: str
    origin: str = ""
    trace_label: str | None = None
    page_size: int | None = None
    pool_tokens: int | None = None
    device: str = "cpu"
    options: dict[str, Any] = field(default_factory=dict)  # ReplayOptions' fields
    checker: str = "background"
    eviction_policy: str | None = None  # what-if (None: the trace's)
    hicache_ratio: float | None = None  # what-if host tier (None: the trace's)
    hicache_write_policy: str | None = None  # what-if host tier (None: the trace's)
    checker_fd: int | None = None
    steps_per_batch: int = 256
    allocator_root: str | None = None
    code: str | None = None


@dataclass(frozen=True, slots=True)
class Started(Contract):
    """The child set its replay session up."""

    KIND: ClassVar[str] = "start"
    config: dict[str, Any]  # kvtrace.replay.config.config_dict
    label: str
    origin: str


@dataclass(frozen=True, slots=True)
class Ended(Contract):
    """The child's stream ended: its replay summary (``kvtrace replay --json``'s object)."""

    KIND: ClassVar[str] = "end"
    summary: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Failed(Contract):
    """The child stopped on an error; ``user``: bad input (its message is the one line to
    print), else an internal error."""

    KIND: ClassVar[str] = "error"
    error: str
    user: bool
    traceback: str = ""

    @property
    def line(self) -> str:
        """The one line that reports it."""
        return self.error if self.user else f"internal error: {self.error}"


# ---------------------------------------------------------------------------- the dashboard


@dataclass(frozen=True, slots=True)
class DashboardJob(Contract):
    """The dashboard's replay process (``kvtrace.tui.remote.process``): a live replay of
    ``side`` (a diff side's job plus the session's checkpoint pacing and a state log to
    write), or a saved ``state_log``; ``profile``: where to save cProfile statistics of
    the replay (bench/tui.py)."""

    KIND: ClassVar[str] = "dashboard_job"
    NESTED: ClassVar[dict[str, type[Contract]]] = {"side": SideJob}
    play: bool
    side: SideJob | None = None
    state_log: str | None = None
    label: str | None = None
    checkpoint_every: int | None = None
    first_pass_every: int | None = None
    first_pass_seconds: float | None = None
    log: str | None = None
    profile: str | None = None
    explain: bool = False  # attribute every admission's missed tokens (``kvtrace.explain``)

    def __post_init__(self) -> None:
        if (self.side is None) == (self.state_log is None):
            raise ContractError("a dashboard job replays either a side or a state log")

    @property
    def name(self) -> str:
        """How messages name what it replays."""
        if self.side is not None:
            return self.side.trace_label or self.side.trace
        return self.label or str(self.state_log)


@dataclass(frozen=True, slots=True)
class Info(Contract):
    """First message: what the header says about the replay (``SourceInfo``'s fields)."""

    KIND: ClassVar[str] = "info"
    name: str
    source: str
    config: str
    version: str
    first_step: int | None
    last_step: int | None
    live: bool
    page_size: int = 1
    cache: str = ""  # the radix cache where it is not the default (``SourceInfo.cache``)
    explain: bool = False  # the replay explains its misses (answers ``explain``)
    sessions: bool = False  # the trace has streaming sessions (``SourceInfo.sessions``)


@dataclass(frozen=True, slots=True)
class Status(Contract):
    """The play state, when it changes."""

    KIND: ClassVar[str] = "status"
    playing: bool
    speed_index: int
    done: bool


@dataclass(frozen=True, slots=True)
class Busy(Contract):
    """What the replay is busy with, answering no command meanwhile (None: no longer)."""

    KIND: ClassVar[str] = "busy"
    what: str | None


@dataclass(frozen=True, slots=True)
class Position(Contract):
    """Where the replay is after a seek, with the per-request columns there
    (``ReplayState.save()``, cut after the highest request id seen)."""

    KIND: ClassVar[str] = "position"
    step: int | None
    time_s: float
    pool: tuple[int, ...] | None  # PoolCounters' fields
    state_step: int | None
    columns: dict[str, Any]  # name -> numpy array [requests]


@dataclass(frozen=True, slots=True)
class Cells(Contract):
    """The page map at ``step`` (``PageCells``' arrays), or a ``note`` saying why there is none."""

    KIND: ClassVar[str] = "cells"
    step: int | None
    edges: Any = None  # int64 [n + 1]
    tokens: Any = None  # int64 [n, NUM_STATES]
    dominant: Any = None  # int8 [n]
    highlight: Any = None  # bool [n]
    positional: bool = False
    note: str | None = None
    pool: int = 0  # the pool mapped: an index into kvtrace.replay.snapshot.POOL_NAMES
    pinned: Any = None  # bool [n] cells of pages the selected request pins through a radix lock


@dataclass(frozen=True, slots=True)
class CellDetail(Contract):
    """What one cell holds (``kvtrace.tui.remote.pagemap.CellDetail``'s fields)."""

    KIND: ClassVar[str] = "cell_detail"
    index: int
    first_page: int
    last_page: int
    tokens: dict[str, int]
    owners: list[tuple[int, int]]  # (rid, slots)
    pinned: list[tuple[int, int]] = field(default_factory=list)  # (rid, slots) pinned through a radix lock
    last_users: list[tuple[int, int]] = field(default_factory=list)  # (rid, slots) of evictable pages


@dataclass(frozen=True, slots=True)
class Cell(Contract):
    """A clicked cell: its slots per state, and its pages and owners (None: no slot
    positions, a state log)."""

    KIND: ClassVar[str] = "cell"
    NESTED: ClassVar[dict[str, type[Contract]]] = {"detail": CellDetail}
    step: int | None
    tokens: dict[str, int]
    detail: CellDetail | None


@dataclass(frozen=True, slots=True)
class History(Contract):
    """A request's lengths step by step and its events (``(step, kind, rid, tokens,
    detail)``); ``clipped``: only its last steps."""

    KIND: ClassVar[str] = "history"
    rid: int
    steps: Any  # int64 [n]
    allocated: Any  # int64 [n]
    committed: Any  # int64 [n]
    events: list[tuple[Any, ...]]
    clipped: bool


@dataclass(frozen=True, slots=True)
class ReplayError(Contract):
    """An error inside the replay (the replayer pauses), or the process's own ``Failed``."""

    KIND: ClassVar[str] = "failure"
    message: str


@dataclass(frozen=True, slots=True)
class InputWarning(Contract):
    """Once the replay is done: what it left out of a damaged input."""

    KIND: ClassVar[str] = "warning"
    message: str


@dataclass(frozen=True, slots=True)
class Explained(Contract):
    """A request's missed prefix tokens by cause (``kvtrace.explain``: every admission
    replayed so far), and the evictions whose tokens it missed, most first: ``(step,
    trigger, evicting rid, batch size, tokens)``; ``note``: why there is none."""

    KIND: ClassVar[str] = "explained"
    rid: int
    missed: int = 0
    causes: dict[str, int] = field(default_factory=dict)
    evictions: list[tuple[int, str, int, int, int]] = field(default_factory=list)
    note: str | None = None


DASHBOARD_MESSAGES: tuple[type[Contract], ...] = (Info, Status, Busy, Position, Cells, Cell, History, ReplayError,
                                                   InputWarning, Explained)

CommandName = Literal["play", "pause", "toggle", "step", "seek", "speed", "cells", "select", "cell", "history",
                      "refresh", "quit", "pool", "explain"]
# What each command's argument is: "int" (required), "rid" (an int, or None), None (none).
COMMAND_NAMES: dict[str, str | None] = {
    "play": None, "pause": None, "toggle": None, "refresh": None, "quit": None,
    "step": "int",  # N steps (N < 0: back)
    "seek": "int",  # STEP
    "speed": "int",  # DELTA, an index into replayer.SPEEDS
    "cells": "int",  # the page map's size
    "cell": "int",  # INDEX of a cell
    "history": "int",  # RID
    "select": "rid",  # RID or None
    "pool": "int",  # the page map's pool: an index into POOL_NAMES (a hybrid model's)
    "explain": "int",  # RID: its missed tokens by cause (a replay with explain on)
}


@dataclass(frozen=True, slots=True)
class Command(Contract):
    """What the screen asks of the dashboard's replay (``kvtrace.tui.remote.replayer``).

    Raises:
        ContractError: an unknown name (the valid ones listed), or a missing or
            unexpected argument.
    """

    KIND: ClassVar[str] = "command"
    name: CommandName
    arg: int | None = None

    def __post_init__(self) -> None:
        if self.name not in COMMAND_NAMES:
            raise ContractError(f"unknown dashboard command {self.name!r} (valid: {', '.join(COMMAND_NAMES)})")
        takes = COMMAND_NAMES[self.name]
        if takes is None and self.arg is not None:
            raise ContractError(f"dashboard command {self.name!r} takes no argument (got {self.arg!r})")
        if takes == "int" and not isinstance(self.arg, int):
            raise ContractError(f"dashboard command {self.name!r} takes an int (got {self.arg!r})")
        if takes == "rid" and self.arg is not None and not isinstance(self.arg, int):
            raise ContractError(f"dashboard command {self.name!r} takes a request id or None (got {self.arg!r})")
