"""Structure-aware mutations of bundled sample traces, written with plain pyarrow.

A ``Seed`` is a sample trace held as pieces (its metadata as a JSON object and its
rows as one Arrow table); a mutation edits the pieces the way a hand-edited or
damaged copy would (a value set to an extreme, rows dropped, duplicated or swapped,
a metadata field removed or retyped, a column retyped or dropped), ``write`` turns
them back into a valid Arrow IPC stream, and byte-level mutations then damage the
file itself (cut, flipped bytes, batches dropped or repeated). Every choice comes
from one ``numpy`` generator, so a case is reproduced from its seed.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from traces.reader import TraceReader
from traces.samples import sample_path
from traces.schema import MAX_RID, MAX_STEP, MAX_TOKENS, METADATA_KEY, OPS

# The bundled samples, cut to about this many rows (whole record batches) so that a
# replay takes a fraction of a second.
SEED_SAMPLES: tuple[tuple[str, int], ...] = (
    ("tiny", 1 << 30),
    ("mooncake-tiny", 600),
    ("mooncake-eagle", 600),
    ("mooncake-pressure", 600),
    ("azure-code", 600),
)
_OPTIONAL = ("draft_len", "accepted_len", "prefix_len", "prompt_len", "block_hashes", "token_ids")
_NUMERIC = ("step", "rid", "seq_len", "append_len", "draft_len", "accepted_len", "prefix_len", "prompt_len")


@dataclass
class Seed:
    """A trace as editable pieces: metadata (a JSON object) and rows (one table)."""

    name: str
    meta: dict[str, Any]
    table: pa.Table

    def copy(self) -> Seed:
        return Seed(self.name, copy.deepcopy(self.meta), self.table)


@dataclass
class Case:
    """One mutated trace: the pieces to write, how to write them, then byte damage."""

    seed: Seed
    meta_bytes: bytes | None = None  # replaces the JSON of ``seed.meta`` when set
    drop_meta: bool = False
    compression: str | None = "zstd"
    rows_per_batch: int = 256
    byte_edits: list[Callable[[bytearray, np.random.Generator], str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def load_seeds() -> list[Seed]:
    """The bundled samples, each cut to its first rows (whole record batches)."""
    seeds = []
    for name, max_rows in SEED_SAMPLES:
        reader = TraceReader(sample_path(name))
        batches, rows = [], 0
        for batch in reader.iter_batches():
            batches.append(batch)
            rows += batch.num_rows
            if rows >= max_rows:
                break
        table = pa.Table.from_batches(batches, schema=reader.schema).combine_chunks()
        table = table.slice(0, _whole_steps(table, max_rows))
        meta = json.loads(reader.schema.metadata[METADATA_KEY])
        # Rows and a context no larger than the cut needs keep each replay's request table small.
        config = meta["config"]
        longest = max(_column_max(table, "seq_len"), _column_max(table, "prompt_len"))
        config["max_context_len"] = min(config["max_context_len"], longest + 64)
        config["max_running"] = min(config["max_running"], len(np.unique(_column_numpy(table, "rid"))))
        seeds.append(Seed(name, meta, table))
    return seeds


def _column_max(table: pa.Table, name: str) -> int:
    return int(_column_numpy(table, name).max(initial=1))


def _whole_steps(table: pa.Table, max_rows: int) -> int:
    """Rows of the whole steps among the first ``max_rows``."""
    if table.num_rows <= max_rows:
        return table.num_rows
    step = _column_numpy(table, "step")
    return int(np.searchsorted(step, step[max_rows], side="left"))


def write(case: Case, path: Path, rng: np.random.Generator) -> Path:
    """Write the case as an Arrow IPC stream, then apply its byte edits."""
    table = case.seed.table
    if case.drop_meta:
        metadata = None
    else:
        raw = case.meta_bytes if case.meta_bytes is not None else json.dumps(case.seed.meta).encode()
        metadata = {METADATA_KEY: raw}
    schema = table.schema.with_metadata(metadata) if metadata else table.schema.remove_metadata()
    table = table.replace_schema_metadata(schema.metadata)
    options = pa.ipc.IpcWriteOptions(compression=case.compression)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema, options=options) as writer:
        if table.num_rows:
            writer.write_table(table, max_chunksize=max(1, case.rows_per_batch))
    if case.byte_edits:
        data = bytearray(path.read_bytes())
        for edit in case.byte_edits:
            case.notes.append(edit(data, rng))
        path.write_bytes(bytes(data))
    return path


# -------------------------------------------------------------------------------- values


def _extremes(seed: Seed, column: str) -> list[int]:
    cfg = seed.meta.get("config", {})
    ctx = cfg.get("max_context_len", 4096) if isinstance(cfg, dict) else 4096
    ctx = ctx if isinstance(ctx, int) else 4096
    rows = seed.table.num_rows
    values = [0, 1, -1, 2, 7, ctx - 1, ctx, ctx + 1, rows - 1, rows, rows + 1, MAX_RID - 1, MAX_RID,
              MAX_TOKENS, MAX_TOKENS + 1, 2**32, MAX_STEP - 1, MAX_STEP, 10**12, 10**15, 2**62,
              2**63 - 1, -(2**63), -(2**31)]
    if column in ("append_len", "draft_len", "accepted_len"):
        values = [v for v in values if -(2**31) <= v < 2**31] + [2**30, 2**31 - 1]
    return values


def _column_numpy(table: pa.Table, name: str) -> np.ndarray:
    array = table.column(name).combine_chunks()
    if array.null_count:
        fill = -1 if name == "prompt_len" else 0
        array = array.fill_null(fill)
    return array.to_numpy(zero_copy_only=False).copy()


def _set_column(table: pa.Table, name: str, values: Any, mask: np.ndarray | None = None) -> pa.Table:
    index = table.column_names.index(name)
    field_ = table.schema.field(index)
    array = pa.array(values, field_.type, mask=mask)
    return table.set_column(index, field_, array)


def _rows(rng: np.random.Generator, n: int) -> np.ndarray:
    """A few rows: one, a handful, or a run."""
    if n == 0:
        return np.zeros(0, np.int64)
    kind = rng.integers(3)
    if kind == 0:
        return rng.integers(0, n, 1)
    if kind == 1:
        return rng.integers(0, n, int(rng.integers(2, 6)))
    start = int(rng.integers(0, n))
    return np.arange(start, min(n, start + int(rng.integers(2, 40))))


# --------------------------------------------------------------------- structural edits


def set_extreme(case: Case, rng: np.random.Generator) -> str:
    """One column's value at a few rows set to an extreme (or just past a bound)."""
    seed = case.seed
    names = [c for c in _NUMERIC if c in seed.table.column_names] + (
        ["time_s"] if "time_s" in seed.table.column_names else []
    )
    name = names[int(rng.integers(len(names)))]
    rows = _rows(rng, seed.table.num_rows)
    values = _column_numpy(seed.table, name)
    if name == "time_s":
        pick = [np.nan, np.inf, -np.inf, -1.0, 0.0, 1e308, 5e-324, 1e18][int(rng.integers(8))]
        values[rows] = pick
    else:
        choices = _extremes(seed, name)
        pick = choices[int(rng.integers(len(choices)))]
        info = np.iinfo(values.dtype)
        values[rows] = int(np.clip(pick, info.min, info.max))
    seed.table = _set_column(seed.table, name, values)
    return f"{name}[{rows[:3].tolist()}...] = {pick}"


