"""Regenerate the bundled sample traces in ``traces/samples/`` exactly.

Run: ``python bench/make_samples.py [--only NAME ...] [--list]``

Every sample is recorded by ``kvtrace record`` (the scheduler model on the real
allocator) from a workload file bundled in ``traces/workloads_data/``, with fixed
seeds and a fixed creation time (``SOURCE_DATE_EPOCH``), so a rerun from the
repository root writes the same steps, rows and values, and the same file byte for
byte unless pyarrow's compressor or the kvtrace version changes. They are Arrow IPC
*files* carrying their provenance (kvtrace version, command line, creation time,
completion) and each request's arrival time (``arrival_s``), so ``kvtrace record
sample:NAME`` schedules their requests anew as they arrived. Each trace's metadata
``source`` carries the data's repository, path, licence and citation;
``traces/README.md`` lists them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# The samples' creation time (2025-01-01T00:00:00Z): fixed, so reruns match byte for byte.
SAMPLES_EPOCH = "1735689600"
DATA = ROOT / "traces" / "workloads_data"
SAMPLES = ROOT / "traces" / "samples"
MOONCAKE = DATA / "mooncake-fast25" / "conversation_trace.jsonl"
AZURE_CODE = DATA / "azure-llm-inference-2023" / "AzureLLMInferenceTrace_code.csv"


@dataclass(frozen=True)
class Sample:
    name: str
    what: str
    args: tuple[str, ...]


SAMPLES_SPEC: tuple[Sample, ...] = (
    Sample(
        "mooncake-conversation.kvtrace",
        "Mooncake conversation trace, the whole hour (12,031 requests), default H200 serving config",
        (str(MOONCAKE), "--format", "mooncake"),
    ),
    Sample(
        "mooncake-eagle.kvtrace",
        "Mooncake conversation, first 5 minutes, EAGLE 3,1,4 speculative decoding at page 16",
        (str(MOONCAKE), "--format", "mooncake", "--duration", "5m", "--page-size", "16", "--spec", "eagle:3,1,4"),
    ),
    Sample(
        "azure-code.kvtrace",
        "Azure LLM inference 2023 code trace, the whole hour, page 16",
        (str(AZURE_CODE), "--format", "azure", "--page-size", "16"),
    ),
    Sample(
        "mooncake-pressure.kvtrace",
        "Mooncake conversation, first 4 minutes, 48k-token pool at page 64 with EAGLE 5,4,8 (1,024-slot draft "
        "reserve per request): eviction, retraction and an OOM abort",
        (
            str(MOONCAKE),
            "--format",
            "mooncake",
            "--duration",
            "4m",
            "--page-size",
            "64",
            "--pool-tokens",
            "48000",
            "--spec",
            "eagle:5,4,8",
        ),
    ),
    Sample(
        "mooncake-tiny.kvtrace",
        "Mooncake conversation, first 12 seconds of arrivals at page 16 (tests, README)",
        (str(MOONCAKE), "--format", "mooncake", "--duration", "12s", "--page-size", "16", "--pool-tokens", "200000"),
    ),
    # Streaming sessions: a session per conversation, the conversations inferred from the hash_ids.
    Sample(
        "mooncake-sessions.kvtrace",
        "Mooncake conversation, first 90 seconds, page 16, --sessions (conversations inferred from the hash_ids)",
        (str(MOONCAKE), "--format", "mooncake", "--duration", "90s", "--page-size", "16", "--sessions"),
    ),
    # HiCache's host tier: an 80k-token device pool evicts the first turns' prompts to a host
    # pool large enough to keep them until their next turns load them back.
    Sample(
        "mooncake-hicache.kvtrace",
        "Mooncake conversation, first 50 seconds, page 16, 80k-token pool, HiCache host tier "
        "(--hicache-ratio 24, write_through): host hits loaded back",
        (str(MOONCAKE), "--format", "mooncake", "--duration", "50s", "--page-size", "16", "--pool-tokens", "80000",
         "--hicache-ratio", "24"),
    ),
    # Hybrid sliding-window models (two KV pools), radix cache off until the SWA radix cache lands.
    Sample(
        "mooncake-gpt-oss.kvtrace",
        "Mooncake conversation, first 12 seconds, gpt-oss-20b (1:1 full/SWA layers, window 128), page 16, "
        "60k-token full pool, radix cache off",
        (str(MOONCAKE), "--format", "mooncake", "--duration", "12s", "--page-size", "16", "--pool-tokens", "60000",
         "--model", "gpt-oss-20b", "--no-radix-cache"),
    ),
    Sample(
        "mooncake-gemma-3.kvtrace",
        "Mooncake conversation, first 12 seconds, gemma-3-27b (5:1 SWA/full layers, window 1,024), page 16, "
        "60k-token full pool, radix cache off",
        (str(MOONCAKE), "--format", "mooncake", "--duration", "12s", "--page-size", "16", "--pool-tokens", "60000",
         "--model", "gemma-3-27b", "--no-radix-cache"),
    ),
    # Hybrid linear-attention models (KV pool + Mamba state pool), radix cache off until
    # the allocator serves the Mamba radix cache.
    Sample(
        "mooncake-qwen3-next.kvtrace",
        "Mooncake conversation, first 12 seconds, qwen3-next-80b-a3b (3:1 linear/full layers, 16 Mamba state "
        "slots), page 16, 60k-token full pool, radix cache off",
        (str(MOONCAKE), "--format", "mooncake", "--duration", "12s", "--page-size", "16", "--pool-tokens", "60000",
         "--model", "qwen3-next-80b-a3b", "--no-radix-cache"),
    ),
    # With the radix cache: its checkpointed Mamba states (no_buffer, so page 1).
    Sample(
        "mooncake-qwen3-next-radix.kvtrace",
        "Mooncake conversation, first 12 seconds, qwen3-next-80b-a3b (3:1 linear/full layers, 56 Mamba state "
        "slots), page 1, 200k-token full pool, radix cache on (checkpointed states, no_buffer)",
        (str(MOONCAKE), "--format", "mooncake", "--duration", "12s", "--page-size", "1", "--pool-tokens", "200000",
         "--model", "qwen3-next-80b-a3b"),
    ),
)


def make(sample: Sample) -> dict:
    import json

    from typer.testing import CliRunner

    from kvtrace.cli import app

    out = SAMPLES / sample.name
    # No wall-clock flushes: record batches then depend only on the steps, so the
    # files come out byte for byte the same. Paths relative to the working directory
    # keep the command line in the metadata the same in every checkout.
    paths = [os.path.relpath(a) if Path(a).is_absolute() else a for a in sample.args]
    out_arg = os.path.relpath(out)
    args = ["record", *paths, "--out", out_arg, "--force", "--seed", "0", "--flush-interval", "0", "--json"]
    t0 = time.perf_counter()
    result = CliRunner().invoke(app, args)
    if result.exit_code != 0:
        raise SystemExit(f"{sample.name}: kvtrace record failed ({result.exit_code}): {result.output}")
    report = json.loads(result.stdout)
    report["make_s"] = time.perf_counter() - t0
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="sample file names to rebuild")
    parser.add_argument("--list", action="store_true", help="list the samples and their commands")
    args = parser.parse_args()
    if args.list:
        for s in SAMPLES_SPEC:
            rel = [a.replace(str(ROOT) + "/", "") for a in s.args]
            print(
                f"{s.name}: {s.what}\n  kvtrace record {' '.join(rel)} --out traces/samples/{s.name} --seed 0 "
                "--flush-interval 0"
            )
        return
    os.environ.setdefault("SOURCE_DATE_EPOCH", SAMPLES_EPOCH)
    SAMPLES.mkdir(parents=True, exist_ok=True)
    total = 0
    for sample in SAMPLES_SPEC:
        if args.only and sample.name not in args.only:
            continue
        r = make(sample)
        total += r["file_bytes"]
        print(
            f"{sample.name:32} {r['file_bytes'] / 1e6:6.2f} MB  steps {r['steps']:>7,}  requests {r['requests']:>6,}  "
            f"sim {r['duration_s']:8.1f} s  hit {r['prefix_hit_rate']:.3f}  retract {r['retractions']}  "
            f"abort {r['aborts']}  evicted {r['evicted_tokens']:,}  integrity "
            f"{'clean' if not r['integrity_violations'] else r['integrity_violations']}  ({r['make_s']:.1f} s)"
        )
    print(f"total {total / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
