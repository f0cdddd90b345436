"""THE kvtrace trace format, version 1: Arrow schema, op kinds, metadata.

A trace is one Arrow IPC file (extension ``.kvtrace``), compressed with zstd or
lz4, holding one record batch per scheduler step or per few steps (a batch always
holds whole steps). Long format: one row per (step, request op). While it is
recorded it is an IPC *stream*, flushed batch by batch (a killed recorder leaves
every completed batch readable); the compaction at the end of a recording rewrites
it as an IPC *file* (with a footer: random access by record batch, memory-mapping,
lazy scans). Readers accept both. ``traces/README.md`` documents the format for
readers without kvtrace.

Columns (``COLUMNS`` below is the single definition):

==============  ========================  =====================================================
column          type                      meaning
==============  ========================  =====================================================
step            int64                     scheduler step; non-decreasing; a step's rows contiguous
time_s          float64                   time of the step's start, seconds since trace start
op              dictionary<int8, utf8>    extend, decode, spec, prealloc, finish, retract, abort
rid             int64                     dense request id (>= 0), unique within the trace
seq_len         int64                     the request's sequence length after the op (see below)
append_len      int32                     tokens the op appends (0 for release ops)
draft_len       int32                     spec: draft tokens verified this step; else 0
accepted_len    int32                     spec: tokens accepted and committed (== append_len)
prefix_len      int64                     prefix the recording engine matched (informative)
prompt_len      int64 (nullable)          the request's prompt length, on its first row only
block_hashes    list<uint64> (nullable)   content-addressed prompt blocks, first row only
token_ids       list<int64> (nullable)    explicit ids of the positions this op appends
arrival_s       float64 (nullable)        the request's arrival, seconds since trace start,
                                          first row only (a row's ``time_s`` is its admission)
==============  ========================  =====================================================

Per op, ``seq_len`` and ``append_len`` mean (``L`` = the request's length before):

* ``extend``   prefill or one prefill chunk: positions ``[L, seq_len)``;
               ``append_len = seq_len - L``. ``L`` is 0 for a new request and for a
               request re-admitted after ``retract``.
* ``decode``   one token: ``seq_len = L + 1``, ``append_len = 1``.
* ``spec``     one speculative step: ``draft_len`` drafts verified, ``accepted_len``
               tokens committed; ``seq_len = L + accepted_len``.
* ``prealloc`` PD-disaggregated decode: the request arrives with ``seq_len`` tokens of
               KV from a prefill server (``L = 0``, ``append_len = seq_len``).
* ``finish``   release, the prefix is kept in the radix cache; ``seq_len`` = tokens whose
               KV the request owns at release (<= L; less when a stop landed early).
* ``retract``  release under memory pressure, nothing cached; ``seq_len = L``. The
               request may come back with an ``extend`` from 0.
* ``abort``    release, nothing cached, the request ends; ``seq_len = L``.

Within a step, rows are ordered by ``OP_ORDER`` (releases first, then allocations),
which is the order an SGLang-style scheduler applies them.

Token content (materialised by ``traces.tokens``): position ``p`` of request ``r``
is, in order of precedence, the explicit id given by the op that appended ``p``
(``token_ids``); for ``p < prompt_len`` with ``block_hashes``, a token derived from
block ``p // block_size`` and offset ``p % block_size`` (equal hashes = equal
content, so equal leading hashes share a prefix); otherwise a token unique to
``(r, p)``.

Metadata: JSON under the schema-metadata key ``kvtrace`` (``TraceMeta``), readable
without reading any data. ``TraceMeta.recording`` says how the trace was made and
whether its recording completed (see ``Recording``); a stream's final status is in
the custom metadata (key ``kvtrace.recording``) of its last, empty record batch.

Bounds (a trace is untrusted input: every value is checked against these before
it sizes an array, indexes a table or drives an allocation):

* ``rid`` lies in ``[0, min(rows of the trace, MAX_RID))``: ids are dense, so a
  trace of ``R`` rows names at most ``R`` requests. Per-request state costs about
  80 bytes per id up to the largest id (the checker, the replay, the token store
  and the allocator each keep a few numpy columns indexed by id), so the bound
  keeps it proportional to the trace and below 1.3 GiB at the hard cap of
  ``MAX_RID`` = 2**24 requests.
* ``step`` lies in ``[0, MAX_STEP)`` (2**53: exact in JSON and float64) and never
  decreases.
* ``seq_len`` and ``prompt_len`` are at most ``config.max_context_len``;
  ``prefix_len`` lies in ``[0, seq_len]`` on ``extend`` and ``prealloc`` rows and is
  0 on the others; ``draft_len`` and ``accepted_len`` are 0 except on ``spec``
  rows, where ``draft_len <= config.spec.num_draft_tokens``.
* Metadata: ``config.pool_tokens`` and ``config.max_context_len`` below 2**31
  (slot indices and positions are int32, as in SGLang's ``req_to_token``);
  ``config.max_running`` and ``config.page_size`` likewise; ``block_size`` at most
  ``MAX_BLOCK_SIZE``; speculative settings at most ``MAX_SPEC_TOKENS``; model
  dimensions at most ``MAX_MODEL_DIM``. Whether a pool of that size fits the
  machine is decided before it is built (``kvtrace.replay.config.check_memory``).
* A record batch decompresses to at most ``traces.ipc.MAX_BATCH_BYTES`` (1 GiB).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from typing import Any, Literal, NamedTuple, Sequence

import numpy as np
import pyarrow as pa

SCHEMA_VERSION = 1
METADATA_KEY = b"kvtrace"
FILE_SUFFIX = ".kvtrace"

# Bounds of the values a trace may hold (see the module docstring).
MAX_RID = 1 << 24  # requests per trace
MAX_STEP = 1 << 53  # steps are exact in JSON and float64 below this
MAX_TOKENS = (1 << 31) - 1  # pool slots, positions and rows are int32
MAX_BLOCK_SIZE = 1 << 20  # tokens per content-addressed block
MAX_SPEC_TOKENS = 1024  # speculative steps, top-k and draft tokens
MAX_MODEL_DIM = 1 << 20  # layers, KV heads, head dim

# Op kinds; the dictionary index of each is its code in the ``op`` column.
OPS: tuple[str, ...] = ("extend", "decode", "spec", "prealloc", "finish", "retract", "abort")
OP_CODE: dict[str, int] = {name: code for code, name in enumerate(OPS)}
EXTEND, DECODE, SPEC, PREALLOC, FINISH, RETRACT, ABORT = range(len(OPS))
RELEASE_OPS = frozenset({FINISH, RETRACT, ABORT})
ALLOC_OPS = frozenset({EXTEND, DECODE, SPEC, PREALLOC})
# The order a scheduler applies a step's ops in: releases, then the new KV.
OP_ORDER: tuple[int, ...] = (FINISH, ABORT, RETRACT, PREALLOC, EXTEND, DECODE, SPEC)
OP_RANK: tuple[int, ...] = tuple(OP_ORDER.index(code) for code in range(len(OPS)))

OpName = Literal["extend", "decode", "spec", "prealloc", "finish", "retract", "abort"]

OP_TYPE = pa.dictionary(pa.int8(), pa.utf8())


@dataclass(frozen=True, slots=True)
class Column:
    """One column of the trace: name, Arrow type, whether it may be absent."""

    name: str
    type: pa.DataType
    required: bool
    nullable: bool = False
    doc: str = ""


COLUMNS: tuple[Column, ...] = (
    Column("step", pa.int64(), True, doc="scheduler step"),
    Column("time_s", pa.float64(), True, doc="step start, seconds since trace start"),
    Column("op", OP_TYPE, True, doc="op kind"),
    Column("rid", pa.int64(), True, doc="dense request id"),
    Column("seq_len", pa.int64(), True, doc="sequence length after the op"),
    Column("append_len", pa.int32(), True, doc="tokens appended by the op"),
    Column("draft_len", pa.int32(), False, doc="spec: draft tokens verified"),
    Column("accepted_len", pa.int32(), False, doc="spec: tokens accepted"),
    Column("prefix_len", pa.int64(), False, doc="prefix matched by the recording engine"),
    Column("prompt_len", pa.int64(), False, nullable=True, doc="prompt length, first row only"),
    Column("block_hashes", pa.list_(pa.uint64()), False, nullable=True, doc="prompt blocks"),
    Column("token_ids", pa.list_(pa.int64()), False, nullable=True, doc="explicit token ids"),
    Column("arrival_s", pa.float64(), False, nullable=True, doc="request arrival time, first row only"),
)
COLUMN_BY_NAME: dict[str, Column] = {c.name: c for c in COLUMNS}
REQUIRED_COLUMNS: tuple[str, ...] = tuple(c.name for c in COLUMNS if c.required)

SpecAlgorithm = Literal["eagle", "eagle3", "standalone", "dflash"]


@dataclass(frozen=True, slots=True)
class SpecSettings:
    """Speculative-decoding settings of the recorded engine (EAGLE-style).

    ``num_steps`` draft steps of ``topk`` candidates; ``num_draft_tokens`` tokens
    verified per step. The allocator derives its per-request reserve from these.
    """

    algorithm: SpecAlgorithm = "eagle"
    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int = 4


@dataclass(frozen=True, slots=True)
class TraceConfig:
    """The serving configuration the trace was recorded under (replay may override some)."""

    page_size: int
    pool_tokens: int
    max_running: int
    max_context_len: int
    chunk_size: int | None = None
    schedule_policy: str = "fcfs"
    spec: SpecSettings | None = None
    pd_decode: bool = False
    hisparse: bool = False
    radix_cache: bool = True  # the engine kept a radix prefix cache


# Bytes per element of each KV-cache dtype a trace may name (``model.dtype``).
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "float8_e4m3fn": 1}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """Model shape; ``bytes_per_token`` = 2 * layers * kv_heads * head_dim * dtype bytes (MHA)."""

    name: str = "unknown"
    num_layers: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES.get(self.dtype, 2)


@dataclass(frozen=True, slots=True)
class TraceSource:
    """Where the trace comes from: engine, workload, and the data's licence and citation."""

    engine: str = "unknown"
    workload: str = "unknown"
    repository: str | None = None
    path: str | None = None
    license: str | None = None
    citation: str | None = None


