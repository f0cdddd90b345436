"""Plain helpers shared by the tests (fixtures stay in the ``conftest.py`` files).

Test modules import these from here, never from a ``conftest.py``: pytest imports conftest files
itself, and a second import of one by name gives a second copy of its module.
The dashboard helpers import Textual only when called, so trace tests stay light.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from traces.batches import StepBatch
from traces.metadata import TraceConfig, TraceMeta
from traces.writer import TraceWriter

if TYPE_CHECKING:
    from kvtrace.tui.app import KvtraceApp
    from kvtrace.tui.driver import Frame


# Other processes (Linux: ``/proc``).

def priority_once_set(pid: int, wanted: int, timeout_s: float = 30.0) -> int:
    """Process ``pid``'s priority once it is ``wanted`` (a child lowers its own soon after
    it starts), or as it is after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while os.getpriority(os.PRIO_PROCESS, pid) != wanted and time.monotonic() < deadline:
        time.sleep(0.01)
    return os.getpriority(os.PRIO_PROCESS, pid)


def descendants(pid: int) -> list[int]:
    """The living descendants of ``pid`` (from ``/proc``: Linux)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # gone meanwhile
                continue
            if fields[0] != "Z":
                parents.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(condition: object, timeout_s: float, what: str) -> None:
    """Poll ``condition()`` until true; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# Traces: small valid metadata and deterministic steps.

def make_meta(**config: object) -> TraceMeta:
    """A small valid metadata; keyword arguments override ``TraceConfig`` fields."""
    fields: dict[str, object] = dict(page_size=16, pool_tokens=4096, max_running=8, max_context_len=4096)
    block_size = config.pop("block_size", 32)
    fields.update(config)
    return TraceMeta(config=TraceConfig(**fields), block_size=block_size)  # type: ignore[arg-type]


def decode_steps(num_steps: int, rows: int = 6, first_step: int = 0) -> list[StepBatch]:
    """Deterministic steps: request ``i`` decodes to ``100 * step + i`` (content checkable)."""
    out = []
    for s in range(first_step, first_step + num_steps):
        rid = np.arange(rows, dtype=np.int64)
        out.append(
            StepBatch.from_columns(
                s,
                0.25 * s,
                op=np.full(rows, 1, np.int8),
                rid=rid,
                seq_len=100 * s + rid,
                append_len=np.ones(rows, np.int32),
                token_ids=[np.array([1000 * s + i]) if i % 3 == 0 else None for i in range(rows)],
            )
        )
    return out


def write_steps(path: Path, steps: list[StepBatch], **kwargs: object) -> Path:
    with TraceWriter(path, kwargs.pop("meta", None) or make_meta(), **kwargs) as writer:  # type: ignore[arg-type]
        for batch in steps:
            writer.write(batch)
    return path


# The dashboard: apps over the tiny sample, paused, and waiting until the replay thread has shown a step.

TINY = "sample:tiny"
SIZE = (160, 48)


def live_app(trace: str = TINY, *, play: bool = False, fixed_clock: bool = False, **session_kw: object) -> KvtraceApp:
    """A dashboard over a live session of ``trace``, replayed in a thread (screened inline:
    no child process; ``test_process.py`` runs the replay in its own process)."""
    from kvtrace.replay.session import ReplaySession
    from kvtrace.tui.app import KvtraceApp
    from kvtrace.tui.remote.link import ThreadReplay
    from kvtrace.tui.remote.sources import LiveSource

    session_kw.setdefault("checkpoint_every", 20)
    session = ReplaySession(trace, track_state=True, checker="inline", allocator_in_step=True, **session_kw)  # type: ignore[arg-type]
    link = ThreadReplay(LiveSource(session), play=play)
    if fixed_clock:
        return KvtraceApp(link, clock=lambda: 0.0)
    return KvtraceApp(link)


async def settle(pilot, until: Callable[[KvtraceApp], bool], timeout_s: float = 20.0) -> None:  # noqa: ANN001
    """Let the replay thread work until ``until(app)`` holds (fails after ``timeout_s``)."""
    app = pilot.app
    t0 = time.monotonic()
    while not (app.frame is not None and until(app)):
        if time.monotonic() - t0 > timeout_s:
            step = app.frame.step if app.frame is not None else None
            raise AssertionError(f"the dashboard did not settle in {timeout_s} s (frame step {step})")
        await pilot.pause(0.02)
    await pilot.pause()


async def play_to_end(pilot) -> Frame:  # noqa: ANN001
    """Once the dashboard shows its first frame (paused), play (space) to the last step;
    the frame shown there."""
    await settle(pilot, lambda a: not a.frame.playing)
    await pilot.press("space")
    await settle(pilot, lambda a: a.frame.done)
    return pilot.app.frame


def at_step(step: int) -> Callable[[KvtraceApp], bool]:
    return lambda app: app.frame.step == step and not app.frame.playing


def log_app(path: Path, **kw: object) -> KvtraceApp:
    from kvtrace.statelog.session import StateLogSession
    from kvtrace.tui.app import KvtraceApp
    from kvtrace.tui.remote.link import ThreadReplay
    from kvtrace.tui.remote.sources import LogSource

    return KvtraceApp(ThreadReplay(LogSource(StateLogSession(path), label=path.name), play=False), **kw)  # type: ignore[arg-type]


def text_of(widget: object) -> str:
    """The plain text a Static shows (strings, Rich Text or tables)."""
    import io

    from rich.console import Console

    console = Console(width=300, file=io.StringIO(), color_system=None)
    with console.capture() as cap:
        console.print(getattr(widget, "content"))
    return cap.get()


def run_with_terminal_stderr(args: list[str], timeout_s: float = 120.0) -> tuple[int, str, str]:
    """Run ``args`` with stderr on a pseudo-terminal (as in an interactive shell) and
    stdout on a pipe (as under ``| jq``).

    Returns:
        The exit code, stdout, and everything the process wrote to the terminal.
    """
    import pty
    import select
    import subprocess

    master, slave = pty.openpty()
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "120"}
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    drawn = bytearray()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the process closed its end
                break
            if not data:
                break
            drawn += data
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return proc.returncode, out.decode(), drawn.decode(errors="replace")


def with_meta(source: Path, out: Path, edit: Callable[[dict[str, object]], None]) -> Path:
    """A copy of the trace ``source`` at ``out`` (an IPC stream) whose metadata JSON
    ``edit`` changed in place; the rows are copied unchanged."""
    import json

    import pyarrow as pa

    from traces.schema import METADATA_KEY

    with pa.OSFile(str(source)) as sink:
        is_file = sink.read(6) == b"ARROW1"
        sink.seek(0)
        reader = pa.ipc.open_file(sink) if is_file else pa.ipc.open_stream(sink)
        schema, table = reader.schema, reader.read_all()
    data = json.loads(schema.metadata[METADATA_KEY])
    edit(data)
    metadata = {METADATA_KEY: json.dumps(data).encode()}
    with pa.OSFile(str(out), "wb") as sink, pa.ipc.new_stream(sink, schema.with_metadata(metadata)) as writer:
        writer.write_table(table.replace_schema_metadata(metadata))
    return out
