"""Replay speed of a hybrid sliding-window (SWA) trace against the same traffic as a
full-attention trace.

Usage:
    python bench/swa.py [TRACE ...] [--repeat N] [--swa-steps]

For each SWA trace (default: the bundled ``mooncake-gpt-oss`` and ``mooncake-gemma-3``)
the bench writes its full-attention twin: the same file with the metadata's
``attention`` layout removed (same steps, ops and pool), so the only difference is the
second KV pool and its out-of-window frees. Both are replayed alternately in fresh
processes through the real CLI (``kvtrace replay --check end --json``), ``--repeat``
times each; the median ``wall_s`` (the replay loop, start-up excluded) is shown per
step, with the SWA / full ratio (issue 43's target: at most 1.5).

Both replay runs of plain decode steps in one allocator call
(``ReplayOptions.decode_runs``; of speculative steps too, on an EAGLE or DFlash trace);
the twin is also replayed step by step (``decode_runs=False``, a ``ReplaySession`` in a
fresh process) for scale, and with ``--swa-steps`` the SWA trace too (what its runs
save). On a shared
machine wall time follows the load, so each SWA and full replay is also timed in CPU
seconds of its process (``time.process_time`` around ``ReplaySession.run``, ``--check
end``, a fresh process each), whose ratio is the steadier figure.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TARGET_RATIO = 1.5


def full_attention_twin(source: Path, out: Path) -> Path:
    """``source`` with its attention layout dropped: a full-attention trace of the same
    traffic, in the same record batches, IPC format and codec (zstd, the bundled
    samples'), so that reading it costs what reading ``source`` does."""
    import pyarrow as pa

    from traces.schema import METADATA_KEY

    with pa.OSFile(str(source)) as sink:
        is_file = sink.read(6) == b"ARROW1"
        sink.seek(0)
        reader = pa.ipc.open_file(sink) if is_file else pa.ipc.open_stream(sink)
        schema = reader.schema
        batches = [reader.get_batch(i) for i in range(reader.num_record_batches)] if is_file else list(reader)
    data = json.loads(schema.metadata[METADATA_KEY])
    data.pop("attention", None)
    metadata = {METADATA_KEY: json.dumps(data).encode()}
    options = pa.ipc.IpcWriteOptions(compression="zstd", use_threads=False)
    new_writer = pa.ipc.new_file if is_file else pa.ipc.new_stream
    with pa.OSFile(str(out), "wb") as sink, new_writer(sink, schema.with_metadata(metadata), options=options) as writer:
        for batch in batches:
            writer.write_batch(batch.replace_schema_metadata(metadata))
    return out


def replay_wall_s(trace: Path) -> tuple[float, int]:
    """``wall_s`` and steps of one ``kvtrace replay --check end`` in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "kvtrace", "replay", str(trace), "--check", "end", "--json"],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    summary = json.loads(done.stdout)
    return float(summary["wall_s"]), int(summary["steps"])


_SESSION = """
import json, sys, time
from kvtrace.replay.engine import ReplayOptions
from kvtrace.replay.session import ReplaySession
options = ReplayOptions(check="end", decode_runs=sys.argv[2] == "runs")
with ReplaySession(sys.argv[1], options=options) as session:
    cpu = time.process_time()
    session.run()
    cpu = time.process_time() - cpu
    print(json.dumps([session.result().wall_s, cpu]))
"""


def session_times(trace: Path, runs: bool) -> tuple[float, float]:
    """``wall_s`` and the process's CPU seconds of a ``ReplaySession`` replay (``--check
    end``, with or without decode runs) in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", _SESSION, str(trace), "runs" if runs else "steps"],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    wall_s, cpu_s = json.loads(done.stdout)
    return float(wall_s), float(cpu_s)


def main() -> None:
    from traces.samples import resolve_trace

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="*", default=["sample:mooncake-gpt-oss", "sample:mooncake-gemma-3"])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--swa-steps", action="store_true", help="also replay each SWA trace step by step")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.traces:
            swa = resolve_trace(spec)
            full = full_attention_twin(swa, Path(tmp) / f"{swa.stem}-full.kvtrace")
            times: dict[str, list[float]] = {"swa": [], "full": [], "full_steps": [], "swa_steps": []}
            cpu: dict[str, list[float]] = {"swa": [], "full": [], "full_steps": [], "swa_steps": []}
            steps = 0
            for _ in range(args.repeat):
                for kind, path in (("swa", swa), ("full", full)):
                    wall_s, steps = replay_wall_s(path)
                    times[kind].append(wall_s)
                    cpu[kind].append(session_times(path, runs=True)[1])
                wall_s, cpu_s = session_times(full, runs=False)
                times["full_steps"].append(wall_s)
                cpu["full_steps"].append(cpu_s)
                if args.swa_steps:
                    wall_s, cpu_s = session_times(swa, runs=False)
                    times["swa_steps"].append(wall_s)
                    cpu["swa_steps"].append(cpu_s)
            med = {kind: statistics.median(t) for kind, t in times.items() if t}
            med_cpu = {kind: statistics.median(t) for kind, t in cpu.items() if t}
            ratio = med["swa"] / med["full"]
            print(
                f"{spec}: {steps:,} steps; SWA {1e6 * med['swa'] / steps:,.1f} µs/step, "
                f"full attention {1e6 * med['full'] / steps:,.1f} µs/step; ratio {ratio:.2f} "
                f"({'within' if ratio <= TARGET_RATIO else 'above'} {TARGET_RATIO}x; "
                f"spread SWA {min(times['swa']):.3f}..{max(times['swa']):.3f} s, "
                f"full {min(times['full']):.3f}..{max(times['full']):.3f} s); "
                f"full attention step by step {1e6 * med['full_steps'] / steps:,.1f} µs/step "
                f"(SWA ratio to it {med['swa'] / med['full_steps']:.2f}); "
                f"CPU: SWA {1e6 * med_cpu['swa'] / steps:,.1f} µs/step, full attention "
                f"{1e6 * med_cpu['full'] / steps:,.1f} µs/step, ratio {med_cpu['swa'] / med_cpu['full']:.2f}"
            )
            if args.swa_steps:
                print(
                    f"{spec}: SWA step by step {1e6 * med['swa_steps'] / steps:,.1f} µs/step "
                    f"(CPU {1e6 * med_cpu['swa_steps'] / steps:,.1f} µs/step); with runs "
                    f"{med['swa_steps'] / med['swa']:.2f}x faster (CPU {med_cpu['swa_steps'] / med_cpu['swa']:.2f}x)"
                )


if __name__ == "__main__":
    main()