RecordingStatus = Literal["recording", "complete", "interrupted"]
RECORDING_STATUSES: tuple[str, ...] = ("recording", "complete", "interrupted")


def timestamp() -> str:
    """Now in UTC, ISO 8601 to the second (``2025-06-01T12:00:00Z``).

    ``SOURCE_DATE_EPOCH`` (the reproducible-builds convention), when set, is used
    instead of the clock, so a regenerated file can match byte for byte.
    """
    fixed = os.environ.get("SOURCE_DATE_EPOCH")
    when = datetime.fromtimestamp(int(fixed), timezone.utc) if fixed else datetime.now(timezone.utc)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True, slots=True)
class Recording:
    """How a trace was made and whether its recording completed.

    The writer stores ``status="recording"`` when the recording starts and the final
    status when it closes: ``"complete"``, or ``"interrupted"`` with ``detail`` saying
    why (Ctrl-C, a signal, an error). A trace whose writer never closed (a killed
    process) still says ``"recording"`` and reads as interrupted
    (``TraceReader.recording`` after a full iteration).

    Attributes:
        status: ``recording``, ``complete`` or ``interrupted``.
        detail: why an interrupted recording stopped (None otherwise).
        kvtrace_version: the kvtrace that wrote the trace.
        command: the command line that made it, shell-quoted (None from a library call).
        finished_at: when the writer closed (UTC, ISO 8601).
        steps: steps written when the writer closed.
    """

    status: RecordingStatus = "recording"
    detail: str | None = None
    kvtrace_version: str | None = None
    command: str | None = None
    finished_at: str | None = None
    steps: int | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Any) -> Recording:
        """Build from parsed JSON. Raises ``ValueError`` naming the bad key."""
        if not isinstance(data, dict):
            raise ValueError("'recording' is not a JSON object")
        status = data.get("status")
        if status not in RECORDING_STATUSES:
            raise ValueError(f"'recording.status' must be one of {', '.join(RECORDING_STATUSES)}, found {status!r}")
        for key in ("detail", "kvtrace_version", "command", "finished_at"):
            value = data.get(key)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"'recording.{key}' must be a string, found {_found(value)}")
        steps = data.get("steps")
        if steps is not None and not (_is_int(steps) and 0 <= steps < MAX_STEP):
            raise ValueError(f"'recording.steps' must be an integer in [0, 2**53), found {_found(steps)}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ValueError(f"'recording' has an unexpected key: {exc}") from None

    @property
    def interrupted(self) -> bool:
        """The recording did not complete (or, read before its end, has not yet)."""
        return self.status != "complete"


@dataclass(frozen=True, slots=True)
class TraceMeta:
    """Everything in the schema metadata. ``to_json``/``from_json`` are the wire format."""

    config: TraceConfig
    source: TraceSource = field(default_factory=TraceSource)
    model: ModelShape = field(default_factory=ModelShape)
    block_size: int | None = None
    format_version: int = SCHEMA_VERSION
    created_at: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    recording: Recording | None = None  # None: not recorded (a library write, or an older trace)

    def with_config(self, **changes: Any) -> TraceMeta:
        return replace(self, config=replace(self.config, **changes))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["model"]["bytes_per_token"] = self.model.bytes_per_token
        if self.recording is None:
            del out["recording"]  # what traces written without it have always held
        return out

    def to_json(self) -> str:
        """Strict JSON (a NaN or infinite number in ``extra`` is a ValueError): what readers accept."""
        return json.dumps(self.to_dict(), sort_keys=True, allow_nan=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TraceMeta:
        """Build from parsed JSON, checking every field's type and bounds.

        Raises:
            ValueError: naming the missing or bad key, what it must be and what was found.
        """
        if not isinstance(data, dict):
            raise ValueError("metadata is not a JSON object")
        version = data.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError("metadata has no integer 'format_version'")
        cfg = data.get("config")
        if not isinstance(cfg, dict):
            raise ValueError("metadata has no 'config' object")
        for key in ("page_size", "pool_tokens", "max_running", "max_context_len"):
            if not _is_int(cfg.get(key)):
                raise ValueError(f"metadata 'config.{key}' is missing or not an integer")
            if cfg[key] <= 0:
                raise ValueError(f"metadata 'config.{key}' must be positive, found {cfg[key]}")
            _int_in(cfg, key, "config.", 1, MAX_TOKENS)
        spec = _optional_object(cfg, "spec", "config.")
        config = TraceConfig(
            page_size=cfg["page_size"],
            pool_tokens=cfg["pool_tokens"],
            max_running=cfg["max_running"],
            max_context_len=cfg["max_context_len"],
            chunk_size=_int_in(cfg, "chunk_size", "config.", 1, MAX_TOKENS, None),
            schedule_policy=_str_of(cfg, "schedule_policy", "config.", "fcfs"),
            spec=None if spec is None else _spec_settings(spec),
            pd_decode=_bool_of(cfg, "pd_decode", "config.", False),
            hisparse=_bool_of(cfg, "hisparse", "config.", False),
            radix_cache=_bool_of(cfg, "radix_cache", "config.", True),
        )
        model = dict(_optional_object(data, "model", "") or {})
        model.pop("bytes_per_token", None)
        source = _optional_object(data, "source", "") or {}
        _known_keys(model, ModelShape, "model.")
        _known_keys(source, TraceSource, "source.")
        for key in ("num_layers", "num_kv_heads", "head_dim"):
            _int_in(model, key, "model.", 1, MAX_MODEL_DIM, None)
        for key in ("name", "dtype"):
            _str_of(model, key, "model.", None)
        if model.get("dtype") is not None and model["dtype"] not in DTYPE_BYTES:
            raise ValueError(
                f"metadata 'model.dtype' {model['dtype']!r} is not a known KV-cache dtype "
                f"(valid: {', '.join(DTYPE_BYTES)})"
            )
        model = {key: value for key, value in model.items() if value is not None}  # null: the default shape's
        for key in source:
            _str_of(source, key, "source.", None)
        recording = data.get("recording")
        return cls(
            config=config,
            source=TraceSource(**source),
            model=ModelShape(**model),
            block_size=_int_in(data, "block_size", "", 1, MAX_BLOCK_SIZE, None),
            format_version=version,
            created_at=_str_of(data, "created_at", "", None),
            extra=dict(_optional_object(data, "extra", "") or {}),
            recording=None if recording is None else Recording.from_dict(recording),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> TraceMeta:
        return cls.from_dict(parse_meta_json(text))


def parse_meta_json(text: str | bytes) -> Any:
    """JSON text as Python objects; bad UTF-8, bad JSON, absurd nesting or numbers are a ValueError."""
    try:
        return json.loads(text, parse_constant=_not_json)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, digit limits
        detail = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise ValueError(f"metadata is not valid JSON ({detail})") from None


def _not_json(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _found(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _int_in(obj: dict[str, Any], key: str, where: str, lo: int, hi: int, default: Any = ...) -> Any:
    """``obj[key]`` as an integer in ``[lo, hi]``; ``default`` when absent or null (``...``: required)."""
    value = obj.get(key)
    if value is None and default is not ...:
        return default
    if not _is_int(value) or not lo <= value <= hi:
        raise ValueError(f"metadata '{where}{key}' must be an integer in [{lo}, {hi}], found {_found(value)}")
    return value


def _bool_of(obj: dict[str, Any], key: str, where: str, default: bool) -> bool:
    value = obj.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"metadata '{where}{key}' must be true or false, found {_found(value)}")
    return value


def _str_of(obj: dict[str, Any], key: str, where: str, default: str | None) -> Any:
    value = obj.get(key, default)
    if value is None and default is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"metadata '{where}{key}' must be a string, found {_found(value)}")
    return value


def _optional_object(obj: dict[str, Any], key: str, where: str) -> dict[str, Any] | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"metadata '{where}{key}' must be an object or null, found {_found(value)}")
    return value


def _known_keys(obj: dict[str, Any], record: type, where: str) -> None:
    unknown = sorted(set(obj) - set(record.__dataclass_fields__))  # type: ignore[attr-defined]
    if unknown:
        raise ValueError(f"metadata has an unexpected key '{where}{unknown[0]}'")


def _spec_settings(spec: dict[str, Any]) -> SpecSettings:
    _known_keys(spec, SpecSettings, "config.spec.")
    algorithm = spec.get("algorithm", "eagle")
    valid = SpecAlgorithm.__args__  # type: ignore[attr-defined]
    if algorithm not in valid:
        raise ValueError(
            f"metadata 'config.spec.algorithm' must be one of {', '.join(valid)}, found {_found(algorithm)}"
        )
    defaults = SpecSettings()
    return SpecSettings(
        algorithm=algorithm,
        num_steps=_int_in(spec, "num_steps", "config.spec.", 1, MAX_SPEC_TOKENS, defaults.num_steps),
        topk=_int_in(spec, "topk", "config.spec.", 1, MAX_SPEC_TOKENS, defaults.topk),
        num_draft_tokens=_int_in(
            spec, "num_draft_tokens", "config.spec.", 1, MAX_SPEC_TOKENS, defaults.num_draft_tokens
        ),
    )


def arrow_schema(meta: TraceMeta) -> pa.Schema:
    """The full v1 schema with ``meta`` attached (writers always write every column)."""
    fields = [pa.field(c.name, c.type, nullable=c.nullable) for c in COLUMNS]
    return pa.schema(fields, metadata={METADATA_KEY: meta.to_json().encode()})



class Ragged(NamedTuple):
    """A list column as numpy: row ``i`` is ``values[offsets[i]:offsets[i+1]]`` where ``valid[i]``.

    A null row (``valid[i]`` False) has an empty slice. ``offsets[0] == 0`` and
    ``offsets[-1] == len(values)``: ``values`` is exactly the rows, concatenated.
    """

    offsets: np.ndarray  # int64 [n+1]
    values: np.ndarray  # [offsets[-1]] uint64 (block_hashes) or int64 (token_ids)
    valid: np.ndarray  # bool [n]

    @property
    def num_rows(self) -> int:
        return int(self.valid.shape[0])

    @property
    def lengths(self) -> np.ndarray:
        """int64 [n]: the length of each row (0 for a null row)."""
        return np.diff(self.offsets)

    def row(self, i: int) -> np.ndarray | None:
        if not self.valid[i]:
            return None
        return self.values[self.offsets[i] : self.offsets[i + 1]]

    def rows(self) -> list[np.ndarray | None]:
        """Every row as its own array (None for a null row); for tests and slow paths."""
        return [self.row(i) for i in range(self.num_rows)]

    @classmethod
    def empty(cls, n: int, dtype: np.dtype | type = np.int64) -> Ragged:
        return cls(np.zeros(n + 1, np.int64), np.zeros(0, dtype), np.zeros(n, np.bool_))

    @classmethod
    def from_rows(cls, rows: Sequence[Any], dtype: np.dtype | type) -> Ragged:
        """Build from one array-like (or None for a null row) per row.

        Raises:
            ValueError: a row is not one-dimensional.
        """
        n = len(rows)
        valid = np.fromiter((r is not None for r in rows), np.bool_, count=n)
        if not valid.any():
            return cls.empty(n, dtype)
        parts = [np.asarray(r, dtype=dtype) for r in rows if r is not None]
        for part in parts:
            if part.ndim != 1:
                raise ValueError(f"a list row must be one-dimensional, found shape {part.shape}")
        lengths = np.zeros(n, np.int64)
        lengths[valid] = [p.shape[0] for p in parts]
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return cls(offsets, np.concatenate(parts), valid)

    @classmethod
    def coerce(cls, data: Any, n: int, dtype: np.dtype | type, name: str = "list column") -> Ragged:
        """``data`` as a Ragged of ``n`` rows: None (all null), a Ragged, or one row per entry.

        Raises:
            ValueError: the row count is not ``n`` or the Ragged is malformed.
        """
        if data is None:
            return cls.empty(n, dtype)
        if isinstance(data, Ragged):
            offsets = np.asarray(data.offsets, np.int64)
            valid = np.asarray(data.valid, np.bool_)
            values = np.asarray(data.values, dtype)
            if valid.shape != (n,) or offsets.shape != (n + 1,):
                raise ValueError(f"{name}: Ragged has {valid.shape[0]} rows, expected {n}")
            if offsets[0] != 0 or offsets[-1] != values.shape[0] or np.any(np.diff(offsets) < 0):
                raise ValueError(f"{name}: Ragged offsets must rise from 0 to len(values)")
            if np.any(offsets[1:][~valid] != offsets[:-1][~valid]):
                raise ValueError(f"{name}: a null row of a Ragged must be empty")
            return cls(offsets, values, valid)
        if len(data) != n:
            raise ValueError(f"{name}: {len(data)} rows, expected {n}")
        return cls.from_rows(data, dtype)

    def take(self, indices: np.ndarray) -> Ragged:
        """The rows at ``indices`` (a permutation or subset), vectorised."""
        lengths = self.lengths[indices]
        offsets = np.zeros(lengths.shape[0] + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        total = int(offsets[-1])
        if total == 0:
            values = self.values[:0]
        else:
            # Position j of the output comes from starts[row(j)] + (j - offsets[row(j)]).
            shift = np.repeat(self.offsets[:-1][indices] - offsets[:-1], lengths)
            values = self.values[np.arange(total, dtype=np.int64) + shift]
        return Ragged(offsets, values, self.valid[indices])

    def slice(self, start: int, stop: int) -> Ragged:
        """Rows ``[start, stop)``; ``values`` is a view."""
        base = self.offsets[start]
        return Ragged(
            self.offsets[start : stop + 1] - base,
            self.values[base : self.offsets[stop]],
            self.valid[start:stop],
        )

    @classmethod
    def concat(cls, parts: Sequence[Ragged]) -> Ragged:
        """The rows of ``parts``, one after the other."""
        if len(parts) == 1:
            return parts[0]
        valid = np.concatenate([p.valid for p in parts])
        sizes = [p.values.shape[0] for p in parts]
        if not any(sizes):
            return cls(np.zeros(valid.shape[0] + 1, np.int64), parts[0].values, valid)
        offsets = np.empty(valid.shape[0] + 1, np.int64)
        offsets[0] = 0
        row, shift = 1, 0
        for part, size in zip(parts, sizes):
            rows = part.valid.shape[0]
            np.add(part.offsets[1:], shift, out=offsets[row : row + rows])
            row += rows
            shift += size
        return cls(offsets, np.concatenate([p.values for p, size in zip(parts, sizes) if size]), valid)

    def equals(self, other: Ragged) -> bool:
        """Same rows, same nulls, same values (dtype aside)."""
        return (
            np.array_equal(self.valid, other.valid)
            and np.array_equal(self.offsets, other.offsets)
            and np.array_equal(self.values, other.values)
        )


def _int_column(data: Any, n: int, dtype: type, name: str, default: int = 0) -> np.ndarray:
    if data is None:
        return np.full(n, default, dtype) if default else np.zeros(n, dtype)
    out = np.asarray(data)
    if out.ndim == 0:
        return np.full(n, out, dtype)
    if out.shape != (n,):
        raise ValueError(f"column '{name}' has shape {out.shape}, expected ({n},)")
    if out.dtype != dtype:
        if out.size == 0:
            return np.zeros(0, dtype)
        if out.dtype.kind not in "iub":
            raise ValueError(f"column '{name}' must hold integers, found dtype {out.dtype}")
        out = out.astype(dtype)
    return out


def op_codes(op: Any, n: int | None = None) -> np.ndarray:
    """``op`` as int8 op codes: codes (any integer array-like) or op names.

    Raises:
        ValueError: an unknown op name or code (the message lists the valid ones).
    """
    arr = np.asarray(op)
    if n is not None and arr.shape != (n,):
        raise ValueError(f"column 'op' has shape {arr.shape}, expected ({n},)")
    if arr.dtype.kind in "iu":
        codes = arr.astype(np.int8, copy=False)
        if codes.size and (int(arr.min()) < 0 or int(arr.max()) >= len(OPS)):
            raise ValueError(f"op codes must lie in [0, {len(OPS)}) (OPS = {OPS})")
        return codes
    if arr.size == 0:
        return np.zeros(0, np.int8)
    names, inverse = np.unique(arr.astype(str), return_inverse=True)
    unknown = [str(x) for x in names if x not in OP_CODE]
    if unknown:
        raise ValueError(f"unknown op {unknown[0]!r}; valid ops: {', '.join(OPS)}")
    lut = np.array([OP_CODE[str(x)] for x in names], np.int8)
    return lut[inverse.reshape(arr.shape)]


_OP_RANK_ARRAY = np.array(OP_RANK, np.int8)


@dataclass(frozen=True, slots=True)
class StepBatch:
    """The ops of one scheduler step, columnar (what ``TraceReader.steps()`` yields and
    ``TraceWriter.write(batch)`` takes). Rows are in ``OP_ORDER``.

    ``prompt_len`` is -1 where the column is null, ``arrival_s`` NaN (or the whole
    column None). Optional columns absent from a file read as zeros / nulls. Arrays
    a reader yields are read-only views.
    """

    step: int
    time_s: float
    op: np.ndarray  # int8 [n] op codes (index into OPS)
    rid: np.ndarray  # int64 [n]
    seq_len: np.ndarray  # int64 [n]
    append_len: np.ndarray  # int32 [n]
    draft_len: np.ndarray  # int32 [n]
    accepted_len: np.ndarray  # int32 [n]
    prefix_len: np.ndarray  # int64 [n]
    prompt_len: np.ndarray  # int64 [n], -1 = null
    block_hashes: Ragged  # uint64 values
    token_ids: Ragged  # int64 values
    arrival_s: np.ndarray | None = None  # float64 [n], NaN = null; None: no row has one

    def __len__(self) -> int:
        return int(self.op.shape[0])

    def rows_of(self, op_code: int) -> np.ndarray:
        """Indices of this step's rows with the given op code (in row order)."""
        return np.flatnonzero(self.op == op_code)

    @classmethod
    def from_columns(
        cls,
        step: int,
        time_s: float,
        *,
        op: Any,
        rid: Any,
        seq_len: Any,
        append_len: Any,
        draft_len: Any = None,
        accepted_len: Any = None,
        prefix_len: Any = None,
        prompt_len: Any = None,
        block_hashes: Any = None,
        token_ids: Any = None,
        arrival_s: Any = None,
        sort: bool = True,
    ) -> StepBatch:
        """Build a step from array-likes, one entry per row, and put its rows in ``OP_ORDER``.

        Args:
            step, time_s: the scheduler step and its start time (seconds).
            op: int8 op codes or op names.
            rid, seq_len, append_len: required columns.
            draft_len, accepted_len, prefix_len: optional (None: zeros; a scalar: every row).
            prompt_len: None (all null), or ints where a negative value or None is null.
            block_hashes, token_ids: None, a ``Ragged``, or one array-like or None per row.
            arrival_s: None (all null), or floats where NaN or None is null.
            sort: stable-sort the rows into ``OP_ORDER`` (off: keep the order given).

        Raises:
            ValueError: a column's length or type does not fit, or an unknown op.
        """
        rid_arr = np.asarray(rid)
        if rid_arr.ndim != 1:
            raise ValueError(f"column 'rid' must be one-dimensional, found shape {rid_arr.shape}")
        n = rid_arr.shape[0]
        rid_arr = _int_column(rid_arr, n, np.int64, "rid")
        if prompt_len is None:
            prompt = np.full(n, -1, np.int64)
        else:
            raw = np.asarray(prompt_len, dtype=object if _has_none(prompt_len) else None)
            if raw.dtype == object:
                raw = np.array([-1 if v is None else v for v in raw.reshape(-1)], np.int64)
            prompt = _int_column(raw, n, np.int64, "prompt_len")
            if np.any(prompt < -1):
                prompt = np.where(prompt < 0, -1, prompt)
        batch = cls(
            step=int(step),
            time_s=float(time_s),
            op=op_codes(op, n),
            rid=rid_arr,
            seq_len=_int_column(seq_len, n, np.int64, "seq_len"),
            append_len=_int_column(append_len, n, np.int32, "append_len"),
            draft_len=_int_column(draft_len, n, np.int32, "draft_len"),
            accepted_len=_int_column(accepted_len, n, np.int32, "accepted_len"),
            prefix_len=_int_column(prefix_len, n, np.int64, "prefix_len"),
            prompt_len=prompt,
            block_hashes=Ragged.coerce(block_hashes, n, np.uint64, "block_hashes"),
            token_ids=Ragged.coerce(token_ids, n, np.int64, "token_ids"),
            arrival_s=None if arrival_s is None else _float_column(arrival_s, n, "arrival_s"),
        )
        return batch.in_op_order() if sort else batch

    def take(self, indices: np.ndarray) -> StepBatch:
        """The rows at ``indices``, in that order."""
        return StepBatch(
            self.step,
            self.time_s,
            self.op[indices],
            self.rid[indices],
            self.seq_len[indices],
            self.append_len[indices],
            self.draft_len[indices],
            self.accepted_len[indices],
            self.prefix_len[indices],
            self.prompt_len[indices],
            self.block_hashes.take(indices),
            self.token_ids.take(indices),
            None if self.arrival_s is None else self.arrival_s[indices],
        )

    def is_op_ordered(self) -> bool:
        """Whether the rows are in ``OP_ORDER``."""
        if self.op.shape[0] < 2:
            return True
        rank = _OP_RANK_ARRAY[self.op]
        return bool((rank[:-1] <= rank[1:]).all())

    def in_op_order(self) -> StepBatch:
        """This step with its rows stably sorted into ``OP_ORDER`` (itself when already so)."""
        if self.is_op_ordered():
            return self
        return self.take(np.argsort(_OP_RANK_ARRAY[self.op], kind="stable"))

    def equals(self, other: StepBatch) -> bool:
        """Same step, time and rows, token content included."""
        return (
            self.step == other.step
            and self.time_s == other.time_s
            and all(
                np.array_equal(getattr(self, name), getattr(other, name))
                for name in (
                    "op", "rid", "seq_len", "append_len", "draft_len",
                    "accepted_len", "prefix_len", "prompt_len",
                )
            )
            and self.block_hashes.equals(other.block_hashes)
            and self.token_ids.equals(other.token_ids)
            and np.array_equal(self.arrivals(), other.arrivals(), equal_nan=True)
        )

    def arrivals(self) -> np.ndarray:
        """float64 [n]: ``arrival_s`` with NaN where a row has none (all NaN when None)."""
        if self.arrival_s is None:
            return np.full(len(self), np.nan)
        return self.arrival_s


def _float_column(data: Any, n: int, name: str) -> np.ndarray:
    raw = np.asarray(data, dtype=object if _has_none(data) else None)
    if raw.dtype == object:
        raw = np.array([np.nan if v is None else v for v in raw.reshape(-1)], np.float64)
    if raw.ndim == 0:
        return np.full(n, raw, np.float64)
    if raw.shape != (n,):
        raise ValueError(f"column '{name}' has shape {raw.shape}, expected ({n},)")
    if raw.size and raw.dtype.kind not in "fiub":
        raise ValueError(f"column '{name}' must hold numbers, found dtype {raw.dtype}")
    return raw.astype(np.float64, copy=False)


def _has_none(data: Any) -> bool:
    return isinstance(data, (list, tuple)) and any(v is None for v in data)
