"""``kvtrace events check|record``: KV-event streams (SGLang's and vLLM's), checked and recorded.

The library is ``kvtrace.events``; these commands parse options and render.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from kvtrace.cli import KvtraceCommand, add_group, ui
from kvtrace.cli.options import (
    ForceOpt,
    JsonOpt,
    NoColorOpt,
    QuietOpt,
    WhatIfPageSizeOpt,
    WhatIfPoolTokensOpt,
    examples,
    finite,
)

EVENTS_EXAMPLES = examples(
    "# the events SGLang would publish for a replay, then the file checked against the same trace",
    "kvtrace replay sample:mooncake-tiny --kv-events run.kvev",
    "kvtrace events check run.kvev --against sample:mooncake-tiny",
    "# record a live engine's stream (SGLang --kv-events-config), filling gaps through its replay endpoint",
    "kvtrace events record tcp://127.0.0.1:5557 --replay-endpoint tcp://127.0.0.1:5558 --out live.kvev --idle 30",
)

events_app = typer.Typer(
    no_args_is_help=True,
    epilog=EVENTS_EXAMPLES,
    help="KV-event streams (BlockStored / BlockRemoved / AllBlocksCleared, SGLang's and vLLM's schema): "
    "check one, alone or against a replay of a trace; record a live one to a file.",
)
add_group(events_app, "events")

TopicOpt = Annotated[str, typer.Option("--topic", help="The topic (prefix) subscribed to on a live stream.")]
ReplayEndpointOpt = Annotated[Optional[str], typer.Option(
    "--replay-endpoint", metavar="tcp://HOST:PORT",
    help="The publisher's replay endpoint: batches missing from the live stream are asked for there.",
    show_default=False)]
IdleOpt = Annotated[Optional[float], typer.Option(
    "--idle", min=0.0, metavar="SECONDS", help="Stop reading a live stream once this long passes without a batch (counted from the first).",
    show_default="never", callback=finite)]
CountOpt = Annotated[Optional[int], typer.Option(
    "--count", min=1, help="Stop reading a live stream after this many batches.", show_default="no limit")]
DurationOpt = Annotated[Optional[float], typer.Option(
    "--duration", min=0.0, metavar="SECONDS", help="Stop reading a live stream after this long.",
    show_default="until Ctrl-C", callback=finite)]


def _endpoint(value: str, option: str) -> str:
    if not value.startswith("tcp://"):
        raise typer.BadParameter(f"'{value}' is not a tcp://HOST:PORT endpoint", param_hint=option)
    return value


def _until_stopped(frames: Iterable[Any]) -> Iterator[Any]:
    """``frames`` until Ctrl-C or SIGTERM, which end a live stream like its end."""
    import signal

    from kvtrace.errors import Terminated
    from kvtrace.outputs import signals_raise

    it = iter(frames)
    with signals_raise((signal.SIGINT, signal.SIGTERM)):
        while True:
            try:
                frame = next(it)
            except (StopIteration, KeyboardInterrupt, Terminated):
                return
            yield frame


CHECK_EXAMPLES = examples(
    "# a recorded stream, alone: gaps, unknown removes, duplicate stores, mid-chain removals",
    "kvtrace events check live.kvev",
    "# against the replay of the trace that produced it, step by step",
    "kvtrace events check run.kvev --against sample:mooncake-tiny --page-size 1",
    "# a live stream for 60 seconds",
    "kvtrace events check tcp://127.0.0.1:5557 --duration 60",
)


@events_app.command("check", cls=KvtraceCommand, epilog=CHECK_EXAMPLES)
def events_check(
    source: Annotated[str, typer.Argument(metavar="FILE|tcp://HOST:PORT", help="A file of events (kvtrace replay --kv-events, kvtrace events record) or a live publisher.", show_default=False)],
    against: Annotated[Optional[str], typer.Option("--against", metavar="TRACE", help="Replay TRACE and compare the index built from the stream with the replay's cache after every step.", show_default=False)] = None,
    allocator: Annotated[str, typer.Option("--allocator", help="With --against: the allocator version replayed (a built-in one).")] = "builtin",
    page_size: WhatIfPageSizeOpt = None,
    pool_tokens: WhatIfPoolTokensOpt = None,
    topic: TopicOpt = "",
    replay_endpoint: ReplayEndpointOpt = None,
    idle: IdleOpt = None,
    count: CountOpt = None,
    duration: DurationOpt = None,
    quiet: QuietOpt = False,
    no_color: NoColorOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Check a KV-event stream, alone or against a replay of a trace.

    Reports sequence gaps, removes of blocks never stored, duplicate stores, stores
    under unknown parents and mid-chain removals, with AllBlocksCleared applied, per
    medium; with --against, where the index built from the stream and the replay's
    cache differ, step by step, first divergence first.

    Exit code: 0 clean (and identical); 1 problems or divergences; 2 bad input.
    """
    from kvtrace.events.check import check_against, check_stream
    from kvtrace.events.sources import replay_events
    from kvtrace.events.record import Subscription
    from kvtrace.events.wire import is_endpoint, read_frames

    live = is_endpoint(source)
    if live:
        frames: Iterable[Any] = Subscription(_endpoint(source, "SOURCE"), topic=topic.encode(),
                                             replay_endpoint=replay_endpoint, from_seq=0 if replay_endpoint else None,
                                             idle_s=idle, count=count, duration_s=duration)
        frames = _until_stopped(frames)
    else:
        if replay_endpoint is not None or idle is not None or count is not None or duration is not None:
            raise typer.BadParameter(f"{source} is a file; these options are for a live tcp:// stream",
                                     param_hint="--replay-endpoint / --idle / --count / --duration")
        path = Path(source)
        if not path.is_file():
            raise typer.BadParameter(f"{source}: no such file (give a file of events or a tcp:// endpoint)",
                                     param_hint="SOURCE")
        frames = read_frames(path)
    if against is None:
        if page_size is not None or pool_tokens is not None or allocator != "builtin":
            raise typer.BadParameter("these options shape the replay; add --against TRACE",
                                     param_hint="--allocator / --page-size / --pool-tokens")
        with ui.progress(f"checking {source}", count=True) as line:
            result = check_stream(frames, on_frame=lambda f: line(f.seq + 1, f"seq {f.seq:,}"))
    else:
        from kvtrace.replay.session import ReplaySession

        with ReplaySession(against, version=allocator, page_size=page_size, pool_tokens=pool_tokens) as session:
            expected = replay_events(session)  # a trace it cannot derive events from: refused now
            with ui.progress(f"checking {source} against {against}", total=1.0) as line:
                result = check_against(frames, expected,
                                       on_step=lambda step: line(session.progress, f"step {step:,}"))
    summary = {"source": source, **result.to_dict()}
    if against is not None:
        summary["against"]["trace"] = against
    if as_json:
        ui.emit_json(summary)
    else:
        _render_check(summary)
    raise typer.Exit(0 if result.ok else 1)


