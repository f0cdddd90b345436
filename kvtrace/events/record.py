"""Recording a live KV-event stream (a ZMQ SUB socket), filling its gaps.

A PUB socket drops what a subscriber cannot take and everything sent before it
subscribed. Where the publisher has a replay endpoint (SGLang's ``replay_endpoint``,
``kvtrace replay --kv-events-replay``), ``subscribe`` asks it for the batches missing
whenever a sequence number skips (and, with ``from_seq``, for those before the first one
received), and yields every frame once, in sequence order. A gap the publisher can no
longer fill stays a gap (``Subscription.lost``), for ``kvtrace events check`` to report.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvtrace.events.wire import END_SEQ, EventStreamError, Frame

__all__ = ["Subscription"]

REPLAY_TIMEOUT_S = 5.0  # how long a replay request may take before its gap counts as lost


@dataclass
class Subscription:
    """A live stream, read by iterating it.

    Args:
        endpoint: the publisher's PUB endpoint (``tcp://HOST:PORT``; connected to).
        topic: the topic prefix subscribed to.
        replay_endpoint: the publisher's replay endpoint (None: gaps stay gaps).
        from_seq: also fetch the batches from this sequence number up to the first one
            received (through the replay endpoint).
        idle_s: stop after this long without a frame, from the first one on (None: never).
        count: stop after this many frames (None: never).
        duration_s: stop after this long (None: never).
    """

    endpoint: str
    topic: bytes = b""
    replay_endpoint: str | None = None
    from_seq: int | None = None
    idle_s: float | None = None
    count: int | None = None
    duration_s: float | None = None
    frames: int = 0  # frames yielded
    recovered: int = 0  # of them, fetched through the replay endpoint
    lost: list[tuple[int, int]] = field(default_factory=list)  # (first, last) sequence numbers never received

    def __iter__(self) -> Iterator[Frame]:
        import zmq

        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        try:
            try:
                sub.connect(self.endpoint)
            except zmq.ZMQError as exc:
                raise EventStreamError(f"{self.endpoint}: cannot connect ({exc})") from None
            sub.setsockopt(zmq.SUBSCRIBE, self.topic)
            yield from self._frames(ctx, sub)
        finally:
            sub.close(linger=0)
            ctx.term()

    def _frames(self, ctx: object, sub: object) -> Iterator[Frame]:
        start = time.monotonic()
        last: float | None = None  # when the last frame came
        next_seq = self.from_seq
        while self.count is None or self.frames < self.count:
            now = time.monotonic()
            waits = [0.1]
            if self.idle_s is not None and last is not None:
                waits.append(self.idle_s - (now - last))
            if self.duration_s is not None:
                waits.append(self.duration_s - (now - start))
            wait = min(waits)
            if wait <= 0:
                return
            if not sub.poll(int(wait * 1000) + 1):  # type: ignore[attr-defined]
                continue
            parts = sub.recv_multipart()  # type: ignore[attr-defined]
            last = time.monotonic()
            if len(parts) != 3:
                continue
            frame = Frame(parts[0], int.from_bytes(parts[1], "big", signed=True), parts[2])
            if next_seq is not None and frame.seq < next_seq:
                continue  # already yielded (it came through the replay endpoint)
            if next_seq is not None and frame.seq > next_seq:
                for missed in self._fetch(ctx, next_seq, frame.seq):
                    yield missed
                    self.frames += 1
                    if self.count is not None and self.frames >= self.count:
                        return
            yield frame
            self.frames += 1
            next_seq = frame.seq + 1

    def _fetch(self, ctx: object, first: int, stop: int) -> list[Frame]:
        """Frames ``first .. stop - 1`` from the replay endpoint (what it still has)."""
        got: list[Frame] = []
        if self.replay_endpoint is not None:
            got = self._replay(ctx, first, stop)
        expected = first
        for frame in got:
            if frame.seq > expected:
                self.lost.append((expected, frame.seq - 1))
            expected = frame.seq + 1
        if expected < stop:
            self.lost.append((expected, stop - 1))
        self.recovered += len(got)
        return got

    def _replay(self, ctx: object, first: int, stop: int) -> list[Frame]:
        import zmq

        sock = ctx.socket(zmq.DEALER)  # type: ignore[attr-defined]
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart((b"", first.to_bytes(8, "big")))
            got: list[Frame] = []
            deadline = time.monotonic() + REPLAY_TIMEOUT_S
            while (left := deadline - time.monotonic()) > 0 and sock.poll(int(left * 1000) + 1):
                parts = sock.recv_multipart()
                if len(parts) != 4:
                    continue
                _, topic, seq_bytes, payload = parts
                if seq_bytes == END_SEQ:
                    break
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if first <= seq < stop and (not got or seq > got[-1].seq):
                    got.append(Frame(topic, seq, payload))
            return got
        finally:
            sock.close(linger=0)
