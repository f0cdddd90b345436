"""The README's examples, and those of the reference pages in docs/, run, so that they cannot rot.

Every ```console / ```bash block of README.md and of each ``docs/*.md`` page is parsed into commands (``$ `` prompts and
``\\`` continuations in console blocks; every line of a bash block) and the output shown
under each. ``test_readme_example`` runs a block's commands in order in a temporary
directory (``kvtrace`` is this checkout's ``python -m kvtrace``; ``traces/``, ``bench/``
and ``tools/`` lead to the repository's), checks each exit code (0, or the one in
``EXIT_CODES``) and that the output shown is printed (``matches``). Files the README only
names (``broken.kvtrace``, a downloaded workload) are made by ``FIXTURES``. What cannot run
here is in ``SKIP_BLOCKS`` / ``SKIP_COMMANDS``, with the reason.

``test_readme_options_exist`` is the quick check: every ``--option`` the README or a docs page
gives a ``kvtrace`` command (in a block or in inline code) is one that command takes;
``test_doc_links_resolve`` checks that their relative links lead to a file (and heading) that exists.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The pages whose examples run: the README and the reference pages it sends readers to.
PAGES = (README, *sorted((ROOT / "docs").glob("*.md")))
REPO_DIRS = ("traces", "bench", "tools")  # reached from the temporary directory through links

# Whole blocks that cannot run here, by the start of their first command.
SKIP_BLOCKS: dict[str, str] = {
    "python3 -m venv .venv && .venv/bin/pip install": "installs packages (network); test_readme_ci checks it is what CI runs",
    ".venv/bin/python -m pytest -q": "the test suite itself",
    "$ python3 -m venv .venv": "installs packages (network)",
    "pip install 'kvtrace[ray]'": "needs a Ray cluster",
    "tools/sglang_oracle/setup.sh": "needs SGLang installed in its own environment",
    "REL=~/venvs/sglang-0.5.23/bin/python": "needs two SGLang installations",
    "$ kvtrace sweep sample:mooncake-conversation --hicache-ratio":
        "long: four replays of the one-hour sample (tests/kvtrace/test_sweep_hicache.py sweeps a small trace)",
    "pip install -e /path/to/kvtrace": "needs SGLang, a GPU and a model",
}
# Single commands that cannot run here, by their start.
SKIP_COMMANDS: dict[str, str] = {
    "kvtrace diff sample:tiny sample:mooncake-eagle --range f42b549..4a6c5f2":
        "long: 8 replays of mooncake-eagle (tests/kvtrace/test_history.py replays both ranges on sample:tiny)",
    "kvtrace diff sample:tiny sample:mooncake-eagle --range 4a6c5f2..42eca2a":
        "long: 8 replays of mooncake-eagle (tests/kvtrace/test_history.py replays both ranges on sample:tiny)",
    "kvtrace record sharegpt.csv --format lengths --rate 5 --duration 1h":
        "long: simulates an hour of arrivals at 5 a second (minutes; the other record examples run)",
    "python bench/fuzz.py --cases 100000": "a benchmark of hours (tests/fuzz runs 20 cases)",
    ".venv/bin/python bench/trace_io.py": "a benchmark (writes and reads 10M-op traces)",
}
# Commands whose documented exit code is not 0, by their start.
EXIT_CODES: dict[str, int] = {
    "kvtrace validate broken.kvtrace": 1,  # problems found
    "kvtrace diff sample:mooncake-eagle --a builtin --b pre-encapsulation": 1,  # diverged
    "kvtrace replay sample:mooncake-eagle --allocator pre-encapsulation": 1,  # invariant violations
}
# Table rows whose value differs run to run (wall-clock time).
VARYING_ROWS = ("time",)
# Table rows the README shows out of date, by (command start, row label): not compared until
# the README is brought up to date.
KNOWN_FAILURES: dict[tuple[str, str], str] = {}


def _broken_trace(path: Path) -> None:
    """The trace of README's ``kvtrace validate broken.kvtrace``: 4 steps, 2 requests, 5 rows
    and exactly the three problems it shows."""
    from tests.helpers import write_steps
    from tests.traces.test_validate import row, step

    write_steps(path, [
        step(0, row("extend", 0, 40, 40, prompt_len=40)),
        step(1, row("decode", 0, 42, 1), row("decode", 1, 1, 1)),  # 40 + 1 is not 42; 1 does not exist
        step(2, row("finish", 0, 42, 0)),
        step(3, row("decode", 0, 43, 1)),  # after its finish
    ])


def _gzip(source: str) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        with (ROOT / source).open("rb") as src, gzip.open(path, "wb") as out:
            shutil.copyfileobj(src, out)
    return make


def _copy(source: str) -> Callable[[Path], None]:
    return lambda path: shutil.copyfile(ROOT / source, path)


# Files the README's commands name but does not make: a stand-in of the same kind.
FIXTURES: dict[str, Callable[[Path], None]] = {
    "broken.kvtrace": _broken_trace,
    "run.kvtrace": _copy("traces/samples/tiny.kvtrace"),
    # The download a record example names: the bundled file of that format.
    "AzureLLMInferenceTrace_conv.csv.gz": _gzip("traces/workloads_data/azure-llm-inference-2023/AzureLLMInferenceTrace_code.csv"),
}


@dataclass(frozen=True, slots=True)
class Example:
    """One command of a README block and the output shown under it."""

    line: int  # README line of the command
    command: str
    output: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Block:
    """A ```console or ```bash block: its commands, run in order."""

    line: int  # page line of the opening fence
    examples: tuple[Example, ...]
    page: str = "README.md"  # the page, relative to the repository

    @property
    def skip_reason(self) -> str | None:
        first = self.examples[0].command if self.examples else ""
        return next((why for start, why in SKIP_BLOCKS.items() if first.startswith(start.removeprefix("$ "))), None)


def _join_continuations(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, text in lines:
        if pending is not None:
            pending = (pending[0], pending[1] + " " + text.strip())
        else:
            pending = (number, text)
        if pending[1].endswith("\\"):
            pending = (pending[0], pending[1][:-1].rstrip())
            continue
        out.append(pending)
        pending = None
    if pending is not None:
        out.append(pending)
    return out


def readme_blocks(text: str | None = None, page: Path = README) -> list[Block]:
    """The console and bash blocks of ``page`` (README.md), or of ``text``, parsed."""
    lines = (page.read_text() if text is None else text).splitlines()
    name = page.relative_to(ROOT).as_posix()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        fence = re.fullmatch(r"```(console|bash)\s*", lines[i])
        if not fence:
            i += 1
            continue
        start = i + 1
        body: list[tuple[int, str]] = []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append((i + 1, lines[i]))
            i += 1
        i += 1
        examples: list[Example] = []
        if fence.group(1) == "bash":
            for number, command in _join_continuations([(n, t) for n, t in body if t.strip()]):
                if not command.lstrip().startswith("#"):
                    examples.append(Example(number, command.strip(), ()))
        else:
            current: tuple[int, list[str]] | None = None
            output: list[str] = []
            for number, text in body:
                if text.startswith("$ ") or (current is not None and current[1][-1].endswith("\\") and not output):
                    if text.startswith("$ ") and current is not None:
                        examples.append(_console_example(current, output))
                        output = []
                    if text.startswith("$ "):
                        current = (number, [text[2:]])
                    else:
                        current[1].append(text.strip())  # type: ignore[index]
                elif current is not None:
                    output.append(text)
            if current is not None:
                examples.append(_console_example(current, output))
        blocks.append(Block(start, tuple(examples), name))
    return blocks


def _console_example(current: tuple[int, list[str]], output: list[str]) -> Example:
    command = " ".join(part.removesuffix("\\").strip() for part in current[1])
    return Example(current[0], command, tuple(output))


def _start_match(table: dict[str, object], command: str) -> object | None:
    return next((value for start, value in table.items() if command.startswith(start)), None)


# ---------------------------------------------------------------------------------------
# Output matching: the key lines shown, not the bytes (widths, paths and times differ).

_SECONDS = re.compile(r"\d[\d,]*(?:\.\d+)? s\b")


def _norm(line: str) -> str:
    return " ".join(_SECONDS.sub("<s>", line).split())


def _table_rows(lines: list[str] | tuple[str, ...]) -> dict[str, str]:
    """The rows of a box table (``│ label │ value │``), wrapped values joined."""
    rows: dict[str, str] = {}
    label = None
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("│").split("│")] if line.lstrip().startswith("│") else None
        if not cells or len(cells) != 2:
            continue
        if cells[0]:
            label = cells[0]
            rows[label] = cells[1]
        elif label is not None:
            rows[label] = f"{rows[label]} {cells[1]}".strip()
    return rows


def _line_pattern(expected: str) -> re.Pattern[str]:
    """``...`` in a shown line stands for anything."""
    return re.compile(".*?".join(re.escape(part) for part in _norm(expected).split("...")))


def _json_mismatches(expected: str, actual_lines: list[str]) -> list[str]:
    """A shown JSON object (elided with ``...``): each ``"key": value`` it shows is printed."""
    printed = next((ln for ln in actual_lines if ln.startswith("{")), None)
    if printed is None:
        return [f"no JSON object printed; expected {expected}"]
    json.loads(printed)
    missing = []
    for pair in re.findall(r'"\w+": (?:"[^"]*"|[^,\]}]+)', expected):
        shown = pair.split(" ...", 1)[0] if '"' in pair.split(": ", 1)[1] else pair
        if shown not in printed:
            missing.append(pair)
    return [f"JSON lacks {m}" for m in missing]


def mismatches(expected: tuple[str, ...], actual: str, ignored_rows: tuple[str, ...] = ()) -> list[str]:
    """What of the ``expected`` output (as the README shows it) ``actual`` does not print:
    a box table's rows by label (but ``VARYING_ROWS`` and ``ignored_rows``), a JSON object's
    pairs, and every other line, in order (whitespace and durations in seconds aside, ``...``
    as a wildcard)."""
    actual_lines = actual.splitlines()
    problems: list[str] = []
    want_rows = _table_rows(expected)
    got_rows = _table_rows(actual_lines)
    for label, value in want_rows.items():
        if label in VARYING_ROWS or label in ignored_rows:
            continue
        if label not in got_rows:
            problems.append(f"no table row {label!r}")
        elif not _line_pattern(value).fullmatch(_norm(got_rows[label])):
            problems.append(f"row {label!r}: README {value!r}, printed {got_rows[label]!r}")
    normalised = [_norm(line) for line in actual_lines]
    at = 0
    for line in expected:
        stripped = line.strip()
        if not stripped or stripped[0] in "│┌└├┏┃┡┗":  # box tables: rows compared above
            continue
        if stripped.startswith("{"):
            problems.extend(_json_mismatches(stripped, actual_lines))
            continue
        pattern = _line_pattern(stripped)
        found = next((k for k in range(at, len(normalised)) if pattern.fullmatch(normalised[k])), None)
        if found is None:
            problems.append(f"not printed (in order): {stripped!r}")
        else:
            at = found + 1
    return problems


# ---------------------------------------------------------------------------------------
# Running a block.


def _workdir(tmp_path: Path, commands: list[str]) -> dict[str, str]:
    """Set ``tmp_path`` up for ``commands`` and return their environment."""
    bin_dir = tmp_path / ".bin"
    bin_dir.mkdir()
    wrappers = {"kvtrace": f'exec "{sys.executable}" -m kvtrace "$@"', "python": f'exec "{sys.executable}" "$@"',
                "python3": f'exec "{sys.executable}" "$@"'}
    for name, body in wrappers.items():
        script = bin_dir / name
        script.write_text(f"#!/bin/sh\n{body}\n")
        script.chmod(0o755)
    for name in REPO_DIRS:
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / "tests" / "regress").mkdir(parents=True)  # where the shrink example writes its test
    for name, make in FIXTURES.items():
        if any(re.search(rf"(^|\s){re.escape(name)}(\s|$)", c) for c in commands):
            make(tmp_path / name)
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(ROOT)
    env["COLUMNS"] = "200"
    env.pop("FORCE_COLOR", None)
    env["NO_COLOR"] = "1"
    return env


def _block_id(block: Block) -> str:
    return f"{block.page}:line{block.line}"


BLOCKS = [block for page in PAGES for block in readme_blocks(page=page)]


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[_block_id(b) for b in BLOCKS])
def test_readme_example(block: Block, tmp_path: Path) -> None:
    if block.skip_reason:
        pytest.skip(block.skip_reason)
    runnable = [ex for ex in block.examples if _start_match(SKIP_COMMANDS, ex.command) is None]
    if not runnable:
        pytest.skip("; ".join(str(_start_match(SKIP_COMMANDS, ex.command)) for ex in block.examples))
    env = _workdir(tmp_path, [ex.command for ex in runnable])
    for ex in runnable:
        done = subprocess.run(["bash", "-c", f"set -o pipefail; {ex.command}"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
        wanted = _start_match(EXIT_CODES, ex.command) or 0
        assert done.returncode == wanted, (
            f"{block.page} line {ex.line}: `{ex.command}` exited {done.returncode}, not {wanted}:\n"
            f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        )
        known = tuple(label for (start, label) in KNOWN_FAILURES if ex.command.startswith(start))
        problems = mismatches(ex.output, done.stdout, known)
        assert not problems, f"{block.page} line {ex.line}: `{ex.command}`:\n" + "\n".join(problems) + f"\n---\n{done.stdout}"


# ---------------------------------------------------------------------------------------
# The quick checks: the options the README and the docs pages name exist; their links resolve.

_INLINE = re.compile(r"`(kvtrace [^`]+)`")


def readme_commands(text: str | None = None, page: Path = README) -> list[tuple[int, str]]:
    """Every ``kvtrace ...`` command ``page`` (README.md) shows: in its blocks and in inline code."""
    text = page.read_text() if text is None else text
    found = [(ex.line, ex.command) for block in readme_blocks(text, page) for ex in block.examples]
    for match in _INLINE.finditer(text):
        found.append((text.count("\n", 0, match.start()) + 1, " ".join(match.group(1).split())))
    out = []
    for line, command in found:
        # A pipeline or a chain: each part that runs kvtrace.
        for part in re.split(r"\|\||&&|\||;", command):
            words = part.split()
            if "kvtrace" in words:
                out.append((line, " ".join(words[words.index("kvtrace"):])))
    return out


def _options_of(words: list[str]) -> tuple[str, set[str]] | None:
    """The command ``kvtrace WORDS...`` names and the options it (and the root) takes; None
    where it names no command."""
    import typer

    from kvtrace.cli import app

    root = typer.main.get_command(app)  # a group (typer's own click: duck-typed here)
    known = {opt for p in root.params for opt in p.opts} | {"--help", "--debug"}
    command = root
    path = []
    rest = [w for w in words[1:] if not w.startswith("-")]
    while hasattr(command, "commands"):
        name = rest.pop(0) if rest and rest[0] in command.commands else None
        if name is None:
            default = getattr(command, "default_command", None) or ("run" if "run" in command.commands else None)
            if default is None or command is root:
                return None
            name = default
        command = command.commands[name]
        path.append(name)
    known |= {opt for p in command.params if not getattr(p, "hidden", False) for opt in (*p.opts, *p.secondary_opts)}
    return " ".join(path), known


def unknown_options(text: str | None = None, page: Path = README) -> tuple[int, list[str]]:
    """How many ``kvtrace`` commands ``page`` (README.md, or ``text``) shows, and each option it
    gives one of them that the command does not take."""
    unknown = []
    checked = 0
    label = "README" if page == README else page.relative_to(ROOT).as_posix()
    for line, command in readme_commands(text, page):
        words = command.split()
        resolved = _options_of(words)
        if resolved is None:
            continue
        name, known = resolved
        checked += 1
        for word in words:
            option = word.split("=", 1)[0].rstrip(",.;:)]")
            if re.fullmatch(r"--[a-z][a-z0-9-]*", option) and option not in known:
                unknown.append(f"{label} line {line}: kvtrace {name} has no {option} ({command})")
    return checked, unknown


@pytest.mark.slow
def test_readme_options_exist() -> None:
    counts = {page.name: unknown_options(page=page) for page in PAGES}
    assert counts["README.md"][0] > 10, f"only {counts['README.md'][0]} kvtrace commands found in README.md"
    assert sum(checked for checked, _ in counts.values()) > 60, counts
    unknown = [u for _, found in counts.values() for u in found]
    assert not unknown, "\n".join(unknown)


_LINK = re.compile(r"\]\(([^()\s]+)\)")


def _anchors(text: str) -> set[str]:
    """The anchors GitHub gives ``text``'s headings (outside code blocks)."""
    anchors: set[str] = set()
    fenced = False
    for line in text.splitlines():
        if line.startswith("```") and (not fenced or line.rstrip() == "```"):
            fenced = not fenced  # a fence closes only with a bare ```
        elif not fenced and (heading := re.match(r"#{1,6} (.+)", line)):
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            n, candidate = 0, slug
            while candidate in anchors:
                n += 1
                candidate = f"{slug}-{n}"
            anchors.add(candidate)
    return anchors


