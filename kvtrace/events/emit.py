"""The KV events SGLang 0.5.23 publishes, derived from a replay.

SGLang's radix cache records a ``BlockStored`` for the pages of every new tree node
(``_insert_helper``), a ``BlockRemoved`` for the pages of every node it evicts
(``evict``) and an ``AllBlocksCleared`` whenever the tree is reset (at start-up too);
the scheduler publishes what was recorded once per step, as one batch. kvtrace's radix
cache mirrors SGLang's call for call, so an ``EventBuilder`` told of its new leaves,
splits and evictions (``allocator.radix_cache.TreeListener``) records the same events in
the same order, with the same coalescing (a store that continues the previous store's
chain, or a remove after a remove, joins the event before it).

Each node keeps its pages' digests (``kvtrace.events.blocks``); a split divides them
between the two parts, so a page's hash never depends on how the tree was cut.
``TreeEvents`` builds the events in the replay's process (``Emitter``, ``kvtrace.events.sources.replay_events``);
``TreeOps`` only records the changes, for a builder in a child process that hashes,
encodes and writes (``BackgroundEmitter``, what ``kvtrace replay --kv-events`` uses)::

    replay = ReplaySession("sample:mooncake-tiny")
    for step in replay_events(replay):      # StepEvents(step, time_s, events), steps with events only
        ...
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
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
from kvtrace.events.wire import EventStreamError, Frame, encode

if TYPE_CHECKING:
    from allocator.radix_cache import RadixCache, TreeNode
    from kvtrace.events.blocks import Event
    from kvtrace.replay.session import ReplaySession
    from kvtrace.replay.snapshot import StepSnapshot

__all__ = [
    "BackgroundEmitter",
    "EventBuilder",
    "Emitter",
    "StepEvents",
    "TreeEvents",
    "TreeOps",
    "attach",
    "eagle_refusal",
    "events_tree",
]


class StepEvents(NamedTuple):
    """The events one replayed step published (one batch)."""

    step: int
    time_s: float  # the step's time in the trace (seconds)
    events: list[Event]


class EventBuilder:
    """Builds SGLang's events from the changes of a radix tree, told by node identity (the
    node objects themselves, or their ids in another process).

    Args:
        page_size: tokens per page of the tree.
        medium: the ``medium`` of every event (SGLang's device tier: ``GPU``).
    """

    def __init__(self, page_size: int, medium: str = GPU) -> None:
        self.page_size = page_size
        self.medium = medium
        self._digests: dict[Hashable, bytes] = {}  # node -> its pages' 32-byte digests, concatenated
        # SGLang's recorder starts with the AllBlocksCleared of the tree's first reset.
        self._queue: list[Event] = [AllBlocksCleared()]
        self.num_stored = 0  # blocks
        self.num_removed = 0

    def on_store(self, node: Hashable, parent: Hashable | None, key: bytes) -> None:
        """``node`` is a new leaf under ``parent`` (None: the root) holding ``key`` (int64 units)."""
        prior = None if parent is None else self._digests[parent][-32:]
        units = np.frombuffer(key, dtype=np.int64)
        digests = page_digests(units, self.page_size, prior)
        self._digests[node] = digests
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

    def on_split(self, upper: Hashable, child: Hashable, upper_len: int) -> None:
        """``child`` was cut after ``upper_len`` tokens; ``upper`` is its new first part."""
        digests = self._digests[child]
        cut = upper_len // self.page_size * 32
        self._digests[upper] = digests[:cut]
        self._digests[child] = digests[cut:]

    def on_remove(self, node: Hashable) -> None:
        """``node`` was evicted."""
        hashes = event_hashes(self._digests.pop(node))
        self.num_removed += len(hashes)
        tail = self._queue[-1] if self._queue else None
        if isinstance(tail, BlockRemoved) and tail.medium == self.medium:
            tail.block_hashes.extend(hashes)
            return
        self._queue.append(BlockRemoved(block_hashes=hashes, medium=self.medium))

    def apply(self, ops: list[tuple[Any, ...]]) -> None:
        """Apply the changes ``TreeOps`` recorded, in order."""
        for op in ops:
            if op[0] == _STORE:
                self.on_store(op[1], op[2], op[3])
            elif op[0] == _SPLIT:
                self.on_split(op[1], op[2], op[3])
            else:
                self.on_remove(op[1])

    def take(self) -> list[Event]:
        """The events recorded since the last ``take`` (and forget them)."""
        events, self._queue = self._queue, []
        return events

    def block_hashes(self) -> set[int]:
        """The hash of every page the tree holds now, as the events told it."""
        return {h for digests in self._digests.values() for h in event_hashes(digests)}


class TreeEvents(EventBuilder):
    """A ``TreeListener`` that builds SGLang's events for one radix cache, in this process."""

    def __init__(self, tree: RadixCache, medium: str = GPU) -> None:
        super().__init__(tree.page_size, medium)
        self._root = tree.root_node

    def stored(self, leaf: TreeNode) -> None:
        parent = leaf.parent
        self.on_store(leaf, None if parent is self._root else parent, leaf.key)

    def split(self, upper: TreeNode, child: TreeNode) -> None:
        self.on_split(upper, child, len(upper))

    def removed(self, node: TreeNode) -> None:
        self.on_remove(node)


_STORE, _SPLIT, _REMOVE = 0, 1, 2


class TreeOps:
    """A ``TreeListener`` that only records the changes, by node id, for an
    ``EventBuilder`` in another process (``BackgroundEmitter``): hashing is the costly part."""

    def __init__(self, tree: RadixCache) -> None:
        self._root = tree.root_node
        self.ops: list[tuple[Any, ...]] = []

    def stored(self, leaf: TreeNode) -> None:
        parent = leaf.parent
        assert parent is not None
        self.ops.append((_STORE, leaf.id, None if parent is self._root else parent.id, leaf.key))

    def split(self, upper: TreeNode, child: TreeNode) -> None:
        self.ops.append((_SPLIT, upper.id, child.id, len(upper)))

    def removed(self, node: TreeNode) -> None:
        self.ops.append((_REMOVE, node.id))

    def take(self) -> list[tuple[Any, ...]]:
        ops, self.ops = self.ops, []
        return ops


def events_tree(tree: RadixCache | None, spec: str) -> RadixCache | None:
    """``tree`` (the allocator ``spec``'s radix cache) if events can be derived from it.

    Returns:
        The tree; None for a disabled cache (SGLang publishes nothing without one).

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
        raise eagle_refusal()
    return tree


def eagle_refusal() -> ConfigError:
    """The one line that refuses KV events of an EAGLE trace (any version)."""
    return ConfigError(
        "--kv-events: this trace uses EAGLE speculative decoding, whose radix cache is keyed by token "
        "pairs that kvtrace keeps only as 64-bit mixes, so SGLang's pair events cannot be derived; "
        "use a trace without EAGLE"
    )


def attach(tree: RadixCache | None, spec: str) -> TreeEvents | None:
    """Attach a ``TreeEvents`` to ``tree`` (see ``events_tree``); None for a disabled cache."""
    tree = events_tree(tree, spec)
    if tree is None:
        return None
    listener = TreeEvents(tree)
    tree.listener = listener
    return listener


class _Pacer:
    """Holds each batch until its step's time in the trace has passed since the first one's."""

    def __init__(self, sleep: Callable[[float], None] = time.sleep) -> None:
        self._sleep = sleep
        self._t0: tuple[float, float] | None = None  # (trace time, wall time) of the first batch

    def hold(self, time_s: float) -> None:
        now = time.monotonic()
        if self._t0 is None:
            self._t0 = (time_s, now)
            return
        wait = (time_s - self._t0[0]) - (now - self._t0[1])
        if wait > 0:
            self._sleep(wait)


class Emitter:
    """Publishes a replay's events as it goes, in this process: after each step, the
    step's batch (if any) goes to ``send`` as the next frame (sequence numbers from 0).

    Args:
        session: the replay, not started yet (the listener must see every change).
        send: where each frame goes (``EventFileWriter.write``, ``ZmqPublisher.send``).
        topic: the frames' topic.
        paced: hold each batch until its step's time in the trace has passed since the
            first step (else as fast as the replay goes).
        sleep: how to wait (tests pass a fake).

    Raises:
        ConfigError: see ``events_tree``.
    """

    def __init__(self, session: ReplaySession, send: Callable[[Frame], Any], *, topic: bytes = b"",
                 paced: bool = False, sleep: Callable[[float], None] = time.sleep) -> None:
        self.listener = attach(getattr(session.allocator, "tree_cache", None), session.version.spec)
        self._send = send
        self.topic = topic
        self._pacer = _Pacer(sleep) if paced else None
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
        if self._pacer is not None:
            self._pacer.hold(snap.time_s)
        payload = encode(KVEventBatch(ts=snap.time_s, events=events, attn_dp_rank=0))
        self._send(Frame(self.topic, self.num_batches, payload))
        self.num_batches += 1
        self.num_events += len(events)

    def summary(self) -> dict[str, int]:
        """The counts for ``kvtrace replay --json`` (``kv_events``)."""
        listener = self.listener
        return {
            "batches": self.num_batches,
            "events": self.num_events,
            "blocks_stored": 0 if listener is None else listener.num_stored,
            "blocks_removed": 0 if listener is None else listener.num_removed,
        }


class BackgroundEmitter:
    """``Emitter`` with the costly part (hashing, encoding, writing or publishing) in a
    child process: the replay records only what changed in its tree (``TreeOps``) and
    hands each step's changes over a pipe.

    Args:
        session: the replay, not started yet.
        target: where the frames go (``kvtrace.events.wire.FileTarget`` or ``ZmqTarget``),
            opened by the child before this returns.
        topic, paced: as for ``Emitter``.

    Raises:
        ConfigError: see ``events_tree``.
        EventStreamError: the child cannot open the target (a port in use, ...).
    """

    def __init__(self, session: ReplaySession, target: Any, *, topic: bytes = b"", paced: bool = False) -> None:
        import multiprocessing as mp

        from traces.lifeline import parent_tie, quiet_start

        tree = events_tree(getattr(session.allocator, "tree_cache", None), session.version.spec)
        self._ops = None if tree is None else TreeOps(tree)
        # fork: the child starts at once; it touches numpy, hashlib, msgspec and ZMQ (its
        # context made there), never torch. Elsewhere, spawn.
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        self._conn, child_conn = ctx.Pipe(duplex=True)
        page_size = session.config.page_size
        self._proc = ctx.Process(target=_publish_in_child, args=(child_conn, target, topic, paced, page_size,
                                                                 parent_tie()), daemon=True)
        with quiet_start():
            self._proc.start()
        child_conn.close()
        self._summary: dict[str, int] | None = None
        kind, detail = self._receive()
        if kind != "ready":
            self._proc.join()
            raise EventStreamError(detail)
        if tree is not None and self._ops is not None:
            tree.listener = self._ops
        self._first = True

    def _receive(self) -> tuple[str, Any]:
        try:
            return self._conn.recv()
        except EOFError:
            return "error", f"the KV-event publisher process died (exit code {self._proc.exitcode})"

    def after(self, snap: StepSnapshot) -> None:
        """Hand over what step ``snap`` changed (the first step always: its AllBlocksCleared).

        Raises:
            EventStreamError: the child stopped (naming why).
        """
        if self._ops is None:
            return
        ops = self._ops.take()
        if ops or self._first:
            self._first = False
            try:
                self._conn.send((snap.time_s, ops))
            except (BrokenPipeError, OSError):  # the child stopped: say why
                kind, detail = self._receive()
                self._proc.join()
                raise EventStreamError(detail if kind == "error" else "the KV-event publisher process stopped") from None

    def close(self) -> None:
        """Wait for the child to publish everything and close its target.

        Raises:
            EventStreamError: it failed (naming why).
        """
        if self._summary is not None:
            return
        try:
            self._conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        kind, detail = self._receive()
        self._proc.join()
        self._conn.close()
        if kind != "done":
            raise EventStreamError(detail)
        self._summary = detail

    def abort(self) -> None:
        """Stop the child at once (the replay failed or was interrupted)."""
        if self._proc.is_alive():
            self._proc.terminate()
        self._proc.join()
        self._conn.close()

    def summary(self) -> dict[str, int]:
        """The counts for ``kvtrace replay --json`` (after ``close``)."""
        assert self._summary is not None, "close() first"
        return self._summary


def _publish_in_child(conn: Any, target: Any, topic: bytes, paced: bool, page_size: int,
                      tie: tuple[int, bool]) -> None:
    """The child of ``BackgroundEmitter``: builds, encodes and sends the events of each
    step it is handed, until handed None; answers ("done", summary) or ("error", why)."""
    import multiprocessing as mp

    from kvtrace.events.wire import open_target
    from traces.lifeline import settle

    parent = mp.parent_process()
    settle(tie[0], parent.sentinel if parent is not None else None, tie[1])
    try:
        send, close = open_target(target)
    except EventStreamError as exc:
        conn.send(("error", str(exc)))
        return
    conn.send(("ready", None))
    builder = EventBuilder(page_size)
    pacer = _Pacer() if paced else None
    num_batches = num_events = 0
    result: tuple[str, Any]
    try:
        while (message := conn.recv()) is not None:
            time_s, ops = message
            builder.apply(ops)
            events = builder.take()
            if not events:
                continue
            if pacer is not None:
                pacer.hold(time_s)
            send(Frame(topic, num_batches, encode(KVEventBatch(ts=time_s, events=events, attn_dp_rank=0))))
            num_batches += 1
            num_events += len(events)
        close()
        result = ("done", {"batches": num_batches, "events": num_events, "blocks_stored": builder.num_stored,
                           "blocks_removed": builder.num_removed})
    except EOFError:  # the replay went away
        return
    except OSError as exc:
        result = ("error", f"{target}: cannot write the events ({exc.strerror or exc})")
    conn.send(result)
