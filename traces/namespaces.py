"""Cache namespaces: the table of a trace's request namespaces and the token-id arrays
that carry one.

A namespace is what SGLang folds into a request's radix key beside its tokens (its
``extra_key``: a LoRA adapter's id, a ``cache_salt``, a caller's extra key): two requests
with the same tokens in different namespaces never share KV. A trace stores them as a
table in its metadata (``TraceMeta.namespaces``, format version 4): the interned names
and, per request id, the index of its name (-1: no namespace).

The radix cache reads a request's namespace off its token ids: ``in_namespace`` tags an
int64 array (a ``NamespacedIds`` view, which every slice keeps), ``key_prefix`` gives the
bytes the tree puts before a child's first page. An untagged array is in no namespace.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from traces.schema import MAX_RID

__all__ = ["MAX_NAMESPACES", "MAX_NAMESPACE_LEN", "NamespaceTable", "NamespacedIds", "in_namespace",
           "key_prefix", "namespace_of"]

MAX_NAMESPACES = 1 << 16  # distinct names per trace
MAX_NAMESPACE_LEN = 1024  # UTF-8 bytes per name


class NamespacedIds(np.ndarray):
    """Token ids (or key units) of a request in a cache namespace; slices keep it."""

    namespace: str | None

    def __array_finalize__(self, obj: Any) -> None:
        self.namespace = getattr(obj, "namespace", None)


def in_namespace(ids: np.ndarray, namespace: str | None) -> np.ndarray:
    """``ids`` tagged with ``namespace`` (a view); ``ids`` itself for no namespace."""
    if namespace is None:
        return ids
    view = ids.view(NamespacedIds)
    view.namespace = namespace
    return view


def namespace_of(ids: object) -> str | None:
    """The namespace ``ids`` carries (None: none)."""
    return ids.namespace if type(ids) is NamespacedIds else None


def key_prefix(ids: object) -> bytes:
    """What a radix tree puts before the first page of a child of the root in the
    namespace of ``ids``: empty for no namespace (the tree is then keyed as without
    namespaces), else a zero byte, the name's length (4 bytes) and its UTF-8 bytes,
    so two names never give prefixes that one page's bytes could make equal."""
    if type(ids) is not NamespacedIds or ids.namespace is None:
        return b""
    raw = ids.namespace.encode()
    return b"\x00" + len(raw).to_bytes(4, "little") + raw


def sglang_namespace(extra_key: str | None, lora_id: str | None = None, cache_salt: str | None = None) -> str | None:
    """One request's namespace from SGLang's request fields, one string that two
    requests share exactly when SGLang lets them share KV: ``Req`` appends ``lora_id``
    to ``extra_key`` and the radix key holds ``(extra_key, cache_salt)``; empty is none."""
    extra = ((extra_key or "") + lora_id) if lora_id else (extra_key or None)
    if not cache_salt:
        return extra
    return json.dumps([extra, cache_salt])


def check_name(name: object, where: str) -> str:
    """``name`` if it is a valid namespace name.

    Raises:
        ValueError: not a non-empty string of at most ``MAX_NAMESPACE_LEN`` UTF-8 bytes
            (SGLang treats an empty ``extra_key`` or ``cache_salt`` as none).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where} must be a non-empty string, found {name!r:.60}")
    try:
        size = len(name.encode())
    except UnicodeEncodeError:
        raise ValueError(f"{where} is not valid UTF-8: {name!r:.60}") from None
    if size > MAX_NAMESPACE_LEN:
        raise ValueError(f"{where} is {size} bytes long; at most {MAX_NAMESPACE_LEN}")
    return name


@dataclass(frozen=True, slots=True)
class NamespaceTable:
    """The namespaces of a trace's requests (metadata key ``namespaces``).

    Attributes:
        names: the distinct names, each once (the index is what ``of_rid`` holds).
        of_rid: per request id from 0, the index of its namespace in ``names``, or -1
            for none; request ids past its end have none.
    """

    names: tuple[str, ...]
    of_rid: tuple[int, ...]

    @classmethod
    def of(cls, by_rid: dict[int, str] | list[str | None]) -> NamespaceTable | None:
        """The table of ``by_rid`` (rid -> name; None for no namespace), names in order of
        first use; None when no request has one.

        Raises:
            ValueError: a bad name or request id.
        """
        items = by_rid.items() if isinstance(by_rid, dict) else enumerate(by_rid)
        pairs = sorted((rid, name) for rid, name in items if name is not None)
        if not pairs:
            return None
        index: dict[str, int] = {}
        of_rid = [-1] * (pairs[-1][0] + 1)
        for rid, name in pairs:
            if not isinstance(rid, int) or not 0 <= rid < MAX_RID:
                raise ValueError(f"namespace of request {rid!r}: request ids lie in [0, {MAX_RID})")
            of_rid[rid] = index.setdefault(check_name(name, f"namespace of request {rid}"), len(index))
        return cls(tuple(index), tuple(of_rid))

    def name_of(self, rid: int) -> str | None:
        if 0 <= rid < len(self.of_rid) and self.of_rid[rid] >= 0:
            return self.names[self.of_rid[rid]]
        return None

    def indices(self) -> np.ndarray:
        """int32 [len(of_rid)]: ``of_rid`` as numpy."""
        return np.asarray(self.of_rid, np.int32)

    def to_dict(self) -> dict[str, Any]:
        return {"names": list(self.names), "of_rid": list(self.of_rid)}

    @classmethod
    def from_dict(cls, data: Any) -> NamespaceTable:
        """Parse and check the metadata object.

        Raises:
            ValueError: one line naming what is wrong.
        """
        if not isinstance(data, dict) or set(data) != {"names", "of_rid"}:
            raise ValueError("metadata 'namespaces' must be an object with exactly 'names' and 'of_rid'")
        names, of_rid = data["names"], data["of_rid"]
        if not isinstance(names, list) or not 0 < len(names) <= MAX_NAMESPACES:
            raise ValueError(f"metadata 'namespaces.names' must be a list of 1 to {MAX_NAMESPACES} names")
        for i, name in enumerate(names):
            check_name(name, f"metadata 'namespaces.names[{i}]'")
        if len(set(names)) != len(names):
            raise ValueError("metadata 'namespaces.names' lists a name twice")
        if not isinstance(of_rid, list) or len(of_rid) > MAX_RID:
            raise ValueError(f"metadata 'namespaces.of_rid' must be a list of at most {MAX_RID} integers")
        arr = np.asarray(of_rid) if of_rid else np.zeros(0, np.int64)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu") or any(type(v) is bool for v in of_rid):
            raise ValueError("metadata 'namespaces.of_rid' must hold integers only")
        bad = np.flatnonzero((arr < -1) | (arr >= len(names)))
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"metadata 'namespaces.of_rid[{i}]' is {int(arr[i])}; it must lie in [-1, {len(names)})"
            )
        return cls(tuple(names), tuple(int(v) for v in of_rid))
