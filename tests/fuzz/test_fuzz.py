"""The seeded quick fuzz run (the long one is ``bench/fuzz.py``), and the judge it relies on."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kvtrace.cli import app
from tests.fuzz.mutate import MANY_COPIES, Case, Seed, load_seeds, make_case, many_copies, nan_time, write
from tests.fuzz.runner import DEFAULT_TIME_LIMIT_S, CaseTimeout, judge, run_case, time_limit

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


@pytest.mark.slow
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


@pytest.mark.slow
def test_the_seeded_quick_run_finds_nothing(seeds: list[Seed], tmp_path: Path) -> None:
    failures = [f for case in QUICK_CASES for f in run_case(seeds, case, tmp_path)]
    assert failures == [], "\n".join(map(str, failures))


@pytest.mark.parametrize("case", FOUND_CASES)
def test_cases_the_long_run_found_stay_fixed(seeds: list[Seed], tmp_path: Path, case: int) -> None:
    failures = run_case(seeds, case, tmp_path)
    assert failures == [], "\n".join(map(str, failures))


@pytest.mark.parametrize(
    ("seed_name", "edit"),
    [
        pytest.param("tiny", lambda case, rng: many_copies(case, rng, copies=max(MANY_COPIES)),
                     marks=pytest.mark.slow),
        ("mooncake-eagle", lambda case, rng: many_copies(case, rng, copies=min(MANY_COPIES))),
        ("tiny", lambda case, rng: nan_time(case, rng, whole=True)),
        ("mooncake-tiny", lambda case, rng: nan_time(case, rng, whole=False)),
    ],
    ids=["many-copies-huge", "many-copies", "nan-time-step", "nan-time-row"],
)
def test_hostile_edits_get_a_verdict_or_one_line(seeds: list[Seed], tmp_path: Path, seed_name: str, edit) -> None:
    """A huge batch of copies of one row, a NaN time: validate and replay refuse the
    trace (a verdict, exit 1, or one error line, exit 2) within the fuzz run's limit."""
    case = Case(next(s for s in seeds if s.name == seed_name).copy())
    rng = np.random.default_rng(11)
    note = edit(case, rng)
    assert "NaN" in note or "repeated" in note, note
    path = write(case, tmp_path / "hostile.kvtrace", rng)
    runner = CliRunner()
    for args in (["validate", str(path), "--json"], ["validate", str(path)], ["replay", str(path)],
                 ["replay", str(path), "--json", "--on-bad-op", "skip"]):
        with time_limit(DEFAULT_TIME_LIMIT_S):
            result = runner.invoke(app, args)
        assert judge(args, result.exit_code, result.stdout, result.stderr, result.exception) is None, (
            note, args, result.stdout[:400], result.stderr)
        if args[0] == "validate" or "skip" not in args:
            assert result.exit_code in (1, 2), (note, args, result.stdout[:400], result.stderr)


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
