"""The serving configuration a simulation runs with: defaults, a trace's own, the user's.

Defaults model SGLang 0.5.23 serving Llama-3.1-8B (bf16) on one NVIDIA H200 (the
arithmetic is in ``kvtrace/cli/record.py``). A trace given as the workload, or as
``--like``, gives the configuration it was recorded with
(``kvtrace.record.simulate.trace_defaults``) for what the user does not override.
Constants only at import time: the command line imports this.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_CHUNK",
    "DEFAULT_CONTEXT_LEN",
    "DEFAULT_MAX_PREFILL_TOKENS",
    "DEFAULT_MAX_RUNNING",
    "DEFAULT_POOL_TOKENS",
    "MODEL_NAMES",
    "SERVING_DEFAULTS",
    "serving_settings",
]

DEFAULT_POOL_TOKENS = 920_000
DEFAULT_MAX_RUNNING = 256
DEFAULT_CONTEXT_LEN = 131_072
DEFAULT_CHUNK = 8192
DEFAULT_MAX_PREFILL_TOKENS = 16_384
# The names of ``traces.models.MODEL_PRESETS`` (here so that --help imports no pyarrow).
MODEL_NAMES: tuple[str, ...] = (
    "llama-3.1-8b", "gpt-oss-20b", "gpt-oss-120b", "gemma-3-27b", "qwen3-next-80b-a3b", "nemotron-h-8b",
)

# The serving defaults of a workload file (a trace given as the workload keeps its own).
SERVING_DEFAULTS: dict[str, Any] = {
    "pool_tokens": DEFAULT_POOL_TOKENS,
    "page_size": 1,
    "max_running": DEFAULT_MAX_RUNNING,
    "context_len": DEFAULT_CONTEXT_LEN,
    "chunk": DEFAULT_CHUNK,
    "max_prefill_tokens": DEFAULT_MAX_PREFILL_TOKENS,
    "spec": None,
    "spec_acceptance": 0.7,
    "pd_decode": False,
    "seed": 0,
    "policy": "fcfs",
    "step_time": None,
}


def serving_settings(workload: Path, fmt: str, given: dict[str, Any], like: Path | None = None) -> dict[str, Any]:
    """The serving options a simulation runs with (``RecordOptions`` keyword arguments):
    those given (not None), else the ``like`` trace's, else a trace's own (a trace as
    the workload), else ``SERVING_DEFAULTS``. A chunk of 0 means no chunking (None).
    ``spec`` is given only when asked for, so a given None (``--spec off``) turns it off.

    Raises:
        TraceError: a trace that cannot be read.
    """
    settings = dict(SERVING_DEFAULTS)
    for trace in ([workload] if fmt == "trace" else []) + ([like] if like is not None else []):
        from kvtrace.record.simulate import trace_defaults
        from traces.reader import TraceReader

        settings.update(trace_defaults(TraceReader(trace).meta))
    settings.update({key: value for key, value in given.items() if value is not None or key == "spec"})
    if settings["step_time"] is None:
        from kvtrace.record.step_time import StepTimeModel

        settings["step_time"] = StepTimeModel()
    settings["chunk"] = settings["chunk"] or None
    return settings
