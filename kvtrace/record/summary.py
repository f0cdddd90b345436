"""What a recording reports: its live counters (``RecordProgress``) and its summary
(``RecordSummary``), which the scheduler model (``kvtrace.record.scheduler``) counts
as it goes and ``kvtrace.record.simulate`` turns into the ``record --json`` report.
"""

from __future__ import annotations

from typing import NamedTuple

from kvtrace.record.step_time import Percentiles

__all__ = ["COUNTED", "RecordProgress", "RecordSummary"]


class RecordProgress(NamedTuple):
    """Live counters, handed to the progress callback."""

    steps: int
    arrived: int
    waiting: int
    running: int
    finished: int
    sim_time_s: float
    total: int | None  # requests in the workload, when known


class RecordSummary(NamedTuple):
    """What a recording did.

    ``prefix_hit_rate`` = prompt tokens reused from the radix cache at each request's
    first admission / prompt tokens of those requests. Latencies are on the
    step-time model's clock, over the requests that got a first token; in PD decode
    the first token is the step that pre-allocates the request's KV.

    Every step is of one kind: ``steps == prefill_steps + decode_steps +
    release_steps + retract_steps``. A prefill step extends (in PD decode: pre-allocates);
    a decode step decodes the running batch (``spec_steps`` of them speculatively); a
    release step only frees requests that finished in the step before; a retract step
    retracted every running request and ran nothing.
    """

    steps: int
    requests: int
    finished: int
    rejected: int
    aborted: int
    retractions: int
    retracted_requests: int
    evicted_tokens: int
    prefix_hit_tokens: int
    prompt_tokens: int
    prefix_hit_rate: float
    duration_s: float
    prefill_steps: int
    decode_steps: int
    release_steps: int
    retract_steps: int
    peak_running: int
    peak_waiting: int
    extend_retries: int
    spec_accepted_tokens: int
    spec_steps: int
    spec_ops: int
    row_overflows: int
    peak_used_tokens: int  # KV neither free nor evictable, the most after any step
    peak_step: int
    queue_delay_s: Percentiles  # arrival -> first scheduled (first extend or prealloc step starts)
    ttft_s: Percentiles  # arrival -> first token (the step completing its first prefill ends)


# The summary fields the scheduler counts as it goes (the rest are derived).
_DERIVED = ("steps", "requests", "prefix_hit_rate", "duration_s", "queue_delay_s", "ttft_s")
COUNTED = tuple(f for f in RecordSummary._fields if f not in _DERIVED)
