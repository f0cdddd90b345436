"""Allocator versions: a spec string -> a factory ``(AllocatorConfig) -> Allocator``.

Specs:
    ``builtin``               this checkout's ``allocator.create_allocator`` (page size from the trace)
    ``token``                 the built-in allocator forced to page size 1
    ``paged`` / ``paged:N``   the built-in allocator, paged (page size from the trace, or N)
    ``pkg.module:factory``    a factory importable from ``sys.path``
    ``path/to/file.py:factory``  a factory defined in a Python file
(``git:REV`` versions run in their own process and are resolved by ``kvtrace diff``.)
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from allocator.base import Allocator, AllocatorConfig
from kvtrace.errors import VersionSpecError

AllocatorFactory = Callable[[AllocatorConfig], Allocator]
BUILTIN_NAMES = ("builtin", "token", "paged", "paged:N")


@dataclass(frozen=True, slots=True)
class AllocatorVersion:
    """A resolved version: its spec, a label for reports, its factory."""

    spec: str
    label: str
    factory: AllocatorFactory

    def create(self, config: AllocatorConfig) -> Allocator:
        """Build the allocator, checking it honours the protocol.

        Raises:
            VersionSpecError: the factory fails or returns something that is not an Allocator.
        """
        try:
            alloc = self.factory(config)
        except Exception as exc:  # a user's factory may fail in any way
            raise VersionSpecError(f"allocator '{self.spec}': its factory failed: {type(exc).__name__}: {exc}") from None
        if not isinstance(alloc, Allocator):
            missing = [m for m in ("extend", "decode", "spec_decode", "prealloc", "release", "counters") if not hasattr(alloc, m)]
            raise VersionSpecError(
                f"allocator '{self.spec}': the factory returned {type(alloc).__name__}, "
                f"which lacks the Allocator methods {', '.join(missing) or '(some)'}"
            )
        return alloc


def _builtin(page_size: int | None = None) -> AllocatorFactory:
    def factory(config: AllocatorConfig) -> Allocator:
        from allocator import create_allocator
        from allocator.pages import floor_align

        if page_size is not None and page_size != config.page_size:
            config = dataclasses.replace(config, page_size=page_size, pool_tokens=floor_align(config.pool_tokens, page_size))
        return create_allocator(config)

    return factory


def resolve_version(spec: str) -> AllocatorVersion:
    """Turn a version spec into an ``AllocatorVersion``.

    Raises:
        VersionSpecError: unknown name, bad syntax, module or file missing, factory not callable.
    """
    spec = spec.strip()
    if spec in ("", "builtin"):
        return AllocatorVersion("builtin", "builtin", _builtin())
    if spec == "token":
        return AllocatorVersion(spec, "token (page 1)", _builtin(1))
    if spec == "paged":
        return AllocatorVersion(spec, "paged", _builtin())
    if spec.startswith("paged:"):
        size = spec.split(":", 1)[1]
        if not size.isdigit() or int(size) < 1:
            raise VersionSpecError(f"allocator '{spec}': the page size after 'paged:' must be a positive integer")
        return AllocatorVersion(spec, f"paged (page {int(size)})", _builtin(int(size)))
    if spec.startswith("git:"):
        raise VersionSpecError(f"allocator '{spec}': git revisions are compared with 'kvtrace diff', not replayed in-process")
    if ":" not in spec:
        raise VersionSpecError(
            f"unknown allocator '{spec}'; use one of {', '.join(BUILTIN_NAMES)}, "
            "'package.module:factory' or 'path/to/file.py:factory'"
        )
    target, attr = spec.rsplit(":", 1)
    if not attr.isidentifier():
        raise VersionSpecError(f"allocator '{spec}': '{attr}' is not a valid factory name")
    if target.endswith(".py"):
        module = _load_file(spec, Path(target))
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise VersionSpecError(f"allocator '{spec}': cannot import module '{target}' ({exc})") from None
        except Exception as exc:
            raise VersionSpecError(f"allocator '{spec}': importing '{target}' failed: {type(exc).__name__}: {exc}") from None
    factory = getattr(module, attr, None)
    if factory is None:
        raise VersionSpecError(f"allocator '{spec}': '{target}' has no attribute '{attr}'")
    if not callable(factory):
        raise VersionSpecError(f"allocator '{spec}': '{attr}' in '{target}' is not callable")
    return AllocatorVersion(spec, spec, factory)


def _load_file(spec: str, path: Path) -> object:
    if not path.is_file():
        raise VersionSpecError(f"allocator '{spec}': no such file {path}")
    name = f"kvtrace_version_{abs(hash(path.resolve()))}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise VersionSpecError(f"allocator '{spec}': cannot load {path} as Python")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise VersionSpecError(f"allocator '{spec}': running {path} failed: {type(exc).__name__}: {exc}") from None
    return module
