"""The dashboard's cost: replay wall time with and without it, frames a second, memory.

Usage:
    python bench/tui.py [TRACE] [--repeat N] [--together] [--size WxH] [--profile-ui FILE] [--profile-replay FILE] [--force]
    python bench/tui.py [TRACE] --no-screen [--repeat N]
    python bench/tui.py [TRACE] --interleaved [--repeat N]
    python bench/tui.py [TRACE] --sliced [--repeat N] [--size WxH] [--no-screen]
    python bench/tui.py [TRACE] --components

TRACE defaults to the bundled one-hour Mooncake sample (12,031 requests). Prints, in
one run, for N interleaved pairs (their order alternates: without then with the
dashboard, then with then without; the machine may be shared, so the spread is shown;
``--together`` runs each pair's two replays at the same time instead, so that a host
whose speed drifts from minute to minute slows both alike, given cores for both):
  * the replay wall time without the dashboard (``ReplaySession.run()`` in a process of
    its own, what ``kvtrace replay`` does) and with it (``KvtraceApp`` headless in this
    process, the replay in its own process as ``kvtrace replay --tui`` runs it, with its
    checkpoints and per-request state, playing at full speed from the first step to the
    last), their ratio and the overhead in percent (target: at most 10%), and the CPU
    seconds of the replay process against those of the plain replay;
  * frames a second the screen showed over the replay's wall time (target: at least 20),
    the median time from a frame's arrival to its screen update, and the CPU seconds of
    the screen's process;
  * memory: peak RSS of the screen's process (this one) and of the replay process, the
    screen's per-request state and timeline;
  * the load average before, after each pair and at the end;
  * first, how much this machine's CPUs slow each other: a CPU-bound loop timed on one CPU
    alone and while another CPU spins. Where they share a physical core or a power budget
    (the 2-vCPU machine of bench/RESULTS.md: from -2% to +30% from run to run), every CPU
    second the screen spends slows the replay, however the work is split between processes.

``--no-screen`` instead runs the dashboard's replay process with no screen (its updates
framed and dropped) beside the plain replay, each pair at the same time: what the replay
process adds by itself, apart from sharing the machine with a screen.

``--interleaved`` runs the dashboard's replay process (no screen, updates framed and
dropped) and the plain replay in this one process, alternating half a second of the
first with the same steps of the second, and compares their CPU seconds: on a machine
whose speed drifts from minute to minute (this 2-vCPU VM: a third from run to run), both
see the same drift, so what the replay process adds by itself (its per-request fold, the
updates, checkpoints, page maps) shows through. It cannot show what separate processes
cost (memory, caches): the pairs above do.

``--sliced`` runs the whole dashboard (its replay process and the screen in this process)
and the plain replay in a process of its own at the same time, but lets only one of the two
replays run at a time: half a second of the one (the other stopped, with its checker, by
SIGSTOP), then half a second of the other, both replays pinned to the same CPU and the
screen and the checkers to the others. Both see the same drift of the machine, as in
``--interleaved``, and the dashboard's replay shares the machine with its screen, as in the
pairs: the CPU seconds of the two replay processes measure all the dashboard costs the
replay, its own work in a process of its own and the screen's presence (on the 2-vCPU
machine of bench/RESULTS.md, a screen that draws far less did not cost the replay less),
but not the wall time the replay waits for a CPU (the pairs show it: a few
tenths of a second) nor frames a second (the screen idles while its replay is stopped).
With ``--no-screen``, the replay process alone (``--replay-process-once``) takes turns with the
plain replay the same way: what a process of its own costs it, apart from a screen (the
interleaved bench, one process for both, cannot show that).

``--components`` runs the dashboard's replay process once with no screen, in this process, and
prints the CPU seconds of each of its own extras beyond the plain replay (building the blocks,
folding them, framing them for the pipe, page maps, checkpoints), timed call by call, and their
share of its CPU to the last step: what each costs, apart from the machine's drift (the clocks'
own cost, a microsecond or two a call, is in the figures).

``--profile-ui`` saves a cProfile of the screen's thread while it plays, ``--profile-replay``
one of the replay process (in its CPU seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import dataclasses
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvtrace.errors import USER_ERRORS  # noqa: E402
from kvtrace.versions.registry import resolve_version  # noqa: E402
from kvtrace.replay.engine import ReplayOptions  # noqa: E402
from kvtrace.replay.session import ReplaySession, open_trace  # noqa: E402
from kvtrace.replay.snapshot import SnapshotBlock  # noqa: E402
from kvtrace.replay.state import ReplayState  # noqa: E402
from kvtrace.diff.sides import child_environ  # noqa: E402
from kvtrace.tui.app import KvtraceApp  # noqa: E402
from kvtrace.tui.remote.link import CHILD_ENV, ChildReplay  # noqa: E402
from kvtrace.tui.remote.replayer import Replayer, dashboard_job, job_source  # noqa: E402
from kvtrace.tui.remote.updates import write_update  # noqa: E402
from kvtrace.proc.contracts import DashboardJob, Status  # noqa: E402
from traces.samples import resolve_trace  # noqa: E402

DEFAULT_TRACE = "sample:mooncake-conversation"
_TICK = os.sysconf("SC_CLK_TCK")


def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _proc_peak_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _plain_here(trace: str) -> dict[str, float]:
    with ReplaySession(trace) as s:
        t0, c0 = time.perf_counter(), time.process_time()
        result = s.run()
        return {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, "steps": result.stats.steps}


class _Discard:
    """A replayer's end with no screen: updates framed as for the pipe (``write_update``),
    then dropped; the wall and CPU clocks when the replay said it was done (what follows,
    filling in the checkpoints where it stopped, is not replay time)."""

    def __init__(self) -> None:
        self.done = False
        self.at_done = (0.0, 0.0)
        self._sink = _Sink()

    def records(self, update: SnapshotBlock) -> None:
        write_update(self._sink, update)  # type: ignore[arg-type]

    def send(self, message: object) -> None:
        if isinstance(message, Status) and message.done and not self.done:
            self.done = True
            self.at_done = (time.perf_counter(), time.process_time())

    def commands(self, timeout: float) -> list[object] | None:
        return None if self.done else []


class _Sink:
    """A connection that drops what is sent to it."""

    def send_bytes(self, data: bytes) -> None:
        pass


@contextlib.contextmanager
def _screenless_replayer(trace: str) -> Iterator[tuple[Replayer, _Discard]]:
    """The dashboard's replay process without a screen: the session as ``kvtrace replay
    --tui`` builds it, playing at full speed, the page map asked for, its updates
    framed and dropped; the source is closed on the way out."""
    source = job_source(_job(trace))  # as the replay process sets it up
    try:
        end = _Discard()
        replayer = Replayer(source, end, play=True)  # type: ignore[arg-type]
        replayer.num_cells = 2_000
        yield replayer, end
    finally:
        source.close()


def _replay_process_here(trace: str) -> dict[str, float]:
    """The dashboard's replay process without a screen (``_screenless_replayer``), timed to
    its last step (``fill_cpu_s``: the checkpoints filled in after it)."""
    with _screenless_replayer(trace) as (replayer, end):
        t0, c0 = time.perf_counter(), time.process_time()
        replayer.run()
        return {"wall_s": end.at_done[0] - t0, "cpu_s": end.at_done[1] - c0,
                "fill_cpu_s": time.process_time() - end.at_done[1],
                "steps": float(replayer.source.state.timeline.size)}

# The replay process's own extras, timed by ``--components``: (what, owner, attribute).
_COMPONENTS: tuple[tuple[str, Any, str], ...] = (
    ("building blocks (SnapshotBlock.of)", SnapshotBlock, "of"),
    ("folding them (ReplayState.apply_block)", ReplayState, "apply_block"),
    ("framing them for the pipe (write_update)", _Discard, "records"),
    ("page maps (Replayer._refresh_map)", Replayer, "_refresh_map"),
    ("checkpoints (ReplaySession._save_checkpoint)", ReplaySession, "_save_checkpoint"),
)


@contextlib.contextmanager
def _timed(owner: Any, name: str, into: list[float]) -> Iterator[None]:
    """``owner.name`` (a function or classmethod) timed in CPU seconds, each call adding
    ``[calls, seconds, minor page faults]`` to ``into``, until the block ends."""
    raw = owner.__dict__[name]
    inner = raw.__func__ if isinstance(raw, classmethod) else raw

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0, f0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        try:
            return inner(*args, **kwargs)
        finally:
            into[0] += 1
            into[1] += time.process_time() - t0
            into[2] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0

    setattr(owner, name, classmethod(timed) if isinstance(raw, classmethod) else timed)
    try:
        yield
    finally:
        setattr(owner, name, raw)


def components(trace: str) -> None:
    """``--components``: the replay process's own extras, call by call, in one replay."""
    totals = {what: [0, 0.0, 0] for what, _, _ in _COMPONENTS}
    with contextlib.ExitStack() as stack:
        for what, owner, name in _COMPONENTS:
            stack.enter_context(_timed(owner, name, totals[what]))
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        r = _replay_process_here(trace)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    print(f"trace {trace}: the dashboard's replay process (no screen) to its last step of {r['steps']:,.0f}: "
          f"{r['cpu_s']:.2f} s CPU ({r['wall_s']:.2f} s wall), {faults:,} minor page faults to the end of its "
          "checkpoints' fill")
    for what, (calls, cpu_s, flt) in totals.items():
        print(f"  {what:<46} {calls:>6,} calls {cpu_s:7.3f} s CPU {100 * cpu_s / r['cpu_s']:5.1f}% {flt:>8,} faults")
    extra = sum(cpu_s for _, cpu_s, _ in totals.values())
    print(f"  {'in all':<46} {'':>12} {extra:7.3f} s CPU {100 * extra / r['cpu_s']:5.1f}% "
          f"{sum(f for _, _, f in totals.values()):>8,} faults")


