"""Trace I/O benchmark: writer cost per step, write/read throughput and memory, trace size.

Usage (from the repository root)::

    .venv/bin/python bench/trace_io.py            # full run: 1M- and 10M-op traces (a few minutes)
    .venv/bin/python bench/trace_io.py --quick    # 100k and 1M ops

Prints:

1. The writer's cost per scheduler step of 256 decode rows, by ``steps_per_batch``
   and codec (in process).
2. Write and read throughput (ops/s) and peak RSS for synthetic 1M- and 10M-op
   traces, each measured in its own subprocess so the memory figures are honest;
   read memory must stay flat from 1M to 10M ops (the reader streams).
3. The one-hour Mooncake-shaped trace (``traces.synth.generate_mooncake_shaped``):
   its size (must stay under 50 MB), how long ``validate`` and token
   materialisation of all its prompts take.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from traces.batches import Ragged, StepBatch  # noqa: E402
from traces.metadata import TraceConfig, TraceMeta  # noqa: E402
from traces.reader import TraceReader  # noqa: E402
from traces.schema import DECODE, EXTEND, FINISH  # noqa: E402
from traces.writer import TraceWriter  # noqa: E402

ROWS_PER_STEP = 256
META = TraceMeta(
    config=TraceConfig(page_size=16, pool_tokens=1_200_000, max_running=256, max_context_len=131_072),
    block_size=512,
)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


class _StepMaker:
    """Steps of a busy decode server: 250 decode rows, 3 finishes, 3 new prefills with hashes."""

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        n_decode, n_finish, n_extend = 250, 3, 3
        self.op = np.concatenate(
            [np.full(n_finish, FINISH), np.full(n_extend, EXTEND), np.full(n_decode, DECODE)]
        ).astype(np.int8)
        self.base_rid = np.arange(ROWS_PER_STEP, dtype=np.int64)
        self.base_seq = rng.integers(500, 20_000, ROWS_PER_STEP).astype(np.int64)
        self.append_len = np.concatenate(
            [np.zeros(n_finish), rng.integers(512, 8192, n_extend), np.ones(n_decode)]
        ).astype(np.int32)
        self.zeros32 = np.zeros(ROWS_PER_STEP, np.int32)
        self.zeros64 = np.zeros(ROWS_PER_STEP, np.int64)
        self.prompt_len = np.full(ROWS_PER_STEP, -1, np.int64)
        self.prompt_len[n_finish : n_finish + n_extend] = self.append_len[n_finish : n_finish + n_extend]
        rows: list[np.ndarray | None] = [None] * ROWS_PER_STEP
        for i in range(n_finish, n_finish + n_extend):
            rows[i] = rng.integers(0, 2**40, -(-int(self.append_len[i]) // 512)).astype(np.uint64)
        self.hashes = Ragged.from_rows(rows, np.uint64)
        self.tokens = Ragged.empty(ROWS_PER_STEP, np.int64)

    def step(self, s: int) -> StepBatch:
        return StepBatch(
            s, 0.02 * s, self.op, self.base_rid + 300 * (s // 300), self.base_seq + s,
            self.append_len, self.zeros32, self.zeros32, self.zeros64, self.prompt_len,
            self.hashes, self.tokens,
        )


# -- children (run in their own process) ------------------------------------------------


def _child_write(path: str, ops: int, steps_per_batch: int, compression: str) -> dict[str, float]:
    maker = _StepMaker()
    num_steps = ops // ROWS_PER_STEP
    baseline = _peak_rss_mb()
    start, cpu = time.perf_counter(), time.process_time()
    with TraceWriter(path, META, steps_per_batch=steps_per_batch, compression=compression, overwrite=True) as w:
        for s in range(num_steps):
            w.write(maker.step(s))
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "rows": num_steps * ROWS_PER_STEP,
            "steps": num_steps, "peak_rss_mb": _peak_rss_mb(), "baseline_rss_mb": baseline,
            "bytes": os.path.getsize(path)}


def _child_read(path: str) -> dict[str, float]:
    process = psutil.Process()
    baseline = process.memory_info().rss / 2**20
    start, cpu = time.perf_counter(), time.process_time()
    reader = TraceReader(path)
    rows = steps = 0
    checksum = 0
    current_max = baseline
    for batch in reader.steps():
        rows += len(batch)
        steps += 1
        checksum += int(batch.seq_len[-1])  # touch the data
        if steps % 256 == 0:
            current_max = max(current_max, process.memory_info().rss / 2**20)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "rows": rows, "steps": steps,
            "peak_rss_mb": _peak_rss_mb(), "baseline_rss_mb": baseline,
            "max_sampled_rss_mb": current_max, "checksum": checksum}


def _run_child(*args: str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", *args], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- parent ----------------------------------------------------------------------------


def bench_writer_per_step(repeats: int = 3) -> list[tuple[str, int, float, float]]:
    """(codec, steps_per_batch, wall us/step, CPU us/step): the best of ``repeats`` runs."""
    maker = _StepMaker()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for compression in ("zstd", "lz4"):
            for spb in (1, 16, 64):
                num_steps = 1024 if spb == 1 else 4096
                path = Path(tmp) / "w.kvtrace"
                best_wall = best_cpu = float("inf")
                for _ in range(repeats):
                    start, cpu = time.perf_counter(), time.process_time()
                    with TraceWriter(path, META, steps_per_batch=spb, compression=compression, overwrite=True) as w:
                        for s in range(num_steps):
                            w.write(maker.step(s))
                    best_wall = min(best_wall, (time.perf_counter() - start) / num_steps * 1e6)
                    best_cpu = min(best_cpu, (time.process_time() - cpu) / num_steps * 1e6)
                results.append((compression, spb, best_wall, best_cpu))
    return results


def bench_mooncake(tmp: Path) -> dict[str, float]:
    from traces.checker import OpSequenceChecker
    from traces.synth import generate_mooncake_shaped
    from traces.tokens import TokenStore

    path = tmp / "mooncake-shaped.kvtrace"
    start = time.perf_counter()
    summary = generate_mooncake_shaped(path, overwrite=True)
    generate_s = time.perf_counter() - start

    reader = TraceReader(path)
    start = time.perf_counter()
    checker = OpSequenceChecker(reader.meta)
    problems = sum(len(checker.check(batch)) for batch in reader.steps())
    validate_s = time.perf_counter() - start

    # Token content of every prompt, as a replay's radix cache would ask for it.
    reader = TraceReader(path)
    store = TokenStore(reader.meta.block_size)
    materialised = 0
    tokens_s = 0.0
    for batch in reader.steps():
        start = time.perf_counter()
        store.ingest(batch)
        firsts = np.flatnonzero(batch.prompt_len >= 0)
        for rid, prompt in zip(batch.rid[firsts].tolist(), batch.prompt_len[firsts].tolist()):
            materialised += store.ids(rid, prompt).shape[0]
        finished = batch.rid[batch.op == FINISH]
        if finished.size:
            store.drop(finished)
        tokens_s += time.perf_counter() - start
    return {
        "bytes": path.stat().st_size,
        "steps": summary.steps,
        "rows": summary.rows,
        "requests": summary.requests,
        "prompt_tokens": summary.prompt_tokens,
        "generated_tokens": summary.generated_tokens,
        "repeated_block_fraction": summary.repeated_block_fraction,
        "duration_s": summary.duration_s,
        "generate_s": generate_s,
        "validate_s": validate_s,
        "problems": problems,
        "materialised_tokens": materialised,
        "tokens_s": tokens_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100k and 1M ops instead of 1M and 10M")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "write":
            result = _child_write(rest[0], int(rest[1]), int(rest[2]), rest[3])
        else:
            result = _child_read(rest[0])
        print(json.dumps(result))
        return

    sizes = (100_000, 1_000_000) if args.quick else (1_000_000, 10_000_000)
    print(f"kvtrace trace I/O benchmark (python {sys.version.split()[0]}, {os.cpu_count()} CPUs)\n")

    print(f"1. Writer cost per step of {ROWS_PER_STEP} rows (250 decode, 3 finish, 3 extend with hashes), "
          "best of 3")
    print(f"   {'codec':<6} {'steps/batch':>11} {'wall us/step':>13} {'CPU us/step':>12}")
    for compression, spb, wall, cpu in bench_writer_per_step():
        print(f"   {compression:<6} {spb:>11} {wall:>13.1f} {cpu:>12.1f}")

    print("\n2. Synthetic traces, steps_per_batch 16, zstd; each figure from its own process")
    print("   (ops/s: wall clock, CPU time in parentheses; RSS in MiB: the process's peak, and for")
    print("   the reader also its RSS after imports and the most it grew while reading)")
    print(f"   {'ops':>11} {'file MB':>8} {'write ops/s':>23} {'read ops/s':>23} "
          f"{'write peak':>11} {'read peak':>10} {'read start':>11} {'read growth':>12}")
    with tempfile.TemporaryDirectory() as tmp:
        for ops in sizes:
            path = str(Path(tmp) / f"t{ops}.kvtrace")
            w = _run_child("write", path, str(ops), "16", "zstd")
            r = _run_child("read", path)
            assert r["rows"] == w["rows"], (r, w)
            write_rate = f"{w['rows'] / w['seconds'] / 1e6:.2f}M ({w['rows'] / w['cpu_seconds'] / 1e6:.2f}M)"
            read_rate = f"{r['rows'] / r['seconds'] / 1e6:.2f}M ({r['rows'] / r['cpu_seconds'] / 1e6:.2f}M)"
            print(
                f"   {w['rows']:>11,} {w['bytes'] / 1e6:>8.1f} {write_rate:>23} {read_rate:>23} "
                f"{w['peak_rss_mb']:>11.1f} {r['peak_rss_mb']:>10.1f} {r['baseline_rss_mb']:>11.1f} "
                f"{r['max_sampled_rss_mb'] - r['baseline_rss_mb']:>+12.1f}"
            )
            os.remove(path)

        print("\n3. One-hour Mooncake-shaped trace (traces.synth.generate_mooncake_shaped)")
        m = bench_mooncake(Path(tmp))
        print(f"   size                {m['bytes'] / 1e6:.1f} MB (limit 50 MB)")
        print(f"   content             {m['requests']:,} requests, {m['steps']:,} steps, {m['rows']:,} rows, "
              f"{m['duration_s']:,.0f} s simulated")
        print(f"   tokens              {m['prompt_tokens'] / 1e6:.1f}M prompt, {m['generated_tokens'] / 1e6:.2f}M "
              f"generated, {m['repeated_block_fraction']:.1%} of block references repeat an earlier block")
        print(f"   generate            {m['generate_s']:.1f} s")
        print(f"   validate            {m['validate_s']:.1f} s ({m['rows'] / m['validate_s']:,.0f} rows/s, "
              f"{m['problems']} problems)")
        print(f"   materialise prompts {m['tokens_s']:.2f} s for {m['materialised_tokens'] / 1e6:.1f}M tokens "
              "(TokenStore: ingest every step, ids() of each prompt, drop at finish)")
        if m["bytes"] >= 50e6:
            raise SystemExit("FAIL: the one-hour Mooncake-shaped trace is 50 MB or more")


if __name__ == "__main__":
    main()
