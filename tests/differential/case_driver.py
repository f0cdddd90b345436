"""What every case driver shares: SGLang's process set up for a driver run by path, and
the test side that runs a driver over a list of cases.

A case driver (``swa_pool_driver.py``, ``mamba_pool_driver.py``, ``mamba_radix_driver.py``,
``hiradix_driver.py``) is one op interpreter over two adapters, ours and SGLang's. The test
process imports it (ours run in process); SGLang's interpreter runs it by path, where its
``main`` calls :func:`sglang_main` (this file is then found beside it, on ``sys.path[0]``).
At module level this imports only the standard library, for the same reason.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any


def install_sglang_import_stubs() -> None:
    """``kvtrace/sglang/world.py``'s import stubs (SGLang's allocator path imports modules
    that need torchvision), world loaded as the SGLang driver loads it: by path, with no
    kvtrace installed in SGLang's environment."""
    import importlib
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "kvtrace" / "sglang" / "driver.py"
    spec = importlib.util.spec_from_file_location("kvtrace_case_driver_loader", path)
    assert spec is not None and spec.loader is not None
    driver = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(driver)
    importlib.import_module(f"{driver.package().__name__}.world").install_import_stubs()


def sglang_main(argv: list[str], run: Callable[[Any], Any], *, python_tree_core: bool = False) -> int:
    """A driver's entry point in SGLang's interpreter: ``CASES.json OUT.json``; the cases
    file's JSON goes through ``run`` and its result is written as JSON.

    Args:
        argv: the two paths.
        run: what the driver does with the cases (usually each through SGLang's adapter).
        python_tree_core: run the unified radix tree's Python core (the drivers of the
            unified tree read its nodes, which the native core does not expose).
    """
    import logging
    import os
    import warnings

    os.environ.pop("SGLANG_USE_CPU_ENGINE", None)
    if python_tree_core:
        os.environ["SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"] = "python"
    install_sglang_import_stubs()
    warnings.filterwarnings("ignore")
    logging.disable(logging.CRITICAL)
    import torch

    torch.set_num_threads(1)
    cases_file, out_file = argv
    with open(cases_file) as f:
        cases = json.load(f)
    out = run(cases)
    with open(out_file, "w") as f:
        json.dump(out, f)
    return 0


def run_in_sglang(python: str, driver: Path, cases: list[Any], tmp: Path, *flags: str, timeout: int = 900) -> Any:
    """Runs ``driver`` by path with SGLang's interpreter over ``cases``; its JSON output.

    Args:
        python: SGLang's interpreter (``harness.require_sglang()``).
        driver: the driver's path.
        cases: what its ``main`` reads.
        tmp: a folder for the two files.
        flags: the driver's own options, before the two paths.
        timeout: seconds.
    """
    cases_file, out_file = tmp / "cases.json", tmp / "sglang.json"
    cases_file.write_text(json.dumps(cases))
    done = subprocess.run([python, str(driver), *flags, str(cases_file), str(out_file)], capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out_file.read_text())
