"""The walk of ``kvtrace diff``: two sides' record streams compared step by step.

``compare_sides`` walks both streams with the one step comparator
(``kvtrace.diff.compare``): chunks of identical records are skipped in one comparison
per column, other steps are compared field by field; each divergence found carries
the last steps of the diverging request's (or pool field's) history, kept in a window
of recent steps. ``kvtrace.diff.diff`` and ``kvtrace.diff.rangediff`` build the sides
and turn what the walk finds into a report.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtrace.diff.compare import Divergence, FieldDiff, StepView, compare_step
from kvtrace.replay.snapshot import PHASES, POOL_NAMES, PoolCounters, op_name

if TYPE_CHECKING:
    from kvtrace.diff.diff import DiffOptions
    from kvtrace.diff.sides import Chunk
    from kvtrace.replay.snapshot import StepSnapshot

__all__ = ["ReportedDivergence", "RequestStep", "compare_sides", "pool_of_field"]

REQUEST_FIELDS = ("kv_allocated_len", "kv_committed_len", "cache_protected_len", "prefix_len", "phase", "op")
_WINDOW_STEPS = 512  # recent steps kept for the context of a divergence
_DESCRIBE = {
    "phase": lambda x, y: (PHASES[int(x)], PHASES[int(y)], ""),
    "op": lambda x, y: (op_name(int(x)), op_name(int(y)), ""),
}


@dataclass(frozen=True, slots=True)
class RequestStep:
    """One step of a diverging request's (or pool field's) history on both sides:
    the values after the step, None on a side where the step did not change it."""

    step: int
    a: dict[str, Any] | None
    b: dict[str, Any] | None

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "a": self.a, "b": self.b}


@dataclass(frozen=True, slots=True)
class ReportedDivergence:
    """A divergence and the last steps before it (``history``, oldest first, ending
    with the diverging step).

    On a hybrid (SWA) trace ``pools`` holds each pool's counters on both sides after
    the diverging step (``{"full": {"a": {...}, "b": {...}, "differs": [...]}, "swa": ...}``)
    and ``pool`` the pool that diverged: the pool of the divergence's own field when it
    is a pool counter, else the first pool (``POOL_NAMES`` order) whose counters differ
    at that step, else None. Both stay None on a full-attention trace, whose report
    keeps its keys as they were.
    """

    divergence: Divergence
    history: tuple[RequestStep, ...]
    pool: str | None = None
    pools: dict[str, dict[str, Any]] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {**self.divergence.to_dict(), "history": [h.to_dict() for h in self.history]}
        if self.pools is not None:
            out.update(pool=self.pool, pools=self.pools)
        return out



# ---------------------------------------------------------------------------- views


def _pool_values(snap: StepSnapshot) -> dict[str, int]:
    """Every pool's counters as one mapping: the full pool's under their own names (as
    before hybrid models), each other pool's prefixed by its name (``swa_available``,
    the state log's column names)."""
    out: dict[str, int] = snap.pool._asdict()
    for name, counters in list(snap.pools.items())[1:]:
        out.update({f"{name}_{k}": v for k, v in counters._asdict().items()})
    return out


def pool_of_field(name: str) -> str | None:
    """The pool a compared field belongs to (``available``: full, ``swa_available``: swa),
    None for a field of no one pool (a request's lengths, an outcome, the digest)."""
    if name in PoolCounters._fields:
        return POOL_NAMES[0]
    for pool in POOL_NAMES[1:]:
        if name.startswith(pool + "_") and name.removeprefix(pool + "_") in PoolCounters._fields:
            return pool
    return None


def _pool_figures(sa: StepSnapshot, sb: StepSnapshot) -> dict[str, dict[str, Any]]:
    """Each pool's counters on both sides after one step, and which of them differ."""
    out: dict[str, dict[str, Any]] = {}
    for name, a in sa.pools.items():
        b = sb.pools.get(name)
        if b is None:
            continue
        x, y = a._asdict(), b._asdict()
        out[name] = {"a": x, "b": y, "differs": [k for k in x if x[k] != y[k]]}
    return out


def _diverged_pool(first: FieldDiff, figures: dict[str, dict[str, Any]]) -> str | None:
    own = pool_of_field(first.field)
    if own is not None:
        return own
    return next((name for name, f in figures.items() if f["differs"]), None)


def _view(snap: StepSnapshot, exact: bool) -> StepView:
    d = snap.requests
    return StepView(
        step=snap.step,
        events=[(e.kind, e.rid, e.tokens) for e in snap.events],
        rids=d.rids,
        requests={
            "kv_allocated_len": d.allocated, "kv_committed_len": d.committed, "cache_protected_len": d.protected,
            "prefix_len": d.prefix, "phase": d.phase, "op": d.op,
        },
        pool=_pool_values(snap),
        physical={"state_digest": snap.digest} if exact else {},
        presence="changed",
    )


