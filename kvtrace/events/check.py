"""Checks of a KV-event stream: alone, and against what a replay's cache really held.

A stream is a sequence of frames (``kvtrace.events.wire``); their payloads may be in
SGLang's or vLLM's schema, each event a tagged map (``{"type": "BlockStored", ...}``)
or a positional array with the tag first (``["BlockStored", hashes, parent, tokens,
block_size, lora_id, medium, ...]``), block hashes ints or bytes. ``StreamChecker``
builds the index a router builds from the events, one per ``medium`` (a missing medium
is its own, ``None``: a dropped tag shows as removes of blocks never stored), and
reports what no correct publisher sends: gaps in the sequence numbers, removes of
blocks never stored, duplicate stores, stores under an unknown parent, mid-chain
removals (a block removed while a child of it stays).

``check_against`` replays a trace, derives the events its cache publishes
(``kvtrace.events.emit``) and compares the stream's index with the replay's after every
step (the stream's batch of sequence number k against the replay's k-th batch): the
first step where they differ first, then every later step where the difference changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Union

from kvtrace.events.wire import Frame

if TYPE_CHECKING:
    from kvtrace.events.emit import StepEvents

__all__ = [
    "AgainstResult",
    "CheckResult",
    "Divergence",
    "Problem",
    "StreamChecker",
    "check_against",
    "check_stream",
    "decode_payload",
]

Hash = Union[int, bytes]
ProblemKind = Literal[
    "gap", "out-of-order", "bad-payload", "unknown-remove", "duplicate-store", "unknown-parent", "mid-chain-removal",
]
MAX_LISTED = 5  # blocks listed per divergence
MAX_DIVERGENCES = 50  # divergences listed (all are counted)


class Event(NamedTuple):
    """One event, whichever schema it came in."""

    kind: Literal["stored", "removed", "cleared"]
    hashes: tuple[Hash, ...]
    parent: Hash | None  # (stored) the first block's parent
    medium: str | None


class Problem(NamedTuple):
    """Something in the stream no correct publisher sends."""

    seq: int  # the frame's sequence number
    step: int | None  # the replay's step of that sequence number (--against), else None
    kind: ProblemKind
    medium: str | None
    block: Hash | None
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "step": self.step, "kind": self.kind, "medium": self.medium,
                "block": show_hash(self.block), "detail": self.detail}


def show_hash(h: Hash | None) -> int | str | None:
    """A block hash for people and JSON: an int as it is, bytes as hex."""
    return h.hex() if isinstance(h, bytes) else h


def _hash(value: Any) -> Hash:
    if isinstance(value, (int, bytes)):
        return value
    raise ValueError(f"a block hash must be an int or bytes, found {type(value).__name__}")


_POSITIONAL = {  # field positions after the tag (vLLM's array_like events)
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def _event(raw: Any) -> Event:
    if isinstance(raw, dict):
        kind = raw.get("type")
        fields = raw
    elif isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        kind = raw[0]
        fields = dict(zip(_POSITIONAL.get(kind, ()), raw[1:]))
    else:
        raise ValueError(f"an event is a tagged map or a positional array with its tag first, found {raw!r:.60}")
    medium = fields.get("medium")
    if kind == "BlockStored":
        parent = fields.get("parent_block_hash")
        return Event("stored", tuple(_hash(h) for h in fields["block_hashes"]),
                     None if parent is None else _hash(parent), medium)
    if kind == "BlockRemoved":
        return Event("removed", tuple(_hash(h) for h in fields["block_hashes"]), None, medium)
    if kind == "AllBlocksCleared":
        return Event("cleared", (), None, medium)
    raise ValueError(f"unknown event type {kind!r} (BlockStored, BlockRemoved, AllBlocksCleared)")


def decode_payload(payload: bytes) -> tuple[float, list[Event]]:
    """The time and events of one batch's msgpack payload (either schema, either form).

    Raises:
        ValueError: not a batch of known events (says what was found).
    """
    import msgspec

    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not msgpack ({exc})") from None
    if isinstance(raw, dict):
        ts, events = raw.get("ts"), raw.get("events")
    elif isinstance(raw, (list, tuple)) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
    else:
        raise ValueError(f"a batch is [ts, events, rank] or a map with ts and events, found {raw!r:.60}")
    if not isinstance(events, (list, tuple)):
        raise ValueError(f"a batch's events are a list, found {type(events).__name__}")
    return float(ts or 0.0), [_event(e) for e in events]


@dataclass
class _Medium:
    """The index of one medium: each held block's parent, and how many held children each has."""

    parent: dict[Hash, Hash | None] = field(default_factory=dict)
    children: dict[Hash, int] = field(default_factory=dict)
    stored: int = 0
    removed: int = 0


