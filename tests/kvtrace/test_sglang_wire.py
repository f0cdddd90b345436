"""The pipe protocol of the SGLang driver (``kvtrace.sglang.wire``): each message's round
trip through real pipes, what fails at the boundary (an unknown method, a malformed frame,
a class in a message), a closed pipe, and the server loop and the client over it. None of
it needs SGLang: the server answers what comes before ``init`` without importing it.
"""

from __future__ import annotations

import inspect
import os
import pickle
import stat
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from allocator.base import AllocatorConfig
from kvtrace.sglang import server, wire
from kvtrace.versions.sglang import SGLangAllocator, SGLangError


def _channels() -> tuple[wire.Channel, wire.Channel, int, int]:
    """Two channels joined by two real pipes: kvtrace's side, the driver's side, and the
    write ends of the requests' and the replies' pipes (for frames written by hand)."""
    requests_r, requests_w = os.pipe()
    replies_r, replies_w = os.pipe()
    return wire.Channel(replies_r, requests_w), wire.Channel(requests_r, replies_w), requests_w, replies_w


@pytest.fixture()
def pair() -> Iterator[tuple[wire.Channel, wire.Channel]]:
    client, driver, _, _ = _channels()
    yield client, driver
    client.close()
    driver.close()


def _raw_frame(fd: int, payload: bytes) -> None:
    """One frame written by hand (multiprocessing.connection's: a 4-byte big-endian length)."""
    os.write(fd, struct.pack("!i", len(payload)) + payload)


def test_each_message_round_trips_through_a_pipe(pair: tuple[wire.Channel, wire.Channel]) -> None:
    client, driver = pair
    values = np.array([3, -1, 2**40], np.int64)
    call = wire.Call("extend", (wire.pack_ints(values), [b""], None, b"\x01"))
    batch = wire.Batch((wire.Call("end_step"), wire.Call("request_lens", (wire.pack_ints([7]),)), wire.Call("counters")))
    for request in (call, batch, wire.Call("init", ({"pool_tokens": 64, "spec": None},))):
        client.send(request)
        assert driver.recv_request() == request
    for reply in (wire.Ok(("ok", 2, 0, wire.pack_ints([0, 5]), [(1, 9, 8)])), wire.Ok(None),
                  wire.Error("ValueError: release: request rid=3 holds no KV", "Traceback ...")):
        driver.send(reply)
        assert client.recv_reply() == reply
    # integer arrays: little-endian int64 bytes, whatever numpy the other side runs
    (packed, *_) = call.args
    assert packed == struct.pack("<3q", 3, -1, 2**40)
    assert np.frombuffer(packed, "<i8").tolist() == values.tolist()


def test_each_message_has_one_serialisation_of_builtins() -> None:
    assert pickle.loads(wire.encode(wire.Call("decode", (b"\x01",)))) == ("decode", (b"\x01",))
    assert pickle.loads(wire.encode(wire.Batch((wire.Call("counters"),)))) == ("batch", (("counters", ()),))
    assert pickle.loads(wire.encode(wire.Ok([1]))) == ("ok", [1])
    assert pickle.loads(wire.encode(wire.Error("E: x", "tb"))) == ("error", "E: x", "tb")
    with pytest.raises(TypeError, match="not a wire message: tuple"):
        wire.encode(("decode", ()))  # type: ignore[arg-type]


def test_an_unknown_method_fails_at_the_boundary_naming_it() -> None:
    with pytest.raises(wire.WireError, match=r"unknown method 'alloc_everything' \(known: check_integrity, "):
        wire.Call("alloc_everything")
    # a frame naming one (another kvtrace's client, say) fails where it is read
    with pytest.raises(wire.WireError, match="unknown method 'batch'"):
        wire.decode_request(pickle.dumps(("batch", (("batch", ()),))))
    with pytest.raises(wire.WireError, match="unknown method '_oom'"):
        wire.decode_request(pickle.dumps(("_oom", ())))


@pytest.mark.parametrize(
    ("data", "decode", "message"),
    [
        (b"not a pickle", wire.decode_request, r"malformed request \(12 bytes\): UnpicklingError"),
        (pickle.dumps(("decode", [b""])), wire.decode_request, r"malformed call: expected \(method, args\)"),
        (pickle.dumps(("batch", [("counters", ())])), wire.decode_request, "malformed batch"),
        (pickle.dumps(("ok", 1))[:-3], wire.decode_reply, r"malformed reply \(\d+ bytes\)"),
        (pickle.dumps(("fine", 1)), wire.decode_reply, r"malformed reply: expected \('ok', value\)"),
        (pickle.dumps(("ok", np.int64(3))), wire.decode_reply, "plain Python values only, not numpy"),
    ],
)
def test_a_malformed_frame_fails_clearly(data: bytes, decode: object, message: str) -> None:
    with pytest.raises(wire.WireError, match=message):
        decode(data)  # type: ignore[operator]


def test_a_closed_pipe_raises_wire_closed() -> None:
    client, driver, _, replies_w = _channels()
    os.write(replies_w, struct.pack("!i", 100) + b"abc")  # a reply cut short by its writer's exit
    driver.close()
    with pytest.raises(wire.WireClosed, match="end of file during message"):
        client.recv_reply()
    with pytest.raises(wire.WireClosed, match="the pipe closed"):
        client.recv_reply()
    with pytest.raises(wire.WireClosed, match="the pipe closed"):
        client.send(wire.Call("counters"))  # nobody reads the requests any more
    client.close()


def test_methods_are_the_servers_calls() -> None:
    public = {name for name, _ in inspect.getmembers(server.AllocatorServer, inspect.isfunction) if not name.startswith("_")}
    assert wire.METHODS == public | {"init"}


def test_the_server_loop() -> None:
    """Over real pipes, without SGLang: a call before ``init``, a frame that is no request and
    an ``init`` inside a batch are answered ``Error``; the loop ends with 0 when the pipe closes."""
    client, driver, requests_w, _ = _channels()
    exit_code: list[int] = []
    thread = threading.Thread(target=lambda: exit_code.append(server.serve(driver)), daemon=True)
    thread.start()
    client.send(wire.Call("counters"))
    reply = client.recv_reply()
    assert isinstance(reply, wire.Error) and reply.text == "ValueError: counters: no init first"
    _raw_frame(requests_w, pickle.dumps(("shrink_pool", ())))
    reply = client.recv_reply()
    assert isinstance(reply, wire.Error) and reply.text.startswith("WireError: unknown method 'shrink_pool'")
    client.send(wire.Batch((wire.Call("init", ({},)),)))
    reply = client.recv_reply()
    assert isinstance(reply, wire.Error) and reply.text == "ValueError: init: not inside a batch"
    client.close()
    thread.join(10)
    assert exit_code == [0]
    driver.close()


def test_the_client_says_the_driver_exited(tmp_path: Path) -> None:
    """A driver that dies before answering (a real process): one line with its exit code and
    the last line of its stderr, as before the framing changed."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'driver: sglang does not import in fake: ImportError: no torch' >&2\nexit 2\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(SGLangError, match=r"the driver exited with code 2: driver: sglang does not import in fake"):
        SGLangAllocator(AllocatorConfig(pool_tokens=64), python=str(fake))


def test_the_server_ends_when_the_parent_left_before_its_reply() -> None:
    client, driver, _, _ = _channels()
    client.send(wire.Call("counters"))
    client.close()  # the request stays in the pipe; nobody will read the reply
    assert server.serve(driver) == 0
    driver.close()
