"""``kvtrace events check`` (``kvtrace.events.check``): a replay's own stream is identical to
the replay; planted faults are each reported with their step and block."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.events.blocks import GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvtrace.events.check import StreamChecker, check_stream
from kvtrace.events.emit import Emitter
from kvtrace.events.wire import EventFileWriter, Frame, encode
from kvtrace.replay.session import ReplaySession

TRACE = "sample:mooncake-tiny"


@pytest.fixture(scope="module")
def stream() -> tuple[list[KVEventBatch], list[int]]:
    """The batches a replay of TRACE publishes, and the step of each."""
    frames: list[Frame] = []
    steps: list[int] = []
    with ReplaySession(TRACE, checker="inline") as session:
        emitter = Emitter(session, frames.append)
        for snap in session.snapshots():
            before = len(frames)
            emitter.after(snap)
            if len(frames) > before:
                steps.append(snap.step)
    return [msgspec.msgpack.decode(f.payload, type=KVEventBatch) for f in frames], steps


def _write(path: Path, batches: list[KVEventBatch], seqs: list[int] | None = None) -> Path:
    with open(path, "wb") as f:
        writer = EventFileWriter(f)
        for i, batch in enumerate(batches):
            writer.write(Frame(b"", i if seqs is None else seqs[i], encode(batch)))
    return path


def _check(path: Path, *against: str) -> tuple[int, dict]:
    res = CliRunner().invoke(app, ["events", "check", str(path), *against, "--json"])
    assert res.exit_code in (0, 1), res.output
    return res.exit_code, json.loads(res.stdout)


def _with(batch: KVEventBatch, events: list) -> KVEventBatch:
    return KVEventBatch(ts=batch.ts, events=events, attn_dp_rank=batch.attn_dp_rank)


def _first(batches: list[KVEventBatch], kind: type, start: int = 1) -> int:
    return next(k for k in range(start, len(batches)) if any(isinstance(e, kind) for e in batches[k].events))


def test_the_replays_own_stream_is_identical(stream, tmp_path: Path) -> None:
    batches, steps = stream
    code, out = _check(_write(tmp_path / "ok.kvev", batches), "--against", TRACE)
    assert code == 0
    assert out["ok"] and out["problems"] == [] and out["against"]["identical"]
    assert out["against"]["batches"] == len(batches) and out["against"]["last_step"] == steps[-1]
    assert out["media"]["GPU"]["removed"] > 0


def test_a_dropped_batch_is_a_gap_and_a_divergence_at_its_step(stream, tmp_path: Path) -> None:
    batches, steps = stream
    k = _first(batches, BlockStored, 3)
    stored = next(e for e in batches[k].events if isinstance(e, BlockStored)).block_hashes[0]
    seqs = [i for i in range(len(batches)) if i != k]
    code, out = _check(_write(tmp_path / "drop.kvev", [batches[i] for i in seqs], seqs), "--against", TRACE)
    assert code == 1
    gap = out["problems"][0]
    assert (gap["kind"], gap["seq"], gap["step"]) == ("gap", k + 1, steps[k + 1])
    first = out["against"]["first_divergence"]
    assert first["step"] == steps[k]
    assert stored in [b["block"] for b in first["replay_only"]] or first["blocks"] > len(first["replay_only"])


def test_a_reordered_remove_diverges_at_its_step(stream, tmp_path: Path) -> None:
    batches, steps = stream
    k = _first(batches, BlockRemoved)
    removed = next(e for e in batches[k].events if isinstance(e, BlockRemoved))
    moved = list(batches)
    moved[k] = _with(batches[k], [e for e in batches[k].events if e is not removed])
    moved[k + 1] = _with(batches[k + 1], [removed, *batches[k + 1].events])
    code, out = _check(_write(tmp_path / "reorder.kvev", moved), "--against", TRACE)
    assert code == 1
    first = out["against"]["first_divergence"]
    assert first["step"] == steps[k]
    assert first["blocks"] == len(removed.block_hashes)
    assert {b["block"] for b in first["stream_only"]} <= set(removed.block_hashes)
    assert out["against"]["divergent_steps"] == 1  # the late remove puts it right


def test_a_missing_clear_shows_as_duplicate_stores(stream, tmp_path: Path) -> None:
    # The engine restarted (its tree reset): the second run's AllBlocksCleared was lost.
    batches, _ = stream
    second = [_with(batches[0], [e for e in batches[0].events if not isinstance(e, AllBlocksCleared)]), *batches[1:]]
    code, out = _check(_write(tmp_path / "noclear.kvev", batches + second))
    assert code == 1
    dup = out["problems"][0]
    assert (dup["kind"], dup["seq"], dup["medium"]) == ("duplicate-store", len(batches), GPU)
    first_store = next(e for e in batches[0].events if isinstance(e, BlockStored))
    assert dup["block"] == first_store.block_hashes[0]
    # With the clear, the same two runs are clean.
    code, out = _check(_write(tmp_path / "clear.kvev", batches + batches))
    assert code == 0, out["problems"][:3]


def test_a_remove_of_a_block_never_stored(stream, tmp_path: Path) -> None:
    batches, steps = stream
    k = 5
    planted = list(batches)
    planted[k] = _with(batches[k], [*batches[k].events, BlockRemoved(block_hashes=[12345], medium=GPU)])
    code, out = _check(_write(tmp_path / "unknown.kvev", planted), "--against", TRACE)
    assert code == 1
    [p] = out["problems"]
    assert (p["kind"], p["seq"], p["step"], p["block"]) == ("unknown-remove", k, steps[k], 12345)


def test_a_mid_chain_removal(stream, tmp_path: Path) -> None:
    batches, steps = stream
    k = _first(batches, BlockStored, 2)
    store = next(e for e in batches[k].events if isinstance(e, BlockStored) and len(e.block_hashes) > 1)
    planted = list(batches)
    planted[k] = _with(batches[k], [*batches[k].events, BlockRemoved(block_hashes=[store.block_hashes[0]], medium=GPU)])
    code, out = _check(_write(tmp_path / "mid.kvev", planted), "--against", TRACE)
    assert code == 1
    mid = out["problems"][0]
    assert (mid["kind"], mid["seq"], mid["step"], mid["block"]) == ("mid-chain-removal", k, steps[k],
                                                                     store.block_hashes[0])


def test_vllm_positional_and_map_forms_and_a_dropped_medium() -> None:
    positional = msgspec.msgpack.encode([1.0, [
        ["AllBlocksCleared"],
        ["BlockStored", [1, 2], None, [7, 8], 1, None, "GPU"],
        ["BlockStored", [b"\x03"], 2, [9], 1, None, "GPU"],
    ], 0])
    mapped = msgspec.msgpack.encode({"ts": 2.0, "events": [
        {"type": "BlockRemoved", "block_hashes": [b"\x03"], "medium": "GPU"},
        {"type": "BlockRemoved", "block_hashes": [2]},  # its medium tag dropped
    ]})
    result = check_stream([Frame(b"", 0, positional), Frame(b"", 1, mapped)])
    [p] = result.checker.problems
    assert (p.kind, p.seq, p.medium, p.block) == ("unknown-remove", 1, None, 2)
    assert result.checker.media_summary()["GPU"] == {"stored": 3, "removed": 1, "held": 2}
    assert result.checker.num_cleared == 1


def test_undecodable_and_out_of_order_frames_are_problems_not_crashes() -> None:
    checker = StreamChecker()
    checker.feed(Frame(b"", 0, b"\xc1"))
    checker.feed(Frame(b"", 2, msgspec.msgpack.encode([0.0, [["Nope"]]])))
    checker.feed(Frame(b"", 1, msgspec.msgpack.encode([0.0, []])))
    assert [p.kind for p in checker.problems] == ["bad-payload", "gap", "bad-payload", "out-of-order"]


@pytest.mark.parametrize(("args", "message"), [
    (["events", "check", "{tmp}/none.kvev"], "no such file"),
    (["events", "check", "{tmp}/junk.kvev"], "not a kvtrace KV-event file"),
    (["events", "check", "{tmp}/junk.kvev", "--page-size", "1"], "add --against"),
    (["events", "check", "{tmp}/junk.kvev", "--idle", "1"], "is a file"),
    (["events", "check", "{tmp}/ok.kvev", "--against", "sample:tiny"], "EAGLE"),
    (["events", "record", "udp://x:1", "--out", "{tmp}/r.kvev"], "tcp://HOST:PORT"),
    (["events", "record", "tcp://127.0.0.1:1", "--from-seq", "0", "--out", "{tmp}/r.kvev"], "--replay-endpoint"),
    (["events", "record", "tcp://127.0.0.1:1", "--out", "{tmp}/ok.kvev"], "already exists"),
])
def test_bad_input_is_one_line_exit_2(args: list[str], message: str, tmp_path: Path) -> None:
    (tmp_path / "junk.kvev").write_bytes(b"hello")
    _write(tmp_path / "ok.kvev", [])
    res = CliRunner().invoke(app, [a.format(tmp=tmp_path) for a in args])
    assert res.exit_code == 2, res.output
    assert message in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
