"""Plain-torch versions of the allocator's index kernels (exact, vectorised, any device).

These are the semantics; ``allocator.kernels`` holds the Triton versions and the
dispatchers that pick one or the other. Both must agree bit for bit on every input
that meets the preconditions below (and on the documented safety behaviour when an
input does not): the Triton kernels are tested against these functions.

Every function here builds its per-token index tensors with ``repeat_interleave``,
``cumsum`` and broadcasting: no Python loop over requests or tokens. None of them
checks argument types or shapes; the dispatchers in ``allocator.kernels`` do that.

Paged extend layout (SGLang's ``alloc_extend``) of one request, page size 4,
``prefix_len`` 6, ``seq_len`` 15 (``|`` page boundaries, ``p`` prefix, numbers the
part each new token goes to)::

    position   0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 14 15
               p p p p | p p 1 1 | 2 2  2  2 | 3  3  3  .
               old pages   old     new page     new page (last),
                           partial              tail slot unused

Part 1 continues the old partial page at ``last_loc + 1`` (``last_loc`` is the slot
of position ``prefix_len - 1``); part 2 fills whole new pages; part 3 starts the
last new page. New pages come from the head of ``free_pages`` in request order.
"""

from __future__ import annotations

import torch

from allocator.pages import ceil_align, num_pages

__all__ = [
    "alloc_decode",
    "alloc_extend",
    "assign_req_to_token_pool",
]


