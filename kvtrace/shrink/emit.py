"""The regression test ``kvtrace shrink --emit-test`` writes: a plain pytest module that
replays the shrunk trace (stored beside it) through the public API and asserts the
failure is gone, or with ``--expect-failure`` that it is still there.

The version under test is a constant at the top of the test (``builtin`` for a test
that the failure is gone, the failing version for one that it is still there); the
environment variable ``KVTRACE_REGRESS_ALLOCATOR`` replaces it for one run.

File names, version specs and the command line are the user's and may hold anything
(quotes, triple quotes, backslashes, newlines): in code they are ``repr`` literals
(``_literal``), in the docstring ``repr`` too, and the docstring as a whole is escaped
(``_docstring``), so the emitted module always compiles.
"""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtrace.shrink.shrinker import ShrinkResult

__all__ = ["ENV_VERSION", "emit_test", "function_name"]

ENV_VERSION = "KVTRACE_REGRESS_ALLOCATOR"

_HEADER = '''"""{doc}"""

from __future__ import annotations

import os
from pathlib import Path

'''

_VIOLATION = '''from kvtrace.replay.engine import ReplayOptions
from kvtrace.replay.session import ReplaySession

TRACE = Path(__file__).with_name({trace_file_q})
ALLOCATOR = os.environ.get({env_q}, {version_q})
CHECK = {check_q}  # the invariant check that broke{field_note}


def {name}() -> None:
    with ReplaySession(TRACE, version=ALLOCATOR, options=ReplayOptions(check="every"), checker="inline") as session:
        result = session.run()
    broken = [v for v in result.stats.violations if v.check == CHECK{field_test}]
{assertion}
'''

_OOM = '''from kvtrace.replay.engine import ReplayOptions
from kvtrace.replay.session import ReplaySession

TRACE = Path(__file__).with_name({trace_file_q})
ALLOCATOR = os.environ.get({env_q}, {version_q})
OP = {op_q}  # the op kind that ran out of KV slots


def {name}() -> None:
    options = ReplayOptions(check="never", on_oom="stop")
    with ReplaySession(TRACE, version=ALLOCATOR, options=options, checker="inline") as session:
        oom = session.run().stats.oom
{assertion}
'''

_DIVERGENCE = '''from kvtrace.diff.diff import DiffOptions, diff_trace

TRACE = Path(__file__).with_name({trace_file_q})
A = {a_q}
B = os.environ.get({env_q}, {version_q})
FIELD = {field_q}  # the first field that differed


def {name}() -> None:
    report = diff_trace(str(TRACE), A, B, options=DiffOptions(exact={exact}), jobs=1)
    first = report.first_divergence
{assertion}
'''

_ASSERT = {
    ("violation", False): '    assert not broken, f"{ALLOCATOR}: step {broken[0].step}, request {broken[0].rid}: '
                          '{broken[0].check}: {broken[0].detail}"',
    ("violation", True): '    assert broken, f"{ALLOCATOR}: no {CHECK} violation any more"',
    ("oom", False): '    assert oom is None or oom.op != OP, (\n'
                    '        f"{ALLOCATOR}: out of memory in {OP} at step {oom.step}, request {oom.rid}: "\n'
                    '        f"needed {oom.needed}, free {oom.free}, evictable {oom.evictable}"\n'
                    '    )',
    ("oom", True): '    assert oom is not None and oom.op == OP, f"{ALLOCATOR}: no out of memory in {OP} any more"',
    ("divergence", False): '    assert first is None, f"{A} and {B} diverge: " + " ".join(first.divergence.body(A, B))',
    ("divergence", True): '    assert first is not None and first.divergence.field == FIELD, (\n'
                          '        f"{A} and {B}: no divergence in {FIELD} any more"\n'
                          '    )',
}


def function_name(stem: str) -> str:
    """``test_double_free`` for a test file ``test_double_free.py`` (any stem: an
    identifier, every character that cannot be in one replaced by ``_``)."""
    name = "".join(c if f"_{c}".isidentifier() else "_" for c in stem)
    return name if name.startswith("test_") else f"test_{name}"


