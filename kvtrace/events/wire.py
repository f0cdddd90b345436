"""SGLang's KV-event wire format: to a file, or a ZMQ PUB socket with a replay endpoint.

On the wire a batch is one ZMQ multipart message of three frames: the topic, the
sequence number (8 bytes, big-endian, from 0, one per batch) and the msgpack payload
(``kvtrace.events.blocks.KVEventBatch``). A publisher with a replay endpoint (a ROUTER
socket) answers a request ``[b"", start_seq]`` with every batch it still holds from
``start_seq`` on, each ``[b"", topic, seq, payload]``, then ``[b"", b"", END_SEQ, b""]``.

A file of events holds the same frames: ``MAGIC``, then for each batch the topic and
the payload, each after its length (4 bytes, big-endian), with the sequence number's
8 bytes between them.
"""

from __future__ import annotations

import struct
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NamedTuple

from kvtrace.errors import KvtraceError

if TYPE_CHECKING:
    from kvtrace.events.blocks import KVEventBatch

__all__ = [
    "END_SEQ",
    "MAGIC",
    "EventFileWriter",
    "EventStreamError",
    "FileTarget",
    "Frame",
    "ZmqPublisher",
    "ZmqTarget",
    "encode",
    "is_endpoint",
    "open_target",
    "read_frames",
]

MAGIC = b"KVTRACE-KV-EVENTS\x01\n"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_LEN = struct.Struct(">I")


class EventStreamError(KvtraceError):
    """An event stream (file or socket) that cannot be read or written."""


class Frame(NamedTuple):
    """One published batch as it travels."""

    topic: bytes
    seq: int
    payload: bytes  # msgpack of a KVEventBatch


def is_endpoint(target: str) -> bool:
    """Whether ``target`` names a ZMQ endpoint rather than a file."""
    return target.startswith(("tcp://", "ipc://", "inproc://"))


_ENCODER: Any = None


def encode(batch: KVEventBatch) -> bytes:
    """The msgpack payload of ``batch``."""
    global _ENCODER
    if _ENCODER is None:
        import msgspec

        _ENCODER = msgspec.msgpack.Encoder()
    return _ENCODER.encode(batch)


class EventFileWriter:
    """Writes frames to an event file (``MAGIC`` first)."""

    def __init__(self, out: IO[bytes]) -> None:
        self._out = out
        out.write(MAGIC)

    def write(self, frame: Frame) -> None:
        out = self._out
        out.write(_LEN.pack(len(frame.topic)))
        out.write(frame.topic)
        out.write(frame.seq.to_bytes(8, "big", signed=True))
        out.write(_LEN.pack(len(frame.payload)))
        out.write(frame.payload)

    def flush(self) -> None:
        self._out.flush()


def read_frames(path: Path) -> Iterator[Frame]:
    """The frames of an event file, in file order, read as they are yielded.

    Raises:
        EventStreamError: not an event file, or cut inside a frame (names the file and
            the byte offset).
    """
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise EventStreamError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    with f:
        if f.read(len(MAGIC)) != MAGIC:
            raise EventStreamError(
                f"{path}: not a kvtrace KV-event file (it does not start with {MAGIC[:-2].decode()})"
            )
        pos = len(MAGIC)
        while True:
            head = f.read(4)
            if not head:
                return
            start = pos
            if len(head) < 4:
                _cut(path, start)
            (tlen,) = _LEN.unpack(head)
            rest = f.read(tlen + 12)
            if len(rest) < tlen + 12:
                _cut(path, start)
            topic = rest[:tlen]
            seq = int.from_bytes(rest[tlen : tlen + 8], "big", signed=True)
            (plen,) = _LEN.unpack_from(rest, tlen + 8)
            payload = f.read(plen)
            if len(payload) < plen:
                _cut(path, start)
            pos += 4 + tlen + 12 + plen
            yield Frame(topic, seq, payload)


def _cut(path: Path, start: int) -> None:
    raise EventStreamError(f"{path}: cut short inside the frame at byte {start}; the frames before it are whole")


