"""This kvtrace's own ``allocator`` and ``traces`` packages, whatever ``sys.path`` says.

``kvtrace``, ``allocator`` and ``traces`` are installed side by side. A process started
with ``python -m`` or ``-c`` has its working directory first on ``sys.path``, and an
engine developer's checkout has an ``allocator/`` of its own; ``PYTHONPATH`` may name
another. Without this finder ``import allocator`` would then load that foreign package
while diff and replay label the version as this kvtrace's built-in one.
``SiblingFinder`` resolves the two top-level names to the directories beside this
``kvtrace`` before any other finder is asked; a version that must bring its own
``allocator`` (a git revision, a working tree) installs it in ``sys.modules``
explicitly (``kvtrace.proc.child.install_allocator``), which no finder overrides.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PINNED = ("allocator", "traces")


class SiblingFinder(importlib.abc.MetaPathFinder):
    """Finds ``allocator`` and ``traces`` beside this ``kvtrace`` (their submodules then
    follow the package's ``__path__``)."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in PINNED:
            return None
        package = ROOT / fullname
        init = package / "__init__.py"
        if not init.is_file():
            return None  # not installed side by side: the ordinary finders decide
        return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[str(package)])


def pin_siblings() -> None:
    """Put ``SiblingFinder`` first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, SiblingFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, SiblingFinder())
