"""Run a scenario through SGLang's real functions with the live recorder on.

Runs INSIDE an SGLang environment with this checkout on ``PYTHONPATH`` (and
pyarrow installed: ``tools/sglang_oracle/setup.sh`` does it), the way
``python -m kvtrace.sglang.launch`` runs a server: ``kvtrace.sglang.hooks`` is
enabled before SGLang is imported, then ``world.SGLangEngine`` drives SGLang's
``alloc_for_extend`` / ``alloc_for_decode`` / ``eagle_prepare_for_decode`` /
``_pre_alloc`` / ``release_kv_cache`` / ``release_req`` / ``checkpoint_kv_cache``
through the scenario, and the hooks record what they see.

    PYTHONPATH=. $KVTRACE_SGLANG_PYTHON tests/differential/live_record.py SCENARIO.jsonl OUT.kvtrace STATES.json

``STATES.json``: per recorded step (the trace's step number), SGLang's state after
it: kvtrace's state digest of SGLang's objects and the pool counters.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    scenario_path, out, states_path = argv
    from kvtrace.sglang import hooks

    live = hooks.enable(out)  # before SGLang is imported, as the launcher does
    assert live is not None
    from kvtrace.sglang import readout, runner, scenario as sc, world

    world.load_sglang()
    (scen,) = sc.load_scenarios(scenario_path)
    eng = world.SGLangEngine(scen.config)
    states: dict[int, dict] = {}
    content = _token_content(scen)

    def emit(_dump: dict) -> None:
        # The hooks' open step is the one this scenario step's calls went to.
        if live.recorder is not None and live._step is not None:
            digest = readout.state_digest(eng, rid_of=live.dense_id)  # the trace's request ids
            states[live.steps_closed] = {"digest": digest, "counters": readout.pool_counters(eng)}
        _append_outputs(eng, content)

    runner.run_scenario(scen, eng, emit)
    hooks._close_active()
    with open(states_path, "w") as f:
        json.dump({"states": states, "failed": live.failed}, f)
    return 0


def _token_content(scen: object) -> dict[int, list[int]]:
    """Each request's token ids by position, from the ops' explicit ids."""
    out: dict[int, list[int]] = {}
    for step in scen.steps:  # type: ignore[attr-defined]
        for op in step.ops:
            if op.tokens:
                ids = out.setdefault(op.rid, [])
                start = op.seq_len - len(op.tokens)
                ids.extend([0] * max(op.seq_len - len(ids), 0))
                ids[start : op.seq_len] = op.tokens
    return out


def _append_outputs(eng: object, content: dict[int, list[int]]) -> None:
    """What SGLang's result processing does after a step and ``world.py`` does not: the
    tokens each running request computed are in its ``output_ids`` (the hooks read a
    decode's token id from there)."""
    from array import array

    for rid, req in eng.reqs.items():  # type: ignore[attr-defined]
        n_origin = len(req.origin_input_ids)
        upto = int(req.kv.kv_committed_len) if req.kv.holds_kv else 0
        known = content.get(rid, [])
        if upto > n_origin and len(known) >= upto:
            req.output_ids = array("q", known[n_origin:upto])
            req.full_untruncated_fill_ids = req.origin_input_ids + req.output_ids


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
