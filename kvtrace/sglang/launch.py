"""Run an SGLang server with its allocator calls recorded into a kvtrace trace.

    python -m kvtrace.sglang.launch --kvtrace-out run.kvtrace --model-path ... [any sglang.launch_server option]

``--kvtrace-out PATH`` (``{pid}`` in it becomes the process id: one trace per
scheduler process, e.g. with data-parallel attention) sets
``$KVTRACE_SGLANG_RECORD`` and enables ``kvtrace.sglang.hooks`` before SGLang is
imported, then runs SGLang's own ``sglang.launch_server`` with the other arguments
unchanged. SGLang's scheduler runs in processes of its own: they inherit the
variable, and the hooks enable themselves there through SGLang's
``run_scheduler_process`` (wrapped when its module is imported). kvtrace must be
importable in SGLang's environment: ``pip install -e /path/to/kvtrace`` there, or
run this file with the checkout on ``PYTHONPATH`` (and ``pyarrow`` installed).
"""

from __future__ import annotations

import os
import runpy
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Parse ``--kvtrace-out``, enable recording, run ``sglang.launch_server``.

    Returns:
        2 when ``--kvtrace-out`` is missing or its directory does not exist.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    out = None
    for i, arg in enumerate(args):
        if arg == "--kvtrace-out" and i + 1 < len(args):
            out = args[i + 1]
            del args[i : i + 2]
            break
        if arg.startswith("--kvtrace-out="):
            out = arg.split("=", 1)[1]
            del args[i]
            break
    if not out:
        print("kvtrace: error: give --kvtrace-out PATH (the trace to write), then sglang.launch_server's options",
              file=sys.stderr)
        return 2
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        print(f"kvtrace: error: --kvtrace-out {out}: the folder {folder} does not exist", file=sys.stderr)
        return 2
    os.environ["KVTRACE_SGLANG_RECORD"] = os.path.abspath(out)
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # The scheduler processes import kvtrace.sglang.hooks by name: make sure they find it.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    from kvtrace.sglang import hooks

    hooks.enable()
    sys.argv = ["sglang.launch_server", *args]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
