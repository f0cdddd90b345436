"""The arguments and options kvtrace's commands share, each defined once.

A command declares them by type (``json_output: JsonOpt = False``), so every
command spells, documents and checks them the same way. Closed sets are Enums,
so ``--help`` lists their choices; flags are plain booleans, shown as flags.
``examples`` builds the Examples section every command's ``--help`` ends with.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Annotated

import typer

from kvtrace.cli import ui
from traces.samples import SAMPLE_PREFIX, list_samples


class Device(str, Enum):
    """Where the allocator's tensors live."""

    cpu = "cpu"
    cuda = "cuda"


class CheckMode(str, Enum):
    """When the replay checks the allocator's invariants (``kvtrace.replay.engine.CHECK_MODES``)."""

    every = "every"
    full = "full"
    end = "end"
    never = "never"


class OnOom(str, Enum):
    """What the replay does at an out-of-memory."""

    stop = "stop"
    skip = "skip"


class OnBadOp(str, Enum):
    """What the replay does at an impossible op in the trace."""

    stop = "stop"
    skip = "skip"


class Codec(str, Enum):
    """Compression of a trace's record batches."""

    zstd = "zstd"
    lz4 = "lz4"


def examples(*lines: str) -> str:
    """The ``Examples`` section of a command's help (its ``epilog``).

    Args:
        lines: ``"# what it does"`` comments and ``kvtrace …`` command lines.
    """
    body = "\n".join(f"  [dim]{line}[/dim]" if line.startswith("#") else f"  $ {line}" for line in lines)
    return f"[b]Examples[/b]\n\b\n{body}"


def finite(value: float | None) -> float | None:
    """Callback of every float option: NaN and infinities mean nothing to any of them
    (a rate, a factor, a probability, seconds), so they are refused, naming the option.

    Raises:
        typer.BadParameter: ``value`` is NaN or infinite.
    """
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"must be a finite number, found {value}")
    return value


TraceArg = Annotated[
    str,
    typer.Argument(
        metavar="TRACE",
        help=f"A trace file (.kvtrace), or {SAMPLE_PREFIX}NAME for a bundled sample ({', '.join(list_samples())}).",
        show_default=False,
    ),
]
JsonOpt = Annotated[
    bool,
    typer.Option(
        "--json",
        help="Print one JSON object on stdout (numbers rounded); progress and warnings go to stderr.",
        callback=ui.set_json,
    ),
]
QuietOpt = Annotated[
    bool,
    typer.Option(
        "--quiet", "-q", help="No progress bar or notes on stderr (errors and warnings still print).", callback=ui.set_quiet
    ),
]
NoColorOpt = Annotated[
    bool,
    typer.Option("--no-color", help="Plain text without colours (also when NO_COLOR is set).", callback=ui.set_no_color),
]
ForceOpt = Annotated[
    bool,
    typer.Option("--force", help="Replace an existing output file (an input is never overwritten)."),
]
IgnoreMemoryCheckOpt = Annotated[
    bool,
    typer.Option(
        "--ignore-memory-check",
        help="Build the pool even when its estimated memory exceeds what the machine has available "
        "(--force only overwrites).",
    ),
]
DeviceOpt = Annotated[
    Device,
    typer.Option("--device", help="Allocator device: cpu, or cuda (Triton kernels on an NVIDIA GPU)."),
]
WhatIfPageSizeOpt = Annotated[
    int | None,
    typer.Option(
        "--page-size",
        min=1,
        help="What-if: replay the recorded schedule with this page size.",
        show_default="the trace's",
    ),
]
WhatIfPoolTokensOpt = Annotated[
    int | None,
    typer.Option(
        "--pool-tokens",
        min=1,
        help="What-if: replay the recorded schedule with this many KV slots (a smaller pool runs out early).",
        show_default="the trace's",
    ),
]
# The replay options ``kvtrace replay`` declares inline, for commands that replay a trace
# the same way (``kvtrace export``).
CheckOpt = Annotated[
    CheckMode,
    typer.Option(
        "--check",
        help="Invariant checks: every (after each allocator call, what it touched), full (the whole state "
        "after each call), end, never.",
    ),
]
MaxViolationsOpt = Annotated[
    int | None,
    typer.Option("--max-violations", min=1, help="Stop after this many invariant violations.", show_default="no limit"),
]
ExitFirstOpt = Annotated[
    bool, typer.Option("-x", "--exitfirst", help="Stop at the first invariant violation (--max-violations 1).")
]
OnOomOpt = Annotated[OnOom, typer.Option("--on-oom", help="At an out-of-memory: stop, or skip (drop the request).")]
OnBadOpOpt = Annotated[OnBadOp, typer.Option("--on-bad-op", help="At an impossible op in the trace: stop, or skip it.")]
StepsOpt = Annotated[
    str | None,
    typer.Option(
        "--steps",
        help="Replay window A:B (B exclusive); earlier steps run silently, the summary covers the window.",
        show_default="every step",
    ),
]
AllocatorOpt = Annotated[
    str,
    typer.Option(
        "--allocator",
        help="Allocator version: builtin, token, paged[:N], module:factory, file.py:factory (those two execute the "
        "code they name; nothing in a trace is ever executed).",
    ),
]


class EvictionPolicyName(str, Enum):
    """The radix cache's eviction order (``allocator.evict_policy``; SGLang's ``--radix-eviction-policy``)."""

    lru = "lru"
    lfu = "lfu"
    fifo = "fifo"
    mru = "mru"
    filo = "filo"
    priority = "priority"
    slru = "slru"


EvictionPolicyOpt = Annotated[
    EvictionPolicyName | None,
    typer.Option(
        "--eviction-policy",
        help="Radix cache eviction policy (SGLang's --radix-eviction-policy): lru, lfu (fewest hits), fifo, "
        "mru, filo, priority, slru (segmented LRU, protected at 2 hits).",
        show_default="the trace's, else lru",
    ),
]
