"""Cached replays of allocator trees: what ``kvtrace diff --range`` does not replay twice.

A replay's result is keyed by what decides it: the tree of the ``allocator`` package
replayed (``kvtrace.diff.series``), the content of the trace, the replay options (checks,
OOM and bad-op handling, the ``--steps`` window, the what-ifs, ``--exact``'s digests)
and the code that drives it (this kvtrace's ``kvtrace`` and ``traces`` sources but for
the modules that only compare, orchestrate or present replays; the versions of Python,
torch, numpy and pyarrow). Under ``<cache dir>/replays``:

* ``entries/KEY.json``: the replay summary (the ``replay --json`` object), its steps,
  and the hash of its records;
* ``records/HASH.arrow``: the per-step records (a state log, zstd), stored once per
  content: a series of behaviour-preserving commits shares one file. The hash covers
  every column but the timings (``kvtrace.statelog.log.TIMING_COLUMNS``), so two replays
  with equal hashes are identical step for step without comparing them.

Files are written beside their destination and renamed into place, so a concurrent
or interrupted run never reads half a file. Records beyond ``KEEP_BYTES`` are removed
least recently used first (never one used in the last ``PRUNE_GRACE_S``); an entry
whose records are gone is a miss. A replay that failed is not cached (it may depend
on the environment): it runs again next time.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from traces.atomic import replacing, temporary_sibling
from traces.identity import trace_digest

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["CachedReplay", "RecordsWriter", "ReplayCache", "driver_digest", "replay_key", "trace_digest"]

KEEP_BYTES = 2 << 30  # bytes of records kept (replays with their digests)
PRUNE_GRACE_S = 3600.0
_ROOT = Path(__file__).resolve().parents[2]
_DRIVER_PACKAGES = ("kvtrace", "traces")
# Modules no replay runs (they compare, orchestrate or present): editing them keeps the cache.
_NOT_DRIVING = (
    "kvtrace/cli/", "kvtrace/tui/", "kvtrace/replay/report.py", "kvtrace/diff/diff.py", "kvtrace/diff/compare.py", "kvtrace/diff/sides.py",
    "kvtrace/diff/rangediff.py", "kvtrace/diff/replaycache.py", "kvtrace/diff/series.py", "kvtrace/versions/git.py", "kvtrace/outputs.py",
)
_DRIVER_DISTRIBUTIONS = ("torch", "numpy", "pyarrow")


def _digest() -> Any:
    return hashlib.blake2b(digest_size=20)


def driver_digest() -> str:
    """The hash of what drives a replay besides the allocator: this kvtrace's ``kvtrace``
    and ``traces`` sources (but ``_NOT_DRIVING``) and the versions of Python, torch,
    numpy and pyarrow."""
    h = _digest()
    for package in _DRIVER_PACKAGES:
        for path in sorted((_ROOT / package).rglob("*.py")):
            name = path.relative_to(_ROOT).as_posix()
            if not name.startswith(_NOT_DRIVING):
                h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(platform.python_version().encode())
    for name in _DRIVER_DISTRIBUTIONS:
        try:
            h.update(f"{name} {metadata.version(name)}".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{name} -".encode())
    return h.hexdigest()


def replay_key(tree: str, trace: str, settings: dict[str, Any], driver: str) -> str:
    """The cache key of one replay.

    Args:
        tree: the object id of the ``allocator`` tree replayed.
        trace: ``trace_digest`` of the trace.
        settings: everything else the replay's records depend on (JSON-able).
        driver: ``driver_digest()``.
    """
    text = json.dumps({"tree": tree, "trace": trace, "settings": settings, "driver": driver}, sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=20).hexdigest()


@dataclass(frozen=True, slots=True)
class CachedReplay:
    """A replay's result: its summary, its step count, the hash of its records and the
    state log holding them."""

    key: str
    summary: dict[str, Any]
    steps: int
    records: str
    log: Path


class RecordsWriter:
    """Writes record batches (a state log stream) to a temporary file beside the cache's
    records, hashing them as they pass (timings aside); ``finish`` files them."""

    def __init__(self, directory: Path) -> None:
        import pyarrow as pa

        self._pa = pa
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.tmp = temporary_sibling(directory / "records.arrow")
        self._sink: Any = None
        self._writer: Any = None
        self._hash = _digest()
        self.steps = 0

    def write(self, batch: pa.RecordBatch) -> None:
        from kvtrace.statelog.log import TIMING_COLUMNS

        if self._writer is None:
            self._sink = self._pa.OSFile(str(self.tmp), "wb")
            options = self._pa.ipc.IpcWriteOptions(compression="zstd")
            self._writer = self._pa.ipc.new_file(self._sink, batch.schema, options=options)
        self._writer.write_batch(batch)
        timeless = batch.drop_columns([c for c in TIMING_COLUMNS if c in batch.schema.names])
        self._hash.update(memoryview(timeless.serialize()))
        self.steps += batch.num_rows

    def finish(self) -> tuple[str, Path]:
        """Close the file and move it to ``records/HASH.arrow`` (dropped when that exists
        already: the same records). Returns the hash and the path."""
        if self._writer is None:  # no step at all: an empty log still has a schema
            from kvtrace.statelog.log import STATE_LOG_SCHEMA

            self._sink = self._pa.OSFile(str(self.tmp), "wb")
            self._writer = self._pa.ipc.new_file(self._sink, STATE_LOG_SCHEMA)
        self._writer.close()
        self._sink.close()
        records = self._hash.hexdigest()
        dest = self.directory / f"{records}.arrow"
        if dest.is_file():
            self.tmp.unlink(missing_ok=True)
            os.utime(dest)
        else:
            os.replace(self.tmp, dest)
        return records, dest

    def abort(self) -> None:
        """Drop what was written."""
        for closable in (self._writer, self._sink):
            try:
                if closable is not None:
                    closable.close()
            except Exception:  # already closed, or broken: the file goes anyway
                pass
        self.tmp.unlink(missing_ok=True)


class ReplayCache:
    """The cache of replays under ``root`` (``<cache dir>/replays``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.entries = root / "entries"
        self.records = root / "records"

    def get(self, key: str) -> CachedReplay | None:
        """The cached replay of ``key``, or None (never stored, unreadable, or its records pruned)."""
        try:
            data = json.loads((self.entries / f"{key}.json").read_text())
            log = self.records / f"{data['records']}.arrow"
            if not log.is_file():
                return None
            os.utime(log)  # its last use, for pruning
            return CachedReplay(key, data["summary"], int(data["steps"]), data["records"], log)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def writer(self) -> RecordsWriter:
        """A writer of one replay's records (``put`` it once complete, or ``abort`` it)."""
        return RecordsWriter(self.records)

    def put(self, key: str, writer: RecordsWriter, summary: dict[str, Any]) -> CachedReplay:
        """File a complete replay: its records and its entry."""
        records, log = writer.finish()
        self.entries.mkdir(parents=True, exist_ok=True)
        entry = {"records": records, "steps": writer.steps, "summary": summary, "stored": time.time()}
        with replacing(self.entries / f"{key}.json") as tmp:
            tmp.write_text(json.dumps(entry))
        return CachedReplay(key, summary, writer.steps, records, log)

    def prune(self, keep_bytes: int = KEEP_BYTES, grace_s: float = PRUNE_GRACE_S) -> None:
        """Remove the least recently used records beyond ``keep_bytes`` (not those used
        within ``grace_s``: a run may be about to read them)."""
        if not self.records.is_dir():
            return
        now = time.time()
        for path, stat in _by_last_use(self.records.glob(".*.tmp")):  # left by a run that was killed
            if now - stat.st_mtime > grace_s:
                path.unlink(missing_ok=True)
        files = _by_last_use(self.records.glob("*.arrow"))
        total = 0
        for path, stat in files:
            total += stat.st_size
            if total > keep_bytes and now - stat.st_mtime > grace_s:
                path.unlink(missing_ok=True)


def _by_last_use(paths: Iterable[Path]) -> list[tuple[Path, os.stat_result]]:
    out = []
    for path in paths:
        try:
            out.append((path, path.stat()))
        except OSError:
            continue
    return sorted(out, key=lambda item: item[1].st_mtime, reverse=True)
