"""The KV events SGLang 0.5.23 publishes, derived from a replay.

SGLang's radix cache records a ``BlockStored`` for the pages of every new tree node
(``_insert_helper``), a ``BlockRemoved`` for the pages of every node it evicts
(``evict``) and an ``AllBlocksCleared`` whenever the tree is reset (at start-up too);
the scheduler publishes what was recorded once per step, as one batch. kvtrace's radix
cache mirrors SGLang's call for call, so ``TreeEvents``, told of its new leaves, splits
and evictions (``allocator.radix_cache.TreeListener``), records the same events in the
same order, with the same coalescing (a store that continues the previous store's chain,
or a remove after a remove, joins the event before it).

Each node keeps its pages' digests (``kvtrace.events.blocks``); a split divides them
between the two parts, so a page's hash never depends on how the tree was cut::

    replay = ReplaySession("sample:mooncake-tiny")
    for step in replay_events(replay):      # StepEvents(step, time_s, events), steps with events only
        ...
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from kvtrace.errors import ConfigError
from kvtrace.events.blocks import (
    GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    event_hash,
    event_hashes,
    page_digests,
)
from kvtrace.events.wire import Frame, encode

if TYPE_CHECKING:
    from allocator.radix_cache import RadixCache, TreeNode
    from kvtrace.events.blocks import Event
    from kvtrace.replay.session import ReplaySession
    from kvtrace.replay.snapshot import StepSnapshot

__all__ = ["Emitter", "StepEvents", "TreeEvents", "attach", "replay_events"]


class StepEvents(NamedTuple):
    """The events one replayed step published (one batch)."""

    step: int
    time_s: float  # the step's time in the trace (seconds)
    events: list[Event]


class TreeEvents:
    """A ``TreeListener`` that records SGLang's KV events for one radix cache.

    Args:
        tree: the cache (page-aligned keys of token ids, not EAGLE bigrams).
        medium: the ``medium`` of every event (SGLang's device tier: ``GPU``).
    """

    def __init__(self, tree: RadixCache, medium: str = GPU) -> None:
        self.tree = tree
        self.page_size = tree.page_size
        self.medium = medium
        self._digests: dict[TreeNode, bytes] = {}  # node -> its pages' 32-byte digests, concatenated
        # SGLang's recorder starts with the AllBlocksCleared of the tree's first reset.
        self._queue: list[Event] = [AllBlocksCleared()]
        self.num_stored = 0  # blocks
        self.num_removed = 0

    # -------------------------------------------------------------- TreeListener
    def stored(self, leaf: TreeNode) -> None:
        parent = leaf.parent
        assert parent is not None
        prior = None if parent is self.tree.root_node else self._digests[parent][-32:]
        units = np.frombuffer(leaf.key, dtype=np.int64)
        digests = page_digests(units, self.page_size, prior)
        self._digests[leaf] = digests
        hashes = event_hashes(digests)
        self.num_stored += len(hashes)
        parent_hash = None if prior is None else event_hash(prior)
        tail = self._queue[-1] if self._queue else None
        if (isinstance(tail, BlockStored) and tail.medium == self.medium and tail.block_hashes
                and tail.block_hashes[-1] == parent_hash):
            tail.block_hashes.extend(hashes)
            tail.token_ids.extend(units.tolist())
            return
        self._queue.append(BlockStored(
            block_hashes=hashes, parent_block_hash=parent_hash, token_ids=units.tolist(),
            block_size=self.page_size, lora_id=None, medium=self.medium,
        ))

    def split(self, upper: TreeNode, child: TreeNode) -> None:
        digests = self._digests[child]
        cut = len(upper) // self.page_size * 32
        self._digests[upper] = digests[:cut]
        self._digests[child] = digests[cut:]

    def removed(self, node: TreeNode) -> None:
        hashes = event_hashes(self._digests.pop(node))
        self.num_removed += len(hashes)
        tail = self._queue[-1] if self._queue else None
        if isinstance(tail, BlockRemoved) and tail.medium == self.medium:
            tail.block_hashes.extend(hashes)
            return
        self._queue.append(BlockRemoved(block_hashes=hashes, medium=self.medium))

    # -------------------------------------------------------------- reading
    def take(self) -> list[Event]:
        """The events recorded since the last ``take`` (and forget them)."""
        events, self._queue = self._queue, []
        return events

    def block_hashes(self) -> set[int]:
        """The hash of every page the tree holds now, as the events told it."""
        return {h for digests in self._digests.values() for h in event_hashes(digests)}


def attach(tree: RadixCache | None, spec: str) -> TreeEvents | None:
    """Attach a ``TreeEvents`` to ``tree`` (the allocator ``spec``'s radix cache).

    Returns:
        The listener; None for a disabled cache (SGLang publishes nothing without one).

    Raises:
        ConfigError: the allocator has no kvtrace radix cache, or keys it by EAGLE bigrams.
    """
    from allocator.radix_cache import RadixCache

    if not isinstance(tree, RadixCache):
        raise ConfigError(
            f"--kv-events: allocator '{spec}' has no kvtrace radix cache to derive events from; "
            "use a built-in allocator (builtin, token, paged[:N])"
        )
    if tree.disable:
        return None
    if tree.is_eagle:
        raise ConfigError(
            "--kv-events: this trace uses EAGLE speculative decoding, whose radix cache is keyed by token "
            "pairs that kvtrace keeps only as 64-bit mixes, so SGLang's pair events cannot be derived; "
            "use a trace without EAGLE"
        )
    listener = TreeEvents(tree)
    tree.listener = listener
    return listener


def replay_events(session: ReplaySession) -> Iterator[StepEvents]:
    """The events of each step of ``session`` that published any, replaying it as they
    are read (the listener is attached now, before the first step).

    Raises:
        ConfigError: see ``attach``.
    """
    listener = attach(getattr(session.allocator, "tree_cache", None), session.version.spec)
    return _step_events(session, listener)


def _step_events(session: ReplaySession, listener: TreeEvents | None) -> Iterator[StepEvents]:
    for snap in session.snapshots():
        if listener is None:
            continue
        events = listener.take()
        if events:
            yield StepEvents(snap.step, snap.time_s, events)


class Emitter:
    """Publishes a replay's events as it goes: after each step, the step's batch (if
    any) goes to ``send`` as the next frame (sequence numbers from 0).

    Args:
        session: the replay, not started yet (the listener must see every change).
        send: where each frame goes (``EventFileWriter.write``, ``ZmqPublisher.send``).
        topic: the frames' topic.
        paced: hold each batch until its step's time in the trace has passed since the
            first step (else as fast as the replay goes).
        sleep: how to wait (tests pass a fake).

    Raises:
        ConfigError: see ``attach``.
    """

    def __init__(self, session: ReplaySession, send: Callable[[Frame], Any], *, topic: bytes = b"",
                 paced: bool = False, sleep: Callable[[float], None] = time.sleep) -> None:
        self.listener = attach(getattr(session.allocator, "tree_cache", None), session.version.spec)
        self._send = send
        self.topic = topic
        self.paced = paced
        self._sleep = sleep
        self._t0: tuple[float, float] | None = None  # (trace time, wall time) of the first step
        self.num_batches = 0
        self.num_events = 0

    def after(self, snap: StepSnapshot) -> None:
        """Publish what step ``snap`` recorded."""
        listener = self.listener
        if listener is None:
            return
        events = listener.take()
        if not events:
            return
        if self.paced:
            self._hold(snap.time_s)
        payload = encode(KVEventBatch(ts=snap.time_s, events=events, attn_dp_rank=0))
        self._send(Frame(self.topic, self.num_batches, payload))
        self.num_batches += 1
        self.num_events += len(events)

    def _hold(self, time_s: float) -> None:
        now = time.monotonic()
        if self._t0 is None:
            self._t0 = (time_s, now)
            return
        wait = (time_s - self._t0[0]) - (now - self._t0[1])
        if wait > 0:
            self._sleep(wait)

    def summary(self) -> dict[str, int]:
        """The counts for ``kvtrace replay --json`` (``kv_events``)."""
        listener = self.listener
        return {
            "batches": self.num_batches,
            "events": self.num_events,
            "blocks_stored": 0 if listener is None else listener.num_stored,
            "blocks_removed": 0 if listener is None else listener.num_removed,
        }
