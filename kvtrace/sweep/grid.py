"""A sweep's grid: inputs x allocator versions x pool sizes x page sizes x speculative
settings x request rows x chunk sizes x eviction policies (x, on hybrid sliding-window
traces, windows x SWA/full pool ratios) x HiCache host-tier ratios x write policies,
one ``Cell`` per combination.

An input is *simulated* (a workload file: the scheduler model runs under the cell's
configuration, as ``kvtrace record`` does) or *replayed* (a trace: its recorded
schedule through the cell's allocator, as ``kvtrace replay`` does; ``reschedule``
simulates a trace instead, as ``kvtrace record TRACE`` does). An axis left out
(None) keeps the input's own value. Everything here is plain data: cells travel to
worker processes and Ray tasks.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from itertools import product
from typing import Any, Literal

__all__ = [
    "PARAM_PREFIX",
    "Cell",
    "Grid",
    "SweepInput",
    "SweepSettings",
    "parse_counts",
    "parse_hicache_ratios",
    "parse_ratios",
    "parse_specs",
]

CellKind = Literal["simulate", "replay"]
PARAM_PREFIX = "param."  # result columns of the cell's requested parameters
_SUFFIX = {"": 1, "k": 1_000, "m": 1_000_000, "g": 1_000_000_000}
_COUNT = re.compile(r"(\d+(?:\.\d+)?)([kmg]?)", re.IGNORECASE)
_SPEC = re.compile(r"off|none|[a-z0-9]+:\d+,\d+,\d+", re.IGNORECASE)


def parse_counts(text: str, option: str, *, minimum: int = 1) -> list[int]:
    """``"100k,400k,1M"`` -> ``[100000, 400000, 1000000]`` (k, M, G: powers of 1,000).

    Raises:
        ValueError: a value that is not a count, a fraction of a unit, below
            ``minimum``, or repeated (the message names ``option``).
    """
    values: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        match = _COUNT.fullmatch(part)
        if match is None:
            raise ValueError(f"{option}: {part!r} is not a count; give integers such as 64, 100k, 1M, comma-separated")
        number = float(match.group(1)) * _SUFFIX[match.group(2).lower()]
        if not number.is_integer():
            raise ValueError(f"{option}: {part!r} is not a whole number of tokens")
        value = int(number)
        if value < minimum:
            raise ValueError(f"{option}: {part!r} must be at least {minimum}")
        if value in values:
            raise ValueError(f"{option}: {part!r} is given twice")
        values.append(value)
    return values


def _parse_floats(text: str, option: str, ok: Callable[[float], bool], what: str) -> list[float]:
    """A comma-separated list of distinct floats each ``ok``; the message names ``option``
    and says ``what`` a value must be (with an example)."""
    values: list[float] = []
    for part in (p.strip() for p in text.split(",")):
        try:
            value = float(part)
        except ValueError:
            value = float("nan")
        if not ok(value):  # NaN fails every bound
            raise ValueError(f"{option}: {part!r} is not {what}, comma-separated")
        if value in values:
            raise ValueError(f"{option}: {part!r} is given twice")
        values.append(value)
    return values


def parse_ratios(text: str, option: str) -> list[float]:
    """``"0.5,0.8"`` -> ``[0.5, 0.8]``: SWA/full pool ratios, each in (0, 1].

    Raises:
        ValueError: a value that is not such a ratio, or repeated (the message names ``option``).
    """
    return _parse_floats(text, option, lambda v: 0 < v <= 1, "a ratio in (0, 1]; give e.g. 0.5,0.8")


def parse_hicache_ratios(text: str, option: str) -> list[float]:
    """``"0,1,2,4"`` -> ``[0.0, 1.0, 2.0, 4.0]``: host pool tokens per device pool token;
    0 is no host tier.

    Raises:
        ValueError: a value that is not such a ratio, or repeated (the message names ``option``).
    """
    from traces.hicache_layout import MAX_HICACHE_RATIO

    return _parse_floats(text, option, lambda v: 0 <= v <= MAX_HICACHE_RATIO,
                         f"a ratio in [0, {MAX_HICACHE_RATIO:g}] (0: no host tier); give e.g. 0,1,2,4")


def parse_specs(text: str) -> list[str]:
    """``"off,eagle:3,1,4,eagle:5,4,8"`` -> ``["off", "eagle:3,1,4", "eagle:5,4,8"]``
    (the commas inside a setting belong to it).

    Raises:
        ValueError: text that is not such a list.
    """
    found = [m.group(0).lower() for m in _SPEC.finditer(text)]
    if ",".join(found) != text.strip().lower() or not found:
        raise ValueError(
            f"--spec: {text!r} is not a comma-separated list of off and ALGORITHM:STEPS,TOPK,DRAFT "
            "(e.g. off,eagle:3,1,4)"
        )
    return ["off" if s == "none" else s for s in found]


@dataclass(frozen=True, slots=True)
class SweepInput:
    """One input of a sweep: as given (the label in results), its file, and how it runs.

    Attributes:
        label: the argument as given (a path or ``sample:NAME``).
        path: the file.
        fmt: ``trace``, or the workload format (``mooncake``, ``azure``, ``lengths``).
        kind: ``simulate`` or ``replay``.
        stamp: the file's size and modification time: a changed file is a new input,
            whose cells run again.
    """

    label: str
    path: str
    fmt: str
    kind: CellKind
    stamp: str = ""


@dataclass(frozen=True, slots=True)
class SweepSettings:
    """What every cell shares (not an axis). A sweep resumed with other settings would
    mix incomparable cells, so they are part of every cell's key.

    Attributes:
        check, on_oom, device: replayed cells, as ``kvtrace replay``.
        duration_s, time_scale, rate, seed: simulated cells, as ``kvtrace record``.
        keep_traces: a directory where simulated cells keep their traces (None: none).
        explain: replayed cells also run ``kvtrace explain`` (its causes and the oracle
            gaps: LRU, Belady and infinite-cache hit rates, as ``explain.*`` columns).
    """

    check: str = "end"
    on_oom: str = "stop"
    device: str = "cpu"
    duration_s: float | None = None
    time_scale: float = 1.0
    rate: float | None = None
    seed: int | None = None
    keep_traces: str | None = None
    explain: bool = False

    def fingerprint(self) -> dict[str, Any]:
        """The settings that change a cell's numbers (``keep_traces`` does not)."""
        out = asdict(self)
        del out["keep_traces"]
        if not self.explain:  # the keys of sweeps without it stay what they were
            del out["explain"]
        return out


