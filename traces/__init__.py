"""The kvtrace trace format and its tools (imports pyarrow and numpy only).

Modules:
    schema    THE format: columns, ops, ``TraceMeta``, ``StepBatch``, ``Ragged``.
    io        ``TraceWriter`` / ``TraceReader``: Arrow IPC (a stream while recorded, a file
              once compacted).
    ipc       ``IpcReader``: any kvtrace Arrow file (trace, state log), stream or file, damage told apart.
    atomic    ``replacing``: write beside the destination, rename into place.
    tokens    ``TokenStore``: token content materialised on demand.
    validate  ``OpSequenceChecker``: incremental, vectorised op-sequence checks.
    synth     seeded synthetic traces (``generate``, ``generate_mooncake_shaped``).
    samples   bundled sample traces (``sample_path``, ``list_samples``).
    errors    ``TraceError`` and its subclasses.
"""