def _event_text(key: tuple[Any, ...] | None) -> str:
    if key is None:
        return "(none)"
    kind, rid, tokens = key
    who = "" if rid is None else f" request {rid}"
    return f"{kind}{who}" + (f" {tokens:,} tokens" if tokens else "")


def _same_step(sa: StepSnapshot, sb: StepSnapshot, exact: bool) -> bool:
    """The quick check of a step's equality (equal here means ``compare_step`` finds nothing)."""
    if sa.step != sb.step or sa.pool != sb.pool or sa.other_pools != sb.other_pools or (exact and sa.digest != sb.digest):
        return False
    if len(sa.events) != len(sb.events) or any(
        (x.kind, x.rid, x.tokens) != (y.kind, y.rid, y.tokens) for x, y in zip(sa.events, sb.events)
    ):
        return False
    return all(x.tobytes() == y.tobytes() for x, y in zip(sa.requests, sb.requests))


def _step_diffs(sa: StepSnapshot | None, sb: StepSnapshot | None, exact: bool) -> list[FieldDiff]:
    if sa is not None and sb is not None and _same_step(sa, sb, exact):
        return []
    if sa is None or sb is None:
        return [FieldDiff(
            "step", None, "(ended)" if sa is None else sa.step, "(ended)" if sb is None else sb.step,
            "one side's replay ended before the other's (an out-of-memory with --on-oom stop, a violation limit)",
        )]
    return compare_step(_view(sa, exact), _view(sb, exact), describe=_DESCRIBE, event_text=_event_text,
                        event_detail="the step's outcomes differ")


def _op_of(snaps: tuple[StepSnapshot | None, ...], rid: int | None) -> str:
    """The op that changed ``rid`` in this step (or the step's ops, for a pool field)."""
    for s in snaps:
        if s is None:
            continue
        d = s.requests
        if rid is not None:
            hit = np.flatnonzero(d.rids == rid)
            if hit.shape[0]:
                return op_name(int(d.op[hit[0]]))
    codes: list[int] = []
    for s in snaps:
        if s is not None:
            codes.extend(int(c) for c in np.unique(s.requests.op))
    names = sorted({op_name(c) for c in codes if c >= 0})
    return "+".join(names) if names else "-"


# ---------------------------------------------------------------------------- history


def _request_values(snap: StepSnapshot | None, rid: int) -> dict[str, Any] | None:
    if snap is None:
        return None
    d = snap.requests
    hit = np.flatnonzero(d.rids == rid)
    if hit.shape[0] == 0:
        return None
    i = int(hit[0])
    return {
        "op": op_name(int(d.op[i])), "phase": PHASES[int(d.phase[i])], "kv_allocated_len": int(d.allocated[i]),
        "kv_committed_len": int(d.committed[i]), "cache_protected_len": int(d.protected[i]), "prefix_len": int(d.prefix[i]),
    }


def _field_values(snap: StepSnapshot | None, name: str) -> dict[str, Any] | None:
    if snap is None:
        return None
    if pool_of_field(name) is not None:
        return {name: int(_pool_values(snap)[name])}
    if name == "state_digest":
        return {name: snap.digest}
    if name.startswith("events"):
        return {"events": [_event_text((e.kind, e.rid, e.tokens)) for e in snap.events]}
    return {"step": snap.step}


class _Window:
    """The most recent compared steps: single pairs, or whole chunk pairs skipped as
    identical (decoded only when a divergence asks for its history)."""

    def __init__(self, steps: int = _WINDOW_STEPS) -> None:
        self._items: deque[Any] = deque()
        self._steps = 0
        self._limit = steps

    def add_pair(self, sa: StepSnapshot | None, sb: StepSnapshot | None) -> None:
        self._push(("pair", sa, sb), 1)

    def add_chunks(self, ca: Chunk, cb: Chunk) -> None:
        self._push(("chunks", ca, cb), len(ca))

    def _push(self, item: Any, steps: int) -> None:
        self._items.append((item, steps))
        self._steps += steps
        while self._steps - self._items[0][1] >= self._limit:
            self._steps -= self._items.popleft()[1]

    def newest_first(self) -> Iterator[tuple[StepSnapshot | None, StepSnapshot | None]]:
        for (kind, x, y), _ in reversed(self._items):
            if kind == "pair":
                yield x, y
            else:
                yield from reversed(list(zip(x.snapshots, y.snapshots)))

    def history(self, rid: int | None, field_name: str, limit: int) -> tuple[RequestStep, ...]:
        rows: list[RequestStep] = []
        for sa, sb in self.newest_first():
            if len(rows) >= limit:
                break
            if rid is None:
                a, b = _field_values(sa, field_name), _field_values(sb, field_name)
            else:
                a, b = _request_values(sa, rid), _request_values(sb, rid)
                if a is None and b is None:
                    continue
            step = sa.step if sa is not None else sb.step if sb is not None else -1
            rows.append(RequestStep(step, a, b))
        return tuple(reversed(rows))


