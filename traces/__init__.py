"""The kvtrace trace format and its tools (imports pyarrow and numpy only).

Modules:
    schema    THE format: columns, ops, ``TraceMeta``, ``StepBatch``, ``Ragged``.
    io        ``TraceWriter`` / ``TraceReader``: streaming Arrow IPC, truncation-safe.
    tokens    ``TokenStore``: token content materialised on demand.
    validate  ``OpSequenceChecker``: incremental, vectorised op-sequence checks.
    synth     seeded synthetic traces (``generate``, ``generate_mooncake_shaped``).
    samples   bundled sample traces (``sample_path``, ``list_samples``).
    errors    ``TraceError`` and its subclasses.
"""
