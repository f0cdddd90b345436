"""A seeded random scheduler that drives ``KvAllocator`` through every op kind.

Used by the long deterministic runs (tests and ``bench/``): requests with shared
prompt prefixes arrive, are prefilled in chunks, decode (or take speculative steps),
finish, get retracted under memory pressure and come back, or are aborted. After
every step the caller may run ``check_integrity``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from allocator import AllocatorConfig, KvAllocator, OutOfMemory, create_allocator


@dataclass
class SimRequest:
    rid: int
    prompt: np.ndarray
    max_new: int
    outputs: list[int] = field(default_factory=list)
    done_len: int = 0  # positions prefilled so far (0: waiting)
    state: str = "waiting"  # waiting | prefill | decode

    def tokens(self) -> np.ndarray:
        if not self.outputs:
            return self.prompt
        return np.concatenate([self.prompt, np.array(self.outputs, dtype=np.int64)])


class RandomScheduler:
    """Drives one allocator with a seeded random workload.

    Args:
        config: allocator configuration.
        seed: random seed (the run is deterministic).
        chunk: prefill chunk budget per step (tokens).
        max_prompt: longest prompt.
    """

    def __init__(self, config: AllocatorConfig, seed: int, chunk: int = 96, max_prompt: int = 200) -> None:
        self.config = config
        self.alloc: KvAllocator = create_allocator(config)
        self.rng = np.random.default_rng(seed)
        self.chunk = chunk
        self.max_prompt = max_prompt
        self.next_rid = 0
        self.waiting: list[SimRequest] = []
        self.running: dict[int, SimRequest] = {}
        self.prefixes = [self.rng.integers(0, 50_000, int(self.rng.integers(8, 120))) for _ in range(6)]
        self.ooms = 0
        self.steps = 0

    def _new_request(self) -> SimRequest:
        rng = self.rng
        base = self.prefixes[int(rng.integers(0, len(self.prefixes)))]
        cut = int(rng.integers(0, base.shape[0] + 1))
        tail = rng.integers(0, 50_000, int(rng.integers(1, self.max_prompt // 2)))
        prompt = np.concatenate([base[:cut], tail]).astype(np.int64)[: self.max_prompt]
        req = SimRequest(self.next_rid, prompt, int(rng.integers(1, 40)))
        self.next_rid += 1
        return req

    def step(self) -> None:
        """One scheduler step: releases, one extend batch, one decode or spec batch."""
        rng = self.rng
        alloc = self.alloc
        self.steps += 1
        for _ in range(int(rng.integers(0, 3))):
            self.waiting.append(self._new_request())
        # 1. finish / abort
        finishing = [r for r in self.running.values() if r.state == "decode" and len(r.outputs) >= r.max_new]
        aborting = [r for r in self.running.values() if r.state == "decode" and rng.random() < 0.01]
        aborting = [r for r in aborting if r not in finishing]
        if finishing:
            lens = alloc.request_lens(np.array([r.rid for r in finishing]))
            owned = lens.committed.copy()
            for i in range(len(finishing)):
                if rng.random() < 0.2 and owned[i] > finishing[i].prompt.shape[0] + 1:
                    owned[i] -= int(rng.integers(1, 3))  # a stop landed before the last token
            alloc.release(
                np.array([r.rid for r in finishing]), owned, [r.tokens() for r in finishing], "finish"
            )
            for r in finishing:
                del self.running[r.rid]
        if aborting:
            lens = alloc.request_lens(np.array([r.rid for r in aborting]))
            alloc.release(np.array([r.rid for r in aborting]), lens.committed, None, "abort")
            for r in aborting:
                del self.running[r.rid]
        # 2. extend: the chunked request continues, then new ones while the budget lasts
        budget = self.chunk
        batch: list[tuple[SimRequest, int, bool]] = []
        for r in [r for r in self.running.values() if r.state == "prefill"]:
            total = r.tokens().shape[0]
            end = min(total, r.done_len + budget)
            budget -= end - r.done_len
            batch.append((r, end, end == total))
        while budget > 0 and self.waiting and len(self.running) + len(batch) < self.config.max_running:
            r = self.waiting[0]
            total = r.tokens().shape[0]
            prefix = alloc.match_prefix(r.tokens())
            end = min(total, prefix + budget)
            if end <= prefix:
                break
            self.waiting.pop(0)
            budget -= end - prefix
            batch.append((r, end, end == total))
        if batch:
            res = alloc.extend(
                np.array([r.rid for r, _, _ in batch]),
                np.array([end for _, end, _ in batch]),
                [r.tokens() for r, _, _ in batch],
                np.array([done for _, _, done in batch]),
            )
            if isinstance(res, OutOfMemory):
                self.ooms += 1
                for r, _, _ in batch:
                    if r.state == "waiting":
                        self.waiting.insert(0, r)
            else:
                for r, end, done in batch:
                    r.done_len = end
                    r.state = "decode" if done else "prefill"
                    self.running[r.rid] = r
                    if done:
                        r.outputs.append(int(r.rid * 1_000_003 + len(r.outputs)) % 50_000 + 50_000)
        # 3. decode or spec for requests whose prefill finished before this step
        decoding = [r for r in self.running.values() if r.state == "decode" and all(r is not b[0] for b in batch)]
        decoding = [r for r in decoding if r.tokens().shape[0] + 2 * (self._reserve() + 1) < self.config.max_context_len]
        if decoding:
            self._decode(decoding)
        if rng.random() < 0.05:
            alloc.evict(int(rng.integers(1, 64)))

    def _reserve(self) -> int:
        return self.alloc.ctx.spec_reserve

    def _decode(self, decoding: list[SimRequest]) -> None:
        alloc = self.alloc
        rng = self.rng
        while decoding:
            rids = np.array([r.rid for r in decoding])
            if self.config.spec is None:
                res = alloc.decode(rids)
                accepted = np.ones(len(decoding), dtype=np.int64)
            else:
                accepted = rng.integers(1, self.config.spec.num_draft_tokens + 1, len(decoding))
                res = alloc.spec_decode(rids, accepted)
            if not isinstance(res, OutOfMemory):
                for r, n in zip(decoding, accepted.tolist()):
                    for _ in range(n):
                        r.outputs.append(int(r.rid * 1_000_003 + len(r.outputs)) % 50_000 + 50_000)
                return
            self.ooms += 1
            # retract the request with the fewest outputs (SGLang's order), then retry
            victim = min(decoding, key=lambda r: (len(r.outputs), -r.prompt.shape[0]))
            lens = alloc.request_lens(np.array([victim.rid]))
            alloc.release(np.array([victim.rid]), lens.committed, None, "retract")
            alloc.evict(len(decoding) * 20)
            del self.running[victim.rid]
            decoding.remove(victim)
            victim.state = "waiting"
            victim.done_len = 0
            self.waiting.insert(0, victim)