# ---------------------------------------------------------------------------- the walk


class _Cursor:
    """Steps of one side, chunk by chunk."""

    def __init__(self, chunks: Iterator[Chunk]) -> None:
        self._chunks = chunks
        self._chunk: Chunk | None = None
        self._pos = 0
        self.ended = False

    def peek_chunk(self) -> Chunk | None:
        """The next whole chunk, when the cursor sits at a chunk boundary (else None)."""
        if self._chunk is None and not self.ended:
            self._chunk = next(self._chunks, None)
            self._pos = 0
            if self._chunk is None:
                self.ended = True
        return self._chunk if self._pos == 0 else None

    def take_chunk(self) -> None:
        self._chunk = None

    def next_step(self) -> StepSnapshot | None:
        while True:
            if self._chunk is None:
                if self.ended:
                    return None
                self._chunk = next(self._chunks, None)
                self._pos = 0
                if self._chunk is None:
                    self.ended = True
                    return None
            snaps = self._chunk.snapshots
            if self._pos < len(snaps):
                self._pos += 1
                return snaps[self._pos - 1]
            self._chunk = None

    def take_chunk_any(self) -> None:
        """Drop the rest of the current chunk and read the next one (drain)."""
        self._chunk = next(self._chunks, None)
        self._pos = 0
        if self._chunk is None:
            self.ended = True


def compare_sides(
    side_a: Any, side_b: Any, options: DiffOptions, on_progress: Callable[[int], None] | None = None
) -> tuple[int, list[ReportedDivergence]]:
    """Walk both sides' records to their ends, comparing every step.

    Args:
        on_progress: called with the last step reached, after each step or chunk of
            steps (compared, or read uncompared after the last divergence wanted).

    Returns:
        Steps compared, and the divergences found (at most ``options.max_divergences``,
        each request or pool field once). After the last divergence wanted both
        streams are read to their end uncompared (their summaries need the whole replay).
    """
    ca, cb = _Cursor(side_a.chunks()), _Cursor(side_b.chunks())
    window = _Window(max(_WINDOW_STEPS, 4 * options.context))
    found: list[ReportedDivergence] = []
    reported: set[Any] = set()
    steps = 0
    progress = on_progress or _no_progress
    while len(found) < options.max_divergences:
        x, y = ca.peek_chunk(), cb.peek_chunk()
        if x is not None and y is not None and len(x) == len(y) and x.same_as(y):
            steps += len(x)
            window.add_chunks(x, y)
            ca.take_chunk()
            cb.take_chunk()
            progress(_last_step(x))
            continue
        sa, sb = ca.next_step(), cb.next_step()
        if sa is None and sb is None:
            break
        steps += 1
        window.add_pair(sa, sb)
        progress(sa.step if sa is not None else sb.step)  # type: ignore[union-attr]
        diffs = _step_diffs(sa, sb, options.exact)
        fresh = [d for d in diffs if (d.rid if d.rid is not None else d.field) not in reported]
        if not fresh:
            continue
        first = fresh[0]
        reported.add(first.rid if first.rid is not None else first.field)
        step = sa.step if sa is not None else sb.step  # type: ignore[union-attr]
        op = _op_of((sa, sb), first.rid)
        divergence = Divergence.of(step, op, [first] + [d for d in diffs if d is not first])
        history = window.history(first.rid, first.field, options.context)
        if sa is not None and sb is not None and sa.other_pools:
            figures = _pool_figures(sa, sb)
            found.append(ReportedDivergence(divergence, history, _diverged_pool(first, figures), figures))
        else:
            found.append(ReportedDivergence(divergence, history))
        if sa is None or sb is None:
            break  # one side ended: nothing more to compare
    _drain(ca, cb, progress)
    return steps, found


def _drain(ca: _Cursor, cb: _Cursor, progress: Callable[[int], None]) -> None:
    """Read both streams to their end, a chunk of each in turn (a side in another
    process must not wait for the other's to finish)."""
    while not (ca.ended and cb.ended):
        for cursor in (ca, cb):
            if not cursor.ended:
                cursor.take_chunk_any()
                chunk = cursor.peek_chunk()
                if chunk is not None and len(chunk):
                    progress(_last_step(chunk))


def _last_step(chunk: Chunk) -> int:
    """The chunk's last step number (read from its record batch without decoding it)."""
    if chunk.batch is not None:
        return int(chunk.batch.column("step")[len(chunk) - 1].as_py())
    return chunk.snapshots[-1].step


def _no_progress(step: int) -> None:
    """``compare_sides``'s progress callback when none is given."""
