"""Export of a replay as a timeline for trace viewers (``kvtrace export``).

``timeline`` turns replay snapshots (a live ``ReplaySession`` or a state log read back)
into a format-free model, streamed: counter tracks per pool, request slices packed into
reusable lanes, instants for events. ``perfetto`` writes it as a Perfetto protobuf trace
(packet by packet) and ``chrome`` as Trace Event Format JSON (chrome://tracing);
``run`` opens the input and drives both. Importing this package imports none of them.
"""
