"""Replay speed per step, before and after, on the same machine in one run.

Usage:
    python bench/replay_speed.py [TRACE ...] [--before REV] [--repeat N] [--no-logs] [--pages 1,16]
    python bench/replay.py --speed ...            (the same)

For every bundled sample of more than 1,000 steps, a decode-heavy trace the bench
records itself (the bundled Azure code workload, its first 10 minutes at the real
arrival rate, default options), the short-request chat trace it records itself
(``short_trace``: issue #42's shape), two synthetic traces of plain decode steps of
32 requests (page 1 and page 16) and any TRACE given, prints µs per step and × real
time of ``kvtrace replay --check end`` for two code versions, at each page size of
``--pages`` (``--page-size``; the decode traces keep their own):

* ``before``: ``--before REV`` (default: the commit before replay in runs),
  checked out into a temporary git worktree and run with its own imports;
* ``after``: this working tree.

Both replay the same trace files, alternately, ``--repeat`` times each (the median
is shown; the spread says how noisy the machine was). Each replay runs in a fresh
process through the real CLI; ``wall_s`` is the replay loop as the summary reports
it (imports and start-up excluded). The summaries (timings aside) must be identical,
and, unless ``--no-logs``, the state logs (``--out``) hold identical rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from beforecode import code_at  # noqa: E402  (bench/, beside this script)
from traces.batches import Ragged, StepBatch  # noqa: E402
from traces.metadata import TraceConfig, TraceMeta  # noqa: E402
from traces.reader import TraceReader  # noqa: E402
from traces.samples import list_samples, sample_path  # noqa: E402
from traces.schema import DECODE, EXTEND  # noqa: E402
from traces.writer import TraceWriter  # noqa: E402

# The last commit before a run of decode or speculative steps went to the allocator
# in one call ("Replay in runs").
DEFAULT_BEFORE = "47cc964"
TIMING_KEYS = {"wall_s", "allocator_s", "speedup_vs_realtime", "device", "state_log", "trace"}
AZURE_CODE = ROOT / "traces/workloads_data/azure-llm-inference-2023/AzureLLMInferenceTrace_code.csv"
MIN_STEPS = 1000
LOG_TIMING_COLUMNS = ("allocator_s",)  # a state log's per-step timing: not a result


def decode_trace(path: Path, page_size: int, requests: int = 32, steps: int = 30_000, step_s: float = 0.01) -> Path:
    """One prefill of ``requests`` prompts, then ``steps`` plain decode steps of all of them."""
    meta = TraceMeta(
        config=TraceConfig(page_size=page_size, pool_tokens=1 << 20, max_running=256, max_context_len=131_072)
    )
    rids = np.arange(requests, dtype=np.int64)
    prompt = 1000 + 37 * rids  # different lengths: pages end at different steps

    def batch(step: int, op: int, seq: np.ndarray, append: np.ndarray, prompt_len: np.ndarray) -> StepBatch:
        zeros = np.zeros(requests, np.int64)
        return StepBatch(
            step, step * step_s, np.full(requests, op, np.int8), rids, seq, append, zeros, zeros, zeros,
            prompt_len, Ragged.empty(requests), Ragged.empty(requests),
        )

    with TraceWriter(path, meta, steps_per_batch=256, overwrite=True) as writer:
        writer.write(batch(0, EXTEND, prompt, prompt, prompt))
        for k in range(1, steps + 1):
            writer.write(batch(k, DECODE, prompt + k, np.ones(requests, np.int64), np.full(requests, -1, np.int64)))
    return path


def short_trace(path: Path, rate: float = 25.0, duration: str = "5m") -> Path | None:
    """Short-request chat traffic (issue #42): the requests of the bundled Azure code
    workload with prompts cut to an eighth (at least 8 tokens) and outputs four times
    as long, a few hundred tokens each, arriving as a seeded Poisson process of
    ``rate`` a second (``kvtrace record --format lengths``): some 30 running, an
    arrival every few steps, runs of decode steps of 1 to 3 steps between them,
    about 35,000 steps in 5 minutes. Deterministic: same file, same seed."""
    if not AZURE_CODE.exists():
        return None
    import csv

    lengths = path.with_suffix(".csv")
    with AZURE_CODE.open(newline="") as src, lengths.open("w", newline="") as dst:
        out = csv.writer(dst)
        out.writerow(["num_prefill_tokens", "num_decode_tokens"])
        for row in csv.DictReader(src):
            out.writerow([max(int(row["ContextTokens"]) // 8, 8), 4 * int(row["GeneratedTokens"])])
    cmd = [sys.executable, "-m", "kvtrace", "record", str(lengths), "--format", "lengths", "--rate", str(rate),
           "--seed", "0", "--duration", duration, "--out", str(path), "--force", "-q"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return path


def record_azure(path: Path) -> Path | None:
    """The first 10 minutes of the Azure code workload at its real rate (default options)."""
    if not AZURE_CODE.exists():
        return None
    cmd = [sys.executable, "-m", "kvtrace", "record", str(AZURE_CODE), "--duration", "10m", "--out", str(path),
           "--force", "-q"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return path


def replay(code: Path, trace: Path, log: Path | None = None, page: int | None = None) -> dict:
    """``kvtrace replay TRACE --json`` with the code at ``code``, in a fresh process
    (``--page-size page`` unless None)."""
    cmd = [sys.executable, "-m", "kvtrace", "replay", str(trace), "--json", "--check", "end"]
    if page is not None:
        cmd += ["--page-size", str(page)]
    if log is not None:
        cmd += ["--out", str(log), "--force"]
    env = {**os.environ, "PYTHONPATH": str(code)}
    proc = subprocess.run(cmd, cwd=code, capture_output=True, text=True, env=env)
    if proc.returncode not in (0, 1) or not proc.stdout.strip():
        raise SystemExit(f"replay of {trace} with {code} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def logs_identical(a: Path, b: Path) -> bool:
    """The two state logs hold the same rows (their header metadata, which names the
    run, and the per-step timing aside)."""
    import pyarrow as pa

    def rows(path: Path) -> pa.Table:
        with pa.memory_map(str(path)) as source:
            head = source.read(6)
            source.seek(0)
            reader = pa.ipc.open_file(source) if head == b"ARROW1" else pa.ipc.open_stream(source)
            table = reader.read_all().replace_schema_metadata(None)
            return table.drop_columns([c for c in LOG_TIMING_COLUMNS if c in table.column_names])

    return rows(a).equals(rows(b))


def traces_to_run(
    extra: list[str], tmp: Path, samples: bool = True, pages: list[int] | None = None, short_only: bool = False
) -> list[tuple[str, Path, int | None]]:
    """(name, trace, page size to replay at: None for the trace's own)."""
    at = pages or [None]
    out: list[tuple[str, Path, int | None]] = []
    short = short_trace(tmp / "short-requests.kvtrace")
    if short is not None:
        out.extend(("short requests", short, p) for p in at)
    if not short_only:
        for name in list_samples() if samples else []:
            path = sample_path(name)
            if TraceReader(path).num_rows and _steps(path) > MIN_STEPS:
                out.extend((name, path, p) for p in at)
        azure = record_azure(tmp / "azure-code-10m.kvtrace") if samples else None
        if azure is not None:
            out.extend(("azure-code-10m (recorded)", azure, p) for p in at)
        out.append(("decode 32 req, page 1", decode_trace(tmp / "decode-p1.kvtrace", 1), None))
        out.append(("decode 32 req, page 16", decode_trace(tmp / "decode-p16.kvtrace", 16), None))
    out.extend((arg, Path(arg).resolve(), p) for arg in extra for p in at)
    return out


def _steps(path: Path) -> int:
    last = None
    steps = 0
    for columns in TraceReader(path).iter_columns():
        s = columns.step
        if s.size:
            steps += int(np.count_nonzero(s[1:] != s[:-1])) + 1 - int(last is not None and int(s[0]) == last)
            last = int(s[-1])
    return steps


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="*", help="more traces to time")
    ap.add_argument("--before", default=DEFAULT_BEFORE, metavar="REV", help="the code to compare with")
    ap.add_argument("--before-tree", type=Path, metavar="DIR",
                    help="that code already extracted (git archive REV allocator kvtrace traces | tar -x -C DIR), "
                         "where the checkout has no git history")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-logs", action="store_true", help="skip the state-log comparison")
    ap.add_argument("--synthetic-only", action="store_true",
                    help="only the traces the bench makes (and any TRACE given), not the samples")
    ap.add_argument("--short-only", action="store_true",
                    help="only the short-request trace (and any TRACE given)")
    ap.add_argument("--pages", default="1,16", metavar="P,P",
                    help="page sizes to replay each trace at (--page-size); 'own': the trace's own")
    args = ap.parse_args(argv)
    load = os.getloadavg()[0]
    print(f"{len(os.sched_getaffinity(0))} CPUs usable (of {os.cpu_count()}); load average {load:.1f}")
    with tempfile.TemporaryDirectory() as tmp_name, code_at(args.before, args.before_tree) as before:
        tmp = Path(tmp_name)
        assert before is not None  # --before has a default
        what = f"the code in {before}" if args.before_tree is not None else args.before
        print(f"before: {what}; after: the working tree {ROOT}")
        pages = None if args.pages == "own" else [int(p) for p in args.pages.split(",")]
        traces = traces_to_run(args.traces, tmp, not args.synthetic_only, pages, args.short_only)
        _table(traces, before, tmp, args.repeat, not args.no_logs)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


def _table(traces: list[tuple[str, Path, int | None]], before: Path, tmp: Path, repeat: int, logs: bool) -> None:
    print(f"{'trace':<34} {'page':>4} {'steps':>8} {'before µs/step':>15} {'after µs/step':>14} {'before x':>9} "
          f"{'after x':>9} {'speed-up':>9} {'spread':>7}  same")
    for name, path, page in traces:
        walls: dict[str, list[float]] = {"before": [], "after": []}
        summaries: dict[str, dict] = {}
        for _ in range(repeat):
            for which, code in (("before", before), ("after", ROOT)):
                s = replay(code, path, page=page)
                walls[which].append(s["wall_s"])
                summaries[which] = {k: v for k, v in s.items() if k not in TIMING_KEYS}
        same = summaries["before"] == summaries["after"]
        if logs and same:
            la, lb = tmp / "before.log", tmp / "after.log"
            replay(before, path, la, page)
            replay(ROOT, path, lb, page)
            same = logs_identical(la, lb)
        steps = summaries["after"]["steps"]
        duration = summaries["after"]["duration_s"] or 0.0
        wb, wa = statistics.median(walls["before"]), statistics.median(walls["after"])
        spread = max(max(w) / min(w) for w in walls.values())
        shown = summaries["after"].get("page_size", page)
        print(
            f"{name:<34} {shown if shown is not None else '':>4} {steps:>8,} {wb / steps * 1e6:>15.1f} "
            f"{wa / steps * 1e6:>14.1f} {duration / wb:>9,.0f} {duration / wa:>9,.0f} {wb / wa:>8.2f}x {spread:>6.2f}x  {'yes' if same else 'NO'}",
            flush=True,
        )


if __name__ == "__main__":
    main()
