"""``kvtrace shrink``: reduce a failing trace to the smallest one that fails the same
way, and optionally write it as a pytest regression test.

The command parses options and renders; ``kvtrace.shrink`` does the work. Exit
codes: 0 shrunk, 1 the failure did not reproduce on the input, 2 bad input.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from kvtrace.cli import command, ui
from kvtrace.cli.options import (
    Device,
    DeviceOpt,
    ForceOpt,
    JsonOpt,
    NoColorOpt,
    QuietOpt,
    TraceArg,
    WhatIfPageSizeOpt,
    WhatIfPoolTokensOpt,
    examples,
    finite,
)

if TYPE_CHECKING:
    from rich.console import Console

    from kvtrace.shrink import Progress, ShrinkResult

SHRINK_EXAMPLES = examples(
    "# the smallest trace on which a broken allocator still breaks an invariant",
    "kvtrace shrink run.kvtrace --until violation --allocator mine.py:create --out small.kvtrace",
    "# keep one invariant check, stop after two minutes, write a regression test",
    "kvtrace shrink run.kvtrace --until violation:ownership --allocator mine.py:create --max-time 120 "
    "--emit-test tests/regress/test_ownership.py",
    "# the smallest trace on which two versions diverge",
    "kvtrace shrink sample:mooncake-eagle --until divergence --a builtin --b pre-encapsulation --out div.kvtrace",
    "# the smallest trace that runs out of memory in a 50,000-token pool",
    "kvtrace shrink run.kvtrace --until oom --pool-tokens 50000 --out oom.kvtrace",
)


@command("shrink", epilog=SHRINK_EXAMPLES)
def shrink(
    ctx: typer.Context,
    trace: TraceArg,
    until: Annotated[str, typer.Option("--until", help="The failure to keep: violation, violation:CHECK (e.g. violation:ownership), oom, or divergence.", show_default=False)],
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write the shrunk trace here.", show_default=False)] = None,
    allocator: Annotated[Optional[str], typer.Option("--allocator", help="violation, oom: the version replayed (kvtrace versions lists them; git: and worktree versions only as --a / --b).", show_default="builtin")] = None,
    baseline: Annotated[Optional[str], typer.Option("--baseline", help="violation, oom: a version that must not fail the same way on the result (e.g. builtin), so the failure stays the --allocator's own.", show_default=False)] = None,
    a: Annotated[Optional[str], typer.Option("--a", help="divergence: version A.", show_default="builtin")] = None,
    b: Annotated[Optional[str], typer.Option("--b", help="divergence: version B.", show_default=False)] = None,
    exact: Annotated[bool, typer.Option("--exact", help="divergence: compare the physical slots too (state digests).")] = False,
    page_size: WhatIfPageSizeOpt = None,
    pool_tokens: WhatIfPoolTokensOpt = None,
    device: DeviceOpt = Device.cpu,
    max_time: Annotated[Optional[float], typer.Option("--max-time", callback=finite, help="Seconds the search may take once the failure is found; then the smallest trace so far is kept (Ctrl-C does the same).", show_default="no limit")] = None,
    jobs: Annotated[Optional[int], typer.Option("--jobs", min=1, help="Processes judging candidates in parallel.", show_default="every usable core; 1 for a trace under 2 MB")] = None,
    emit_test: Annotated[Optional[Path], typer.Option("--emit-test", help="Write a pytest test here (tests/regress/test_NAME.py) that replays the shrunk trace, stored beside it as test_NAME.kvtrace.", show_default=False)] = None,
    expect_failure: Annotated[bool, typer.Option("--expect-failure", help="The emitted test asserts the failure is still there (default: that it is gone).")] = False,
    force: ForceOpt = False,
    quiet: QuietOpt = False,
    no_color: NoColorOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Shrink TRACE to the smallest trace that still fails the same way: an invariant
    violation or an out-of-memory of --allocator, or a divergence of --a and --b.

    Candidates (fewer requests, fewer steps, shorter prompts and outputs, a smaller
    pool) are replayed in parallel; the failure's signature (the check, the op kind
    that ran out, the first differing field) must stay the same. The result is a valid
    trace whose metadata says what it was shrunk from.

    Exit code: 0 shrunk; 1 the failure did not reproduce on TRACE; 2 bad input.
    """
    from kvtrace.cli.replay import check_device
    from kvtrace.outputs import OutputFile, distinct_outputs
    from kvtrace.shrink import shrink_trace
    from traces.samples import resolve_trace

    target = _target(until)
    oracle = _oracle(target, allocator, baseline, a, b, exact, device.value)
    if out is None and emit_test is None:
        raise typer.BadParameter("say where the shrunk trace goes: --out SMALL.kvtrace, --emit-test, or both", param_hint="--out")
    if expect_failure and emit_test is None:
        raise typer.BadParameter("applies to the emitted test: add --emit-test tests/regress/test_NAME.py", param_hint="--expect-failure")
    if max_time is not None and not (math.isfinite(max_time) and max_time > 0):
        raise typer.BadParameter(f"must be a positive number of seconds, found {max_time}", param_hint="--max-time")
    if target.kind == "oom" and emit_test is not None and baseline is None and not expect_failure:
        # Without a baseline nothing shows that a version avoids the out-of-memory on the
        # shrunk trace (builtin runs out on it as much as any), so a test that it is gone
        # would fail as soon as it is written.
        raise typer.BadParameter(
            "a test that the out-of-memory is gone needs a version that avoids it: give --baseline VERSION "
            "(kept free of it while shrinking), or --expect-failure for a test that it is still there",
            param_hint="--emit-test",
        )
    check_device(device.value)
    inputs = [resolve_trace(trace)]
    target_out = None if out is None else OutputFile(out, force=force, inputs=inputs)
    test_files = None if emit_test is None else _test_outputs(emit_test, force, inputs)
    distinct_outputs([target_out, *(test_files or ())])
    for output in (target_out, *(test_files or ())):
        if output is not None:
            _check_writable(output)
    command_text = ui.command_line(ctx.meta)
    with _Progress() as progress:
        result = shrink_trace(trace, oracle, page_size=page_size, pool_tokens=pool_tokens, jobs=jobs,
                              max_time=max_time, on_progress=progress, command=command_text)
    summary = result.to_dict()
    if result.confirmed is not None and not result.confirmed.reproduced:
        ui.warn(f"the shrunk trace did not fail again when judged once more: {result.confirmed.detail}")
    if result.reproduced:
        if target_out is not None:
            with target_out.writing() as tmp:
                result.write(tmp)
        if test_files is not None:
            _write_test(result, test_files, expect_failure, command_text)
    summary["out"] = None if out is None or not result.reproduced else str(out)
    summary["test"] = None if emit_test is None or not result.reproduced else str(emit_test)
    if as_json:
        ui.emit_json(summary)
    else:
        _render(result, summary, ui.console())
    raise typer.Exit(0 if result.reproduced else 1)


