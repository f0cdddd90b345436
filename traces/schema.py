"""THE kvtrace trace format, version 2: Arrow schema, op kinds, bounds (the metadata's
records are ``traces.metadata``'s; a step's rows in memory, ``traces.batches``').

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
op              dictionary<int8, utf8>    extend, decode, spec, prealloc, finish, retract, abort,
                                          hold, close (streaming sessions, version 6)
rid             int64                     dense request id (>= 0), unique within the trace
seq_len         int64                     the request's sequence length after the op (see below)
append_len      int32                     tokens the op appends (0 for release ops)
draft_len       int32                     spec: draft tokens verified this step; else 0
accepted_len    int32                     spec: tokens accepted and committed (== append_len)
prefix_len      int64                     prefix the recording engine matched (informative)
prompt_len      int64 (nullable)          the request's prompt length, on its first row only (and
                                          a session turn's first extend, version 6)
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
* ``hold``     streaming session: the turn ends and its session keeps the KV of its
               first ``seq_len`` tokens (<= L), neither cached nor freed. The request
               (one id per session, SGLang's streaming session) is *held*: its next
               turn is an ``extend`` from ``seq_len`` (the held KV is its prefix), and
               ``close`` ends it. The first ``hold`` opens the session. The
               next turn's first ``extend`` may carry ``prompt_len``: the end of that
               turn's prompt (the conversation so far), where its prefill is done.
* ``close``    release of a held session's KV, nothing cached, the request ends;
               ``seq_len = L`` (the held length).

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
``TraceMeta.attention`` (key ``attention``, version 2) is the model's attention
layout: its full and sliding-window layers, the window and the two pools' split
(``AttentionLayout``); absent, every layer is full attention.

``TraceMeta.mamba`` (key ``mamba``, version 3) is a hybrid linear-attention model's
layout: its full and linear (Mamba / GDN) layers, the state bytes per request and
the Mamba slots (``MambaLayout``); absent, no layer is linear.

``TraceMeta.namespaces`` (key ``namespaces``, version 4) is the cache namespace of each
request (a LoRA adapter, a ``cache_salt``, an ``extra_key``: what SGLang's radix key holds
beside the tokens; ``traces.namespaces``): ``names``, the distinct names, and ``of_rid``,
per request id from 0 the index of its name or -1 for none. Absent, no request has one.

``TraceConfig.hicache`` (key ``config.hicache``, version 5) is HiCache's host tier:
the host pool in tokens, how SGLang sized it and the write policy
(``traces.hicache_layout.HostTier``); absent, the engine had no host tier. A radix
eviction policy other than LRU (``config.eviction_policy``) is written as version 5 too,
so that no older reader replays it as LRU.

Versions: 1, the columns above and the metadata without ``attention``; 2 adds the
optional ``attention`` object and nothing else, so a version 2 trace without it
reads exactly as version 1 did; 3 adds the optional ``mamba`` object likewise; 4 the
optional ``namespaces`` object; 5 the optional ``config.hicache`` object and a non-LRU
``config.eviction_policy``; 6 the ``hold`` and ``close`` ops, which a trace may hold
only when its metadata says ``config.sessions`` (a version 6 trace). Readers read every
version up to
``SCHEMA_VERSION`` and refuse newer ones.

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
  dimensions at most ``MAX_MODEL_DIM``; a Mamba layout's state bytes per layer at most
  ``traces.metadata.MAX_STATE_BYTES`` (1 GiB) and its slots below 2**31. Whether a
  pool of that size fits the machine is decided before it is built
  (``kvtrace.replay.config.check_memory``).
* A record batch decompresses to at most ``traces.ipc.MAX_BATCH_BYTES`` (1 GiB).
"""


from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import pyarrow as pa

if TYPE_CHECKING:
    from traces.metadata import TraceMeta

SCHEMA_VERSION = 6
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
OPS: tuple[str, ...] = ("extend", "decode", "spec", "prealloc", "finish", "retract", "abort", "hold", "close")
OP_CODE: dict[str, int] = {name: code for code, name in enumerate(OPS)}
EXTEND, DECODE, SPEC, PREALLOC, FINISH, RETRACT, ABORT, HOLD, CLOSE = range(len(OPS))
RELEASE_OPS = frozenset({FINISH, RETRACT, ABORT, HOLD, CLOSE})
ALLOC_OPS = frozenset({EXTEND, DECODE, SPEC, PREALLOC})
# Streaming-session ops (format version 6, ``config.sessions``).
SESSION_OPS = frozenset({HOLD, CLOSE})
# The order a scheduler applies a step's ops in: releases, then the new KV.
OP_ORDER: tuple[int, ...] = (FINISH, HOLD, CLOSE, ABORT, RETRACT, PREALLOC, EXTEND, DECODE, SPEC)
OP_RANK: tuple[int, ...] = tuple(OP_ORDER.index(code) for code in range(len(OPS)))

OpName = Literal["extend", "decode", "spec", "prealloc", "finish", "retract", "abort", "hold", "close"]

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


def arrow_schema(meta: TraceMeta) -> pa.Schema:
    """The full schema with ``meta`` attached (writers always write every column)."""
    fields = [pa.field(c.name, c.type, nullable=c.nullable) for c in COLUMNS]
    return pa.schema(fields, metadata={METADATA_KEY: meta.to_json().encode()})
