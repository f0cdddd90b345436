"""The child process's pipes (``kvtrace.proc.channel``): every byte written arrives, in
order, through a real pipe; a reader gone away is one error, not one per write."""

from __future__ import annotations

import os
import threading

import pytest

from kvtrace.proc.channel import chunk_reader, chunk_writer, connection, receive_all


def test_a_chunked_stream_arrives_whole_through_a_full_pipe() -> None:
    read_fd, write_fd = os.pipe()
    payload = bytes(range(256)) * 4000  # more than a chunk and more than the pipe holds
    got = bytearray()

    def read_all() -> None:
        with chunk_reader(read_fd) as reader:
            while chunk := reader.read(10_007):  # (reads that straddle the writer's chunks)
                got.extend(chunk)

    reader = threading.Thread(target=read_all)
    reader.start()
    with chunk_writer(connection(write_fd, readable=False)) as out:
        out.write(payload[:10])
        out.write(payload[10:500_000])
        for i in range(500_000, len(payload), 777):
            out.write(payload[i:i + 777])
    reader.join(timeout=30)
    assert bytes(got) == payload


def test_a_chunk_writer_whose_reader_left_raises_once_then_drops() -> None:
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    out = chunk_writer(connection(write_fd, readable=False))
    with pytest.raises(BrokenPipeError):
        out.write(b"x" * 200_000)
    out.write(b"more")  # dropped: no second error, and closing does not raise
    out.close()


def test_receive_all_returns_what_was_sent_until_the_writer_closed() -> None:
    read_fd, write_fd = os.pipe()
    writer = connection(write_fd, readable=False)
    for message in ({"kind": "start"}, (3, {"kind": "status"}), {"kind": "end"}):
        writer.send(message)
    writer.close()
    reader = connection(read_fd, writable=False)
    assert receive_all(reader) == [{"kind": "start"}, (3, {"kind": "status"}), {"kind": "end"}]
    assert reader.closed
