"""Child processes: quiet on Ctrl-C, dead with their parent (``traces.lifeline``).

Real processes and real signals: a terminal's Ctrl-C is a SIGINT to the whole
process group, so the tests start kvtrace in a group of its own and signal it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import alive, descendants, wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
HOUR = "sample:mooncake-conversation"  # long enough to be interrupted mid-replay
COMMANDS = {
    "replay": ["replay", HOUR],
    "diff": ["diff", HOUR, "--a", "builtin", "--b", "builtin", "--jobs", "2"],
    "shrink": ["shrink", HOUR, "--until", "oom", "--jobs", "2", "--out"],  # + a path
}
CHILDREN = {"replay": 1, "diff": 3, "shrink": 3}  # the checker; the sides or the pool's workers


def _start(command: str, tmp_path: Path) -> subprocess.Popen[bytes]:
    args = COMMANDS[command] + ([str(tmp_path / "small.kvtrace")] if command == "shrink" else [])
    return subprocess.Popen(
        [sys.executable, "-m", "kvtrace", *args], cwd=ROOT, env=ENV, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )


def _busy_children(proc: subprocess.Popen[bytes], count: int) -> list[int]:
    """The command's child processes once ``count`` of them run (the checker, the sides)."""
    wait_until(lambda: proc.poll() is not None or len(descendants(proc.pid)) >= count, 60, f"{count} children")
    assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
    return descendants(proc.pid)


@pytest.mark.parametrize("attempt", range(3))  # it was intermittent: a few tries
@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.slow
def test_ctrl_c_prints_one_line_and_no_traceback(tmp_path: Path, command: str, attempt: int) -> None:
    proc = _start(command, tmp_path)
    try:
        children = _busy_children(proc, CHILDREN[command])
        time.sleep(0.3 + 0.4 * attempt)  # the checker mid-step
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: the whole group
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = err.decode()
    assert "Traceback" not in text, text
    assert text.strip().splitlines() == ["kvtrace: interrupted"], text
    # README "Exit codes": Ctrl-C is 130; a death by SIGINT itself, seen once in many runs,
    # reads the same to a shell ($? is 128 + 2).
    assert proc.returncode in (130, -signal.SIGINT)
    wait_until(lambda: not any(alive(pid) for pid in children), 10, "the children to be reaped")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_children_die_when_the_parent_is_killed(tmp_path: Path, command: str) -> None:
    proc = _start(command, tmp_path)
    try:
        children = _busy_children(proc, CHILDREN[command])
        proc.kill()  # the parent alone: SIGKILL runs none of its clean-up
        proc.wait()
        wait_until(lambda: not any(alive(pid) for pid in children), 5, f"children {children} to die")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# A parent that starts one child (a multiprocessing fork child, or a subprocess) that
# settles WITHOUT the kernel's parent-death signal, prints its id and sleeps: the pipe
# watch alone must end it.
_PARENT = textwrap.dedent(
    """
    import multiprocessing as mp, os, subprocess, sys, time
    from traces import lifeline

    def child(pid):
        lifeline.settle(pid, mp.parent_process().sentinel, False)
        time.sleep(600)

    if __name__ == "__main__":
        if sys.argv[1] == "fork":
            with lifeline.quiet_start():
                p = mp.get_context("fork").Process(target=child, args=(os.getpid(),))
                p.start()
            pid = p.pid
        else:
            env = {**os.environ, lifeline.ENV: f"{os.getpid()}:{lifeline.lifeline_fd()}:0"}
            code = "from traces import lifeline; import time; lifeline.settle_from_env(); time.sleep(600)"
            pid = subprocess.Popen([sys.executable, "-c", code], env=env, pass_fds=(lifeline.lifeline_fd(),)).pid
        print(pid, flush=True)
        time.sleep(600)
    """
)


@pytest.mark.parametrize("how", ["fork", "subprocess"])
def test_the_pipe_watch_ends_a_child_without_the_death_signal(tmp_path: Path, how: str) -> None:
    script = tmp_path / "parent.py"
    script.write_text(_PARENT)
    proc = subprocess.Popen([sys.executable, str(script), how], env=ENV, stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        time.sleep(0.5)  # settled
        assert alive(child)
        proc.kill()
        proc.wait()
        wait_until(lambda: not alive(child), 5, f"child {child} to die")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
