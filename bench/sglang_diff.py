"""SGLang's own allocator against the built-in one: ``kvtrace diff --exact`` over the bundled
and generated traces, and the one-hour sample replayed through both, in one run.

Usage:
    python bench/sglang_diff.py [--sglang PYTHON] [--pages 1,16,64] [--traces NAME,...]
                                [--synth N] [--no-hour] [--hour-only]

``--sglang`` defaults to ``$KVTRACE_SGLANG_PYTHON`` (an environment made by
``tools/sglang_oracle/setup.sh``). Each diff runs in a fresh process through the real CLI:
``kvtrace diff TRACE --a sglang:PYTHON --b builtin --exact --page-size P --jobs 2 --json``,
for every bundled trace (``traces/samples``; the one-hour ``mooncake-conversation`` at its
own page size only, unless named in ``--traces``) at each page size, then for ``--synth N``
seeds of generated traces (``traces.synth``) of four shapes: page 1 chunked prefill with
retraction and aborts, page 16 EAGLE with retraction, page 64 PD decode with explicit token
ids, page 16 PD decode with EAGLE. Prints each diff's verdict, steps compared and wall time;
exits 1 if any diverged. Then (unless ``--no-hour``) ``kvtrace replay
sample:mooncake-conversation --json`` through ``sglang:PYTHON`` and through ``builtin``:
both wall times and whether the summaries agree. The machine may be shared: wall times
vary with its load (printed).
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

from traces.samples import list_samples  # noqa: E402
from traces.synth import generate  # noqa: E402

HOUR = "mooncake-conversation"
SHAPES: dict[str, dict[str, object]] = {
    "p1-chunked-retract-abort": dict(page_size=1, chunk_size=64, retract_prob=0.05, abort_prob=0.03),
    "p16-eagle-retract": dict(page_size=16, spec=True, retract_prob=0.05, abort_prob=0.02),
    "p64-pd-explicit": dict(page_size=64, pd_decode=True, block_size=64, retract_prob=0.05, explicit_fraction=0.5),
    "p16-pd-eagle": dict(page_size=16, pd_decode=True, block_size=16, spec=True, retract_prob=0.03),
}


def kvtrace(args: list[str]) -> tuple[float, int, dict]:
    """``kvtrace ARGS --json`` in a fresh process: (wall s, exit code, the JSON printed)."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "kvtrace", *args, "--json"], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - t0
    if proc.returncode not in (0, 1):
        raise SystemExit(f"kvtrace {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return wall, proc.returncode, json.loads(proc.stdout)


def diff(trace: str, python: str, page: int | None) -> bool:
    """One exact diff, printed; whether it was identical."""
    args = ["diff", trace, "--a", f"sglang:{python}", "--b", "builtin", "--exact", "--jobs", "2"]
    if page is not None:
        args += ["--page-size", str(page)]
    wall, code, out = kvtrace(args)
    a = out["a"]
    verdict = "identical" if out["identical"] else f"DIVERGED at {out['first_divergence']}"
    print(f"{Path(trace).name:<34}{page or '-':>5}{out['steps_compared']:>9,}{a.get('retractions', 0):>7}"
          f"{a.get('num_ooms', 0):>6}{wall:>9.1f}  {verdict}", flush=True)
    return bool(out["identical"]) and code == 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sglang", default=os.environ.get("KVTRACE_SGLANG_PYTHON"))
    ap.add_argument("--pages", default="1,16,64")
    ap.add_argument("--traces", default=None, help="bundled trace names (default: all)")
    ap.add_argument("--synth", type=int, default=2, help="seeds per generated shape")
    ap.add_argument("--no-hour", action="store_true", help="skip the one-hour replay timing")
    ap.add_argument("--hour-only", action="store_true", help="only the one-hour replay timing")
    args = ap.parse_args()
    if not args.sglang:
        raise SystemExit("give --sglang PYTHON or set $KVTRACE_SGLANG_PYTHON (tools/sglang_oracle/setup.sh)")
    pages = [int(p) for p in args.pages.split(",")]
    names = args.traces.split(",") if args.traces else list_samples()
    bad = 0
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; sglang:{args.sglang}")
    if not args.hour_only:
        print(f"{'trace':<34}{'page':>5}{'steps':>9}{'retr':>7}{'ooms':>6}{'wall s':>9}  verdict")
        for name in names:
            for page in ([None] if name == HOUR and not args.traces else pages):
                bad += not diff(f"sample:{name}", args.sglang, page)
        with tempfile.TemporaryDirectory() as tmp:
            for shape, kw in SHAPES.items():
                for seed in range(args.synth):
                    path = Path(tmp) / f"{shape}-s{seed}.kvtrace"
                    generate(str(path), num_requests=60, seed=100 + seed, pool_tokens=12_288,
                             max_context_len=2048, max_running=16, **kw)  # type: ignore[arg-type]
                    bad += not diff(str(path), args.sglang, None)
        print(f"{bad} diff(s) not identical")
    if not args.no_hour:
        walls = {}
        summaries = {}
        for version in (f"sglang:{args.sglang}", "builtin"):
            walls[version], _, summaries[version] = kvtrace(["replay", f"sample:{HOUR}", "--allocator", version])
            s = summaries[version]
            print(f"replay sample:{HOUR} --allocator {version}: wall {walls[version]:.1f} s "
                  f"({s['steps']:,} steps, {s.get('speedup_vs_realtime', 0):,.0f}x real time)", flush=True)
        keys = ("steps", "peak_used_tokens", "peak_step", "evicted_tokens", "num_ooms", "prefix_hit_rate", "overalloc",
                "retractions", "num_violations")
        a, b = summaries.values()
        same = all(a.get(k) == b.get(k) for k in keys)
        print(f"summaries ({', '.join(keys)}) {'agree' if same else 'DIFFER'}; "
              f"sglang / builtin wall {walls[f'sglang:{args.sglang}'] / walls['builtin']:.1f}x; "
              f"load average {os.getloadavg()[0]:.1f}")
        bad += not same
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
