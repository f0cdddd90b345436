"""The test ``kvtrace shrink --emit-test`` writes compiles and runs whatever the names
in it: the input trace, the test file, the trace beside it, the version spec and the
command line may hold quotes, triple quotes, backslashes and newlines."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from kvtrace.shrink import Oracle, ShrinkResult, Target, emit_test, shrink_trace
from kvtrace.shrink.emit import function_name
from traces.samples import resolve_trace

FAULTY = Path(__file__).with_name("faulty_allocators.py")

HOSTILE = [
    'triple"""quote',
    "single'''quote",
    'ends with a quote"',
    "back\\slash\\",
    "new\nline",
    "\\N{BULLET}\\u",  # escapes that would not parse inside a string literal
    "cr\rnul\x00tab\t",
    "ünïcødé²",
]


@pytest.fixture(scope="module")
def hostile_shrink(tmp_path_factory: pytest.TempPathFactory) -> tuple[ShrinkResult, Path]:
    """One real shrink (stopped as soon as the failure is found) of a trace whose file
    name and allocator path hold every hostile character the file system allows."""
    work = tmp_path_factory.mktemp("hostile")
    name = 'in"""put\\\'s\nname'
    trace = work / f"{name}.kvtrace"
    shutil.copyfile(resolve_trace("sample:tiny"), trace)
    allocator = work / f'faulty"""{name}.py'
    shutil.copyfile(FAULTY, allocator)
    oracle = Oracle(Target("violation"), allocator=f"{allocator}:stale_row")
    result = shrink_trace(str(trace), oracle, jobs=1, max_time=0)
    assert result.reproduced
    return result, work


@pytest.mark.parametrize("name", HOSTILE)
def test_an_emitted_test_with_a_hostile_name_compiles_and_keeps_the_names(
    hostile_shrink: tuple[ShrinkResult, Path], tmp_path: Path, name: str
) -> None:
    result, _ = hostile_shrink
    stem = f"test_{name}"
    trace_file = f"{name}.kvtrace"
    source = emit_test(result, stem=stem, trace_file=trace_file, expect_failure=True,
                       command=f"kvtrace shrink {name} --emit-test {stem}.py")
    code = compile(source, "<emitted test>", "exec")  # a SyntaxError here is the bug
    namespace: dict[str, object] = {"__file__": str(tmp_path / "test_x.py"), "__name__": "emitted"}
    exec(code, namespace)
    # The names read back exactly; the docstring tells the story with them in it.
    assert namespace["TRACE"] == tmp_path / trace_file
    assert str(namespace["ALLOCATOR"]).endswith(":stale_row")
    doc = str(namespace["__doc__"])
    assert repr(trace_file) in doc and f"kvtrace shrink {name} --emit-test" in doc
    assert callable(namespace[function_name(stem)]) and function_name(stem).isidentifier()


def test_the_emitted_test_runs_against_the_trace_beside_it(hostile_shrink: tuple[ShrinkResult, Path]) -> None:
    result, work = hostile_shrink
    folder = work / "regress"
    folder.mkdir()
    stem = 'test_a"""b\\c\nd'
    result.write(folder / f"{stem}.kvtrace")
    (folder / f"{stem}.py").write_text(
        emit_test(result, stem=stem, trace_file=f"{stem}.kvtrace", expect_failure=True, command=None), encoding="utf-8"
    )
    spec = importlib.util.spec_from_file_location("emitted_hostile", folder / f"{stem}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    getattr(module, function_name(stem))()  # the failure is still there: passes
