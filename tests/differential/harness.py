"""Differential harness: the same scenarios through SGLang 0.5.23's real allocator
classes and through kvtrace's allocator, compared step by step.

    python -m tests.differential.harness [INPUT ...] [--random N] [--json]

INPUT is a scenario file (``.jsonl``, see ``scenario.py``), a kvtrace trace
(``.kvtrace``, converted by ``trace_adapter.py``), or ``builtin`` (the
hand-written scenarios of ``scenarios.py``; the default when nothing else is
asked). ``--random N`` adds N seeded random scenarios per configuration
(``scenarios.RANDOM_CONFIGS``: page 1/16 x spec off / EAGLE 3,1,4 / EAGLE 5,4,8,
and two PD decode ones: page 1, page 16 with EAGLE 3,1,4).

The SGLang side runs as a subprocess of ``$KVTRACE_SGLANG_PYTHON`` (or
``--sglang-python``), the interpreter of a venv made by
``tools/sglang_oracle/setup.sh``; ours runs in this process.

Prints the FIRST divergence of each scenario (step, op, request, field, both
values, context) and a summary; ``--json`` prints one JSON object instead.
Exit code: 0 identical (expected divergences included), 1 diverged, 2 error.
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
from typing import Sequence

from kvtrace.sglang import scenario as sc
from tests.differential import compare, scenarios as gen

DRIVER = Path(__file__).resolve().parents[2] / "kvtrace" / "sglang" / "driver.py"
ENV_VAR = "KVTRACE_SGLANG_PYTHON"


class HarnessError(RuntimeError):
    """The harness could not run a side (bad input, missing SGLang venv, driver crash)."""


def sglang_python(explicit: str | None = None) -> str | None:
    """The SGLang venv interpreter: ``explicit``, else ``$KVTRACE_SGLANG_PYTHON``."""
    return explicit or os.environ.get(ENV_VAR) or None


def sglang_unusable(python: str | None, modules: tuple[str, ...] = ()) -> str | None:
    """Why the SGLang interpreter cannot be used (None when it looks usable).

    Cheap check (no SGLang import, which takes ~6 s): the interpreter runs, has an
    sglang release the driver knows (``kvtrace.sglang.probe.probe``) and, when asked,
    the ``modules`` (e.g. ``pyarrow`` for the live recorder).
    """
    from kvtrace.sglang import KNOWN_SGLANG_VERSIONS
    from kvtrace.sglang.probe import probe

    if not python:
        return f"{ENV_VAR} is not set (create the venv with tools/sglang_oracle/setup.sh)"
    version, why = probe(python)
    if version is None:
        return f"{ENV_VAR}: {why}"
    if version not in KNOWN_SGLANG_VERSIONS:
        return f"{python} has sglang {version}, the driver knows {', '.join(KNOWN_SGLANG_VERSIONS)}"
    for module in modules:
        done = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            return f"{python} cannot import {module} (re-run tools/sglang_oracle/setup.sh on that venv)"
    return None


def require_sglang(modules: tuple[str, ...] = ()) -> str:
    """The SGLang interpreter for a test, else skip it with the reason; with
    ``$KVTRACE_REQUIRE_SGLANG=1`` (``.ci/run`` sets it) a missing SGLang fails the test
    instead, so the parity tests cannot silently skip in CI."""
    import pytest

    python = sglang_python()
    why = sglang_unusable(python, modules)
    if why is None:
        assert python is not None
        return python
    if os.environ.get("KVTRACE_REQUIRE_SGLANG") == "1":
        pytest.fail(f"SGLang required ($KVTRACE_REQUIRE_SGLANG=1) but unavailable: {why}")
    pytest.skip(f"SGLang unavailable: {why}")


def run_sglang(
    scenario_file: str, out_file: str, python: str, tree: str = "radix", timeout: float = 1800, fine: bool = False,
) -> float:
    """Run the SGLang driver on a scenario file; returns its wall time. Raises HarnessError."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [python, str(DRIVER), scenario_file, "-o", out_file, "--tree", tree] + (["--fine"] if fine else []),
        capture_output=True, text=True, timeout=timeout,
    )
    if not os.path.exists(out_file) or os.path.getsize(out_file) == 0:
        tail = (proc.stderr or "").strip().splitlines()[-5:]
        raise HarnessError(f"SGLang driver produced no output (exit {proc.returncode}): {' | '.join(tail)}")
    return time.perf_counter() - t0


