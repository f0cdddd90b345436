"""SGLang's speculative bookkeeping as it was before PR #29432: kept by the caller.

Before #29432 moved every ``kv_allocated_len`` update into the function that makes
the allocation, SGLang's speculative reserve took the slots in one place
(``take_spec_slots`` here: evict, allocate ``row[cur:nxt]``, write the row) and the
caller updated ``req.kv_allocated_len = nxt`` at the call site. The page-1 call site
did; the paged one forgot (SGLang #13741 / #13826). Then a request's recorded
allocation stays behind what it physically holds, the next step reserves the same
positions again (overwriting the row), and at release ``[ceil_align(owned),
allocated)`` misses the slots past the stale length: over-allocated slots that are
never released, a leak that grows with every speculative step until the pool runs
out.

``PreEncapsulationAllocator`` is the built-in allocator with that structure (the
``pre-encapsulation`` version of ``kvtrace diff``): identical at page size 1,
diverging at the first speculative step that reserves pages at page size > 1::

    kvtrace diff sample:mooncake-eagle --a builtin --b pre-encapsulation
"""

from __future__ import annotations

import numpy as np

from allocator.allocation import SpecPlan, SpecResult, record_spec_reserve, take_spec_slots
from allocator.base import AllocatorConfig, OutOfMemory
from allocator.manager import KvAllocator

__all__ = ["PreEncapsulationAllocator", "create_allocator"]


class PreEncapsulationAllocator(KvAllocator):
    """``KvAllocator`` whose speculative bookkeeping is updated at the call site, and
    only on the page-1 path (the paged path forgets it, as SGLang did)."""

    def _reserve_spec(self, rows: np.ndarray, plan: SpecPlan, rids: np.ndarray) -> SpecResult | OutOfMemory:
        ctx = self.ctx
        res = take_spec_slots(ctx, rows, plan, rids)
        if isinstance(res, SpecResult) and res.num_tokens and ctx.page_size == 1:
            record_spec_reserve(ctx, rows, plan, res.taken)  # the call site's bookkeeping
        return res


def create_allocator(config: AllocatorConfig) -> PreEncapsulationAllocator:
    """The pre-encapsulation variant for ``config``."""
    return PreEncapsulationAllocator(config)
