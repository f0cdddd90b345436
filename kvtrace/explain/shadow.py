"""The shadow: every prefix ever computed, by the replay's pages, for ``Attribution``.

A radix tree over the replay cache's keys (token ids, or EAGLE bigram units) whose
edges are whole pages of ``page_size`` units, as the replay's own cache. Each page
keeps the id of the eviction that last removed it from the replay's cache (0: none),
run-length coded per node: an eviction removes a whole node of the replay's tree, so
a run of pages shares one id. Unlike a ``RadixCache`` it never evicts, so it keeps no
access times, lock counts, leaf sets or eviction heap: its memory is the distinct
pages computed plus one small node per branch and a few runs per node.

Units are stored 4 bytes each while every unit inserted fits an int32 (token ids do;
EAGLE bigram units and hashed ids do not): the tree widens itself to 8 bytes a unit at
the first insert that does not fit. Callers always pass int64 keys (``units.tobytes()``);
a read whose key holds a unit too wide for a narrow tree matches up to it (nothing
stored holds it).

A sequence's partial last page (``len % page_size`` units) is no edge of the tree: it
is kept apart, by the full pages before it, so that ``seen_len`` still counts the units
of a partial page computed before (the page-size floor).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

import numpy as np

__all__ = ["Shadow"]


_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1


class _Node:
    __slots__ = ("key", "recs", "children")

    def __init__(self, key: bytes, recs: tuple[list[int], list[int]] | None) -> None:
        self.key = key  # units, whole pages, Shadow.unit_bytes each
        # eviction ids by runs: (first page of each run, ascending from 0; its id); None: all 0
        self.recs = recs
        self.children: dict[bytes, _Node] | None = None  # by the first page's bytes

    def set_recs(self, a: int, b: int, rec: int, num_pages: int) -> None:
        """Pages ``[a, b)`` of the node's ``num_pages`` take eviction id ``rec``."""
        if self.recs is None:
            self.recs = ([0], [0])
        starts, ids = self.recs
        i = bisect_left(starts, a)
        j = bisect_right(starts, b)
        after = ids[j - 1]  # the id at page b
        new_starts, new_ids = [a], [rec]
        if b < num_pages and after != rec:
            new_starts.append(b)
            new_ids.append(after)
        starts[i:j] = new_starts
        ids[i:j] = new_ids

    def get_recs(self, a: int, b: int, out: np.ndarray) -> None:
        """Write the eviction ids of pages ``[a, b)`` into ``out``."""
        if self.recs is None:
            return
        starts, ids = self.recs
        k = bisect_right(starts, a) - 1
        while k < len(starts) and starts[k] < b:
            lo = max(starts[k], a)
            hi = min(starts[k + 1] if k + 1 < len(starts) else b, b)
            out[lo - a : hi - a] = ids[k]
            k += 1

    def split_recs(self, m: int) -> tuple[list[int], list[int]] | None:
        """Keep the runs past page ``m`` (renumbered from 0); return those before it."""
        if self.recs is None:
            return None
        starts, ids = self.recs
        k = bisect_right(starts, m) - 1
        upper = (starts[: k + 1] if starts[k] < m else starts[:k], ids[: k + 1] if starts[k] < m else ids[:k])
        self.recs = ([0] + [s - m for s in starts[k + 1 :]], [ids[k]] + ids[k + 1 :])
        return upper if upper[0] else None


