"""Streaming sessions in the built-in allocator: KV held between turns, ``session_held``
in the counters and the conservation invariant, release on close and on abort, faults."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from allocator import AllocatorConfig, create_allocator
from allocator.manager import KvAllocator
from kvtrace.cli import app
from kvtrace.record.recorder import Recorder
from tests.helpers import make_meta

TOKENS = np.arange(5000, 5600, dtype=np.int64)  # one conversation's token ids


def _a(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _make(page_size: int, cls: type[KvAllocator] = KvAllocator, pool: int = 256) -> KvAllocator:
    return cls(AllocatorConfig(pool_tokens=pool, page_size=page_size))


def _ceil(n: int, page_size: int) -> int:
    return -(-n // page_size) * page_size


def _clean(alloc: KvAllocator) -> None:
    assert alloc.check_integrity() == []
    c = alloc.counters()
    assert c.available + c.evictable + c.protected + c.committed + c.overallocated + c.session_held == c.pool_tokens


@pytest.mark.parametrize("page_size", [1, 4])
def test_two_turns_hold_resume_close(page_size: int) -> None:
    alloc = _make(page_size)
    alloc.extend(_a(0), _a(10), [TOKENS[:10]])
    alloc.decode(_a(0))
    alloc.end_step()
    protected = alloc.counters().protected  # the first turn's prompt, published
    assert protected == (10 // page_size) * page_size
    alloc.hold(_a(0), _a(11))
    c = alloc.counters()
    # SGLang's kv_private_tokens: the held row up to its page's end, past the tree's prefix
    assert c.session_held == _ceil(11, page_size) - protected and c.committed == 0
    assert alloc.session_held(_a(0)).tolist() == [11 - protected]
    _clean(alloc)
    # the next turn's prefix is the held KV, not a tree match
    res = alloc.extend(_a(0), _a(20), [TOKENS[:20]])
    assert res.prefix_lens.tolist() == [11]
    c = alloc.counters()  # the running turn's row is still the session's
    assert c.session_held == _ceil(20, page_size) - protected and c.committed == c.overallocated == 0
    alloc.end_step()
    assert alloc.counters().protected == protected  # a later turn publishes nothing
    _clean(alloc)
    alloc.hold(_a(0), _a(19))  # a stop landed early: the tail past 19 goes back
    assert alloc.counters().session_held == _ceil(19, page_size) - protected
    _clean(alloc)
    alloc.close_session(_a(0))
    c = alloc.counters()
    assert c.session_held == 0 and c.running_requests == 0
    assert c.available + c.evictable == c.pool_tokens
    _clean(alloc)


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_checkpoint_keeps_the_held_sessions(page_size: int) -> None:
    # A seek restores a checkpoint: a session held then must be held again (its KV counted
    # in session_held, its next turn resuming it), and one turned since must be as it was.
    alloc = _make(page_size)
    alloc.extend(_a(0), _a(10), [TOKENS[:10]])
    alloc.decode(_a(0))
    alloc.decode(_a(0))
    alloc.end_step()
    alloc.hold(_a(0), _a(12))
    alloc.end_step()
    saved = alloc.save_state()
    held = alloc.counters()
    assert held.session_held > 0
    alloc.extend(_a(0), _a(20), [TOKENS[:20]])  # the next turn: the session's KV is the request's again
    alloc.end_step()
    alloc.hold(_a(0), _a(20))
    alloc.close_session(_a(0))
    alloc.end_step()
    alloc.restore_state(saved)
    assert alloc.counters() == held
    assert alloc.session_held(_a(0)).tolist() == [held.session_held]
    _clean(alloc)
    res = alloc.extend(_a(0), _a(20), [TOKENS[:20]])  # resumes the held session, as before the seek
    assert res.prefix_lens.tolist() == [12]
    alloc.end_step()
    _clean(alloc)


@pytest.mark.parametrize("page_size", [1, 4])
def test_abort_of_a_resumed_turn_releases_the_session_kv(page_size: int) -> None:
    alloc = _make(page_size)
    alloc.extend(_a(3), _a(9), [TOKENS[:9]])
    alloc.end_step()
    alloc.hold(_a(3), _a(9))
    alloc.extend(_a(3), _a(15), [TOKENS[:15]])
    alloc.release(_a(3), _a(15), None, "abort")
    c = alloc.counters()
    assert c.session_held == 0 and c.running_requests == 0 and c.available + c.evictable == c.pool_tokens
    _clean(alloc)


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_running_turn_is_session_held_as_in_sglang(page_size: int) -> None:
    """SGLang counts a session's row as session-held from its take to its close, while a
    turn runs on it too (``pool_stats_observer.session_held_tokens``), page-rounded; the
    turn's decode growth and over-allocation go there, not to committed/overallocated."""
    alloc = _make(page_size)
    alloc.extend(_a(0), _a(9), [TOKENS[:9]])
    alloc.decode(_a(0))
    alloc.end_step()
    c = alloc.counters()  # the first turn: a request's, not known to be a session's yet
    assert c.session_held == 0 and c.committed + c.overallocated > 0
    alloc.hold(_a(0), _a(10))
    protected = alloc.counters().protected
    alloc.extend(_a(0), _a(13), [TOKENS[:13]])
    alloc.decode(_a(0))
    alloc.end_step()
    c = alloc.counters()
    assert c.session_held == _ceil(14, page_size) - protected
    assert c.committed == 0 and c.overallocated == 0
    _clean(alloc)
    alloc.extend(_a(1), _a(5), [TOKENS[300:305]])  # a plain request beside it: its own terms
    alloc.decode(_a(1))
    alloc.end_step()
    c = alloc.counters()
    assert c.session_held == _ceil(14, page_size) - protected and c.committed + c.overallocated > 0
    _clean(alloc)


