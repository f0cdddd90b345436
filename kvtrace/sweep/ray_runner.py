"""Run sweep cells on a Ray cluster (``kvtrace sweep --ray ADDRESS|auto``).

Ray is the engine: each input file is put into the object store once, each cell
is one Ray task (one CPU) that Ray schedules on any node and retries when its
worker dies (``max_retries``); rows are gathered here as tasks finish, so the
sweep's output is the same Parquet file as a local run's. Every node needs kvtrace
installed (``pip install 'kvtrace[ray]'``); the inputs travel with the tasks.

A ``HOST:PORT`` is checked with a plain TCP connect first (``check_reachable``):
``ray.init`` would wait minutes on an address where nothing answers, printing its
own connection logs. Ray's log messages below errors and its Python warnings are
kept off the terminal (``_quiet_ray``): the sweep reports in its own lines.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvtrace.errors import ConfigError
from kvtrace.sweep.grid import Cell

__all__ = ["CONNECT_TIMEOUT_S", "TASK_RETRIES", "check_reachable", "require_ray", "run_ray"]

TASK_RETRIES = 3  # a cell whose worker process dies (out of memory, a node lost) runs again
CONNECT_TIMEOUT_S = 3.0  # a cluster's head answers a TCP connect at once; more is nothing there


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


def _host_port(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (or ``ray://HOST:PORT``, ``[V6]:PORT``) as (host, port).

    Raises:
        ConfigError: not such an address.
    """
    host, _, port = address.removeprefix("ray://").rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--ray {address}: give HOST:PORT (the head node's GCS port, e.g. 10.0.0.5:6379), auto or local")
    return host, int(port)


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Refuse a ``HOST:PORT`` where nothing accepts a TCP connection within ``timeout_s``
    (``auto`` and ``local`` are not addresses: nothing to check).

    Raises:
        ConfigError: a malformed address, or nothing answers there (one line).
    """
    if address in ("auto", "local"):
        return
    host, port = _host_port(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        why = f"no answer within {timeout_s:g} s" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc)).lower()
        raise ConfigError(
            f"--ray {address}: no Ray cluster answers there ({why}); start one with 'ray start --head --port {port}' "
            "or give --ray auto (the cluster of this machine) or local"
        ) from None


@contextmanager
def _quiet_ray() -> Iterator[None]:
    """Ray's Python log messages below errors and its Python warnings off the terminal."""
    ray_logger = logging.getLogger("ray")
    level = ray_logger.level
    ray_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=r"ray(\.|$)")
            yield
    finally:
        ray_logger.setLevel(level)


@contextmanager
def _stderr_aside() -> Iterator[None]:
    """File descriptor 2 into a discarded temporary file for the block: Ray's C++ core
    logs its connection attempts there, past Python's logging."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as aside:
            os.dup2(aside.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)


def run_ray(cells: Sequence[Cell], address: str, on_row: Callable[[dict[str, Any]], None]) -> None:
    """Run ``cells`` as Ray tasks on the cluster at ``address`` (``auto``: the one this
    machine belongs to; ``local``: start one here), calling ``on_row`` with each row
    as its task finishes.

    Raises:
        ConfigError: Ray is not installed, or no cluster answers at ``address``.
    """
    ray = require_ray()
    check_reachable(address)
    with _quiet_ray():
        _run_ray(ray, cells, address, on_row)


def _run_ray(ray: Any, cells: Sequence[Cell], address: str, on_row: Callable[[dict[str, Any]], None]) -> None:
    started = not ray.is_initialized()
    if started:
        try:
            with _stderr_aside():
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
