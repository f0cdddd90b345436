"""The pipe protocol between kvtrace and the SGLang driver (standard library only).

Both interpreters load this file: kvtrace as ``kvtrace.sglang.wire``, the driver by
path (``driver.py``), so the messages are records of this module and travel as plain
Python values, never as pickled classes:

* requests: ``Call(method, args)`` (one ``AllocatorServer`` method, or ``init``) and
  ``Batch(calls)`` (several calls in one round trip);
* replies: ``Ok(value)`` and ``Error(text, traceback)``.

Each has one serialisation (``encode``; read back by ``decode_request`` /
``decode_reply``): a pickle (protocol 4) of a tuple of builtins, ``(method, args)``,
``("batch", ((method, args), ...))``, ``("ok", value)`` or ``("error", text,
traceback)``. Reading refuses any class in a message, so integer arrays travel as
``bytes`` of little-endian int64 (``pack_ints`` / ``numpy.frombuffer``) and the two
interpreters may run different numpy versions. The framing is the standard
library's ``multiprocessing.connection.Connection`` over the pipe's file
descriptors (``Channel``).
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Union

__all__ = [
    "METHODS", "Batch", "Call", "Channel", "Error", "Ok", "Reply", "Request", "WireClosed", "WireError",
    "decode_reply", "decode_request", "encode", "pack_ints",
]

# What a ``Call`` may name: ``init`` (a new SGLang world) and the calls of
# ``server.AllocatorServer`` (the test of this module checks the two agree).
METHODS: frozenset[str] = frozenset({
    "init", "extend", "decode", "spec_decode", "prealloc", "release", "end_step", "evict", "match_prefix",
    "counters", "pool_counters", "request_lens", "holds_kv", "row_slots", "check_integrity", "state_digest",
    "enable_kv_events", "take_kv_events", "set_namespaces", "enable_sessions", "hold", "close_session",
})
_PROTOCOL = 4  # every interpreter the driver supports reads it


class WireClosed(EOFError):
    """The other side closed the pipe (it exited)."""


class WireError(ValueError):
    """A message that is not one of this protocol's (malformed, or an unknown method)."""


@dataclass(frozen=True, slots=True)
class Call:
    """One call of the driver: ``method`` (one of ``METHODS``) with positional ``args``
    (plain Python values; integer arrays as ``pack_ints`` bytes).

    Raises:
        WireError: ``method`` is not one of ``METHODS``.
    """

    method: str
    args: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise WireError(f"unknown method {self.method!r} (known: {', '.join(sorted(METHODS))})")


@dataclass(frozen=True, slots=True)
class Batch:
    """Several calls in one round trip; the reply's value lists their values, in order."""

    calls: tuple[Call, ...]


@dataclass(frozen=True, slots=True)
class Ok:
    """A request's value (a ``Batch``: the list of its calls' values)."""

    value: Any


@dataclass(frozen=True, slots=True)
class Error:
    """A request that raised in the driver: ``"Type: message"`` and its traceback."""

    text: str
    traceback: str


Request = Union[Call, Batch]
Reply = Union[Ok, Error]


def encode(message: Request | Reply) -> bytes:
    """The one serialisation of a message (see the module doc)."""
    if isinstance(message, Call):
        plain: tuple[Any, ...] = (message.method, message.args)
    elif isinstance(message, Batch):
        plain = ("batch", tuple((c.method, c.args) for c in message.calls))
    elif isinstance(message, Ok):
        plain = ("ok", message.value)
    elif isinstance(message, Error):
        plain = ("error", message.text, message.traceback)
    else:
        raise TypeError(f"not a wire message: {type(message).__name__}")
    return pickle.dumps(plain, protocol=_PROTOCOL)


class _PlainUnpickler(pickle.Unpickler):
    """Builtins only: a class in a message (a numpy scalar, a dataclass) is an error
    rather than an import of that class by name on this side."""

    def find_class(self, module: str, name: str) -> Any:
        raise WireError(f"a message holds plain Python values only, not {module}.{name}")


def _plain(data: bytes, what: str) -> Any:
    try:
        return _PlainUnpickler(io.BytesIO(data)).load()
    except WireError:
        raise
    except Exception as exc:  # a truncated or foreign frame: pickle's errors vary
        raise WireError(f"malformed {what} ({len(data)} bytes): {type(exc).__name__}: {exc}") from None


def _call(plain: Any) -> Call:
    if not (isinstance(plain, tuple) and len(plain) == 2 and isinstance(plain[0], str) and isinstance(plain[1], tuple)):
        raise WireError(f"malformed call: expected (method, args), got {type(plain).__name__}")
    return Call(plain[0], plain[1])


def decode_request(data: bytes) -> Request:
    """A ``Call`` or ``Batch`` read back from ``encode``'s bytes.

    Raises:
        WireError: not a request, or an unknown method.
    """
    plain = _plain(data, "request")
    if isinstance(plain, tuple) and len(plain) == 2 and plain[0] == "batch":
        if not isinstance(plain[1], tuple):
            raise WireError(f"malformed batch: expected a tuple of calls, got {type(plain[1]).__name__}")
        return Batch(tuple(_call(c) for c in plain[1]))
    return _call(plain)


def decode_reply(data: bytes) -> Reply:
    """An ``Ok`` or ``Error`` read back from ``encode``'s bytes.

    Raises:
        WireError: not a reply.
    """
    plain = _plain(data, "reply")
    if isinstance(plain, tuple):
        if len(plain) == 2 and plain[0] == "ok":
            return Ok(plain[1])
        if len(plain) == 3 and plain[0] == "error" and isinstance(plain[1], str) and isinstance(plain[2], str):
            return Error(plain[1], plain[2])
    raise WireError(f"malformed reply: expected ('ok', value) or ('error', text, traceback), got {plain!r:.80}")


class Channel:
    """One end of the protocol: messages read from ``read_fd`` and written to ``write_fd``
    (the two ends of two pipes), each framed by ``multiprocessing.connection``. The
    channel owns both descriptors (``close``).

    Args:
        read_fd: the descriptor replies (kvtrace) or requests (the driver) arrive on.
        write_fd: the descriptor this side's messages go to.
    """

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self._in = Connection(read_fd, writable=False)
        self._out = Connection(write_fd, readable=False)

    def send(self, message: Request | Reply) -> None:
        """Write one message.

        Raises:
            WireClosed: the other side closed its end.
        """
        try:
            self._out.send_bytes(encode(message))
        except (BrokenPipeError, ConnectionResetError):
            raise WireClosed("the pipe closed") from None

    def _recv(self) -> bytes:
        try:
            return self._in.recv_bytes()
        except EOFError:
            raise WireClosed("the pipe closed") from None
        except OSError as exc:  # "got end of file during message": the writer exited mid-message
            raise WireClosed(f"the pipe closed ({exc})") from None

    def recv_request(self) -> Request:
        """The next request.

        Raises:
            WireClosed: the pipe closed.
            WireError: a frame that is not a request (see ``decode_request``).
        """
        return decode_request(self._recv())

    def recv_reply(self) -> Reply:
        """The next reply.

        Raises:
            WireClosed: the pipe closed.
            WireError: a frame that is not a reply.
        """
        return decode_reply(self._recv())

    def close(self) -> None:
        """Close both descriptors (the other side then reads ``WireClosed``)."""
        self._out.close()
        self._in.close()


def pack_ints(values: Any) -> bytes:
    """An integer sequence (a numpy array, a list) as little-endian int64 bytes."""
    import numpy as np

    return np.ascontiguousarray(values, dtype="<i8").tobytes()