def _literal(text: str) -> str:
    """``repr(text)``, in double quotes where that needs no escape (the project's style)."""
    quoted = repr(text)
    return f'"{quoted[1:-1]}"' if "'" not in text and '"' not in text else quoted


def _docstring(text: str) -> str:
    """``text`` as the inside of a triple-quoted string that reads back as ``text``:
    backslashes, double quotes and unprintable characters (a carriage return, NUL, a
    lone surrogate) escaped; newlines kept."""
    return "".join(_escaped(c) for c in text)


def _escaped(c: str) -> str:
    if c == "\n":
        return c
    if c in '"\\':
        return "\\" + c
    return c if c.isprintable() else repr(c)[1:-1]


def emit_test(result: ShrinkResult, *, stem: str, trace_file: str, expect_failure: bool, command: str | None) -> str:
    """The source of the regression test for a shrink's result.

    Args:
        result: a shrink that found its failure.
        stem: the test file's name without ``.py`` (names the test function).
        trace_file: the name of the shrunk trace beside the test.
        expect_failure: assert the failure is still there (else: that it is gone).
        command: the command line that made it.
    """
    failure, oracle, after = result.failure, result.oracle, result.after
    assert failure is not None and after is not None
    sig = failure.signature
    kind = sig.kind
    found_with = f"{oracle.a!r} vs {oracle.b!r}" if kind == "divergence" else repr(oracle.allocator)
    failing = oracle.b if kind == "divergence" else oracle.allocator
    good = "builtin" if kind == "divergence" or oracle.baseline is None else oracle.baseline
    version = failing if expect_failure else good
    before = result.before
    how = {
        "violation": "replays it through ALLOCATOR with the invariants checked after every allocator call",
        "oom": "replays it through ALLOCATOR (stopping at an out-of-memory)",
        "divergence": "diffs versions A and B on it",
    }[kind]
    story = "\n\n".join(textwrap.fill(p, 88) for p in (
        f"{trace_file!r} (beside this file) holds {_count(after.requests, 'request')} in "
        f"{_count(after.steps, 'step')} ({_count(after.ops, 'op')}); it was shrunk from {str(result.trace)!r} "
        f"({before['requests']:,} requests, {before['steps']:,} steps, {before['ops']:,} ops), where {found_with} "
        f"showed at step {failure.step}: {failure.detail}.",
        f"The test {how} and asserts that {_claim(kind, sig.name, expect_failure)}. {ENV_VERSION} replaces "
        f"{'B' if kind == 'divergence' else 'ALLOCATOR'} for one run (kvtrace versions lists the versions).",
    ))
    doc = (f"Regression test: {sig.describe()}, on a trace shrunk by kvtrace shrink.\n\n{story}\n\n"
           f"Made by: {command or '(a library call)'}\n")
    header = _HEADER.format(doc=_docstring(doc))
    fields = {"trace_file_q": _literal(trace_file), "env_q": _literal(ENV_VERSION), "version_q": _literal(version),
              "name": function_name(stem), "assertion": _ASSERT[(kind, expect_failure)]}
    if kind == "violation":
        body = _VIOLATION.format(
            **fields, check_q=_literal(sig.name),
            field_note=(f" (counter {sig.field!r})" if sig.field else "") + (f" (pool {sig.pool!r})" if sig.pool else ""),
            field_test=(f" and v.detail.startswith({_literal(sig.field + ' ')})" if sig.field else "")
            + (f" and v.pool == {_literal(sig.pool)}" if sig.pool else ""),
        )
    elif kind == "oom":
        body = _OOM.format(**fields, op_q=_literal(sig.name))
    else:
        body = _DIVERGENCE.format(**fields, a_q=_literal(oracle.a), field_q=_literal(sig.name), exact=oracle.exact)
    return header + body


def _claim(kind: str, name: str, expect_failure: bool) -> str:
    if kind == "violation":
        return f"the {name} check {'still breaks' if expect_failure else 'holds'}"
    if kind == "oom":
        return f"it {'still runs' if expect_failure else 'never runs'} out of memory in {name}"
    return f"A and B {'still diverge first in ' + name if expect_failure else 'are identical'}"


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"
