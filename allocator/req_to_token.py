"""ReqToTokenPool: request rows and the ``req_to_token`` table (SGLang 0.5.23 semantics).

Row 0 is padding (CUDA-graph padded batches write there); rows ``1..size`` are
handed out. ``free_slots`` starts as ``[1, 2, ..., size]``; an allocation of ``n``
rows takes the LAST ``n`` entries (in list order) and a freed row is appended, so
rows are reused last-in-first-out exactly as in SGLang::

    free_slots  [1, 2, 3, 4]   alloc(2) -> [3, 4]   free(3) -> [1, 2, 3]   alloc(1) -> [3]

The table is int32 ``(size + 1, width)`` on the host. With ``device="cuda"`` a
device copy exists as well (``device_req_to_token``); the host copy stays the
reference that every read uses, and the table writer keeps both in step.

With a ``journal`` attached (an incremental checker, ``allocator.check.journal``) the
rows handed out and given back are recorded there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from allocator.check.journal import Journal

__all__ = ["ReqToTokenPool"]


class ReqToTokenPool:
    """Request rows plus the position -> KV slot table.

    Args:
        size: usable rows (SGLang ``max_running_requests`` plus PD pre-allocation rows).
        max_context_len: row width (context length plus SGLang's headroom).
        device: ``"cpu"`` or a CUDA device for the device copy of the table.

    Attributes:
        req_to_token: int32 ``[size + 1, max_context_len]`` host table (CPU tensor).
        req_to_token_np: zero-copy numpy view of ``req_to_token``.
        device_req_to_token: int32 device copy, or None on the CPU.
        free_slots: free rows, handed out from the end.
    """

    def __init__(self, size: int, max_context_len: int, device: str = "cpu") -> None:
        if size < 1:
            raise ValueError(f"ReqToTokenPool: size must be >= 1, found {size}")
        if max_context_len < 1:
            raise ValueError(f"ReqToTokenPool: max_context_len must be >= 1, found {max_context_len}")
        self.size = size
        self.max_context_len = max_context_len
        self.device = device
        # int32 [size + 1, width], CPU; zero pages are mapped lazily by the OS.
        self.req_to_token = torch.zeros((size + 1, max_context_len), dtype=torch.int32)
        self.req_to_token_np: np.ndarray = self.req_to_token.numpy()
        self.device_req_to_token: torch.Tensor | None = None
        if torch.device(device).type != "cpu":
            self.device_req_to_token = torch.zeros((size + 1, max_context_len), dtype=torch.int32, device=device)
        self.free_slots: list[int] = list(range(1, size + 1))
        self.journal: Journal | None = None

    def available_size(self) -> int:
        """Free rows."""
        return len(self.free_slots)

    def alloc(self, need_size: int) -> list[int] | None:
        """Take ``need_size`` rows from the end of ``free_slots`` (None if too few).

        The i-th new request gets ``free_slots[-need_size + i]``, as SGLang's
        ``alloc_rows`` assigns them in batch order.
        """
        if need_size > len(self.free_slots):
            return None
        if need_size == 0:
            return []
        rows = self.free_slots[-need_size:]
        del self.free_slots[-need_size:]
        if self.journal is not None:
            self.journal.rows_taken(rows)
        return rows

    def free(self, row: int) -> None:
        """Give one row back (appended: the next allocation reuses it first)."""
        if self.journal is not None:
            self.journal.rows_freed([row])
        self.free_slots.append(row)

    def free_rows(self, rows: list[int]) -> None:
        """Give rows back in this order."""
        if self.journal is not None:
            self.journal.rows_freed(rows)
        self.free_slots.extend(rows)

    def unalloc(self, rows: list[int]) -> None:
        """Undo the allocation that returned ``rows`` (restores ``free_slots`` exactly)."""
        if self.journal is not None:
            self.journal.rows_freed(rows)
        self.free_slots.extend(rows)

    def clear(self) -> None:
        self.free_slots = list(range(1, self.size + 1))