def nudge(case: Case, rng: np.random.Generator) -> str:
    """A column off by a little at a few rows (lengths that no longer add up)."""
    seed = case.seed
    names = [c for c in _NUMERIC if c in seed.table.column_names]
    name = names[int(rng.integers(len(names)))]
    rows = _rows(rng, seed.table.num_rows)
    values = _column_numpy(seed.table, name)
    delta = int(rng.choice([-3, -2, -1, 1, 2, 3, 100]))
    values[rows] = values[rows] + delta
    seed.table = _set_column(seed.table, name, values)
    return f"{name}[{rows[:3].tolist()}...] += {delta}"


def _op_dictionary(table: pa.Table) -> pa.DictionaryArray | None:
    """The op column as a dictionary array (an earlier edit may have retyped it to plain
    strings: encoded again; to anything else, or dropped: None)."""
    if "op" not in table.column_names:
        return None
    column = table.column("op").combine_chunks()
    if pa.types.is_dictionary(column.type):
        return column
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        return column.dictionary_encode()
    return None


def change_op(case: Case, rng: np.random.Generator) -> str:
    """Rows given another op kind (dictionary index)."""
    seed = case.seed
    column = _op_dictionary(seed.table)
    if column is None:
        return "op changed: skipped (the op column is no longer strings)"
    indices = column.indices.to_numpy(zero_copy_only=False).copy()
    rows = _rows(rng, indices.shape[0])
    indices[rows] = rng.integers(0, len(column.dictionary), rows.shape[0])
    op = pa.DictionaryArray.from_arrays(pa.array(indices, column.indices.type), column.dictionary)
    seed.table = seed.table.set_column(seed.table.column_names.index("op"), seed.table.schema.field("op"), op)
    return f"op[{rows[:3].tolist()}...] changed"


