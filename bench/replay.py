"""Replay speed and memory: how much faster than real time, what --check every costs, flat RSS.

Usage:
    python bench/replay.py [TRACE] [--device cpu|cuda] [--every-steps N] [--skip-memory]
                           [--compare-devices] [--profile N]

TRACE defaults to the bundled one-hour Mooncake sample. Prints, for the trace:
  * replay with --check end: wall time, allocator time, simulated duration, speed-up vs real time;
  * the cost of --check every (incremental: what each allocator call changed) over the
    first N steps (default 2,000), as wall time per step and the ratio
    (``bench/check.py`` compares every, full and end, and every over the whole trace);
  * with --compare-devices: the same replay on cpu and cuda, and whether the summaries
    are identical (timings and the device name aside);
  * peak RSS of a replay of the trace and of the same trace tiled 10x (each in a fresh
    process, so the figures are honest): memory must stay flat in trace length;
  * optionally (--profile N) the N most expensive functions of one replay (cProfile).
Each replay runs in a subprocess through the real CLI (`python -m kvtrace replay --json`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from traces.batches import StepBatch  # noqa: E402
from traces.reader import TraceReader  # noqa: E402
from traces.samples import resolve_trace  # noqa: E402
from traces.writer import TraceWriter  # noqa: E402

DEFAULT_TRACE = "sample:mooncake-conversation"
TIMING_KEYS = ("wall_s", "allocator_s", "speedup_vs_realtime", "device", "state_log")

_RSS_WRAPPER = """
import resource, runpy, sys
sys.argv = ["kvtrace"] + sys.argv[1:]
try:
    runpy.run_module("kvtrace", run_name="__main__")
except SystemExit as exc:
    code = exc.code
else:
    code = 0
rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
sys.stderr.write(f"\\nPEAK_RSS_MB={rss_mb:.1f}\\n")
sys.exit(code)
"""


def run_replay(trace: str, *extra: str) -> tuple[dict, float]:
    """Replay in a fresh process; return (the JSON summary, peak RSS in MB)."""
    cmd = [sys.executable, "-c", _RSS_WRAPPER, "replay", trace, "--json", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode not in (0, 1):
        raise SystemExit(f"replay failed ({proc.returncode}):\n{proc.stderr}")
    rss = float(proc.stderr.rsplit("PEAK_RSS_MB=", 1)[1].split()[0])
    return json.loads(proc.stdout), rss


def tile(trace: Path, times: int, out: Path) -> None:
    """Write ``trace`` ``times`` times in a row (steps, times and request ids shifted)."""
    reader = TraceReader(trace)
    last_step = last_time = max_rid = 0
    for batch in reader.steps():
        last_step, last_time = batch.step, batch.time_s
        if len(batch):
            max_rid = max(max_rid, int(batch.rid.max()))
    with TraceWriter(out, reader.meta, steps_per_batch=16, overwrite=True) as writer:
        for k in range(times):
            step_off, time_off, rid_off = k * (last_step + 1), k * (last_time + 1.0), k * (max_rid + 1)
            for b in TraceReader(trace).steps():
                writer.write(
                    StepBatch(
                        b.step + step_off, b.time_s + time_off, b.op, b.rid + rid_off, b.seq_len,
                        b.append_len, b.draft_len, b.accepted_len, b.prefix_len, b.prompt_len,
                        b.block_hashes, b.token_ids,
                    )
                )


def profile(trace: str, top: int) -> None:
    import cProfile
    import pstats

    from kvtrace.replay.session import ReplaySession

    session = ReplaySession(trace, checker="inline")
    prof = cProfile.Profile()
    prof.enable()
    session.run()
    prof.disable()
    session.close()
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def _row(name: str, s: dict) -> None:
    print(
        f"{name:<26} {s['steps']:>8,} {s['wall_s']:>8.2f} {s['allocator_s']:>8.2f} {s['duration_s']:>10,.0f} "
        f"{s['speedup_vs_realtime'] or 0:>12,.0f} {s['num_violations']:>10}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="?", default=DEFAULT_TRACE)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--every-steps", type=int, default=2000, metavar="N", help="steps for the --check every comparison (0: skip)")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--compare-devices", action="store_true")
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    args = ap.parse_args()
    path = resolve_trace(args.trace)
    print(f"trace {args.trace}: {path.stat().st_size / 1e6:.1f} MB, device {args.device}, {os.cpu_count()} CPUs")
    end, _ = run_replay(str(path), "--device", args.device, "--check", "end")
    print(f"{'mode':<26} {'steps':>8} {'wall s':>8} {'alloc s':>8} {'serving s':>10} {'x real time':>12} {'violations':>10}")
    _row("--check end", end)
    if args.every_steps:
        window = f"0:{args.every_steps}"
        w_end, _ = run_replay(str(path), "--device", args.device, "--check", "end", "--steps", window)
        w_every, _ = run_replay(str(path), "--device", args.device, "--check", "every", "--steps", window)
        _row(f"--check end, steps {window}", w_end)
        _row(f"--check every, steps {window}", w_every)
        per_end = w_end["wall_s"] / max(w_end["steps"], 1) * 1e3
        per_every = w_every["wall_s"] / max(w_every["steps"], 1) * 1e3
        print(
            f"--check every: {per_every:.2f} ms/step vs {per_end:.3f} ms/step with --check end "
            f"({per_every / per_end:.1f}x; the checker verifies what each allocator call changed)"
        )
    if args.compare_devices:
        other = "cuda" if args.device == "cpu" else "cpu"
        second, _ = run_replay(str(path), "--device", other, "--check", "end")
        _row(f"--check end on {other}", second)
        a = {k: v for k, v in end.items() if k not in TIMING_KEYS}
        b = {k: v for k, v in second.items() if k not in TIMING_KEYS}
        diff = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        print(f"summaries {args.device} vs {other}: " + ("IDENTICAL" if not diff else f"DIFFER in {diff}"))
    if not args.skip_memory:
        with tempfile.TemporaryDirectory() as tmp:
            tiled = Path(tmp) / "tiled10.kvtrace"
            t0 = time.perf_counter()
            tile(path, 10, tiled)
            print(f"tiled 10x: {tiled.stat().st_size / 1e6:.1f} MB in {time.perf_counter() - t0:.1f} s")
            big, rss_big = run_replay(str(tiled), "--device", args.device, "--check", "never")
            small, rss_small = run_replay(str(path), "--device", args.device, "--check", "never")
        print(f"{'trace':<12} {'steps':>9} {'peak RSS MB':>12}")
        print(f"{'1x':<12} {small['steps']:>9,} {rss_small:>12.0f}")
        print(f"{'10x':<12} {big['steps']:>9,} {rss_big:>12.0f}")
        print(f"RSS ratio 10x / 1x = {rss_big / rss_small:.2f} (flat means close to 1)")
    if args.profile:
        profile(args.trace, args.profile)


if __name__ == "__main__":
    main()
