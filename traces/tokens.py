"""Token content of a trace's requests, materialised on demand, vectorised.

A trace stores content compactly (see ``traces.schema``): position ``p`` of
request ``r`` is, in order of precedence,

1. the explicit id the op that appended ``p`` carried (``token_ids``);
2. for ``p < prompt_len`` with ``block_hashes``: a *block token* derived from
   block ``p // block_size`` and offset ``p % block_size`` (equal hashes give equal
   tokens, so equal leading hashes share a prefix);
3. otherwise a *unique token* of ``(r, p)``.

The three kinds live in disjoint ranges of int64, so a synthetic token can never
equal another kind's token::

    explicit ids   [0, 2**62)          real vocabularies (a trace should keep to this range)
    block tokens   [2**62, 2**63)      62 mixed bits of (hash, offset), bit 62 set
    unique tokens  [-2**62, -1]        -1 - (rid << 31 | p): exactly one per (rid, p)

Block tokens are ``splitmix64(hash)`` (per block) XOR ``splitmix64(offset + salt)``
(a per-offset table), so a whole prompt costs one XOR per token; unique tokens
are an arange, so decode appends need no work until someone asks for the ids.

``TokenStore`` keeps, per live request, the prompt length, its block hashes
and a lazily grown id buffer; explicit ids are logged vectorised at ingest and
folded into the buffers on demand. Only live requests cost memory.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from traces.batches import StepBatch
from traces.namespaces import NamespaceTable, in_namespace

BLOCK_TOKEN_BIT = np.uint64(1 << 62)
_LOW_62 = np.uint64((1 << 62) - 1)
_OFFSET_SALT = np.uint64(0x5BD1E9955BD1E995)
MAX_RID = 1 << 31  # unique tokens encode rid and position in 31 bits each
MAX_POSITION = 1 << 31

# Explicit ids waiting to be folded into their request's buffer are folded all
# at once when this many have accumulated (bounds the per-request scan in ``ids``).
_LOG_FOLD_ENTRIES = 1 << 14


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser over a uint64 array (wrapping arithmetic), a bijection."""
    z = np.asarray(x, np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@functools.lru_cache(maxsize=8)  # a process sees a few block sizes (one per trace)
def _offset_table(block_size: int) -> np.ndarray:
    offsets = np.arange(block_size, dtype=np.uint64) + _OFFSET_SALT
    table = splitmix64(offsets) & _LOW_62
    table.flags.writeable = False
    return table


def block_token_ids(block_hashes: np.ndarray, block_size: int, start: int, end: int) -> np.ndarray:
    """Tokens of positions ``[start, end)`` of a prompt made of ``block_hashes``.

    Args:
        block_hashes: uint64 hashes of the prompt's blocks, in order.
        block_size: tokens per block.
        start, end: the positions wanted; ``end <= len(block_hashes) * block_size``.

    Returns:
        int64 ``[end - start]`` block tokens (in ``[2**62, 2**63)``).

    Raises:
        ValueError: the range is empty-inverted or runs past the last block.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, not {block_size}")
    if not 0 <= start <= end <= len(block_hashes) * block_size:
        raise ValueError(
            f"positions [{start}, {end}) outside the {len(block_hashes)} blocks of {block_size} tokens"
        )
    first, last = start // block_size, -(-end // block_size)
    base = (splitmix64(np.asarray(block_hashes[first:last], np.uint64)) & _LOW_62) | BLOCK_TOKEN_BIT
    tokens = (base[:, None] ^ _offset_table(block_size)[None, :]).reshape(-1)
    lo = start - first * block_size
    return tokens[lo : lo + (end - start)].view(np.int64)


def unique_token_ids(rid: int, start: int, end: int) -> np.ndarray:
    """Tokens of positions ``[start, end)`` of request ``rid`` that belong to it alone.

    Returns:
        int64 ``[end - start]``: ``-1 - (rid << 31 | p)``, distinct for every ``(rid, p)``.

    Raises:
        ValueError: ``rid`` or a position outside ``[0, 2**31)``.
    """
    if not 0 <= rid < MAX_RID or not 0 <= start <= end <= MAX_POSITION:
        raise ValueError(f"unique tokens need 0 <= rid, position < 2**31 (rid {rid}, [{start}, {end}))")
    return np.arange(-1 - (rid << 31) - start, -1 - (rid << 31) - end, -1, dtype=np.int64)


class TokenStore:
    """Materialises each live request's token ids on demand.

    Feed every step to ``ingest`` (the first row of a request brings
    ``prompt_len`` and ``block_hashes``; any row may bring explicit ``token_ids``
    for the positions it appends), ask ``ids(rid, end)`` when the radix cache
    needs a request's tokens, and ``drop`` a request when it finishes or aborts
    (a retracted request keeps its content: it comes back with the same tokens).

    Args:
        block_size: tokens per block hash (``TraceMeta.block_size``); None ignores
            block hashes (every prompt position is then unique to its request).
        namespaces: the requests' cache namespaces (``TraceMeta.namespaces``): ``ids``
            of a request in one is tagged with it (``traces.namespaces.in_namespace``).
    """

    # Bytes per request id (prompt length, filled length, logged flag) and per token
    # of live content (an int64 id in a buffer grown by doubling).
    BYTES_PER_RID = 17
    BYTES_PER_TOKEN = 16

    @classmethod
    def bytes_bound(cls, num_tokens: int, num_rids: int) -> int:
        """Most bytes a store holds for ``num_rids`` request ids whose live requests
        hold ``num_tokens`` tokens together (the KV pool's size bounds what they hold)."""
        return num_tokens * cls.BYTES_PER_TOKEN + num_rids * cls.BYTES_PER_RID

    def __init__(self, block_size: int | None, namespaces: NamespaceTable | None = None) -> None:
        self.block_size = block_size
        self.namespaces = namespaces
        self._prompt_len = np.full(1024, -1, np.int64)  # per rid, -1 unknown
        self._filled = np.zeros(1024, np.int64)  # per rid, positions materialised
        self._logged = np.zeros(1024, np.bool_)  # per rid, explicit ids in the log
        self._hashes: dict[int, np.ndarray] = {}
        self._buffers: dict[int, np.ndarray] = {}
        self._explicit: set[int] = set()  # rids whose buffer holds explicit ids (not derivable)
        # The log of explicit ids not yet folded in: (rid, position, id) chunks.
        self._log: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._log_entries = 0

    # -- ingest ----------------------------------------------------------------------

    def _grow(self, max_rid: int) -> None:
        size = self._prompt_len.shape[0]
        if max_rid < size:
            return
        new = max(max_rid + 1, 2 * size)
        self._prompt_len = np.concatenate([self._prompt_len, np.full(new - size, -1, np.int64)])
        self._filled = np.concatenate([self._filled, np.zeros(new - size, np.int64)])
        self._logged = np.concatenate([self._logged, np.zeros(new - size, np.bool_)])

    def ingest(self, batch: StepBatch) -> None:
        """Record the prompts and explicit ids one step brings (vectorised).

        A request's first row (``prompt_len`` given, none known yet) sets its prompt
        and block hashes. Rows with ``token_ids`` give the ids of positions
        ``[seq_len - append_len, ...)``.

        Raises:
            ValueError: a request id outside ``[0, 2**31)``.
        """
        if len(batch) == 0:
            return
        rid = batch.rid
        if rid.min() < 0 or rid.max() >= MAX_RID:
            raise ValueError(f"request ids must lie in [0, 2**31), found {rid.min()}..{rid.max()}")
        self._grow(int(rid.max()))
        # A request's first row: prompt_len given and none known (a later row repeating
        # it, e.g. a re-extend after retract, changes nothing).
        firsts = np.flatnonzero((batch.prompt_len >= 0) & (self._prompt_len[rid] < 0))
        if firsts.size:
            first_rids = rid[firsts]
            self._prompt_len[first_rids] = batch.prompt_len[firsts]
            self._filled[first_rids] = 0
            hashes = batch.block_hashes
            for i, r in zip(firsts.tolist(), first_rids.tolist()):
                self._buffers.pop(r, None)
                self._explicit.discard(r)
                if hashes.valid[i] and self.block_size:
                    # A copy: a view would pin the whole record batch in memory.
                    self._hashes[r] = hashes.values[hashes.offsets[i] : hashes.offsets[i + 1]].copy()
                else:
                    self._hashes.pop(r, None)
        tokens = batch.token_ids
        if tokens.values.shape[0]:
            lengths = tokens.lengths
            row = np.repeat(np.arange(len(batch)), lengths)
            start = batch.seq_len - batch.append_len
            position = start[row] + (np.arange(row.shape[0]) - tokens.offsets[row])
            log_rid = rid[row]
            self._log.append((log_rid, position, tokens.values.astype(np.int64, copy=True)))
            self._logged[log_rid] = True
            self._log_entries += row.shape[0]
            if self._log_entries >= _LOG_FOLD_ENTRIES:
                self._fold_log()

    # -- queries ---------------------------------------------------------------------

    def ids(self, rid: int, end: int) -> np.ndarray:
        """The token ids of positions ``[0, end)`` of request ``rid`` (a read-only view).

        A request whose first row was never ingested reads as all-unique tokens.

        Raises:
            ValueError: ``rid`` or ``end`` outside ``[0, 2**31)``.
        """
        if not 0 <= rid < MAX_RID or not 0 <= end <= MAX_POSITION:
            raise ValueError(f"ids() needs 0 <= rid, end < 2**31 (rid {rid}, end {end})")
        self._grow(rid)
        if self._logged[rid]:
            self._fold_rid(rid)
        buffer = self._materialise(rid, end)
        view = buffer[:end]
        view.flags.writeable = False
        if self.namespaces is not None:
            return in_namespace(view, self.namespaces.name_of(rid))
        return view

    def ids_many(self, rids: Sequence[int] | np.ndarray, ends: Sequence[int] | np.ndarray) -> list[np.ndarray]:
        """``ids(rid, end)`` for each pair (what a batched extend needs)."""
        return [self.ids(int(r), int(e)) for r, e in zip(rids, ends)]

    def prompt_len(self, rid: int) -> int:
        """The prompt length ingested for ``rid``; -1 when unknown."""
        return int(self._prompt_len[rid]) if 0 <= rid < self._prompt_len.shape[0] else -1

    def drop(self, rids: int | Sequence[int] | np.ndarray) -> None:
        """Forget requests (finished or aborted): their memory is released."""
        rid_array = np.atleast_1d(np.asarray(rids, np.int64))
        rid_array = rid_array[(rid_array >= 0) & (rid_array < self._prompt_len.shape[0])]
        if rid_array.size == 0:
            return
        if self._logged[rid_array].any():
            self._discard_log(rid_array)
        self._prompt_len[rid_array] = -1
        self._filled[rid_array] = 0
        for r in rid_array.tolist():
            self._hashes.pop(r, None)
            self._buffers.pop(r, None)
            self._explicit.discard(r)

    @property
    def num_live(self) -> int:
        """Requests holding any state (prompt, buffer or logged ids)."""
        return len(set(self._buffers) | set(self._hashes) | set(np.flatnonzero(self._prompt_len >= 0).tolist()))

    @property
    def nbytes(self) -> int:
        """Bytes held by buffers, hashes and the log."""
        total = sum(b.nbytes for b in self._buffers.values()) + sum(h.nbytes for h in self._hashes.values())
        return total + sum(r.nbytes + p.nbytes + v.nbytes for r, p, v in self._log)

    def __deepcopy__(self, memo: dict) -> TokenStore:
        """A copy without the buffers that ``block_hashes`` and request ids derive
        (they are materialised again when asked for): a checkpoint keeps only what
        cannot be derived (prompts, hashes, explicit ids)."""
        clone = TokenStore.__new__(TokenStore)
        clone.block_size = self.block_size
        clone.namespaces = self.namespaces
        clone._prompt_len = self._prompt_len.copy()
        clone._filled = self._filled.copy()
        clone._logged = self._logged.copy()
        clone._hashes = dict(self._hashes)  # the hash arrays are never written
        clone._buffers = {r: b.copy() for r, b in self._buffers.items() if r in self._explicit}
        for r in self._buffers.keys() - self._explicit:
            clone._filled[r] = 0
        clone._explicit = set(self._explicit)
        clone._log = [tuple(a.copy() for a in part) for part in self._log]  # type: ignore[misc]
        clone._log_entries = self._log_entries
        return clone

    # -- internals -------------------------------------------------------------------

    def _materialise(self, rid: int, end: int) -> np.ndarray:
        """The buffer of ``rid`` with positions ``[0, max(end, ...))`` filled."""
        buffer = self._buffers.get(rid)
        filled = int(self._filled[rid])
        if buffer is not None and filled >= end:
            return buffer
        prompt = int(self._prompt_len[rid])
        # The whole prompt at once: chunked prefill asks for it chunk by chunk.
        target = max(end, prompt if filled < prompt else 0)
        capacity = 0 if buffer is None else buffer.shape[0]
        if target > capacity:
            grown = np.empty(max(target, 2 * capacity, 64), np.int64)
            if filled:
                grown[:filled] = buffer[:filled]  # type: ignore[index]
            buffer = grown
            self._buffers[rid] = buffer
        assert buffer is not None
        self._fill_defaults(rid, buffer, filled, target, prompt)
        self._filled[rid] = target
        return buffer

    def _fill_defaults(self, rid: int, buffer: np.ndarray, start: int, end: int, prompt: int) -> None:
        hashes = self._hashes.get(rid)
        block_end = start
        if hashes is not None and self.block_size and start < prompt:
            block_end = min(end, prompt, hashes.shape[0] * self.block_size)
            if block_end > start:
                buffer[start:block_end] = block_token_ids(hashes, self.block_size, start, block_end)
            block_end = max(block_end, start)
        if end > block_end:
            buffer[block_end:end] = unique_token_ids(rid, block_end, end)

    def _write_explicit(self, rid: int, position: np.ndarray, values: np.ndarray) -> None:
        if position.size == 0:
            return
        if position.min() < 0:
            keep = position >= 0
            position, values = position[keep], values[keep]
            if position.size == 0:
                return
        buffer = self._materialise(rid, int(position.max()) + 1)
        buffer[position] = values
        self._explicit.add(rid)

    def _log_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if len(self._log) > 1:
            self._log = [tuple(np.concatenate(parts) for parts in zip(*self._log))]  # type: ignore[list-item]
        return self._log[0]

    def _fold_rid(self, rid: int) -> None:
        """Write the logged explicit ids of one request into its buffer."""
        log_rid, position, values = self._log_arrays()
        mine = log_rid == rid
        self._write_explicit(rid, position[mine], values[mine])
        keep = ~mine
        self._log = [(log_rid[keep], position[keep], values[keep])]
        self._log_entries = int(keep.sum())
        self._logged[rid] = False

    def _fold_log(self) -> None:
        """Write every logged explicit id into its request's buffer (one sort, then per request)."""
        if not self._log:
            return
        log_rid, position, values = self._log_arrays()
        order = np.argsort(log_rid, kind="stable")  # stable: a later write of a position wins
        log_rid, position, values = log_rid[order], position[order], values[order]
        bounds = np.flatnonzero(np.diff(log_rid)) + 1
        starts = np.concatenate(([0], bounds)).tolist()
        stops = np.concatenate((bounds, [log_rid.shape[0]])).tolist()
        for a, b in zip(starts, stops):
            self._write_explicit(int(log_rid[a]), position[a:b], values[a:b])
        self._logged[log_rid] = False
        self._log = []
        self._log_entries = 0

    def _discard_log(self, rids: np.ndarray) -> None:
        log_rid, position, values = self._log_arrays()
        keep = ~np.isin(log_rid, rids)
        self._log = [(log_rid[keep], position[keep], values[keep])]
        self._log_entries = int(keep.sum())
        self._logged[rids] = False