def test_hold_and_close_refuse_requests_in_the_wrong_state() -> None:
    alloc = _make(1)
    alloc.extend(_a(0), _a(4), [TOKENS[:4]])
    with pytest.raises(ValueError, match="close: request rid=0 is not held"):
        alloc.close_session(_a(0))
    alloc.hold(_a(0), _a(4))
    with pytest.raises(ValueError, match="hold: request rid=0 is already held"):
        alloc.hold(_a(0), _a(4))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    page_size=st.sampled_from([1, 4]),
    script=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 4), st.integers(1, 12)), max_size=30),
)
def test_session_held_matches_a_reference_model(page_size: int, script: list[tuple[int, int, int]]) -> None:
    """Three conversations driven at random; the reference knows, per session, the held
    length (or that it runs, and how long it is); the allocator's counters must agree."""
    alloc = _make(page_size, pool=512)
    running: dict[int, int] = {}  # rid -> length
    held: dict[int, int] = {}  # rid -> held length
    sessions: set[int] = set()  # rids a session owns (held once, not closed or aborted)
    for rid, action, n in script:
        if action == 0 and rid not in running:  # a new conversation, or its next turn
            start = held.pop(rid, 0)
            alloc.extend(_a(rid), _a(start + n), [TOKENS[: start + n]])
            running[rid] = start + n
        elif action == 1 and rid in running:
            alloc.decode(_a(rid))
            running[rid] += 1
        elif action == 2 and rid in running:  # the turn ends; a stop may land early
            keep = max(running[rid] - n % 3, 1)
            alloc.hold(_a(rid), _a(keep))
            kv = alloc.kv_info(rid)
            assert kv is not None
            held[rid] = kv.kv_committed_len
            assert held[rid] == max(keep, kv.cache_protected_len)
            del running[rid]
            sessions.add(rid)
        elif action == 3 and rid in held:
            alloc.close_session(_a(rid))
            del held[rid]
            sessions.discard(rid)
        elif action == 4 and rid in running:
            alloc.release(_a(rid), _a(running.pop(rid)), None, "abort")
            sessions.discard(rid)
        alloc.end_step()
        c = alloc.counters()
        # a session owns its row from the first hold on, while a later turn runs too
        owned = {**held, **{r: n for r, n in running.items() if r in sessions}}
        expected = sum(_ceil(n, page_size) - alloc.kv_info(r).cache_protected_len  # type: ignore[union-attr]
                       for r, n in owned.items())
        assert c.session_held == expected
        assert c.running_requests == len(running) + len(held)
        _clean(alloc)
    for rid in list(held):
        alloc.close_session(_a(rid))
    for rid, length in running.items():
        alloc.release(_a(rid), _a(length), None, "abort")
    c = alloc.counters()
    assert c.session_held == 0 and c.available + c.evictable == c.pool_tokens


