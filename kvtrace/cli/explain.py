"""``kvtrace explain``: why each admission's prefix missed, who evicted it, and how far the
cache is from the best possible (``kvtrace.explain``).

The replay pipeline is imported inside the command, when it runs.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from kvtrace.cli import command, ui
from kvtrace.cli.options import (
    AllocatorOpt,
    CheckMode,
    CheckOpt,
    Device,
    DeviceOpt,
    ExitFirstOpt,
    IgnoreMemoryCheckOpt,
    JsonOpt,
    MaxViolationsOpt,
    NoColorOpt,
    OnBadOp,
    OnBadOpOpt,
    OnOom,
    OnOomOpt,
    QuietOpt,
    StepsOpt,
    TraceArg,
    WhatIfPageSizeOpt,
    WhatIfPoolTokensOpt,
    examples,
)
from kvtrace.cli.replay import check_device, parse_step_range, warn_truncated

EXPLAIN_EXAMPLES = examples(
    "# why prefixes missed on a bundled sample, with its recorded configuration",
    "kvtrace explain sample:mooncake-pressure",
    "# the same on a larger pool: how much of the miss was capacity",
    "kvtrace explain sample:mooncake-pressure --pool-tokens 200000",
    "# as JSON, without the Belady oracle (the slowest part)",
    "kvtrace explain run.kvtrace --no-belady --json",
)

BeladyOpt = Annotated[
    bool,
    typer.Option("--belady/--no-belady", help="Run Belady's optimal eviction over the trace's future (the oracles' slowest part)."),
]


@command("explain", epilog=EXPLAIN_EXAMPLES)
def explain(
    trace: TraceArg,
    page_size: WhatIfPageSizeOpt = None,
    pool_tokens: WhatIfPoolTokensOpt = None,
    device: DeviceOpt = Device.cpu,
    check: CheckOpt = CheckMode.end,
    max_violations: MaxViolationsOpt = None,
    first_violation: ExitFirstOpt = False,
    on_oom: OnOomOpt = OnOom.stop,
    on_bad_op: OnBadOpOpt = OnBadOp.stop,
    steps: StepsOpt = None,
    allocator: AllocatorOpt = "builtin",
    ignore_memory_check: IgnoreMemoryCheckOpt = False,
    belady: BeladyOpt = True,
    quiet: QuietOpt = False,
    no_color: NoColorOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Replay TRACE and explain its prefix misses: every admission's missed tokens by cause
    (cold, page-size floor, in flight, evicted, out of the SWA window, recomputed after a
    retraction; they sum to the missed tokens), the evictions that cost the most, the hit
    rates of an infinite cache, LRU and Belady's optimal eviction with the same pool, and
    the age and reuse histograms.

    Every replay option applies, as in kvtrace replay. With --json the object holds the
    report's keys and the replay's summary under "replay".

    Exit code: 0 explained; 1 explained, and the replay found violations, an out-of-memory
    (with --on-oom stop) or skipped bad ops; 2 bad input.
    """
    from kvtrace.replay.engine import ReplayOptions
    from kvtrace.replay.session import ReplaySession

    start, stop = parse_step_range(steps)
    check_device(device.value)
    options = ReplayOptions(
        check=check.value,  # type: ignore[arg-type]
        on_oom=on_oom.value,  # type: ignore[arg-type]
        on_bad_op=on_bad_op.value,  # type: ignore[arg-type]
        start_step=start,
        stop_step=stop,
        max_violations=1 if first_violation else max_violations,
    )
    with ReplaySession(trace, version=allocator, page_size=page_size, pool_tokens=pool_tokens, device=device.value,
                       options=options, force_memory=ignore_memory_check) as session:
        summary, report, failed = run_explained(session, belady=belady)
    if summary["truncated"]:
        warn_truncated(trace)
    out = {"trace": str(trace), **report, "replay": summary}
    if as_json:
        ui.emit_json(out)
    else:
        from kvtrace.explain.report import print_report

        print_report(report, ui.console(), f"kvtrace explain {trace}")
    raise typer.Exit(1 if failed else 0)


def run_explained(session: Any, *, belady: bool = True) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """Replay ``session`` to its end with explain attached, with progress; return the
    replay's summary, the explain report's JSON object, and whether the replay failed."""
    from kvtrace.cli.replay import _run
    from kvtrace.explain.report import Explainer

    explainer = Explainer(session, belady=belady)
    _run(session, None)
    result = session.result()
    with ui.progress("oracles"):
        report = explainer.report().to_dict()
    return result.to_dict(), report, bool(result.failed)
