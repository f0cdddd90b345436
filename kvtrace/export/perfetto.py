"""The timeline as a Perfetto trace (``.pftrace``: the ``Trace`` protobuf of Perfetto's
trace format), written packet by packet through the ``perfetto`` package's streaming
builder: nothing but the open tracks is held, whatever the length of the replay.

One replay is one process (``PerfettoProcess``): under it a counter track per pool and
counter, a hit-rate track, one track per request lane, and an ``events`` track of
instants; flows (``--flows``) join an instant on the evicting request's lane to one on
the missing admission's lane. Tracks are described (``TrackDescriptor``) the first time they are used. A
file may hold several processes on one clock (``kvtrace diff --export``: the two sides),
each on its own packet sequence.
"""

from __future__ import annotations

from typing import IO, Any

from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import TracePacket, TrackEvent
from perfetto.trace_builder.proto_builder import StreamingTraceProtoBuilder

from kvtrace.export.timeline import COUNTERS, Counters, Flow, HitRate, Instant, Record, SliceBegin, SliceEnd

__all__ = ["PerfettoFile", "PerfettoProcess"]

_UUIDS_PER_PROCESS = 1 << 32
# Track uuids within a process: the process, its events, the hit rate, then counters and lanes.
_PROCESS, _EVENTS, _HIT_RATE, _FIRST_FREE = range(4)


class PerfettoFile:
    """A Perfetto trace being written to ``file`` (binary, open for writing)."""

    def __init__(self, file: IO[bytes]) -> None:
        self._builder = StreamingTraceProtoBuilder(file)
        self._sequences = 0

    def process(self, name: str, pid: int | None = None) -> PerfettoProcess:
        """A new process in the file, named ``name`` (pid: 1, 2, ... in order of creation)."""
        self._sequences += 1
        return PerfettoProcess(self._builder, name, pid=pid or self._sequences, sequence_id=self._sequences)


