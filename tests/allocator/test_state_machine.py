"""Stateful property test: random extend / chunk / decode / spec / prealloc / finish /
retract / abort / evict sequences against a reference model of per-request lengths,
with ``check_integrity`` after every rule. Page sizes 1, 16 and 64, speculative
decoding on and off."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from allocator import AllocatorConfig, OutOfMemory, SpecConfig, create_allocator

_SHARED = [np.arange(5000 + 100 * i, 5000 + 100 * i + 80, dtype=np.int64) for i in range(3)]


class _Req:
    def __init__(self, rid: int, tokens: np.ndarray, prompt_len: int) -> None:
        self.rid = rid
        self.tokens = tokens
        self.prompt_len = prompt_len
        self.committed = 0
        self.allocated = 0
        self.state = "prefill"

    def grow(self, n: int) -> None:
        extra = (self.rid * 7919 + np.arange(self.tokens.shape[0], self.tokens.shape[0] + n)) % 40_000 + 60_000
        self.tokens = np.concatenate([self.tokens, extra.astype(np.int64)])


def _machine(config: AllocatorConfig) -> type[RuleBasedStateMachine]:
    ps = config.page_size
    spec = config.spec

    class KvMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.alloc = create_allocator(config)
            self.reserve = self.alloc.ctx.spec_reserve
            self.reqs: dict[int, _Req] = {}
            self.waiting: list[_Req] = []
            self.next_rid = 0
            self.ooms = 0

        # ------------------------------------------------------------ helpers

        def _by_state(self, state: str) -> list[_Req]:
            return [r for r in self.reqs.values() if r.state == state]

        def _pick(self, data, reqs: list[_Req], at_least: int = 1) -> list[_Req]:
            chosen = data.draw(st.lists(st.sampled_from(reqs), min_size=at_least, max_size=len(reqs), unique=True))
            return chosen

        def _rows_free(self) -> int:
            return self.alloc.req_to_token_pool.available_size()

        def _fingerprint(self) -> tuple:
            """What a failed allocation must leave alone (eviction before it is allowed)."""
            c = self.alloc.counters()
            rids = np.array(sorted(self.reqs), dtype=np.int64)
            lens = self.alloc.request_lens(rids)
            return (
                c.protected, c.committed, c.overallocated, c.running_requests, c.free_rows,
                c.available + c.evictable, lens.allocated.tolist(), lens.committed.tolist(),
                lens.protected.tolist(),
            )

        def _failed(self, before: tuple) -> None:
            self.ooms += 1
            assert self._fingerprint() == before

        def _extend(self, batch: list[tuple[_Req, int, bool]]) -> None:
            self.alloc.end_step()
            chunked = [r for r, _, _ in batch if r.rid in self.reqs]
            if chunked:  # the stash of the previous chunk is the step's, not the allocation's
                self.alloc.stash_chunked(np.array([r.rid for r in chunked]), [r.tokens for r in chunked])
            before = self._fingerprint()
            res = self.alloc.extend(
                np.array([r.rid for r, _, _ in batch]),
                np.array([end for _, end, _ in batch]),
                [r.tokens for r, _, _ in batch],
                np.array([done for _, _, done in batch]),
            )
            if isinstance(res, OutOfMemory):
                self._failed(before)
                return
            for r, end, done in batch:
                r.committed = r.allocated = end
                r.state = "decode" if done else "prefill"
                self.reqs[r.rid] = r
                if done and r.tokens.shape[0] == end:
                    r.grow(1)  # the token sampled by the prefill

        # ------------------------------------------------------------ rules

        @precondition(lambda self: self._rows_free() > 0)
        @rule(shared=st.integers(0, 2), cut=st.integers(0, 80), tail=st.integers(1, 120), chunk=st.sampled_from([16, 64, 512]))
        def new_request(self, shared: int, cut: int, tail: int, chunk: int) -> None:
            rid = self.next_rid
            self.next_rid += 1
            tokens = np.concatenate([_SHARED[shared][:cut], np.arange(tail, dtype=np.int64) + rid * 1000])
            req = _Req(rid, tokens, tokens.shape[0])
            prefix = self.alloc.match_prefix(tokens)
            end = min(tokens.shape[0], max(prefix + chunk, ps))
            end = min(end, tokens.shape[0])
            self._extend([(req, end, end == tokens.shape[0])])

        @precondition(lambda self: self._rows_free() > 0 and self.waiting)
        @rule(data=st.data())
        def readmit_retracted(self, data) -> None:
            req = self.waiting.pop(0)
            self._extend([(req, req.tokens.shape[0] - 1, True)])

        @precondition(lambda self: any(r.state == "prefill" for r in self.reqs.values()))
        @rule(data=st.data(), chunk=st.sampled_from([16, 48, 1000]))
        def continue_chunk(self, data, chunk: int) -> None:
            req = data.draw(st.sampled_from(self._by_state("prefill")))
            end = min(req.tokens.shape[0], req.allocated + chunk)
            self._extend([(req, end, end == req.tokens.shape[0])])

        @precondition(lambda self: spec is None and any(r.state == "decode" for r in self.reqs.values()))
        @rule(data=st.data())
        def decode(self, data) -> None:
            reqs = [r for r in self._by_state("decode") if r.committed + 2 < config.max_context_len]
            if not reqs:
                return
            batch = self._pick(data, reqs)
            self.alloc.end_step()
            before = self._fingerprint()
            res = self.alloc.decode(np.array([r.rid for r in batch]))
            if isinstance(res, OutOfMemory):
                self._failed(before)
                return
            for r in batch:
                r.committed += 1
                r.allocated += 1
                r.grow(1)

        @precondition(lambda self: spec is not None and any(r.state == "decode" for r in self.reqs.values()))
        @rule(data=st.data())
        def spec_step(self, data) -> None:
            limit = config.max_context_len - 2 * self.reserve - ps
            reqs = [r for r in self._by_state("decode") if r.committed < limit]
            if not reqs:
                return
            batch = self._pick(data, reqs)
            accepted = data.draw(
                st.lists(st.integers(1, spec.num_draft_tokens), min_size=len(batch), max_size=len(batch))
            )
            self.alloc.end_step()
            before = self._fingerprint()
            res = self.alloc.spec_decode(np.array([r.rid for r in batch]), np.array(accepted))
            if isinstance(res, OutOfMemory):
                self._failed(before)
                return
            assert res.row_overflow == ()
            for r, n in zip(batch, accepted):
                target = -(-(r.committed + self.reserve) // ps) * ps
                r.allocated = max(r.allocated, target)
                r.committed += n
                r.grow(n)

        @precondition(lambda self: self._rows_free() > 0)
        @rule(shared=st.integers(0, 2), cut=st.integers(0, 80), tail=st.integers(1, 60))
        def prealloc(self, shared: int, cut: int, tail: int) -> None:
            rid = self.next_rid
            self.next_rid += 1
            tokens = np.concatenate([_SHARED[shared][:cut], np.arange(tail, dtype=np.int64) + rid * 1000])
            req = _Req(rid, tokens, tokens.shape[0])
            self.alloc.end_step()
            before = self._fingerprint()
            res = self.alloc.prealloc(np.array([rid]), np.array([tokens.shape[0]]), [tokens])
            if isinstance(res, OutOfMemory):
                self._failed(before)
                return
            req.committed = req.allocated = tokens.shape[0]
            req.state = "decode"
            req.grow(1)
            self.reqs[rid] = req

        @precondition(lambda self: any(r.state == "decode" for r in self.reqs.values()))
        @rule(data=st.data(), early=st.integers(0, 2))
        def finish(self, data, early: int) -> None:
            batch = self._pick(data, self._by_state("decode"))
            owned = [max(r.prompt_len, r.committed - early) for r in batch]
            self.alloc.release(
                np.array([r.rid for r in batch]), np.array(owned), [r.tokens for r in batch], "finish"
            )
            for r in batch:
                del self.reqs[r.rid]

        @precondition(lambda self: any(r.state == "decode" for r in self.reqs.values()))
        @rule(data=st.data(), evict=st.integers(0, 64))
        def retract(self, data, evict: int) -> None:
            req = data.draw(st.sampled_from(self._by_state("decode")))
            self.alloc.release(np.array([req.rid]), np.array([req.committed]), None, "retract")
            self.alloc.evict(evict)
            del self.reqs[req.rid]
            req.state = "prefill"
            req.committed = req.allocated = 0
            self.waiting.append(req)

        @precondition(lambda self: bool(self.reqs))
        @rule(data=st.data())
        def abort(self, data) -> None:
            req = data.draw(st.sampled_from(list(self.reqs.values())))
            self.alloc.release(np.array([req.rid]), np.array([req.committed]), None, "abort")
            del self.reqs[req.rid]

        @rule(n=st.integers(1, 200))
        def evict(self, n: int) -> None:
            before = self.alloc.counters()
            evicted = self.alloc.evict(n)
            after = self.alloc.counters()
            assert evicted <= before.evictable
            assert evicted >= min(n, before.evictable) or after.evictable == 0
            assert after.available == before.available + evicted

        @rule()
        def end_step(self) -> None:
            self.alloc.end_step()

        # ------------------------------------------------------------ invariants

        @invariant()
        def sound(self) -> None:
            violations = self.alloc.check_integrity()
            assert violations == [], violations
            rids = np.array(sorted(self.reqs), dtype=np.int64)
            assert self.alloc.live_rids().tolist() == rids.tolist()
            if rids.shape[0]:
                lens = self.alloc.request_lens(rids)
                assert lens.committed.tolist() == [self.reqs[r].committed for r in rids.tolist()]
                assert lens.allocated.tolist() == [self.reqs[r].allocated for r in rids.tolist()]
            c = self.alloc.counters()
            assert c.available + c.evictable + c.protected + c.committed + c.overallocated == c.pool_tokens
            assert c.running_requests == len(self.reqs)

        def teardown(self) -> None:
            # Releasing everything and evicting the cache gives the whole pool back.
            rids = np.array(sorted(self.reqs), dtype=np.int64)
            if rids.shape[0]:
                self.alloc.release(rids, self.alloc.request_lens(rids).committed, None, "abort")
            self.alloc.evict(1 << 30)
            c = self.alloc.counters()
            assert c.available == c.pool_tokens, c
            assert c.free_rows == config.max_running + config.extra_rows

    return KvMachine


def machine_config(page_size: int, spec: SpecConfig | None) -> AllocatorConfig:
    """The small pool the state machines run on (a few requests fill it)."""
    return AllocatorConfig(
        pool_tokens={1: 400, 16: 384, 64: 640}[page_size],
        page_size=page_size,
        max_running=5,
        extra_rows=1,
        max_context_len=320,
        spec=spec,
    )


_CONFIGS = [
    pytest.param(1, None, id="page1"),
    pytest.param(16, None, id="page16"),
    pytest.param(64, None, id="page64"),
    pytest.param(1, SpecConfig("eagle", 3, 1, 4), id="page1-eagle"),
    pytest.param(16, SpecConfig("eagle", 3, 1, 4), id="page16-eagle"),
    pytest.param(64, SpecConfig("standalone", 3, 1, 4), id="page64-standalone"),
]


@pytest.mark.parametrize(("page_size", "spec"), _CONFIGS)
def test_state_machine(page_size: int, spec: SpecConfig | None) -> None:
    config = machine_config(page_size, spec)
    run_state_machine_as_test(
        _machine(config),
        settings=settings(
            max_examples=30,
            stateful_step_count=50,
            deadline=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
