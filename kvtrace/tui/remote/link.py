"""How the screen and the replay side of the dashboard talk: a child process, or a thread.

The replay side (``kvtrace.tui.remote.replayer.Replayer``) says two things, in order: the
steps it replays (``records``: ``kvtrace.replay.snapshot.SnapshotBlock``) and messages
(``send``: dicts with a ``kind``); it hears commands (``commands``). The screen's side
(``ReplayLink``) gets ``("records", SnapshotBlock)``, ``("msg", dict)`` and, once the
other side is gone, ``("closed", reason)``, and sends commands without ever waiting
for the replay.

* ``ChildReplay``: the replay in its own process, ``python -m kvtrace.tui.remote.process JOB
  CONTROL_FD`` as a ``kvtrace diff`` side runs (``kvtrace.diff.sides``): stdout carries
  the records as update frames (``kvtrace.tui.remote.updates``), the control fd JSON lines
  (the messages, with numpy arrays packed; the child's ``start``, ``error``), stdin
  the commands (JSON lines). Each message carries ``records``, the steps sent before
  it, so the screen applies it after folding them (two pipes keep no common order).
* ``ThreadReplay``: the replay in a thread of the screen's process (tests, and
  callers that already hold a source): the same items through queues.
"""

from __future__ import annotations

import base64
import json
import os
import queue
import select
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any, BinaryIO, Protocol

import numpy as np

from kvtrace.errors import KvtraceError

if TYPE_CHECKING:
    from kvtrace.tui.remote.replayer import Replayer
    from kvtrace.tui.remote.sources import ReplaySource
    from kvtrace.replay.snapshot import SnapshotBlock

__all__ = [
    "ChildReplay",
    "Item",
    "PipeEnd",
    "ReplayLink",
    "ReplayProcessError",
    "ReplayerEnd",
    "ThreadReplay",
    "pack",
    "unpack",
]

Item = tuple[str, Any]  # ("records", SnapshotBlock) | ("msg", dict) | ("closed", str | None)
_QUEUED = 64  # items waiting for the screen before the replay waits (back-pressure)
START_TIMEOUT_S = 300.0
# The replay process holds hundreds of MB of checkpoints; numpy's transparent huge pages
# then cost the kernel compaction on later page faults, system time that the plain replay
# does not pay (bench/RESULTS.md). A variable the user sets wins.
CHILD_ENV = {"NUMPY_MADVISE_HUGEPAGE": "0"}
# The update pipe's capacity: room for several updates at full speed (their blocks carry
# the steps' request rows; a thread of the screen's reads them as they come), so that the
# replay process writes on while the screen is busy drawing rather than waiting for it to
# read, as it does with the default 64 KiB (bench/RESULTS.md).
PIPE_BYTES = 1 << 20


class ReplayProcessError(KvtraceError):
    """The dashboard's replay process could not start (its message says why)."""


