"""Replay speed of a hybrid sliding-window (SWA) trace against the same traffic as a
full-attention trace.

Usage:
    python bench/swa.py [TRACE ...] [--repeat N]

For each SWA trace (default: the bundled ``mooncake-gpt-oss`` and ``mooncake-gemma-3``)
the bench writes its full-attention twin: the same file with the metadata's
``attention`` layout removed (same steps, ops and pool), so the only difference is the
second KV pool and its out-of-window frees. Both are replayed alternately in fresh
processes through the real CLI (``kvtrace replay --check end --json``), ``--repeat``
times each; the median ``wall_s`` (the replay loop, start-up excluded) is shown per
step, with the SWA / full ratio (issue 43's target: at most 1.5).

The full-attention replay applies runs of plain decode steps in one allocator call
(``ReplayOptions.decode_runs``), which the SWA allocator does not offer; the twin is
therefore also replayed step by step (``decode_runs=False``, a ``ReplaySession`` in a
fresh process), which separates the cost of the missing runs from that of the SWA
pool itself.
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
    """``source`` with its attention layout dropped: a full-attention trace of the same traffic."""
    import pyarrow as pa

    from traces.schema import METADATA_KEY

    with pa.OSFile(str(source)) as sink:
        is_file = sink.read(6) == b"ARROW1"
        sink.seek(0)
        reader = pa.ipc.open_file(sink) if is_file else pa.ipc.open_stream(sink)
        schema, table = reader.schema, reader.read_all()
    data = json.loads(schema.metadata[METADATA_KEY])
    data.pop("attention", None)
    metadata = {METADATA_KEY: json.dumps(data).encode()}
    with pa.OSFile(str(out), "wb") as sink, pa.ipc.new_stream(sink, schema.with_metadata(metadata)) as writer:
        writer.write_table(table.replace_schema_metadata(metadata))
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


_STEP_BY_STEP = """
import json, sys
from kvtrace.replay.engine import ReplayOptions
from kvtrace.replay.session import ReplaySession
with ReplaySession(sys.argv[1], options=ReplayOptions(decode_runs=False)) as session:
    session.run()
    print(json.dumps(session.result().wall_s))
"""


def step_by_step_wall_s(trace: Path) -> float:
    """``wall_s`` of a replay without decode runs, in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", _STEP_BY_STEP, str(trace)], capture_output=True, text=True, env=env, check=True
    )
    return float(done.stdout)


def main() -> None:
    from traces.samples import resolve_trace

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="*", default=["sample:mooncake-gpt-oss", "sample:mooncake-gemma-3"])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.traces:
            swa = resolve_trace(spec)
            full = full_attention_twin(swa, Path(tmp) / f"{swa.stem}-full.kvtrace")
            times: dict[str, list[float]] = {"swa": [], "full": [], "full_steps": []}
            steps = 0
            for _ in range(args.repeat):
                for kind, path in (("swa", swa), ("full", full)):
                    wall_s, steps = replay_wall_s(path)
                    times[kind].append(wall_s)
                times["full_steps"].append(step_by_step_wall_s(full))
            med = {kind: statistics.median(t) for kind, t in times.items()}
            ratio = med["swa"] / med["full"]
            print(
                f"{spec}: {steps:,} steps; SWA {1e6 * med['swa'] / steps:,.1f} µs/step, "
                f"full attention {1e6 * med['full'] / steps:,.1f} µs/step; ratio {ratio:.2f} "
                f"({'within' if ratio <= TARGET_RATIO else 'above'} {TARGET_RATIO}x; "
                f"spread SWA {min(times['swa']):.3f}..{max(times['swa']):.3f} s, "
                f"full {min(times['full']):.3f}..{max(times['full']):.3f} s); "
                f"full attention step by step {1e6 * med['full_steps'] / steps:,.1f} µs/step "
                f"(SWA ratio to it {med['swa'] / med['full_steps']:.2f})"
            )


if __name__ == "__main__":
    main()
