"""``kvtrace shrink``: reduce a failing trace to the smallest one that fails the same
way, and hand it back as a regression test.

``shrink_trace(trace, Oracle(Target.parse("violation"), allocator=...))`` finds the
failure (an invariant violation, an out-of-memory, a divergence of two versions),
then delta-debugs the trace (requests, steps, rows, lengths, the pool), judging
candidates in parallel; ``emit_test`` writes a pytest test that replays the result.

Modules: ``signature`` (what is kept), ``table`` (the trace in memory and the
candidates cut from it), ``oracle`` (replaying and judging), ``runner`` (candidates
on every core), ``search`` (the phases), ``shrinker`` (the whole), ``emit`` (the test).
"""

from __future__ import annotations

from kvtrace.shrink.emit import emit_test
from kvtrace.shrink.oracle import Failure, Oracle, Outcome
from kvtrace.shrink.shrinker import Progress, ShrinkResult, shrink_trace
from kvtrace.shrink.signature import Signature, Target

__all__ = [
    "Failure",
    "Oracle",
    "Outcome",
    "Progress",
    "ShrinkResult",
    "Signature",
    "Target",
    "emit_test",
    "shrink_trace",
]
