"""A trace file's identity: the hash of its bytes, which names it in replay caches and state logs
whatever its path."""

from __future__ import annotations

import hashlib
import os

__all__ = ["trace_digest"]


def trace_digest(path: str | os.PathLike[str]) -> str:
    """The hash of a trace file's bytes (BLAKE2b, 20 bytes, hex)."""
    h = hashlib.blake2b(digest_size=20)
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
