"""Allocator versions: a spec string -> how the version is built and where it runs.

A version is anything that yields an ``Allocator`` for a configuration, through a
factory ``(AllocatorConfig) -> Allocator`` (``allocator.base``; the optional
``Checkpointable`` and ``Digestible`` protocols add seeking and ``diff --exact``).

Specs (``kvtrace versions`` lists what is available and where each comes from):
    ``builtin``                  this kvtrace's ``allocator.create_allocator`` (the trace's page size)
    ``token``                    the built-in allocator at page size 1
    ``paged`` / ``paged:N``      the built-in allocator, paged (the trace's page size, or N)
    ``pre-encapsulation``        the built-in allocator with SGLang's speculative bookkeeping from
                                 before PR #29432 (``allocator.pre_encapsulation``)
    ``NAME``                     a factory an installed package registers in the entry-point
                                 group ``kvtrace.allocators``
    ``pkg.module:factory``       a factory importable from ``sys.path``
    ``path/to/file.py:factory``  a factory defined in a Python file
    ``sglang`` / ``sglang:PYTHON``  SGLang's own allocator (the sglang of this interpreter, or of
                                 another environment's PYTHON), driven in a process of its own
                                 (``kvtrace.sglang``)
    ``git:REV[@PATH]``           the ``allocator`` package of revision REV of the repository at
                                 PATH (default: the one holding the current directory), checked
                                 out into a cached git worktree (``kvtrace.versions.git``)
    ``worktree[@PATH]``          the ``allocator`` package of that repository's working tree,
                                 uncommitted changes included

The first five run in this process (``AllocatorVersion``). ``git:`` and
``worktree`` versions import their own ``allocator`` package, so they run in a
child process (``ChildVersion``, driven by ``kvtrace.proc.child``).

Every spec but the built-in names executes code the user points at: a module, a
file, a commit, a working tree. Each version's ``origin`` names the files that run,
with a hash of their content (``code_identity``); the child process of a side
checks that what it imported is what its origin names. Nothing a trace holds is
ever taken for a spec.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtrace.errors import VersionSpecError
from kvtrace.versions.base import AllocatorVersion, ChildVersion, code_digest, code_identity  # noqa: F401 (this module's names)

if TYPE_CHECKING:
    from allocator.base import Allocator, AllocatorConfig

ENTRY_POINT_GROUP = "kvtrace.allocators"
BUILTIN_NAMES = ("builtin", "token", "paged", "paged:N", "pre-encapsulation")
VALID_FORMS = (
    "builtin, token, paged, paged:N, pre-encapsulation, sglang, sglang:PYTHON, an installed name ('kvtrace versions'), "
    "package.module:factory, path/to/file.py:factory, git:REV[@PATH], worktree[@PATH]"
)


@dataclass(frozen=True, slots=True)
class VersionInfo:
    """One line of ``kvtrace versions``."""

    name: str
    kind: str  # builtin | installed | git | sglang | factory
    origin: str
    description: str


def _builtin(config: AllocatorConfig) -> Allocator:
    _own_allocator()
    from allocator import create_allocator

    return create_allocator(config)


def _pre_encapsulation(config: AllocatorConfig) -> Allocator:
    _own_allocator()
    from allocator.pre_encapsulation import create_allocator

    return create_allocator(config)


def _here() -> str:
    return str(Path(__file__).resolve().parents[2] / "allocator")


def _own_allocator() -> None:
    """Raise unless ``allocator`` in this process is this kvtrace's own (``_here()``).

    Raises:
        VersionSpecError: another ``allocator`` package was imported (one that was
            first on ``sys.path`` before kvtrace was imported).
    """
    import allocator

    found = Path(allocator.__file__ or "").resolve().parent
    if found != Path(_here()):
        raise VersionSpecError(
            f"the built-in allocator is {_here()}, but this process imported 'allocator' from {found}; "
            "import kvtrace before anything that imports allocator, or run the version in its own process"
        )


def resolve_version(spec: str) -> AllocatorVersion:
    """Turn the spec of a version that runs in this process into an ``AllocatorVersion``.

    Raises:
        VersionSpecError: unknown name, bad syntax, module or file missing, factory not
            callable, or a ``git:`` / ``worktree`` spec (those run in their own process:
            ``resolve_any``).
    """
    found = resolve_any(spec)
    if isinstance(found, ChildVersion):
        raise VersionSpecError(
            f"allocator '{spec}': git revisions and working trees run in their own process; "
            "compare them with 'kvtrace diff TRACE --a ... --b ...'"
        )
    return found


def resolve_any(spec: str, *, cache_dir: Path | None = None) -> AllocatorVersion | ChildVersion:
    """Resolve any version spec (see the module doc). ``git:`` specs check the revision
    out (or reuse the cached checkout) under ``cache_dir`` (default
    ``kvtrace.versions.git.cache_dir()``).

    Raises:
        VersionSpecError: the spec does not resolve (one line: what and the valid forms).
    """
    spec = spec.strip()
    builtin = _resolve_builtin(spec)
    if builtin is not None:
        return builtin
    if spec.startswith("git:") or spec == "worktree" or spec.startswith("worktree@"):
        from kvtrace.versions import git as gitversions

        return gitversions.resolve(spec, cache=cache_dir)
    if spec == "sglang" or spec.startswith("sglang:"):
        from kvtrace.versions.sglang import resolve_sglang

        return resolve_sglang(spec)
    if ":" not in spec:
        ep = _entry_points().get(spec)
        if ep is not None:
            return _from_entry_point(spec, ep)
        raise VersionSpecError(f"unknown allocator '{spec}'; valid forms: {VALID_FORMS}")
    return _resolve_factory(spec)


def _builtin_origin() -> str:
    return f"built in ({code_identity(_here())})"


def _resolve_builtin(spec: str) -> AllocatorVersion | None:
    if spec not in ("", "builtin", "token", "paged", "pre-encapsulation") and not spec.startswith("paged:"):
        return None
    here = _builtin_origin()
    if spec in ("", "builtin"):
        return AllocatorVersion("builtin", "builtin", _builtin, origin=here)
    if spec == "token":
        return AllocatorVersion(spec, "token (page 1)", _builtin, page_size=1, origin=here)
    if spec == "paged":
        return AllocatorVersion(spec, "paged", _builtin, origin=here)
    if spec.startswith("paged:"):
        size = spec.split(":", 1)[1]
        if not size.isdigit() or int(size) < 1:
            raise VersionSpecError(f"allocator '{spec}': the page size after 'paged:' must be a positive integer")
        return AllocatorVersion(spec, f"paged (page {int(size)})", _builtin, page_size=int(size), origin=here)
    if spec == "pre-encapsulation":
        return AllocatorVersion(spec, spec, _pre_encapsulation, origin=here)
    return None


def _resolve_factory(spec: str) -> AllocatorVersion:
    target, attr = spec.rsplit(":", 1)
    if not attr.isidentifier():
        raise VersionSpecError(f"allocator '{spec}': '{attr}' is not a valid factory name; valid forms: {VALID_FORMS}")
    if target.endswith(".py"):
        module = _load_file(spec, Path(target))
        origin = f"file {code_identity(target)}"
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise VersionSpecError(f"allocator '{spec}': cannot import module '{target}' ({exc})") from None
        except Exception as exc:
            raise VersionSpecError(f"allocator '{spec}': importing '{target}' failed: {type(exc).__name__}: {exc}") from None
        file = getattr(module, "__file__", None)
        origin = f"module {code_identity(file) if file else target}"
    factory = getattr(module, attr, None)
    if factory is None:
        raise VersionSpecError(f"allocator '{spec}': '{target}' has no attribute '{attr}'")
    if not callable(factory):
        raise VersionSpecError(f"allocator '{spec}': '{attr}' in '{target}' is not callable")
    return AllocatorVersion(spec, spec, factory, origin=origin)


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


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _entry_point_origin(ep: importlib.metadata.EntryPoint) -> str:
    dist = ep.dist
    who = f"{dist.name} {dist.version}" if dist is not None else "an installed package"
    return f"entry point of {who}: {ep.value}"


def _from_entry_point(spec: str, ep: importlib.metadata.EntryPoint) -> AllocatorVersion:
    try:
        factory: Any = ep.load()
    except Exception as exc:
        raise VersionSpecError(
            f"allocator '{spec}': loading its entry point {ep.value} failed: {type(exc).__name__}: {exc}"
        ) from None
    if not callable(factory):
        raise VersionSpecError(f"allocator '{spec}': entry point {ep.value} is not callable")
    return AllocatorVersion(spec, spec, factory, origin=_entry_point_origin(ep))


def _sglang_versions() -> list[VersionInfo]:
    """``sglang`` (this interpreter) and ``sglang:PYTHON`` (``$KVTRACE_SGLANG_PYTHON``
    probed when set), each with the sglang found or why not."""
    import os

    from kvtrace.sglang import KNOWN_SGLANG_VERSIONS
    from kvtrace.sglang.probe import ENV_VAR, probe

    def origin(python: str | None) -> str:
        version, why = probe(python)
        where = python or sys.executable
        if version is None:
            return f"unavailable: {why}"
        known = "" if version in KNOWN_SGLANG_VERSIONS else f", not a version the driver knows ({', '.join(KNOWN_SGLANG_VERSIONS)})"
        return f"sglang {version} at {where}{known}"

    env = os.environ.get(ENV_VAR)
    return [
        VersionInfo("sglang", "sglang", origin(None), "SGLang's own allocator classes, the sglang of this interpreter"),
        VersionInfo(
            "sglang:PYTHON", "sglang", origin(env) if env else f"(${ENV_VAR} not set)",
            "SGLang's own allocator classes in another environment (PYTHON: its interpreter)",
        ),
    ]


def list_versions() -> list[VersionInfo]:
    """What ``kvtrace versions`` lists: the built-ins, the installed entry points, and
    the forms that take an argument (with the repository ``worktree`` would use)."""
    here = _builtin_origin()
    out = [
        VersionInfo("builtin", "builtin", here, "SGLang 0.5.23 semantics at the trace's page size"),
        VersionInfo("token", "builtin", here, "the built-in allocator at page size 1"),
        VersionInfo("paged[:N]", "builtin", here, "the built-in allocator, paged (the trace's page size, or N)"),
        VersionInfo(
            "pre-encapsulation", "builtin", here,
            "speculative bookkeeping kept by the caller and forgotten on the paged path (SGLang before #29432)",
        ),
    ]
    for name, ep in sorted(_entry_points().items()):
        out.append(VersionInfo(name, "installed", _entry_point_origin(ep), f"group {ENTRY_POINT_GROUP}"))
    from kvtrace.versions import git as gitversions

    repo = gitversions.current_repository()
    where = f"the repository at {repo}" if repo is not None else "the repository at PATH (here: not in a git repository)"
    out.append(VersionInfo("worktree[@PATH]", "git", where, "its working tree, uncommitted changes included"))
    cached = gitversions.cached_checkouts()
    note = f" ({len(cached)} cached in {gitversions.cache_dir()})" if cached else ""
    out.append(VersionInfo("git:REV[@PATH]", "git", where, f"revision REV, checked out into a cached git worktree{note}"))
    out.extend(_sglang_versions())
    out.append(VersionInfo("package.module:factory", "factory", "sys.path", "a factory (AllocatorConfig) -> Allocator"))
    out.append(VersionInfo("path/to/file.py:factory", "factory", "a Python file", "a factory defined in a file"))
    return out
