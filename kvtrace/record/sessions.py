"""The conversations of a multi-turn workload, for recording with streaming sessions
(``kvtrace record --sessions``).

A workload line may name its conversation (``session_id``): such requests are the turns
of that session, in arrival order. The Mooncake conversation trace names none; its
multi-turn structure shows only through shared prefixes, so the conversations are
*inferred* for requests without an id: a request whose ``hash_ids`` extend the complete
blocks of an earlier request's ``hash_ids`` (its last block dropped when partial: the
next turn's prompt holds that block completed by the answer and the new message, under
another hash), at least ``MIN_BLOCKS`` of them, continues that earlier request's
conversation (the most recent such request). A session is append-only, so only the
conversation's latest turn can be continued; a second continuation of the same turn
starts a conversation of its own. Only an inferred conversation of two turns or more
becomes a session (a single request stays a plain one, whose KV is cached on finish);
a named one always does.

What the scheduler model does with them is ``kvtrace.record.scheduler`` (a session per
conversation, one request id per session).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from traces.workload_request import WorkloadRequest

__all__ = ["MIN_BLOCKS", "SessionPlan", "plan_sessions"]

# Every Mooncake request starts with block 0 (a shared system prompt): one complete
# block in common says nothing about a conversation.
MIN_BLOCKS = 2


@dataclass(frozen=True)
class SessionPlan:
    """The workload's requests with their ``session_id`` (None: a plain request) and the
    number of turns of each session (its last turn closes it)."""

    requests: list[WorkloadRequest]
    turns: dict[str, int]


def plan_sessions(requests: Iterable[WorkloadRequest]) -> SessionPlan:
    """The conversations of ``requests`` (in arrival order): the ids the workload gives,
    else inferred from the block hashes (module docstring). Inferred sessions are named
    ``conversation-N`` (N from 0, by first turn), distinct from any id the workload names."""
    out: list[WorkloadRequest] = list(requests)
    named = {r.session_id for r in out if r.session_id is not None}
    by_prefix: dict[int, int] = {}  # rolling key of complete blocks -> latest request with them
    conversation: list[int] = []  # per request: its inferred conversation (-1: named or none)
    tip: dict[int, int] = {}  # conversation -> its latest request
    count = 0
    for i, req in enumerate(out):
        conversation.append(-1)
        hashes = req.block_hashes
        if req.session_id is not None or hashes is None or not req.block_size:
            continue
        values = hashes.tolist()
        complete = req.input_len // req.block_size
        key, keys = 0, []
        for h in values:
            key = hash((key, h))
            keys.append(key)
        parent = -1
        for k in range(len(values), MIN_BLOCKS - 1, -1):
            j = by_prefix.get(keys[k - 1])
            if j is not None and out[j].block_hashes[:k].tolist() == values[:k]:  # type: ignore[index]
                parent = j
                break
        if parent >= 0 and tip.get(conversation[parent]) == parent:
            conversation[i] = conversation[parent]
        else:
            conversation[i] = count
            count += 1
        tip[conversation[i]] = i
        if complete >= MIN_BLOCKS:
            by_prefix[keys[complete - 1]] = i
    sizes: dict[int, int] = {}
    for c in conversation:
        if c >= 0:
            sizes[c] = sizes.get(c, 0) + 1
    names: dict[int, str] = {}
    turns: dict[str, int] = {}
    for i, c in enumerate(conversation):
        if c >= 0 and sizes[c] >= 2:
            if c not in names:
                name = f"conversation-{len(names)}"
                while name in named:
                    name = "_" + name
                names[c] = name
            out[i] = replace(out[i], session_id=names[c])
        sid = out[i].session_id
        if sid is not None:
            turns[sid] = turns.get(sid, 0) + 1
    return SessionPlan(out, turns)