def _exclusive_cumsum(values: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(values, 0) - values


def _page_slots(free_pages: torch.Tensor, page_idx: torch.Tensor, offsets: torch.Tensor | int, page_size: int) -> torch.Tensor:
    """``free_pages[page_idx] * page_size + offsets``, or -1 where ``page_idx`` is past
    the end of ``free_pages`` (``page_idx`` is never negative here).

    NOTE: reading -1 instead of out of bounds is the documented behaviour of both
    backends when the caller passes too few pages.
    """
    num_free_pages = free_pages.numel()
    if num_free_pages == 0:
        return torch.full_like(page_idx, -1)
    pages = free_pages[page_idx.clamp(max=num_free_pages - 1)]
    return torch.where(page_idx < num_free_pages, pages * page_size + offsets, -1)


def assign_req_to_token_pool(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    start_offsets: torch.Tensor,
    end_offsets: torch.Tensor,
    out_cache_loc: torch.Tensor,
) -> None:
    """Write each request's new KV slots into its ``req_to_token`` row.

    For each request ``i``:
    ``req_to_token[req_pool_indices[i], start_offsets[i]:end_offsets[i]] =
    out_cache_loc[o_i : o_i + end_offsets[i] - start_offsets[i]]`` with
    ``o_i = sum(end_offsets[j] - start_offsets[j] for j < i)``.

    Preconditions (not checked; the caller knows the lengths on the host):
    ``0 <= start_offsets <= end_offsets`` element-wise and
    ``out_cache_loc.numel() == sum(end_offsets - start_offsets)``; no two requests
    write the same row position; slots fit in the table's dtype.

    NOTE: the writer never writes outside a row: positions at or past the row width
    (``req_to_token.shape[1]``), negative positions and rows outside the table are
    skipped. The caller reports such a request (``AllocResult.row_overflow``).

    Args:
        req_to_token: int32 or int64 ``[num_rows, row_width]``, written in place.
        req_pool_indices: int64 ``[bs]`` row of each request.
        start_offsets: int64 ``[bs]`` first row position written.
        end_offsets: int64 ``[bs]`` one past the last row position written.
        out_cache_loc: int64 ``[sum(end - start)]`` slots, requests in batch order.
    """
    num_tokens = out_cache_loc.numel()
    if num_tokens == 0:
        return
    num_rows, row_width = req_to_token.shape
    span_lens = end_offsets - start_offsets
    # Position of output token t (request i) in its row: t - o_i + start_i.
    col_base = start_offsets - _exclusive_cumsum(span_lens)
    col_base_per_token = torch.repeat_interleave(col_base, span_lens, output_size=num_tokens)
    rows = torch.repeat_interleave(req_pool_indices, span_lens, output_size=num_tokens)
    cols = col_base_per_token + torch.arange(num_tokens, dtype=torch.int64, device=out_cache_loc.device)
    inside = (cols >= 0) & (cols < row_width) & (rows >= 0) & (rows < num_rows)
    values = out_cache_loc.to(req_to_token.dtype)
    req_to_token[rows[inside], cols[inside]] = values[inside]


def alloc_extend(
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    page_size: int,
    out_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """KV slots for extending each request from ``prefix_lens[i]`` to ``seq_lens[i]`` tokens.

    SGLang's paged extend layout (see the module docstring). Per request, in batch
    order: ``ceil(seq/ps) - ceil(prefix/ps)`` new pages are taken from the head of
    ``free_pages``; Part 1 writes ``min(seq, ceil_align(prefix)) - prefix`` slots at
    ``last_loc + 1, last_loc + 2, ...``; if that did not reach ``seq``, Part 2 writes
    ``floor_align(seq) - ceil_align(prefix)`` slots on whole new pages and Part 3
    ``seq - floor_align(seq)`` slots at the start of the last new page. The slot of
    (page ``p``, offset ``o``) is ``p * page_size + o``. With ``page_size == 1`` this
    is simply the first ``sum(seq - prefix)`` entries of ``free_pages`` in order.

    The function only computes the slots: the caller checks beforehand that
    ``free_pages`` holds at least ``sum(ceil(seq/ps) - ceil(prefix/ps))`` pages and
    afterwards removes that many from the head of its free list. NOTE: if it holds
    fewer, slots that would come from the missing pages are -1 (never an
    out-of-bounds read).

    Preconditions (not checked): ``0 <= prefix_lens <= seq_lens``; ``last_loc[i]`` is
    the slot of position ``prefix_lens[i] - 1`` where the prefix is not page aligned
    (its value is unused otherwise); ``out_indices``, when given, has exactly
    ``sum(seq - prefix)`` elements.

    Args:
        prefix_lens: int64 ``[bs]`` tokens each request already holds.
        seq_lens: int64 ``[bs]`` tokens each request holds after the extend.
        last_loc: int64 ``[bs]`` slot of position ``prefix_len - 1``, or -1.
        free_pages: int64 ``[num_free_pages]`` page ids, head first.
        page_size: tokens per page (>= 1).
        out_indices: optional int64 output ``[sum(seq - prefix)]``. Passing it avoids
            reading the total length back from the device.

    Returns:
        int64 ``[sum(seq - prefix)]`` slots, requests in batch order (``out_indices``
        when given).
    """
    extend_lens = seq_lens - prefix_lens
    if out_indices is None:
        num_tokens = int(extend_lens.sum().item()) if extend_lens.numel() else 0
        out_indices = torch.empty(num_tokens, dtype=torch.int64, device=seq_lens.device)
    num_tokens = out_indices.numel()
    if num_tokens == 0:
        return out_indices

    ceil_prefix = ceil_align(prefix_lens, page_size)
    num_new_pages = num_pages(seq_lens, page_size) - num_pages(prefix_lens, page_size)
    page_starts = _exclusive_cumsum(num_new_pages)
    out_starts = _exclusive_cumsum(extend_lens)
    num_part1 = torch.minimum(seq_lens, ceil_prefix) - prefix_lens

    # For output token t of request i: local = t - out_starts[i] is its index in the
    # extend; rel = local - num_part1[i] its index past the old partial page.
    token_idx = torch.arange(num_tokens, dtype=torch.int64, device=out_indices.device)
    part1_base = torch.repeat_interleave(last_loc + 1 - out_starts, extend_lens, output_size=num_tokens)
    rel = token_idx + torch.repeat_interleave(-out_starts - num_part1, extend_lens, output_size=num_tokens)
    page_start_per_token = torch.repeat_interleave(page_starts, extend_lens, output_size=num_tokens)

    in_new_pages = rel >= 0
    rel = rel.clamp(min=0)
    new_page_slots = _page_slots(free_pages, page_start_per_token + rel // page_size, rel % page_size, page_size)
    torch.where(in_new_pages, new_page_slots, part1_base + token_idx, out=out_indices)
    return out_indices


def alloc_decode(
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    page_size: int,
) -> torch.Tensor:
    """One KV slot per request for its next decode token.

    ``seq_lens`` are the lengths AFTER the new token. A request needs a new page iff
    ``(seq_len - 1) % page_size == 0``; those requests take pages from the head of
    ``free_pages`` in batch order and get the page's first slot; every other request
    gets ``last_loc + 1``. With ``page_size == 1`` request ``i`` gets ``free_pages[i]``.

    As for ``alloc_extend``, the caller checks there are enough pages and removes the
    used ones (``sum((seq_lens - 1) % page_size == 0)``) from its free list; slots of
    missing pages are -1. Precondition (not checked): ``seq_lens >= 1``.

    Args:
        seq_lens: int64 ``[bs]`` lengths after the new token.
        last_loc: int64 ``[bs]`` slot of position ``seq_len - 2`` (unused on a new page).
        free_pages: int64 ``[num_free_pages]`` page ids, head first.
        page_size: tokens per page (>= 1).

    Returns:
        int64 ``[bs]`` slots.
    """
    needs_page = ((seq_lens - 1) % page_size == 0).to(torch.int64)
    page_rank = _exclusive_cumsum(needs_page)
    new_page_slots = _page_slots(free_pages, page_rank, 0, page_size)
    return torch.where(needs_page.bool(), new_page_slots, last_loc + 1)
