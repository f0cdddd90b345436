"""The versions ``sglang`` and ``sglang:PYTHON``: SGLang's own allocator behind kvtrace's protocol.

``resolve_sglang(spec)`` checks (without importing SGLang) that the interpreter has
an sglang the driver knows and returns an ``AllocatorVersion`` whose factory starts
``driver.py --serve`` under that interpreter. ``SGLangAllocator`` is the kvtrace
side: every ``Allocator`` call (``allocator.base``) is one message over a pipe
(``wire``), answered by SGLang's real classes (``server.AllocatorServer``). The
replay engine, the checks, the state log and ``kvtrace diff`` see an allocator like
any other, so the records of the two versions come from the same code.

* ``sglang``: the sglang this interpreter imports (kvtrace installed in SGLang's
  environment);
* ``sglang:PYTHON``: another environment's interpreter (a development checkout of
  SGLang installed editable there, or the one ``tools/sglang_oracle/setup.sh``
  makes); ``$KVTRACE_SGLANG_PYTHON`` is what ``kvtrace versions`` probes.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtrace.errors import KvtraceError, VersionSpecError
from kvtrace.sglang import KNOWN_SGLANG_VERSIONS, wire
from kvtrace.sglang.probe import ENV_VAR, probe
from traces.namespaces import namespace_of

if TYPE_CHECKING:
    from collections.abc import Sequence

    from allocator.base import AllocatorConfig, AllocOutcome, PoolCounters, ReleaseKind, ReleaseResult, RequestLens
    from kvtrace.versions.base import AllocatorVersion

__all__ = ["DRIVER", "ENV_VAR", "UNCHECKED_VAR", "SGLangAllocator", "SGLangError", "probe", "resolve_sglang"]

DRIVER = Path(__file__).resolve().parents[1] / "sglang" / "driver.py"
# Set to 1 to drive an sglang release the driver does not know (a development checkout
# whose allocation functions kept 0.5.23's signatures).
UNCHECKED_VAR = "KVTRACE_SGLANG_UNCHECKED"


class SGLangError(KvtraceError):
    """SGLang's side failed: its driver did not start, or a call raised inside SGLang."""


def resolve_sglang(spec: str) -> AllocatorVersion:
    """The version ``sglang`` or ``sglang:PYTHON``.

    Raises:
        VersionSpecError: no interpreter given after ``sglang:``, no sglang there, or an
            sglang release the driver does not know (one line, with what to do; ``$KVTRACE_SGLANG_UNCHECKED=1``
            lets an unknown release through).
    """
    from kvtrace.versions.base import AllocatorVersion

    python = None
    if spec.startswith("sglang:"):
        python = spec.split(":", 1)[1]
        if not python:
            raise VersionSpecError("allocator 'sglang:': give the interpreter of an SGLang environment, sglang:/path/to/python")
    version, why = probe(python)
    if version is None:
        raise VersionSpecError(
            f"allocator '{spec}': {why}; install it there, or make an environment with tools/sglang_oracle/setup.sh "
            "and use sglang:ENV/bin/python"
        )
    if version not in KNOWN_SGLANG_VERSIONS and os.environ.get(UNCHECKED_VAR) != "1":
        raise VersionSpecError(
            f"allocator '{spec}': sglang {version} is not a version the driver knows "
            f"({', '.join(KNOWN_SGLANG_VERSIONS)}); use an environment with sglang {KNOWN_SGLANG_VERSIONS[-1]}, "
            f"or set {UNCHECKED_VAR}=1 to drive it anyway"
        )
    exe = sys.executable if python is None else str(Path(python).expanduser())
    return AllocatorVersion(
        spec, f"sglang {version}", functools.partial(SGLangAllocator, python=exe),
        origin=f"SGLang {version}'s own classes, run by {exe} (driver {DRIVER})",
    )


# Drivers whose allocator was dropped, by interpreter: the next allocator for the same
# interpreter sends them a new ``init`` instead of paying SGLang's import again (tests,
# benchmarks and sweeps replay many traces in one process).
_IDLE: dict[str, list[tuple[subprocess.Popen[bytes], wire.Channel, Any]]] = {}


