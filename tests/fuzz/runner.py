"""Run kvtrace's commands in-process over mutated traces and judge what they did.

A case passes when every command (``info``, ``validate``, ``replay``) exits 0, 1 or
2; when an exit 2 is exactly one ``kvtrace: error: ...`` line naming no internal
failure; when ``--json`` output parses; within the per-case time limit; and without
the process's peak memory (itself and its children) growing past the memory limit.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import typer
import typer.testing as typer_testing
from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.replay.config import MEMORY_LIMIT_VAR
from tests.fuzz.mutate import Case, Seed, make_case, write

# What an error line must never say: the command failed in a way it did not foresee.
FORBIDDEN = ("internal error", "factory failed", "no reason given", "Traceback")
DEFAULT_TIME_LIMIT_S = 30.0
DEFAULT_MEMORY_LIMIT = 1 << 30
_build_command = typer_testing._get_command


class CaseTimeout(BaseException):
    """The per-case time limit ran out (a BaseException: no ``except Exception`` eats it)."""


@dataclass(frozen=True, slots=True)
class Failure:
    """A case that broke the contract: which, how to rebuild it, what went wrong."""

    seed: int
    command: str
    reason: str
    notes: tuple[str, ...]

    def __str__(self) -> str:
        return f"case {self.seed} ({'; '.join(self.notes)}): {self.command}: {self.reason}"


class BuiltCliRunner(CliRunner):
    """Typer's test runner, with the command tree built once: ``CliRunner.invoke``
    rebuilds it from the app's signatures on every call (half of a case's time).
    Every typer version's runner builds it through ``typer.testing._get_command``,
    which this runner answers from its cache while it invokes."""

    def __init__(self) -> None:
        super().__init__()
        self._built: dict[int, Any] = {}

    def _get_command(self, app: typer.Typer) -> Any:
        built = self._built.get(id(app))
        if built is None:
            built = self._built[id(app)] = _build_command(app)
        return built

    def invoke(self, app: typer.Typer, args: Any = None, **kwargs: Any) -> Any:  # type: ignore[override]
        typer_testing._get_command = self._get_command
        try:
            return super().invoke(app, args, **kwargs)
        finally:
            typer_testing._get_command = _build_command


_SHARED_RUNNER = BuiltCliRunner()  # the command tree, built on the first case


def _peak_rss() -> int:
    """Peak resident bytes of this process and of its largest child so far (Linux: KiB)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children) * 1024


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise ``CaseTimeout`` in the main thread after ``seconds``."""

    def expire(signum: int, frame: object) -> None:
        raise CaseTimeout(f"over the {seconds:g} s limit")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ``--check every`` checks the whole pool after every allocator call: only on small pools.
CHECK_EVERY_MAX_POOL = 1 << 16


def commands_for(path: Path, case: Case, rng: np.random.Generator) -> list[list[str]]:
    """The commands a case runs: info, validate, and a replay with varied options, most
    with ``--json``, some rendering their tables."""
    as_json = ["--json"] if rng.random() < 0.7 else []
    replay = ["replay", str(path), *as_json]
    if rng.random() < 0.3:
        replay += ["--on-bad-op", "skip"]
    if rng.random() < 0.2:
        replay += ["--on-oom", "skip"]
    pool = case.seed.meta.get("config", {}).get("pool_tokens") if isinstance(case.seed.meta.get("config"), dict) else None
    if rng.random() < 0.1 and isinstance(pool, int) and pool <= CHECK_EVERY_MAX_POOL:
        replay += ["--check", "every"]
    return [["info", str(path), *as_json], ["validate", str(path), *as_json], replay]


def judge(args: list[str], exit_code: int, stdout: str, stderr: str, exception: BaseException | None) -> str | None:
    """Why a command's result breaks the contract (None: it keeps it)."""
    if exception is not None and not isinstance(exception, SystemExit):
        return f"raised {type(exception).__name__}: {exception}"
    if exit_code not in (0, 1, 2):
        return f"exit code {exit_code}"
    for word in FORBIDDEN:
        if word in stderr or word in stdout:
            return f"says {word!r}: {(stderr or stdout).strip()[:400]}"
    leaked = [line for line in stderr.splitlines() if "Warning" in line and not line.startswith("kvtrace: ")]
    if leaked:
        return f"a Python warning reached stderr: {leaked[0][:300]}"
    errors = [line for line in stderr.splitlines() if line.startswith("kvtrace: error: ")]
    if exit_code == 2:
        if len(errors) != 1 or stdout.strip():
            return f"exit 2 without exactly one error line: {stderr.strip()[:400]!r}"
        return None
    if errors:
        return f"exit {exit_code} with an error line: {errors[0][:300]}"
    if "--json" not in args:
        return None if stdout.strip() else f"exit {exit_code} and nothing on stdout"
    try:
        json.loads(stdout, parse_constant=_not_json)
    except ValueError as exc:
        return f"exit {exit_code} and stdout is not one JSON object ({exc}): {stdout[:200]!r}"
    return None


def _not_json(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def run_case(
    seeds: list[Seed],
    case_seed: int,
    workdir: Path,
    *,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    memory_limit: int = DEFAULT_MEMORY_LIMIT,
    runner: CliRunner | None = None,
) -> list[Failure]:
    """Build case ``case_seed``, run the commands on it, and return what went wrong."""
    rng = np.random.default_rng(case_seed)
    path = workdir / f"case-{case_seed}.kvtrace"
    try:
        case: Case = make_case(seeds, rng)
        write(case, path, rng)
    except Exception as exc:  # noqa: BLE001 - a fault of the fuzzer itself, reported as such
        path.unlink(missing_ok=True)
        return [Failure(case_seed, "mutate", f"the fuzzer could not build the case: {type(exc).__name__}: {exc}", ())]
    runner = runner or _SHARED_RUNNER
    failures = []
    # The product's own memory check refuses a pool past half the case's budget (the
    # estimate leaves out the interpreter's own growth): one clear line, not a swollen process.
    previous_limit = os.environ.get(MEMORY_LIMIT_VAR)
    os.environ[MEMORY_LIMIT_VAR] = str(memory_limit // 2)
    try:
        for args in commands_for(path, case, rng):
            before = _peak_rss()
            t0 = time.perf_counter()
            try:
                with time_limit(time_limit_s):
                    result = runner.invoke(app, args)
            except CaseTimeout as exc:
                failures.append(Failure(case_seed, args[0], str(exc), tuple(case.notes)))
                continue
            reason = judge(args, result.exit_code, result.stdout, result.stderr, result.exception)
            grown = _peak_rss() - before
            if reason is None and grown > memory_limit:
                reason = f"peak memory grew by {grown / 2**20:.0f} MiB (limit {memory_limit / 2**20:.0f} MiB)"
            if reason is not None:
                wall = time.perf_counter() - t0
                command = " ".join(args[:1] + args[2:])
                failures.append(Failure(case_seed, command, f"{reason} ({wall:.1f} s)", tuple(case.notes)))
    finally:
        path.unlink(missing_ok=True)
        if previous_limit is None:
            os.environ.pop(MEMORY_LIMIT_VAR, None)
        else:
            os.environ[MEMORY_LIMIT_VAR] = previous_limit
    return failures
