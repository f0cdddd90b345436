"""The child process of a ``kvtrace diff`` side: one version replays one trace and
streams its per-step records to the parent.

    python -m kvtrace.proc.child JOB_JSON CONTROL_FD

``JOB_JSON`` is the JSON of a ``kvtrace.proc.contracts.SideJob``'s wire form
(``kvtrace.diff.sides.side_job``): the trace, the version (a spec, or an
``allocator_root`` whose ``allocator`` package is imported first: a ``git:`` checkout
or a working tree), the what-if options and the ``ReplayOptions``, and optionally
``checker_fd``: the pipe of an op-sequence checker the parent runs once for both
sides (``traces.checker_process.start_shared_checker``). Stdout carries
the records: a state log stream (``kvtrace.statelog.log``; pool counters, per-request
deltas, events, state digests), uncompressed, ``steps_per_batch`` steps per record
batch, in chunks over a ``Connection`` (``kvtrace.proc.channel.chunk_writer``).
``CONTROL_FD`` is a ``Connection`` carrying ``Started`` once the session is set up (the
configuration, the version's label and origin), then ``Ended`` (the ``kvtrace replay
--json`` object) or ``Failed`` (a job that does not decode fails so too).

Nothing here imports ``allocator`` (or anything that does) before the checkout's
package is installed under that name; this checkout's ``kvtrace`` and ``traces``
drive it. A later driver of another engine (SGLang's own allocator in its own
environment) writes the same two streams.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FunctionType
from typing import TYPE_CHECKING, Any, BinaryIO

from kvtrace.proc.channel import chunk_writer, connection
from kvtrace.proc.contracts import DashboardJob, Ended, Failed, SideJob, Started, decode

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

__all__ = ["OPTIONAL_PROTOCOLS", "install_allocator", "job_checker", "job_version", "main", "run_job"]

# Optional protocols of ``allocator.base`` that this kvtrace checks with isinstance before
# calling their methods. A package older than one of them lacks the name, or defines it
# with fewer methods than this kvtrace calls (``DecodeRuns`` before ``spec_decode_run``):
# this checkout's definition stands in, so such a commit still replays (without the
# protocol when its allocators lack one of those methods).
OPTIONAL_PROTOCOLS = ("Checkpointable", "Digestible", "DecodeRuns")
# The modules of ``allocator`` whose names the driver (``kvtrace.replay.config``, ``replay``,
# ``session``, ``snapshot``, ``state``, ``scheduler``) imports. What an older package
# lacks of them comes from this checkout (``_shim``): a name added since (``PoolMemory``,
# ``pages``' arithmetic), a property or method added to a record (``PoolCounters.used_tokens``,
# ``AllocatorConfig.check``). Protocols are left alone (a method added to one would
# change what isinstance asks of the version's allocators).
DRIVER_MODULES = ("base", "sizing", "pages")


def install_allocator(root: str | Path) -> None:
    """Make ``root/allocator`` the ``allocator`` package of this process (before any
    import of it), whatever else is on ``sys.path``; add what the driver needs and it
    predates (``OPTIONAL_PROTOCOLS``, ``DRIVER_MODULES``).

    Raises:
        ImportError (or what the package raises): it does not import.
    """
    own = _own_modules()
    package = Path(root) / "allocator"
    init = package / "__init__.py"
    spec = importlib.util.spec_from_file_location("allocator", init, submodule_search_locations=[str(package)])
    if spec is None or spec.loader is None:
        raise ImportError(f"{init}: not an importable allocator package")
    module = importlib.util.module_from_spec(spec)
    sys.modules["allocator"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["allocator"]
        raise
    _shim(module, own)


def _shim_class(theirs: type, mine: type) -> None:
    """Give an older record class what this kvtrace reads of it: properties and methods
    added since, and fields added since with a default (which is then what every one of
    its records holds: the older code knew nothing else)."""
    for key, member in vars(mine).items():
        if isinstance(member, property | FunctionType) and not key.startswith("_") and not hasattr(theirs, key):
            setattr(theirs, key, member)
    defaults: dict[str, Any] = dict(getattr(mine, "_field_defaults", {}))  # a NamedTuple's
    if dataclasses.is_dataclass(mine):
        defaults.update({f.name: f.default for f in dataclasses.fields(mine) if f.default is not dataclasses.MISSING})
    for key, default in defaults.items():
        if not hasattr(theirs, key):
            setattr(theirs, key, default)


def _own_modules() -> dict[str, Any]:
    """This checkout's ``DRIVER_MODULES``, imported and then taken out of ``sys.modules``
    (their functions keep their own globals) so that ``allocator`` can be another."""
    for name in DRIVER_MODULES:
        importlib.import_module(f"allocator.{name}")
    own = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "allocator" or k.startswith("allocator.")}
    return {name: own[f"allocator.{name}"] for name in DRIVER_MODULES}


def _shim(package: Any, own: dict[str, Any]) -> None:
    """Give the installed ``package`` what the driver imports and it lacks (see
    ``DRIVER_MODULES``); never replace what it has, but the optional protocols it
    declares with other methods than this kvtrace calls."""
    for name in DRIVER_MODULES:
        mine = own[name]
        try:
            theirs = importlib.import_module(f"allocator.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"allocator.{name}":
                raise
            sys.modules[f"allocator.{name}"] = mine
            setattr(package, name, mine)
            continue
        for attr, value in vars(mine).items():
            if attr.startswith("_"):
                continue
            found = getattr(theirs, attr, None)
            if found is None:
                setattr(theirs, attr, value)
            elif isinstance(value, type) and isinstance(found, type) and not getattr(found, "_is_protocol", False):
                _shim_class(found, value)
    base, mine = sys.modules["allocator.base"], own["base"]
    for name in OPTIONAL_PROTOCOLS:
        theirs = getattr(base, name, None)
        if theirs is None or _methods(theirs) != _methods(getattr(mine, name)):
            setattr(base, name, getattr(mine, name))


def _check_code(job: SideJob) -> None:
    """Raise unless the ``allocator`` package installed is the one the job names
    (``job.code``: its ``code_identity``).

    Raises:
        VersionSpecError: another package, or the same directory with other content.
    """
    from kvtrace.errors import VersionSpecError
    from kvtrace.versions.registry import code_identity

    expected = job.code
    found = code_identity(Path(sys.modules["allocator"].__file__ or "").parent)
    if expected and found != expected:
        raise VersionSpecError(f"allocator '{job.spec}': this process imported {found}, but the side is labelled {expected}")


def _methods(protocol: type) -> set[str]:
    """The public names a protocol class declares (what isinstance checks)."""
    return {n for n in vars(protocol) if not n.startswith("_")}


def run_job(job: SideJob, out: Connection, control: Connection) -> None:
    """Replay ``job`` and stream its records to ``out`` (a state log stream, in chunks),
    messages to ``control``.

    Raises:
        KvtraceError, TraceError: bad input (reported by ``main`` as one line).
    """
    from kvtrace.replay.engine import ReplayOptions

    version = job_version(job)
    options = ReplayOptions(**job.options)
    checker = job_checker(job, options)
    try:
        with chunk_writer(out) as stream:
            _replay(job, version, options, checker, stream, control)
    finally:
        if not isinstance(checker, str):
            checker.close()


def job_version(job: SideJob) -> Any:
    """The ``AllocatorVersion`` a job names (its checkout's ``allocator`` when it has a root).

    Raises:
        VersionSpecError: the spec does not resolve.
    """
    from kvtrace.errors import VersionSpecError
    from kvtrace.versions.registry import AllocatorVersion, resolve_version

    if job.allocator_root:
        try:
            from allocator import create_allocator
        except ImportError as exc:
            if exc.name == "allocator" or "create_allocator" in str(exc):
                raise VersionSpecError(
                    f"allocator '{job.spec}': its allocator package has no create_allocator (a revision from before "
                    "the allocator had one: there is no allocator to replay)"
                ) from None
            # The revision's own package is broken (a commit caught halfway through a move).
            raise VersionSpecError(
                f"allocator '{job.spec}': its allocator package does not import: {type(exc).__name__}: {exc}"
            ) from None

        return AllocatorVersion(job.spec, job.label, create_allocator, origin=job.origin)
    version = resolve_version(job.spec)
    if job.origin and version.origin != job.origin:
        raise VersionSpecError(
            f"allocator '{job.spec}': this process runs {version.origin}, but the side is labelled {job.origin}"
        )
    return version


def job_checker(job: SideJob, options: Any) -> Any:
    """What checks the job's steps: a mode (``background``, ``inline``), or the checker
    the parent shares between the sides (``checker_fd``)."""
    if job.checker_fd is None:
        return job.checker
    from traces.checker_process import BackgroundChecker

    return BackgroundChecker(job.trace, options.stop_step, conn=connection(job.checker_fd, writable=False))


def _replay(job: SideJob, version: Any, options: Any, checker: Any, out: BinaryIO, control: Connection) -> None:
    from kvtrace.replay.config import config_dict
    from kvtrace.replay.session import ReplaySession
    from kvtrace.statelog.log import StateLogWriter

    with ReplaySession(
        job.trace, version=version, page_size=job.page_size, pool_tokens=job.pool_tokens,
        device=job.device, options=options, checker=checker, label=job.trace_label,
        eviction_policy=job.eviction_policy, hicache_ratio=job.hicache_ratio,
        hicache_write_policy=job.hicache_write_policy,
    ) as session:
        config = config_dict(session.config)
        control.send(Started(config, version.label, version.origin).to_wire())
        info = {"trace": job.trace_label or job.trace, "allocator": version.spec, "config": config}
        with StateLogWriter(out, info, steps_per_batch=job.steps_per_batch, compression=None,
                            sessions=session.reader.meta.config.sessions) as log:
            for snap in session.snapshots():
                log.write(snap)
        control.send(Ended(session.result().to_dict()).to_wire())


def main(argv: list[str] | None = None, run: Callable[[Any, Connection, Connection], None] = run_job) -> int:
    """Entry point (see the module doc). Exit 0 done, 2 an error (reported on the control fd).

    ``run``: what replays the job (``run_job``; the dashboard's replay process passes its
    own, ``kvtrace.tui.remote.process``, so that this module never imports the dashboard).
    """
    from traces.lifeline import settle_from_env

    settle_from_env()  # Ctrl-C is the parent's to report; this process dies with it
    args = sys.argv[1:] if argv is None else argv
    control = connection(int(args[1]), readable=False)
    sys.stdout.flush()
    out = connection(os.dup(1), readable=False)
    # Stdout is the record stream: nothing else may write there. Python's prints go to
    # stderr, and so do a library's own writes to descriptor 1.
    sys.stdout = sys.stderr
    os.dup2(2, 1)
    try:
        job = decode(json.loads(args[0]), (SideJob, DashboardJob))
        side = job.side if isinstance(job, DashboardJob) else job
        if side is not None and side.allocator_root:
            install_allocator(side.allocator_root)
            _check_code(side)
        run(job, out, control)
    except BrokenPipeError:
        return 0  # the parent stopped reading (it found what it wanted, or was interrupted)
    except BaseException as exc:  # reported to the parent, which decides what to print
        from kvtrace.errors import USER_ERRORS

        user = isinstance(exc, USER_ERRORS)
        text = str(exc) if user else f"{type(exc).__name__}: {exc}"
        try:
            control.send(Failed(text, user, traceback.format_exc()).to_wire())
        except (BrokenPipeError, OSError):
            pass
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
