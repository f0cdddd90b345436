"""THE kvtrace trace format, version 1: Arrow schema, op kinds, metadata.

A trace is one Arrow IPC *stream* (file extension ``.kvtrace``), compressed with
zstd or lz4, holding one record batch per scheduler step or per few steps (a
batch always holds whole steps). Long format: one row per (step, request op).

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
without reading any data.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, NamedTuple

import numpy as np
import pyarrow as pa

SCHEMA_VERSION = 1
METADATA_KEY = b"kvtrace"
FILE_SUFFIX = ".kvtrace"

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
        dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "float8_e4m3fn": 1}
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes.get(self.dtype, 2)


@dataclass(frozen=True, slots=True)
class TraceSource:
    """Where the trace comes from: engine, workload, and the data's licence and citation."""

    engine: str = "unknown"
    workload: str = "unknown"
    repository: str | None = None
    path: str | None = None
    license: str | None = None
    citation: str | None = None


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

    def with_config(self, **changes: Any) -> TraceMeta:
        return replace(self, config=replace(self.config, **changes))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["model"]["bytes_per_token"] = self.model.bytes_per_token
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TraceMeta:
        """Build from parsed JSON. Raises ``ValueError`` naming the missing or bad key."""
        if not isinstance(data, dict):
            raise ValueError("metadata is not a JSON object")
        version = data.get("format_version")
        if not isinstance(version, int):
            raise ValueError("metadata has no integer 'format_version'")
        cfg = data.get("config")
        if not isinstance(cfg, dict):
            raise ValueError("metadata has no 'config' object")
        for key in ("page_size", "pool_tokens", "max_running", "max_context_len"):
            if not isinstance(cfg.get(key), int) or isinstance(cfg.get(key), bool):
                raise ValueError(f"metadata 'config.{key}' is missing or not an integer")
            if cfg[key] <= 0:
                raise ValueError(f"metadata 'config.{key}' must be positive, found {cfg[key]}")
        spec = cfg.get("spec")
        try:
            config = TraceConfig(
                page_size=cfg["page_size"],
                pool_tokens=cfg["pool_tokens"],
                max_running=cfg["max_running"],
                max_context_len=cfg["max_context_len"],
                chunk_size=cfg.get("chunk_size"),
                schedule_policy=cfg.get("schedule_policy", "fcfs"),
                spec=SpecSettings(**spec) if spec else None,
                pd_decode=bool(cfg.get("pd_decode", False)),
                hisparse=bool(cfg.get("hisparse", False)),
            )
            model = dict(data.get("model") or {})
            model.pop("bytes_per_token", None)
            return cls(
                config=config,
                source=TraceSource(**(data.get("source") or {})),
                model=ModelShape(**model),
                block_size=data.get("block_size"),
                format_version=version,
                created_at=data.get("created_at"),
                extra=dict(data.get("extra") or {}),
            )
        except TypeError as exc:  # unknown keys in a sub-object
            raise ValueError(f"metadata has an unexpected key: {exc}") from None

    @classmethod
    def from_json(cls, text: str | bytes) -> TraceMeta:
        try:
            data = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"metadata is not valid JSON ({exc})") from None
        return cls.from_dict(data)


def arrow_schema(meta: TraceMeta) -> pa.Schema:
    """The full v1 schema with ``meta`` attached (writers always write every column)."""
    fields = [pa.field(c.name, c.type, nullable=c.nullable) for c in COLUMNS]
    return pa.schema(fields, metadata={METADATA_KEY: meta.to_json().encode()})


class Ragged(NamedTuple):
    """A list column as numpy: row ``i`` is ``values[offsets[i]:offsets[i+1]]`` where ``valid[i]``.

    A null row (``valid[i]`` False) has an empty slice.
    """

    offsets: np.ndarray  # int64 [n+1]
    values: np.ndarray  # [offsets[-1]] uint64 (block_hashes) or int64 (token_ids)
    valid: np.ndarray  # bool [n]

    def row(self, i: int) -> np.ndarray | None:
        if not self.valid[i]:
            return None
        return self.values[self.offsets[i] : self.offsets[i + 1]]

    @classmethod
    def empty(cls, n: int, dtype: np.dtype | type = np.int64) -> Ragged:
        return cls(np.zeros(n + 1, np.int64), np.zeros(0, dtype), np.zeros(n, np.bool_))


@dataclass(frozen=True, slots=True)
class StepBatch:
    """The ops of one scheduler step, columnar (what ``TraceReader.steps()`` yields and
    ``TraceWriter.write(batch)`` takes). Rows are in ``OP_ORDER``.

    ``prompt_len`` is -1 where the column is null. Optional columns absent from a
    file read as zeros / nulls.
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

    def __len__(self) -> int:
        return int(self.op.shape[0])

    def rows_of(self, op_code: int) -> np.ndarray:
        """Indices of this step's rows with the given op code (in row order)."""
        return np.flatnonzero(self.op == op_code)
