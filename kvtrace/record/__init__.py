"""Recording traces: the recorder an engine calls, and the scheduler model that records workloads.

``recorder`` is the recorder API (``Recorder``: one call per scheduler step of a live
engine); ``scheduler`` models SGLang's continuous-batching scheduler on a real allocator;
``simulate`` runs a workload through it (``kvtrace record``, simulated sweep cells);
``serving`` is the serving configuration it runs with, ``step_time`` the modelled
clock and ``summary`` what a recording reports. ``from kvtrace.record import Recorder`` stays the engines' import; the name is
loaded on first use, so importing a submodule does not import the recorder.
"""

from typing import Any

__all__ = ["Recorder", "RecorderStats"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvtrace.record import recorder

        return getattr(recorder, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
