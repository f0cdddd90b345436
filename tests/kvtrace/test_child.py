"""The child process's pipes (``kvtrace.proc.child.pipe_writer``): every byte written arrives."""

from __future__ import annotations

import os
import threading

import pytest

from kvtrace.proc import child


def _read_all(fd: int, into: bytearray) -> None:
    while chunk := os.read(fd, 1 << 16):
        into.extend(chunk)
    os.close(fd)


@pytest.mark.parametrize("text", [False, True])
def test_a_pipe_writer_writes_the_rest_after_a_partial_write(monkeypatch: pytest.MonkeyPatch, text: bool) -> None:
    real_write = os.write
    calls = []

    def partial(fd: int, data: bytes) -> int:  # a write a signal interrupts: part of it
        calls.append(len(data))
        return real_write(fd, bytes(memoryview(data)[:777]))

    monkeypatch.setattr(child.os, "write", partial)
    read_fd, write_fd = os.pipe()
    got = bytearray()
    reader = threading.Thread(target=_read_all, args=(read_fd, got))
    reader.start()
    payload = bytes(range(256)) * 400  # 100 kB, past the buffer and the pipe's capacity
    out = child.pipe_writer(write_fd, text=text)
    if text:
        out.write(payload.hex() + "\n")
    else:
        out.write(payload[:10])
        out.write(payload[10:])
    out.close()
    reader.join(timeout=30)
    assert bytes(got) == ((payload.hex() + "\n").encode() if text else payload)
    assert len(calls) > 100  # it went through many partial writes


def test_a_pipe_writer_whose_reader_left_raises_once_then_drops(monkeypatch: pytest.MonkeyPatch) -> None:
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    out = child.pipe_writer(write_fd)
    with pytest.raises(BrokenPipeError):
        out.write(b"x" * 200_000)
    out.write(b"more")  # dropped: no second error, and closing does not raise
    out.close()