class StreamChecker:
    """Builds a router's index from frames fed in order and reports problems.

    Args:
        step_of: the replay's step of a sequence number (None where unknown).
        on_change: told of every (medium, block) that enters or leaves the index.
    """

    def __init__(self, step_of: Callable[[int], int | None] = lambda seq: None,
                 on_change: Callable[[str | None, Hash], None] | None = None) -> None:
        self.step_of = step_of
        self.on_change = on_change
        self.media: dict[str | None, _Medium] = {}
        self.problems: list[Problem] = []
        self.num_batches = 0
        self.num_events = 0
        self.num_cleared = 0  # AllBlocksCleared events (they clear every medium)
        self.last_seq: int | None = None

    def _problem(self, seq: int, kind: ProblemKind, medium: str | None, block: Hash | None, detail: str) -> None:
        self.problems.append(Problem(seq, self.step_of(seq), kind, medium, block, detail))

    def feed(self, frame: Frame) -> None:
        """Apply one frame (its sequence number first, then its events in order)."""
        seq = frame.seq
        expected = 0 if self.last_seq is None else self.last_seq + 1
        if seq > expected:
            missing = f"batch {expected}" if seq == expected + 1 else f"batches {expected}..{seq - 1}"
            self._problem(seq, "gap", None, None, f"sequence gap: {missing} missing before {seq}")
        elif seq < expected:
            self._problem(seq, "out-of-order", None, None, f"sequence {seq} after {expected - 1}")
        self.last_seq = seq if self.last_seq is None else max(seq, self.last_seq)
        try:
            _ts, events = decode_payload(frame.payload)
        except (ValueError, KeyError, TypeError) as exc:
            self._problem(seq, "bad-payload", None, None, f"undecodable payload: {exc}")
            return
        self.num_batches += 1
        self.num_events += len(events)
        for event in events:
            if event.kind == "stored":
                self._store(seq, event)
            elif event.kind == "removed":
                self._remove(seq, event)
            else:
                self._clear()

    def _index(self, medium: str | None) -> _Medium:
        index = self.media.get(medium)
        if index is None:
            index = self.media[medium] = _Medium()
        return index

    def _store(self, seq: int, event: Event) -> None:
        index = self._index(event.medium)
        parent = event.parent
        if parent is not None and parent not in index.parent:
            self._problem(seq, "unknown-parent", event.medium, event.hashes[0] if event.hashes else None,
                          f"stored under parent {show_hash(parent)}, which the stream never stored (or removed)")
        for h in event.hashes:
            if h in index.parent:
                self._problem(seq, "duplicate-store", event.medium, h,
                              "stored again while held (a missed BlockRemoved or AllBlocksCleared?)")
            else:
                index.parent[h] = parent
                index.stored += 1
                if parent is not None:
                    index.children[parent] = index.children.get(parent, 0) + 1
                if self.on_change is not None:
                    self.on_change(event.medium, h)
            parent = h

    def _remove(self, seq: int, event: Event) -> None:
        index = self._index(event.medium)
        removed = []
        for h in event.hashes:
            if h not in index.parent:
                self._problem(seq, "unknown-remove", event.medium, h, "removed, but never stored (or removed twice)")
                continue
            parent = index.parent.pop(h)
            index.removed += 1
            if parent is not None and index.children.get(parent):
                index.children[parent] -= 1
            removed.append(h)
            if self.on_change is not None:
                self.on_change(event.medium, h)
        for h in removed:  # a whole event's removes first: a node goes with its pages
            left = index.children.pop(h, 0)
            if left:
                self._problem(seq, "mid-chain-removal", event.medium, h,
                              f"removed while {left} child block(s) of it stay in the index")

    def _clear(self) -> None:
        self.num_cleared += 1
        for medium, index in self.media.items():
            if self.on_change is not None:
                for h in index.parent:
                    self.on_change(medium, h)
            index.parent.clear()
            index.children.clear()

    def media_summary(self) -> dict[str, dict[str, int]]:
        """Per medium (``None`` shown as ``"untagged"``): blocks stored, removed and held."""
        return {
            "untagged" if m is None else m: {"stored": i.stored, "removed": i.removed, "held": len(i.parent)}
            for m, i in self.media.items()
        }


class Divergence(NamedTuple):
    """A step after which the stream's index and the replay's cache differ."""

    step: int | None  # None: after the replay's last batch
    seq: int  # the replay's batch at that step (its sequence number)
    num_blocks: int  # blocks held by one side only
    stream_only: list[tuple[str | None, Hash]]  # (medium, block), the first few
    replay_only: list[tuple[str | None, Hash]]

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step, "seq": self.seq, "blocks": self.num_blocks,
            "stream_only": [{"medium": m, "block": show_hash(h)} for m, h in self.stream_only],
            "replay_only": [{"medium": m, "block": show_hash(h)} for m, h in self.replay_only],
        }


