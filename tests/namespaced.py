"""A small trace whose requests share their tokens across two cache namespaces."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from tests.helpers import make_meta
from traces.batches import StepBatch
from traces.namespaces import NamespaceTable
from traces.writer import TraceWriter

PROMPT_LEN = 64
# request id -> namespace, in arrival order; each request's prompt is the same 64 tokens
NAMESPACE_OF = {0: "lora-a", 1: "lora-b", 2: "lora-a", 3: None, 4: "lora-b"}


def write_namespaced_trace(path: Path, page_size: int = 16) -> Path:
    """Requests 0..4 run one after another with one prompt: 0 in ``lora-a`` (cold), 1 in
    ``lora-b`` (cold: 0's KV is another namespace's), 2 in ``lora-a`` (reuses 0's), 3 in
    none (cold), 4 in ``lora-b`` (reuses 1's). Each prefills, decodes one token, finishes."""
    prompt = np.arange(1000, 1000 + PROMPT_LEN, dtype=np.int64)
    meta = replace(
        make_meta(page_size=page_size, pool_tokens=1024, max_running=4, max_context_len=512, block_size=None),
        namespaces=NamespaceTable.of(NAMESPACE_OF),
    )
    with TraceWriter(path, meta) as writer:
        step = 0
        for rid in NAMESPACE_OF:
            writer.write(StepBatch.from_columns(
                step, 0.1 * step, op=["extend"], rid=[rid], seq_len=[PROMPT_LEN], append_len=[PROMPT_LEN],
                prompt_len=[PROMPT_LEN], token_ids=[prompt],
            ))
            writer.write(StepBatch.from_columns(
                step + 1, 0.1 * step + 0.05, op=["decode"], rid=[rid], seq_len=[PROMPT_LEN + 1], append_len=[1],
                token_ids=[np.array([7 + rid])],
            ))
            writer.write(StepBatch.from_columns(
                step + 2, 0.1 * step + 0.08, op=["finish"], rid=[rid], seq_len=[PROMPT_LEN + 1], append_len=[0],
            ))
            step += 3
    return path
