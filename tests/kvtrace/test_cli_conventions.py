"""The command line speaks its ecosystem's conventions: --version, examples in every
help, flags shown as flags, choices listed, defaults that come from the trace saying
so, shell completion, -q and --no-color everywhere, one warning style, no hard
wrapping into a pipe, rounded JSON, and a start-up that never imports torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import kvtrace
from kvtrace.cli import app, ui

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ("info", "validate", "record", "replay", "diff", "versions", "sweep run", "sweep report", "explain")
runner = CliRunner()


def help_of(*command: str) -> str:
    result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.stdout


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout == f"kvtrace {kvtrace.__version__}\n"
    from importlib.metadata import version

    assert version("kvtrace") == kvtrace.__version__  # one version: pyproject reads it from the package


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_every_help_has_examples_and_shows_flags_as_flags(command: str) -> None:
    text = help_of(*command.split())
    assert "Examples" in text and "$ kvtrace " in text
    assert "<bool>" not in text
    assert "--quiet" in text and "-q" in text and "--no-color" in text


def _click_commands() -> list[tuple[list[str], Any]]:
    """Every command and group of the CLI with its words (``["sweep", "run"]``), the root first."""
    import typer

    found: list[tuple[list[str], Any]] = []

    def walk(words: list[str], cmd: Any) -> None:
        found.append((words, cmd))
        for name, sub in sorted(getattr(cmd, "commands", {}).items()):
            walk([*words, name], sub)

    walk([], typer.main.get_command(app))
    return found


@pytest.mark.slow
def test_help_at_80_columns_shows_every_option_name_whole() -> None:
    import re

    commands = _click_commands()
    assert {" ".join(words) for words, _ in commands} >= {"view", "shrink", "sweep run", "record"}
    for words, cmd in commands:
        text = runner.invoke(app, [*words, "--help"], env={"COLUMNS": "80"}).stdout
        assert max(len(line) for line in text.splitlines()) <= 80, words
        for param in cmd.params:
            for name in [*param.opts, *param.secondary_opts]:
                if name.startswith("-"):
                    assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), (words, name)
        assert not re.search(r"[\w-]…", text.split("Examples")[0]), (words, text)  # no word cut short


def test_help_paragraphs_wrap_at_the_terminal_not_at_the_source() -> None:
    """A help paragraph is wrapped to the terminal's width, never broken where the
    docstring's source line ended (``one line`` / ``per commit`` at 80 columns)."""
    import inspect

    checked = 0
    for words, cmd in _click_commands():
        text = runner.invoke(app, [*words, "--help"], env={"COLUMNS": "200"}).stdout
        lines = {line.strip() for line in text.splitlines()}
        for paragraph in inspect.cleandoc(cmd.callback.__doc__ or "").split("\n\n")[1:] if cmd.callback else []:
            plain = " ".join(part.strip() for part in paragraph.splitlines())
            if "\n" in paragraph and len(plain) < 180 and not paragraph.lstrip().startswith(("- ", "* ", "\b")):
                assert plain in lines, (words, plain)
                checked += 1
    assert checked >= 5


@pytest.mark.slow
def test_usage_names_arguments_plainly() -> None:
    for words, cmd in _click_commands():
        usage = runner.invoke(app, [*words, "--help"], env={"COLUMNS": "200"}).stdout
        line = next(line for line in usage.splitlines() if "Usage:" in line)
        assert "{" not in line and "}" not in line, line
    assert "Usage: kvtrace replay [OPTIONS] TRACE " in help_of("replay")
    assert "Usage: kvtrace view [OPTIONS] LOG " in help_of("view")
    wrong = runner.invoke(app, ["info"])  # a missing argument's usage line too
    assert wrong.exit_code == 2 and "{TRACE}" not in wrong.output and "TRACE" in wrong.output


def test_choices_and_defaults_from_the_trace_are_shown() -> None:
    replay = help_of("replay")
    for choices in ("<cpu|cuda>", "<every|full|end|never>", "<stop|skip>"):
        assert choices in replay, choices
    assert replay.count("[default: (the trace's)]") == 2  # --page-size, --pool-tokens
    record = help_of("record")
    assert "<cpu|cuda>" in record and "<zstd|lz4>" in record and "<mooncake|azure|lengths|trace>" in record
    assert "[default: (from the file)]" in record
    diff = help_of("diff")
    for choices in ("<cpu|cuda>", "<every|full|end|never>", "<stop|skip>"):
        assert choices in diff, choices
    assert diff.count("[default: (the trace's)]") == 2


