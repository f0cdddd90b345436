"""KV events over real ZMQ sockets between processes on the loopback: a replay publishing,
``kvtrace events record`` subscribing, gaps filled through the replay endpoint, and the
recording checked against the same trace."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvtrace.events.wire import EventStreamError, read_frames
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parents[2]
TRACE = "sample:mooncake-tiny"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kvtrace(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "kvtrace", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _done(proc: subprocess.Popen[str], timeout_s: float = 120) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout_s)
    return proc.returncode, out, err


def _check_against(path: Path) -> dict:
    code, out, err = _done(_kvtrace("events", "check", str(path), "--against", TRACE, "--json"))
    assert code in (0, 1), err
    return json.loads(out)


@pytest.mark.slow  # three processes, each replaying or recording the trace
def test_a_published_replay_recorded_by_a_subscriber_is_identical(tmp_path: Path) -> None:
    pub, rep = _free_port(), _free_port()
    out = tmp_path / "live.kvev"
    recorder = _kvtrace("events", "record", f"tcp://127.0.0.1:{pub}", "--replay-endpoint", f"tcp://127.0.0.1:{rep}",
                        "--from-seq", "0", "--idle", "2", "--duration", "90", "--out", str(out), "--json")
    publisher = _kvtrace("replay", TRACE, "--kv-events", f"tcp://127.0.0.1:{pub}", "--kv-events-replay",
                         f"tcp://127.0.0.1:{rep}", "--kv-events-wait", "5", "--json")
    code, stdout, err = _done(publisher)
    assert code == 0, err
    batches = json.loads(stdout)["kv_events"]["batches"]
    code, stdout, err = _done(recorder)
    assert code == 0, err
    recorded = json.loads(stdout)
    assert recorded["frames"] == batches > 0 and recorded["lost"] == []
    assert [f.seq for f in read_frames(out)] == list(range(batches))
    result = _check_against(out)
    assert result["ok"] and result["against"]["identical"], result["problems"][:3]


@pytest.mark.slow  # two processes, each replaying the trace
def test_a_live_stream_checked_against_the_trace_is_identical() -> None:
    pub = _free_port()
    checker = _kvtrace("events", "check", f"tcp://127.0.0.1:{pub}", "--idle", "2", "--duration", "90",
                       "--against", TRACE, "--json")
    publisher = _kvtrace("replay", TRACE, "--kv-events", f"tcp://127.0.0.1:{pub}", "--kv-events-wait", "20")
    code, stdout, err = _done(checker)
    assert code == 0, err
    assert _done(publisher)[0] == 0
    result = json.loads(stdout)
    assert result["ok"] and result["against"]["identical"] and result["batches"] == result["against"]["batches"]


# A publisher whose PUB socket drops one batch (seq DROP) that its replay buffer keeps:
# what a slow subscriber past the high-water mark sees.
_DROPPING_PUBLISHER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from kvtrace.events.wire import ZmqPublisher, read_frames
    source, pub, rep, drop = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    publisher = ZmqPublisher(pub, replay_endpoint=rep, wait_s=20)  # until the recorder leaves
    for frame in read_frames(Path(source)):
        publisher.send(frame, publish=frame.seq != drop)
    publisher.close()
""")


def _dropping_publisher(source: Path, pub: int, rep: int, drop: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _DROPPING_PUBLISHER, str(source), f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}",
         str(drop)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


@pytest.mark.slow  # seven processes
def test_a_dropped_batch_is_recovered_through_the_replay_endpoint_or_reported(tmp_path: Path) -> None:
    source = tmp_path / "source.kvev"
    code, _, err = _done(_kvtrace("replay", TRACE, "--kv-events", str(source)))
    assert code == 0, err
    num = len(list(read_frames(source)))
    drop = num // 2
    # With the replay endpoint: the recorder asks for the missing batch and gets it.
    pub, rep = _free_port(), _free_port()
    out = tmp_path / "recovered.kvev"
    recorder = _kvtrace("events", "record", f"tcp://127.0.0.1:{pub}", "--replay-endpoint", f"tcp://127.0.0.1:{rep}",
                        "--idle", "2", "--duration", "90", "--out", str(out), "--json")
    publisher = _dropping_publisher(source, pub, rep, drop)
    code, stdout, err = _done(recorder)
    assert code == 0, err
    assert _done(publisher)[0] == 0
    recorded = json.loads(stdout)
    assert (recorded["frames"], recorded["recovered"], recorded["lost"]) == (num, 1, [])
    assert list(read_frames(out)) == list(read_frames(source))
    # Without it: the gap stays, the recorder warns, and the check names the step and blocks.
    pub, rep = _free_port(), _free_port()
    out = tmp_path / "gap.kvev"
    recorder = _kvtrace("events", "record", f"tcp://127.0.0.1:{pub}", "--idle", "2", "--duration", "90",
                        "--out", str(out), "--json")
    publisher = _dropping_publisher(source, pub, rep, drop)
    code, stdout, err = _done(recorder)
    publisher.send_signal(signal.SIGTERM)
    _done(publisher)
    assert code == 0, err
    assert json.loads(stdout)["lost"] == [{"first": drop, "last": drop}]
    assert f"batches {drop}..{drop} were never received" in err
    result = _check_against(out)
    assert not result["ok"]
    gap = result["problems"][0]
    assert (gap["kind"], gap["seq"]) == ("gap", drop + 1)
    assert result["against"]["first_divergence"]["seq"] == drop


def _num_frames(path: Path) -> int:
    try:
        return len(list(read_frames(path)))
    except EventStreamError:  # not started, or a frame being written
        return -1


def test_sigterm_ends_a_recording_with_every_batch_on_disk(tmp_path: Path) -> None:
    source = tmp_path / "source.kvev"
    code, _, err = _done(_kvtrace("replay", TRACE, "--kv-events", str(source)))
    assert code == 0, err
    num = len(list(read_frames(source)))
    pub, rep = _free_port(), _free_port()
    out = tmp_path / "stopped.kvev"
    recorder = _kvtrace("events", "record", f"tcp://127.0.0.1:{pub}", "--out", str(out), "--json")
    publisher = _dropping_publisher(source, pub, rep, -1)  # drops nothing, stays until the recorder leaves
    wait_until(lambda: _num_frames(out) == num, 60, "the recorder's file to hold every batch")
    recorder.send_signal(signal.SIGTERM)
    code, stdout, err = _done(recorder)
    assert code == 0, err
    assert list(read_frames(out)) == list(read_frames(source))
    assert json.loads(stdout)["frames"] == num
    assert _done(publisher)[0] == 0
