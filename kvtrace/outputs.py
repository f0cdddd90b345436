"""Files kvtrace writes: never one of the inputs, never an existing file without
``--force``, never half a file.

Every command that writes a file goes through ``OutputFile``; the checks run when
it is made (before any work), the file is written under a temporary name beside
the destination and renamed into place when complete (``traces.atomic``)::

    out = OutputFile(path, force=force, inputs=[trace_path])    # refuses at once (exit 2)
    with out.writing() as tmp:                                    # ".run.arrow.<pid>-<hex>.tmp"
        write_everything(tmp)                                     # renamed over `path` at the end

An interrupted or failed run leaves the destination as it was and removes the
temporary file: while a file is written, SIGTERM and SIGHUP (when nothing else
handles them) raise ``Terminated`` instead of killing the process outright. A
temporary file left by a process killed with SIGKILL is removed by the next run
to the same destination. A recording, which must survive a kill with every
completed step, writes through ``recording()`` instead.

Two runs racing to create the same new file cannot both succeed: without
``force`` the finished file is linked into place, which fails if the other run's
file got there first (``traces.atomic.replacing(exclusive=True)``). Only regular
files are ever replaced: a device (``/dev/null``), a FIFO or a socket is refused.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from kvtrace.errors import OutputError, Terminated
from traces.atomic import remove_stale_temporaries, replacing

__all__ = ["OutputFile", "distinct_outputs", "signals_raise", "terminating_cleanly"]

_KINDS = (
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return a.resolve() == b.resolve()


def _reason(exc: OSError) -> str:
    """The OS's words for ``exc`` ("No space left on device"), without pyarrow's decoration."""
    return os.strerror(exc.errno) if exc.errno else str(exc)


def _not_regular(path: Path) -> str | None:
    """What ``path`` is when it exists and is neither a regular file nor a directory."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    for test, kind in _KINDS:
        if test(mode):
            return kind
    return None


@contextmanager
def signals_raise(signums: Iterable[int], *, unhandled_only: bool = False) -> Iterator[None]:
    """Within the block, SIGINT raises ``KeyboardInterrupt`` and the other ``signums``
    raise ``Terminated``, each once the step a trace writer may be writing is on disk
    (``traces.writer.interrupt_when_safe``), so ``with`` blocks close their files and remove
    their temporary ones. ``unhandled_only`` leaves a signal someone already handles
    alone. Outside the main thread, where handlers cannot be installed, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from traces.writer import interrupt_when_safe

    def handler(signum: int, frame: object) -> None:
        interrupt_when_safe(KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum))

    previous = {}
    for signum in signums:
        if not unhandled_only or signal.getsignal(signum) is signal.SIG_DFL:
            previous[signum] = signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def terminating_cleanly() -> contextlib.AbstractContextManager[None]:
    """Within the block, SIGTERM and SIGHUP raise ``Terminated`` unless someone already
    handles them (the CLI's ``ui.terminate_on_signals``): what a file being written needs."""
    return signals_raise((signal.SIGTERM, signal.SIGHUP), unhandled_only=True)


def distinct_outputs(outputs: Iterable[OutputFile | None]) -> None:
    """Refuse a command's outputs that name the same file (one would overwrite the other).

    Raises:
        OutputError: one line naming both options and the file.
    """
    seen: list[OutputFile] = []
    for output in outputs:
        if output is None:
            continue
        for other in seen:
            if _same_file(output.path, other.path):
                raise OutputError(
                    f"{other.option} {other.path} and {output.option} {output.path} are the same file; "
                    "give them different paths"
                )
        seen.append(output)


class OutputFile:
    """An output path, checked against the command's inputs and the files it would replace.

    Args:
        path: where the output goes.
        option: the option that named it, for messages (``--out``).
        force: replace an existing file.
        inputs: the command's input files; an output that is one of them (the same
            file, however it is spelled: resolved links, hard links) is refused even
            with ``force``.

    Temporary files left at the destination by a killed run (their process is gone)
    are removed.

    Raises:
        OutputError: the path is ``-``, an input, a directory, a device, FIFO or socket,
            in a directory that does not exist, or an existing file without ``force``
            (one line naming it).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        option: str = "--out",
        force: bool = False,
        inputs: Iterable[str | os.PathLike[str]] = (),
    ) -> None:
        self.path = Path(path)
        self.option = option
        self.force = force
        if str(path) == "-":
            raise OutputError(
                f"{option} -: this output is a file, not standard output; give a file path"
            )
        for source in inputs:
            if _same_file(self.path, Path(source)):
                raise OutputError(
                    f"{option} {self.path} is the input {source}; writing it would destroy the input, "
                    "give another path"
                )
        if self.path.is_dir():
            raise OutputError(f"{option} {self.path} is a directory; give a file path")
        kind = _not_regular(self.path)
        if kind is not None:
            raise OutputError(
                f"{option} {self.path} is {kind}, not a regular file; kvtrace replaces regular files only "
                "(even with --force), give a file path"
            )
        parent = self.path.parent
        if not parent.is_dir():
            raise OutputError(f"{option} {self.path}: directory {parent} does not exist; create it first")
        if self.path.exists() and not force:
            raise OutputError(f"{option} {self.path} already exists; pass --force to overwrite it")
        self.replaces = self.path.exists()  # an existing file will be replaced (force)
        remove_stale_temporaries(self.path)

    @contextmanager
    def writing(self) -> Iterator[Path]:
        """A temporary path to write, renamed over ``path`` when the block completes.

        Without ``force``, the file must still not exist when it is complete (another
        process may have written it meanwhile): it is then left as it is.

        Yields:
            The temporary path (not created yet).

        Raises:
            OutputError: the finished file cannot be put into place.
            Terminated: SIGTERM or SIGHUP (the temporary file is removed).
        """
        try:
            with terminating_cleanly(), replacing(self.path, exclusive=not self.force) as tmp:
                yield tmp
        except FileExistsError:
            raise OutputError(
                f"{self.option} {self.path} was created by another process while this one ran; "
                "it was left as it is, pass --force to overwrite it"
            ) from None
        except OSError as exc:
            raise OutputError(f"{self.option} {self.path}: cannot write it ({_reason(exc)})") from None

    @contextmanager
    def recording(self) -> Iterator[Path]:
        """The path a durable recording writes to as it goes.

        A new file is written in place: a recording interrupted or killed leaves
        its completed steps there (its metadata says it is interrupted). The new
        file is created (empty) first, exclusively, so that of two runs racing to
        record to the same path one is refused; it is removed again if the block
        fails before writing anything. An
        existing file (``force``) is replaced only when the recording completes: it
        is written under a temporary name, and an interrupted run removes that and
        leaves the old file as it was.

        Yields:
            The path to write (a new one exists, empty: open it for writing, not
            exclusively).

        Raises:
            OutputError: a new file appeared at the path since the checks.
        """
        if not self.replaces:
            try:
                os.close(os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            except FileExistsError:
                raise OutputError(
                    f"{self.option} {self.path} was created by another process meanwhile; "
                    "it was left as it is, pass --force to overwrite it"
                ) from None
            except OSError as exc:
                raise OutputError(f"{self.option} {self.path}: cannot write it ({_reason(exc)})") from None
            try:
                with terminating_cleanly():
                    yield self.path
            except BaseException:
                try:
                    if self.path.stat().st_size == 0:  # nothing written: no trace to keep
                        self.path.unlink()
                except OSError:
                    pass
                raise
            return
        with self.writing() as tmp:
            yield tmp