def test_shell_completion() -> None:
    root = help_of()
    assert "--install-completion" in root and "--show-completion" in root
    # In a process of its own, started by bash as a user's would be (typer before 0.29
    # finds the shell among the process's parents), the shell also named on the command line.
    script = subprocess.run(
        ["bash", "-c", '"$0" -m kvtrace --show-completion bash; exit $?', sys.executable],
        capture_output=True, text=True, env={**os.environ, "SHELL": "/bin/bash"},
    )
    assert script.returncode == 0 and "_KVTRACE_COMPLETE=complete_bash" in script.stdout, script.stderr

    def complete(words: str, cword: int) -> list[str]:
        env = dict(os.environ, COMP_WORDS=words, COMP_CWORD=str(cword), _KVTRACE_COMPLETE="complete_bash")
        env["PYTHONPATH"] = str(ROOT)
        out = subprocess.run([sys.executable, "-m", "kvtrace"], env=env, capture_output=True, text=True, cwd=ROOT)
        return out.stdout.split()

    assert complete("kvtrace rep", 1) == ["replay"]
    assert complete("kvtrace replay sample:tiny --device ", 4) == ["cpu", "cuda"]


def test_completion_installs_and_shows_the_shell_named(tmp_path: Path) -> None:
    """Run from bash, as a user's would be: the shell named on the command line wins over
    the one kvtrace runs in (typer's own options ignored the name and installed bash's)."""

    def kvtrace_from_bash(*args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "SHELL": "/bin/bash", "HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
        return subprocess.run(["bash", "-c", '"$0" -m kvtrace "$@"; exit $?', sys.executable, *args],
                              capture_output=True, text=True, env=env, cwd=ROOT)

    installed = kvtrace_from_bash("--install-completion", "zsh")
    assert installed.returncode == 0 and "zsh completion installed" in installed.stdout, installed.stderr
    assert (tmp_path / ".zfunc" / "_kvtrace").read_text().startswith("#compdef kvtrace")
    assert (tmp_path / ".zshrc").is_file() and not (tmp_path / ".bashrc").exists()
    shown = kvtrace_from_bash("--show-completion", "zsh")
    assert shown.returncode == 0 and shown.stdout.startswith("#compdef kvtrace"), shown.stderr
    wrong = kvtrace_from_bash("--show-completion", "tcsh")
    assert wrong.returncode == 2 and wrong.stdout == ""
    assert wrong.stderr.strip().splitlines() == [
        "kvtrace: error: Invalid value for '--show-completion': 'tcsh' is not a shell kvtrace completes; "
        "use one of bash, zsh, fish, powershell, pwsh (see 'kvtrace --help')"
    ]


def test_a_bad_root_option_is_one_line() -> None:
    result = runner.invoke(app, ["--bogus", "info", "sample:tiny"])
    assert result.exit_code == 2
    assert result.stderr.strip() == "kvtrace: error: No such option: --bogus (see 'kvtrace --help')"


@pytest.mark.parametrize("placement", ["root", "command"])
def test_quiet_and_no_color_everywhere(placement: str) -> None:
    colour = runner.invoke(app, ["info", "sample:tiny"], env={"FORCE_COLOR": "1"})
    assert "\x1b[" in colour.stdout  # rich colours a forced terminal ...
    for command in (
        ["info", "sample:tiny"],
        ["validate", "sample:tiny"],
        ["replay", "sample:tiny"],
        ["diff", "sample:tiny", "--b", "builtin", "--jobs", "1"],
        ["versions"],
    ):
        args = ["-q", "--no-color", *command] if placement == "root" else [*command, "-q", "--no-color"]
        result = runner.invoke(app, args, env={"FORCE_COLOR": "1"})
        assert result.exit_code == 0, result.output
        assert "\x1b[" not in result.stdout and "\x1b[" not in result.stderr  # ... but not with --no-color


def test_json_before_the_command_name() -> None:
    after = runner.invoke(app, ["info", "sample:tiny", "--json"])
    before = runner.invoke(app, ["--json", "info", "sample:tiny"])
    assert before.exit_code == 0 and json.loads(before.stdout) == json.loads(after.stdout)
    validate = runner.invoke(app, ["--json", "-q", "validate", "sample:tiny"])
    assert validate.exit_code == 0 and json.loads(validate.stdout)["ok"] is True


def test_view_takes_json_quiet_and_no_color(tmp_path: Path) -> None:
    log = tmp_path / "tiny.arrow"
    assert runner.invoke(app, ["replay", "sample:tiny", "--out", str(log), "-q"]).exit_code == 0
    info = json.loads(runner.invoke(app, ["info", str(log), "--json"]).stdout)
    for args in (["view", str(log), "--json", "-q", "--no-color"], ["--json", "view", str(log)]):
        result = runner.invoke(app, args, env={"FORCE_COLOR": "1"})
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout) == info and "\x1b[" not in result.stdout
    served = runner.invoke(app, ["view", str(log), "--json", "--serve"])
    assert served.exit_code == 2 and "drop --json or --serve" in served.stderr


