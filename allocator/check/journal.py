"""The change journal: what the lowest-level primitives did since the last check.

The primitives that change who holds a page or what a row says each carry a
``journal`` attribute, None unless an incremental checker is attached:

* the free lists: ``PageFreeList`` take / drop (pages leave) and prepend / append
  (pages come back), and the staged lists of the sorted (``need_sort``) mode;
* the radix tree: a new leaf (its slots enter the tree), a split, an eviction (its
  slots leave the tree), every lock / unlock;
* the table writer: every row range written;
* the request-row pool: rows taken and given back;
* the allocator's prompt publish: the requests it checkpointed.

With a journal attached each records, in call order, what it did; the checker
(``allocator.check.incremental``) replays the events against its shadow of the pool.
Recording at the primitives means a bug in a higher layer (an allocation function,
the manager) cannot change the pool without the change being seen. Without a
journal a primitive pays one attribute test.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from allocator.manager import KvAllocator
    from allocator.radix_cache import TreeNode

__all__ = ["Journal", "attach_journal", "detach_journal"]

# Event kinds (the first item of each event tuple).
TAKE = 0  # (TAKE, pages): pages left a free list
GIVE = 1  # (GIVE, pages): pages entered a free list (or the staged list)
INSERT = 2  # (INSERT, node, slots): a new radix leaf; its slots entered the tree
EVICT = 3  # (EVICT, node, parent, slots): node evicted; its slots left the tree
SPLIT = 4  # (SPLIT, upper, child): child split, upper is the new node above it
LOCK = 5  # (LOCK, node): the path root..node was locked or unlocked
WRITE = 6  # (WRITE, rows, starts, ends): table[rows[i], starts[i]:ends[i]] written
ROWS_TAKEN = 7  # (ROWS_TAKEN, rows): request rows handed out
ROWS_FREED = 8  # (ROWS_FREED, rows): request rows given back
TOUCH = 9  # (TOUCH, rids): requests whose bookkeeping changed outside the caller's call
POINTS = 10  # (POINTS, rows, positions): table[rows[i], positions[i]] written (one entry per row)
RECOVER = 11  # (RECOVER, node, old, new): an SWA tree node's full slots replaced (old leave, new enter)
SWA_CACHE = 12  # (SWA_CACHE, slots): SWA slots entered the SWA radix tree (its SWA journal)


class Journal:
    """An ordered list of change events (tuples; the first item is the kind).

    Arrays are recorded as copies where the primitive's argument may be a view that
    later changes (a row slice, the free-list buffer).
    """

    __slots__ = ("events",)

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def drain(self) -> list[tuple[Any, ...]]:
        """The events recorded since the last drain (and forget them)."""
        events, self.events = self.events, []
        return events

    def take(self, pages: np.ndarray) -> None:
        self.events.append((TAKE, pages))

    def give(self, pages: np.ndarray) -> None:
        self.events.append((GIVE, pages))

    def insert(self, node: TreeNode) -> None:
        # node.value now: a later split of the node replaces the attribute, not the array
        self.events.append((INSERT, node, node.value))

    def evict(self, node: TreeNode, parent: TreeNode) -> None:
        self.events.append((EVICT, node, parent, node.value))

    def split(self, upper: TreeNode, child: TreeNode) -> None:
        self.events.append((SPLIT, upper, child))

    def lock(self, node: TreeNode) -> None:
        self.events.append((LOCK, node))

    def write(self, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        self.events.append((WRITE, np.array(rows, dtype=np.int64), np.array(starts, dtype=np.int64),
                            np.array(ends, dtype=np.int64)))

    def points(self, rows: np.ndarray, positions: np.ndarray) -> None:
        self.events.append((POINTS, np.array(rows, dtype=np.int64), np.array(positions, dtype=np.int64)))

    def rows_taken(self, rows: list[int]) -> None:
        self.events.append((ROWS_TAKEN, list(rows)))

    def rows_freed(self, rows: list[int]) -> None:
        self.events.append((ROWS_FREED, list(rows)))

    def touch(self, rids: list[int]) -> None:
        self.events.append((TOUCH, list(rids)))

    def recover(self, node: TreeNode, old: np.ndarray) -> None:
        self.events.append((RECOVER, node, old, node.value))

    def swa_cache(self, slots: np.ndarray) -> None:
        self.events.append((SWA_CACHE, slots))


def _parts(allocator: KvAllocator) -> list[object]:
    from allocator.ownership import full_side

    # HiSparse: rows hold logical slots; the device side is checked whole. SWA: rows
    # hold full slots; the SWA pool journals into the checker's own SWA journal.
    logical = full_side(allocator.token_to_kv_pool_allocator)
    return [logical, logical._free, allocator.tree_cache, allocator.writer, allocator.req_to_token_pool, allocator]


def attach_journal(allocator: KvAllocator, journal: Journal) -> None:
    """Make the allocator's primitives record into ``journal``."""
    for part in _parts(allocator):
        part.journal = journal  # type: ignore[attr-defined]


def detach_journal(allocator: KvAllocator) -> None:
    """Stop recording (the primitives go back to one attribute test each)."""
    for part in _parts(allocator):
        part.journal = None  # type: ignore[attr-defined]
