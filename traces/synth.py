"""Seeded synthetic traces: valid op sequences exercising every op kind.

``generate`` simulates a small continuous-batching scheduler (no pool capacity:
that is the allocator's and the scheduler model's job) and writes what it does:

* requests arrive over time; each prompt is a run of content-addressed blocks,
  many sharing leading blocks with earlier requests (``prefix_groups``);
* admitted requests prefill in chunks of ``chunk_size`` tokens per step (chunk
  ends that cross page boundaries), then decode one token per step, or run
  speculative steps (``spec``) that accept 1..draft+1 tokens and may overshoot
  the stop, so a finish keeps fewer tokens than it holds (early stop);
* with ``pd_decode`` some requests arrive by ``prealloc`` (KV from a prefill server);
* requests are sometimes retracted (they come back with an extend from 0),
  aborted, or carry explicit token ids.

``generate_mooncake_shaped`` runs the same scheduler on the token counts of the
one-hour Mooncake conversation trace (FAST'25): about 12k requests, 145M prompt
tokens in 512-token hashed blocks (about 36% of block references repeat an
earlier block), about 4M generated tokens at up to 256 running requests. It
sizes the format; its requests are synthetic, not Mooncake's.

One concept, read top to bottom: the simulated scheduler that makes a synthetic trace,
then the entry points that configure and run it; they share its private state, which
a split would have to make public.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from traces.batches import Ragged, StepBatch
from traces.metadata import ModelShape, SpecSettings, TraceConfig, TraceMeta, TraceSource
from traces.schema import ABORT, DECODE, EXTEND, FINISH, OPS, PREALLOC, RETRACT, SPEC
from traces.writer import Compression, TraceWriter

VOCAB_SIZE = 32_000


class SynthSummary(NamedTuple):
    """What a generator wrote."""

    path: str
    steps: int
    rows: int
    requests: int
    ops: dict[str, int]
    prompt_tokens: int
    generated_tokens: int
    block_refs: int
    repeated_block_refs: int
    duration_s: float

    @property
    def repeated_block_fraction(self) -> float:
        return self.repeated_block_refs / self.block_refs if self.block_refs else 0.0


@dataclass(frozen=True, slots=True)
class _Workload:
    """Per-request draws, arrays indexed by request id."""

    arrival_s: np.ndarray  # float64 [n]
    prompt_len: np.ndarray  # int64 [n]
    output_len: np.ndarray  # int64 [n]
    is_spec: np.ndarray  # bool [n]
    is_prealloc: np.ndarray  # bool [n]
    is_explicit: np.ndarray  # bool [n]
    hashes: list[np.ndarray | None]


class _RowBuffer:
    """The rows of one step that are not decode/spec rows (few per step)."""

    def __init__(self) -> None:
        self.op: list[int] = []
        self.rid: list[int] = []
        self.seq_len: list[int] = []
        self.append_len: list[int] = []
        self.prefix_len: list[int] = []
        self.prompt_len: list[int] = []
        self.hashes: list[np.ndarray | None] = []
        self.tokens: list[np.ndarray | None] = []

    def add(
        self,
        op: int,
        rid: int,
        seq_len: int,
        append_len: int,
        *,
        prefix_len: int = 0,
        prompt_len: int = -1,
        hashes: np.ndarray | None = None,
        tokens: np.ndarray | None = None,
    ) -> None:
        self.op.append(op)
        self.rid.append(rid)
        self.seq_len.append(seq_len)
        self.append_len.append(append_len)
        self.prefix_len.append(prefix_len)
        self.prompt_len.append(prompt_len)
        self.hashes.append(hashes)
        self.tokens.append(tokens)


class _PrefixIndex:
    """Which leading blocks of a prompt an earlier prompt already had (a hash trie)."""

    def __init__(self) -> None:
        self._children: dict[tuple[int, int], int] = {}

    def match_and_insert(self, hashes: np.ndarray) -> int:
        node, matched, inserting = 0, 0, False
        for h in hashes.tolist():
            key = (node, h)
            child = self._children.get(key)
            if child is None:
                child = len(self._children) + 1
                self._children[key] = child
                inserting = True
            elif not inserting:
                matched += 1
            node = child
        return matched


class _Simulator:
    """A continuous-batching scheduler without a KV pool, writing what it does."""

    def __init__(
        self,
        writer: TraceWriter,
        workload: _Workload,
        rng: np.random.Generator,
        *,
        meta: TraceMeta,
        chunk_size: int,
        retract_prob: float,
        abort_prob: float,
        early_stop_prob: float,
        step_time_s: float,
        prefill_token_s: float,
        max_steps: int | None,
    ) -> None:
        self.writer = writer
        self.w = workload
        self.rng = rng
        self.meta = meta
        cfg = meta.config
        self.page_size = cfg.page_size
        self.block_size = meta.block_size
        self.max_running = cfg.max_running
        self.spec = cfg.spec
        self.chunk_size = chunk_size
        self.retract_prob = retract_prob
        self.abort_prob = abort_prob
        self.early_stop_prob = early_stop_prob
        self.step_time_s = step_time_s
        self.prefill_token_s = prefill_token_s
        self.max_steps = max_steps
        n = workload.prompt_len.shape[0]
        self.length = np.zeros(n, np.int64)  # tokens held now
        self.generated = np.zeros(n, np.int64)
        self.started = np.zeros(n, np.bool_)  # first row written
        self.ended = np.zeros(n, np.bool_)
        self.explicit_ids: dict[int, np.ndarray] = {}
        self.prefix = _PrefixIndex()
        self.op_counts = np.zeros(len(OPS), np.int64)
        self.block_refs = 0
        self.repeated_block_refs = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0

    # -- helpers ---------------------------------------------------------------------

    def _ids(self, rid: int) -> np.ndarray:
        ids = self.explicit_ids.get(rid)
        if ids is None:
            # Prompt + outputs + room for a speculative overshoot, drawn once.
            extra = 0 if self.spec is None else self.spec.num_steps + 1
            size = int(self.w.prompt_len[rid] + self.w.output_len[rid]) + extra
            ids = self.rng.integers(0, VOCAB_SIZE, size, dtype=np.int64)
            self.explicit_ids[rid] = ids
        return ids

    def _first_row_fields(self, rid: int) -> dict[str, object]:
        if self.started[rid]:
            return {}
        self.started[rid] = True
        hashes = self.w.hashes[rid]
        fields: dict[str, object] = {"prompt_len": int(self.w.prompt_len[rid])}
        if hashes is not None:
            fields["hashes"] = hashes
            matched = self.prefix.match_and_insert(hashes)
            self.block_refs += hashes.shape[0]
            self.repeated_block_refs += matched
            assert self.block_size is not None
            # What a radix cache would have matched: whole pages, at least one token computed.
            hit = min(matched * self.block_size, int(self.w.prompt_len[rid]) - 1)
            fields["prefix_len"] = max(0, hit - hit % self.page_size)
        return fields

    # -- the loop --------------------------------------------------------------------

    def run(self) -> tuple[int, float]:
        w, rng = self.w, self.rng
        n = w.prompt_len.shape[0]
        order = np.argsort(w.arrival_s, kind="stable")
        next_arrival = 0
        waiting: deque[int] = deque()
        prefilling: list[int] = []  # admitted, prefill not complete (in admission order)
        target: dict[int, int] = {}  # prefill target length (prompt + outputs so far)
        running = np.zeros(0, np.int64)  # decoding, in admission order
        retracted: set[int] = set()
        clock = 0.0
        step = 0
        live = n
        while live > 0:
            if self.max_steps is not None and step >= self.max_steps:
                break
            while next_arrival < n and w.arrival_s[order[next_arrival]] <= clock:
                waiting.append(int(order[next_arrival]))
                next_arrival += 1
            if not waiting and not prefilling and running.size == 0:
                if next_arrival >= n:
                    break
                clock = max(clock, float(w.arrival_s[order[next_arrival]]))
                continue
            rows = _RowBuffer()

            # Releases: finish (stop reached), abort (rare), retract (rare).
            if running.size:
                done = self.generated[running] >= w.output_len[running]
                for rid in running[done].tolist():
                    owned = int(w.prompt_len[rid] + w.output_len[rid])
                    if not w.is_spec[rid] and rng.random() < self.early_stop_prob:
                        owned -= 1  # the stop landed before the last committed token
                    owned = min(owned, int(self.length[rid]))
                    rows.add(FINISH, rid, owned, 0)
                    self._end(rid)
                running = running[~done]
            if self.abort_prob and rng.random() < self.abort_prob:
                candidates = running.tolist() + prefilling + sorted(retracted)
                if candidates:
                    rid = candidates[int(rng.integers(len(candidates)))]
                    rows.add(ABORT, rid, int(self.length[rid]), 0)
                    self._end(rid)
                    running = running[running != rid]
                    if rid in prefilling:
                        prefilling.remove(rid)
                    retracted.discard(rid)
                    if rid in waiting:
                        waiting.remove(rid)
            if self.retract_prob and running.size > 1 and rng.random() < self.retract_prob:
                rid = int(running[int(rng.integers(running.size))])
                rows.add(RETRACT, rid, int(self.length[rid]), 0)
                self.length[rid] = 0
                running = running[running != rid]
                retracted.add(rid)
                waiting.appendleft(rid)  # retracted requests go first, as in SGLang

            # Admission: prealloc arrivals take a row and decode at once; others queue for
            # prefill while this step's chunk budget is not yet spoken for.
            pending = sum(target[r] - int(self.length[r]) for r in prefilling)
            joined: list[int] = []
            while waiting and running.size + len(prefilling) + len(joined) < self.max_running:
                rid = waiting[0]
                if rid in rows.rid:
                    break  # retracted in this very step: it comes back in a later one
                resume = int(w.prompt_len[rid] + self.generated[rid])
                if w.is_prealloc[rid]:
                    waiting.popleft()
                    retracted.discard(rid)
                    fields = self._first_row_fields(rid)
                    tokens = self._ids(rid)[:resume] if w.is_explicit[rid] else None
                    rows.add(PREALLOC, rid, resume, resume, tokens=tokens, **fields)  # type: ignore[arg-type]
                    self.length[rid] = resume
                    joined.append(rid)  # decodes from the next step
                    continue
                if pending >= self.chunk_size:
                    break
                waiting.popleft()
                retracted.discard(rid)
                prefilling.append(rid)
                target[rid] = resume
                pending += resume

            # Chunked prefill.
            budget = self.chunk_size
            prefill_tokens = 0
            completed = joined
            for rid in prefilling:
                if budget <= 0:
                    break
                start = int(self.length[rid])
                chunk = min(target[rid] - start, budget)
                budget -= chunk
                end = start + chunk
                fields = self._first_row_fields(rid)
                # The matched prefix is part of the sequence: a first chunk shorter than
                # the hit records only what it holds.
                fields["prefix_len"] = min(int(fields.get("prefix_len", start)), end)  # type: ignore[call-overload]
                tokens = self._ids(rid)[start:end] if w.is_explicit[rid] else None
                rows.add(EXTEND, rid, end, chunk, tokens=tokens, **fields)  # type: ignore[arg-type]
                self.length[rid] = end
                prefill_tokens += chunk
                if end >= target[rid]:
                    completed.append(rid)
            self.prompt_tokens += prefill_tokens

            # Decode and speculative steps of requests already decoding.
            decode_part, spec_part = self._decode_rows(running)
            for rid in completed:
                if rid in target:
                    prefilling.remove(rid)
                    del target[rid]
            if completed:
                running = np.concatenate([running, np.array(completed, np.int64)])

            batch = self._assemble(step, clock, rows, decode_part, spec_part)
            if len(batch):
                self.writer.write(batch)
                np.add.at(self.op_counts, batch.op, 1)
            live = n - int(self.ended.sum())
            clock += self.step_time_s + prefill_tokens * self.prefill_token_s
            step += 1
        return step, clock

    def _end(self, rid: int) -> None:
        self.ended[rid] = True
        self.length[rid] = 0
        self.explicit_ids.pop(rid, None)

    def _decode_rows(self, running: np.ndarray) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
        w = self.w
        spec_mask = w.is_spec[running]
        decoding = running[~spec_mask]
        before = self.length[decoding]
        self.length[decoding] = before + 1
        self.generated[decoding] += 1
        self.generated_tokens += int(decoding.size)
        decode_part = (decoding, before + 1)
        speculating = running[spec_mask]
        if speculating.size == 0:
            return decode_part, (speculating, speculating, speculating, speculating)
        assert self.spec is not None
        draft = self.spec.num_draft_tokens
        most = min(draft + 1, self.spec.num_steps + 1)
        accepted = self.rng.integers(1, most + 1, speculating.size)
        before = self.length[speculating]
        self.length[speculating] = before + accepted
        self.generated[speculating] += accepted
        self.generated_tokens += int(accepted.sum())
        return decode_part, (speculating, before + accepted, accepted, np.full(speculating.size, draft))

    def _assemble(
        self,
        step: int,
        clock: float,
        rows: _RowBuffer,
        decode_part: tuple[np.ndarray, ...],
        spec_part: tuple[np.ndarray, ...],
    ) -> StepBatch:
        w = self.w
        decoding, decode_seq = decode_part
        speculating, spec_seq, accepted, draft = spec_part
        k, d, s = len(rows.op), decoding.size, speculating.size
        # Rows are built in OP_ORDER: releases (finish, abort, retract), prealloc, extend,
        # decode, spec. ``rows`` holds them in that order only after sorting its part.
        other_order = np.argsort(np.array([_RANK[o] for o in rows.op], np.int8), kind="stable")
        op = np.concatenate(
            [np.array(rows.op, np.int8)[other_order], np.full(d, DECODE, np.int8), np.full(s, SPEC, np.int8)]
        )
        rid = np.concatenate([np.array(rows.rid, np.int64)[other_order], decoding, speculating])
        seq_len = np.concatenate([np.array(rows.seq_len, np.int64)[other_order], decode_seq, spec_seq])
        append_len = np.concatenate(
            [np.array(rows.append_len, np.int32)[other_order], np.ones(d, np.int32), accepted.astype(np.int32)]
        )
        draft_len = np.concatenate([np.zeros(k + d, np.int32), draft.astype(np.int32)])
        accepted_len = np.concatenate([np.zeros(k + d, np.int32), accepted.astype(np.int32)])
        prefix_len = np.concatenate([np.array(rows.prefix_len, np.int64)[other_order], np.zeros(d + s, np.int64)])
        prompt_len = np.concatenate([np.array(rows.prompt_len, np.int64)[other_order], np.full(d + s, -1, np.int64)])
        other = other_order.tolist()
        hashes = Ragged.concat(
            [Ragged.from_rows([rows.hashes[i] for i in other], np.uint64), Ragged.empty(d + s, np.uint64)]
        )
        tokens = self._token_rows([rows.tokens[i] for i in other], decoding, speculating, accepted, decode_seq, spec_seq)
        return StepBatch(
            step, clock, op, rid, seq_len, append_len, draft_len, accepted_len,
            prefix_len, prompt_len, hashes, tokens,
        )

    def _token_rows(
        self,
        other: list[np.ndarray | None],
        decoding: np.ndarray,
        speculating: np.ndarray,
        accepted: np.ndarray,
        decode_seq: np.ndarray,
        spec_seq: np.ndarray,
    ) -> Ragged:
        w = self.w
        head = Ragged.from_rows(other, np.int64)
        explicit_decode = w.is_explicit[decoding]
        explicit_spec = w.is_explicit[speculating]
        if not explicit_decode.any() and not explicit_spec.any():
            return Ragged.concat([head, Ragged.empty(decoding.size + speculating.size, np.int64)])
        tail: list[np.ndarray | None] = []
        for rid, seq, flag in zip(decoding.tolist(), decode_seq.tolist(), explicit_decode.tolist()):
            tail.append(self._ids(rid)[seq - 1 : seq] if flag else None)
        for rid, seq, acc, flag in zip(speculating.tolist(), spec_seq.tolist(), accepted.tolist(), explicit_spec.tolist()):
            tail.append(self._ids(rid)[seq - acc : seq] if flag else None)
        return Ragged.concat([head, Ragged.from_rows(tail, np.int64)])


_RANK = {code: rank for rank, code in enumerate((FINISH, ABORT, RETRACT, PREALLOC, EXTEND, DECODE, SPEC))}


def _draw_hashes(
    rng: np.random.Generator,
    prompt_len: np.ndarray,
    block_size: int,
    *,
    prefix_groups: int,
    group_blocks: int,
    continue_prob: float,
    lookback: int,
) -> list[np.ndarray]:
    """Block hashes per request: a shared group prefix, sometimes an earlier prompt's blocks.

    Every prompt starts with the blocks of one of ``prefix_groups`` system prompts
    (``group_blocks`` long, cut to the prompt). With ``continue_prob`` a request
    continues an earlier conversation: it also repeats the full blocks of a recent
    prompt shorter than its own. The remaining blocks are fresh.
    """
    n = prompt_len.shape[0]
    num_blocks = -(-prompt_len // block_size)
    next_hash = 1 << 40  # fresh hashes; group prefixes use small values
    out: list[np.ndarray] = []
    group = rng.integers(0, max(1, prefix_groups), n)
    continues = rng.random(n) < continue_prob
    for r in range(n):
        nb = int(num_blocks[r])
        shared: np.ndarray | None = None
        if continues[r] and r > 0:
            # Of 8 recent prompts, the longest with fewer full blocks than this one.
            best = 0
            for j in rng.integers(max(0, r - lookback), r, 8).tolist():
                full = int(prompt_len[j]) // block_size
                if best < full < nb:
                    best, shared = full, out[j][:full]
        if shared is None:
            g = int(group[r])
            shared = np.arange(g * group_blocks, g * group_blocks + min(group_blocks, nb), dtype=np.uint64)
        fresh = nb - shared.shape[0]
        hashes = np.concatenate([shared, np.arange(next_hash, next_hash + fresh, dtype=np.uint64)])
        next_hash += fresh
        out.append(hashes)
    return out


def synth_meta(
    *,
    page_size: int,
    pool_tokens: int,
    max_running: int,
    max_context_len: int,
    block_size: int | None,
    chunk_size: int | None,
    spec: SpecSettings | None,
    pd_decode: bool,
    workload: str,
    extra: dict[str, object] | None = None,
) -> TraceMeta:
    """The metadata of a synthetic trace."""
    return TraceMeta(
        config=TraceConfig(
            page_size=page_size,
            pool_tokens=pool_tokens,
            max_running=max_running,
            max_context_len=max_context_len,
            chunk_size=chunk_size,
            spec=spec,
            pd_decode=pd_decode,
        ),
        source=TraceSource(engine="kvtrace.synth", workload=workload, license="Apache-2.0"),
        model=ModelShape(name="llama-3-8b", num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16"),
        block_size=block_size,
        extra=dict(extra or {}),
    )


def _open_writer(
    dest: str | os.PathLike[str] | TraceWriter,
    meta: TraceMeta,
    *,
    steps_per_batch: int,
    compression: Compression,
    overwrite: bool,
) -> tuple[TraceWriter, bool]:
    if isinstance(dest, TraceWriter):
        if dest.meta.config != meta.config or dest.meta.block_size != meta.block_size:
            raise ValueError(
                "the writer's metadata does not match the generator's settings; "
                "build it with traces.synth.synth_meta(...) or pass a path"
            )
        return dest, False
    writer = TraceWriter(
        dest, meta, steps_per_batch=steps_per_batch, compression=compression, overwrite=overwrite
    )
    return writer, True


def generate(
    dest: str | os.PathLike[str] | TraceWriter,
    *,
    num_requests: int = 32,
    seed: int = 0,
    page_size: int = 16,
    block_size: int | None = None,
    pool_tokens: int | None = None,
    max_running: int = 8,
    max_context_len: int = 2048,
    chunk_size: int | None = None,
    spec: bool | SpecSettings = False,
    spec_fraction: float = 0.5,
    pd_decode: bool = False,
    prealloc_fraction: float = 0.25,
    prompt_len: tuple[int, int] = (8, 400),
    output_len: tuple[int, int] = (1, 48),
    arrival_rate: float = 40.0,
    prefix_groups: int = 3,
    continue_prob: float = 0.3,
    retract_prob: float = 0.0,
    abort_prob: float = 0.0,
    early_stop_prob: float = 0.1,
    explicit_fraction: float = 0.0,
    max_steps: int | None = None,
    steps_per_batch: int = 4,
    compression: Compression = "zstd",
    overwrite: bool = False,
) -> SynthSummary:
    """Write a valid synthetic trace.

    Args:
        dest: a path, or an open ``TraceWriter`` whose metadata came from ``synth_meta``
            with the same settings (it is not closed).
        num_requests, seed: how many requests; the seed of every draw.
        page_size, block_size (default 2 pages), pool_tokens (default: room for
            ``max_running`` longest requests), max_running, max_context_len, chunk_size
            (default 3 pages minus 5 tokens, so chunk ends cross pages): the config.
        spec: speculative settings (True: ``SpecSettings()``); ``spec_fraction`` of the
            requests then decode speculatively (the others plainly, to exercise both).
        pd_decode: PD-disaggregated decode; ``prealloc_fraction`` of the requests arrive
            by ``prealloc``.
        prompt_len, output_len: inclusive ranges of the uniform draws.
        arrival_rate: requests per second (Poisson arrivals).
        prefix_groups, continue_prob: prefix sharing (see ``_draw_hashes``).
        retract_prob, abort_prob: per-step probability of one retraction / abort.
        early_stop_prob: chance a plain request's stop lands before its last token.
        explicit_fraction: requests whose rows carry explicit token ids (no hashes).
        max_steps: stop after this many steps (a window: requests left holding KV).
        steps_per_batch, compression, overwrite: passed to ``TraceWriter``.

    Returns:
        A ``SynthSummary``.

    Raises:
        ValueError: inconsistent settings.
        TraceWriteError: the file cannot be written.
    """
    spec_settings = SpecSettings() if spec is True else (spec or None)
    block_size = 2 * page_size if block_size is None else block_size
    chunk_size = 3 * page_size - 5 if chunk_size is None else chunk_size
    overshoot = 0 if spec_settings is None else spec_settings.num_steps + 1
    if prompt_len[1] + output_len[1] + overshoot > max_context_len:
        raise ValueError(
            f"prompt_len {prompt_len[1]} + output_len {output_len[1]} (+{overshoot} speculative) "
            f"exceeds max_context_len {max_context_len}"
        )
    if chunk_size < 1 or prompt_len[0] < 1 or output_len[0] < 1:
        raise ValueError("chunk_size, prompt_len and output_len must be at least 1")
    if pool_tokens is None:
        longest = prompt_len[1] + output_len[1] + overshoot
        pool_tokens = max_running * (-(-longest // page_size) + 2) * page_size
    rng = np.random.default_rng(seed)
    n = num_requests
    prompts = rng.integers(prompt_len[0], prompt_len[1] + 1, n).astype(np.int64)
    workload = _Workload(
        arrival_s=np.cumsum(rng.exponential(1.0 / arrival_rate, n)),
        prompt_len=prompts,
        output_len=rng.integers(output_len[0], output_len[1] + 1, n).astype(np.int64),
        is_spec=(rng.random(n) < spec_fraction) if spec_settings is not None else np.zeros(n, np.bool_),
        is_prealloc=(rng.random(n) < prealloc_fraction) if pd_decode else np.zeros(n, np.bool_),
        is_explicit=rng.random(n) < explicit_fraction,
        hashes=[],
    )
    hashes = _draw_hashes(
        rng, prompts, block_size, prefix_groups=prefix_groups,
        group_blocks=2, continue_prob=continue_prob, lookback=16,
    )
    workload.hashes.extend(None if e else h for e, h in zip(workload.is_explicit.tolist(), hashes))
    meta = synth_meta(
        page_size=page_size, pool_tokens=pool_tokens, max_running=max_running,
        max_context_len=max_context_len, block_size=block_size, chunk_size=chunk_size,
        spec=spec_settings, pd_decode=pd_decode, workload=f"synthetic (seed {seed})",
        extra={"generator": "traces.synth.generate", "seed": seed, "num_requests": n},
    )
    return _run(
        dest, meta, workload, rng, chunk_size=chunk_size, retract_prob=retract_prob,
        abort_prob=abort_prob, early_stop_prob=early_stop_prob, step_time_s=0.02,
        prefill_token_s=2e-5, max_steps=max_steps, steps_per_batch=steps_per_batch,
        compression=compression, overwrite=overwrite,
    )


def generate_mooncake_shaped(
    dest: str | os.PathLike[str] | TraceWriter,
    *,
    seed: int = 0,
    num_requests: int = 12_031,
    max_running: int = 256,
    page_size: int = 16,
    chunk_size: int = 8192,
    block_size: int = 512,
    duration_s: float = 3537.0,
    step_time_s: float = 0.2,
    steps_per_batch: int = 64,
    compression: Compression = "zstd",
    overwrite: bool = False,
) -> SynthSummary:
    """Write a trace with the token counts of the one-hour Mooncake conversation trace.

    Prompt lengths are log-normal with Mooncake's median (6,909) and mean (12,035),
    capped at 126,195; outputs are around 350 tokens (mean about 343, at most 2,000);
    arrivals are uniform over ``duration_s``; prompts share leading 512-token blocks
    so that about 36% of block references repeat an earlier block. Plain decoding
    (no speculative rows), chunked prefill of ``chunk_size`` tokens per step.

    Returns:
        A ``SynthSummary`` (its ``repeated_block_fraction`` is the measured sharing).
    """
    rng = np.random.default_rng(seed)
    n = num_requests
    sigma = np.sqrt(2.0 * np.log(12_035 / 6_909))
    prompts = np.clip(rng.lognormal(np.log(6_909), sigma, n), 1, 126_195).astype(np.int64)
    outputs = np.clip(np.rint(rng.normal(350, 120, n)), 1, 2_000).astype(np.int64)
    hashes = _draw_hashes(
        rng, prompts, block_size, prefix_groups=1, group_blocks=1,
        continue_prob=0.56, lookback=400,
    )
    workload = _Workload(
        arrival_s=np.sort(rng.uniform(0.0, duration_s, n)),
        prompt_len=prompts,
        output_len=outputs,
        is_spec=np.zeros(n, np.bool_),
        is_prealloc=np.zeros(n, np.bool_),
        is_explicit=np.zeros(n, np.bool_),
        hashes=list(hashes),
    )
    meta = synth_meta(
        page_size=page_size, pool_tokens=1_200_000, max_running=max_running,
        max_context_len=131_072, block_size=block_size, chunk_size=chunk_size, spec=None,
        pd_decode=False, workload="synthetic, shaped like the Mooncake FAST'25 conversation trace",
        extra={"generator": "traces.synth.generate_mooncake_shaped", "seed": seed, "num_requests": n},
    )
    return _run(
        dest, meta, workload, rng, chunk_size=chunk_size, retract_prob=0.0, abort_prob=0.0,
        early_stop_prob=0.0, step_time_s=step_time_s, prefill_token_s=0.0, max_steps=None,
        steps_per_batch=steps_per_batch, compression=compression, overwrite=overwrite,
    )


def _run(
    dest: str | os.PathLike[str] | TraceWriter,
    meta: TraceMeta,
    workload: _Workload,
    rng: np.random.Generator,
    *,
    chunk_size: int,
    retract_prob: float,
    abort_prob: float,
    early_stop_prob: float,
    step_time_s: float,
    prefill_token_s: float,
    max_steps: int | None,
    steps_per_batch: int,
    compression: Compression,
    overwrite: bool,
) -> SynthSummary:
    writer, owned = _open_writer(
        dest, meta, steps_per_batch=steps_per_batch, compression=compression, overwrite=overwrite
    )
    try:
        sim = _Simulator(
            writer, workload, rng, meta=meta, chunk_size=chunk_size, retract_prob=retract_prob,
            abort_prob=abort_prob, early_stop_prob=early_stop_prob, step_time_s=step_time_s,
            prefill_token_s=prefill_token_s, max_steps=max_steps,
        )
        _, duration = sim.run()
    finally:
        if owned:
            writer.close()
    return SynthSummary(
        path=str(writer.path),
        steps=writer.steps_written,
        rows=writer.rows_written,
        requests=int(sim.started.sum()),
        ops={name: int(c) for name, c in zip(OPS, sim.op_counts)},
        prompt_tokens=sim.prompt_tokens,
        generated_tokens=sim.generated_tokens,
        block_refs=sim.block_refs,
        repeated_block_refs=sim.repeated_block_refs,
        duration_s=duration,
    )
