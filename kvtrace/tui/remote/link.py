"""How the screen and the replay side of the dashboard talk: a child process, or a thread.

The replay side (``kvtrace.tui.remote.replayer.Replayer``) says two things, in order: the
steps it replays (``records``: ``kvtrace.replay.snapshot.SnapshotBlock``) and messages
(``send``: the dashboard's messages of ``kvtrace.proc.contracts``); it hears commands
(``commands``: ``contracts.Command``). The screen's side (``ReplayLink``) gets
``("records", SnapshotBlock)``, ``("msg", (records, message))`` (``records``: the steps
sent before the message, which the screen folds before applying it) and, once the
other side is gone, ``("closed", reason)``, and sends commands without ever waiting
for the replay.

* ``ChildReplay``: the replay in its own process, ``python -m kvtrace.tui.remote.process JOB
  CONTROL_FD`` as a ``kvtrace diff`` side runs (``kvtrace.diff.sides``), its three
  pipes ``Connection``s (``kvtrace.proc.channel``): stdout carries the records, an
  update a message (``kvtrace.tui.remote.updates``), the control fd the messages
  (``(records, wire form)``; the child's own ``Failed``), stdin the commands (wire
  forms). Two pipes keep no common order: hence ``records``.
* ``ThreadReplay``: the replay in a thread of the screen's process (tests, and
  callers that already hold a source): the same items through queues.
"""

from __future__ import annotations

import os
import queue
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from kvtrace.errors import KvtraceError
from kvtrace.proc.channel import connection
from kvtrace.proc.contracts import DASHBOARD_MESSAGES, Command, Contract, DashboardJob, Failed, Info, ReplayError, decode

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from kvtrace.tui.remote.replayer import Replayer
    from kvtrace.tui.remote.sources import ReplaySource
    from kvtrace.replay.snapshot import SnapshotBlock

__all__ = [
    "ChildReplay",
    "Item",
    "PipeEnd",
    "ReplayLink",
    "ReplayProcessDied",
    "ReplayProcessError",
    "ReplayerEnd",
    "ThreadReplay",
]

Item = tuple[str, Any]  # ("records", SnapshotBlock) | ("msg", (int, Contract)) | ("closed", str | None)
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


class ReplayProcessDied(KvtraceError):
    """The dashboard's replay process went away while the screen showed it (killed,
    crashed): the dashboard command fails once the user quits."""

    exit_code = 1


# ---------------------------------------------------------------------------- the replay's side


class ReplayerEnd(Protocol):
    """What the replayer talks through."""

    def records(self, update: SnapshotBlock) -> None:
        """Send consecutive steps (in order)."""
        ...

    def send(self, message: Contract) -> None:
        """Send a message, after the records sent before it."""
        ...

    def commands(self, timeout: float) -> list[Command] | None:
        """The commands that arrived (waiting up to ``timeout`` seconds for one); None
        once the screen has gone away."""
        ...


class PipeEnd:
    """The replayer's end in a child process: records to ``out`` (an update a message),
    messages to ``control``, commands from ``commands``.

    Args:
        out: the record stream (the child's stdout).
        control: the control channel.
        commands: the command stream (the child's stdin).
    """

    def __init__(self, out: Connection, control: Connection, commands: Connection) -> None:
        self._out = out
        self._control = control
        self._commands = commands
        self._eof = False
        self.sent = 0

    def records(self, update: SnapshotBlock) -> None:
        from kvtrace.tui.remote.updates import write_update

        write_update(self._out, update)
        self.sent += update.num_steps

    def send(self, message: Contract) -> None:
        self._control.send((self.sent, message.to_wire()))

    def commands(self, timeout: float) -> list[Command] | None:
        if self._eof:
            return None
        out: list[Command] = []
        conn = self._commands
        try:
            if not conn.poll(max(timeout, 0.0)):
                return out
            while True:
                out.append(decode(conn.recv(), (Command,)))
                if not conn.poll(0):
                    return out
        except EOFError:
            self._eof = True
            return out or None

    def close(self) -> None:
        self._out.close()


class _ThreadEnd:
    """The replayer's end in a thread: items into the screen's queue."""

    def __init__(self, inbox: queue.Queue[Item], commands: queue.SimpleQueue[Command | None]) -> None:
        self._inbox = inbox
        self._commands = commands
        self.sent = 0

    def records(self, update: SnapshotBlock) -> None:
        self._inbox.put(("records", update))
        self.sent += update.num_steps

    def send(self, message: Contract) -> None:
        self._inbox.put(("msg", (self.sent, message)))

    def commands(self, timeout: float) -> list[Command] | None:
        out: list[Command] = []
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

    def command(self, command: Command) -> None:
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
        self._commands: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
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

    def command(self, command: Command) -> None:
        self._commands.put(command)

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

    def __init__(self, job: DashboardJob, python: str = sys.executable) -> None:
        from kvtrace.diff.sides import spawn_child

        self.name = job.name
        self._stderr = tempfile.TemporaryFile()
        self.proc, self._control = spawn_child(job, python, stderr=self._stderr, commands=True,
                                               env_defaults=CHILD_ENV, module="kvtrace.tui.remote.process")
        assert self.proc.stdout is not None and self.proc.stdin is not None
        _widen_pipe(self.proc.stdout.fileno())
        # The pipes become Connections (the one framing); Popen's files are let go.
        self._records = connection(os.dup(self.proc.stdout.fileno()), writable=False)
        self._commands = connection(os.dup(self.proc.stdin.fileno()), readable=False)
        self.proc.stdout.close()
        self.proc.stdin.close()
        self._inbox: queue.Queue[Item] = queue.Queue(maxsize=_QUEUED)
        self._outbox: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
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
            while (update := read_update(self._records)) is not None:
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
        try:
            while True:
                try:
                    item = self._control.recv()
                except (EOFError, OSError):
                    break
                if isinstance(item, tuple):  # (records, a dashboard message)
                    records, message = item[0], decode(item[1], DASHBOARD_MESSAGES)
                else:  # kvtrace.proc.child's own
                    failed = decode(item, (Failed,))
                    self._start_error = failed.line
                    records, message = 0, ReplayError(failed.line)
                if isinstance(message, Info):
                    self._started.set()
                self._inbox.put(("msg", (records, message)))
        except Exception as exc:  # noqa: BLE001  a message that is not one (ContractError): stop the child
            from kvtrace.diff.sides import stop_child

            self._stream_error = f"the replay process's messages broke ({type(exc).__name__}: {exc})"
            stop_child(self.proc)
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
        conn = self._commands
        while True:
            item = self._outbox.get()
            try:
                if item is None:
                    conn.close()
                    return
                conn.send(item.to_wire())
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

    def command(self, command: Command) -> None:
        self._outbox.put(command)

    def close(self, timeout: float = 60.0) -> None:
        """Ask the child to quit (it closes its state log, if any) and wait for it; stop it
        if it does not answer in ``timeout`` seconds."""
        import time

        self._closing = True
        self._outbox.put(Command("quit"))
        self._outbox.put(None)
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.get(0.05)  # drain, so that a child blocked on a full pipe gets out
        from kvtrace.diff.sides import stop_child

        stop_child(self.proc)
        deadline = time.monotonic() + 10
        while any(t.is_alive() for t in self._threads[:2]) and time.monotonic() < deadline:
            self.get(0.05)
        self._records.close()
        self._control.close()
        self._stderr.close()