class _LeaksSessionOnAbort(KvAllocator):
    """Planted fault: an abort forgets that the session held the request's KV."""

    def release(self, rids, owned_lens, token_ids, kind):  # type: ignore[no-untyped-def]
        before = self._session_held[np.asarray(rids)].copy()
        out = super().release(rids, owned_lens, token_ids, kind)
        self._session_held[np.asarray(rids)] = before
        self.sum_session_held += int(before[before >= 0].sum())
        return out


class _DoubleCountsSessionHeld(KvAllocator):
    """Planted fault: the busy count keeps the session-held KV in ``committed`` too."""

    def counters_now(self):  # type: ignore[no-untyped-def]
        c = super().counters_now()
        return c._replace(committed=c.committed + c.session_held)


def test_fault_session_kv_leaked_on_abort_is_caught_with_blame() -> None:
    alloc = _make(4, _LeaksSessionOnAbort)
    alloc.extend(_a(5), _a(9), [TOKENS[:9]])
    alloc.end_step()
    alloc.hold(_a(5), _a(9))
    _clean(alloc)
    alloc.close_session(_a(5))
    violations = alloc.check_integrity()
    assert {v.check for v in violations} == {"session_held"}
    assert any(v.rid == 5 and "held by its session but holds no row" in v.detail for v in violations)


def test_fault_double_counted_session_held_breaks_conservation() -> None:
    alloc = _make(1, _DoubleCountsSessionHeld)
    alloc.extend(_a(2), _a(9), [TOKENS[:9]])
    alloc.decode(_a(2))
    alloc.end_step()
    assert alloc.check_integrity() == []
    alloc.hold(_a(2), _a(10))
    violations = alloc.check_integrity()
    assert [v.check for v in violations] == ["conservation"]
    assert "session_held 1" in violations[0].detail


def _session_trace(path: Path) -> None:
    with Recorder(path, make_meta(sessions=True, page_size=1), overwrite=True) as rec:
        for t, (op, args) in enumerate([
            ("extend", ([4], [10])), ("hold", ([4],)), ("extend", ([4], [40])), ("hold", ([4],)),
            ("close_session", ([4],)),
        ]):
            rec.begin_step(float(t))
            kwargs = {"prompt_lens": [10]} if t == 0 else {}
            getattr(rec, op)(*args, **kwargs)
            rec.end_step()


def test_replay_flags_session_kv_held_past_the_bound(tmp_path: Path) -> None:
    path = tmp_path / "s.kvtrace"
    _session_trace(path)
    runner = CliRunner()
    ok = runner.invoke(app, ["replay", str(path), "--check", "every", "--json"])
    assert ok.exit_code == 0, ok.output
    import json

    summary = json.loads(ok.output)
    assert summary["session_held"] == {"holds": 2, "closes": 1, "peak_tokens": 30}
    assert summary["num_violations"] == 0
    bad = runner.invoke(app, ["replay", str(path), "--session-hold-bound", "32", "--json"])
    violations = json.loads(bad.output)["violations"]
    assert [(v["step"], v["rid"], v["check"]) for v in violations] == [(3, 0, "session_hold_bound")]
    assert "holds 40 tokens" in violations[0]["detail"]


