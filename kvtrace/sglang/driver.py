"""The SGLang driver: SGLang 0.5.23's REAL allocator classes, run by any interpreter with sglang.

Run by path (kvtrace need not be installed in that environment; this directory is
loaded as a package of its own, whose modules import the standard library, numpy,
torch and sglang only)::

    PYTHON kvtrace/sglang/driver.py --serve                 # the Allocator protocol on stdin/stdout
    PYTHON kvtrace/sglang/driver.py SCENARIOS.jsonl [-o OUT.jsonl] [--tree unified] [--fine]

``--serve``: the SGLang side of the kvtrace versions ``sglang`` / ``sglang:PYTHON``
(``server.py``; ``kvtrace.versions.sglang`` starts it). A scenario file: the
differential tests' JSON-lines scenarios (``scenario.py``), one state dump per step
(``scenario.STATE_FIELDS`` plus ``step`` and ``events``) after a header ``{"scenario",
"engine", "config", "row_width"}``, then ``{"end": name, "steps", "wall_s"}`` or
``{"end": name, "error": "..."}``. ``world.py`` lists every emulation decision.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import IO

__all__ = ["main", "package"]

_ALIAS = "kvtrace_sglang_driver"


def package() -> ModuleType:
    """This directory as a package: ``kvtrace.sglang`` when kvtrace imports it, else
    loaded by path under a name of its own (no ``sys.path`` change)."""
    if __package__:
        return importlib.import_module(__package__)
    if _ALIAS in sys.modules:
        return sys.modules[_ALIAS]
    here = Path(__file__).resolve().parent
    spec = importlib.util.spec_from_file_location(_ALIAS, here / "__init__.py", submodule_search_locations=[str(here)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[_ALIAS] = module
    spec.loader.exec_module(module)
    return module


def _sub(name: str) -> ModuleType:
    return importlib.import_module(f"{package().__name__}.{name}")


def run_file(path: str, out: IO[str], tree_kind: str, only: set[str] | None, fine: bool = False) -> int:
    """Run every scenario of ``path`` (or those named in ``only``); returns the failures."""
    sc, runner, world = _sub("scenario"), _sub("runner"), _sub("world")
    failures = 0
    for scen in sc.load_scenarios(path):
        if only and scen.name not in only:
            continue
        t0 = time.perf_counter()
        eng = None
        try:
            eng = world.SGLangEngine(scen.config, tree_kind)
            out.write(json.dumps({"scenario": scen.name, "engine": f"sglang-{world.SG.version}/{tree_kind}",
                                  "config": scen.config.to_dict(), "row_width": eng.row_width}) + "\n")
            stats = runner.run_scenario(scen, eng, lambda d: out.write(json.dumps(d) + "\n"), fine=fine)
            out.write(json.dumps({"end": scen.name, "steps": stats.steps, "ops": stats.ops,
                                  "wall_s": round(time.perf_counter() - t0, 4)}) + "\n")
        except Exception as exc:  # report per scenario, keep going
            failures += 1
            tb = traceback.format_exc(limit=8)
            out.write(json.dumps({"end": scen.name, "error": f"{type(exc).__name__}: {exc}", "traceback": tb}) + "\n")
        finally:
            if eng is not None:
                eng.close()
        out.flush()
    return failures


def main(argv: list[str] | None = None) -> int:
    """Entry point (see the module doc). Exit 0 done, 1 a scenario failed, 2 SGLang does not import."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("scenarios", nargs="?", help="scenario JSON-lines file")
    ap.add_argument("--serve", action="store_true", help="serve the Allocator protocol on stdin / stdout")
    ap.add_argument("-o", "--out", help="output JSON-lines file (default: stdout)")
    ap.add_argument("--tree", choices=("radix", "unified"), default="radix",
                    help="radix: the plain Python RadixCache; unified: UnifiedRadixCache")
    ap.add_argument("--only", action="append", help="run only this scenario (repeatable)")
    ap.add_argument("--fine", action="store_true", help="also dump after every batched call")
    args = ap.parse_args(argv)
    if not args.serve and not args.scenarios:
        ap.error("give a scenario file, or --serve")
    real_stdout = sys.stdout
    sys.stdout = sys.stderr  # SGLang prints (tree dumps); keep them off the data stream
    if args.serve:
        # The replies keep stdout's pipe on a descriptor of their own and fd 1 goes to
        # stderr: what a C library prints (below sys.stdout) never lands in a frame.
        replies_fd = os.dup(1)
        os.dup2(2, 1)
    try:
        _sub("world").load_sglang(args.tree)
    except Exception as exc:
        print(f"driver: sglang does not import in {sys.executable}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if args.serve:
        return _sub("server").serve(_sub("wire").Channel(0, replies_fd))
    out = open(args.out, "w") if args.out else real_stdout
    try:
        failures = run_file(args.scenarios, out, args.tree, set(args.only) if args.only else None, args.fine)
    finally:
        if args.out:
            out.close()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