def _render_check(summary: dict[str, Any]) -> None:
    out = ui.console()
    problems = summary["problems"]
    media = ", ".join(f"{m}: {v['stored']:,} stored, {v['removed']:,} removed, {v['held']:,} held"
                      for m, v in summary["media"].items()) or "no blocks"
    out.print(f"{summary['source']}: {summary['batches']:,} batches, {summary['events']:,} events ({media})",
              markup=False, highlight=False)
    for p in problems[:20]:
        where = f"seq {p['seq']}" + ("" if p["step"] is None else f" (step {p['step']})")
        block = "" if p["block"] is None else f" block {p['block']}"
        medium = "" if p["medium"] is None else f" [{p['medium']}]"
        out.print(f"  {where}: {p['kind']}{medium}{block}: {p['detail']}", markup=False, highlight=False)
    if len(problems) > 20:
        out.print(f"  … and {len(problems) - 20:,} more problems (--json lists them all)", markup=False)
    if not problems:
        out.print("  no problems in the stream", markup=False)
    against = summary["against"]
    if against is None:
        return
    if against["identical"]:
        out.print(f"identical to the replay of {against['trace']} over its {against['batches']:,} batches",
                  markup=False, highlight=False)
        return
    first = against["first_divergence"]
    step = "after the replay's last batch" if first["step"] is None else f"at step {first['step']}"
    out.print(f"differs from the replay of {against['trace']} {step} (seq {first['seq']}): {first['blocks']:,} "
              f"block(s) held by one side only; {against['divergent_steps']:,} divergent step(s)",
              markup=False, highlight=False)
    for d in against["divergences"][:5]:
        where = "end" if d["step"] is None else f"step {d['step']}"
        sides = [f"stream only {b['block']} [{b['medium']}]" for b in d["stream_only"][:2]]
        sides += [f"replay only {b['block']} [{b['medium']}]" for b in d["replay_only"][:2]]
        out.print(f"  {where}: {d['blocks']:,} block(s): {'; '.join(sides)}", markup=False, highlight=False)


