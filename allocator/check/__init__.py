"""What kvtrace checks and keeps of the built-in allocator, apart from its SGLang-mirroring core.

``invariants`` walks the whole state (``check_integrity``); ``incremental`` (with
``incremental_pages`` and ``incremental_tree``) checks only what the calls since the last
check changed, from the ``journal`` the core's primitives keep; ``digest`` hashes the
physical state per step (``kvtrace diff --exact``); ``checkpoint`` saves and restores the
whole state (seeking). Importing this package imports none of them.
"""
