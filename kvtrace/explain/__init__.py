"""Why each admission's prefix missed, who evicted it, and how far the cache is from the best.

``kvtrace explain`` and ``kvtrace replay --explain``. This package owns:

- ``attribution``: watching one replay session (its radix cache's ``TreeListener`` and the
  allocator calls the engine makes) and splitting every admission's missed prefix tokens
  into causes (cold, page-size floor, in flight, evicted, out of the SWA window,
  recomputed after a retraction) that sum exactly to the missed tokens;
- ``oracle``: the same admissions under an infinite cache, LRU and Belady's optimal
  eviction in a page model of the cache with the same pool;
- ``distributions``: age at hit, age at eviction, reuse count and reuse distance, as
  histograms;
- ``report``: the report of one run, its JSON and its text rendering.

The command only parses options and renders (``kvtrace.cli.explain``).
"""

from __future__ import annotations

__all__ = ["CAUSES", "Attribution", "ExplainReport", "Explainer", "build_report"]

from kvtrace.explain.attribution import CAUSES, Attribution
from kvtrace.explain.report import ExplainReport, Explainer, build_report