def _random_sessions_trace(path: Path, seed: int) -> None:
    """Six conversations at random: turns that decode, hold, resume, close or abort."""
    rng = np.random.default_rng(seed)
    meta = make_meta(sessions=True, page_size=1, pool_tokens=4096, max_context_len=4096)
    with Recorder(path, meta, overwrite=True, dense_ids=True) as rec:
        state: dict[int, str] = {}
        for step in range(200):
            rec.begin_step(float(step))
            for rid in range(6):
                phase, r = state.get(rid, "new"), rng.random()
                length = int(rec._lens[rid])  # noqa: SLF001 - the recorder's length of the request
                if phase == "new" and r < 0.2:
                    n = int(rng.integers(5, 60))
                    rec.extend([rid], [n], prompt_lens=[n])
                    state[rid] = "run"
                elif phase == "run":
                    if r < 0.1:
                        rec.hold([rid], [length - int(rng.integers(0, 2))])
                        state[rid] = "held"
                    elif r < 0.12:
                        rec.abort([rid])
                        state[rid] = "done"
                    else:
                        rec.decode([rid])
                elif phase == "held" and r < 0.1:
                    rec.close_session([rid])
                    state[rid] = "done"
                elif phase == "held" and r < 0.4:
                    rec.extend([rid], [length + int(rng.integers(1, 40))])
                    state[rid] = "run"
            rec.end_step()


@pytest.mark.parametrize("page_size", [1, 16])
def test_replay_of_random_sessions_is_clean_under_every_check(tmp_path: Path, page_size: int) -> None:
    import json

    path = tmp_path / "multi.kvtrace"
    _random_sessions_trace(path, seed=1)
    out = CliRunner().invoke(app, ["replay", str(path), "--check", "every", "--page-size", str(page_size), "--json"])
    assert out.exit_code == 0, out.output
    summary = json.loads(out.output)
    assert summary["session_held"]["holds"] > 10 and summary["num_violations"] == 0



def test_hold_is_refused_where_sessions_are_not_modelled() -> None:
    alloc = create_allocator(AllocatorConfig(pool_tokens=64, page_size=1, hisparse=True, radix_cache=False))
    alloc.extend(_a(0), _a(4), [TOKENS[:4]])
    with pytest.raises(ValueError, match="full-attention pools only"):
        alloc.hold(_a(0), _a(4))


def test_only_a_session_trace_logs_and_summarizes_session_held(tmp_path: Path) -> None:
    """A trace without sessions gets the state log and --json summary it had before
    sessions existed (no session_held column or key); a session trace gets both."""
    import json

    import pyarrow as pa

    from kvtrace.statelog.log import read_state_log

    path = tmp_path / "s.kvtrace"
    _session_trace(path)
    runner = CliRunner()
    plain = runner.invoke(app, ["replay", "sample:tiny", "--out", str(tmp_path / "plain.arrow"), "--json"])
    assert plain.exit_code == 0, plain.output
    assert "session_held" not in json.loads(plain.output)
    assert not any("session_held" in name for name in pa.ipc.open_file(tmp_path / "plain.arrow").schema.names)
    _, snaps = read_state_log(tmp_path / "plain.arrow")
    assert all(s.pool.session_held == 0 for s in snaps)
    held = runner.invoke(app, ["replay", str(path), "--out", str(tmp_path / "held.arrow"), "--json"])
    assert held.exit_code == 0, held.output
    assert json.loads(held.output)["session_held"]["holds"] == 2
    names = pa.ipc.open_file(tmp_path / "held.arrow").schema.names
    assert names[names.index("free_rows") + 1] == "session_held"
    _, snaps = read_state_log(tmp_path / "held.arrow")
    # the first turn is in the tree; the second turn's row is the session's while it runs
    assert [s.pool.session_held for s in snaps] == [0, 0, 30, 30, 0]


def test_config_sessions_needs_format_version_6() -> None:
    import json

    from traces.metadata import TraceMeta

    data = json.loads(make_meta(sessions=True).to_json())
    assert data["format_version"] == 6
    data["format_version"] = 5
    with pytest.raises(ValueError, match=r"'config.sessions', which format version 5 does not have"):
        TraceMeta.from_json(json.dumps(data))
