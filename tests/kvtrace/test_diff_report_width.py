"""``kvtrace diff``'s text report on an 80-column terminal: the lines that name each side
(its version and where its code comes from) and a hybrid divergence's per-pool lines
(each side's counters) wrap under themselves instead of running past the edge (the
terminal then broke them at column 80, the rest starting at column 0). Into a pipe the
report never wraps, as before."""

from __future__ import annotations

import io
import json

from rich.console import Console
from typer.testing import CliRunner

from kvtrace.cli import app
from kvtrace.replay.report import render_diff_report

SWA_SAMPLE = "sample:mooncake-gpt-oss"
LONG_ORIGIN = "the working tree of /home/someone/src/kvtrace-checkouts/feature-branch: " \
              "/home/someone/src/kvtrace-checkouts/feature-branch/allocator sha256:27249f7c0494"


def _report() -> dict:
    """A diff of the SWA sample at two page sizes (it diverges at step 0, in both pools)."""
    result = CliRunner().invoke(app, ["diff", SWA_SAMPLE, "--steps", "0:2", "--b", "paged:1", "--json"])
    assert result.exit_code == 1, result.output
    return json.loads(result.stdout)


def _rendered(report: dict, width: int) -> list[str]:
    out = io.StringIO()
    render_diff_report(report, Console(file=out, width=width, no_color=True, color_system=None))
    return out.getvalue().splitlines()


def test_the_side_and_pool_lines_fit_80_columns_and_lose_nothing() -> None:
    report = _report()
    report["versions"]["b"]["origin"] = LONG_ORIGIN
    divergence = report["divergences"][0]
    pools = divergence["pools"]
    assert set(pools) == {"full", "swa"}
    # every counter differs in the full pool, none in the swa pool (the identical line)
    full = pools["full"]
    full["b"] = {k: v + 1_000_000 for k, v in full["a"].items()}
    full["differs"] = [k for k in full["a"] if k != "pool_tokens"]
    pools["swa"]["b"], pools["swa"]["differs"] = dict(pools["swa"]["a"]), []
    divergence["pool"] = "full"
    lines = _rendered(report, 80)
    assert max(map(len, lines)) <= 80, "\n".join(line for line in lines if len(line) > 80)
    # the side line: B's spec, then where its code comes from on indented lines
    at = next(i for i, line in enumerate(lines) if line.startswith("  B  paged:1"))
    end = next(i for i in range(at + 1, len(lines)) if not lines[i].startswith("     "))
    assert end > at + 1, lines[at:at + 2]
    assert " ".join(" ".join(lines[at:end]).split()) == f"B paged:1 {LONG_ORIGIN}", lines[at:end]
    # the full pool's line goes on under its first counter, each "A / B" pair whole
    at = next(i for i, line in enumerate(lines) if line.startswith("    full  differs (A / B): "))
    column = len("    full  differs (A / B): ")
    more = [line for line in lines[at + 1:] if line.startswith(" " * column) and line[column] != " "]
    assert more, lines[at:]
    text = " ".join(line.strip() for line in [lines[at], *more])
    for k in full["differs"]:
        assert f"{k} {full['a'][k]:,} / {full['b'][k]:,}" in text, (k, text)
    swa = next(i for i, line in enumerate(lines) if line.startswith("    swa   identical: "))
    assert lines[swa + 1].startswith("                     ") and "of " in lines[swa + 1], lines[swa:swa + 2]


def test_into_a_pipe_the_report_keeps_one_line_per_side() -> None:
    report = _report()
    report["versions"]["b"]["origin"] = LONG_ORIGIN
    lines = _rendered(report, 10_000)
    assert f"  B  paged:1  {LONG_ORIGIN}" in lines
    assert any(line.startswith("    full  differs (A / B): available ") for line in lines)