def _park(python: str, proc: subprocess.Popen[bytes], channel: wire.Channel, stderr: Any) -> None:
    """An allocator was dropped: keep its driver (its channel and the file of its
    stderr) for the next one; it exits when this process does (its input closes)."""
    if proc.poll() is None:
        _IDLE.setdefault(python, []).append((proc, channel, stderr))
    else:
        channel.close()
        stderr.close()


def _start_driver(python: str) -> tuple[subprocess.Popen[bytes], wire.Channel, Any]:
    idle = _IDLE.get(python)
    while idle:
        proc, channel, stderr = idle.pop()
        if proc.poll() is None:
            return proc, channel, stderr
        channel.close()
        stderr.close()
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the driver imports nothing of this checkout by name
    stderr = tempfile.TemporaryFile()
    from traces.lifeline import quiet_start

    # Started with SIGINT ignored: Ctrl-C is this process's to report. The driver ends
    # when its input closes, as it does when this process dies. The pipes' other ends
    # (ours) are not inherited, by it or by any other child.
    requests_r, requests_w = os.pipe()
    replies_r, replies_w = os.pipe()
    try:
        with quiet_start():
            proc = subprocess.Popen(
                [python, str(DRIVER), "--serve"], stdin=requests_r, stdout=replies_w, stderr=stderr, env=env,
            )
    except BaseException:
        os.close(requests_w)
        os.close(replies_r)
        stderr.close()
        raise
    finally:
        os.close(requests_r)
        os.close(replies_w)
    return proc, wire.Channel(replies_r, requests_w), stderr


