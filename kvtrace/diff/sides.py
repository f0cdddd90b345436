"""The sides of a diff: something that produces the per-step record stream of a trace.

A side yields ``Chunk``s of consecutive steps and, once its stream ends, a summary:

* ``SessionSide``: a ``ReplaySession`` in this process (its chunks hold snapshots);
* ``ChildSide``: a version replaying in a child process (``kvtrace.proc.child``, its job
  a ``SideJob``), its records arriving as state-log record batches over a pipe, read by
  a thread so the child never waits on the parent, its ``Started`` / ``Ended`` /
  ``Failed`` over a ``Connection`` (``kvtrace.proc.contracts``);
* ``LogSide``: a state log saved by ``kvtrace replay --out``.

Two chunks of record batches that hold the same records compare in one call per
column (``Chunk.same_as``), without decoding a snapshot: that is what keeps a diff
of two identical versions near the cost of one replay.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from kvtrace.errors import KvtraceError
from kvtrace.proc.channel import chunk_reader, connection, receive_all
from kvtrace.proc.contracts import Contract, Ended, Failed, SideJob, Started, decode

if TYPE_CHECKING:
    import pyarrow as pa

    from kvtrace.versions.registry import AllocatorVersion, ChildVersion
    from kvtrace.replay.session import ReplaySession
    from kvtrace.replay.snapshot import StepSnapshot

__all__ = [
    "Chunk", "ChildSide", "LogSide", "SessionSide", "SideError", "child_command", "child_environ", "side_job", "spawn_child",
]

SESSION_CHUNK_STEPS = 64
CHILD_BATCH_STEPS = 256
_QUEUED_BATCHES = 8
_REPO_ROOT = str(Path(__file__).resolve().parents[2])


class SideError(KvtraceError):
    """A side could not replay (its version failed to load, or its process died)."""


class Chunk:
    """Consecutive steps of one side: a state-log record batch, or snapshots."""

    __slots__ = ("batch", "_snaps")

    def __init__(self, batch: pa.RecordBatch | None = None, snaps: list[StepSnapshot] | None = None) -> None:
        self.batch = batch
        self._snaps = snaps

    def __len__(self) -> int:
        return self.batch.num_rows if self.batch is not None else len(self._snaps or ())

    @property
    def snapshots(self) -> list[StepSnapshot]:
        """The chunk's snapshots (decoded from the batch on first use)."""
        if self._snaps is None:
            from kvtrace.statelog.log import snapshots_of

            assert self.batch is not None
            self._snaps = snapshots_of(self.batch)
        return self._snaps

    def same_as(self, other: Chunk) -> bool:
        """True when both are record batches with equal records (timings aside, and the
        requests' Mamba slots, which the step-by-step comparison does not compare either: a
        version that does not report them must not make every chunk compare step by step);
        False means "compare step by step", not "different"."""
        if self.batch is None or other.batch is None or self.batch.num_rows != other.batch.num_rows:
            return False
        from kvtrace.statelog.log import MAMBA_SLOT_COLUMN, TIMING_COLUMNS

        a, b = self.batch, other.batch
        if a.schema.names != b.schema.names:
            return False
        skipped = (*TIMING_COLUMNS, MAMBA_SLOT_COLUMN)
        return all(a.column(i).equals(b.column(i)) for i, name in enumerate(a.schema.names) if name not in skipped)


class SessionSide:
    """A replay session in this process, stepped chunk by chunk."""

    def __init__(self, session: ReplaySession, chunk_steps: int = SESSION_CHUNK_STEPS) -> None:
        self.session = session
        self.label = session.version.label
        self.spec = session.version.spec
        self.origin = session.version.origin
        self._chunk_steps = chunk_steps

    def chunks(self) -> Iterator[Chunk]:
        buf: list[StepSnapshot] = []
        for snap in self.session.snapshots():
            buf.append(snap)
            if len(buf) >= self._chunk_steps:
                yield Chunk(snaps=buf)
                buf = []
        if buf:
            yield Chunk(snaps=buf)

    def summary(self) -> dict[str, Any]:
        return self.session.result().to_dict()

    def close(self) -> None:
        self.session.close()


def side_job(
    version: AllocatorVersion | ChildVersion,
    trace: str,
    *,
    trace_label: str,
    page_size: int | None,
    pool_tokens: int | None,
    device: str,
    options: dict[str, Any],
    checker: str = "background",
    eviction_policy: str | None = None,
    hicache_ratio: float | None = None,
    hicache_write_policy: str | None = None,
) -> SideJob:
    """The job a ``ChildSide`` hands ``kvtrace.proc.child``."""
    root = getattr(version, "allocator_root", None)
    code = None
    if root is not None:
        from kvtrace.versions.registry import code_identity

        code = code_identity(Path(root) / "allocator")  # what the child must import (it checks)
    return SideJob(
        trace=trace, trace_label=trace_label, spec=version.spec, label=version.label, origin=version.origin,
        page_size=page_size, pool_tokens=pool_tokens, device=device, options=dict(options), checker=checker,
        eviction_policy=eviction_policy, hicache_ratio=hicache_ratio, hicache_write_policy=hicache_write_policy,
        steps_per_batch=CHILD_BATCH_STEPS, allocator_root=None if root is None else str(root), code=code,
    )