def broken_links(text: str, page: Path) -> list[str]:
    """Each relative link of ``text`` (written at ``page``) whose file, or heading, does not exist."""
    broken = []
    for match in _LINK.finditer(text):
        target = match.group(1)
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        line = text.count("\n", 0, match.start()) + 1
        if not resolved.exists():
            broken.append(f"{page.name} line {line}: {target} (no {resolved})")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(
                text if resolved == page else resolved.read_text()):
            broken.append(f"{page.name} line {line}: {target} (no heading #{anchor})")
    return broken


def test_doc_links_resolve() -> None:
    broken = [b for page in PAGES for b in broken_links(page.read_text(), page)]
    assert not broken, "\n".join(broken)


def test_a_broken_link_is_found() -> None:
    text = "# Top\n## `kvtrace diff TRACE --a A`\n[ok](#kvtrace-diff-trace---a-a) [me](README.md#top)\n" \
           "[gone](docs/nosuch.md) [no heading](#nosuch) [web](https://example.com/x)\n"
    page = ROOT / "README.md"
    assert [b.split(" (")[0] for b in broken_links(text, page)] == [
        "README.md line 4: docs/nosuch.md", "README.md line 4: #nosuch",
    ]


def test_the_parser_reads_console_and_bash_blocks() -> None:
    text = "\n".join([
        "```console", "$ kvtrace info a \\", "    --json", '{"ok": true}', "$ kvtrace validate b", "ok", "```",
        "```bash", "kvtrace record w.jsonl \\", "    --out x.kvtrace   # a comment", "# only a comment", "```",
        "```python", "kvtrace nothing", "```",
    ])
    blocks = readme_blocks(text)
    assert [b.line for b in blocks] == [1, 8]
    assert [(e.command, e.output) for e in blocks[0].examples] == [
        ("kvtrace info a --json", ('{"ok": true}',)), ("kvtrace validate b", ("ok",)),
    ]
    assert [e.command for e in blocks[1].examples] == ["kvtrace record w.jsonl --out x.kvtrace   # a comment"]


