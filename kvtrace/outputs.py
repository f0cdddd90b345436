"""Files kvtrace writes: never one of the inputs, never an existing file without
``--force``, never half a file.

Every command that writes a file goes through ``OutputFile``; the checks run when
it is made (before any work), the file is written under a temporary name beside
the destination and renamed into place when complete (``traces.atomic``)::

    out = OutputFile(path, force=force, inputs=[trace_path])    # refuses at once (exit 2)
    with out.writing() as tmp:                                    # ".run.arrow.<pid>-<hex>.tmp"
        write_everything(tmp)                                     # renamed over `path` at the end

An interrupted or failed run leaves the destination as it was and removes the
temporary file. A recording, which must survive a kill with every completed step,
writes through ``recording()`` instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from kvtrace.errors import OutputError
from traces.atomic import replacing

__all__ = ["OutputFile", "distinct_outputs"]


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return a.resolve() == b.resolve()


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

    Raises:
        OutputError: the path is an input, a directory, in a directory that does not
            exist, or an existing file without ``force`` (one line naming it).
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
        for source in inputs:
            if _same_file(self.path, Path(source)):
                raise OutputError(
                    f"{option} {self.path} is the input {source}; writing it would destroy the input, "
                    "give another path"
                )
        if self.path.is_dir():
            raise OutputError(f"{option} {self.path} is a directory; give a file path")
        parent = self.path.parent
        if not parent.is_dir():
            raise OutputError(f"{option} {self.path}: directory {parent} does not exist; create it first")
        if self.path.exists() and not force:
            raise OutputError(f"{option} {self.path} already exists; pass --force to overwrite it")
        self.replaces = self.path.exists()  # an existing file will be replaced (force)

    @contextmanager
    def writing(self) -> Iterator[Path]:
        """A temporary path to write, renamed over ``path`` when the block completes.

        Yields:
            The temporary path (not created yet).

        Raises:
            OutputError: the finished file cannot be renamed into place.
        """
        try:
            with replacing(self.path) as tmp:
                yield tmp
        except OSError as exc:
            raise OutputError(f"{self.option} {self.path}: cannot write it ({exc.strerror or exc})") from None

    @contextmanager
    def recording(self) -> Iterator[Path]:
        """The path a durable recording writes to as it goes.

        A new file is written in place: a recording interrupted or killed leaves
        its completed steps there (its metadata says it is interrupted). An
        existing file (``force``) is replaced only when the recording completes: it
        is written under a temporary name, and an interrupted run removes that and
        leaves the old file as it was.

        Yields:
            The path to write.
        """
        if not self.replaces:
            yield self.path
            return
        with self.writing() as tmp:
            yield tmp