def pack(value: Any) -> Any:
    """A message with numpy arrays made JSON-able (``unpack`` reverses it)."""
    if isinstance(value, np.ndarray):
        data = np.ascontiguousarray(value)
        return {"__nd__": [data.dtype.str, list(data.shape), base64.b64encode(data.tobytes()).decode("ascii")]}
    if isinstance(value, dict):
        return {k: pack(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [pack(v) for v in value]
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return value


def unpack(value: Any) -> Any:
    """The message ``pack`` made JSON-able, arrays restored."""
    if isinstance(value, dict):
        nd = value.get("__nd__")
        if nd is not None and len(value) == 1:
            dtype, shape, data = nd
            return np.frombuffer(base64.b64decode(data), dtype=np.dtype(dtype)).reshape(shape).copy()
        return {k: unpack(v) for k, v in value.items()}
    if isinstance(value, list):
        return [unpack(v) for v in value]
    return value


# ---------------------------------------------------------------------------- the replay's side


class ReplayerEnd(Protocol):
    """What the replayer talks through."""

    def records(self, update: SnapshotBlock) -> None:
        """Send consecutive steps (in order)."""
        ...

    def send(self, message: dict[str, Any]) -> None:
        """Send a message, after the records sent before it."""
        ...

    def commands(self, timeout: float) -> list[tuple[str, list[Any]]] | None:
        """The commands that arrived (waiting up to ``timeout`` seconds for one); None
        once the screen has gone away."""
        ...


class PipeEnd:
    """The replayer's end in a child process: records to ``out`` (update frames),
    messages to ``control`` (JSON lines), commands from ``commands`` (JSON lines).

    Args:
        out: the record stream (the child's stdout).
        control: the control channel (text, line buffered by ``send``).
        commands: the command stream (the child's stdin).
    """

    def __init__(self, out: BinaryIO, control: IO[str], commands: BinaryIO) -> None:
        self._out = out
        self._control = control
        self._fd = commands.fileno()
        self._pending = b""
        self._eof = False
        self.sent = 0

    def records(self, update: SnapshotBlock) -> None:
        from kvtrace.tui.remote.updates import write_update

        write_update(self._out, update)
        self.sent += update.num_steps

    def send(self, message: dict[str, Any]) -> None:
        self._control.write(json.dumps(pack({**message, "records": self.sent})) + "\n")
        self._control.flush()

    def commands(self, timeout: float) -> list[tuple[str, list[Any]]] | None:
        if self._eof:
            return None
        ready, _, _ = select.select([self._fd], [], [], max(timeout, 0.0))
        if not ready:
            return []
        chunk = os.read(self._fd, 1 << 16)
        if not chunk:
            self._eof = True
            return None
        lines = (self._pending + chunk).split(b"\n")
        self._pending = lines.pop()
        out = []
        for line in lines:
            if line.strip():
                name, *args = json.loads(line)
                out.append((str(name), args))
        return out

    def close(self) -> None:
        self._out.flush()


class _ThreadEnd:
    """The replayer's end in a thread: items into the screen's queue."""

    def __init__(self, inbox: queue.Queue[Item], commands: queue.SimpleQueue[tuple[str, list[Any]] | None]) -> None:
        self._inbox = inbox
        self._commands = commands
        self.sent = 0

    def records(self, update: SnapshotBlock) -> None:
        self._inbox.put(("records", update))
        self.sent += update.num_steps

    def send(self, message: dict[str, Any]) -> None:
        self._inbox.put(("msg", {**message, "records": self.sent}))

    def commands(self, timeout: float) -> list[tuple[str, list[Any]]] | None:
        out: list[tuple[str, list[Any]]] = []
        try:
            item = self._commands.get(timeout=timeout) if timeout > 0 else self._commands.get_nowait()
        except queue.Empty:
            return out
        while True:
            if item is None:
                return None
            out.append(item)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return out


# ---------------------------------------------------------------------------- the screen's side


class ReplayLink(Protocol):
    """What the screen's driver talks through."""

    def get(self, timeout: float) -> Item | None:
        """The next item (None when none came within ``timeout`` seconds)."""
        ...

    def command(self, name: str, *args: Any) -> None:
        """Queue a command (never waits for the replay)."""
        ...

    def close(self) -> None:
        """Ask the replay side to quit and wait (bounded) until it did."""
        ...


def _take(inbox: queue.Queue[Item], timeout: float) -> Item | None:
    """The next item of ``inbox``, waiting up to ``timeout`` s (0: only one already there)."""
    try:
        return inbox.get(timeout=timeout) if timeout > 0 else inbox.get_nowait()
    except queue.Empty:
        return None


class ThreadReplay:
    """A ``Replayer`` over ``source`` in a thread of this process.

    Args:
        source: what to replay (closed when the replayer returns).
        play: start playing at once.
        make: builds the replayer (``Replayer(source, end, play=...)`` by default).
    """

    def __init__(self, source: ReplaySource, *, play: bool = True, make: Callable[..., Replayer] | None = None) -> None:
        from kvtrace.tui.remote.replayer import Replayer

        self._inbox: queue.Queue[Item] = queue.Queue(maxsize=_QUEUED)
        self._commands: queue.SimpleQueue[tuple[str, list[Any]] | None] = queue.SimpleQueue()
        end = _ThreadEnd(self._inbox, self._commands)
        self.replayer = (make or Replayer)(source, end, play=play)
        self._thread = threading.Thread(target=self._run, name="kvtrace-replayer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.replayer.run()
        finally:
            self.replayer.source.close()
            self._put(("closed", None))

    def _put(self, item: Item) -> None:
        while self._thread.is_alive():
            try:
                self._inbox.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def get(self, timeout: float) -> Item | None:
        return _take(self._inbox, timeout)

    def command(self, name: str, *args: Any) -> None:
        self._commands.put((name, list(args)))

    def close(self) -> None:
        self._commands.put(None)
        while self._thread.is_alive():  # drain, so that a replayer blocked on a full queue returns
            self.get(0.05)
        self._thread.join()


def _widen_pipe(fd: int, size: int = PIPE_BYTES) -> None:
    """Let pipe ``fd`` hold ``size`` bytes (Linux; elsewhere, or past the system's limit,
    it keeps its own size): the replay then writes on while the screen draws a frame,
    instead of waiting for it to read."""
    import fcntl

    setsize = getattr(fcntl, "F_SETPIPE_SZ", None)
    if setsize is None:
        return
    try:
        fcntl.fcntl(fd, setsize, size)
    except OSError:
        pass


class ChildReplay:
    """The replay in its own process (``python -m kvtrace.tui.remote.process``, a dashboard job).

    Args:
        job: the child's job (``kvtrace.tui.remote.replayer.dashboard_job`` / ``log_job``).
        python: the child's interpreter.

    Raises:
        ReplayProcessError (from ``wait_started``): the child reported an error while
            setting up (a bad trace, version or option: its one-line message), or died.
    """

    def __init__(self, job: dict[str, Any], python: str = sys.executable) -> None:
        from kvtrace.diff.sides import spawn_child

        self.name = str(job.get("trace_label") or job.get("state_log") or job.get("trace"))
        self._stderr = tempfile.TemporaryFile()
        self.proc, self._control = spawn_child(job, python, stderr=self._stderr, commands=True,
                                               env_defaults=CHILD_ENV, module="kvtrace.tui.remote.process")
        assert self.proc.stdout is not None
        _widen_pipe(self.proc.stdout.fileno())
        self._inbox: queue.Queue[Item] = queue.Queue(maxsize=_QUEUED)
        self._outbox: queue.SimpleQueue[tuple[str, list[Any]] | None] = queue.SimpleQueue()
        self._started = threading.Event()
        self._start_error: str | None = None
        self._stream_error: str | None = None
        self._closing = False
        self._ended = {"records": False, "control": False}
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._read_records, name="kvtrace-replay-records", daemon=True),
            threading.Thread(target=self._read_control, name="kvtrace-replay-control", daemon=True),
            threading.Thread(target=self._write_commands, name="kvtrace-replay-commands", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ threads
    def _read_records(self) -> None:
        from kvtrace.tui.remote.updates import read_update

        try:
            assert self.proc.stdout is not None
            while (update := read_update(self.proc.stdout)) is not None:
                self._inbox.put(("records", update))
        except BaseException as exc:  # noqa: BLE001  the stream broke
            if not self._closing and self.proc.poll() is None:
                # The child lives on but its updates cannot be read: stop it (its control
                # channel then ends too) and say why, rather than wait for it forever.
                from kvtrace.diff.sides import stop_child

                self._stream_error = f"the replay process's update stream broke ({type(exc).__name__}: {exc})"
                stop_child(self.proc)
        self._end("records")

    def _read_control(self) -> None:
        for line in self._control:
            if not line.strip():
                continue
            message = unpack(json.loads(line))
            if "kind" not in message:  # kvtrace.proc.child's own: start, error
                if "error" in message:
                    prefix = "" if message.get("user") else "internal error: "
                    self._start_error = f"{prefix}{message['error']}"
                    message = {"kind": "failure", "message": self._start_error, "records": 0}
                else:
                    continue
            if message["kind"] == "info":
                self._started.set()
            self._inbox.put(("msg", message))
        self._end("control")

    def _end(self, which: str) -> None:
        with self._lock:
            self._ended[which] = True
            done = all(self._ended.values())
        if done:
            self.proc.wait()
            self._started.set()
            self._inbox.put(("closed", None if self._closing else self.exit_reason()))

    def _write_commands(self) -> None:
        stdin = self.proc.stdin
        assert stdin is not None
        while True:
            item = self._outbox.get()
            try:
                if item is None:
                    stdin.close()
                    return
                stdin.write((json.dumps(item) + "\n").encode())
                stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                return

    # ------------------------------------------------------------------ ReplayLink
    def wait_started(self, timeout: float = START_TIMEOUT_S) -> None:
        """Wait until the child has set its replay up (its ``info`` message).

        Raises:
            ReplayProcessError: it reported an error instead, or exited.
        """
        self._started.wait(timeout)
        if self._start_error is not None:
            self.close()
            raise ReplayProcessError(self._start_error)
        if self.proc.poll() is not None or not self._started.is_set():
            reason = self.exit_reason() if self.proc.poll() is not None else f"no answer in {timeout:.0f} s"
            self.close()
            raise ReplayProcessError(f"the replay process of {self.name} did not start: {reason}")

    def exit_reason(self) -> str:
        """Why the child is gone: its error message, else its exit code and last line of stderr."""
        if self._start_error is not None:
            return self._start_error
        if self._stream_error is not None:
            return self._stream_error
        code = self.proc.poll()
        self._stderr.seek(0)
        tail = self._stderr.read().decode(errors="replace").strip().splitlines()[-1:]
        why = f": {tail[0]}" if tail else ""
        return f"the replay process exited with code {code}{why}"

    def get(self, timeout: float) -> Item | None:
        return _take(self._inbox, timeout)

    def command(self, name: str, *args: Any) -> None:
        self._outbox.put([name, *args])

    def close(self, timeout: float = 60.0) -> None:
        """Ask the child to quit (it closes its state log, if any) and wait for it; stop it
        if it does not answer in ``timeout`` seconds."""
        import time

        self._closing = True
        self._outbox.put(["quit"])
        self._outbox.put(None)
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.get(0.05)  # drain, so that a child blocked on a full pipe gets out
        from kvtrace.diff.sides import stop_child

        stop_child(self.proc)
        deadline = time.monotonic() + 10
        while any(t.is_alive() for t in self._threads[:2]) and time.monotonic() < deadline:
            self.get(0.05)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._control.close()
        self._stderr.close()