def _target(until: str) -> Any:
    from kvtrace.errors import ConfigError
    from kvtrace.shrink.signature import Target

    try:
        return Target.parse(until)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc).removeprefix("--until "), param_hint="--until") from None


def _oracle(target: Any, allocator: str | None, baseline: str | None, a: str | None, b: str | None,
            exact: bool, device: str) -> Any:
    from kvtrace.shrink import Oracle

    if target.kind == "divergence":
        for name, value in (("--allocator", allocator), ("--baseline", baseline)):
            if value is not None:
                raise typer.BadParameter(f"a divergence compares --a and --b; {name} applies to violation and oom", param_hint=name)
        if b is None:
            raise typer.BadParameter("give the version to compare with --b SPEC (and --a SPEC, default builtin)", param_hint="--b")
        return Oracle(target, a=a or "builtin", b=b, exact=exact, device=device)
    for name, value in (("--a", a), ("--b", b), ("--exact", exact or None)):
        if value is not None:
            raise typer.BadParameter(f"applies to --until divergence; for {target.kind} give --allocator", param_hint=name)
    return Oracle(target, allocator=allocator or "builtin", baseline=baseline, device=device)


def _test_outputs(path: Path, force: bool, inputs: list[Path]) -> tuple[Any, Any]:
    from kvtrace.outputs import OutputFile

    if path.suffix != ".py" or not path.name.startswith("test_"):
        raise typer.BadParameter(f"{path}: name the test test_NAME.py (pytest collects test_*.py)", param_hint="--emit-test")
    return (OutputFile(path, option="--emit-test", force=force, inputs=inputs),
            OutputFile(path.with_suffix(".kvtrace"), option="--emit-test's trace", force=force, inputs=inputs))