@dataclass(frozen=True, slots=True)
class Cell:
    """One run of a sweep: an input under one configuration (None: the input's own).

    ``swa_window`` / ``swa_full_tokens_ratio`` change a hybrid (SWA) model's sliding
    window and its SWA pool's share of the full pool; they join ``params()`` only when
    set, so the cells (and keys) of other sweeps stay what they were. So do
    ``hicache_ratio`` (host pool tokens per device pool token; 0: no host tier) and
    ``hicache_write_policy`` (SGLang's ``--hicache-write-policy``).
    """

    input: SweepInput
    version: str = "builtin"
    pool_tokens: int | None = None
    page_size: int | None = None
    spec: str | None = None
    max_running: int | None = None
    chunk: int | None = None
    settings: SweepSettings = field(default_factory=SweepSettings)
    swa_window: int | None = None
    swa_full_tokens_ratio: float | None = None
    eviction_policy: str | None = None
    hicache_ratio: float | None = None
    hicache_write_policy: str | None = None

    @property
    def kind(self) -> CellKind:
        return self.input.kind

    def params(self) -> dict[str, Any]:
        """The cell's parameters as result columns (``param.version``, …)."""
        swa = {"swa_window": self.swa_window, "swa_full_tokens_ratio": self.swa_full_tokens_ratio}
        tier = {"hicache_ratio": self.hicache_ratio, "hicache_write_policy": self.hicache_write_policy}
        return {
            PARAM_PREFIX + "version": self.version,
            PARAM_PREFIX + "pool_tokens": self.pool_tokens,
            PARAM_PREFIX + "page_size": self.page_size,
            PARAM_PREFIX + "spec": self.spec,
            PARAM_PREFIX + "max_running": self.max_running,
            PARAM_PREFIX + "chunk": self.chunk,
            **{PARAM_PREFIX + k: v for k, v in swa.items() if v is not None},
            PARAM_PREFIX + "eviction_policy": self.eviction_policy,
            **{PARAM_PREFIX + k: v for k, v in tier.items() if v is not None},
        }

    @property
    def key(self) -> str:
        """A stable id of the cell's input, kind, parameters and settings."""
        ident = {
            "input": self.input.label,
            "stamp": self.input.stamp,
            "kind": self.kind,
            **self.params(),
            "settings": self.settings.fingerprint(),
        }
        if self.eviction_policy is None:  # the input's own: the key cells had before the axis
            del ident[PARAM_PREFIX + "eviction_policy"]
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]

    def describe(self) -> str:
        """One line for messages: the input and the parameters that are set."""
        parts = [f"{k.removeprefix(PARAM_PREFIX)}={v}" for k, v in self.params().items() if v is not None]
        return f"{self.input.label} ({self.kind}; {', '.join(parts)})"


@dataclass(frozen=True, slots=True)
class Grid:
    """The axes of a sweep; ``cells()`` is every combination, in a stable order."""

    inputs: tuple[SweepInput, ...]
    versions: tuple[str, ...] = ("builtin",)
    pool_tokens: tuple[int | None, ...] = (None,)
    page_sizes: tuple[int | None, ...] = (None,)
    specs: tuple[str | None, ...] = (None,)
    max_running: tuple[int | None, ...] = (None,)
    chunks: tuple[int | None, ...] = (None,)
    settings: SweepSettings = field(default_factory=SweepSettings)
    swa_windows: tuple[int | None, ...] = (None,)
    swa_ratios: tuple[float | None, ...] = (None,)
    eviction_policies: tuple[str | None, ...] = (None,)
    hicache_ratios: tuple[float | None, ...] = (None,)
    hicache_write_policies: tuple[str | None, ...] = (None,)

    def cells(self) -> list[Cell]:
        """Every combination: inputs outermost, host-tier write policies innermost. A
        host-tier ratio of 0 (no tier) has no write policy: one cell, not one per policy."""
        cells: list[Cell] = []
        for source, version, pool, page, spec, rows, chunk, window, ratio, policy, host, write in product(
            self.inputs, self.versions, self.pool_tokens, self.page_sizes, self.specs, self.max_running, self.chunks,
            self.swa_windows, self.swa_ratios, self.eviction_policies, self.hicache_ratios, self.hicache_write_policies,
        ):
            cell = Cell(source, version, pool, page, spec, rows, chunk, self.settings, window, ratio, policy,
                        host, None if host == 0 else write)
            if cell not in cells:
                cells.append(cell)
        return cells