def stop_child(proc: subprocess.Popen[bytes], timeout: float = 10) -> None:
    """End a child of ``spawn_child`` that still runs: SIGTERM, then SIGKILL after ``timeout``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def child_environ(defaults: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child, with ``defaults`` for the variables it does
    not set itself (a variable the user set wins)."""
    return {**(defaults or {}), **os.environ}


# The child's first statement: ``python -m`` and ``-c`` put the working directory first
# on ``sys.path`` (an engine checkout's own ``allocator/`` or ``kvtrace/`` would win);
# this checkout's root takes its place, so the child runs this ``kvtrace``, and
# ``kvtrace`` then pins its sibling ``allocator`` and ``traces`` (``kvtrace._siblings``).
_BOOTSTRAP = (
    "import os, sys; here = os.getcwd(); "
    "sys.path[:] = [{root!r}] + [p for p in sys.path if p not in ('', '.', here)]; "
    "import runpy; runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
)


def child_command(python: str, *args: str, module: str = "kvtrace.proc.child") -> list[str]:
    """The command line of ``python -m MODULE ARGS`` (``kvtrace.proc.child``, or the
    dashboard's ``kvtrace.tui.remote.process``) run without the working directory on its
    ``sys.path`` (``_BOOTSTRAP``)."""
    return [python, "-c", _BOOTSTRAP.format(root=_REPO_ROOT, module=module), *args]


def spawn_child(
    job: Contract, python: str = sys.executable, *, stderr: Any, pass_fds: tuple[int, ...] = (),
    commands: bool = False, env_defaults: dict[str, str] | None = None, module: str = "kvtrace.proc.child",
) -> tuple[subprocess.Popen[bytes], IO[str]]:
    """Start ``module JOB CONTROL_FD`` (``kvtrace.proc.child``, or a module running its ``main``)
    under ``python`` (``child_command``: this
    checkout's ``kvtrace`` first on its path, the working directory not on it): its
    stdout is the record stream (a pipe), ``stderr`` where its messages go, stdin a pipe
    of commands when ``commands`` (else nothing); ``env_defaults``: environment
    variables for it that this process's environment does not set itself.

    Returns:
        The process and the reading end of its control channel (a ``Connection``).

    Raises:
        SideError: the interpreter cannot be started.
    """
    from traces import lifeline

    read_fd, write_fd = os.pipe()
    env = child_environ(env_defaults)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO_ROOT, env.get("PYTHONPATH", "")) if p)
    # The child ignores Ctrl-C (this process reports it and stops the child) and dies
    # with this process (kvtrace.proc.child settles with traces.lifeline first thing).
    env.update(lifeline.child_env())
    try:
        with lifeline.quiet_start():
            proc = subprocess.Popen(
                child_command(python, json.dumps(job.to_wire()), str(write_fd), module=module),
                stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.PIPE if commands else subprocess.DEVNULL,
                pass_fds=(write_fd, lifeline.lifeline_fd(), *pass_fds), env=env,
            )
    except OSError as exc:
        os.close(read_fd)
        raise SideError(f"cannot start {python}: {exc}") from None
    finally:
        os.close(write_fd)
    return proc, connection(read_fd, writable=False)


