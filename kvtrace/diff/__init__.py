"""The diff: two allocator versions (or two state logs) on one trace, compared after every step.

``diff`` is ``kvtrace diff`` (the first divergence, or up to N, and why); ``sides`` are
what produces each side's per-step records (in this process or a child process);
``walk`` compares two sides' records step by step; ``compare`` is the step comparator (also used by the SGLang differential tests);
``rangediff`` replays a series of commits (``series``) against a base, caching replays
(``replaycache``), for ``kvtrace diff --range``. Importing this package imports none
of them.
"""
