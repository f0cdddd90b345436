"""Cache namespaces in the trace format: the metadata table, its versions and its checks."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import decode_steps, make_meta, with_meta, write_steps
from tests.namespaced import NAMESPACE_OF, write_namespaced_trace
from traces.batches import StepBatch
from traces.metadata import TraceMeta
from traces.namespaces import NamespaceTable, in_namespace, key_prefix, namespace_of
from traces.reader import TraceReader
from traces.tokens import TokenStore

ROOT = Path(__file__).resolve().parents[2]


def test_a_namespaced_trace_reads_back_its_table_as_version_4(tmp_path: Path) -> None:
    path = write_namespaced_trace(tmp_path / "ns.kvtrace")
    meta = TraceReader(path).meta
    assert meta.format_version == 4
    assert meta.namespaces == NamespaceTable(("lora-a", "lora-b"), (0, 1, 0, -1, 1))
    assert [meta.namespaces.name_of(r) for r in range(6)] == [*NAMESPACE_OF.values(), None]


def test_a_trace_without_namespaces_keeps_its_version_and_metadata(tmp_path: Path) -> None:
    meta = make_meta()
    assert meta.format_version == 1 and "namespaces" not in json.loads(meta.to_json())
    path = write_steps(tmp_path / "plain.kvtrace", decode_steps(3))
    assert TraceReader(path).meta.namespaces is None and TraceReader(path).meta.format_version == 1
    # the table only ever raises the version, and round-trips through JSON
    named = replace(meta, namespaces=NamespaceTable.of({2: "salt"}))
    assert named.format_version == 4 and TraceMeta.from_json(named.to_json()) == named


def test_the_table_interns_names_in_order_of_first_use() -> None:
    table = NamespaceTable.of({5: "b", 1: "a", 3: "b", 0: None})
    assert table == NamespaceTable(("a", "b"), (-1, 0, -1, 1, -1, 1))
    assert NamespaceTable.of({0: None}) is None
    with pytest.raises(ValueError, match="non-empty string"):
        NamespaceTable.of({0: ""})


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda ns: ns.update(of_rid=[0, 7]), "metadata 'namespaces.of_rid[1]' is 7; it must lie in [-1, 2)"),
        (lambda ns: ns.update(names=["a", "a"]), "metadata 'namespaces.names' lists a name twice"),
        (lambda ns: ns.update(names=["a", 3]), "metadata 'namespaces.names[1]' must be a non-empty string"),
        (lambda ns: ns.update(of_rid="0,1"), "metadata 'namespaces.of_rid' must be a list"),
        (lambda ns: ns.update(of_rid=[0.5]), "metadata 'namespaces.of_rid' must hold integers only"),
        (lambda ns: ns.pop("names"), "metadata 'namespaces' must be an object with exactly 'names' and 'of_rid'"),
    ],
)
def test_a_damaged_table_is_one_clear_line_and_exit_2(tmp_path: Path, edit, message: str) -> None:
    source = write_namespaced_trace(tmp_path / "ns.kvtrace")
    bad = with_meta(source, tmp_path / "bad.kvtrace", lambda data: edit(data["namespaces"]))
    proc = subprocess.run(
        [sys.executable, "-m", "kvtrace", "info", str(bad)], capture_output=True, text=True, cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=60,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr


def test_a_table_in_an_older_version_is_refused(tmp_path: Path) -> None:
    source = write_namespaced_trace(tmp_path / "ns.kvtrace")
    data = json.loads(TraceReader(source).meta.to_json())
    data["format_version"] = 3
    with pytest.raises(ValueError, match="'namespaces', which format version 3 does not have"):
        TraceMeta.from_dict(data)


def test_info_shows_the_namespaces(tmp_path: Path) -> None:
    from kvtrace.traceinfo import trace_info

    info = trace_info(TraceReader(write_namespaced_trace(tmp_path / "ns.kvtrace")))
    assert info["namespaces"] == {"count": 2, "requests": {"lora-a": 2, "lora-b": 2}}


def test_the_token_store_tags_a_request_s_ids_with_its_namespace() -> None:
    store = TokenStore(None, NamespaceTable.of({1: "lora-a"}))
    store.ingest(StepBatch.from_columns(0, 0.0, op=["extend", "extend"], rid=[0, 1], seq_len=[4, 4],
                                        append_len=[4, 4], prompt_len=[4, 4]))
    plain, tagged = store.ids(0, 4), store.ids(1, 4)
    assert namespace_of(plain) is None and key_prefix(plain) == b""
    assert namespace_of(tagged) == "lora-a" and namespace_of(tagged[1:3]) == "lora-a"
    assert key_prefix(in_namespace(np.arange(3), "lora-a")) == b"\x00\x06\x00\x00\x00lora-a"


def test_a_mooncake_line_s_sglang_fields_give_its_namespace(tmp_path: Path) -> None:
    from traces.workloads import WorkloadFileError, read_mooncake

    base = '{"timestamp": %d, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]%s}\n'
    extras = [', "lora_id": "a"', ', "extra_key": "a"', ', "cache_salt": "s"', "", ', "extra_key": ""']
    path = tmp_path / "w.jsonl"
    path.write_text("".join(base % (10 * i, extra) for i, extra in enumerate(extras)))
    # SGLang appends lora_id to extra_key: the first two share a namespace (and their KV)
    assert [r.namespace for r in read_mooncake(path)] == ["a", "a", '[null, "s"]', None, None]
    path.write_text(base % (0, ', "lora_id": 7'))
    with pytest.raises(WorkloadFileError, match=":1: lora_id must be a string or null, found 7"):
        list(read_mooncake(path))