@pytest.mark.slow
def test_every_float_option_refuses_nan_and_infinity_naming_itself() -> None:
    floats = [(words, param.opts[0]) for words, cmd in _click_commands() for param in cmd.params
              if "float" in getattr(param.type, "name", "")]
    assert {opt for _, opt in floats} >= {"--flush-interval", "--spec-acceptance", "--time-scale", "--rate", "--max-time"}
    for words, option in floats:
        for value in ("nan", "inf", "-inf"):
            result = runner.invoke(app, [*words, option, value])
            assert result.exit_code == 2, (words, option, value)
            [line] = result.stderr.strip().splitlines()
            assert line.startswith(f"kvtrace: error: Invalid value for '{option}': "), line
            if value != "-inf":  # (below an option's minimum, click's range message says so first)
                assert f"must be a finite number, found {float(value)} " in line, line


@pytest.mark.parametrize("command", ["record", "sweep run"])
def test_a_negative_seed_names_the_option(command: str, tmp_path: Path) -> None:
    out = tmp_path / "unused"
    result = runner.invoke(app, [*command.split(), "sample:tiny", "-o", str(out), "--seed", "-1"])
    assert result.exit_code == 2 and "Invalid value for '--seed': -1 is not in the range x>=0" in result.stderr
    assert not out.exists()


def test_force_only_overwrites_and_the_memory_check_has_its_own_flag(tmp_path: Path) -> None:
    small = {"KVTRACE_MEMORY_LIMIT": "1K"}  # any pool looks too big for this machine
    log = tmp_path / "tiny.arrow"
    log.write_text("an older log")
    refused = runner.invoke(app, ["replay", "sample:tiny", "--out", str(log), "--force"], env=small)
    assert refused.exit_code == 2 and refused.stderr.strip().endswith("pass --ignore-memory-check to try anyway")
    assert log.read_text() == "an older log"
    built = runner.invoke(app, ["replay", "sample:tiny", "--out", str(log), "--force", "--ignore-memory-check"], env=small)
    assert built.exit_code == 0, built.output
    kept = runner.invoke(app, ["replay", "sample:tiny", "--out", str(log), "--ignore-memory-check"], env=small)
    assert kept.exit_code == 2 and "already exists; pass --force to overwrite it" in kept.stderr
    out = tmp_path / "t.kvtrace"
    recorded = runner.invoke(app, ["record", "sample:tiny", "-o", str(out), "--force", "-q"], env=small)
    assert recorded.exit_code == 2 and "pass --ignore-memory-check" in recorded.stderr and not out.exists()


