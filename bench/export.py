"""Export benchmark: ``kvtrace export`` of a trace against a plain replay of it, in one run.

Usage (from the repository root)::

    .venv/bin/python bench/export.py                        # the one-hour sample, Perfetto
    .venv/bin/python bench/export.py --trace sample:azure-code --to chrome --repeat 3
    .venv/bin/python bench/export.py --flows                # also the export with --flows

Each replay and each export runs in its own subprocess (alternating, ``--repeat`` times each),
so the peak RSS figures are each process's own. The plain replay is what ``kvtrace replay``
does without ``--out``: every snapshot of the session, nothing written. The export replays the
same way and writes every step's records (``kvtrace.export``); ``--flows`` adds an export
with the eviction flows (explain's attribution run along). Prints the wall time and peak
RSS of each (the best wall and the median RSS over the repeats), their ratios and the
targets of issue #40: export at most 2x the replay's wall time, peak memory within 10%.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WALL_TARGET = 2.0
RSS_TARGET = 1.10


def _child(mode: str, trace: str, to: str, out: str) -> None:
    """One replay or export in this process; prints its figures as one JSON line."""
    from kvtrace.replay.session import ReplaySession

    t0 = time.perf_counter()
    steps = 0
    with ReplaySession(trace) as session:
        if mode == "replay":
            for _ in session.snapshots():
                steps += 1
        else:
            from kvtrace.export.flows import EvictionFlows
            from kvtrace.export.run import ProcessExport, open_timeline_file

            flows = EvictionFlows.attach(session) if mode == "flows" else None
            with open_timeline_file(out, to) as file:  # type: ignore[arg-type]
                export = ProcessExport(file, trace, flows=flows)
                for snap in session.snapshots():
                    export.feed(snap)
                    steps += 1
                export.finish()
    wall = time.perf_counter() - t0
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB
    size = os.path.getsize(out) if mode != "replay" else 0
    print(json.dumps({"mode": mode, "steps": steps, "wall_s": wall, "rss_mb": rss_mb, "file_bytes": size}))


def _run(mode: str, trace: str, to: str, out: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, __file__, "--child", mode, "--trace", trace, "--to", to, "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed ({proc.returncode}):\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default="sample:mooncake-conversation")
    parser.add_argument("--to", choices=("perfetto", "chrome"), default="perfetto")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--flows", action="store_true", help="also time the export with --flows")
    parser.add_argument("--child", choices=("replay", "export", "flows"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.trace, args.to, args.out)
        return
    modes = ("replay", "export", "flows") if args.flows else ("replay", "export")
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / ("export.pftrace" if args.to == "perfetto" else "export.json")
        for _ in range(args.repeat):
            for mode in modes:
                runs[mode].append(_run(mode, args.trace, args.to, out))
                if out.exists():
                    out.unlink()
    wall = {m: min(r["wall_s"] for r in rs) for m, rs in runs.items()}
    rss = {m: statistics.median(r["rss_mb"] for r in rs) for m, rs in runs.items()}
    steps = runs["replay"][0]["steps"]
    size = runs["export"][0]["file_bytes"]
    load = os.getloadavg()[0]
    print(f"{args.trace}: {steps:,} steps, export --to {args.to}: {size / 1e6:,.1f} MB; "
          f"{args.repeat} run(s) each, load {load:.1f} on {os.cpu_count()} cores")
    print(f"{'':10} {'wall s':>8} {'µs/step':>8} {'peak RSS MB':>12}")
    for mode in modes:
        print(f"{mode:10} {wall[mode]:8.2f} {1e6 * wall[mode] / steps:8.1f} {rss[mode]:12.1f}")
    for mode in modes[1:]:
        wall_ratio = wall[mode] / wall["replay"]
        rss_ratio = rss[mode] / rss["replay"]
        print(f"{mode}: wall ratio {wall_ratio:.2f}x (target <= {WALL_TARGET:.1f}x: "
              f"{'met' if wall_ratio <= WALL_TARGET else 'MISSED'}); peak RSS ratio {rss_ratio:.3f}x "
              f"(target <= {RSS_TARGET:.2f}x: {'met' if rss_ratio <= RSS_TARGET else 'MISSED'})")


if __name__ == "__main__":
    main()
