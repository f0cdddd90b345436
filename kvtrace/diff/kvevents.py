"""``kvtrace diff --kv-events``: the KV events two versions publish, compared step by step.

Both versions replay the trace in this process, in lockstep, each with its event source
switched on (``kvtrace.events.sources``: SGLang's own recorder for the ``sglang``
version, events derived from the radix tree for the others). After every step the two
batches are compared event by event: the event's type, then each field in SGLang's order
(``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``, ``lora_id``,
``medium``, ...), a list down to its first differing item. The first difference is the
result (``KvEventsDivergence``); the batches' times are the trace's on both sides and are
not compared. Versions that run in their own process (``git:REV``, ``worktree``) are
refused: their allocators are not here to switch events on.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtrace.errors import ConfigError

if TYPE_CHECKING:
    from kvtrace.events.blocks import Event
    from kvtrace.replay.engine import ReplayOptions

__all__ = ["KvEventsDivergence", "KvEventsReport", "compare_batches", "diff_kv_events"]


@dataclass(frozen=True, slots=True)
class KvEventsDivergence:
    """Where two event streams first differ.

    ``event``: the index of the event in the step's batch; ``field``: ``type``, a field
    (``block_hashes[3]`` for an item of a list), ``events`` (one batch is longer: ``a`` /
    ``b`` are the event counts) or ``steps`` (one side stopped: the steps each replayed).
    """

    step: int
    event: int | None
    field: str
    a: Any
    b: Any

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "event": self.event, "field": self.field, "a": self.a, "b": self.b}

    def line(self) -> str:
        where = f"step {self.step}" if self.event is None else f"step {self.step}, event {self.event}"
        return f"KV events differ at {where}: {self.field}: A {self.a!r}, B {self.b!r}"


@dataclass(frozen=True, slots=True)
class KvEventsReport:
    """The comparison of two versions' event streams (``to_dict()``: ``--json``'s ``kv_events``)."""

    steps_compared: int
    batches: int  # steps that published events (side A)
    events: int  # events side A published
    first_divergence: KvEventsDivergence | None

    @property
    def identical(self) -> bool:
        return self.first_divergence is None

    def to_dict(self) -> dict[str, Any]:
        first = self.first_divergence
        return {"identical": self.identical, "steps_compared": self.steps_compared, "batches": self.batches,
                "events": self.events, "first_divergence": None if first is None else first.to_dict()}

    def line(self) -> str:
        if self.first_divergence is not None:
            return self.first_divergence.line()
        return (f"KV events identical over {self.steps_compared:,} steps "
                f"({self.batches:,} batches, {self.events:,} events)")


def _tag(event: Event) -> str:
    return type(event).__name__


def compare_batches(step: int, a: list[Event], b: list[Event]) -> KvEventsDivergence | None:
    """The first difference between two batches of step ``step`` (None: identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x == y:
            continue
        if type(x) is not type(y):
            return KvEventsDivergence(step, i, "type", _tag(x), _tag(y))
        for name in x.__struct_fields__:
            u, v = getattr(x, name), getattr(y, name)
            if u == v:
                continue
            if isinstance(u, list) and isinstance(v, list):
                for j, (p, q) in enumerate(zip(u, v)):
                    if p != q:
                        return KvEventsDivergence(step, i, f"{name}[{j}]", p, q)
                return KvEventsDivergence(step, i, f"len({name})", len(u), len(v))
            return KvEventsDivergence(step, i, name, u, v)
    if len(a) != len(b):
        return KvEventsDivergence(step, min(len(a), len(b)), "events", len(a), len(b))
    return None


def diff_kv_events(
    trace: str,
    spec_a: str,
    spec_b: str,
    *,
    replay: ReplayOptions | None = None,
    page_size: int | None = None,
    pool_tokens: int | None = None,
    device: str = "cpu",
) -> KvEventsReport:
    """Replay ``trace`` through ``spec_a`` and ``spec_b`` in lockstep and compare their KV events.

    Args:
        trace: a trace path or ``sample:NAME``.
        spec_a, spec_b: version specs that run in this process.
        replay: replay options of both sides (``start_step`` must be None).
        page_size, pool_tokens, device: what-ifs applied to both sides.

    Raises:
        ConfigError: a version that runs in its own process, a window's start, an EAGLE
            trace or a version without events (``kvtrace.events.sources``).
        KvtraceError: a spec that does not resolve, a bad trace, a side that fails.
    """
    from kvtrace.events.sources import step_events
    from kvtrace.replay.engine import ReplayOptions
    from kvtrace.replay.session import ReplaySession
    from kvtrace.versions.registry import AllocatorVersion, resolve_any

    replay = replay or ReplayOptions()
    if replay.start_step is not None:
        raise ConfigError("--kv-events: KV events start at the trace's first step (a window's start would fold "
                          "the steps before it into one batch); use --steps :B")
    versions = [resolve_any(spec_a), resolve_any(spec_b)]
    for v in versions:
        if not isinstance(v, AllocatorVersion):
            raise ConfigError(f"--kv-events: version '{v.spec}' runs in its own process, where its events cannot be "
                              "switched on; compare versions that run here (builtin, token, paged[:N], "
                              "module:factory, file.py:factory, sglang)")
    what_if = {"page_size": page_size, "pool_tokens": pool_tokens, "device": device}
    with ReplaySession(trace, version=versions[0], options=replay, label=trace, checker="inline", **what_if) as first, \
            ReplaySession(trace, version=versions[1], options=replay, label=trace, checker=first.checker,
                          **what_if) as second:
        return _walk(step_events(first), step_events(second))


def _walk(a_steps: Any, b_steps: Any) -> KvEventsReport:
    steps = batches = events = 0
    for a, b in itertools.zip_longest(a_steps, b_steps):
        if a is None or b is None:
            last = (a or b).step
            return KvEventsReport(steps, batches, events, KvEventsDivergence(
                last, None, "steps", "stopped" if a is None else f"replayed step {last}",
                "stopped" if b is None else f"replayed step {last}"))
        steps += 1
        batches += bool(a.events)
        events += len(a.events)
        found = compare_batches(a.step, a.events, b.events) if a.step == b.step else KvEventsDivergence(
            min(a.step, b.step), None, "step", a.step, b.step)
        if found is not None:
            return KvEventsReport(steps, batches, events, found)
    return KvEventsReport(steps, batches, events, None)