class Shadow:
    """Every page computed so far, with the eviction that last removed each one.

    Args:
        page_size: units per page (the replay's cache's page size).
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.unit_bytes = 4  # 8 once a unit inserted does not fit an int32
        self._dtype: type[np.signedinteger] = np.int32
        self._psb = page_size * 4
        self.root = _Node(b"", None)
        self.num_units = 0  # in the tree's pages (the partial tails apart)
        self.num_nodes = 0
        # the full pages before a partial last page (their int64 bytes' hash) -> the partial
        # pages there (int64 bytes: few, and never widened)
        self._tails: dict[int, list[bytes]] = {}

    # ------------------------------------------------------------------ unit width
    def _packed(self, kb: bytes, widen: bool) -> bytes:
        """A key's int64 bytes as the tree stores them: as they are once wide; else as
        int32, after widening the tree (``widen``) or cut before the first unit too wide."""
        if self.unit_bytes == 8:
            return kb
        units = np.frombuffer(kb, np.int64)
        wide = (units > _INT32_MAX) | (units < _INT32_MIN)
        if wide.any():
            if widen:
                self._widen()
                return kb
            units = units[: int(wide.argmax())]
        return units.astype(np.int32).tobytes()

    def _widen(self) -> None:
        """Store 8 bytes a unit from now on: every node's key converted once."""
        psb = self.page_size * 8
        stack = [self.root]
        while stack:
            node = stack.pop()
            node.key = np.frombuffer(node.key, np.int32).astype(np.int64).tobytes()
            if node.children is not None:
                stack.extend(node.children.values())
        stack = [self.root]
        while stack:  # the children are keyed by their first page's bytes
            node = stack.pop()
            if node.children is not None:
                node.children = {c.key[:psb]: c for c in node.children.values()}
                stack.extend(node.children.values())
        self.unit_bytes, self._dtype, self._psb = 8, np.int64, psb

    # ------------------------------------------------------------------ insert
    def insert(self, units: np.ndarray, known: int = 0, raw: bytes | None = None) -> None:
        """Add one sequence's key (int64 units) as computed.

        Args:
            units: the key.
            known: units of its prefix inserted before (the same request's earlier
                chunk): followed without comparing them, so that a long request's
                chunks cost their own length, not the whole prefix again.
            raw: ``units.tobytes()``, where the caller has it.
        """
        ps = self.page_size
        n = units.shape[0]
        full = n // ps * ps
        raw64 = raw if raw is not None else units.tobytes()
        packed = self._packed(raw64[: full * 8], widen=True)
        psb, w = self._psb, self.unit_bytes
        node = self.root
        start = 0  # units followed on trust
        known = min(known, full)
        while start < known and node.children is not None:
            child = node.children.get(packed[start * w : (start + ps) * w])
            if child is None or start + len(child.key) // w > known:
                break
            start += len(child.key) // w
            node = child
        kb = packed[start * w :] if start else packed
        nb = len(kb)
        pos = 0
        while pos < nb:
            first = kb[pos : pos + psb]
            child = node.children.get(first) if node.children is not None else None
            if child is None:
                if node.children is None:
                    node.children = {}
                node.children[first] = _Node(kb[pos:], None)
                self.num_units += (nb - pos) // w
                self.num_nodes += 1
                break
            ck = child.key
            if kb.startswith(ck, pos):
                pos += len(ck)
                node = child
                continue
            m = _matched(ck, kb, pos, w) // ps  # pages
            upper = _Node(ck[: m * psb], child.split_recs(m))
            child.key = ck[m * psb :]
            upper.children = {child.key[:psb]: child}
            node.children[first] = upper  # type: ignore[index]
            self.num_nodes += 1
            node = upper
            pos += m * psb
        if full < n:
            self._add_tail(hash(raw64[: full * 8]), raw64[full * 8 : n * 8])

    def _add_tail(self, at: int, tail: bytes) -> None:
        tails = self._tails.setdefault(at, [])
        for i, t in enumerate(tails):
            if t.startswith(tail):
                return
            if tail.startswith(t):
                tails[i] = tail
                return
        tails.append(tail)

    # ------------------------------------------------------------------ reads
    def seen_len(self, kb: bytes) -> int:
        """Units of the longest prefix of a key (``units.tobytes()``) computed before
        (to the unit: a partial page counts the units it shares with a page or a
        partial page computed there)."""
        ps = self.page_size
        psb, w = self._psb, self.unit_bytes
        pk = self._packed(kb, widen=False)
        nb = len(pk)
        node = self.root
        pos = 0
        branch: _Node | None = None  # where the walk stopped at a page boundary
        while True:
            if pos >= nb or node.children is None:
                branch = node
                break
            child = node.children.get(pk[pos : pos + psb])
            if child is None:
                branch = node
                break
            if pk.startswith(child.key, pos):
                pos += len(child.key)
                node = child
                continue
            pos += _matched(child.key, pk, pos, w) * w  # to the unit
            break
        seen = pos // w
        if ps == 1:
            return seen
        base = seen // ps * ps  # the page boundary at or before the end of the match
        nxt = np.frombuffer(kb, np.int64, count=min(ps, len(kb) // 8 - base), offset=base * 8)
        if nxt.shape[0] == 0:
            return seen
        candidates = [np.frombuffer(t, np.int64) for t in self._tails.get(hash(kb[: base * 8]), ())]
        if branch is not None and branch.children is not None and seen == base:
            candidates.extend(np.frombuffer(c.key[:psb], self._dtype) for c in branch.children.values())
        for page in candidates:
            seen = max(seen, base + _common(page, nxt))
        return seen

    def mark(self, kb: bytes, lo: int, hi: int, rec: int) -> None:
        """Pages ``[lo, hi)`` of a key (``units.tobytes()``) were evicted by eviction ``rec``.

        NOTE: the nodes wholly before page ``lo`` are followed by their first page only
        (an evicted node's path was computed, so it is in the shadow); the pages marked
        are compared whole."""
        kb = self._packed(kb[: hi * self.page_size * 8], widen=False)
        for node, start, m in self._walk(kb, hi * self._psb, lo * self._psb):
            a, b = max(lo, start), min(hi, start + m)
            if a < b:
                node.set_recs(a - start, b - start, rec, len(node.key) // self._psb)

    def recs(self, kb: bytes, lo: int, hi: int) -> np.ndarray:
        """The eviction ids of pages ``[lo, hi)`` of a key (``units.tobytes()``), int32
        (0: never evicted, or not in the shadow)."""
        out = np.zeros(hi - lo, np.int32)
        kb = self._packed(kb[: hi * self.page_size * 8], widen=False)
        for node, start, m in self._walk(kb, hi * self._psb):
            a, b = max(lo, start), min(hi, start + m)
            if a < b and node.recs is not None:
                node.get_recs(a - start, b - start, out[a - lo : b - lo])
        return out

    def _walk(self, kb: bytes, nb: int, trusted: int = 0) -> list[tuple[_Node, int, int]]:
        """(node, first page, pages matched) of each node along ``kb[:nb]`` (whole pages);
        nodes ending within the first ``trusted`` bytes are not compared past their first page."""
        out = []
        psb = self._psb
        ps = self.page_size
        node = self.root
        pos = 0
        nb = min(nb, len(kb))
        while pos < nb and node.children is not None:
            child = node.children.get(kb[pos : pos + psb])
            if child is None:
                break
            if pos + len(child.key) <= trusted or kb.startswith(child.key, pos, nb):
                out.append((child, pos // psb, len(child.key) // psb))
                pos += len(child.key)
                node = child
                continue
            out.append((child, pos // psb, _matched(child.key, kb, pos, self.unit_bytes, nb) // ps))
            break
        return out


def _matched(ckey: bytes, kb: bytes, pos: int, unit_bytes: int, nb: int | None = None) -> int:
    """Units of ``ckey`` matching ``kb[pos:nb]`` (both ``unit_bytes`` a unit)."""
    dtype = np.int32 if unit_bytes == 4 else np.int64
    a = np.frombuffer(ckey, dtype=dtype)
    k = min(a.shape[0], ((len(kb) if nb is None else nb) - pos) // unit_bytes)
    b = np.frombuffer(kb, dtype=dtype, count=k, offset=pos)
    neq = a[:k] != b
    return int(neq.argmax()) if neq.any() else k


def _common(a: np.ndarray, units: np.ndarray) -> int:
    """Units ``a`` and ``units`` share at their start."""
    k = min(a.shape[0], units.shape[0])
    neq = a[:k] != units[:k]
    return int(neq.argmax()) if neq.any() else k
