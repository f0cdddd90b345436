"""What marks an Arrow IPC file as a kvtrace state log, importable without numpy or the allocator.

``kvtrace info`` decides from a file's schema metadata whether it holds a trace or a
state log before it imports what either needs (start-up time).
"""

from __future__ import annotations

from typing import Any

STATE_LOG_VERSION = 2
STATE_LOG_METADATA_KEY = b"kvtrace.statelog"


def is_state_log_schema(schema: Any) -> bool:
    """Whether an Arrow schema (``pyarrow.Schema``) carries the state-log metadata key."""
    return STATE_LOG_METADATA_KEY in (schema.metadata or {})