def change_op_names(case: Case, rng: np.random.Generator) -> str:
    """The op dictionary permuted, extended or given an unknown name."""
    seed = case.seed
    column = _op_dictionary(seed.table)
    if column is None:
        return "op dictionary: skipped (the op column is no longer strings)"
    names = list(OPS)
    kind = int(rng.integers(3))
    if kind == 0:
        rng.shuffle(names)
    elif kind == 1:
        names[int(rng.integers(len(names)))] = "compact"
    else:
        names = names + ["bogus", "extend"]
    op = pa.DictionaryArray.from_arrays(column.indices, pa.array(names, pa.utf8()))
    seed.table = seed.table.set_column(seed.table.column_names.index("op"), seed.table.schema.field("op"), op)
    return f"op dictionary = {names}"


def edit_list(case: Case, rng: np.random.Generator) -> str:
    """A list column's rows nulled, emptied, lengthened or given extreme values."""
    seed = case.seed
    names = [c for c in ("block_hashes", "token_ids") if c in seed.table.column_names]
    if not names:
        return "no list column"
    name = names[int(rng.integers(len(names)))]
    values = seed.table.column(name).to_pylist()
    rows = _rows(rng, len(values))
    kind = int(rng.integers(5))
    top = 2**64 - 1 if name == "block_hashes" else 2**63 - 1
    for r in rows.tolist():
        if kind == 0:
            values[r] = None
        elif kind == 1:
            values[r] = []
        elif kind == 2:
            values[r] = (values[r] or []) + [int(v) for v in rng.integers(0, 1000, int(rng.integers(1, 50)))]
        elif kind == 3:
            values[r] = [top if name == "block_hashes" else int(rng.choice([-1, 2**62, top]))] * max(
                1, len(values[r] or [])
            )
        else:
            values[r] = (values[r] or [0])[: max(0, len(values[r] or []) - 1)]
    seed.table = _set_column(seed.table, name, values)
    return f"{name}[{rows[:3].tolist()}...] edit {kind}"


def null_column(case: Case, rng: np.random.Generator) -> str:
    """Nulls in a column (required columns must have none)."""
    seed = case.seed
    name = seed.table.column_names[int(rng.integers(seed.table.num_columns))]
    if name == "op" or pa.types.is_list(seed.table.schema.field(name).type):
        return "no nulls added"
    rows = _rows(rng, seed.table.num_rows)
    mask = np.zeros(seed.table.num_rows, np.bool_)
    mask[rows] = True
    values = _column_numpy(seed.table, name)
    index = seed.table.column_names.index(name)
    field_ = seed.table.schema.field(index).with_nullable(True)
    seed.table = seed.table.set_column(index, field_, pa.array(values, field_.type, mask=mask))
    return f"{name} nulls at {rows[:3].tolist()}..."


def drop_rows(case: Case, rng: np.random.Generator) -> str:
    rows = _rows(rng, case.seed.table.num_rows)
    keep = np.setdiff1d(np.arange(case.seed.table.num_rows), rows)
    case.seed.table = case.seed.table.take(pa.array(keep))
    return f"dropped rows {rows[:3].tolist()}..."


