"""Importers of public request-level LLM serving workloads.

Each reader streams one :class:`WorkloadRequest` per request, in arrival order,
and checks the file as it goes: the first bad row or column raises ONE
:class:`WorkloadFileError` naming the file, the line and what was expected.
(``traces`` may not import ``kvtrace``; the CLI turns the error into
``kvtrace.errors.WorkloadError``.)

Formats
-------
``mooncake``  JSON Lines (kvcache-ai/Mooncake traces): ``timestamp`` (ms),
              ``input_length``, ``output_length``, ``hash_ids`` (ids of the prompt's
              512-token blocks, ``len(hash_ids) == ceil(input_length / 512)``; the last
              block is usually partial). Equal leading ids share a prefix, so the ids
              become content-addressed prompt blocks. Optional SGLang request fields
              ``extra_key``, ``lora_id``, ``cache_salt`` put a request in a cache
              namespace (``traces.namespaces.sglang_namespace``). An optional
              ``session_id`` (string or integer) names the conversation a request is
              a turn of (SGLang's streaming session; ``kvtrace record --sessions``).
``azure``     CSV (Azure/AzurePublicDataset LLM inference traces): ``TIMESTAMP``
              (wall-clock ``YYYY-MM-DD HH:MM:SS.fffffff``, any number of fractional
              digits, optional UTC offset), ``ContextTokens``, ``GeneratedTokens``.
              No prefix information: prompts are unrelated.
``lengths``   CSV of length pairs (ShareGPT / arXiv statistics of etalon, vidur,
              sarathi-serve): ``num_prefill_tokens``, ``num_decode_tokens``. No
              timestamps: arrivals come from a seeded Poisson process at ``rate``.

``trace``     a kvtrace trace: the requests it served, with their arrivals and
              content (``traces.trace_workload``), scheduled anew.

Arrival times are seconds since the first request (the first arrives at 0; a
trace's keep its own clock). Files compressed with gzip or zstd are read as they
are (recognised by their first bytes, whatever their name). A binary file that
is not a trace, or a trace given with another format, is refused with one line
saying what it is.

One concept, read top to bottom: reading a workload file, from opening it (standard
input, compression, what a binary file is) through each format's rows to the window
of requests asked for. How much its blocks repeat is ``traces.block_reuse``'s; where a
known file comes from, ``traces.workload_sources``'.
"""

from __future__ import annotations

import codecs
import csv
import gzip
import io
import json
import math
import os
import re
import shutil
import stat
import sys
import tempfile
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import numpy as np

from traces.namespaces import check_name, sglang_namespace
from traces.workload_request import WorkloadRequest

__all__ = [
    "MOONCAKE_BLOCK_SIZE",
    "STDIN",
    "WORKLOAD_FORMATS",
    "WorkloadFileError",
    "WorkloadFormat",
    "WorkloadRequest",
    "guess_format",
    "parse_duration",
    "read_azure",
    "read_lengths",
    "read_mooncake",
    "read_workload",
    "rereadable",
    "within",
]

MOONCAKE_BLOCK_SIZE = 512
STDIN = "-"  # the workload path that means standard input
WorkloadFormat = Literal["mooncake", "azure", "lengths", "trace"]
WORKLOAD_FORMATS: tuple[str, ...] = ("mooncake", "azure", "lengths", "trace")

_MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_LENGTHS_COLUMNS = ("num_prefill_tokens", "num_decode_tokens")


class WorkloadFileError(ValueError):
    """A workload file has a bad row or column. ``str()`` is one line: ``path:line: message``."""

    def __init__(self, path: str | Path, line: int | None, message: str) -> None:
        self.path = str(path)
        self.line = line
        self.message = message
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {message}")


# --------------------------------------------------------------------------- helpers


