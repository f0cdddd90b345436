"""Cost of recording: microseconds per recorded step of 256 decode ops.

Run: ``python bench/recorder.py [--steps N]``. Prints, for steps_per_batch 1 (every
step flushed to disk) and larger batches, the wall time per step of a live engine's
calls (begin_step, decode(256 string ids, seq_lens), end_step), with dense int ids
and with engine string ids, and the bytes written per step.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvtrace.record.recorder import Recorder  # noqa: E402
from traces.metadata import TraceConfig, TraceMeta  # noqa: E402
from traces.reader import TraceReader  # noqa: E402

BATCH = 256


def run(steps: int, steps_per_batch: int, string_ids: bool, directory: Path) -> tuple[float, float]:
    meta = TraceMeta(config=TraceConfig(page_size=16, pool_tokens=900_000, max_running=256, max_context_len=131_072))
    path = directory / f"bench-{steps_per_batch}-{string_ids}.kvtrace"
    ids: list[str] | np.ndarray = [f"req-{i:06d}" for i in range(BATCH)] if string_ids else np.arange(BATCH)
    seq = np.full(BATCH, 1000, np.int64)
    with Recorder(path, meta, steps_per_batch=steps_per_batch, overwrite=True, dense_ids=not string_ids) as rec:
        rec.record_step(0.0, extend=(ids, seq))
        t0 = time.perf_counter()
        for step in range(steps):
            seq = seq + 1
            rec.begin_step(0.02 * (step + 1))
            rec.decode(ids, seq)
            rec.end_step()
        elapsed = time.perf_counter() - t0
    assert sum(1 for _ in TraceReader(path).steps()) == steps + 1
    return elapsed / steps * 1e6, path.stat().st_size / (steps + 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    print(f"recorder: {BATCH} decode ops per step, {args.steps} steps")
    print(f"{'steps/batch':>11} {'ids':>7} {'us/step':>9} {'bytes/step':>11}")
    with tempfile.TemporaryDirectory() as tmp:
        for spb in (1, 16, 256):
            for string_ids in (False, True):
                us, size = run(args.steps, spb, string_ids, Path(tmp))
                print(f"{spb:>11} {'string' if string_ids else 'int':>7} {us:>9.1f} {size:>11.0f}")


if __name__ == "__main__":
    main()