def duplicate_rows(case: Case, rng: np.random.Generator) -> str:
    rows = _rows(rng, case.seed.table.num_rows)
    order = np.sort(np.concatenate([np.arange(case.seed.table.num_rows), rows]))
    case.seed.table = case.seed.table.take(pa.array(order))
    return f"duplicated rows {rows[:3].tolist()}..."


def many_copies(case: Case, rng: np.random.Generator, copies: int | None = None) -> str:
    """One row repeated a huge number of times in place (``copies``; None: one of
    ``MANY_COPIES``), all in one record batch: a few KB on disk, millions of rows of one
    request in one step once read."""
    n = case.seed.table.num_rows
    if n == 0:
        return "no rows"
    at = int(rng.integers(0, n))
    copies = int(rng.choice(MANY_COPIES)) if copies is None else copies
    order = np.concatenate([np.arange(at), np.full(copies, at), np.arange(at + 1, n)])
    case.seed.table = case.seed.table.take(pa.array(order))
    case.rows_per_batch = max(case.rows_per_batch, case.seed.table.num_rows)
    return f"row {at} repeated {copies:,} times in one batch"


def nan_time(case: Case, rng: np.random.Generator, whole: bool | None = None) -> str:
    """time_s NaN at every row of one step (``whole``; None: a coin decides), or at one
    row of it (a later one when it has several: the step's time is read from its first
    row)."""
    table = case.seed.table
    if "time_s" not in table.column_names or "step" not in table.column_names or table.num_rows == 0:
        return "no time_s or step column"
    steps = _column_numpy(table, "step")
    times = _column_numpy(table, "time_s").astype(np.float64)
    at = int(rng.integers(0, table.num_rows))
    rows = np.flatnonzero(steps == steps[at])
    if (rng.random() < 0.5 if whole is None else whole) or rows.size == 1:
        times[rows] = np.nan
        note = f"time_s NaN at every row of step {steps[at]}"
    else:
        row = int(rows[1 + int(rng.integers(rows.size - 1))])
        times[row] = np.nan
        note = f"time_s NaN at row {row} of step {steps[at]}"
    case.seed.table = _set_column(table, "time_s", times)
    return note


def swap_rows(case: Case, rng: np.random.Generator) -> str:
    n = case.seed.table.num_rows
    if n < 2:
        return "too few rows"
    order = np.arange(n)
    kind = int(rng.integers(3))
    if kind == 0:
        a, b = rng.integers(0, n, 2)
        order[[a, b]] = order[[b, a]]
        note = f"swapped rows {a} and {b}"
    elif kind == 1:
        start = int(rng.integers(0, n - 1))
        stop = min(n, start + int(rng.integers(2, 30)))
        order[start:stop] = order[start:stop][::-1]
        note = f"reversed rows {start}..{stop}"
    else:
        start = int(rng.integers(0, n - 1))
        stop = min(n, start + int(rng.integers(2, 30)))
        rng.shuffle(order[start:stop])
        note = f"shuffled rows {start}..{stop}"
    case.seed.table = case.seed.table.take(pa.array(order))
    return note


def drop_column(case: Case, rng: np.random.Generator) -> str:
    """An optional column removed, or (rarely) a required one."""
    names = [c for c in case.seed.table.column_names if c in _OPTIONAL or rng.random() < 0.1]
    name = names[int(rng.integers(len(names)))]
    case.seed.table = case.seed.table.drop_columns([name])
    return f"dropped column {name}"


def retype_column(case: Case, rng: np.random.Generator) -> str:
    """A column written with another Arrow type."""
    seed = case.seed
    name = seed.table.column_names[int(rng.integers(seed.table.num_columns))]
    target = [pa.int32(), pa.int64(), pa.float64(), pa.uint64(), pa.utf8(), pa.int8()][int(rng.integers(6))]
    try:
        array = seed.table.column(name).cast(target, safe=False)
    except (pa.ArrowException, ValueError):
        return f"cannot retype {name}"
    index = seed.table.column_names.index(name)
    seed.table = seed.table.set_column(index, pa.field(name, target), array)
    return f"column {name} as {target}"


