"""The radix cache's eviction policy and namespaces where the replay is described: the
dashboard's header (live and ``kvtrace view LOG``), ``replay --json`` / ``record --json``
and the text summary. A default cache (LRU, no namespace) reads as it always did."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from kvtrace.cli import app as cli
from kvtrace.tui.widgets.header import ReplayHeader
from tests.helpers import TINY, at_step, live_app, log_app, settle
from tests.namespaced import NAMESPACE_OF, write_namespaced_trace

runner = CliRunner()
NUM_NAMESPACES = len({n for n in NAMESPACE_OF.values() if n is not None})


def _header(app) -> str:  # noqa: ANN001
    return app.main.query_one(ReplayHeader).content.plain


async def test_the_header_names_a_policy_and_namespaces_live(tmp_path: Path) -> None:
    trace = write_namespaced_trace(tmp_path / "ns.kvtrace")
    app = live_app(str(trace), eviction_policy="slru")
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("g", "3", "enter")
        await settle(pilot, at_step(3))
        line = _header(app).splitlines()[1]
        # next to the page size, shortened so that an 80-column header still shows them
        assert line.startswith(f"pool 1,024 · page 16 · slru · {NUM_NAMESPACES} ns "), line
    app = live_app(str(trace), eviction_policy="slru")
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.press("g", "3", "enter")
        await settle(pilot, at_step(3))
        line = _header(app).splitlines()[1]
        assert line.startswith(f"pool 1,024 tokens · page 16 · slru · {NUM_NAMESPACES} namespaces · 64 pages · "), line


async def test_a_default_caches_header_says_nothing_of_it() -> None:
    app = live_app(TINY)
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.press("g", "3", "enter")
        await settle(pilot, at_step(3))
        header = _header(app)
        assert "lru" not in header and "namespace" not in header, header


async def test_a_state_logs_header_names_its_policy_and_namespaces(tmp_path: Path) -> None:
    trace = write_namespaced_trace(tmp_path / "ns.kvtrace")
    log = tmp_path / "ns.log"
    result = runner.invoke(cli, ["replay", str(trace), "--eviction-policy", "lfu", "--out", str(log)])
    assert result.exit_code == 0, result.output
    app = log_app(log)
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.press("g", "3", "enter")
        await settle(pilot, at_step(3))
        assert f"page 16 · lfu · {NUM_NAMESPACES} namespaces · 64 pages" in _header(app), _header(app)


def test_replay_json_and_text_say_the_policy_and_namespaces(tmp_path: Path) -> None:
    trace = write_namespaced_trace(tmp_path / "ns.kvtrace")
    result = runner.invoke(cli, ["replay", str(trace), "--eviction-policy", "fifo", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert (summary["eviction_policy"], summary["namespaces"]) == ("fifo", NUM_NAMESPACES)
    text = runner.invoke(cli, ["replay", str(trace), "--eviction-policy", "fifo"])
    assert text.exit_code == 0, text.output
    assert f"fifo eviction, {NUM_NAMESPACES} namespaces; hit rate" in " ".join(text.stdout.split()), text.stdout
    # the default cache: the keys say so, the text is as before
    plain = json.loads(runner.invoke(cli, ["replay", TINY, "--json"]).stdout)
    assert (plain["eviction_policy"], plain["namespaces"]) == ("lru", 0)
    text = runner.invoke(cli, ["replay", TINY]).stdout
    assert "eviction" not in text and "namespace" not in text, text


def test_record_json_says_the_policy_and_namespaces(tmp_path: Path) -> None:
    out = tmp_path / "slru.kvtrace"
    result = runner.invoke(cli, ["record", "sample:tiny", "--eviction-policy", "slru", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    config = json.loads(result.stdout.strip().splitlines()[-1])["config"]
    assert (config["eviction_policy"], config["namespaces"]) == ("slru", 0)


async def test_the_dashboards_replay_process_replays_with_the_eviction_policy_asked(tmp_path: Path) -> None:
    # ``replay --tui --eviction-policy``: the job carries the policy and the replay process
    # (its own process, as the command runs it) replays with it: its header and its state log say so.
    import dataclasses

    from kvtrace.replay.engine import ReplayOptions
    from kvtrace.statelog.session import StateLogSession
    from kvtrace.tui.app import KvtraceApp
    from kvtrace.tui.remote.link import ChildReplay
    from kvtrace.tui.remote.replayer import dashboard_job
    from kvtrace.versions.registry import resolve_version

    trace = write_namespaced_trace(tmp_path / "ns.kvtrace")
    log = tmp_path / "run.log"
    job = dashboard_job(resolve_version("builtin"), str(trace), trace_label="ns", page_size=None, pool_tokens=None,
                        device="cpu", options=dataclasses.asdict(ReplayOptions()), play=False, log=str(log),
                        eviction_policy="fifo")
    assert job.side is not None and job.side.eviction_policy == "fifo"
    link = ChildReplay(dataclasses.replace(job, side=dataclasses.replace(job.side, checker="inline")))
    link.wait_started()
    app = KvtraceApp(link)
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.press("g", "3", "enter")
        await settle(pilot, at_step(3))
        assert " · fifo · " in _header(app), _header(app)
        await pilot.press("q")
    link.close()  # the replay process closes its state log
    with StateLogSession(str(log)) as logged:
        assert logged.info["config"]["eviction_policy"] == "fifo", logged.info


def test_replay_tui_takes_an_eviction_policy() -> None:
    # It was refused ("the dashboard replays with the trace's eviction policy"); now the one
    # complaint left under a test runner is that there is no terminal.
    result = runner.invoke(cli, ["replay", TINY, "--tui", "--eviction-policy", "lfu"])
    assert "eviction" not in result.output, result.output
    assert "terminal" in result.output, result.output
