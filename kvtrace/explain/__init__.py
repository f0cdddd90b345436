"""Why each admission's prefix missed, who evicted it, and how far the cache is from the best.

``kvtrace explain`` and ``kvtrace replay --explain``. ``attribution`` watches one replay
session (its radix cache's ``TreeListener`` and, as a ``ReplayObserver``, the engine's allocator calls) and
splits every admission's missed prefix tokens into causes (cold, page-size floor,
uncached, evicted, out of the SWA window, recomputed after a retraction) that sum exactly
to the missed tokens; ``oracle`` replays the same admissions under an infinite cache, LRU
and Belady's optimal eviction in a page model of the cache with the same pool;
``distributions`` holds the histograms (age at hit, age at eviction, reuse count, reuse
distance); ``shadow`` is every page ever computed; ``report`` wires them into a session (``Explainer``) and builds the report,
its JSON and its text. Importing this package imports none of them (start-up time).
"""