def _check_writable(output: Any) -> None:
    """Refuse, before the search, an output whose directory cannot take a new file
    (read-only, no permission): found only at the end, the whole search would be lost.

    Raises:
        OutputError: one line naming the option and the path.
    """
    from kvtrace.errors import OutputError

    folder = output.path.parent
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=f".{output.path.name[:32]}.", suffix=".probe")
    except OSError as exc:
        raise OutputError(f"{output.option} {output.path}: cannot write in {folder} ({exc.strerror or exc})") from None
    os.close(fd)
    os.unlink(probe)


def _write_test(result: ShrinkResult, files: tuple[Any, Any], expect_failure: bool, command_text: str) -> None:
    from kvtrace.shrink import emit_test

    source_file, trace_file = files
    text = emit_test(result, stem=source_file.path.stem, trace_file=trace_file.path.name,
                     expect_failure=expect_failure, command=command_text)
    # Both or neither: each is written under a temporary name, and neither is renamed
    # into place until both are written (a full disk leaves no trace without its test).
    placed = False
    try:
        with trace_file.writing() as trace_tmp:
            with source_file.writing() as source_tmp:
                result.write(trace_tmp)
                source_tmp.write_text(text, encoding="utf-8")
            placed = True
    except BaseException:
        if placed and not source_file.replaces:  # the trace could not be renamed into place
            source_file.path.unlink(missing_ok=True)
        raise


def _render(result: ShrinkResult, summary: dict[str, Any], console: Console) -> None:
    def line(text: str) -> None:
        console.print(text, markup=False, highlight=False)

    if not result.reproduced:
        line(f"kvtrace shrink {result.trace}: the failure did not reproduce: {result.reason}")
        return
    f, before, after = result.failure, summary["before"], result.after
    assert f is not None and after is not None
    oracle = result.oracle
    who = f"{oracle.a} vs {oracle.b}" if f.signature.kind == "divergence" else oracle.allocator
    line(f"kvtrace shrink {result.trace}: {f.signature.describe()} ({who})")
    line(f"  found at step {f.step:,}" + (f", request {f.rid}" if f.rid is not None else "") + f": {f.detail}")
    line(f"  shrunk {_size(before)} to {_size(after.to_dict())}, pool {after.pool_tokens:,} tokens")
    c = result.counts
    procs = "1 process" if result.jobs == 1 else f"{result.jobs} processes"
    line(f"  {c.tried:,} candidates ({c.reproduced:,} reproduced, {c.invalid:,} invalid, {c.crashed:,} crashed) "
         f"in {result.wall_s:.1f} s on {procs}")
    for note in result.notes:
        line(f"  note: {note}")
    if summary["out"]:
        line(f"  wrote {summary['out']}")
    if summary["test"]:
        line(f"  wrote {summary['test']} (the trace beside it: {Path(summary['test']).with_suffix('.kvtrace').name})")


def _size(d: dict[str, int]) -> str:
    from kvtrace.replay.report import count

    r = d["requests"]
    return f"{count(r, 'request')}, {count(d['steps'], 'step')}, {count(d['ops'], 'op')}"


class _Progress:
    """Progress on stderr: the ``ui.progress`` line where one is shown (candidates, size,
    time left), a note per phase elsewhere; nothing with -q."""

    def __init__(self) -> None:
        self._phase = ""
        self._line = ui.ProgressLine()
        self._context: Any = None

    def __enter__(self) -> _Progress:
        if ui.progress_shown():
            self._context = ui.progress("shrink")
            self._line = self._context.__enter__()
        return self

    def __call__(self, p: Progress) -> None:
        size = "" if p.size is None else f"{p.size.requests:,} requests / {p.size.steps:,} steps / {p.size.ops:,} ops"
        left = "" if p.left_s is None else f", {p.left_s:,.0f} s left"
        text = f"[{p.phase}] {p.counts.tried:,} candidates, {size}{left}"
        if self._context is not None:
            self._line(0, text)
        elif p.phase != self._phase:
            ui.note(f"shrink {text}")
        self._phase = p.phase

    def __exit__(self, *exc: object) -> None:
        if self._context is not None:
            self._context.__exit__(*exc)
