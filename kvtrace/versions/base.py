"""What a version is, below every way of naming one: the in-process ``AllocatorVersion``,
the child-process ``ChildVersion``, and the identity of the code a version runs.

``registry`` turns specs into these; ``git`` and ``sglang`` build them too, so they live
here, beneath all three (``registry`` imports ``git`` and ``sglang``).
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvtrace.errors import VersionSpecError

if TYPE_CHECKING:
    from allocator.base import Allocator, AllocatorConfig

__all__ = ["AllocatorFactory", "AllocatorVersion", "ChildVersion", "code_digest", "code_identity"]

AllocatorFactory = Callable[["AllocatorConfig"], "Allocator"]
_PROTOCOL_METHODS = ("extend", "decode", "spec_decode", "prealloc", "release", "counters")


@dataclass(frozen=True, slots=True)
class AllocatorVersion:
    """A version that runs in this process: its spec, a label for reports, its factory.

    ``page_size``: the page size the version itself fixes (``token``: 1, ``paged:N``:
    N), None when it takes the trace's. ``kvtrace.replay.config.effective_config`` decides
    the configuration from it and the user's options; the factory receives that
    configuration unchanged. ``origin``: where it comes from (``kvtrace versions``).
    """

    spec: str
    label: str
    factory: AllocatorFactory
    page_size: int | None = None
    origin: str = ""

    def create(self, config: AllocatorConfig) -> Allocator:
        """Build the allocator, checking it honours the protocol.

        Raises:
            VersionSpecError: the factory fails or returns something that is not an Allocator.
        """
        from allocator.base import Allocator

        try:
            alloc = self.factory(config)
        except Exception as exc:  # a user's factory may fail in any way
            raise VersionSpecError(f"allocator '{self.spec}': its factory failed: {type(exc).__name__}: {exc}") from None
        if not isinstance(alloc, Allocator):
            missing = [m for m in _PROTOCOL_METHODS if not hasattr(alloc, m)]
            raise VersionSpecError(
                f"allocator '{self.spec}': the factory returned {type(alloc).__name__}, "
                f"which lacks the Allocator methods {', '.join(missing) or '(some)'}"
            )
        return alloc


@dataclass(frozen=True, slots=True)
class ChildVersion:
    """A version that runs in a child process (``kvtrace.proc.child``): the ``allocator``
    package under ``allocator_root`` comes first there, this kvtrace drives it.

    ``python``: the interpreter of the child (this one unless another environment is
    needed); ``commit``: the revision checked out (None for a working tree).
    """

    spec: str
    label: str
    allocator_root: Path
    origin: str
    commit: str | None = None
    python: str = sys.executable
    page_size: int | None = None


def code_digest(path: str | Path) -> str:
    """The SHA-256 of a file's bytes, or of a package directory: every file under it
    (``__pycache__`` aside) by relative path and content, in path order.

    Raises:
        OSError: ``path`` cannot be read.
    """
    root = Path(path)
    h = hashlib.sha256()
    if root.is_file():
        h.update(root.read_bytes())
        return h.hexdigest()
    for f in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.relative_to(root).parts):
        h.update(f.relative_to(root).as_posix().encode() + b"\0")
        h.update(f.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def code_identity(path: str | Path) -> str:
    """Which code runs: ``PATH sha256:HASH`` (12 hex digits of ``code_digest``)."""
    resolved = Path(path).resolve()
    return f"{resolved} sha256:{code_digest(resolved)[:12]}"