def test_the_matcher_reads_tables_json_and_wildcards() -> None:
    shown = ("kvtrace info: .../tiny.kvtrace", "│ steps   │ 139 (0..138) │", "│ time    │ wall 1.0 s   │",
             '{"ok": false, "problems": [{"problem": "seq_len 42 inconsistent ..."}], ...}', "took 3.2 s")
    printed = "\n".join(["kvtrace info: /x/tiny.kvtrace", "│ steps │ 139 │", "│       │ (0..138) │",
                         "│ time │ wall 9.9 s │", '{"path": "p", "ok": false, "problems": [{"problem": '
                         '"seq_len 42 inconsistent with decode"}]}', "took 12.5 s"])
    assert mismatches(shown, printed) == []
    assert mismatches(shown, printed.replace("139", "140")) != []
    assert mismatches(shown, printed.replace('"ok": false', '"ok": true')) != []
    assert mismatches(shown, printed.replace("took", "spent")) != []


def test_an_option_a_command_does_not_take_is_found() -> None:
    text = "Run `kvtrace replay sample:tiny --pool-tokens 4k --no-such-option`, then\n```bash\nkvtrace sweep x --jobs 2 --tui\n```\n"
    checked, unknown = unknown_options(text)
    assert checked == 2
    assert [u.split(" (")[0] for u in unknown] == [
        "README line 3: kvtrace sweep run has no --tui", "README line 1: kvtrace replay has no --no-such-option",
    ]