class SGLangAllocator:
    """An ``Allocator`` (and ``Digestible``) whose state lives in SGLang's own classes,
    in a driver process (``driver.py --serve``) under ``python``.

    Args:
        config: the replay's configuration (``device`` must be ``cpu``; no HiSparse).
        python: the interpreter of an environment with sglang.

    Raises:
        SGLangError: the driver did not start, or refused the configuration.
    """

    def __init__(self, config: AllocatorConfig, *, python: str = sys.executable) -> None:
        self.config = config
        self.python = python
        try:
            self._proc, self._channel, self._stderr = _start_driver(python)
        except OSError as exc:
            raise SGLangError(f"sglang ({python}): cannot start the driver: {exc}") from None
        self._finalizer = weakref.finalize(self, _park, python, self._proc, self._channel, self._stderr)
        # Round trips are what a replay through SGLang mostly costs: calls that answer
        # nothing (end_step) wait for the next call and go with it; the pool counters
        # (and, once asked, the digest) come with each request_lens, which the replay
        # engine asks right before them; holds_kv is answered from the calls' outcomes.
        self._deferred: list[wire.Call] = []
        self._prefetched: dict[str, Any] = {}
        self._want_digest = False
        self._holding: set[int] = set()
        self._namespaced: set[int] = set()  # rids whose namespace the driver was told
        info = self._call("init", dataclasses.asdict(config))
        self.sglang_version: str = info["sglang"]
        self.row_width: int = info["row_width"]

    def close(self) -> None:
        """Hand the driver process to the next allocator of this interpreter (also done
        when the allocator is garbage collected); it exits with this process."""
        self._finalizer()

    def _call(self, method: str, *args: Any) -> Any:
        """One call (with the deferred ones before it) in one round trip; its value."""
        call = wire.Call(method, args)
        if self._deferred:
            return self._batch([call])[0]
        self._prefetched.clear()
        return self._round_trip(call)

    def _batch(self, calls: list[wire.Call]) -> list[Any]:
        """Several calls (after the deferred ones) in one round trip; their values."""
        self._prefetched.clear()
        skip = len(self._deferred)
        batch = wire.Batch((*self._deferred, *calls))
        self._deferred = []
        return self._round_trip(batch)[skip:]

    def _round_trip(self, request: wire.Request) -> Any:
        what = request.method if isinstance(request, wire.Call) else "batch"
        try:
            self._channel.send(request)
            reply = self._channel.recv_reply()
        except (OSError, wire.WireClosed):
            proc = self._proc
            proc.wait()
            self._stderr.seek(0)
            lines = self._stderr.read().decode(errors="replace").strip().splitlines()
            why = lines[-1] if lines else "no message"
            raise SGLangError(f"sglang ({self.python}): the driver exited with code {proc.returncode}: {why}") from None
        except wire.WireError as exc:
            raise SGLangError(f"sglang ({self.python}): {what}: the driver's reply: {exc}") from None
        if isinstance(reply, wire.Error):
            text = reply.text.split(": ", 1)[-1] if reply.text.startswith(("ScenarioError", "ValueError")) else reply.text
            raise SGLangError(f"sglang ({self.python}): {what}: {text}")
        return reply.value

    # ------------------------------------------------------------------ allocation calls
    def _outcome(self, reply: tuple[Any, ...], rids: np.ndarray | None = None) -> AllocOutcome:
        from allocator.base import AllocResult, OutOfMemory

        if reply[0] == "oom":
            return OutOfMemory(*reply[1:])
        _, num, evicted, prefix, overflow = reply
        if rids is not None:
            self._holding.update(int(r) for r in rids)
        prefix_lens = None if prefix is None else np.frombuffer(prefix, "<i8").astype(np.int64)
        return AllocResult(num, evicted, prefix_lens, tuple(tuple(x) for x in overflow))

    def extend(
        self, rids: np.ndarray, seq_lens: np.ndarray, token_ids: Sequence[np.ndarray], prefill_done: np.ndarray | None = None,
    ) -> AllocOutcome:
        done = np.ones(len(rids), bool) if prefill_done is None else np.asarray(prefill_done, bool)
        self._tell_namespaces(rids, token_ids)
        return self._outcome(self._call(
            "extend", wire.pack_ints(rids), wire.pack_ints(seq_lens), [wire.pack_ints(t) for t in token_ids],
            done.astype(np.uint8).tobytes(),
        ), rids)

    def decode(self, rids: np.ndarray) -> AllocOutcome:
        return self._outcome(self._call("decode", wire.pack_ints(rids)))

    def spec_decode(self, rids: np.ndarray, accepted_lens: np.ndarray) -> AllocOutcome:
        return self._outcome(self._call("spec_decode", wire.pack_ints(rids), wire.pack_ints(accepted_lens)))

    def prealloc(self, rids: np.ndarray, fill_lens: np.ndarray, token_ids: Sequence[np.ndarray]) -> AllocOutcome:
        self._tell_namespaces(rids, token_ids)
        return self._outcome(self._call(
            "prealloc", wire.pack_ints(rids), wire.pack_ints(fill_lens), [wire.pack_ints(t) for t in token_ids],
        ), rids)

    def release(
        self, rids: np.ndarray, owned_lens: np.ndarray, token_ids: Sequence[np.ndarray] | None, kind: ReleaseKind,
    ) -> ReleaseResult:
        from allocator.base import ReleaseResult

        tokens = None if token_ids is None else [wire.pack_ints(t) for t in token_ids]
        freed, cached, overalloc, evicted = self._call("release", wire.pack_ints(rids), wire.pack_ints(owned_lens), tokens, kind)
        self._holding.difference_update(int(r) for r in rids)
        return ReleaseResult(freed, cached, np.frombuffer(overalloc, "<i8").astype(np.int64), evicted)

    def enable_sessions(self) -> None:
        """Drive SGLang's streaming sessions (before the first step): the driver rebuilds
        its world on the unified tree, which owns the session slots (``world.py``,
        decision 15)."""
        self._call("enable_sessions")

    def hold(self, rids: np.ndarray, held_lens: np.ndarray) -> ReleaseResult:
        """Each turn ends; its session keeps the KV (SGLang's ``try_cache_finished_req``)."""
        from allocator.base import ReleaseResult

        freed, cached, overalloc, evicted = self._call("hold", wire.pack_ints(rids), wire.pack_ints(held_lens))
        return ReleaseResult(freed, cached, np.frombuffer(overalloc, "<i8").astype(np.int64), evicted)

    def close_session(self, rids: np.ndarray) -> ReleaseResult:
        """Release the KV each request's session holds (SGLang's ``release_session``)."""
        from allocator.base import ReleaseResult

        freed, cached, overalloc, evicted = self._call("close_session", wire.pack_ints(rids))
        self._holding.difference_update(int(r) for r in rids)
        return ReleaseResult(freed, cached, np.frombuffer(overalloc, "<i8").astype(np.int64), evicted)

    def end_step(self) -> None:
        self._prefetched.clear()
        self._deferred.append(wire.Call("end_step"))

    def evict(self, num_tokens: int) -> int:
        return int(self._call("evict", int(num_tokens)))

    def match_prefix(self, token_ids: np.ndarray) -> int:
        namespace = namespace_of(token_ids)
        if namespace is None:
            return int(self._call("match_prefix", wire.pack_ints(token_ids)))
        return int(self._call("match_prefix", wire.pack_ints(token_ids), namespace))

    def _tell_namespaces(self, rids: np.ndarray, token_ids: Sequence[np.ndarray]) -> None:
        """Send the namespaces of requests new to the driver (with the next call): SGLang
        keys a request's radix matches by its ``extra_key``."""
        pairs = [
            [int(r), ns] for r, t in zip(rids, token_ids)
            if (ns := namespace_of(t)) is not None and int(r) not in self._namespaced
        ]
        if pairs:
            self._namespaced.update(p[0] for p in pairs)
            self._deferred.append(wire.Call("set_namespaces", (pairs,)))

    # ------------------------------------------------------------------ reads
    def counters(self) -> PoolCounters:
        from allocator.base import PoolCounters

        value = self._prefetched.pop("counters", None)
        return PoolCounters(*(value if value is not None else self._call("counters")))

    def _several_pools(self) -> bool:
        """Whether the config has a pool besides the full one (SWA, Mamba, HiCache's host)."""
        cfg = self.config
        return any(getattr(cfg, name, None) is not None for name in ("swa", "mamba", "hicache"))

    def pool_counters(self) -> dict[str, PoolCounters]:
        """Each KV pool's counters: ``{"full": counters()}``, and a hybrid SWA model's
        ``"swa"`` pool too, a hybrid linear-attention model's ``"mamba"`` pool, HiCache's
        ``"host"`` pool (asked with ``request_lens``, as the counters are)."""
        from allocator.base import PoolCounters

        if not self._several_pools():
            return {"full": self.counters()}
        value = self._prefetched.pop("pool_counters", None)
        pools = value if value is not None else self._call("pool_counters")
        return {name: PoolCounters(*fields) for name, fields in pools.items()}

    def request_lens(self, rids: np.ndarray) -> RequestLens:
        from allocator.base import RequestLens

        several = self._several_pools()
        names = ["counters", "pool_counters"] if several else ["counters"]
        calls = [wire.Call("request_lens", (wire.pack_ints(rids),)), *(wire.Call(n) for n in names)]
        if self._want_digest:
            calls.append(wire.Call("state_digest"))
            names.append("state_digest")
        values = self._batch(calls)
        self._prefetched = dict(zip(names, values[1:]))
        return RequestLens(*(np.frombuffer(c, "<i8").astype(np.int64) for c in values[0]))

    def holds_kv(self, rids: np.ndarray) -> np.ndarray:
        """Answered here: a request holds KV from a successful extend / prealloc to its release."""
        holding = self._holding
        return np.fromiter((int(r) in holding for r in rids), bool, len(rids))

    def row_slots(self, rid: int) -> np.ndarray:
        return np.frombuffer(self._call("row_slots", int(rid)), "<i8").astype(np.int64)

    def check_integrity(self) -> list[Any]:
        from allocator.base import Violation

        return [Violation(v["check"], v["detail"], v["rid"]) for v in self._call("check_integrity")]

    # ------------------------------------------------------------------ KV events
    def enable_kv_events(self) -> bool:
        """Switch on SGLang's own KV-event recorder (before the first step).

        Returns:
            Whether there will be events (False: the radix cache is disabled).

        Raises:
            SGLangError: after the first step, or a configuration whose events are not driven.
        """
        return bool(self._call("enable_kv_events"))

    def take_kv_events(self) -> list[Any]:
        """The events SGLang recorded since the last take (``kvtrace.events.blocks`` types,
        decoded from SGLang's own msgpack of them)."""
        import msgspec

        from kvtrace.events.blocks import Event

        return msgspec.msgpack.decode(self._call("take_kv_events"), type=list[Event])

    def state_digest(self) -> str:
        """kvtrace's physical-state digest computed from SGLang's state (``allocator.check.digest``)."""
        self._want_digest = True
        value = self._prefetched.pop("state_digest", None)
        return str(value if value is not None else self._call("state_digest"))
