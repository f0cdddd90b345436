"""One request of a request-level workload, whatever it was read from.

The readers of public workload files (``traces.workloads``) and of a trace taken as a
workload (``traces.trace_workload``) both yield it; it lives beneath both so that
neither imports the other for it (``workloads`` reads a trace through
``trace_workload``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["WorkloadRequest"]


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One request of a workload.

    Attributes:
        arrival_s: arrival time, seconds since the workload's first request.
        input_len: prompt tokens (>= 1).
        output_len: generated tokens (>= 0).
        block_hashes: content-addressed prompt blocks (uint64,
            ``ceil(input_len / block_size)`` of them), or None when the source has
            no prefix information (unrelated prompts).
        block_size: tokens per block of ``block_hashes`` (None without them).
        line: line of the source file the request came from (1-based).
        namespace: its cache namespace (a LoRA adapter, ``cache_salt`` or
            ``extra_key``: ``traces.namespaces``), or None.
        session_id: the conversation (streaming session) it is a turn of, as the
            workload names it or as ``kvtrace.record.sessions`` infers it; None: none.
    """

    arrival_s: float
    input_len: int
    output_len: int
    block_hashes: np.ndarray | None = None
    block_size: int | None = None
    line: int = 0
    namespace: str | None = None
    session_id: str | None = None
