"""Start-up time of the command line: ``kvtrace --help`` and ``kvtrace info`` of a bundled trace.

Run: ``python bench/startup.py [--runs N]``. Each command runs N times as a fresh
process (the console script of this environment); printed are the fastest and the
median wall time, the CPU time of the fastest run, and what the process imported:
the modules that cost most (``python -X importtime``, cumulative) and whether torch
was among them (it must not be: torch is imported only where an allocator runs).
Target (docs/DESIGN: performance): under 0.3 s for both.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS: tuple[tuple[str, ...], ...] = (("--help",), ("info", "sample:tiny"), ("info", "sample:mooncake-tiny"))
# Modules whose cumulative import time is reported (what each brought in that was not loaded yet).
WATCHED = ("kvtrace.cli", "typer", "pydantic", "rich.console", "rich.table", "numpy", "pyarrow", "traces.reader", "pandas", "torch")


def _kvtrace() -> list[str]:
    script = Path(sys.executable).with_name("kvtrace")
    if script.exists():
        return [str(script)]
    found = shutil.which("kvtrace")
    return [found] if found else [sys.executable, "-m", "kvtrace"]


def _run(argv: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds of one run (the child's user + system time)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def _imports(args: tuple[str, ...]) -> dict[str, float]:
    """Cumulative import seconds of the WATCHED top-level packages in one run."""
    code = "import sys; from kvtrace.cli import main; sys.argv = ['kvtrace', *sys.argv[1:]]; main()"
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "80"},
    )
    seen: dict[str, float] = {}
    for line in result.stderr.splitlines():
        match = re.match(r"import time:\s+\d+ \|\s+(\d+) \|( *)(\S+)$", line)
        if match and match.group(3) in WATCHED:
            seen[match.group(3)] = max(seen.get(match.group(3), 0.0), int(match.group(1)) / 1e6)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="runs of each command (default 15)")
    args = parser.parse_args()
    kvtrace = _kvtrace()
    print(f"{' '.join(kvtrace)}: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start")
    print(f"{'command':36} {'fastest':>8} {'median':>8} {'cpu':>7}  imports (cumulative s)")
    for command in COMMANDS:
        runs = [_run([*kvtrace, *command]) for _ in range(args.runs)]
        walls = sorted(w for w, _ in runs)
        cpu = min(runs)[1]
        imported = _imports(command)
        shown = ", ".join(f"{name} {seconds:.3f}" for name, seconds in sorted(imported.items(), key=lambda x: -x[1]))
        torch = "TORCH IMPORTED" if "torch" in imported else "no torch"
        if "pandas" in imported:
            torch += ", PANDAS IMPORTED"
        print(
            f"kvtrace {' '.join(command):28} {walls[0]:7.3f}s {statistics.median(walls):7.3f}s {cpu:6.3f}s  "
            f"{torch}; {shown}"
        )


if __name__ == "__main__":
    main()