def start_once(trace: str, what: str = "--plain-once") -> subprocess.Popen[str]:
    """One replay in a fresh process, so that this process holds only the screen: the
    plain replay (as ``kvtrace replay`` runs it), or with ``--replay-process-once`` the
    dashboard's replay process without a screen (with the environment ``ChildReplay``
    gives it); ``result`` waits for its figures."""
    env = child_environ(CHILD_ENV) if what == "--replay-process-once" else None
    return subprocess.Popen([sys.executable, __file__, trace, what], stdout=subprocess.PIPE, text=True, env=env)


def result(proc: subprocess.Popen[str]) -> dict[str, float]:
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, proc.args))} failed with code {proc.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def plain(trace: str) -> dict[str, float]:
    return result(start_once(trace))


def _job(trace: str) -> DashboardJob:
    """The dashboard's replay job for ``trace``, as ``kvtrace replay TRACE --tui`` makes it."""
    return dashboard_job(resolve_version("builtin"), str(resolve_trace(trace)), trace_label=trace, page_size=None,
                         pool_tokens=None, device="cpu", options=dataclasses.asdict(ReplayOptions()),
                         play=False)


async def dashboard(trace: str, size: tuple[int, int], profile: cProfile.Profile | None,
                    profile_replay: str | None = None) -> dict[str, float]:
    job = _job(trace)
    if profile_replay:
        job = dataclasses.replace(job, profile=profile_replay)
    link = ChildReplay(job)
    link.wait_started()
    pid = link.proc.pid
    app = KvtraceApp(link)
    async with app.run_test(size=size) as pilot:
        while app.frame is None:
            await pilot.pause(0.01)
        t0, c0, child0 = time.perf_counter(), time.process_time(), _proc_cpu_s(pid)
        shown0 = app.frames_shown
        if profile is not None:
            profile.enable()
        await pilot.press("space")
        while app.frame is None or not app.frame.done:
            await asyncio.sleep(0.05)  # not pilot.pause: it makes every widget answer, and redraws
        wall = time.perf_counter() - t0
        if profile is not None:
            profile.disable()
        state = app.driver.state
        out = {
            "wall_s": wall,
            "child_cpu_s": _proc_cpu_s(pid) - child0,
            "ui_cpu_s": time.process_time() - c0,
            "child_peak_mb": _proc_peak_mb(pid),
            "steps": float(state.timeline.size if state is not None else 0),
            "frames_shown": float(app.frames_shown - shown0),
            "state_mb": (state.nbytes() if state is not None else 0) / 2**20,
            "requests": float(app.frame.requests.size),
            "draw_ms": 1000 * statistics.median(app.draw_s) if app.draw_s else float("nan"),
        }
        await pilot.press("q")
    return out


def no_screen(trace: str, repeat: int) -> None:
    """``--no-screen``: what the replay process adds by itself, pairs run at the same time."""
    print(f"trace {trace}, {os.cpu_count()} CPUs; the dashboard's replay process with no screen against the plain "
          "replay, each pair at the same time", flush=True)
    if (os.cpu_count() or 1) < 4:
        print(f"warning: {os.cpu_count()} CPUs: the two replays and their checkers need four; they compete for cores",
              flush=True)
    ratios = []
    for i in range(repeat):
        proc = start_once(trace)
        d = result(start_once(trace, "--replay-process-once"))
        p = result(proc)
        ratios.append(d["wall_s"] / p["wall_s"])
        print(f"pair {i + 1}: plain {p['wall_s']:.2f} s ({p['cpu_s']:.2f} s CPU), replay process {d['wall_s']:.2f} s "
              f"({d['cpu_s']:.2f} s CPU; then {d['fill_cpu_s']:.2f} s filling in checkpoints): x{ratios[-1]:.2f}",
              flush=True)
    print(f"replay process against the plain replay: median x{statistics.median(ratios):.2f}, "
          f"x{min(ratios):.2f} to x{max(ratios):.2f}")


def _interleaved_once(trace: str, slice_s: float = 0.5) -> tuple[float, float, int]:
    """(plain CPU s, replay process CPU s, steps): the two replays of ``trace`` in this
    process, ``slice_s`` of the replay process's loop (as ``Replayer.run`` goes, playing
    at full speed with a page map asked for) then the plain replay up to the same step."""
    plain_cpu = dash_cpu = 0.0
    with ReplaySession(str(resolve_trace(trace))) as plain_session, _screenless_replayer(trace) as (replayer, end):
        plain_steps = plain_session.snapshots()
        due: float | None = time.monotonic()
        while not end.done and due is not None:
            c0 = time.process_time()
            stop = time.monotonic() + slice_s
            while time.monotonic() < stop and not end.done and due is not None:
                due = replayer.turn(due)
            c1 = end.at_done[1] if end.done else time.process_time()  # not the fill after the end
            last = replayer.source.last
            target = last.step if last is not None else -1
            c2 = time.process_time()
            for snap in plain_steps:
                if snap.step >= target:
                    break
            dash_cpu += c1 - c0
            plain_cpu += time.process_time() - c2
        c2 = time.process_time()
        for _ in plain_steps:
            pass
        plain_cpu += time.process_time() - c2
        return plain_cpu, dash_cpu, int(replayer.source.state.timeline.size)


def interleaved(trace: str, repeat: int) -> None:
    """``--interleaved``: the replay process's CPU against the plain replay's, in one process."""
    print(f"trace {trace}, {os.cpu_count()} CPUs; the dashboard's replay process (no screen) and the plain replay "
          "in one process, half a second of the first, then the second up to the same step", flush=True)
    overs = []
    for i in range(repeat):
        p, d, steps = _interleaved_once(trace)
        overs.append(100 * (d / p - 1))
        print(f"run {i + 1}: {steps:,} steps; plain replay {p:.2f} s CPU, replay process {d:.2f} s CPU: "
              f"{overs[-1]:+.1f}%", flush=True)
    print(f"replay process CPU against the plain replay's, interleaved: {_spread(overs)}")


def _signal_tree(pid: int, sig: int) -> None:
    """Send ``sig`` to process ``pid`` and every process under it (a replay and its checker)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(sig)


def _pin_tree(pid: int, replay_cpu: set[int], other_cpus: set[int]) -> None:
    """Pin process ``pid`` (a replay) to ``replay_cpu`` and the processes under it (its
    checker, forked at any time) to ``other_cpus``."""
    import psutil

    try:
        root = psutil.Process(pid)
        root.cpu_affinity(sorted(replay_cpu))
        for child in root.children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                child.cpu_affinity(sorted(other_cpus))
    except psutil.NoSuchProcess:
        return


class _Turns:
    """Which replay of ``--sliced`` runs now: the replays take turns on one CPU (the other
    stopped, with its checker), this process (the screen, and the children it starts until
    pinned) and the checkers on the others; nothing is pinned on a single CPU or where
    affinity cannot be set."""

    @staticmethod
    def possible() -> bool:
        return hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) >= 2

    def __init__(self) -> None:
        self.pinned = self.possible()
        cpus = sorted(os.sched_getaffinity(0)) if self.pinned else []
        self.saved = set(cpus)
        self.replay_cpu, self.other_cpus = ({cpus[0]}, set(cpus[1:])) if self.pinned else (set(), set())
        if self.pinned:
            os.sched_setaffinity(0, self.other_cpus)
        self.running: int | None = None  # the replay process whose turn it is
        self.pids: list[int] = []  # every replay process taking turns

    def add(self, pid: int) -> None:
        """A replay process takes part (it runs until ``give`` passes the turn on)."""
        self.pids.append(pid)
        if self.pinned:
            _pin_tree(pid, self.replay_cpu, self.other_cpus)

    def give(self, pid: int) -> None:
        """The turn to ``pid``: the others stop (with their checkers), it runs (re-pinned:
        its checker may have been forked since)."""
        for other in self.pids:
            if other != pid:
                _signal_tree(other, signal.SIGSTOP)
        if self.pinned:
            _pin_tree(pid, self.replay_cpu, self.other_cpus)
        _signal_tree(pid, signal.SIGCONT)
        self.running = pid

    def release(self) -> None:
        """Every process runs again (none is left stopped) and this one's CPUs are restored."""
        for pid in self.pids:
            _signal_tree(pid, signal.SIGCONT)
        if self.pinned:
            os.sched_setaffinity(0, self.saved)


def _sliced_no_screen_once(trace: str, slice_s: float = 0.5) -> tuple[float, float]:
    """The plain replay and the dashboard's replay process with no screen
    (``--replay-process-once``), each in a process of its own, taking turns as in
    ``_sliced_once``; their CPU seconds (the replay process's to its last step)."""
    turns = _Turns()
    procs = [start_once(trace), start_once(trace, "--replay-process-once")]
    try:
        for proc in procs:
            turns.add(proc.pid)
        turns.give(procs[0].pid)
        while any(proc.poll() is None for proc in procs):
            time.sleep(slice_s)
            waiting = next(proc for proc in procs if proc.pid != turns.running)
            if waiting.poll() is None:
                turns.give(waiting.pid)
        return result(procs[0])["cpu_s"], result(procs[1])["cpu_s"]
    finally:
        turns.release()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def sliced_no_screen(trace: str, repeat: int) -> None:
    """``--sliced --no-screen``: the replay process alone, in a process of its own, against
    the plain replay, taking turns."""
    where = "; both on one CPU, the checkers on the others" if _Turns.possible() else ""
    print(f"trace {trace}, {os.cpu_count()} CPUs; the dashboard's replay process with no screen and the plain replay, "
          f"each in a process of its own, taking turns half a second each, the other stopped{where}", flush=True)
    overs = []
    for i in range(repeat):
        p, d = _sliced_no_screen_once(trace)
        overs.append(100 * (d / p - 1))
        print(f"run {i + 1}: plain replay {p:.2f} s CPU, replay process {d:.2f} s CPU: {overs[-1]:+.1f}%", flush=True)
    print(f"replay process CPU (no screen) against the plain replay's, taking turns: {_spread(overs)}")


async def _sliced_once(trace: str, size: tuple[int, int], slice_s: float = 0.5) -> dict[str, float]:
    """The dashboard (``dashboard``'s set-up) and the plain replay (``start_once``) of
    ``trace`` at once, ``slice_s`` of the one running, then of the other; their replay
    processes' CPU seconds (the dashboard's to its done status) and the screen's while
    its replay ran. Where affinity can be set, both replay processes run on the same CPU
    (CPUs of one machine differ in speed, and in what else shares their core) and the
    screen and the checkers on the others."""
    turns = _Turns()
    plain_proc = start_once(trace)
    turns.add(plain_proc.pid)
    try:
        link = ChildReplay(_job(trace))
        link.wait_started()
        pid = link.proc.pid
        turns.add(pid)
        app = KvtraceApp(link)
        async with app.run_test(size=size) as pilot:
            while app.frame is None:
                await pilot.pause(0.01)
            turns.give(pid)
            c0, ui0 = _proc_cpu_s(pid), time.process_time()
            dash_cpu: float | None = None
            ui_cpu = 0.0
            await pilot.press("space")
            switch_at = time.perf_counter() + slice_s
            while dash_cpu is None or plain_proc.poll() is None:
                await asyncio.sleep(0.01)
                if dash_cpu is None and app.frame is not None and app.frame.done:
                    dash_cpu = _proc_cpu_s(pid) - c0  # not the checkpoints' fill after the end
                    if turns.running == pid:
                        ui_cpu += time.process_time() - ui0
                    turns.give(plain_proc.pid)
                    continue
                if time.perf_counter() < switch_at:
                    continue
                switch_at = time.perf_counter() + slice_s
                if turns.running == pid and plain_proc.poll() is None:
                    ui_cpu += time.process_time() - ui0
                    turns.give(plain_proc.pid)
                elif turns.running != pid and dash_cpu is None:
                    turns.give(pid)
                    ui0 = time.process_time()
            turns.release()
            steps = app.driver.state.timeline.size if app.driver.state is not None else 0
            await pilot.press("q")
        plain = result(plain_proc)
    finally:
        turns.release()  # never leave a stopped process behind
        if plain_proc.poll() is None:
            plain_proc.kill()
            plain_proc.wait()
    return {"plain_cpu_s": plain["cpu_s"], "dash_cpu_s": dash_cpu, "ui_cpu_s": ui_cpu, "steps": float(steps)}


def sliced(trace: str, size: tuple[int, int], repeat: int) -> None:
    """``--sliced``: the dashboard's replay process (with its screen) against the plain
    replay, taking turns on the machine."""
    where = "; both replays on one CPU, the screen and the checkers on the others" if _Turns.possible() else ""
    print(f"trace {trace}, {os.cpu_count()} CPUs, terminal {size[0]}x{size[1]}; the dashboard (replay process and "
          f"screen) and the plain replay taking turns, half a second each, the other stopped{where}", flush=True)
    overs = []
    for i in range(repeat):
        r = asyncio.run(_sliced_once(trace, size))
        overs.append(100 * (r["dash_cpu_s"] / r["plain_cpu_s"] - 1))
        print(f"run {i + 1}: {r['steps']:,.0f} steps; plain replay {r['plain_cpu_s']:.2f} s CPU, the dashboard's replay "
              f"process {r['dash_cpu_s']:.2f} s CPU: {overs[-1]:+.1f}%; its screen {r['ui_cpu_s']:.2f} s CPU",
              flush=True)
    print(f"replay process CPU with the dashboard against the plain replay's, taking turns: {_spread(overs)} "
          f"(target <= +10%: {'ok' if statistics.median(overs) <= 10 else 'MISSED'})")


def _spin_cpu_s(iterations: int) -> float:
    """CPU seconds this process takes for a fixed pure-Python loop."""
    t0 = time.process_time()
    x = 0
    for i in range(iterations):
        x += i
    return time.process_time() - t0


def cpu_interference(repeat: int = 3, iterations: int = 20_000_000) -> float | None:
    """How much slower (percent, median of ``repeat``) a CPU-bound loop runs on one CPU
    while another CPU is busy than while it is idle; None on a single CPU or where
    affinity cannot be set."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    here, there = cpus[0], cpus[1]
    spinner = ("import os, sys, time\n"
               f"os.sched_setaffinity(0, {{{there}}})\n"
               "end = time.monotonic() + float(sys.argv[1])\n"
               "while time.monotonic() < end: pass\n")
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {here})
    try:
        slowdowns = []
        _spin_cpu_s(iterations // 4)  # warm up (the first loop runs slow)
        for _ in range(repeat):
            alone = _spin_cpu_s(iterations)
            busy = subprocess.Popen([sys.executable, "-c", spinner, str(4 * alone + 1.0)])
            time.sleep(0.3)  # the spinner is spinning
            shared = _spin_cpu_s(iterations)
            busy.kill()
            busy.wait()
            slowdowns.append(100 * (shared / alone - 1))
        return statistics.median(slowdowns)
    finally:
        os.sched_setaffinity(0, saved)


def _spread(values: list[float]) -> str:
    return f"median {statistics.median(values):+.1f}%, {min(values):+.1f}% to {max(values):+.1f}%"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="?", default=DEFAULT_TRACE)
    ap.add_argument("--repeat", type=int, default=3, metavar="N", help="interleaved pairs of runs")
    ap.add_argument("--size", default="180x50", metavar="WxH", help="terminal size of the headless dashboard")
    ap.add_argument("--profile-ui", metavar="FILE", help="cProfile the screen's process while it plays (pstats file)")
    ap.add_argument("--profile-replay", metavar="FILE", help="cProfile the replay process, in CPU seconds (pstats file)")
    ap.add_argument("--together", action="store_true",
                    help="run each pair's two replays at the same time (a machine with six cores or more)")
    ap.add_argument("--no-screen", action="store_true",
                    help="the dashboard's replay process with no screen (updates discarded) against the plain replay, "
                         "each pair at the same time (a machine with four cores or more)")
    ap.add_argument("--interleaved", action="store_true",
                    help="the dashboard's replay process (no screen) and the plain replay alternating in one process: "
                         "their CPU seconds, immune to a machine's drift")
    ap.add_argument("--sliced", action="store_true",
                    help="the dashboard (with its screen) and the plain replay taking turns, half a second each: "
                         "their replay processes' CPU seconds, immune to a machine's drift (with --no-screen: the "
                         "replay process alone, in a process of its own)")
    ap.add_argument("--components", action="store_true",
                    help="the CPU seconds of each of the replay process's own extras, timed call by call in one replay")
    ap.add_argument("--force", action="store_true", help="overwrite the --profile-ui / --profile-replay files")
    ap.add_argument("--replay-process-once", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--plain-once", action="store_true", help=argparse.SUPPRESS)  # one plain replay, as JSON
    args = ap.parse_args()
    modes = [name for name in ("together", "interleaved", "sliced", "components") if getattr(args, name)]
    if len(modes) > 1 or (args.no_screen and modes and modes != ["sliced"]):
        ap.error(f"--{' and --'.join(modes + (['no-screen'] if args.no_screen else []))}: one mode at a time "
                 "(--no-screen goes alone or with --sliced)")
    if (args.profile_ui or args.profile_replay) and (set(modes) - {"together"} or args.no_screen):
        ap.error("--profile-ui / --profile-replay: only with the pairs (no mode, or --together)")
    try:
        open_trace(args.trace)  # a bad trace: one line, before any replay starts
    except USER_ERRORS as exc:
        ap.exit(2, f"bench/tui.py: {exc}\n")
    for out in (args.profile_ui, args.profile_replay):
        if out and Path(out).exists() and not args.force:
            ap.error(f"{out} exists (pass --force to overwrite it)")
    if args.plain_once:
        print(json.dumps(_plain_here(args.trace)))
        return
    if args.replay_process_once:
        print(json.dumps(_replay_process_here(args.trace)))
        return
    if args.components:
        if any(name not in os.environ for name in CHILD_ENV):  # as the replay process runs (numpy reads it at import)
            os.execve(sys.executable, [sys.executable, *sys.argv], child_environ(CHILD_ENV))
        components(args.trace)
        return
    if args.no_screen and args.sliced:
        sliced_no_screen(args.trace, args.repeat)
        return
    if args.no_screen:
        no_screen(args.trace, args.repeat)
        return
    if args.interleaved:
        interleaved(args.trace, args.repeat)
        return
    w, h = (int(v) for v in args.size.split("x"))
    if args.sliced:
        sliced(args.trace, (w, h), args.repeat)
        return
    profile = cProfile.Profile() if args.profile_ui else None
    load0 = os.getloadavg()
    print(f"trace {args.trace}, {os.cpu_count()} CPUs, load average {load0[0]:.1f} / {load0[1]:.1f} / {load0[2]:.1f} "
          f"(1 / 5 / 15 min), terminal {w}x{h}", flush=True)
    slowdown = cpu_interference()
    if slowdown is not None:
        how = f"{slowdown:.0f}% slower" if slowdown >= 0 else f"{-slowdown:.0f}% faster"
        print(f"CPU interference: a CPU-bound loop runs {how} while another CPU is busy (median of 3); the screen's "
              "CPU time slows the replay by about that share of it (it varies from minute to minute)", flush=True)
    if args.together:
        print("each pair runs the two replays at the same time: a machine whose speed drifts (a shared host) "
              "slows both alike", flush=True)
        if (os.cpu_count() or 1) < 6:
            print(f"warning: {os.cpu_count()} CPUs: the two replays, their checkers and the screen need six; "
                  "they compete for cores and the ratio means little", flush=True)
    rows = []
    for i in range(args.repeat):
        if args.together:
            proc = start_once(args.trace)
            d = asyncio.run(dashboard(args.trace, (w, h), profile, args.profile_replay))
            p = result(proc)
        elif i % 2 == 0:
            p = plain(args.trace)
            d = asyncio.run(dashboard(args.trace, (w, h), profile, args.profile_replay))
        else:
            d = asyncio.run(dashboard(args.trace, (w, h), profile, args.profile_replay))
            p = plain(args.trace)
        over = 100 * (d["wall_s"] / p["wall_s"] - 1)
        cpu_over = 100 * (d["child_cpu_s"] / p["cpu_s"] - 1)
        fps = d["frames_shown"] / d["wall_s"]
        rows.append((p, d, over, cpu_over, fps))
        print(f"pair {i + 1}: without {p['wall_s']:.2f} s ({p['cpu_s']:.2f} s CPU); with the dashboard {d['wall_s']:.2f} s "
              f"(x{d['wall_s'] / p['wall_s']:.2f}, {over:+.1f}%; replay process {d['child_cpu_s']:.2f} s CPU, {cpu_over:+.1f}%), {fps:.1f} frames/s, "
              f"median draw {d['draw_ms']:.1f} ms, screen process {d['ui_cpu_s']:.2f} s CPU; load {os.getloadavg()[0]:.1f}",
              flush=True)
    overs = [r[2] for r in rows]
    cpu_overs = [r[3] for r in rows]
    fpss = [r[4] for r in rows]
    steps = rows[0][0]["steps"]
    ok = statistics.median(overs) <= 10
    ratio = statistics.median(r[1]["wall_s"] / r[0]["wall_s"] for r in rows)
    print(f"replay of {steps:,} steps, wall time with the dashboard against without: x{ratio:.2f}, {_spread(overs)} "
          f"(target <= +10%: {'ok' if ok else 'MISSED'})")
    print(f"replay process CPU against the plain replay's: {_spread(cpu_overs)}")
    fps_ok = statistics.median(fpss) >= 20
    print(f"frames a second: median {statistics.median(fpss):.1f}, {min(fpss):.1f} to {max(fpss):.1f} "
          f"(target >= 20: {'ok' if fps_ok else 'MISSED'})")
    last = rows[-1][1]
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"memory with {last['requests']:,.0f} requests: screen process peak RSS {rss_mb:.0f} MB, replay process peak RSS {last['child_peak_mb']:.0f} MB; the screen's "
          f"per-request state and timeline {last['state_mb']:.1f} MB")
    load1 = os.getloadavg()
    print(f"load average at the end {load1[0]:.1f} / {load1[1]:.1f} / {load1[2]:.1f}")
    if profile is not None:
        profile.dump_stats(args.profile_ui)
        print(f"screen profile: {args.profile_ui}")


if __name__ == "__main__":
    main()
