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


class _TestPathTakenAfterTheTrace:
    """A shrink result whose trace write then puts a directory where the test goes: the
    test can no longer be put in place (as a full disk would stop it being written)."""

    def __init__(self, result: ShrinkResult, test_path: Path) -> None:
        self._result = result
        self._test_path = test_path

    def write(self, path: Path) -> None:
        self._result.write(path)
        self._test_path.mkdir()

    def __getattr__(self, name: str) -> object:
        return getattr(self._result, name)


def test_emit_test_writes_the_trace_and_its_test_or_neither(
    hostile_shrink: tuple[ShrinkResult, Path], tmp_path: Path
) -> None:
    from kvtrace.cli.shrink import _test_outputs, _write_test
    from kvtrace.errors import OutputError

    result, _ = hostile_shrink
    test_path = tmp_path / "test_regress.py"
    files = _test_outputs(test_path, False, [])
    with pytest.raises(OutputError, match=r"--emit-test .*test_regress.py(: cannot write it| was created by another process)"):
        _write_test(_TestPathTakenAfterTheTrace(result, test_path), files, True, "kvtrace shrink ...")  # type: ignore[arg-type]
    assert not test_path.with_suffix(".kvtrace").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["test_regress.py"] and test_path.is_dir()  # no temporary left
    # Unhindered, both are written.
    test_path.rmdir()
    _write_test(result, files, True, "kvtrace shrink ...")
    assert test_path.is_file() and test_path.with_suffix(".kvtrace").is_file()
