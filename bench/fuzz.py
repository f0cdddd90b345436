"""The long fuzz run: mutated sample traces through ``info``, ``validate`` and ``replay``.

Case ``i`` is rebuilt from seed ``i`` alone (``tests/fuzz/mutate.py``): one of the
bundled samples cut to its first rows, one to three structural edits (values set to
extremes or nudged, ops changed, rows dropped / duplicated / swapped, list columns
edited, columns dropped or retyped, metadata fields removed, retyped or added, the
metadata bytes replaced), sometimes byte damage (cut, flipped bytes, batches
dropped / repeated / swapped, garbage). Each command runs in-process (Typer's
``CliRunner``) under a per-case time limit and a memory limit (``tests/fuzz/runner.py``
says what passes). Workers run cases ``start + k * jobs + w``; the script prints,
every ``--report-every`` seconds and at the end, the cases done, cases per minute
and failures found, and each failure (with the seed that rebuilds it) as it comes.

Usage: ``python bench/fuzz.py [--cases 100000] [--start 0] [--jobs 1]
[--time-limit 30] [--memory-limit-mib 1024] [--failures out.jsonl]``

Exit code: 0 when no case failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue as queue_module
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _worker(
    start: int, stop: int, step: int, time_limit: float, memory_limit: int, deadline: float, queue: mp.Queue
) -> None:
    from tests.fuzz.mutate import load_seeds
    from tests.fuzz.runner import run_case

    seeds = load_seeds()
    with tempfile.TemporaryDirectory(prefix="kvtrace-fuzz-") as workdir:
        for case in range(start, stop, step):
            if time.time() >= deadline:
                break
            queue.put(("start", case, None))
            failures = run_case(seeds, case, Path(workdir), time_limit_s=time_limit, memory_limit=memory_limit)
            queue.put(("case", case, [(f.command, f.reason, list(f.notes)) for f in failures]))
    queue.put(("end", start, None))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=100_000)
    parser.add_argument("--start", type=int, default=0, help="First case seed.")
    parser.add_argument("--jobs", type=int, default=1, help="Worker processes.")
    parser.add_argument("--time-limit", type=float, default=30.0, help="Seconds per command of a case.")
    parser.add_argument("--memory-limit-mib", type=int, default=1024, help="Peak memory growth allowed per command.")
    parser.add_argument("--report-every", type=float, default=60.0, help="Seconds between progress lines.")
    parser.add_argument("--failures", type=Path, help="Append each failure to this JSON-lines file.")
    parser.add_argument("--max-seconds", type=float, help="Start no case after this many seconds (a partial run).")
    args = parser.parse_args(argv)

    deadline = time.time() + args.max_seconds if args.max_seconds is not None else float("inf")
    # One core per worker: torch, Arrow and BLAS thread pools sized to the machine, in
    # every worker at once, fight over the cores (a third of the cases per minute on 16).
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(variable, "1")
    ctx = mp.get_context("spawn")  # each worker imports kvtrace afresh: no shared state
    queue: mp.Queue = ctx.Queue()
    stop = args.start + args.cases
    workers = [
        ctx.Process(
            target=_worker,
            args=(args.start + w, stop, args.jobs, args.time_limit, args.memory_limit_mib << 20, deadline, queue),
        )  # not daemonic: a replay starts its own checker process
        for w in range(args.jobs)
    ]
    for worker in workers:
        worker.start()
    t0 = last = time.perf_counter()
    done = failed_cases = failures = 0
    current: dict[int, int] = {}  # worker -> the case it is on
    last_case: dict[int, int] = {}  # worker -> the last case it ran
    ended: set[int] = set()
    while len(ended) < len(workers):
        try:
            kind, case, found = queue.get(timeout=5.0)
        except queue_module.Empty:
            for w, worker in enumerate(workers):
                if w not in ended and not worker.is_alive():  # killed (the OOM killer, a crash)
                    ended.add(w)
                    found = [("worker", f"the worker process died (exit code {worker.exitcode})", [])]
                    kind, case = "case", current.get(w, -1)
                    break
            else:
                continue
        worker_index = (case - args.start) % args.jobs
        if kind == "start":
            current[worker_index] = case
            continue
        if kind == "end":
            ended.add(worker_index)
            last_case[worker_index] = current.get(worker_index, case - args.jobs)
            continue
        done += 1
        if found:
            failed_cases += 1
            failures += len(found)
            for command, reason, notes in found:
                print(f"FAIL case {case} ({'; '.join(notes)}): {command}: {reason}", flush=True)
                if args.failures is not None:
                    with args.failures.open("a") as out:
                        out.write(json.dumps({"case": case, "command": command, "reason": reason, "notes": notes}) + "\n")
        now = time.perf_counter()
        if now - last >= args.report_every:
            last = now
            print(f"{done:,} cases, {done / (now - t0) * 60:,.0f} cases/min, {failed_cases} failing", flush=True)
    for worker in workers:
        worker.join()
    wall = time.perf_counter() - t0
    if done < args.cases:  # a partial run: which seeds ran
        ranges = ", ".join(
            f"{args.start + w}..{last_case.get(w, args.start + w - args.jobs)} step {args.jobs}" for w in range(args.jobs)
        )
        print(f"partial run: seeds {ranges}", flush=True)
    print(
        f"done: {done:,} cases (seeds from {args.start}, below {stop}) in {wall:,.0f} s, "
        f"{done / wall * 60:,.0f} cases/min, {args.jobs} jobs; "
        f"{failed_cases} failing cases, {failures} failures",
        flush=True,
    )
    return 1 if failed_cases else 0


if __name__ == "__main__":
    sys.exit(main())
