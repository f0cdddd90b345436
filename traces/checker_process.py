"""The op checker run ahead of a replay in a child process (``BackgroundChecker``), and
one such process shared by several replays (``start_shared_checker``).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from traces.batches import StepBatch
from traces.checker import OpSequenceChecker, Problem
from traces.errors import TraceError
from traces.lifeline import parent_tie, quiet_start, settle
from traces.schema import DECODE, MAX_RID, SPEC



class BackgroundChecker:
    """``OpSequenceChecker`` run over a trace file by a child process, ahead of the caller.

    The replay engine spends about a quarter of its time checking steps; this moves
    that work onto another core. The child reads the same file with its own
    ``TraceReader`` and checks every step; ``check(batch)`` returns exactly what
    ``OpSequenceChecker.check`` would return for that step, waiting for the child
    only if the caller has caught up with it. Steps must be asked for in file order,
    each once: the child and the caller match steps by their position in the file,
    not by step number (a trace whose step numbers go wrong is checked like any other).

    One checker may serve several replays of the same trace in other processes
    (``start_shared_checker``): each attaches to its end of the checker's pipe with
    ``conn``.

    Args:
        path: the trace file (the caller reads it too).
        stop: the step the caller stops before (the child need not go further).
        rid_bound: the caller's ``TraceReader.rid_bound`` (the child's reader finds the
            same); kept as ``rid_bound`` for callers that size arrays by request id.
        conn: the reading end of a pipe a shared checker writes to (no process is
            started then; ``close`` closes the pipe only).
        nice: how much to lower the child's priority (``os.nice``): a caller that shares
            the machine with a dashboard lets the dashboard and the replay go first, the
            child filling the gaps (it runs ahead; it is waited for only when caught up).

    Raises:
        TraceError (from ``check``): the child stopped early for a reason the caller's
            own reader has not met.
    """

    _REPORT_EVERY = 128  # steps between progress messages from the child

    def __init__(
        self,
        path: str | os.PathLike[str],
        stop: int | None = None,
        rid_bound: int | None = None,
        *,
        conn: Any = None,
        nice: int = 0,
    ) -> None:
        self._proc: Any = None
        if conn is None:
            ctx = _mp_context()
            self._conn, child_conn = ctx.Pipe(duplex=False)
            self._proc = ctx.Process(
                target=_check_in_child, args=(str(path), [child_conn], stop, nice, parent_tie()), daemon=True
            )
            with quiet_start():
                self._proc.start()
            child_conn.close()
        else:
            self._conn = conn
        self._path = str(path)
        self.rid_bound = MAX_RID if rid_bound is None else min(rid_bound, MAX_RID)
        self._asked = -1  # position (0-based) of the last step asked for
        self._upto = -1  # every step at a position <= this one has been checked by the child
        self._last_step: int | None = None  # the step number at position ``_upto``
        self._problems: dict[int, list[Problem]] = {}  # by position
        self._ended = False
        self._error: str | None = None

    def check(self, batch: StepBatch) -> list[Problem]:
        """The problems of the next step in file order (``batch``, as the caller read it).

        Raises:
            TraceError: the child stopped before this step (naming why).
        """
        self._asked += 1
        position = self._asked
        while self._upto < position and not self._ended:
            self._receive()
        if self._upto < position:
            after = "before the first step" if self._last_step is None else f"after step {self._last_step}"
            reason = self._error or (
                f"it read {self._upto + 1} steps and the replay asked for step {batch.step} beyond them "
                "(did the file change while it was read?)"
            )
            raise TraceError(f"background validation stopped {after}: {reason}", path=self._path)
        return self._problems.pop(position, [])

    def _receive(self) -> None:
        try:
            kind, position, step, payload = self._conn.recv()
        except (EOFError, OSError):
            self._ended = True
            self._error = self._error or "the checker process exited"
            return
        if position > self._upto:
            self._upto, self._last_step = position, step
        if kind == "problems":
            self._problems[position] = [Problem(step, rid, text) for rid, text in payload]
        elif kind == "end":
            self._ended = True
        elif kind == "error":
            self._error = payload
            self._ended = True

    def close(self) -> None:
        """Stop the child (it may still be ahead of the caller)."""
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.terminate()
            self._proc.join(timeout=5)
        self._conn.close()

    def __enter__(self) -> BackgroundChecker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _mp_context() -> Any:
    import multiprocessing as mp

    # fork: the child starts at once, with nothing to import; it touches only
    # numpy and pyarrow (never torch or CUDA). Elsewhere, spawn.
    return mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")


def start_shared_checker(path: str | os.PathLike[str], consumers: int, stop: int | None = None) -> tuple[Any, list[Any]]:
    """One checker process for ``consumers`` replays of the same trace in other processes.

    Returns:
        The process (``terminate`` / ``join`` it when done) and the reading end of one
        pipe per consumer (pass its ``fileno()`` to the consumer, which attaches with
        ``BackgroundChecker(path, stop, conn=multiprocessing.connection.Connection(fd,
        writable=False))``; close the parent's copies once the consumers hold theirs).
        A consumer that goes away early (its pipe breaks) is dropped; the others are
        served to the end.
    """
    ctx = _mp_context()
    pipes = [ctx.Pipe(duplex=False) for _ in range(consumers)]
    proc = ctx.Process(target=_check_in_child, args=(str(path), [w for _, w in pipes], stop, 0, parent_tie()), daemon=True)
    with quiet_start():
        proc.start()
    for _, w in pipes:
        w.close()
    return proc, [r for r, _ in pipes]


def _check_in_child(
    path: str, conns: list[Any], stop: int | None, nice: int = 0, tie: tuple[int, bool] | None = None
) -> None:
    """The checker process: ``tie`` is the parent's ``traces.lifeline.parent_tie()``
    (Ctrl-C is the parent's to report; the child dies with it)."""
    import multiprocessing as mp

    from traces.reader import TraceReader
    from traces.runs import run_lengths

    if tie is not None:
        parent = mp.parent_process()
        settle(tie[0], parent.sentinel if parent is not None else None, tie[1])

    if nice > 0 and hasattr(os, "nice"):
        try:
            os.nice(nice)
        except OSError:  # not allowed here: check at the priority given
            pass

    def send(message: tuple[str, int, int | None, Any]) -> None:
        for conn in list(conns):
            try:
                conn.send(message)
            except (BrokenPipeError, OSError):  # that consumer went away
                conns.remove(conn)
        if not conns:
            raise SystemExit(0)

    position, last = -1, None
    try:
        reader = TraceReader(path)
        checker = OpSequenceChecker(reader.meta, rid_bound=reader.rid_bound)
        since = 0
        for chunk in reader.chunks(stop=stop):
            runs = np.maximum(run_lengths(chunk, DECODE), run_lengths(chunk, SPEC))
            steps = chunk.step_numbers()
            i, k = 0, steps.shape[0]
            while i < k:
                m = int(runs[i])
                if m > 1 and checker.check_run(chunk, i, m):
                    position += m
                    last = int(steps[i + m - 1])
                    i += m
                    since += m
                else:
                    batch = chunk.step_batch(i)
                    problems = checker.check(batch)
                    position += 1
                    last = batch.step
                    i += 1
                    if problems:
                        send(("problems", position, last, [(p.rid, p.problem) for p in problems]))
                        since = 0
                        continue
                    since += 1
                if since >= BackgroundChecker._REPORT_EVERY:
                    send(("upto", position, last, None))
                    since = 0
        send(("end", position, last, None))
    except Exception as exc:  # noqa: BLE001 - reported to the consumers, which decide
        try:
            detail = " ".join(str(exc).split())
            send(("error", position, last, f"{type(exc).__name__}: {detail}"))
        except SystemExit:
            pass
    finally:
        for conn in conns:
            conn.close()