@pytest.mark.slow
def test_the_dashboard_refuses_to_start_without_a_terminal(tmp_path: Path) -> None:
    """stdout a pipe: one line and exit 2, at once, instead of escape codes and a wait for keys."""
    log = tmp_path / "tiny.arrow"
    assert runner.invoke(app, ["replay", "sample:tiny", "--out", str(log), "-q"]).exit_code == 0
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for args, instead in ((["view", str(log)], "or --json for the summary"), (["replay", "sample:tiny", "--tui"], "or drop --tui")):
        result = subprocess.run([sys.executable, "-m", "kvtrace", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, text=True, env=env, cwd=ROOT, timeout=60)
        assert result.returncode == 2 and result.stdout == "", args
        [line] = result.stderr.strip().splitlines()
        assert line.startswith("kvtrace: error: the dashboard needs a terminal, and stdout is not one (a pipe or a file); "), line
        assert line.endswith(instead) and "--serve" in line, line


def test_the_look_closer_hint_repeats_the_options_that_change_the_replay() -> None:
    faulty = "tests/kvtrace/faulty_allocators.py:stale_row"
    what_if = ["--pool-tokens", "4000", "--page-size", "8"]
    first = runner.invoke(app, ["replay", "sample:tiny", "--allocator", faulty, *what_if, "--check", "every"])
    assert first.exit_code == 1
    hint = next(line for line in first.stdout.splitlines() if line.startswith("To look closer: "))
    command = hint.removeprefix("To look closer: ").removesuffix(" (-x stops at the first violation)").split()
    assert command[:2] == ["kvtrace", "replay"] and " ".join(what_if) in " ".join(command), hint
    again = runner.invoke(app, [*command[1:], "--json"])
    ran = json.loads(again.stdout)
    assert (ran["pool_tokens"], ran["page_size"]) == (4000, 8)
    expected = json.loads(runner.invoke(app, ["replay", "sample:tiny", "--allocator", faulty, *what_if, "--check",
                                              "every", "--json"]).stdout)["violations"][0]
    assert ran["violations"][0] == expected


def test_human_counts_have_plurals_and_thousands_separators() -> None:
    from rich.console import Console

    from kvtrace.replay.report import count, render_replay_summary

    assert [count(1, "page"), count(2, "page"), count(0, "page"), count(12031, "request")] == [
        "1 page", "2 pages", "0 pages", "12,031 requests"]
    assert count(1, "record batch", "record batches") == "1 record batch" and count(3, "batch", "batches") == "3 batches"
    result = runner.invoke(app, ["replay", "sample:tiny"])
    # sample:tiny's recorded prefix lengths came from another cache: the line says which hits differ
    assert "28 admissions; 24 recomputed prefix hits differ from the recorded ones; 880 tokens evicted" in result.stdout
    summary = json.loads(runner.invoke(app, ["replay", "sample:tiny", "--json"]).stdout)
    summary.update(peak_step=74020, duration_s=9557.0, admissions=1, evicted_tokens=1, prefix_differs_from_recorded=1,
                   num_violations=1, violations=[{"step": 12345, "rid": 3, "op": "decode", "check": "c", "detail": "d"}])
    console = Console(record=True, width=300)
    render_replay_summary(summary, console)
    text = console.export_text()
    for part in ("at step 74,020", "9,557.0 s of serving", "over 1 admission;", "1 recomputed prefix hit differs from the "
                 "recorded one;", "1 token evicted", "1 violation ", "--steps 12245:12346"):
        assert part in text, (part, text)


def test_one_warning_style(tmp_path: Path) -> None:
    from traces.samples import sample_path

    cut = tmp_path / "cut.kvtrace"
    cut.write_bytes(sample_path("tiny").read_bytes()[:-5000])
    outputs = [
        runner.invoke(app, ["info", str(cut)]).stderr,
        runner.invoke(app, ["replay", str(cut)]).stderr,
        runner.invoke(app, ["replay", "sample:tiny", "--steps", "100000:100010"]).stderr,
    ]
    for stderr in outputs:
        lines = [line for line in stderr.splitlines() if line]
        assert lines and all(line.startswith("kvtrace: warning: ") for line in lines), stderr


def test_no_hard_wrapping_into_a_pipe() -> None:
    result = runner.invoke(app, ["info", "sample:tiny"])  # CliRunner's stdout is not a terminal
    ops = "extend 158, decode 302, spec 124, prealloc 9, finish 26, retract 5, abort 6"
    assert any(ops in line for line in result.stdout.splitlines())  # one line, 80 columns or not
    assert max(len(line) for line in result.stdout.splitlines()) > 80


def _floats(value: Any) -> list[float]:
    if isinstance(value, float):
        return [value]
    if isinstance(value, dict):
        return [x for item in value.values() for x in _floats(item)]
    if isinstance(value, list):
        return [x for item in value for x in _floats(item)]
    return []


def test_json_numbers_are_rounded() -> None:
    assert ui.rounded({"a": [1 / 3, 2.0e-9 / 3, 1e7 / 3, float("nan")], "b": 7}) == {
        "a": [0.333333, 6.66667e-10, 3333333.333, None],
        "b": 7,
    }
    for command in (["info", "sample:tiny"], ["replay", "sample:tiny"], ["diff", "sample:tiny", "--b", "token", "--jobs", "1"]):
        result = runner.invoke(app, [*command, "--json"])
        floats = _floats(json.loads(result.stdout))
        assert floats and all(x == ui.rounded(x) for x in floats), command


def test_help_and_info_never_import_torch() -> None:
    """The start-up contract (bench/startup.py measures the time): torch only where an
    allocator runs; pandas (which pyarrow pulls in when it can) not at all; ``versions``
    imports none of numpy, pyarrow and torch."""
    versions = (
        "import sys\n"
        "import kvtrace.cli\n"
        "sys.argv = ['kvtrace', 'versions', '--json']\n"
        "try:\n"
        "    kvtrace.cli.main()\n"
        "except SystemExit as exc:\n"
        "    assert exc.code in (0, None), exc.code\n"
        "heavy = [m for m in ('torch', 'numpy', 'pyarrow', 'pandas') if m in sys.modules]\n"
        "assert not heavy, f'kvtrace versions imported {heavy}'\n"
    )
    result = subprocess.run([sys.executable, "-c", versions], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["versions"]
    code = (
        "import sys\n"
        "import kvtrace.cli\n"
        "assert 'torch' not in sys.modules, 'import kvtrace.cli imported torch'\n"
        "assert 'numpy' not in sys.modules and 'pyarrow' not in sys.modules, 'kvtrace.cli imported numpy or pyarrow'\n"
        "import allocator.base\n"
        "assert 'torch' not in sys.modules, 'allocator.base imported torch'\n"
        "sys.argv = ['kvtrace', 'info', 'sample:tiny', '--json']\n"
        "try:\n"
        "    kvtrace.cli.main()\n"
        "except SystemExit as exc:\n"
        "    assert exc.code in (0, None), exc.code\n"
        "heavy = [m for m in ('torch', 'triton', 'pandas', 'pydantic') if m in sys.modules]\n"
        "assert not heavy, f'kvtrace info imported {heavy}'\n"
        "others = sorted(m for m in sys.modules if m.startswith('kvtrace.cli.') and m.rsplit('.', 1)[1] in {'record', 'replay', 'diff', 'view', 'sweep', 'shrink'})\n"
        "assert not others, f'kvtrace info imported the modules of other commands: {others}'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["steps"] == 139


def test_command_modules_name_every_command_once() -> None:
    """``COMMAND_MODULES`` (what the console script imports for one command) names
    exactly the commands the modules register, so a lazily started command is the
    one the full app has."""
    from kvtrace.cli import COMMAND_MODULES, command_named

    registered = [info.name for info in app.registered_commands] + [group.name for group in app.registered_groups]
    assert sorted(registered) == sorted(COMMAND_MODULES)
    assert command_named(["-q", "--no-color", "replay", "x.kvtrace"]) == "replay"
    assert command_named(["--help"]) is None
    assert command_named(["--help", "replay"]) is None and command_named(["-q", "-h", "info"]) is None
    assert command_named(["replay", "--help"]) == "replay"
    # The root's help lists every command even when a command's name follows it.
    root_help = subprocess.run([sys.executable, "-m", "kvtrace", "--help", "replay"], capture_output=True, text=True,
                               cwd=ROOT, env={**os.environ, "COLUMNS": "100"})
    assert root_help.returncode == 0 and all(f" {name} " in root_help.stdout for name in COMMAND_MODULES), root_help.stdout
    assert command_named(["nosuch", "info"]) is None


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--pool-tokens", "1"], "kvtrace: error: --pool-tokens 1 is below two pages of 16 tokens; give --pool-tokens 32 or more"),
        (
            ["--page-size", "1000000"],
            "kvtrace: error: --page-size 1,000,000: two pages of 1,000,000 tokens do not fit the trace's pool of "
            "3,968 tokens; give a --page-size of at most 1,984 or a larger --pool-tokens",
        ),
    ],
)
def test_a_pool_below_two_pages_names_the_option(args: list[str], line: str) -> None:
    result = runner.invoke(app, ["replay", "sample:tiny", *args])
    assert result.exit_code == 2 and result.stderr.strip() == line