def _int_field(path: Path, line: int, name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise WorkloadFileError(path, line, f"{name} must be an integer, found {value!r}")
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise WorkloadFileError(path, line, f"{name} must be an integer, found {value!r}") from None
    elif isinstance(value, float):
        if not value.is_integer():
            raise WorkloadFileError(path, line, f"{name} must be an integer, found {value!r}")
        value = int(value)
    if value < minimum:
        raise WorkloadFileError(path, line, f"{name} must be >= {minimum}, found {value}")
    return value


def _number_field(path: Path, line: int, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise WorkloadFileError(path, line, f"{name} must be a number, found {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise WorkloadFileError(path, line, f"{name} must be a finite number >= 0, found {value!r}")
    return value


_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_ARROW_MAGICS = (b"ARROW1", b"\xff\xff\xff\xff")  # an Arrow IPC file, an Arrow IPC stream
_SNIFF_BYTES = 1 << 16
_WORKLOAD_KINDS = "Mooncake JSON Lines, an Azure CSV or a lengths CSV (plain, gzip or zstd)"


class _TextLines:
    """The lines of a workload file; decoding and decompression errors become one
    ``WorkloadFileError`` naming the line."""

    def __init__(self, path: Path, stream: io.TextIOBase) -> None:
        self.path = path
        self._stream = stream
        self.line = 0

    def __enter__(self) -> _TextLines:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stream.close()

    def __iter__(self) -> _TextLines:
        return self

    def __next__(self) -> str:
        try:
            text = next(self._stream)
        except UnicodeDecodeError:
            raise WorkloadFileError(
                self.path, self.line + 1, f"is not UTF-8 text here (binary data?); expected {_WORKLOAD_KINDS}"
            ) from None
        except (EOFError, OSError, zlib.error) as exc:
            raise WorkloadFileError(
                self.path, self.line + 1, f"cannot be decompressed ({exc}); the file is damaged or cut short"
            ) from None
        self.line += 1
        return text


def _what_binary(head: bytes) -> str | None:
    """What ``head`` (a file's first bytes) says the file is, when it is not text."""
    if head.startswith(_ARROW_MAGICS):
        return (
            "is an Arrow IPC file (a kvtrace trace or state log), not a workload of this format; "
            "give --format trace (or no --format) to schedule a trace's requests anew"
        )
    if b"\x00" in head:
        return f"is a binary file, not a workload; expected {_WORKLOAD_KINDS}"
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return f"is not UTF-8 text (a binary file?); expected {_WORKLOAD_KINDS}"
    return None


def _decompressed(path: Path, codec: str) -> Any:
    """A binary stream of ``path`` decompressed with ``codec`` (gzip, zstd)."""
    if codec == "gzip":
        return gzip.open(path, "rb")
    import pyarrow as pa  # zstd: pyarrow's codec (the standard library has none before 3.14)

    return pa.input_stream(str(path), compression="zstd")


def _open_text(path: Path) -> _TextLines:
    """Open a workload file as text lines, decompressing gzip and zstd.

    Raises:
        WorkloadFileError: missing, a directory, unreadable, a trace or another binary
            file (compressed or not).
    """
    try:
        with path.open("rb") as raw:
            head = raw.read(_SNIFF_BYTES)
        codec = "gzip" if head.startswith(_GZIP_MAGIC) else "zstd" if head.startswith(_ZSTD_MAGIC) else None
        if codec is not None:
            try:
                with _decompressed(path, codec) as binary:
                    head = binary.read(_SNIFF_BYTES)
            except (EOFError, OSError, zlib.error) as exc:
                raise WorkloadFileError(
                    path, None, f"is {codec}-compressed but cannot be decompressed ({exc}); the file is damaged"
                ) from None
        what = _what_binary(head)
        if what is not None:
            prefix = f"is {codec}-compressed and " if codec else ""
            raise WorkloadFileError(path, None, prefix + (what.removeprefix("is ") if codec else what))
        if codec is None:
            stream = path.open("r", encoding="utf-8", newline="")
        else:
            stream = io.TextIOWrapper(_decompressed(path, codec), encoding="utf-8", newline="")
    except FileNotFoundError:
        raise WorkloadFileError(path, None, "no such file; give the path of a workload file") from None
    except IsADirectoryError:
        raise WorkloadFileError(path, None, "is a directory, expected a workload file") from None
    except PermissionError as exc:
        raise WorkloadFileError(path, None, f"cannot be read ({exc.strerror})") from None
    return _TextLines(path, stream)


@contextmanager
def rereadable(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A path to the workload that may be opened as often as needed.

    Recording opens its workload several times (its format from the first bytes, a
    checking pass, the recording pass), which only a regular file allows: a FIFO
    reopened waits for a new writer, and a pipe (``/dev/fd/N``, a shell's
    ``<(...)``) reopened has had its data consumed. So a regular file is yielded as
    it is, and any other stream (``-`` for stdin, a FIFO, ``/dev/fd/N``) is opened
    once and copied, as read, into a temporary file named after it (``stdin`` for
    ``-``), removed when the ``with`` block ends.

    Raises:
        WorkloadFileError: missing, a directory or unreadable.
    """
    given = os.fspath(path)
    if given != STDIN:
        try:
            if stat.S_ISREG(os.stat(given).st_mode):
                yield Path(given)
                return
        except FileNotFoundError:
            raise WorkloadFileError(given, None, "no such file; give the path of a workload file") from None
        except OSError as exc:
            raise WorkloadFileError(given, None, f"cannot be read ({exc.strerror})") from None
        if os.path.isdir(given):
            raise WorkloadFileError(given, None, "is a directory, expected a workload file")
    with tempfile.TemporaryDirectory(prefix="kvtrace-workload-") as tmp:
        copy = Path(tmp) / ("stdin" if given == STDIN else Path(given).name or "workload")
        try:
            if given == STDIN:
                with copy.open("wb") as dst:
                    shutil.copyfileobj(sys.stdin.buffer, dst, 1 << 20)
            else:
                with open(given, "rb") as src, copy.open("wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
        except OSError as exc:
            raise WorkloadFileError(given, None, f"cannot be copied to a temporary file ({exc.strerror or exc})") from None
        yield copy


def _unsorted(path: Path, line: int, what: str, found: str, previous: str, previous_line: int) -> WorkloadFileError:
    return WorkloadFileError(
        path,
        line,
        f"{what} {found} is earlier than {previous} on line {previous_line}; "
        "requests must be sorted by arrival time",
    )


# --------------------------------------------------------------------------- Mooncake


def read_mooncake(path: str | Path, *, block_size: int = MOONCAKE_BLOCK_SIZE) -> Iterator[WorkloadRequest]:
    """Stream a Mooncake JSON Lines trace.

    Args:
        path: the ``.jsonl`` file (one JSON object per line; blank lines are skipped).
        block_size: tokens per ``hash_ids`` block (Mooncake publishes 512).

    Yields:
        One request per line; ``block_hashes`` are the ``hash_ids`` as uint64.

    Raises:
        WorkloadFileError: invalid JSON, a missing or non-numeric field, a length out
            of range, a timestamp earlier than the previous one, or a ``hash_ids``
            list whose length is not ``ceil(input_length / block_size)``.
    """
    path = Path(path)
    t0: float | None = None
    prev_ts = 0.0
    prev_line = 0
    with _open_text(path) as fh:
        for line_no, text in enumerate(fh, start=1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as exc:
                hint = " (is this file a Mooncake JSON Lines trace?)" if line_no == 1 else ""
                raise WorkloadFileError(
                    path,
                    line_no,
                    f"invalid JSON ({exc.msg} at column {exc.colno}); each line must be one JSON object{hint}",
                ) from None
            if not isinstance(row, dict):
                raise WorkloadFileError(
                    path, line_no, f"expected a JSON object, found {type(row).__name__}"
                )
            for name in _MOONCAKE_FIELDS:
                if name not in row:
                    raise WorkloadFileError(
                        path,
                        line_no,
                        f"missing field {name!r} (a Mooncake trace line has "
                        f"{', '.join(_MOONCAKE_FIELDS)}; found {', '.join(map(str, row)) or 'none'})",
                    )
            ts = _number_field(path, line_no, "timestamp", row["timestamp"])
            input_len = _int_field(path, line_no, "input_length", row["input_length"], 1)
            output_len = _int_field(path, line_no, "output_length", row["output_length"], 0)
            hash_ids = row["hash_ids"]
            if not isinstance(hash_ids, list):
                raise WorkloadFileError(
                    path, line_no, f"hash_ids must be a list of integers, found {type(hash_ids).__name__}"
                )
            need = -(-input_len // block_size)
            if len(hash_ids) != need:
                raise WorkloadFileError(
                    path,
                    line_no,
                    f"hash_ids has {len(hash_ids)} entries but input_length {input_len} needs "
                    f"ceil({input_len}/{block_size}) = {need} blocks of {block_size} tokens",
                )
            for h in hash_ids:
                if type(h) is not int or h < 0:
                    raise WorkloadFileError(
                        path, line_no, f"hash_ids must hold non-negative integers, found {h!r}"
                    )
            try:
                hashes = np.array(hash_ids, dtype=np.uint64)
            except OverflowError:
                raise WorkloadFileError(path, line_no, "hash_ids hold an integer wider than 64 bits") from None
            if t0 is None:
                t0 = ts
            elif ts < prev_ts:
                raise _unsorted(path, line_no, "timestamp", f"{ts:g} ms", f"{prev_ts:g} ms", prev_line)
            prev_ts, prev_line = ts, line_no
            yield WorkloadRequest(
                arrival_s=(ts - t0) / 1000.0,
                input_len=input_len,
                output_len=output_len,
                block_hashes=hashes,
                block_size=block_size,
                line=line_no,
                namespace=_namespace_fields(path, line_no, row),
                session_id=_session_field(path, line_no, row),
            )


def _session_field(path: Path, line: int, row: dict[str, Any]) -> str | None:
    """The optional ``session_id`` of a line (a string or an integer; null: none)."""
    value = row.get("session_id")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise WorkloadFileError(path, line, f"session_id must be a string, an integer or null, found {value!r:.40}")
    text = str(value)
    if not text or len(text) > 256:
        raise WorkloadFileError(path, line, f"session_id must hold 1 to 256 characters, found {len(text)}")
    return text


def _namespace_fields(path: Path, line: int, row: dict[str, Any]) -> str | None:
    """The request's cache namespace from the optional SGLang request fields
    ``extra_key``, ``lora_id`` and ``cache_salt`` (strings or null), when a line has any."""
    if not (_NAMESPACE_FIELDS & row.keys()):
        return None
    for name in _NAMESPACE_FIELDS & row.keys():
        if row[name] is not None and not isinstance(row[name], str):
            raise WorkloadFileError(path, line, f"{name} must be a string or null, found {row[name]!r:.40}")
    name = sglang_namespace(row.get("extra_key"), row.get("lora_id"), row.get("cache_salt"))
    if name is not None:
        try:
            check_name(name, "the request's namespace (extra_key, lora_id, cache_salt)")
        except ValueError as exc:
            raise WorkloadFileError(path, line, str(exc)) from None
    return name


_NAMESPACE_FIELDS = frozenset({"extra_key", "lora_id", "cache_salt"})


# --------------------------------------------------------------------------- CSV formats


def _csv_rows(path: Path, fh: Any, required: tuple[str, ...], kind: str) -> Iterator[tuple[int, dict[str, str]]]:
    """Yield ``(line, {column: field})`` for each data row after checking the header."""
    reader = csv.reader(fh)
    try:
        header = next(reader)
    except StopIteration:
        raise WorkloadFileError(
            path, 1, f"empty file; expected a header with {', '.join(required)} ({kind})"
        ) from None
    except csv.Error as exc:
        raise WorkloadFileError(path, reader.line_num, f"not valid CSV ({exc})") from None
    header = [h.strip().lstrip("\ufeff") for h in header]
    for name in required:
        if name not in header:
            raise WorkloadFileError(
                path,
                1,
                f"missing column {name!r} (found {', '.join(header) or 'none'}); "
                f"{kind} needs {', '.join(required)}",
            )
    index = {name: header.index(name) for name in required}
    width = len(header)
    while True:
        try:
            fields = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            raise WorkloadFileError(path, reader.line_num, f"not valid CSV ({exc})") from None
        if not fields or (len(fields) == 1 and not fields[0].strip()):
            continue
        if len(fields) != width:
            raise WorkloadFileError(
                path, reader.line_num, f"row has {len(fields)} fields, the header has {width}"
            )
        yield reader.line_num, {name: fields[i] for name, i in index.items()}


def _parse_timestamp(path: Path, line: int, text: str) -> datetime:
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise WorkloadFileError(
            path, line, f"TIMESTAMP {text!r} is not a 'YYYY-MM-DD HH:MM:SS.fffffff' time"
        ) from None
    if when.tzinfo is not None:
        when = when.astimezone(timezone.utc).replace(tzinfo=None)
    return when


def read_azure(path: str | Path) -> Iterator[WorkloadRequest]:
    """Stream an Azure LLM inference trace (CSV).

    Args:
        path: the CSV file with columns ``TIMESTAMP``, ``ContextTokens``,
            ``GeneratedTokens`` (any order, extra columns ignored).

    Yields:
        One request per row, without prefix information.

    Raises:
        WorkloadFileError: a missing column, a bad timestamp or number, a length out
            of range, or a timestamp earlier than the previous row's.
    """
    path = Path(path)
    t0: datetime | None = None
    prev: datetime | None = None
    prev_line = 0
    with _open_text(path) as fh:
        for line_no, row in _csv_rows(path, fh, _AZURE_COLUMNS, "an Azure LLM inference trace"):
            when = _parse_timestamp(path, line_no, row["TIMESTAMP"])
            input_len = _int_field(path, line_no, "ContextTokens", row["ContextTokens"], 1)
            output_len = _int_field(path, line_no, "GeneratedTokens", row["GeneratedTokens"], 0)
            if t0 is None:
                t0 = when
            elif prev is not None and when < prev:
                raise _unsorted(path, line_no, "TIMESTAMP", str(when), str(prev), prev_line)
            prev, prev_line = when, line_no
            yield WorkloadRequest(
                arrival_s=(when - t0).total_seconds(),
                input_len=input_len,
                output_len=output_len,
                line=line_no,
            )


def read_lengths(path: str | Path, *, rate: float, seed: int = 0) -> Iterator[WorkloadRequest]:
    """Stream a length-distribution CSV with seeded Poisson arrivals.

    Args:
        path: CSV with ``num_prefill_tokens`` and ``num_decode_tokens`` columns.
        rate: mean arrival rate, requests per second (> 0). Inter-arrival gaps are
            exponential with mean ``1 / rate``; the first request arrives at 0.
        seed: seed of the arrival process (same seed, same arrivals).

    Yields:
        One request per row, in file order, without prefix information.

    Raises:
        WorkloadFileError: a missing column, a non-numeric field or a length out of range.
        ValueError: ``rate`` is not a positive finite number.
    """
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a positive number of requests per second, found {rate!r}")
    path = Path(path)
    rng = np.random.default_rng(seed)
    gaps = np.empty(0)
    used = 0
    clock = 0.0
    first = True
    with _open_text(path) as fh:
        for line_no, row in _csv_rows(path, fh, _LENGTHS_COLUMNS, "a length-distribution CSV"):
            input_len = _int_field(path, line_no, "num_prefill_tokens", row["num_prefill_tokens"], 1)
            output_len = _int_field(path, line_no, "num_decode_tokens", row["num_decode_tokens"], 0)
            if first:
                first = False
            else:
                # Gaps are drawn in fixed blocks so the sequence depends only on the seed.
                if used == gaps.size:
                    gaps = rng.exponential(1.0 / rate, size=1024)
                    used = 0
                clock += float(gaps[used])
                used += 1
            yield WorkloadRequest(arrival_s=clock, input_len=input_len, output_len=output_len, line=line_no)


def guess_format(path: str | Path) -> WorkloadFormat | None:
    """The format of a workload file from its first bytes (an Arrow IPC trace), its name
    (``.jsonl``, ``.json``, compressed or not) or its CSV header; None when none says.

    Raises:
        WorkloadFileError: the file cannot be opened, or is a trace or another binary file.
    """
    path = Path(path)
    try:
        with path.open("rb") as raw:
            if raw.read(8).startswith(_ARROW_MAGICS):
                return "trace"
    except OSError:
        pass  # _open_text below says what is wrong with it
    suffixes = [x.lower() for x in path.suffixes]
    if suffixes and suffixes[-1] in (".gz", ".zst", ".zstd"):
        suffixes = suffixes[:-1]
    if suffixes and suffixes[-1] in (".jsonl", ".json"):
        return "mooncake"
    with _open_text(path) as lines:
        header = next(lines, "")
    if "TIMESTAMP" in header and "ContextTokens" in header:
        return "azure"
    if "num_prefill_tokens" in header:
        return "lengths"
    if header.lstrip().startswith("{"):
        return "mooncake"
    return None


def read_workload(
    path: str | Path,
    fmt: WorkloadFormat,
    *,
    rate: float | None = None,
    seed: int = 0,
    duration_s: float | None = None,
    time_scale: float = 1.0,
) -> Iterator[WorkloadRequest]:
    """Stream any supported workload, cut at ``duration_s`` of arrivals when given.

    Args:
        path, fmt: the file and its format.
        rate, seed: the arrival process of the ``lengths`` format.
        duration_s: keep the requests arriving in the first ``duration_s`` seconds
            of the source.
        time_scale: multiply arrival times by this (2.0: half the request rate, the
            same traffic between two turns of a conversation).

    Raises:
        ValueError: unknown format, ``rate`` missing for ``lengths``, or a
            non-positive ``time_scale``.
        WorkloadFileError: see the per-format readers.
        TraceError: a ``trace`` that cannot be read or re-scheduled.
    """
    if not (math.isfinite(time_scale) and time_scale > 0):
        raise ValueError(f"time_scale must be a positive number, found {time_scale!r}")
    if fmt == "mooncake":
        requests: Iterator[WorkloadRequest] = read_mooncake(path)
    elif fmt == "azure":
        requests = read_azure(path)
    elif fmt == "lengths":
        if rate is None:
            raise ValueError("the lengths format needs an arrival rate (requests per second)")
        requests = read_lengths(path, rate=rate, seed=seed)
    elif fmt == "trace":
        from traces.trace_workload import read_trace_workload

        requests = iter(read_trace_workload(path).requests)
    else:
        raise ValueError(f"unknown workload format {fmt!r}; expected one of {', '.join(WORKLOAD_FORMATS)}")
    if duration_s is not None:
        requests = within(requests, duration_s)
    if time_scale != 1.0:
        requests = _scaled(requests, time_scale)
    return requests


def _scaled(requests: Iterable[WorkloadRequest], factor: float) -> Iterator[WorkloadRequest]:
    for req in requests:
        yield WorkloadRequest(req.arrival_s * factor, req.input_len, req.output_len, req.block_hashes, req.block_size, req.line)


def within(requests: Iterable[WorkloadRequest], duration_s: float) -> Iterator[WorkloadRequest]:
    """The requests arriving before ``duration_s``; stops reading at the first later one."""
    for req in requests:
        if req.arrival_s >= duration_s:
            return
        yield req


_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|s|m|h)?")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(text: str) -> float:
    """Seconds in a duration such as ``90s``, ``10m``, ``1h``, ``1h30m``, ``2.5m`` or ``45``.

    Raises:
        ValueError: the text is not a positive duration.
    """
    compact = text.strip().lower().replace(" ", "")
    pos = 0
    total = 0.0
    parts = 0
    while pos < len(compact):
        m = _DURATION_PART.match(compact, pos)
        if m is None or (m.group(2) is None and m.end() != len(compact)):
            raise ValueError(f"{text!r} is not a duration; use e.g. 90s, 10m, 1h or 1h30m")
        total += float(m.group(1)) * _UNIT_S[m.group(2)]
        pos = m.end()
        parts += 1
    if parts == 0 or total <= 0:
        raise ValueError(f"{text!r} is not a positive duration; use e.g. 90s, 10m, 1h or 1h30m")
    return total
