"""Parity of kvtrace's SWA allocator with SGLang 0.5.23's real SWA classes, step by step.

Hybrid sliding-window models with the radix cache off (``scenarios.SWA_CONFIGS``: pages
1, 16 and 64, spec off and EAGLE 3,1,4, PD decode with the SWA tail, the overlap
scheduler's chunk rule, an SWA pool as large as the full one): per step, besides the full pool's state, the SWA pool's free
list in order and available size, and per request ``swa_evicted_seqlen`` and the SWA
slot of every row position (``scenario.SWA_STATE_FIELDS``). The SGLang side runs
``SWATokenToKVPoolAllocator``, ``UnifiedRadixCache(FULL, SWA)`` disabled and the real
``maybe_evict_swa`` (``kvtrace/sglang/world.py``, decision 11).

With the radix cache on (``scenarios.SWA_RADIX_CONFIGS``: pages 1, 16 and 64, spec off
and EAGLE 3,1,4, PD decode, shared prefixes and small pools) the SGLang side runs
``UnifiedRadixCache(FULL, SWA)`` enabled, ours ``allocator.swa_radix.SwaRadixCache``, and
each step also compares the tree's SWA evictable / protected sizes, its shape (FULL
value, lock and access-time rank per node) and each node's SWA side (slots or
tombstone, SWA lock: ``scenario.SWA_RADIX_STATE_FIELDS``).

Skipped unless ``KVTRACE_SGLANG_PYTHON`` names the interpreter of a venv made by
``tools/sglang_oracle/setup.sh``. ``KVTRACE_DIFF_SEEDS`` (default 3) seeds per configuration.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtrace.sglang import runner, scenario as sc
from tests.differential import compare, harness, ours_driver, scenarios as gen

NUM_SEEDS = int(os.environ.get("KVTRACE_DIFF_SEEDS", "3"))
SCENARIOS: list[sc.Scenario] = gen.random_scenarios(range(NUM_SEEDS), gen.SWA_CONFIGS)
RADIX_SCENARIOS: list[sc.Scenario] = gen.random_scenarios(range(NUM_SEEDS), gen.SWA_RADIX_CONFIGS)


@pytest.fixture(scope="module")
def parity() -> compare.Summary:
    python = harness.require_sglang()
    summary, _times = harness.differential(SCENARIOS + RADIX_SCENARIOS, python)
    return summary


def _assert_identical(parity: compare.Summary, scenarios: list[sc.Scenario], name: str) -> None:
    result = next(r for r in parity.results if r.scenario == name)
    assert result.status == "identical", (
        result.divergence.render() if result.divergence else f"{result.status}: {result.note}"
    )
    assert result.steps_compared == len(next(s for s in scenarios if s.name == name).steps)


@pytest.mark.slow
@pytest.mark.parametrize("name", [s.name for s in SCENARIOS])
def test_swa_identical_to_sglang(parity: compare.Summary, name: str) -> None:
    _assert_identical(parity, SCENARIOS, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [s.name for s in RADIX_SCENARIOS])
def test_swa_radix_identical_to_sglang(parity: compare.Summary, name: str) -> None:
    _assert_identical(parity, RADIX_SCENARIOS, name)


def test_swa_configurations_cover_pages_spec_and_pd() -> None:
    configs = [s.config for s in SCENARIOS]
    assert all(c.swa is not None and not c.radix_cache for c in configs)
    for ps in (1, 16, 64):
        assert any(c.page_size == ps and c.spec is None for c in configs), ps
    for ps in (1, 16, 64):
        assert any(c.page_size == ps and c.spec == gen.EAGLE_314 for c in configs), ps
    pd = [s for s in SCENARIOS if any(o.op == "prealloc" for st in s.steps for o in st.ops)]
    assert {s.config.page_size for s in pd} >= {16, 64}
    assert any(c.swa.overlap_chunked_prefill for c in configs)  # the overlap scheduler's chunk rule


def test_swa_scenarios_free_windows_and_run_short_of_each_pool() -> None:
    """Ours alone (no SGLang): the scenarios exercise what the parity is about, window
    frees and out-of-memory calls; a config round-trips through the scenario file."""
    out = io.StringIO()
    assert ours_driver.run_scenarios(SCENARIOS[: len(gen.SWA_CONFIGS)], out) == 0
    dumps = [json.loads(line) for line in out.getvalue().splitlines()]
    assert max(q[1] for d in dumps for q in d.get("swa_reqs", ())) > 0
    ooms = sum(1 for d in dumps for e in d.get("events", ()) if e.get("outcome") == "oom")
    assert ooms > 0
    cfg = SCENARIOS[0].config
    assert sc.ScenarioConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert "swa" not in sc.ScenarioConfig(pool_tokens=64).to_dict()


def test_swa_radix_configurations_cover_pages_and_spec() -> None:
    configs = [s.config for s in RADIX_SCENARIOS]
    assert all(c.swa is not None and c.radix_cache for c in configs)
    for ps in (1, 16, 64):
        assert any(c.page_size == ps and c.spec is None for c in configs), ps
        assert any(c.page_size == ps and c.spec == gen.EAGLE_314 for c in configs), ps
    pd = [s for s in RADIX_SCENARIOS if any(o.op == "prealloc" for st in s.steps for o in st.ops)]
    assert {s.config.page_size for s in pd} == {1, 16, 64}


def test_swa_radix_scenarios_reach_every_tree_path() -> None:
    """Ours alone (no SGLang): the radix scenarios are not vacuous. At every page size
    they match cached prefixes, gate matches on the window, tombstone, delete SWA-only
    leaves, recover tombstones on insert, evict both pools and run out of memory; the
    locked recoveries and window splits happen at least somewhere."""
    factory, base = ours_driver.load_factory("allocator")
    totals: dict[int, dict[str, int]] = {}
    for scen in RADIX_SCENARIOS[:: NUM_SEEDS]:  # one seed per configuration
        eng = ours_driver.OursEngine(scen.config, factory, base)
        seen = {"hits": 0, "ooms": 0}

        def sink(d: dict) -> None:
            seen["hits"] += sum(1 for r in d.get("reqs", ()) if r[4] > 0)
            seen["ooms"] += sum(1 for e in d.get("events", ()) if e.get("outcome") == "oom")

        runner.run_scenario(scen, eng, sink)
        tree = eng.alloc.tree_cache
        got = totals.setdefault(scen.config.page_size, dict.fromkeys(tree.stats, 0) | {"hits": 0, "ooms": 0,
                                                                                     "evicted": 0, "swa_evicted": 0})
        for k, v in (tree.stats | seen).items():
            got[k] += v
        got["evicted"] += tree.evicted_tokens_total
        got["swa_evicted"] += tree.swa_evicted_tokens_total
    for ps, got in totals.items():
        for k in ("hits", "ooms", "gated_match", "tombstoned", "swa_leaf_deleted", "recovered", "evicted", "swa_evicted"):
            assert got[k] > 0, (ps, k, got)
    assert sum(t["recovered_locked"] for t in totals.values()) > 0, totals
    assert sum(t["window_split"] for t in totals.values()) > 0, totals


def test_swa_pd_scenarios_take_sglangs_prealloc_path_run_short_and_reclaim() -> None:
    """Ours alone (no SGLang): the PD scenarios the parity above compares are not
    vacuous. SGLang's ``_uses_swa_tail_prealloc`` (page > 1) allocates only the SWA
    tail, so a request fresh from prealloc has ``swa_evicted_seqlen > 0`` once its
    fill exceeds window + page; at page 1 it takes the fallback (the SWA pool at full
    length, cursor 0); radix cache off, as with it on the checkpoint that follows
    the prealloc moves the cursor too. Preallocs run out of memory at every page size,
    and with the decode radix cache at page > 1 some prealloc evicts SWA from the tree
    (``_reclaim_swa_tail_capacity``)."""
    factory, base = ours_driver.load_factory("allocator")
    pd = [s for s in SCENARIOS + RADIX_SCENARIOS if any(o.op == "prealloc" for st in s.steps for o in st.ops)]
    seen: dict[tuple[int, bool], dict[str, int]] = {}
    for scen in pd:
        cfg = scen.config
        got = seen.setdefault((cfg.page_size, cfg.radix_cache), {"tail": 0, "full": 0, "oom": 0, "reclaim": 0})
        eng = ours_driver.OursEngine(cfg, factory, base)
        fills = {(st.step, o.rid): o.seq_len for st in scen.steps for o in st.ops if o.op == "prealloc"}
        window = cfg.swa.window
        # the shortest fill whose tail starts past position 0 (decode.py _swa_tail_len)
        first_tail = 1 + max(window, cfg.page_size) + cfg.page_size if cfg.radix_cache else window + cfg.page_size
        prealloc = eng.prealloc

        def observed(rids, fill_lens, token_ids, prompt_lens, got=got, eng=eng, prealloc=prealloc):
            tree = eng.alloc.tree_cache
            before = getattr(tree, "swa_evicted_tokens_total", 0)
            res = prealloc(rids, fill_lens, token_ids, prompt_lens)
            got["reclaim"] += res.outcome == "ok" and getattr(tree, "swa_evicted_tokens_total", 0) > before
            return res

        eng.prealloc = observed

        def sink(d: dict, got=got, first_tail=first_tail, fills=fills) -> None:
            if d.get("phase") != "prealloc":
                return
            ev = d["events"][0]
            got["oom"] += ev["outcome"] == "oom"
            if ev["outcome"] != "ok":
                return
            cursor = {q[0]: q[1] for q in d["swa_reqs"]}
            for rid in ev["rids"]:
                if fills[(d["step"], rid)] >= first_tail:
                    got["tail" if cursor[rid] > 0 else "full"] += 1

        runner.run_scenario(scen, eng, sink, fine=True)
    assert {ps for ps, _ in seen} == {1, 16, 64}
    for (ps, radix), got in seen.items():
        assert got["oom"] > 0, (ps, radix, got)
        if radix:  # the checkpoint after the prealloc frees out of the window at once
            continue
        if ps == 1:
            assert got["tail"] == 0 and got["full"] > 0, (ps, radix, got)
        else:
            assert got["full"] == 0 and got["tail"] > 0, (ps, radix, got)
    assert all(got["reclaim"] > 0 for (ps, radix), got in seen.items() if radix and ps > 1), seen


def test_swa_dflash_is_in_both_parity_sets() -> None:
    """DFLASH on an SWA model is compared with SGLang's own DFlashDraftInputV2
    prepare (kvtrace/sglang/world.py decision 6f): radix cache off (page 1, PD at
    page 16) and on (page 64)."""
    for scens in (SCENARIOS, RADIX_SCENARIOS):
        assert any(s.config.spec == gen.DFLASH_8 for s in scens)
    assert {s.config.page_size for s in SCENARIOS + RADIX_SCENARIOS if s.config.spec == gen.DFLASH_8} == {1, 16, 64}


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_a_dflash_swa_trace_diffs_identical_against_sglang(tmp_path: Path, page_size: int) -> None:
    """A trace recorded with DFlash on the gpt-oss-20b preset (window 128, radix cache
    on), replayed by SGLang's own classes and ours: ``kvtrace diff --exact``."""
    python = harness.require_sglang()
    trace = tmp_path / "dflash.kvtrace"
    cli = [sys.executable, "-m", "kvtrace"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    rec = subprocess.run([*cli, "record", "sample:tiny", "--model", "gpt-oss-20b", "--spec", "dflash:1,1,8",
                          "--page-size", str(page_size), "--chunk", "256", "--pool-tokens", "8000", "-o", str(trace), "-q"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert rec.returncode == 0, rec.stderr
    out = subprocess.run([*cli, "diff", str(trace), "--a", f"sglang:{python}", "--b", "builtin", "--exact",
                          "--json", "-q"], capture_output=True, text=True, env=env, timeout=1200)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["identical"] and report["steps_compared"] > 0, report.get("first_divergence")
    assert report["b"]["pools"]["swa"]["peak_used_tokens"] < report["b"]["pools"]["full"]["peak_used_tokens"]


def test_a_draft_swa_window_is_in_both_parity_sets() -> None:
    """A draft reading further back than the model's window (SGLang's
    draft_swa_window: swa_retain_window is the larger) is compared with SGLang, radix
    cache off (page 1 EAGLE, PD at page 16) and on (PD at page 16); the scenario file
    keeps the field and leaves it out when 0."""
    for scens in (SCENARIOS, RADIX_SCENARIOS):
        drafted = [s for s in scens if s.config.swa.draft_window > s.config.swa.window]
        assert drafted and any(o.op == "prealloc" for s in drafted for st in s.steps for o in st.ops)
        cfg = drafted[0].config
        assert sc.ScenarioConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    plain = next(s.config for s in SCENARIOS if not s.config.swa.draft_window)
    assert "draft_window" not in plain.to_dict()["swa"]


@pytest.mark.slow
@pytest.mark.parametrize("radix_cache", [False, True])
def test_a_trace_with_a_draft_swa_window_diffs_identical_against_sglang(tmp_path: Path, radix_cache: bool) -> None:
    """sample:tiny as served by an SWA model whose draft reads 200 tokens back (window
    128): the trace's attention.draft_sliding_window reaches both sides
    (``kvtrace diff --exact``), and the window frees keep the larger window."""
    from tests.kvtrace.test_swa_replay import swa_tiny

    python = harness.require_sglang()
    trace = swa_tiny(tmp_path, radix_cache=radix_cache, draft_sliding_window=200)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-m", "kvtrace", "diff", str(trace), "--a", f"sglang:{python}", "--b",
                          "builtin", "--exact", "--json", "-q"], capture_output=True, text=True, env=env, timeout=1200)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["identical"] and report["steps_compared"] > 0, report.get("first_divergence")


def test_release_prefill_swa_scenarios_release_locks() -> None:
    """Ours alone (no SGLang): the SGLANG_OPT_RELEASE_PREFILL_SWA scenarios (radix
    cache on: pages 1 and 16, EAGLE, PD) do release SWA locks early, so their parity
    above compares SGLang's release_swa_prefix_lock with ours."""
    from allocator.swa_radix import SwaRadixCache

    factory, base = ours_driver.load_factory("allocator")
    released: dict[str, int] = {}
    for scen in RADIX_SCENARIOS:
        if not scen.config.swa.release_prefill_swa:
            continue
        eng = ours_driver.OursEngine(scen.config, factory, base)
        tree = eng.alloc.tree_cache
        assert isinstance(tree, SwaRadixCache)
        calls = [0]
        release = tree.release_swa_lock

        def counted(node, uuid, calls=calls, release=release):  # type: ignore[no-untyped-def]
            calls[0] += 1
            release(node, uuid)

        tree.release_swa_lock = counted  # type: ignore[method-assign]
        runner.run_scenario(scen, eng, lambda d: None)
        key = scen.name.rsplit("-seed", 1)[0]
        released[key] = released.get(key, 0) + calls[0]
    assert len(released) == 3 and all(n > 0 for n in released.values()), released