@dataclass
class AgainstResult:
    """How the stream compares with a replay."""

    batches: int  # batches the replay published
    last_step: int | None  # the step of its last batch
    divergences: list[Divergence]  # the first MAX_DIVERGENCES
    num_divergent_steps: int

    @property
    def identical(self) -> bool:
        return self.num_divergent_steps == 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "batches": self.batches, "last_step": self.last_step, "identical": self.identical,
            "divergent_steps": self.num_divergent_steps,
            "first_divergence": self.divergences[0].to_dict() if self.divergences else None,
            "divergences": [d.to_dict() for d in self.divergences],
        }


@dataclass
class CheckResult:
    """What ``kvtrace events check`` reports."""

    checker: StreamChecker
    against: AgainstResult | None = None

    @property
    def ok(self) -> bool:
        return not self.checker.problems and (self.against is None or self.against.identical)

    def to_dict(self) -> dict[str, Any]:
        c = self.checker
        return {
            "ok": self.ok, "batches": c.num_batches, "events": c.num_events, "clears": c.num_cleared,
            "media": c.media_summary(),
            "problems": [p.to_dict() for p in c.problems],
            "against": None if self.against is None else self.against.to_dict(),
        }


def check_stream(frames: Iterable[Frame], on_frame: Callable[[Frame], None] | None = None) -> CheckResult:
    """Check a stream alone."""
    checker = StreamChecker()
    for frame in frames:
        checker.feed(frame)
        if on_frame is not None:
            on_frame(frame)
    return CheckResult(checker)


class _Diff:
    """The blocks held by exactly one side (stream or replay), kept as both change."""

    def __init__(self) -> None:
        self.blocks: set[tuple[str | None, Hash]] = set()
        self.replay: dict[str | None, set[Hash]] = {}
        self.changed = False

    def toggle(self, medium: str | None, h: Hash) -> None:
        key = (medium, h)
        if key in self.blocks:
            self.blocks.remove(key)
        else:
            self.blocks.add(key)
        self.changed = True

    def apply_replay(self, events: Iterable[Any]) -> None:
        from kvtrace.events.blocks import AllBlocksCleared, BlockStored

        for event in events:
            if isinstance(event, AllBlocksCleared):
                for medium, held in self.replay.items():
                    for h in held:
                        self.toggle(medium, h)
                    held.clear()
                continue
            held = self.replay.setdefault(event.medium, set())
            if isinstance(event, BlockStored):
                held.update(event.block_hashes)
            else:
                held.difference_update(event.block_hashes)
            for h in event.block_hashes:
                self.toggle(event.medium, h)

    def divergence(self, step: int | None, seq: int) -> Divergence:
        stream_only, replay_only = [], []
        for medium, h in sorted(self.blocks, key=lambda b: (str(b[0]), str(b[1]))):
            side = replay_only if h in self.replay.get(medium, ()) else stream_only
            if len(side) < MAX_LISTED:
                side.append((medium, h))
        return Divergence(step, seq, len(self.blocks), stream_only, replay_only)


def check_against(frames: Iterable[Frame], expected: Iterator[StepEvents],
                  on_step: Callable[[int], None] | None = None) -> CheckResult:
    """Check a stream and compare it, step by step, with the events a replay published.

    Args:
        frames: the stream, in arrival order.
        expected: the replay's batches (``kvtrace.events.sources.replay_events``).
        on_step: told of each replayed step with a batch (progress).
    """
    steps: list[int] = []
    diff = _Diff()
    checker = StreamChecker(lambda seq: steps[seq] if 0 <= seq < len(steps) else None, diff.toggle)
    divergences: list[Divergence] = []
    num_divergent = 0
    stream = iter(frames)
    pending = next(stream, None)

    def compare(step: int | None, seq: int) -> None:
        nonlocal num_divergent
        if diff.blocks:
            num_divergent += 1
            if diff.changed and len(divergences) < MAX_DIVERGENCES:
                divergences.append(diff.divergence(step, seq))
        diff.changed = False

    for k, batch in enumerate(expected):
        steps.append(batch.step)
        diff.apply_replay(batch.events)
        while pending is not None and pending.seq <= k:
            checker.feed(pending)
            pending = next(stream, None)
        compare(batch.step, k)
        if on_step is not None:
            on_step(batch.step)
    if pending is not None:  # batches past the replay's last
        for frame in [pending, *stream]:
            checker.feed(frame)
        compare(None, len(steps))
    against = AgainstResult(len(steps), steps[-1] if steps else None, divergences, num_divergent)
    return CheckResult(checker, against)

