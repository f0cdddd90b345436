"""Child processes that leave quietly and die with their parent.

Ctrl-C in a terminal sends SIGINT to the whole foreground process group: the
parent and every child at once. The parent says ``kvtrace: interrupted`` and stops
its children; a child must print nothing (no ``KeyboardInterrupt`` traceback) and
must never outlive its parent (a parent killed by SIGKILL runs no clean-up).

Parent side: start a child inside ``quiet_start()``, so that it cannot take a
SIGINT before ``settle`` (a signal sent meanwhile stays pending and reaches the
parent when the block ends). A child run by ``subprocess`` gets ``child_env()`` and
``lifeline_fd()`` in its ``pass_fds``; a ``multiprocessing`` child gets
``parent_tie()`` as an argument.

Child side: ``settle(parent_pid, fd, deathsig)`` (``settle_from_env()`` for a
``subprocess`` child) as its first act: SIGINT is ignored, SIGTERM and SIGHUP take
their default action (a forked child inherits the parent's Python handlers), the
kernel kills the child when its parent dies (Linux ``PR_SET_PDEATHSIG``), and a
thread watching a pipe only the parent holds open exits the child at its EOF (the
portable fallback).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

__all__ = ["ENV", "child_env", "lifeline_fd", "parent_tie", "quiet_start", "settle", "settle_from_env"]

ENV = "KVTRACE_LIFELINE"  # "PARENT_PID:FD:DEATHSIG" for a subprocess child
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

# The process-wide lifeline: the parent keeps the writing end open for its whole
# life (closed only by its death); every subprocess child inherits the reading end.
_pipe: tuple[int, int] | None = None
_pipe_owner = -1  # the process that made ``_pipe`` (a forked child holds a stale copy)
_pipe_lock = threading.Lock()


@contextlib.contextmanager
def quiet_start() -> Iterator[None]:
    """Start children inside this block: they start with SIGINT ignored (in the main
    thread, where a handler can be set: a disposition to ignore survives fork and exec,
    and Python keeps it at start-up) and blocked (a signal mask survives fork), until
    ``settle``. This process holds a SIGINT that comes meanwhile and takes it after."""
    blocking = hasattr(signal, "pthread_sigmask")
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if blocking else None
    old_handler = None
    if threading.current_thread() is threading.main_thread():
        old_handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        # The handler first: a SIGINT held by the mask now reaches it (and is not
        # discarded, as it would be while the disposition is to ignore).
        if old_handler is not None:
            signal.signal(signal.SIGINT, old_handler)
        if old_mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def _deathsig_usable() -> bool:
    # PR_SET_PDEATHSIG fires when the THREAD that made the child ends, not the
    # process: only a child made by the main thread may use it.
    return sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread()


def parent_tie() -> tuple[int, bool]:
    """What a ``multiprocessing`` child passes to ``settle`` (with its parent's sentinel):
    this process's id and whether the child may use the kernel's parent-death signal."""
    return os.getpid(), _deathsig_usable()


def lifeline_fd() -> int:
    """The reading end of this process's lifeline pipe (for a subprocess's ``pass_fds``)."""
    global _pipe, _pipe_owner
    with _pipe_lock:
        if _pipe is None or _pipe_owner != os.getpid():
            _pipe = os.pipe()  # both ends non-inheritable: only pass_fds hands the reading end on
            _pipe_owner = os.getpid()
        return _pipe[0]


def child_env() -> dict[str, str]:
    """The environment entry a subprocess child reads with ``settle_from_env``."""
    fd = lifeline_fd()
    pid, deathsig = parent_tie()
    return {ENV: f"{pid}:{fd}:{int(deathsig)}"}


def settle(parent_pid: int, fd: int | None, deathsig: bool) -> None:
    """Make this (child) process quiet on Ctrl-C and mortal with its parent.

    Args:
        parent_pid: the parent's process id (the child exits at once if it is gone already).
        fd: a descriptor that reaches EOF (or becomes readable) when the parent dies:
            ``multiprocessing.parent_process().sentinel`` or the lifeline pipe; None: none.
        deathsig: ask the kernel for SIGKILL when the parent dies (Linux).
    """
    global _pipe
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for name in ("SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    # A forked child holds a copy of its parent's lifeline pipe: drop it, or the
    # parent's other children would wait for this one to die as well.
    if _pipe is not None and _pipe_owner != os.getpid():
        for end in _pipe:
            if end != fd:
                with contextlib.suppress(OSError):
                    os.close(end)
        _pipe = None
    if deathsig and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the tie was made
        os._exit(0)
    if fd is not None:
        threading.Thread(target=_watch, args=(fd,), name="kvtrace-lifeline", daemon=True).start()


def settle_from_env() -> None:
    """``settle`` for a child started by ``subprocess`` with ``child_env()`` (nothing when
    the variable is not set: the process was started by hand). The variable is removed,
    so this process's own children do not read it."""
    value = os.environ.pop(ENV, None)
    if not value:
        return
    pid, fd, deathsig = value.split(":")
    settle(int(pid), int(fd), deathsig == "1")


def _watch(fd: int) -> None:
    """Thread: wait until the parent's end of ``fd`` closes (nothing is ever written
    there: readable means EOF), then exit at once."""
    import selectors

    try:
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while not selector.select():
                pass
    except (OSError, ValueError):  # the descriptor is not there: nothing to watch
        return
    os._exit(0)
