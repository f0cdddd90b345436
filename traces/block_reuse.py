"""How much of a content-addressed workload's prompt blocks repeat: measured on the
source itself, before any recording (``kvtrace record`` reports it beside a trace).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from traces.workload_request import WorkloadRequest

class BlockReuse(NamedTuple):
    """Prefix sharing of a content-addressed workload, measured on the source itself.

    Attributes:
        references: block references over all prompts.
        distinct: distinct blocks.
        repeated_fraction: share of references to a block seen before (any position).
        prefix_hit_fraction: share of references that continue a block chain already
            seen from the first block (a prefix hit for an unbounded, instantly
            published cache).
        token_hit_fraction: prompt tokens covered by those prefix-hit blocks (whole
            blocks, capped at ``input_len - 1`` as a radix cache caps a match), over
            all prompt tokens.
    """

    references: int
    distinct: int
    repeated_fraction: float
    prefix_hit_fraction: float
    token_hit_fraction: float


def block_reuse(requests: Iterable[WorkloadRequest]) -> BlockReuse:
    """Measure block and prefix reuse of the requests (in arrival order)."""
    seen_blocks: set[int] = set()
    seen_chains: set[int] = set()
    references = repeated = prefix_hits = 0
    hit_tokens = prompt_tokens = 0
    for req in requests:
        prompt_tokens += req.input_len
        if req.block_hashes is None or req.block_size is None:
            continue
        chain = 0
        matched = 0
        still_prefix = True
        for h in req.block_hashes.tolist():
            references += 1
            if h in seen_blocks:
                repeated += 1
            else:
                seen_blocks.add(h)
            chain = hash((chain, h))
            if still_prefix and chain in seen_chains:
                matched += 1
            else:
                still_prefix = False
                seen_chains.add(chain)
        prefix_hits += matched
        hit_tokens += min(matched * req.block_size, req.input_len - 1)
    return BlockReuse(
        references=references,
        distinct=len(seen_blocks),
        repeated_fraction=repeated / references if references else 0.0,
        prefix_hit_fraction=prefix_hits / references if references else 0.0,
        token_hit_fraction=hit_tokens / prompt_tokens if prompt_tokens else 0.0,
    )
