"""The kvtrace trace format and its tools (imports pyarrow and numpy only).

Modules:
    schema          THE format: columns, ops, bounds, the Arrow schema.
    metadata        ``TraceMeta`` and its parts (config, model, source, ``Recording``).
    batches         ``StepBatch`` (one step's rows, columnar) and ``Ragged`` (a list column).
    encoding        steps as Arrow record batches; their checksums and closing status.
    writer          ``TraceWriter`` (an Arrow IPC stream while recorded) and ``compact_trace``
                    (rewrites it as an Arrow IPC file).
    reader          ``TraceReader``: a trace, stream or file, step by step.
    chunks          ``StepChunk``: runs of whole steps, column-wise, as the reader gathers them.
    ipc             ``IpcReader``: any kvtrace Arrow file (trace, state log), stream or file, damage told apart.
    arrow_arrays    numpy views of Arrow arrays, Arrow arrays from numpy (never importing pandas).
    atomic          ``replacing``: write beside the destination, rename into place.
    tokens          ``TokenStore``: token content materialised on demand.
    checker         ``OpSequenceChecker``: incremental, vectorised op-sequence checks.
    checker_process ``BackgroundChecker``: the checker run ahead of a replay in a child process.
    synth           seeded synthetic traces (``generate``, ``generate_mooncake_shaped``).
    workloads       importers of public request-level workloads (``read_workload``).
    block_reuse     how much of a workload's prompt blocks repeat.
    workload_sources  attribution of the known public workload files.
    samples         bundled sample traces (``sample_path``, ``list_samples``).
    errors          ``TraceError`` and its subclasses.
"""