class PerfettoProcess:
    """The tracks of one replay in a Perfetto trace; ``write`` one timeline record at a time.

    Args:
        builder: the file's streaming builder.
        name: the process's name in the viewer (the trace and the allocator version).
        pid: its process id in the viewer.
        sequence_id: its packet sequence (one per process).
    """

    def __init__(self, builder: StreamingTraceProtoBuilder, name: str, *, pid: int, sequence_id: int) -> None:
        self._builder = builder
        self._sequence_id = sequence_id
        self._base = pid * _UUIDS_PER_PROCESS
        self._next_uuid = self._base + _FIRST_FREE
        self._counter_tracks: dict[str, list[int]] = {}  # pool -> uuid per COUNTERS entry
        self._lanes: list[int] = []  # lane -> uuid
        self._hit_rate = False
        first = self._packet(0)
        first.sequence_flags = TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
        first.ClearField("timestamp")
        first.track_descriptor.uuid = self._base + _PROCESS
        first.track_descriptor.process.pid = pid
        first.track_descriptor.process.process_name = name
        self._builder.write_packet(first)
        self._describe(self._base + _EVENTS, "events")
        self._dispatch = {
            Counters: self._counters,
            HitRate: self._hit,
            SliceBegin: self._begin,
            SliceEnd: self._end,
            Instant: self._instant,
            Flow: self._flow,
        }

    def write(self, record: Record) -> None:
        """Write one timeline record (its packet, after the descriptors of new tracks)."""
        self._dispatch[type(record)](record)

    def marker(self, ts_ns: int, name: str, args: dict[str, Any]) -> None:
        """An instant named ``name`` on the events track (the first divergence of a diff)."""
        packet, event = self._event(ts_ns, TrackEvent.TYPE_INSTANT, self._base + _EVENTS)
        event.name = name
        _annotate(event, args)
        self._builder.write_packet(packet)

    # ------------------------------------------------------------------ records
    def _counters(self, rec: Counters) -> None:
        uuids = self._counter_tracks.get(rec.pool)
        if uuids is None:
            uuids = []
            for counter in COUNTERS:
                uuid = self._new_uuid()
                self._describe(uuid, f"{rec.pool} {counter}", unit="tokens")
                uuids.append(uuid)
            self._counter_tracks[rec.pool] = uuids
        packet, event = self._event(rec.ts_ns, TrackEvent.TYPE_COUNTER, uuids[0])
        event.counter_value = rec.values[0]
        # One packet for the pool: the other counters ride along as extra counter values.
        event.extra_counter_track_uuids.extend(uuids[1:])
        event.extra_counter_values.extend(rec.values[1:])
        self._builder.write_packet(packet)

    def _hit(self, rec: HitRate) -> None:
        uuid = self._base + _HIT_RATE
        if not self._hit_rate:
            self._describe(uuid, "prefix hit rate", unit="%")
            self._hit_rate = True
        packet, event = self._event(rec.ts_ns, TrackEvent.TYPE_COUNTER, uuid)
        event.double_counter_value = 100.0 * rec.value
        self._builder.write_packet(packet)

    def _lane(self, lane: int) -> int:
        while len(self._lanes) <= lane:
            uuid = self._new_uuid()
            self._describe(uuid, f"lane {len(self._lanes)}", rank=len(self._lanes))
            self._lanes.append(uuid)
        return self._lanes[lane]

    def _begin(self, rec: SliceBegin) -> None:
        packet, event = self._event(rec.ts_ns, TrackEvent.TYPE_SLICE_BEGIN, self._lane(rec.lane))
        event.name = rec.name
        _annotate(event, rec.args)
        self._builder.write_packet(packet)

    def _end(self, rec: SliceEnd) -> None:
        packet, event = self._event(rec.ts_ns, TrackEvent.TYPE_SLICE_END, self._lane(rec.lane))
        _annotate(event, rec.args)
        self._builder.write_packet(packet)

    def _instant(self, rec: Instant) -> None:
        packet, event = self._event(rec.ts_ns, TrackEvent.TYPE_INSTANT, self._base + _EVENTS)
        event.name = rec.kind
        _annotate(event, {"rid": rec.rid, "tokens": rec.tokens, "detail": rec.detail or None})
        self._builder.write_packet(packet)

    def _flow(self, rec: Flow) -> None:
        # Two instants joined by a flow id (unique in the file: the process's uuid base);
        # the source is in the past of the stream, which the trace processor sorts.
        flow_id = self._base + rec.flow_id
        src = self._base + _EVENTS if rec.src_lane is None else self._lane(rec.src_lane)
        packet, event = self._event(rec.src_ts_ns, TrackEvent.TYPE_INSTANT, src)
        event.name = "evicted prefix"
        event.flow_ids.append(flow_id)
        _annotate(event, rec.src_args)
        self._builder.write_packet(packet)
        packet, event = self._event(rec.ts_ns, TrackEvent.TYPE_INSTANT, self._lane(rec.lane))
        event.name = "missed evicted prefix"
        event.terminating_flow_ids.append(flow_id)
        _annotate(event, rec.args)
        self._builder.write_packet(packet)

    # ------------------------------------------------------------------ packets
    def _new_uuid(self) -> int:
        uuid = self._next_uuid
        self._next_uuid += 1
        return uuid

    def _packet(self, ts_ns: int) -> TracePacket:
        packet = self._builder.create_packet()
        packet.timestamp = ts_ns
        packet.trusted_packet_sequence_id = self._sequence_id
        return packet

    def _event(self, ts_ns: int, kind: int, track: int) -> tuple[TracePacket, TrackEvent]:
        packet = self._packet(ts_ns)
        event = packet.track_event
        event.type = kind
        event.track_uuid = track
        return packet, event

    def _describe(self, uuid: int, name: str, *, unit: str | None = None, rank: int | None = None) -> None:
        packet = self._packet(0)
        packet.ClearField("timestamp")
        desc = packet.track_descriptor
        desc.uuid = uuid
        desc.parent_uuid = self._base + _PROCESS
        desc.name = name
        if unit is not None:
            desc.counter.unit_name = unit
        if rank is not None:
            desc.sibling_order_rank = rank
        self._builder.write_packet(packet)


def _annotate(event: TrackEvent, args: dict[str, Any]) -> None:
    for key, value in args.items():
        if value is None:
            continue
        note = event.debug_annotations.add()
        note.name = key
        if isinstance(value, bool):
            note.bool_value = value
        elif isinstance(value, int):
            note.int_value = value
        elif isinstance(value, float):
            note.double_value = value
        else:
            note.string_value = str(value)
