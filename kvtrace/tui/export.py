"""``x`` on the dashboard: the view as it is now, written to files a person can keep.

Two files per export, never over an existing one: an SVG of the screen (Textual's
``export_screenshot``) and the request table as CSV (the rows the table shows, in its
order and filter). They go next to the trace or log when it is a file in a writable
directory, else in the current directory, named ``kvtrace-<name>-step<N>-<k>.svg`` /
``.csv`` with ``k`` the first number free for both; each is written under a temporary
name and linked into place (``traces.atomic.replacing``), so a file that appears
meanwhile is never overwritten.
"""

from __future__ import annotations

import csv
import io
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from traces.atomic import replacing

if TYPE_CHECKING:
    from kvtrace.tui.driver import Frame
    from kvtrace.tui.widgets.request_table import RequestTable

__all__ = ["CSV_COLUMNS", "export_dir", "export_view", "table_csv"]

CSV_COLUMNS = ("rid", "phase", "used", "allocated", "over", "pages", "protected", "prefix_hit", "admitted_step",
               "ended_step")
_MAX_TRIES = 10_000


def export_dir(trace: str) -> Path:
    """Where exports go: the trace's (or log's) directory when it is a file there and the
    directory is writable, else the current directory."""
    path = Path(trace)
    if path.is_file() and os.access(path.parent, os.W_OK):
        return path.parent
    return Path.cwd()


def table_csv(table: RequestTable, frame: Frame) -> str:
    """The rows ``table`` shows (its order and filter) as CSV, one line a request."""
    from kvtrace.replay.snapshot import PHASES

    req = frame.requests
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for rid in table.shown_rids.tolist():
        alloc, used = int(req.allocated[rid]), int(req.committed[rid])
        writer.writerow((rid, PHASES[int(req.phase[rid])], used, alloc, alloc - used, -(-alloc // req.page_size),
                         int(req.protected[rid]), int(req.prefix_hit[rid]), int(req.admitted_step[rid]),
                         int(req.ended_step[rid])))
    return out.getvalue()


def export_view(directory: Path, name: str, step: int | None, svg: str, table: str) -> tuple[Path, Path]:
    """Write ``svg`` and ``table`` (CSV) under the first free numbered names in ``directory``.

    Returns:
        The SVG's and the CSV's paths.

    Raises:
        OSError: they cannot be written (the directory is read-only, the disk full).
    """
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(name).stem if ":" not in name else name).strip("-") or "view"
    at = f"step{step}" if step is not None else "start"
    for k in range(1, _MAX_TRIES):
        svg_path = directory / f"kvtrace-{stem}-{at}-{k}.svg"
        csv_path = directory / f"kvtrace-{stem}-{at}-{k}.csv"
        if svg_path.exists() or csv_path.exists():
            continue
        try:
            _write_new(svg_path, svg)
        except FileExistsError:
            continue
        try:
            _write_new(csv_path, table)
        except FileExistsError:
            svg_path.unlink()  # a pair: take the next number for both
            continue
        return svg_path, csv_path
    raise OSError(f"no free export name in {directory} after {_MAX_TRIES} tries")


def _write_new(path: Path, text: str) -> None:
    """Create ``path`` with ``text``; FileExistsError if it appeared meanwhile."""
    with replacing(path, exclusive=True) as tmp:
        tmp.write_text(text, encoding="utf-8")
