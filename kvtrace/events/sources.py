"""Where a replay's per-step KV events come from, whatever its allocator version.

A version that publishes events itself (the ``sglang`` version: SGLang's own radix
cache with its event recorder on, ``kvtrace.versions.sglang.SGLangAllocator``) has
``enable_kv_events()`` and ``take_kv_events()``; any other version with a kvtrace radix
cache (built-in, a module or file factory built on ``allocator``) gets a ``TreeEvents``
listener that derives SGLang's events from its tree (``kvtrace.events.emit``). Both are
refused for EAGLE traces, the same line either way. ``kvtrace diff --kv-events``
compares two versions' streams (``kvtrace.diff.kvevents``)::

    for step in step_events(session):   # StepEvents(step, time_s, events) for every step
        ...
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from kvtrace.events.emit import StepEvents, attach, eagle_refusal

if TYPE_CHECKING:
    from kvtrace.events.blocks import Event
    from kvtrace.replay.session import ReplaySession

__all__ = ["EventTake", "event_source", "replay_events", "step_events"]

EventTake = Callable[[], "list[Event]"]  # the events recorded since the last call


def event_source(session: ReplaySession) -> EventTake | None:
    """Switch on the KV events of ``session``'s allocator (before its first step) and
    return what takes each step's events; None when it publishes none (the radix cache
    is disabled).

    Raises:
        ConfigError: an EAGLE trace, or an allocator with neither its own events nor a
            kvtrace radix cache.
        KvtraceError: the version's own recorder cannot be switched on (one line, naming why).
    """
    from allocator.sizing import uses_bigram_keys

    allocator = session.allocator
    if callable(getattr(allocator, "enable_kv_events", None)):
        if uses_bigram_keys(session.config.spec):
            raise eagle_refusal()
        if not allocator.enable_kv_events():  # type: ignore[attr-defined]
            return None
        return allocator.take_kv_events  # type: ignore[attr-defined,no-any-return]
    listener = attach(getattr(allocator, "tree_cache", None), session.version.spec)
    return None if listener is None else listener.take


def step_events(session: ReplaySession) -> Iterator[StepEvents]:
    """Each replayed step of ``session`` with the events it published (an empty list for
    a step that published none), replaying as they are read; the source is switched on
    now, before the first step.

    Raises:
        ConfigError, KvtraceError: see ``event_source``.
    """
    take = event_source(session)
    return _steps(session, take)


def _steps(session: ReplaySession, take: EventTake | None) -> Iterator[StepEvents]:
    for snap in session.snapshots():
        yield StepEvents(snap.step, snap.time_s, [] if take is None else take())


def replay_events(session: ReplaySession) -> Iterator[StepEvents]:
    """The events of each step of ``session`` that published any, replaying it as they
    are read (``step_events`` without the empty steps).

    Raises:
        ConfigError, KvtraceError: see ``event_source``.
    """
    return (step for step in step_events(session) if step.events)