def run_ours(scenarios: Sequence[sc.Scenario], out_file: str, module: str = "allocator", fine: bool = False) -> float:
    from tests.differential import ours_driver

    t0 = time.perf_counter()
    with open(out_file, "w") as f:
        ours_driver.run_scenarios(scenarios, f, module, fine)
    return time.perf_counter() - t0


def load_inputs(inputs: Sequence[str], random_seeds: int, seed: int, steps: int | None) -> list[sc.Scenario]:
    out: list[sc.Scenario] = []
    for item in inputs:
        if item == "builtin":
            out.extend(gen.hand_written())
        elif item.endswith(".kvtrace"):
            from tests.differential import trace_adapter
            from traces.errors import TraceError

            try:
                out.append(trace_adapter.trace_to_scenario(item))
            except TraceError as exc:
                raise HarnessError(str(exc)) from None
        elif os.path.isfile(item):
            out.extend(sc.load_scenarios(item))
        else:
            raise HarnessError(f"{item}: not a scenario file, a .kvtrace trace or 'builtin'")
    if random_seeds:
        out.extend(gen.random_scenarios(range(seed, seed + random_seeds), steps=steps))
    names = [s.name for s in out]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise HarnessError(f"scenario names must be unique; repeated: {sorted(dup)[:5]}")
    return out


def differential(
    scenarios: Sequence[sc.Scenario], python: str, *, module: str = "allocator", tree: str = "radix",
    keep_dir: str | None = None, fine: bool = False,
) -> tuple[compare.Summary, dict[str, float]]:
    """Run both sides on ``scenarios`` and compare. Raises HarnessError if a side cannot run."""
    with tempfile.TemporaryDirectory(prefix="kvtrace-diff-") as tmp:
        work = keep_dir or tmp
        os.makedirs(work, exist_ok=True)
        scen_file = os.path.join(work, "scenarios.jsonl")
        sc.dump_scenarios(scenarios, scen_file)
        sg_out, ours_out = os.path.join(work, "sglang.jsonl"), os.path.join(work, "ours.jsonl")
        t_sg = run_sglang(scen_file, sg_out, python, tree, fine=fine)
        t_ours = run_ours(scenarios, ours_out, module, fine)
        with open(sg_out) as a, open(ours_out) as b:
            summary = compare.compare_runs(scenarios, a, b)
    return summary, {"sglang_s": round(t_sg, 2), "ours_s": round(t_ours, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tests.differential.harness",
        description="compare kvtrace's allocator with SGLang 0.5.23's real classes",
    )
    ap.add_argument("inputs", nargs="*", help="scenario .jsonl files, .kvtrace traces, or 'builtin'")
    ap.add_argument("--random", type=int, default=0, metavar="N", help="random seeds per configuration")
    ap.add_argument("--seed", type=int, default=0, help="first random seed")
    ap.add_argument("--steps", type=int, default=None, help="steps per random scenario")
    ap.add_argument("--only", action="append", help="only scenarios whose name contains this (repeatable)")
    ap.add_argument("--sglang-python", help=f"SGLang venv interpreter (default ${ENV_VAR})")
    ap.add_argument("--allocator", default="allocator", help="module exposing create_allocator")
    ap.add_argument("--tree", choices=("radix", "unified"), default="radix", help="SGLang tree class")
    ap.add_argument("--keep", metavar="DIR", help="keep scenario and dump files in DIR")
    ap.add_argument("--fine", action="store_true",
                    help="compare after every batched call, not only after every step (pins the call)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    inputs = args.inputs or ([] if args.random else ["builtin"])
    try:
        scens = load_inputs(inputs, args.random, args.seed, args.steps)
        if args.only:
            scens = [s for s in scens if any(o in s.name for o in args.only)]
        if not scens:
            raise HarnessError("no scenario selected")
        python = sglang_python(args.sglang_python)
        why = sglang_unusable(python)
        if why:
            raise HarnessError(why)
        summary, times = differential(
            scens, python, module=args.allocator, tree=args.tree, keep_dir=args.keep, fine=args.fine,
        )
    except (HarnessError, sc.ScenarioError, OSError, subprocess.SubprocessError) as exc:
        if args.json:
            print(json.dumps({"identical": False, "error": str(exc)}))
        else:
            print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out = summary.to_dict()
        out["times"] = times
        print(json.dumps(out))
    else:
        print(summary.render())
        print(f"(sglang side {times['sglang_s']} s including its ~6 s import, ours {times['ours_s']} s)")
    if summary.has_error:
        return 2
    return 0 if summary.identical else 1


if __name__ == "__main__":
    sys.exit(main())
