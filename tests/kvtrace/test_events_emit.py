"""KV events from a replay (``kvtrace.events.blocks``, ``emit``, ``wire``): SGLang's hashes
and bytes, events that describe exactly what the replay's radix cache holds, and the
``replay --kv-events`` option."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.events.blocks import (
    GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    event_hash,
    event_hashes,
    hash_ids,
    page_digests,
)
from kvtrace.events.emit import Emitter
from kvtrace.events.wire import EventFileWriter, EventStreamError, Frame, encode, read_frames
from kvtrace.replay.engine import ReplayOptions
from kvtrace.replay.session import ReplaySession

TRACE = "sample:mooncake-tiny"  # no EAGLE; its default pool evicts


def _split(digests: bytes) -> list[bytes]:
    return [digests[i : i + 32] for i in range(0, len(digests), 32)]


def test_page_digests_are_sglangs() -> None:
    # Printed by SGLang 0.5.23's sglang.srt.mem_cache.utils.get_hash_str (its native hash)
    # and hash_str_to_int64 for the same tokens: two pages of 4, a page chained from the
    # first, and pages of 2 of which one holds a token above 2**32 (the 64-bit form).
    a = _split(page_digests(np.array([1, 2, 3, 4, 5, 6, 7, 8]), 4, None))
    assert [d.hex() for d in a] == [
        "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72",
        "4ebfa8a1f3c341517621838c6e1b9aa350307e3f00b3cbd1a07ef740f54396d6",
    ]
    assert _split(page_digests(np.array([5, 6, 7, 8]), 4, a[0])) == a[1:]
    c = _split(page_digests(np.array([2**40, 3, 7, 9]), 2, a[-1]))
    assert [d.hex() for d in c] == [
        "a54493dfe3dd918224ab1d915a13ab291ee776707b2c194c73f7ad5c3bfc149b",
        "77e4b04b470a9b00a19c017ee98cd74b1a43409f26ed7cf538659e9a055dd872",
    ]
    assert event_hashes(b"".join(a + c)) == [event_hash(d) for d in a + c] == [
        -3488128144981237669, 5674439469042975057, -6537938169225178750, 8639223822564367104,
    ]


def test_negative_ids_hash_as_sglang_hashes_them_without_the_sign_bit() -> None:
    # SGLang refuses negative ids (kvtrace's tokens unique to a request); both sides hash
    # -2 as 2**63 - 2. Printed by SGLang 0.5.23's get_native_hash(array("q", [1, 2**63 - 2,
    # 3, 4]), None, 2).
    pages = _split(page_digests(np.array([1, -2, 3, 4]), 2, None))
    assert [d.hex() for d in pages] == [
        "c48f12027971a878d76db9852c8e6745aa8e8fee157ac34f529bb4a93946b527",
        "753959f9ba6d85965b562f589856e7b4a66d53808bc8b9cec2bd459bafed041c",
    ]
    assert hash_ids(np.array([-1, 0, 5, -(2**62)])).tolist() == [2**63 - 1, 0, 5, 2**62]


def test_a_batch_is_sglangs_bytes() -> None:
    # msgspec.msgpack.encode of SGLang 0.5.23's own KVEventBatch with the same events.
    sglang_hex = (
        "93cb3ff80000000000009381a474797065b0416c6c426c6f636b73436c656172656487a474797065ab426c6f636b53746f726564"
        "ac626c6f636b5f6861736865739201feb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473920304aa626c6f"
        "636b5f73697a6501a76c6f72615f6964c0a66d656469756da347505583a474797065ac426c6f636b52656d6f766564ac626c6f63"
        "6b5f6861736865739105a66d656469756da347505500"
    )
    batch = KVEventBatch(ts=1.5, events=[
        AllBlocksCleared(),
        BlockStored(block_hashes=[1, -2], parent_block_hash=None, token_ids=[3, 4], block_size=1, lora_id=None,
                    medium=GPU),
        BlockRemoved(block_hashes=[5], medium=GPU),
    ], attn_dp_rank=0)
    assert encode(batch).hex() == sglang_hex


def _tree_hashes(tree: object, page_size: int) -> set[int]:
    """Every page's hash computed from the tree alone, top down: each node's pages chained
    from the last page of its parent."""
    out: set[int] = set()
    stack = [(child, None) for child in tree.root_node.children.values()]  # type: ignore[attr-defined]
    while stack:
        node, prior = stack.pop()
        digests = _split(page_digests(node.key_units(), page_size, prior))
        out.update(event_hash(d) for d in digests)
        stack.extend((child, digests[-1]) for child in node.children.values())
    return out


def _applied(frames: list[Frame]) -> set[int]:
    """The blocks held after applying every decoded event in order."""
    held: set[int] = set()
    for frame in frames:
        _ts, events, rank = msgspec.msgpack.decode(frame.payload)
        assert rank == 0
        for event in events:
            if event["type"] == "BlockStored":
                assert event["medium"] == GPU and event["lora_id"] is None
                assert len(event["token_ids"]) == len(event["block_hashes"]) * event["block_size"]
                assert not held & set(event["block_hashes"])
                held.update(event["block_hashes"])
            elif event["type"] == "BlockRemoved":
                assert set(event["block_hashes"]) <= held
                held.difference_update(event["block_hashes"])
            else:
                held.clear()
    return held


@pytest.mark.parametrize("page_size", [1, 16])
def test_events_describe_the_replay_tree_exactly(page_size: int, tmp_path: Path) -> None:
    frames: list[Frame] = []
    # A small pool (requests that do not fit are dropped) evicts from the first steps on.
    options = ReplayOptions(on_oom="skip", stop_step=400)
    with ReplaySession(TRACE, page_size=page_size, pool_tokens=60_000, options=options, checker="inline") as session:
        emitter = Emitter(session, frames.append)
        for snap in session.snapshots():
            emitter.after(snap)
        tree = session.allocator.tree_cache
        truth = _tree_hashes(tree, page_size)
    assert [f.seq for f in frames] == list(range(len(frames)))
    first = msgspec.msgpack.decode(frames[0].payload)[1]
    assert first[0] == {"type": "AllBlocksCleared"}  # SGLang's tree reset at start-up
    assert emitter.listener is not None and emitter.listener.num_removed > 0  # the pool evicted
    assert _applied(frames) == truth == emitter.listener.block_hashes()
    assert len(truth) == tree.total_size() // page_size
    # Through the file format and back, frame for frame.
    path = tmp_path / "events.kvev"
    with open(path, "wb") as f:
        writer = EventFileWriter(f)
        for frame in frames:
            writer.write(frame)
    assert list(read_frames(path)) == frames
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(EventStreamError, match="cut short inside the frame at byte"):
        list(read_frames(path))


def test_replay_kv_events_writes_the_file_once(tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "events.kvev"
    res = runner.invoke(app, ["replay", TRACE, "--kv-events", str(out), "--json"])
    assert res.exit_code == 0, res.output
    summary = msgspec.json.decode(res.stdout)
    frames = list(read_frames(out))
    assert summary["kv_events"]["batches"] == len(frames) > 0
    assert summary["kv_events"]["blocks_removed"] > 0
    res = runner.invoke(app, ["replay", TRACE, "--kv-events", str(out)])
    assert res.exit_code == 2
    assert "already exists; pass --force" in res.stderr
    assert list(read_frames(out)) == frames


@pytest.mark.parametrize(("args", "message"), [
    (["sample:tiny", "--kv-events", "{out}"], "EAGLE"),
    ([TRACE, "--kv-events", "{out}", "--kv-events-replay", "tcp://127.0.0.1:0"], "names a file"),
    ([TRACE, "--kv-events-wait", "1"], "add --kv-events"),
    ([TRACE, "--kv-events", "ipc:///tmp/x"], "tcp://HOST:PORT"),
    ([TRACE, "--kv-events", "{out}", "--steps", "10:"], "use --steps :B"),
])
def test_replay_kv_events_bad_input_is_one_line(args: list[str], message: str, tmp_path: Path) -> None:
    out = tmp_path / "events.kvev"
    res = CliRunner().invoke(app, ["replay", *[a.format(out=out) for a in args]])
    assert res.exit_code == 2, res.output
    assert message in res.stderr
    assert "Traceback" not in res.output
    assert not out.exists()


def test_the_background_emitter_writes_the_same_frames(tmp_path: Path) -> None:
    # The replay records its tree's changes; a child process hashes, encodes and writes.
    from kvtrace.events.emit import BackgroundEmitter
    from kvtrace.events.wire import FileTarget

    frames: list[Frame] = []
    options = ReplayOptions(on_oom="skip", stop_step=400)
    with ReplaySession(TRACE, pool_tokens=60_000, options=options, checker="inline") as session:
        emitter = Emitter(session, frames.append)
        for snap in session.snapshots():
            emitter.after(snap)
    path = tmp_path / "events.kvev"
    with ReplaySession(TRACE, pool_tokens=60_000, options=options, checker="inline") as session:
        background = BackgroundEmitter(session, FileTarget(str(path)))
        for snap in session.snapshots():
            background.after(snap)
        background.close()
    assert list(read_frames(path)) == frames
    assert background.summary() == emitter.summary()


def test_paced_batches_wait_for_their_trace_time() -> None:
    waits: list[float] = []
    times: list[float] = []
    options = ReplayOptions(stop_step=400)
    with ReplaySession(TRACE, options=options, checker="inline") as session:
        emitter = Emitter(session, lambda f: times.append(msgspec.msgpack.decode(f.payload)[0]), paced=True,
                          sleep=waits.append)
        for snap in session.snapshots():
            emitter.after(snap)
    assert len(times) > 2 and times == sorted(times)
    # The fake sleep lets no time pass: each wait is the batch's trace time since the
    # first batch, less the little real time the replay took.
    assert waits and max(waits) <= times[-1] - times[0]
    assert max(waits) > times[-1] - times[0] - 5.0


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_disk_in_the_child_is_one_error() -> None:
    from kvtrace.events.emit import BackgroundEmitter
    from kvtrace.events.wire import FileTarget

    options = ReplayOptions(stop_step=400)
    with ReplaySession(TRACE, options=options, checker="inline") as session:
        background = BackgroundEmitter(session, FileTarget("/dev/full"))
        with pytest.raises(EventStreamError, match="/dev/full: cannot write the events .No space left on device."):
            for snap in session.snapshots():
                background.after(snap)
            background.close()