RECORD_EXAMPLES = examples(
    "# record until 30 s pass without a batch",
    "kvtrace events record tcp://127.0.0.1:5557 --out live.kvev --idle 30",
    "# from the publisher's first batch on, gaps filled through its replay endpoint",
    "kvtrace events record tcp://127.0.0.1:5557 --replay-endpoint tcp://127.0.0.1:5558 --from-seq 0 --out live.kvev",
)


@events_app.command("record", cls=KvtraceCommand, epilog=RECORD_EXAMPLES)
def events_record(
    endpoint: Annotated[str, typer.Argument(metavar="tcp://HOST:PORT", help="The publisher's PUB endpoint (SGLang --kv-events-config endpoint, kvtrace replay --kv-events).", show_default=False)],
    out: Annotated[Path, typer.Option("--out", "-o", help="The file of events to write.", show_default=False)],
    force: ForceOpt = False,
    topic: TopicOpt = "",
    replay_endpoint: ReplayEndpointOpt = None,
    from_seq: Annotated[Optional[int], typer.Option("--from-seq", min=0, help="With --replay-endpoint: also fetch the batches from this sequence number up to the first one received.", show_default=False)] = None,
    idle: IdleOpt = None,
    count: CountOpt = None,
    duration: DurationOpt = None,
    quiet: QuietOpt = False,
    no_color: NoColorOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Record a live KV-event stream to a file.

    Batch by batch: Ctrl-C or SIGTERM ends it with every batch received on disk.
    Sequence gaps are filled through the publisher's replay endpoint where it has one.

    Exit code: 0 recorded (a gap that could not be filled is a warning; kvtrace events
    check reports it); 2 bad input.
    """
    from kvtrace.events.record import Subscription
    from kvtrace.events.wire import EventFileWriter
    from kvtrace.outputs import OutputFile

    _endpoint(endpoint, "ENDPOINT")
    if replay_endpoint is not None:
        _endpoint(replay_endpoint, "--replay-endpoint")
    if from_seq is not None and replay_endpoint is None:
        raise typer.BadParameter("earlier batches come from the replay endpoint; add --replay-endpoint",
                                 param_hint="--from-seq")
    target = OutputFile(out, force=force)
    sub = Subscription(endpoint, topic=topic.encode(), replay_endpoint=replay_endpoint, from_seq=from_seq,
                       idle_s=idle, count=count, duration_s=duration)
    t0 = time.perf_counter()
    with target.recording() as path, open(path, "wb") as f:
        writer = EventFileWriter(f)
        with ui.progress(f"recording {endpoint}", count=True) as line:
            for frame in _until_stopped(sub):
                writer.write(frame)
                writer.flush()
                line(sub.frames, f"seq {frame.seq:,}")
    summary = {"out": str(out), "frames": sub.frames, "recovered": sub.recovered,
               "lost": [{"first": a, "last": b} for a, b in sub.lost], "wall_s": time.perf_counter() - t0}
    for a, b in sub.lost:
        ui.warn(f"batches {a}..{b} were never received (no replay endpoint, or it no longer had them)")
    if as_json:
        ui.emit_json(summary)
    else:
        ui.console().print(f"recorded {sub.frames:,} batches to {out} ({sub.recovered:,} through the replay endpoint)",
                           markup=False, highlight=False)
