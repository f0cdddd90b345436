"""A sweep's results on disk: durable per cell, one Parquet file at the end.

While a sweep runs, each finished cell is written at once as a small Parquet file
of one row in a sidecar directory beside the output (``results.parquet.parts/``,
``<cell key>.parquet``), under a temporary name flushed and renamed into place
(``traces.atomic``): a sweep killed at any instant loses no finished cell, and a
rerun of the same command skips the cells that ran (``ok``, or a check that found
something: the same cell would find it again); failed cells run again. When every cell is done the parts are merged into the output (written
aside and renamed into place by ``kvtrace.outputs.OutputFile``), in grid order, and
the sidecar directory is removed.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtrace.errors import OutputError
from traces.atomic import replacing

if TYPE_CHECKING:
    import pyarrow as pa

    from kvtrace.outputs import OutputFile

__all__ = ["ResultStore", "parts_dir"]


def parts_dir(out: Path) -> Path:
    """The sidecar directory of ``out``'s finished cells."""
    return out.with_name(out.name + ".parts")


class ResultStore:
    """The finished cells of the sweep writing ``out``.

    Args:
        out: the final Parquet file.
        fresh: drop the cells of an earlier, unfinished run (``--force``).

    Raises:
        OutputError: the sidecar path exists and is not a directory, or cannot be made.
    """

    def __init__(self, out: Path, *, fresh: bool = False) -> None:
        self.out = out
        self.parts = parts_dir(out)
        if self.parts.exists() and not self.parts.is_dir():
            raise OutputError(f"{self.parts} (where a sweep keeps its finished cells) is not a directory; remove it")
        if fresh and self.parts.exists():
            shutil.rmtree(self.parts)
        try:
            self.parts.mkdir(exist_ok=True)
        except OSError as exc:
            raise OutputError(f"cannot create {self.parts}: {exc.strerror or exc}") from None

    def _part(self, key: str) -> Path:
        return self.parts / f"{key}.parquet"

    def finished(self, keys: Iterable[str]) -> set[str]:
        """The keys among ``keys`` whose cell ran (any status but ``failed``) in this or
        an earlier run (a part that cannot be read, e.g. of another kvtrace, counts as
        not done)."""
        import pyarrow.parquet as pq

        done = set()
        for key in keys:
            part = self._part(key)
            if not part.is_file():
                continue
            try:
                status = pq.read_table(part, columns=["status"]).column("status").to_pylist()
            except Exception:  # noqa: BLE001 - an unreadable part is a cell to run again
                continue
            if len(status) == 1 and status[0] not in (None, "failed"):
                done.add(key)
        return done

    def write(self, row: dict[str, Any]) -> None:
        """Write one finished cell durably (flushed, then renamed into place).

        Raises:
            OutputError: the part cannot be written (disk full, permissions).
        """
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.Table.from_pylist([row])
        try:
            with replacing(self._part(row["cell"])) as tmp:
                pq.write_table(table, tmp)
        except OSError as exc:
            raise OutputError(f"cannot write {self._part(row['cell'])}: {exc.strerror or exc}") from None

    def rows(self, keys: list[str]) -> pa.Table:
        """The finished cells ``keys`` (those with a part), in that order, as one table."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        tables = [pq.read_table(self._part(k)) for k in keys if self._part(k).is_file()]
        if not tables:
            return pa.table({})
        table = pa.concat_tables(tables, promote_options="permissive")
        # A summary key that is null in every row and an object elsewhere ("oom":
        # null, "oom.step": 12) keeps only the object's columns.
        names = table.column_names
        drop = [n for n in names if table.column(n).null_count == table.num_rows and any(m.startswith(n + ".") for m in names)]
        return table.drop_columns(drop)

    def merge(self, keys: list[str], target: OutputFile) -> pa.Table:
        """Write the cells ``keys`` into the output (atomically) and remove the parts.

        Raises:
            OutputError: the output cannot be written, or some cell's part is gone
                (removed by something else): the output is left as it was rather
                than replaced by fewer rows.
        """
        import pyarrow.parquet as pq

        missing = [k for k in keys if not self._part(k).is_file()]
        if missing:
            raise OutputError(
                f"{len(missing):,} of {len(keys):,} finished cells are gone from {self.parts} (removed by another "
                f"process?); {target.path} is left as it was: run the sweep again"
            )
        table = self.rows(keys)
        with target.writing() as tmp:
            pq.write_table(table, tmp)
        shutil.rmtree(self.parts, ignore_errors=True)
        return table
