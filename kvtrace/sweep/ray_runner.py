"""Run sweep cells on a Ray cluster (``kvtrace sweep --ray ADDRESS|auto``).

Ray is the engine: each input file is put into the object store once, each cell
is one Ray task (one CPU) that Ray schedules on any node and retries when its
worker dies (``max_retries``); rows are gathered here as tasks finish, so the
sweep's output is the same Parquet file as a local run's. Every node needs kvtrace
installed (``pip install 'kvtrace[ray]'``); the inputs travel with the tasks.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvtrace.errors import ConfigError
from kvtrace.sweep.grid import Cell

__all__ = ["TASK_RETRIES", "require_ray", "run_ray"]

TASK_RETRIES = 3  # a cell whose worker process dies (out of memory, a node lost) runs again


def _input_on_worker(cell: Cell, data: bytes, digest: str) -> Cell:
    """The cell with its input written to this node's temporary directory (once per
    node and content; written aside and renamed, so concurrent tasks agree)."""
    from traces.atomic import replacing

    folder = Path(tempfile.gettempdir()) / f"kvtrace-sweep-{digest[:16]}"
    folder.mkdir(exist_ok=True)
    path = folder / Path(cell.input.path).name
    if not path.is_file() or path.stat().st_size != len(data):
        with replacing(path) as tmp:
            tmp.write_bytes(data)
    return replace(cell, input=replace(cell.input, path=str(path)))


def _run_remote(cell: Cell, data: bytes, digest: str) -> dict[str, Any]:
    from kvtrace.sweep.cells import run_cell

    return run_cell(_input_on_worker(cell, data, digest))


def require_ray() -> Any:
    """The ``ray`` module.

    Raises:
        ConfigError: Ray is not installed (one line saying how to install it).
    """
    try:
        import ray
    except ImportError:
        raise ConfigError("--ray needs Ray: pip install 'kvtrace[ray]' (on every node of the cluster)") from None
    return ray


def run_ray(cells: Sequence[Cell], address: str, on_row: Callable[[dict[str, Any]], None]) -> None:
    """Run ``cells`` as Ray tasks on the cluster at ``address`` (``auto``: the one this
    machine belongs to; ``local``: start one here), calling ``on_row`` with each row
    as its task finishes.

    Raises:
        ConfigError: Ray is not installed, or no cluster answers at ``address``.
    """
    ray = require_ray()
    started = not ray.is_initialized()
    if started:
        try:
            ray.init(
                address=None if address == "local" else address,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
            )
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise ConfigError(f"--ray {address}: no Ray cluster answers there ({exc}); start one with 'ray start --head'") from None
    pending: list[Any] = []
    try:
        task = ray.remote(num_cpus=1, max_retries=TASK_RETRIES)(_run_remote)
        inputs: dict[str, tuple[Any, str]] = {}  # path -> (object ref of its bytes, digest)
        for cell in cells:
            if cell.input.path not in inputs:
                data = Path(cell.input.path).read_bytes()
                inputs[cell.input.path] = (ray.put(data), hashlib.sha256(data).hexdigest())
            ref, digest = inputs[cell.input.path]
            pending.append(task.remote(cell, ref, digest))
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for done in ready:
                on_row(ray.get(done))
    except BaseException:
        for ref in pending:
            ray.cancel(ref, force=True)
        raise
    finally:
        if started:
            ray.shutdown()