class ChildSide:
    """A version replaying in a child process (``python -m kvtrace.proc.child``).

    Args:
        name: how errors name the side (``A`` / ``B``).
        job: ``side_job(...)`` (with ``checker_fd`` set when the sides share a checker).
        python: the child's interpreter.
        pass_fds: more descriptors the child inherits (a shared checker's pipe).

    Raises:
        SideError (from ``chunks`` / ``summary``): the child reported an error or died.
    """

    def __init__(self, name: str, job: SideJob, python: str = sys.executable, pass_fds: tuple[int, ...] = ()) -> None:
        self.name = name
        self.spec = job.spec
        self.label = job.label
        self.origin = job.origin
        self.start_info: Started | None = None
        self._messages: list[Started | Ended | Failed] | None = None
        self._stderr = tempfile.TemporaryFile()
        try:
            self.proc, self._control = spawn_child(job, python, stderr=self._stderr, pass_fds=pass_fds)
        except SideError as exc:
            raise SideError(f"side {name} ({self.spec}): {exc}") from None
        assert self.proc.stdout is not None
        self._records = chunk_reader(os.dup(self.proc.stdout.fileno()))
        self.proc.stdout.close()
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=_QUEUED_BATCHES)
        self._thread = threading.Thread(target=self._read, name=f"kvtrace-side-{name}", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        """Thread: record batches from the child's stdout into the queue, then None."""
        from kvtrace.statelog.log import open_state_log

        try:
            _, reader = open_state_log(self._records)
            for batch in reader.iter_batches():
                self._queue.put(batch)
            self._queue.put(None)
        except BaseException as exc:  # the stream broke or never started: the control fd says why
            self._queue.put(exc)

    def chunks(self) -> Iterator[Chunk]:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise self._failure(item)
            yield Chunk(batch=item)

    def _control_messages(self) -> list[Started | Ended | Failed]:
        if self._messages is None:
            self._messages = [decode(m, (Started, Ended, Failed)) for m in receive_all(self._control)]
            self.proc.wait()
            for m in self._messages:
                if isinstance(m, Started):
                    self.start_info = m
        return self._messages

    def _failure(self, exc: BaseException | None) -> SideError:
        messages = self._control_messages()
        for m in messages:
            if isinstance(m, Failed):
                return SideError(f"side {self.name} ({self.spec}): {m.line}")
        self._stderr.seek(0)
        tail = self._stderr.read().decode(errors="replace").strip().splitlines()[-1:]
        why = tail[0] if tail else (f"{type(exc).__name__}: {exc}" if exc is not None else "no message")
        return SideError(f"side {self.name} ({self.spec}): its process exited with code {self.proc.returncode}: {why}")

    def summary(self) -> dict[str, Any]:
        """The child's replay summary (after its stream ended).

        Raises:
            SideError: the child reported an error instead.
        """
        for m in self._control_messages():
            if isinstance(m, Ended):
                return m.summary
        raise self._failure(None)

    def close(self) -> None:
        """Stop the child if it still runs (the parent stopped reading early)."""
        stop_child(self.proc)
        self._records.close()
        if not self._control.closed:
            self._control.close()
        self._stderr.close()


class LogSide:
    """A saved state log (``kvtrace replay --out``); its summary is computed from the
    records (steps, peak occupancy, evictions, over-allocation released, OOMs,
    violations): a log holds no replay summary."""

    def __init__(self, path: str | Path) -> None:
        from kvtrace.statelog.log import open_state_log

        self.path = Path(path)
        self.info, self._reader = open_state_log(self.path)
        self.spec = str(self.info.get("allocator", "?"))
        self.label = f"{self.path.name} ({self.spec})"
        self.origin = f"state log {self.path}"
        self._stats = _LogStats()

    def chunks(self) -> Iterator[Chunk]:
        for batch in self._reader.iter_batches():
            self._stats.add(batch)
            yield Chunk(batch=batch)

    def summary(self) -> dict[str, Any]:
        config = self.info.get("config", {})
        return {"trace": self.info.get("trace"), "allocator": self.spec, "state_log": str(self.path),
                "page_size": config.get("page_size"), "pool_tokens": config.get("pool_tokens"), **self._stats.to_dict(),
                "truncated": bool(self._reader.truncated), "truncation_detail": getattr(self._reader, "truncation_detail", None)}

    def close(self) -> None:
        """Nothing to release: the log's file is open only while its batches are read."""


class _LogStats:
    """Summary figures of a state log, accumulated batch by batch (vectorised)."""

    def __init__(self) -> None:
        self.steps = 0
        self.peak_used_tokens = 0
        self.peak_step: int | None = None
        self.sums = {"evict": 0, "overalloc_release": 0}
        self.counts = {"oom": 0, "violation": 0, "dropped": 0}
        self.oom: dict[str, Any] | None = None

    def add(self, batch: pa.RecordBatch) -> None:
        import pyarrow.compute as pc

        n = batch.num_rows
        if n == 0:
            return
        self.steps += n
        col = {name: batch.column(name) for name in batch.schema.names}
        used = col["pool_tokens"].to_numpy() - col["available"].to_numpy() - col["evictable"].to_numpy()
        i = int(np.argmax(used))
        if self.peak_step is None or int(used[i]) > self.peak_used_tokens:
            self.peak_used_tokens, self.peak_step = int(used[i]), int(col["step"][i].as_py())
        events = col["events"]
        flat = events.flatten()
        if len(flat) == 0:
            return
        kind = flat.field("kind")
        tokens = flat.field("tokens")
        for name in self.sums:
            self.sums[name] += int(pc.sum(pc.filter(tokens, pc.equal(kind, name))).as_py() or 0)
        for name in self.counts:
            self.counts[name] += int(pc.sum(pc.equal(kind, name).cast("int64")).as_py() or 0)
        if self.oom is None and self.counts["oom"]:
            first = int(pc.index(kind, "oom").as_py())
            row = int(pc.list_parent_indices(events)[first].as_py())
            self.oom = {"step": int(col["step"][row].as_py()), "rid": flat.field("rid")[first].as_py(),
                        "detail": flat.field("detail")[first].as_py()}

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps, "peak_used_tokens": self.peak_used_tokens, "peak_step": self.peak_step,
            "evicted_tokens": self.sums["evict"], "overalloc": {"released": self.sums["overalloc_release"]},
            "oom": self.oom, "num_ooms": self.counts["oom"], "num_violations": self.counts["violation"],
            "dropped_requests": self.counts["dropped"],
        }
