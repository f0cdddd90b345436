"""The replay: one trace through one allocator version, step by step.

``session`` is the replay session (``ReplaySession``), the library entry of every
consumer; ``engine`` turns one trace step into batched allocator calls and one
``StepSnapshot`` (``snapshot``); ``result`` is what a replay found and counted;
``state`` folds snapshots into the per-request table;
``config`` decides the allocator configuration a trace is replayed with; ``report`` is
the summary of a replay (its JSON object and its human rendering). Importing this
package imports none of them (start-up time: the CLI's ``--help`` loads no torch).
"""
