"""The live recorder (``kvtrace.sglang.hooks``) on SGLang's real functions, on the CPU.

``live_record.py`` runs in the SGLang environment with the hooks enabled before
SGLang is imported (as ``python -m kvtrace.sglang.launch`` does) and drives
SGLang's allocation and release functions through a scenario (``world.py``);
after every step it notes kvtrace's state digest of SGLang's objects. The trace
the hooks wrote is then replayed through ``builtin`` and through ``sglang:PYTHON``:
both must reproduce, step by step, the states SGLang had (digests: rows, free
lists in order, free rows; and the pool counters).

Skipped unless ``KVTRACE_SGLANG_PYTHON`` has sglang 0.5.23 and pyarrow
(``tools/sglang_oracle/setup.sh`` installs it).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kvtrace.replay.engine import ReplayOptions
from kvtrace.replay.session import ReplaySession
from kvtrace.sglang import scenario as sc
from tests.differential import harness, trace_adapter

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # SGLang in a subprocess

SHAPES = {
    "p16-spec-retract-abort": dict(page_size=16, spec=True, retract_prob=0.05, abort_prob=0.02),
    "p1-pd-explicit": dict(page_size=1, chunk_size=64, pd_decode=True, block_size=16, retract_prob=0.05, abort_prob=0.02,
                           explicit_fraction=0.3),
}
_SYNTHETIC = 1 << 62


def _sglang_python() -> str:
    return harness.require_sglang(("pyarrow",))


def _as_engine_ids(scen: sc.Scenario) -> sc.Scenario:
    """A real engine's token ids are vocabulary ids: move kvtrace's synthetic ids (outside
    [0, 2**62), reserved for generated content) to [2**61, 2**62), keeping them distinct."""

    def fix(ids: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if ids is None:
            return None
        arr = np.asarray(ids, dtype=np.int64).view(np.uint64)  # ids past 2**63 are stored negative
        big = arr >= np.uint64(_SYNTHETIC)
        arr[big] = (arr[big] & np.uint64((1 << 61) - 1)) | np.uint64(1 << 61)
        return tuple(int(x) for x in arr.view(np.int64).tolist())

    steps = tuple(
        sc.Step(st.step, tuple(
            sc.Op(o.op, o.rid, o.seq_len, o.accepted, o.draft, o.prompt_len, fix(o.tokens), fix(o.prompt_tokens))
            for o in st.ops
        ))
        for st in scen.steps
    )
    return sc.Scenario(scen.name, scen.config, steps, scen.description)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_recorded_trace_reproduces_sglang_states(tmp_path: Path, shape: str) -> None:
    from traces.synth import generate

    python = _sglang_python()
    source = str(tmp_path / "source.kvtrace")
    generate(source, num_requests=20, seed=3, pool_tokens=4096, max_context_len=1024, **SHAPES[shape])
    scen = _as_engine_ids(trace_adapter.trace_to_scenario(source, name=shape))
    scen_file, out, states_file = tmp_path / "scen.jsonl", tmp_path / "live.kvtrace", tmp_path / "states.json"
    sc.dump_scenarios([scen], str(scen_file))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [python, str(ROOT / "tests" / "differential" / "live_record.py"), str(scen_file), str(out), str(states_file)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    recorded = json.loads(states_file.read_text())
    assert recorded["failed"] is None
    states = {int(k): v for k, v in recorded["states"].items()}
    assert len(states) >= len(scen.steps) // 2  # steps that only decode merge; none is lost

    for version in ("builtin", f"sglang:{python}"):
        seen = 0
        with ReplaySession(str(out), version=version, options=ReplayOptions(state_digest=True, check="every")) as s:
            for snap in s.snapshots():
                want = states[snap.step]
                assert list(snap.pool) == want["counters"], (version, snap.step)
                assert snap.digest == want["digest"], (version, snap.step)
                seen += 1
            result = s.result()
        assert seen == len(states) and result.completed and result.stats.num_violations == 0, version
