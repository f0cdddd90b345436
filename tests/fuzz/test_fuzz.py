"""The seeded quick fuzz run (the long one is ``bench/fuzz.py``), and the judge it relies on."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from tests.fuzz.mutate import Case, Seed, load_seeds, make_case, write
from tests.fuzz.runner import CaseTimeout, judge, run_case, time_limit

QUICK_CASES = range(1000, 1020)  # seeds of the quick run (about 20 s on one idle core)
# Cases the long run failed once, kept as regressions: a step whose number goes back
# reached the allocator unscreened (500006); recording.command not a string (700460, 700495);
# metadata asking for an 11,000-row request table (1.1 GiB) was built past the case's budget (901979);
# a null model field reached the bytes-per-token product (412, 5345); the fuzzer itself
# could not change the ops of a case whose op column an earlier edit had retyped (30912).
FOUND_CASES = (500006, 700460, 700495, 901979, 412, 5345, 30912)


@pytest.fixture(scope="module")
def seeds() -> list[Seed]:
    return load_seeds()


def test_the_seeds_are_clean_traces(seeds: list[Seed], tmp_path: Path) -> None:
    """Unmutated, every seed validates and replays (so a failure comes from the mutation)."""
    runner = CliRunner()
    for seed in seeds:
        path = write(Case(seed.copy()), tmp_path / f"{seed.name}.kvtrace", np.random.default_rng(0))
        for command, expected in (("validate", 0), ("replay", 0)):
            result = runner.invoke(app, [command, str(path), "--json"])
            assert result.exit_code == expected, (seed.name, command, result.stdout, result.stderr)


def test_cases_are_reproducible_from_their_seed(seeds: list[Seed], tmp_path: Path) -> None:
    first = write(make_case(seeds, np.random.default_rng(7)), tmp_path / "a.kvtrace", np.random.default_rng(8))
    again = write(make_case(seeds, np.random.default_rng(7)), tmp_path / "b.kvtrace", np.random.default_rng(8))
    assert first.read_bytes() == again.read_bytes()


def test_the_seeded_quick_run_finds_nothing(seeds: list[Seed], tmp_path: Path) -> None:
    failures = [f for case in QUICK_CASES for f in run_case(seeds, case, tmp_path)]
    assert failures == [], "\n".join(map(str, failures))


@pytest.mark.parametrize("case", FOUND_CASES)
def test_cases_the_long_run_found_stay_fixed(seeds: list[Seed], tmp_path: Path, case: int) -> None:
    failures = run_case(seeds, case, tmp_path)
    assert failures == [], "\n".join(map(str, failures))


@pytest.mark.parametrize(
    ("exit_code", "stdout", "stderr", "verdict"),
    [
        (0, '{"ok": true}', "", None),
        (1, '{"ok": false}', "kvtrace: warning: trace x: file truncated after step 3\n", None),
        (2, "", "kvtrace: error: trace x: corrupt data in record batch 2\n", None),
        (2, "", "kvtrace: internal error: MemoryError: Unable to allocate\n", "says 'internal error'"),
        (2, "", "kvtrace: error: allocator 'builtin': its factory failed: MemoryError\n", "says 'factory failed'"),
        (2, "", "kvtrace: error: background validation stopped at step 3: no reason given\n", "says 'no reason given'"),
        (2, "", "kvtrace: error: one\nkvtrace: error: two\n", "without exactly one error line"),
        (0, "not json", "", "is not one JSON object"),
        (0, '{"duration_s": Infinity}', "", "Infinity is not JSON"),
        (1, "{}", "kvtrace: error: x\n", "with an error line"),
        (3, "", "", "exit code 3"),
        (1, "{}", "validate.py:514: RuntimeWarning: overflow encountered\n", "a Python warning reached stderr"),
    ],
)
def test_the_judge(exit_code: int, stdout: str, stderr: str, verdict: str | None) -> None:
    found = judge(["replay", "t.kvtrace", "--json"], exit_code, stdout, stderr, None)
    assert found is None if verdict is None else verdict in str(found)


def test_the_judge_of_a_rendered_table() -> None:
    assert judge(["info", "t.kvtrace"], 0, "kvtrace info: t.kvtrace\n...", "", None) is None
    assert "nothing on stdout" in str(judge(["info", "t.kvtrace"], 0, "", "", None))


def test_an_exception_escaping_the_command_fails_the_case() -> None:
    assert "raised ValueError" in str(judge(["info"], 1, "", "", ValueError("boom")))


def test_the_time_limit_interrupts_a_case() -> None:
    with pytest.raises(CaseTimeout):
        with time_limit(0.05):
            time.sleep(2)