_RETYPED: tuple[Any, ...] = (
    "abc", "", 1.5, True, False, None, [], {}, [1, 2], {"a": 1}, -1, 0, 1, 2**31, 2**31 - 1,
    10**12, 2**63, -(2**63) - 1, 10**30, "1" * 300, float("nan"), "[/]x[bold", "line\nbreak",
)


def _meta_paths(meta: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    if isinstance(meta, dict):
        for key, value in meta.items():
            out.append(prefix + (key,))
            out.extend(_meta_paths(value, prefix + (key,)))
    return out


def edit_meta(case: Case, rng: np.random.Generator) -> str:
    """A metadata field removed, retyped or set to an extreme (any depth)."""
    meta = case.seed.meta
    paths = _meta_paths(meta)
    if not paths:
        return "no metadata field"
    path = paths[int(rng.integers(len(paths)))]
    parent = meta
    for key in path[:-1]:
        parent = parent[key]
    kind = int(rng.integers(4))
    if kind == 0:
        del parent[path[-1]]
        return f"metadata {'.'.join(map(str, path))} removed"
    value = _RETYPED[int(rng.integers(len(_RETYPED)))]
    if kind == 3 and isinstance(parent[path[-1]], int) and not isinstance(parent[path[-1]], bool):
        value = int(parent[path[-1]]) * int(rng.choice([0, -1, 2, 1000, 10**9]))
    parent[path[-1]] = value
    return f"metadata {'.'.join(map(str, path))} = {str(value)[:30]}"


def add_meta_key(case: Case, rng: np.random.Generator) -> str:
    """An unexpected key in a metadata object."""
    meta = case.seed.meta
    objects = [()] + [p for p in _meta_paths(meta) if isinstance(_lookup(meta, p), dict)]
    path = objects[int(rng.integers(len(objects)))]
    _lookup(meta, path)["surprise"] = _RETYPED[int(rng.integers(len(_RETYPED)))]
    return f"metadata {'.'.join(map(str, path)) or '(root)'}.surprise added"


def _lookup(meta: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        meta = meta[key]
    return meta


def raw_meta(case: Case, rng: np.random.Generator) -> str:
    """The metadata bytes replaced: not JSON, not UTF-8, not an object, absurdly nested."""
    choices = [
        b"", b"{", b"null", b"[]", b"42", b'"text"', b"\xff\xfe\x00", b"[" * 100_000 + b"]" * 100_000,
        b'{"format_version": ' + b"9" * 5000 + b"}", b'{"format_version": 1}',
        json.dumps(case.seed.meta).encode()[:-7], b'{"format_version": 2, "config": {}}',
        b'{"format_version": 0}', b'{"format_version": true}', b'{"format_version": 1.0}',
    ]
    pick = int(rng.integers(len(choices) + 1))
    if pick == len(choices):
        case.drop_meta = True
        return "metadata removed"
    case.meta_bytes = choices[pick]
    return f"metadata bytes = {choices[pick][:30]!r}"


# --------------------------------------------------------------------------- byte edits


def cut(data: bytearray, rng: np.random.Generator) -> str:
    """The file cut at a random byte (a killed writer, a partial download)."""
    at = int(rng.integers(0, len(data)))
    del data[at:]
    return f"cut at byte {at}"


def flip(data: bytearray, rng: np.random.Generator) -> str:
    """A few random bytes or bits changed."""
    n = int(rng.integers(1, 9))
    where = rng.integers(0, len(data), n)
    for at in where.tolist():
        if rng.random() < 0.5:
            data[at] ^= 1 << int(rng.integers(8))
        else:
            data[at] = int(rng.integers(256))
    return f"flipped bytes at {where[:3].tolist()}..."


def _message_spans(data: bytearray) -> list[tuple[int, int]]:
    spans, offset = [], 0
    while offset + 8 <= len(data):
        continuation, meta_len = np.frombuffer(bytes(data[offset : offset + 8]), "<u4,<i4")[0]
        if continuation != 0xFFFFFFFF or meta_len <= 0:
            break
        meta = bytes(data[offset + 8 : offset + 8 + meta_len])
        try:
            from traces.ipc import _parse_message_header

            _, body_len = _parse_message_header(meta)
        except ValueError:
            break
        end = offset + 8 + meta_len + body_len
        spans.append((offset, end))
        offset = end
    return spans


def shuffle_batches(data: bytearray, rng: np.random.Generator) -> str:
    """Whole record batches dropped, repeated or swapped (the schema message stays first)."""
    spans = _message_spans(data)
    if len(spans) < 3:
        return "too few batches"
    head, batches, tail = data[: spans[1][0]], [data[a:b] for a, b in spans[1:]], data[spans[-1][1] :]
    kind = int(rng.integers(3))
    i = int(rng.integers(len(batches)))
    if kind == 0:
        del batches[i]
    elif kind == 1:
        batches.insert(i, batches[i])
    else:
        j = int(rng.integers(len(batches)))
        batches[i], batches[j] = batches[j], batches[i]
    data[:] = head + b"".join(bytes(b) for b in batches) + tail
    return f"batches edit {kind} at {i}"


def garbage(data: bytearray, rng: np.random.Generator) -> str:
    """Bytes appended after the end, or inserted in the middle."""
    blob = rng.integers(0, 256, int(rng.integers(1, 64)), dtype=np.uint8).tobytes()
    if rng.random() < 0.5:
        data.extend(blob)
        return "garbage appended"
    at = int(rng.integers(0, len(data)))
    data[at:at] = blob
    return f"garbage inserted at {at}"


STRUCTURAL: tuple[tuple[Callable[[Case, np.random.Generator], str], float], ...] = (
    (set_extreme, 6.0),
    (nudge, 3.0),
    (change_op, 2.0),
    (change_op_names, 0.5),
    (edit_list, 1.5),
    (null_column, 0.5),
    (drop_rows, 2.0),
    (duplicate_rows, 2.0),
    (swap_rows, 2.0),
    (drop_column, 0.7),
    (retype_column, 0.5),
    (edit_meta, 4.0),
    (add_meta_key, 0.5),
    (raw_meta, 0.7),
)
# Edits that make a huge or a NaN-timed case, drawn from a stream of their own
# (``make_case``), at this rate: the cases of seeds found before they existed stay as
# they were. Copies of one row: a step of millions of rows must cost seconds.
HOSTILE: tuple[Callable[[Case, np.random.Generator], str], ...] = (many_copies, nan_time)
HOSTILE_RATE = 0.08
MANY_COPIES = (20_000, 300_000, 3_000_000)
BYTE_EDITS: tuple[Callable[[bytearray, np.random.Generator], str], ...] = (cut, flip, shuffle_batches, garbage)


def make_case(seeds: list[Seed], rng: np.random.Generator) -> Case:
    """A random case: a seed, one to three structural edits, sometimes byte damage."""
    case = Case(seeds[int(rng.integers(len(seeds)))].copy())
    case.compression = [None, "zstd", "lz4"][int(rng.integers(3))]
    case.rows_per_batch = int(rng.choice([1, 7, 64, 256, 4096]))
    weights = np.array([w for _, w in STRUCTURAL])
    for _ in range(int(rng.integers(1, 4))):
        _apply(case, STRUCTURAL[int(rng.choice(len(STRUCTURAL), p=weights / weights.sum()))][0], rng)
    # spawn() draws nothing from ``rng``: what follows (byte edits, commands) is unchanged.
    hostile = rng.spawn(1)[0]
    if hostile.random() < HOSTILE_RATE:
        _apply(case, HOSTILE[int(hostile.integers(len(HOSTILE)))], hostile)
    if rng.random() < 0.2:
        case.byte_edits.append(BYTE_EDITS[int(rng.integers(len(BYTE_EDITS)))])
    return case


def _apply(case: Case, edit: Callable[[Case, np.random.Generator], str], rng: np.random.Generator) -> None:
    try:
        note = edit(case, rng)
    except (pa.ArrowException, OverflowError, ValueError, TypeError, KeyError) as exc:
        # e.g. a value a retyped column cannot hold, or an edit of a column dropped before
        note = f"not applicable ({type(exc).__name__})"
    case.notes.append(f"{edit.__name__}: {note}")