class ZmqPublisher:
    """Publishes frames on a ZMQ PUB socket, as SGLang's ``ZmqEventPublisher`` does, with
    an optional replay endpoint answered from the last ``buffer_steps`` batches.

    Args:
        endpoint: where the PUB socket binds (``tcp://*:5557``, ``tcp://127.0.0.1:5557``).
        replay_endpoint: where the replay ROUTER binds (None: no replay).
        wait_s: wait at most this long for a first subscriber before publishing (a PUB
            socket drops what it sends before anyone subscribed), and after the last
            batch keep answering replay requests until every subscriber has left, at
            most this long.
        buffer_steps: batches kept for replay.

    Raises:
        EventStreamError: an endpoint cannot be bound.
    """

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None, wait_s: float = 0.0,
                 buffer_steps: int = 10_000) -> None:
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context()
        # XPUB: a PUB socket that also reports subscriptions, so the wait can end on the first.
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.XPUB_VERBOSER, 1)  # every (un)subscription, to count subscribers
        self._pub.setsockopt(zmq.SNDHWM, 0)  # never drop what a slow subscriber has not read
        self.subscribers = 0
        self._replay = None
        self.wait_s = wait_s
        self._buffer: deque[Frame] = deque(maxlen=buffer_steps)
        try:
            self._pub.bind(_bindable(endpoint))
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(_bindable(replay_endpoint))
        except zmq.ZMQError as exc:
            self.close(linger_s=0)
            raise EventStreamError(f"--kv-events {endpoint}: cannot bind ({exc})") from None
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._waited = False

    def _wait_for_subscriber(self) -> None:
        self._waited = True
        if self.wait_s > 0 and self._pub.poll(int(self.wait_s * 1000)):
            self._count_subscribers()

    def _count_subscribers(self) -> None:
        """Read the (un)subscription messages waiting: 1 then the topic, or 0 then the topic."""
        while self._pub.poll(0):
            message = self._pub.recv()
            if message[:1] == b"\x01":
                self.subscribers += 1
            elif message[:1] == b"\x00":
                self.subscribers = max(self.subscribers - 1, 0)

    def send(self, frame: Frame, *, publish: bool = True) -> None:
        """Publish ``frame`` (``publish=False``: keep it for replay only, as if the PUB
        socket had dropped it) and answer any replay request waiting."""
        if not self._waited:
            self._wait_for_subscriber()
        if publish:
            self._pub.send_multipart((frame.topic, frame.seq.to_bytes(8, "big"), frame.payload))
        self._buffer.append(frame)
        self._serve_replay(0)

    def _serve_replay(self, timeout_ms: int) -> bool:
        replay = self._replay
        if replay is None or not replay.poll(timeout_ms):
            return False
        request = replay.recv_multipart()
        if len(request) != 3:
            return True
        client, _, start = request
        first = int.from_bytes(start, "big")
        for frame in list(self._buffer):
            if frame.seq >= first:
                replay.send_multipart((client, b"", frame.topic, frame.seq.to_bytes(8, "big"), frame.payload))
        replay.send_multipart((client, b"", b"", END_SEQ, b""))
        return True

    def close(self, linger_s: float | None = None) -> None:
        """Answer replay requests until the subscribers leave (at most ``linger_s``, by
        default ``wait_s``), deliver what is queued, close."""
        linger = self.wait_s if linger_s is None else linger_s
        deadline = time.monotonic() + linger
        while self._replay is not None and (left := deadline - time.monotonic()) > 0:
            self._count_subscribers()
            if self._waited and not self.subscribers:
                break
            self._serve_replay(int(min(left, 0.05) * 1000) + 1)
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=int(max(linger, 1.0) * 1000))
        self._ctx.term()


def _bindable(endpoint: str) -> str:
    """``tcp://HOST:0`` binds a free port (ZMQ's spelling is ``tcp://HOST:*``)."""
    return endpoint[:-2] + ":*" if endpoint.startswith("tcp://") and endpoint.endswith(":0") else endpoint


@dataclass(frozen=True, slots=True)
class FileTarget:
    """Frames go to an event file at ``path`` (created or truncated)."""

    path: str

    def __str__(self) -> str:
        return self.path


@dataclass(frozen=True, slots=True)
class ZmqTarget:
    """Frames are published on a ZMQ PUB socket (``ZmqPublisher``'s arguments)."""

    endpoint: str
    replay_endpoint: str | None = None
    wait_s: float = 0.0

    def __str__(self) -> str:
        return self.endpoint


def open_target(target: FileTarget | ZmqTarget) -> tuple[Callable[[Frame], None], Callable[[], None]]:
    """Open ``target``: the function that sends a frame, and the one that closes it.

    Raises:
        EventStreamError: it cannot be opened.
    """
    if isinstance(target, ZmqTarget):
        publisher = ZmqPublisher(target.endpoint, replay_endpoint=target.replay_endpoint, wait_s=target.wait_s)
        return publisher.send, publisher.close
    try:
        f = open(target.path, "wb")
    except OSError as exc:
        raise EventStreamError(f"{target.path}: cannot write it ({exc.strerror or exc})") from None
    writer = EventFileWriter(f)
    return writer.write, f.close
