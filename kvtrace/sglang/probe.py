"""Which sglang an interpreter has, without importing sglang (nor numpy: ``kvtrace
versions`` lists the SGLang versions through this module only)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["ENV_VAR", "probe"]

ENV_VAR = "KVTRACE_SGLANG_PYTHON"
_PROBE = "import importlib.metadata as m, sys; sys.stdout.write(m.version('sglang'))"


def probe(python: str | None = None) -> tuple[str | None, str | None]:
    """The sglang version an interpreter has, without importing sglang.

    Args:
        python: an interpreter path (None: this one).

    Returns:
        ``(version, None)``, or ``(None, why not)`` in one line.
    """
    if python is None:
        try:
            return importlib.metadata.version("sglang"), None
        except importlib.metadata.PackageNotFoundError:
            return None, f"sglang is not installed in this interpreter ({sys.executable})"
    path = Path(python).expanduser()
    if not (path.is_file() and os.access(path, os.X_OK)):
        return None, f"{python} is not an executable file"
    try:
        done = subprocess.run([str(path), "-c", _PROBE], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"{python} does not run ({exc})"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return None, f"sglang is not installed for {python} ({last})"
    return done.stdout.strip(), None
