"""Every value of an untrusted trace is checked before it sizes or drives anything.

Metadata fields (``TraceMeta.from_dict``), the reader's row count (the bound of
request ids), and the op-sequence rules on columns an op kind does not use.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from tests.helpers import decode_steps, make_meta, write_steps
from tests.traces.test_validate import messages, row, run, step
from traces.checker import OpSequenceChecker
from traces.checker_process import BackgroundChecker
from traces.errors import TraceMetadataError
from traces.metadata import SpecSettings, TraceMeta
from traces.reader import TraceReader
from traces.samples import sample_path
from traces.schema import MAX_RID, METADATA_KEY


def _meta(**edits: Any) -> dict[str, Any]:
    """The JSON of a valid metadata with ``edits`` ("config.spec.topk" style paths; None removes)."""
    data = json.loads(make_meta(spec=SpecSettings()).to_json())
    for path, value in edits.items():
        *parents, key = path.split("__")
        node = data
        for name in parents:
            node = node[name]
        if value is None:
            node.pop(key, None)
        else:
            node[key] = value
    return data


@pytest.mark.parametrize(
    ("edits", "message"),
    [
        ({"config__pool_tokens": 10**12}, "'config.pool_tokens' must be an integer in [1, 2147483647], found 1000000000000"),
        ({"config__max_context_len": 2**31}, "'config.max_context_len' must be an integer in [1, 2147483647]"),
        ({"config__max_running": True}, "'config.max_running' is missing or not an integer"),
        ({"config__page_size": 0}, "'config.page_size' must be positive, found 0"),
        ({"config__chunk_size": "8k"}, "'config.chunk_size' must be an integer in [1, 2147483647], found '8k'"),
        ({"config__pd_decode": "false"}, "'config.pd_decode' must be true or false, found 'false'"),
        ({"config__radix_cache": 1}, "'config.radix_cache' must be true or false, found 1"),
        ({"config__spec": [3, 1, 4]}, "'config.spec' must be an object or null, found [3, 1, 4]"),
        ({"config__spec__num_draft_tokens": 2**30}, "'config.spec.num_draft_tokens' must be an integer in [1, 1024]"),
        ({"config__spec__topk": 0}, "'config.spec.topk' must be an integer in [1, 1024], found 0"),
        ({"config__spec__algorithm": "medusa"}, "'config.spec.algorithm' must be one of eagle, eagle3, standalone, dflash"),
        ({"config__spec__width": 3}, "unexpected key 'config.spec.width'"),
        ({"block_size": 2**40}, "'block_size' must be an integer in [1, 1048576], found 1099511627776"),
        ({"block_size": 1.5}, "'block_size' must be an integer in [1, 1048576], found 1.5"),
        ({"model__num_layers": "32"}, "'model.num_layers' must be an integer in [1, 1048576], found '32'"),
        ({"model__num_kv_heads": 10**9}, "'model.num_kv_heads' must be an integer in [1, 1048576]"),
        ({"model__dtype": 16}, "'model.dtype' must be a string, found 16"),
        ({"model__experts": 8}, "unexpected key 'model.experts'"),
        ({"source__license": ["MIT"]}, "'source.license' must be a string, found [\"MIT\"]"),
        ({"source": "kimi"}, "'source' must be an object or null, found 'kimi'"),
        ({"extra": [1]}, "'extra' must be an object or null, found [1]"),
        ({"created_at": 20240101}, "'created_at' must be a string, found 20240101"),
        ({"format_version": True}, "no integer 'format_version'"),
    ],
)
def test_every_metadata_field_is_checked(edits: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        TraceMeta.from_dict(_meta(**edits))
    assert message in str(info.value)


def test_valid_metadata_round_trips_and_optional_fields_default() -> None:
    meta = make_meta(spec=SpecSettings(num_steps=5, topk=4, num_draft_tokens=8), pd_decode=True)
    assert TraceMeta.from_json(meta.to_json()) == meta
    bare = TraceMeta.from_dict(_meta(config__spec=None, config__chunk_size=None, model=None, source=None))
    assert bare.config.spec is None and bare.model.num_layers == 32 and bare.source.engine == "unknown"
    # A model field that is null means what its absence means: the default shape's.
    data = _meta()
    data["model"].update(num_layers=None, head_dim=None, dtype=None)
    nulls = TraceMeta.from_dict(data)
    assert (nulls.model.num_layers, nulls.model.head_dim, nulls.model.dtype) == (32, 128, "bfloat16")
    assert nulls.to_dict()["model"]["bytes_per_token"] == nulls.model.bytes_per_token


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "metadata is not valid JSON"),
        (b'{"format_version": ' + b"9" * 5000 + b"}", "metadata is not valid JSON"),
        (b"\xff\xfe", "metadata is not valid JSON"),
        (b"[]", "metadata is not a JSON object"),
        (b'{"format_version": 1, "extra": {"rate": NaN}}', "metadata is not valid JSON (NaN is not a JSON number)"),
    ],
)
def test_hostile_metadata_bytes_are_one_metadata_error(tmp_path: Path, raw: bytes, message: str) -> None:
    path = write_steps(tmp_path / "t.kvtrace", decode_steps(2))
    table = pa.ipc.open_stream(str(path)).read_all()
    with pa.OSFile(str(tmp_path / "m.kvtrace"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema.with_metadata({METADATA_KEY: raw})) as writer:
            writer.write_table(table)
    with pytest.raises(TraceMetadataError) as info:
        TraceReader(tmp_path / "m.kvtrace")
    assert message in str(info.value) and "\n" not in str(info.value)


# -------------------------------------------------------------------- rows and rid bound


@pytest.mark.parametrize("name", ["tiny", "mooncake-tiny"])
def test_the_row_count_comes_from_the_headers_and_bounds_request_ids(name: str) -> None:
    reader = TraceReader(sample_path(name))
    rows = sum(batch.num_rows for batch in reader.iter_batches())
    assert reader.num_rows == rows and reader.rid_bound == rows
    assert OpSequenceChecker(reader.meta, rid_bound=reader.rid_bound).rid_bound == rows
    assert OpSequenceChecker(reader.meta, rid_bound=10 * MAX_RID).rid_bound == MAX_RID


def test_the_row_count_stops_at_a_cut_or_damaged_batch(tmp_path: Path) -> None:
    path = write_steps(tmp_path / "t.kvtrace", decode_steps(6, rows=5), steps_per_batch=2)
    full = path.stat().st_size
    assert TraceReader(path).num_rows == 30
    data = path.read_bytes()
    cut = tmp_path / "cut.kvtrace"
    cut.write_bytes(data[: full - 40])  # inside the last batch
    assert TraceReader(cut).num_rows == 20


@pytest.mark.parametrize("name", ["tiny", "mooncake-tiny"])
def test_the_row_count_of_a_sample_matches_its_batches(name: str) -> None:
    """Both layouts (a stream, an IPC file with its footer) are counted from the headers."""
    reader = TraceReader(sample_path(name))
    assert reader.num_rows == sum(batch.num_rows for batch in reader.iter_batches()) > 0


def test_ids_beyond_the_row_count_are_problems_and_negative_ids_keep_their_message() -> None:
    batch = step(0, row("extend", 0, 4, 4, prompt_len=4), row("extend", 5, 4, 4, prompt_len=4),
                 row("extend", -1, 4, 4, prompt_len=4))
    checker = OpSequenceChecker(make_meta(), rid_bound=3)
    found = checker.check(batch)
    assert messages(found) == [
        "step 0, request 5: request id outside [0, 3) (ids are dense, from 0, fewer than the trace's 3 rows)",
        "step 0, request -1: request id outside [0, 3) (ids are dense, from 0, fewer than the trace's 3 rows)",
    ]
    assert checker._phase.shape[0] <= 1024  # nothing grew past the bound
    unbounded = OpSequenceChecker(make_meta())
    assert messages(unbounded.check(step(0, row("extend", -3, 4, 4, prompt_len=4)))) == [
        "step 0, request -3: request id outside [0, 2**24) (ids are dense, from 0)"
    ]


# ------------------------------------------------------------------ columns by op kind


@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        (
            [step(0, row("extend", 0, 4, 4, prompt_len=4)),
             step(1, row("spec", 0, 6, 2, draft_len=2**30, accepted_len=2))],
            ["step 1, request 0: draft_len 1073741824 exceeds config.spec.num_draft_tokens 4"],
        ),
        (
            [step(0, row("extend", 0, 4, 4, prompt_len=4)), step(1, row("finish", 0, 4, 0, draft_len=3))],
            ["step 1, request 0: draft_len 3 on a finish row (only spec rows carry it; it must be 0)"],
        ),
        (
            [step(0, row("extend", 0, 4, 4, prompt_len=4)), step(1, row("decode", 0, 5, 1, accepted_len=1))],
            ["step 1, request 0: accepted_len 1 on a decode row (only spec rows carry it; it must be 0)"],
        ),
        (
            [step(0, row("extend", 0, 4, 4, prompt_len=4, prefix_len=10**12))],
            ["step 0, request 0: prefix_len 1000000000000 exceeds seq_len 4 (the matched prefix is part of the sequence)"],
        ),
        (
            [step(0, row("extend", 0, 4, 4, prompt_len=4, prefix_len=-2))],
            ["step 0, request 0: prefix_len is negative (-2)"],
        ),
        (
            [step(0, row("extend", 0, 4, 4, prompt_len=4)), step(1, row("decode", 0, 5, 1, prefix_len=4))],
            ["step 1, request 0: prefix_len 4 on a decode row (only extend and prealloc rows carry it; it must be 0)"],
        ),
        (
            [step(0, row("extend", 0, 4, 4, prompt_len=10**12))],
            ["step 0, request 0: prompt_len 1000000000000 exceeds config.max_context_len 4096"],
        ),
        (
            [step(0, row("extend", 0, 4, 4, prompt_len=4)), step(2**62, row("decode", 0, 5, 1))],
            ["step 4611686018427387904: step 4611686018427387904 outside [0, 2**53)"],
        ),
    ],
)
def test_columns_are_checked_against_their_meaning(steps: list[Any], expected: list[str]) -> None:
    problems, _ = run(steps, spec=SpecSettings())
    assert messages(problems) == expected


def test_a_plain_decode_step_with_a_stray_column_is_not_waved_through() -> None:
    """The fast path for decode-only steps checks the unused columns too."""
    start = step(0, *(row("extend", r, 4, 4, prompt_len=4) for r in range(3)))
    decode = step(1, *(row("decode", r, 5, 1, draft_len=int(r == 1)) for r in range(3)))
    problems, _ = run([start, decode])
    assert messages(problems) == ["step 1, request 1: draft_len 1 on a decode row (only spec rows carry it; it must be 0)"]


def test_background_checker_follows_steps_that_go_back(tmp_path: Path) -> None:
    """A step number out of order (2**62 then 3) is reported, never 'no reason given'."""
    first = step(0, row("extend", 0, 1, 1, prompt_len=1), row("extend", 1, 1, 1, prompt_len=1))
    chain = [first] + [
        step(s, row("decode", 0, 2 + i, 1), row("decode", 1, 2 + i, 1), time_s=1.0 + i)
        for i, s in enumerate((1, 2, 2**62, 3, 4))
    ]
    meta = make_meta()
    path = tmp_path / "t.kvtrace"
    # The writer refuses decreasing steps: write the parts apart, then join their batches.
    parts = [
        pa.ipc.open_stream(str(write_steps(tmp_path / f"part{i}.kvtrace", chunk, meta=meta))).read_all()
        for i, chunk in enumerate((chain[:4], chain[4:]))
    ]
    table = parts[0]
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        for part in parts:
            writer.write_table(part)
    reader = TraceReader(path)
    inline = OpSequenceChecker(reader.meta, rid_bound=reader.rid_bound)
    seen = []
    with BackgroundChecker(path, rid_bound=reader.rid_bound) as background:
        for batch in reader.steps():
            problems = background.check(batch)
            assert problems == inline.check(batch)
            seen.extend(messages(problems))
    assert seen == [
        "step 4611686018427387904: step 4611686018427387904 outside [0, 2**53)",
        "step 3: step 3 comes after step 4611686018427387904: steps must not decrease",
        "step 4: step 4 comes after step 4611686018427387904: steps must not decrease",
    ]


def test_a_batch_declaring_a_huge_decompressed_size_is_refused_before_it_is_decoded(tmp_path: Path) -> None:
    """pyarrow allocates what a compressed buffer declares: the reader checks the sum first."""
    import struct

    from traces.errors import TraceCorruptError
    from traces.ipc import MAX_BATCH_BYTES, _parse_message_header, _table_field

    path = write_steps(tmp_path / "t.kvtrace", decode_steps(4, rows=50), steps_per_batch=2)
    data = bytearray(path.read_bytes())
    offset, patched = 0, False
    while not patched:
        meta_len = struct.unpack_from("<i", data, offset + 4)[0]
        meta = bytes(data[offset + 8 : offset + 8 + meta_len])
        header_type, body_len = _parse_message_header(meta)
        body_at = offset + 8 + meta_len
        if header_type == 3:
            root = struct.unpack_from("<I", meta, 0)[0]
            header = _table_field(meta, root, 2)
            batch = header + struct.unpack_from("<I", meta, header)[0]
            vector_at = _table_field(meta, batch, 2)
            vector = vector_at + struct.unpack_from("<I", meta, vector_at)[0]
            for i in range(struct.unpack_from("<I", meta, vector)[0]):
                buffer_offset, length = struct.unpack_from("<qq", meta, vector + 4 + 16 * i)
                if length >= 8 and body_len and struct.unpack_from("<q", data, body_at + buffer_offset)[0] > 0:
                    struct.pack_into("<q", data, body_at + buffer_offset, 1 << 40)
                    patched = True
                    break
        offset = body_at + body_len
    path.write_bytes(bytes(data))
    with pytest.raises(TraceCorruptError) as info:
        list(TraceReader(path).steps())
    message = str(info.value)
    assert f"bytes of decompressed data, more than a trace's batch may hold ({MAX_BATCH_BYTES:,})" in message
    declared = int(message.split("declares ")[1].split(" bytes")[0].replace(",", ""))
    assert 1 << 40 <= declared < (1 << 40) + (1 << 20)
    assert "record batch" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        (
            [step(0, row("extend", 0, 10, 10, prompt_len=7))],
            ["step 0, request 0: extend to seq_len 10 beyond the prompt_len 7 of a new request "
             "(it prefills its prompt, then decodes)"],
        ),
        (
            [step(0, row("extend", 0, 4, 4, prompt_len=4)), step(1, row("extend", 0, 6, 2))],
            ["step 1, request 0: extend of a request whose prefill is complete (length 4 >= prompt_len 4); "
             "after its prefill a request decodes"],
        ),
        (   # re-admitted after a retraction: the prefill may also cover the token sampled last
            [step(0, row("extend", 0, 4, 4, prompt_len=4)), step(1, row("decode", 0, 5, 1)),
             step(2, row("retract", 0, 5, 0)), step(3, row("extend", 0, 3, 3)),
             step(4, row("extend", 0, 6, 3)), step(5, row("decode", 0, 7, 1))],
            [],
        ),
        (
            [step(0, row("extend", 0, 4, 4, prompt_len=4)), step(1, row("decode", 0, 5, 1)),
             step(2, row("decode", 0, 6, 1)), step(3, row("retract", 0, 6, 0)),
             step(4, row("extend", 0, 3, 3)), step(5, row("decode", 0, 4, 1))],
            ["step 5, request 0: decode before the prefill is complete (length 3 < 6, its length when it "
             "was retracted)"],
        ),
    ],
)
def test_a_prefill_ends_at_its_prompt_or_at_the_length_it_was_retracted_at(
    steps: list[Any], expected: list[str]
) -> None:
    problems, _ = run(steps)
    assert messages(problems) == expected


# ------------------------------------------------------------------ property-based

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from traces.batches import StepBatch  # noqa: E402
from traces.schema import OPS  # noqa: E402

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
_FIELDS = [
    "format_version", "block_size", "created_at", "extra", "model", "source", "config",
    "config__page_size", "config__pool_tokens", "config__max_running", "config__max_context_len",
    "config__chunk_size", "config__schedule_policy", "config__spec", "config__pd_decode",
    "config__hisparse", "config__radix_cache", "config__spec__algorithm", "config__spec__num_steps",
    "config__spec__topk", "config__spec__num_draft_tokens", "model__num_layers", "model__dtype",
    "model__name", "source__engine", "source__license",
]


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from(_FIELDS), value=_JSON)
def test_any_json_in_any_metadata_field_is_accepted_or_one_value_error(field: str, value: Any) -> None:
    try:
        meta = TraceMeta.from_dict(_meta(**{field: value}))
    except ValueError as exc:
        assert "\n" not in str(exc) and str(exc)
    else:  # what was accepted is a well-formed configuration that writes back
        assert 1 <= meta.config.pool_tokens < 2**31 and 1 <= meta.config.max_context_len < 2**31
        assert TraceMeta.from_json(meta.to_json()) == meta


_BIG = st.sampled_from([-(2**63), -(2**31), -1, 0, 1, 2, 5, 100, 2**24, 2**31 - 1, 2**53, 2**62, 2**63 - 1])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(
        st.tuples(
            st.integers(0, len(OPS) - 1), st.integers(0, 12) | _BIG, st.integers(0, 50) | _BIG,
            st.integers(0, 50) | _BIG.filter(lambda v: -(2**31) <= v < 2**31),
            st.integers(0, 5), st.integers(-1, 60) | _BIG,
        ),
        min_size=1, max_size=12,
    ),
    steps=st.lists(st.integers(0, 5) | _BIG, min_size=1, max_size=4),
)
def test_the_checker_never_raises_and_never_grows_past_the_bound(
    rows: list[tuple[int, int, int, int, int, int]], steps: list[int]
) -> None:
    checker = OpSequenceChecker(make_meta(spec=SpecSettings()), rid_bound=16)
    for number in steps:
        op, rid, seq_len, append_len, draft_len, prompt_len = zip(*rows)
        batch = StepBatch.from_columns(
            number, 0.0, op=list(op), rid=list(rid), seq_len=list(seq_len), append_len=list(append_len),
            draft_len=list(draft_len), accepted_len=list(draft_len), prefix_len=list(seq_len),
            prompt_len=list(prompt_len),
        )
        for problem in checker.check(batch):
            assert "\n" not in problem.problem
    assert checker._phase.shape[0] <= 1024 and checker._scratch.shape[0] <= 1024
