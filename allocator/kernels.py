"""Triton kernels for the allocator's hot index writes, their launchers and dispatchers.

Public dispatchers (same signatures as ``allocator.reference`` plus ``backend``):

* ``assign_req_to_token_pool``: write new slots into ``req_to_token`` rows.
* ``alloc_extend``: SGLang's paged extend layout.
* ``alloc_decode``: one slot per request for its next token.

``backend="auto"`` runs Triton when the tensors are on CUDA and the plain-torch
reference otherwise; ``"torch"`` always runs the reference; ``"triton"`` insists on
Triton (CUDA tensors, or CPU tensors when the kernels were decorated under
``TRITON_INTERPRET=1``). Every dispatcher checks types, shapes, dtypes, contiguity
and devices first and raises ``ValueError`` on misuse, whatever the backend.

Kernel design. ``assign_req_to_token_pool`` and ``alloc_extend`` run one program per
request, looping over its span in blocks of ``_BLOCK`` tokens, so any extend length
is fine. Each program needs its request's offset into the flat output (and, for
extend, into ``free_pages``): the exclusive prefix sums over earlier requests. Up to
``_INLINE_OFFSETS_MAX_REQS`` requests each program sums them itself over a padded
power-of-two window (one launch); beyond that a single-program scan kernel writes
them first (two launches, linear work), so 10,000-request batches stay cheap.
``alloc_decode`` is one program scanning the batch in blocks. Nothing reads a value
back to the host (no sync) unless ``alloc_extend`` is called without ``out_indices``.
"""

from __future__ import annotations

import contextlib
from typing import Literal

import torch
import triton
import triton.language as tl

from allocator import reference

__all__ = [
    "TRITON_INTERPRETED",
    "Backend",
    "alloc_decode",
    "alloc_extend",
    "assign_req_to_token_pool",
]

Backend = Literal["auto", "triton", "torch"]
_BACKENDS = ("auto", "triton", "torch")


# ------------------------------------------------------------------------------ kernels

_BLOCK = 512  # tokens per block in the per-request loops
_SCAN_BLOCK = 1024  # requests per block in the single-program scans
_INLINE_OFFSETS_MAX_REQS = 1024  # larger batches get their offsets from the scan kernel
_MIN_INLINE_WINDOW = 16  # smallest padded window: fewer compiled variants

# NOTE: pointer and count arguments are not specialised: callers pass slices of
# free lists and of shared staging buffers whose alignment changes from call to
# call, and specialising on it would compile each kernel again for every pattern.


@triton.jit(do_not_specialize=["hi_ptr", "lo_ptr", "token_starts_ptr", "page_starts_ptr", "num_reqs"])
def _request_offsets_kernel(
    hi_ptr,
    lo_ptr,
    token_starts_ptr,
    page_starts_ptr,
    num_reqs,
    PAGE_SIZE: tl.constexpr,
    WITH_PAGES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program: exclusive prefix sums over requests of (hi - lo) tokens and, with
    # WITH_PAGES, of the pages they add (ceil(hi/ps) - ceil(lo/ps)).
    token_carry = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), axis=0)
    page_carry = token_carry
    for block_start in range(0, num_reqs, BLOCK):
        idx = block_start + tl.arange(0, BLOCK)
        mask = idx < num_reqs
        hi = tl.load(hi_ptr + idx, mask=mask, other=0)
        lo = tl.load(lo_ptr + idx, mask=mask, other=0)
        lens = hi - lo
        tl.store(token_starts_ptr + idx, token_carry + tl.cumsum(lens, axis=0) - lens, mask=mask)
        token_carry += tl.sum(lens, axis=0)
        if WITH_PAGES:
            pages = (hi + PAGE_SIZE - 1) // PAGE_SIZE - (lo + PAGE_SIZE - 1) // PAGE_SIZE
            tl.store(page_starts_ptr + idx, page_carry + tl.cumsum(pages, axis=0) - pages, mask=mask)
            page_carry += tl.sum(pages, axis=0)


@triton.jit(
    do_not_specialize=[
        "req_pool_indices_ptr", "start_offsets_ptr", "end_offsets_ptr", "out_cache_loc_ptr", "out_starts_ptr",
        "num_out", "num_rows",
    ]
)
def _assign_req_to_token_pool_kernel(
    req_to_token_ptr,
    req_pool_indices_ptr,
    start_offsets_ptr,
    end_offsets_ptr,
    out_cache_loc_ptr,
    out_starts_ptr,
    num_out,
    num_rows,
    row_width,
    row_stride,
    INLINE_WINDOW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    start = tl.load(start_offsets_ptr + pid)
    end = tl.load(end_offsets_ptr + pid)
    row = tl.load(req_pool_indices_ptr + pid)
    if INLINE_WINDOW > 0:
        idx = tl.arange(0, INLINE_WINDOW)
        before = idx < pid
        ends_before = tl.load(end_offsets_ptr + idx, mask=before, other=0)
        starts_before = tl.load(start_offsets_ptr + idx, mask=before, other=0)
        out_start = tl.sum(ends_before - starts_before, axis=0)
    else:
        out_start = tl.load(out_starts_ptr + pid)
    # NOTE: never write outside the row or the table (the caller reports overflow):
    # positions from col_end on are skipped, all of them when the row is not a row.
    # (Masks combine tensors only: the interpreter rejects scalar & tensor masks.)
    row_ok = ((row >= 0) & (row < num_rows)).to(tl.int64)
    col_end = tl.minimum(end, row_width) * row_ok
    row_base = req_to_token_ptr + row * row_stride
    span_len = (end - start).to(tl.int32)
    for block_start in range(0, span_len, BLOCK):
        j = block_start + tl.arange(0, BLOCK)
        out_pos = out_start + j
        in_span = (j < span_len) & (out_pos < num_out)
        slots = tl.load(out_cache_loc_ptr + out_pos, mask=in_span, other=0)
        col = start + j
        in_row = in_span & (col >= 0) & (col < col_end)
        tl.store(row_base + col, slots.to(req_to_token_ptr.dtype.element_ty), mask=in_row)


@triton.jit(
    do_not_specialize=[
        "prefix_lens_ptr", "seq_lens_ptr", "last_loc_ptr", "free_pages_ptr", "out_ptr", "out_starts_ptr",
        "page_starts_ptr", "num_free_pages", "num_out",
    ]
)
def _alloc_extend_kernel(
    prefix_lens_ptr,
    seq_lens_ptr,
    last_loc_ptr,
    free_pages_ptr,
    out_ptr,
    out_starts_ptr,
    page_starts_ptr,
    num_free_pages,
    num_out,
    PAGE_SIZE: tl.constexpr,
    INLINE_WINDOW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    prefix_len = tl.load(prefix_lens_ptr + pid)
    seq_len = tl.load(seq_lens_ptr + pid)
    if INLINE_WINDOW > 0:
        idx = tl.arange(0, INLINE_WINDOW)
        before = idx < pid
        prefix_before = tl.load(prefix_lens_ptr + idx, mask=before, other=0)
        seq_before = tl.load(seq_lens_ptr + idx, mask=before, other=0)
        out_start = tl.sum(seq_before - prefix_before, axis=0)
        pages_before = (seq_before + PAGE_SIZE - 1) // PAGE_SIZE - (prefix_before + PAGE_SIZE - 1) // PAGE_SIZE
        page_start = tl.sum(pages_before, axis=0)
    else:
        out_start = tl.load(out_starts_ptr + pid)
        page_start = tl.load(page_starts_ptr + pid)
    # Part 1 (the rest of the old partial page) continues at last_loc + 1; every later
    # token sits at offset rel % ps of the (rel // ps)-th new page, which covers both
    # the whole new pages (part 2) and the start of the last one (part 3).
    num_part1 = tl.minimum(seq_len, (prefix_len + PAGE_SIZE - 1) // PAGE_SIZE * PAGE_SIZE) - prefix_len
    part1_base = tl.load(last_loc_ptr + pid) + 1
    extend_len = (seq_len - prefix_len).to(tl.int32)
    for block_start in range(0, extend_len, BLOCK):
        j = block_start + tl.arange(0, BLOCK)
        in_extend = j < extend_len
        rel = j - num_part1
        in_new_pages = rel >= 0
        rel = tl.maximum(rel, 0)
        page_idx = page_start + rel // PAGE_SIZE
        page_ok = in_extend & in_new_pages & (page_idx < num_free_pages)
        pages = tl.load(free_pages_ptr + page_idx, mask=page_ok, other=0)
        new_page_slots = tl.where(page_ok, pages * PAGE_SIZE + rel % PAGE_SIZE, -1)
        slots = tl.where(in_new_pages, new_page_slots, part1_base + j)
        out_pos = out_start + j
        tl.store(out_ptr + out_pos, slots, mask=in_extend & (out_pos < num_out))


@triton.jit(
    do_not_specialize=["seq_lens_ptr", "last_loc_ptr", "free_pages_ptr", "out_ptr", "num_reqs", "num_free_pages"]
)
def _alloc_decode_kernel(
    seq_lens_ptr,
    last_loc_ptr,
    free_pages_ptr,
    out_ptr,
    num_reqs,
    num_free_pages,
    PAGE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program: requests needing a page take them in batch order (a running rank).
    page_carry = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), axis=0)
    for block_start in range(0, num_reqs, BLOCK):
        idx = block_start + tl.arange(0, BLOCK)
        mask = idx < num_reqs
        seq_len = tl.load(seq_lens_ptr + idx, mask=mask, other=1)
        last_loc = tl.load(last_loc_ptr + idx, mask=mask, other=0)
        needs_page = (mask & ((seq_len - 1) % PAGE_SIZE == 0)).to(tl.int64)
        page_rank = page_carry + tl.cumsum(needs_page, axis=0) - needs_page
        page_carry += tl.sum(needs_page, axis=0)
        page_ok = (needs_page > 0) & (page_rank < num_free_pages)
        pages = tl.load(free_pages_ptr + page_rank, mask=page_ok, other=0)
        new_page_slots = tl.where(page_ok, pages * PAGE_SIZE, -1)
        tl.store(out_ptr + idx, tl.where(needs_page > 0, new_page_slots, last_loc + 1), mask=mask)


# Kernels decorated under TRITON_INTERPRET=1 run on CPU tensors (tests only).
TRITON_INTERPRETED = type(_alloc_extend_kernel).__name__ == "InterpretedFunction"


def _inline_window(num_reqs: int, inline_offsets: bool | None) -> int:
    """Padded power-of-two window for in-kernel offsets, or 0 to use the scan kernel."""
    if inline_offsets is None:
        inline_offsets = num_reqs <= _INLINE_OFFSETS_MAX_REQS
    if not inline_offsets:
        return 0
    return max(_MIN_INLINE_WINDOW, triton.next_power_of_2(num_reqs))


def _on_device(device: torch.device) -> contextlib.AbstractContextManager[object]:
    # Triton launches on the current CUDA device; follow the tensors.
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


# ---------------------------------------------------------------------------- launchers
# Arguments are already checked by the dispatchers below.


def _launch_assign_req_to_token_pool(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    start_offsets: torch.Tensor,
    end_offsets: torch.Tensor,
    out_cache_loc: torch.Tensor,
    inline_offsets: bool | None = None,
) -> None:
    num_reqs = req_pool_indices.shape[0]
    if num_reqs == 0 or out_cache_loc.numel() == 0:
        return
    window = _inline_window(num_reqs, inline_offsets)
    with _on_device(req_to_token.device):
        if window:
            out_starts = start_offsets  # unused by the kernel
        else:
            out_starts = torch.empty(num_reqs, dtype=torch.int64, device=req_to_token.device)
            _request_offsets_kernel[(1,)](
                end_offsets, start_offsets, out_starts, out_starts, num_reqs,
                PAGE_SIZE=1, WITH_PAGES=False, BLOCK=_SCAN_BLOCK,
            )
        _assign_req_to_token_pool_kernel[(num_reqs,)](
            req_to_token, req_pool_indices, start_offsets, end_offsets, out_cache_loc, out_starts,
            out_cache_loc.numel(), req_to_token.shape[0], req_to_token.shape[1], req_to_token.stride(0),
            INLINE_WINDOW=window, BLOCK=_BLOCK,
        )


def _launch_alloc_extend(
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    page_size: int,
    out_indices: torch.Tensor,
    inline_offsets: bool | None = None,
) -> torch.Tensor:
    num_reqs = seq_lens.shape[0]
    if num_reqs == 0 or out_indices.numel() == 0:
        return out_indices
    window = _inline_window(num_reqs, inline_offsets)
    with _on_device(seq_lens.device):
        if window:
            out_starts = page_starts = seq_lens  # unused by the kernel
        else:
            starts = torch.empty((2, num_reqs), dtype=torch.int64, device=seq_lens.device)
            out_starts, page_starts = starts[0], starts[1]
            _request_offsets_kernel[(1,)](
                seq_lens, prefix_lens, out_starts, page_starts, num_reqs,
                PAGE_SIZE=page_size, WITH_PAGES=True, BLOCK=_SCAN_BLOCK,
            )
        _alloc_extend_kernel[(num_reqs,)](
            prefix_lens, seq_lens, last_loc, free_pages, out_indices, out_starts, page_starts,
            free_pages.numel(), out_indices.numel(),
            PAGE_SIZE=page_size, INLINE_WINDOW=window, BLOCK=_BLOCK,
        )
    return out_indices


def _launch_alloc_decode(
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    page_size: int,
) -> torch.Tensor:
    num_reqs = seq_lens.shape[0]
    out_indices = torch.empty(num_reqs, dtype=torch.int64, device=seq_lens.device)
    if num_reqs == 0:
        return out_indices
    with _on_device(seq_lens.device):
        _alloc_decode_kernel[(1,)](
            seq_lens, last_loc, free_pages, out_indices, num_reqs, free_pages.numel(),
            PAGE_SIZE=page_size, BLOCK=_SCAN_BLOCK,
        )
    return out_indices


# ----------------------------------------------------------------------------- checks


def _check_vector(name: str, tensor: object, length: int | None, device: torch.device | None) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, found {type(tensor).__name__}")
    if tensor.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor, found shape {tuple(tensor.shape)}")
    if tensor.dtype != torch.int64:
        raise ValueError(f"{name}: expected dtype torch.int64, found {tensor.dtype}")
    if length is not None and tensor.shape[0] != length:
        raise ValueError(f"{name}: expected {length} elements (one per request), found {tensor.shape[0]}")
    if tensor.numel() > 1 and tensor.stride(0) != 1:
        raise ValueError(f"{name}: expected a contiguous tensor, found stride {tensor.stride(0)}; call .contiguous()")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name}: expected device {device} (like the other arguments), found {tensor.device}")
    return tensor


def _check_page_size(page_size: object) -> int:
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size: expected an int >= 1, found {page_size!r}")
    return page_size


def _check_backend(backend: str) -> None:
    if backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(_BACKENDS)}, found {backend!r}")


def _use_triton(backend: str, device: torch.device) -> bool:
    _check_backend(backend)
    if backend == "torch":
        return False
    if backend == "auto" or device.type == "cuda":
        return device.type == "cuda"
    if TRITON_INTERPRETED and device.type == "cpu":
        return True
    raise ValueError(
        f"backend='triton': needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 set "
        f"before allocator.kernels is imported); found tensors on {device}"
    )


# ------------------------------------------------------------------------- dispatchers


def assign_req_to_token_pool(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    start_offsets: torch.Tensor,
    end_offsets: torch.Tensor,
    out_cache_loc: torch.Tensor,
    *,
    backend: Backend = "auto",
) -> None:
    """Write each request's new KV slots into its ``req_to_token`` row (in place).

    Semantics, preconditions and the row-bound safety rule: see
    ``allocator.reference.assign_req_to_token_pool``.

    Args:
        req_to_token: int32 or int64 ``[num_rows, row_width]``, unit stride along a row.
        req_pool_indices: int64 ``[bs]`` row of each request.
        start_offsets: int64 ``[bs]`` first row position written.
        end_offsets: int64 ``[bs]`` one past the last row position written.
        out_cache_loc: int64 ``[sum(end - start)]`` slots, requests in batch order.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Raises:
        ValueError: an argument has the wrong type, shape, dtype, layout or device.
    """
    if not isinstance(req_to_token, torch.Tensor):
        raise ValueError(f"req_to_token: expected a torch.Tensor, found {type(req_to_token).__name__}")
    if req_to_token.dim() != 2:
        raise ValueError(f"req_to_token: expected a 2-D tensor, found shape {tuple(req_to_token.shape)}")
    if req_to_token.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"req_to_token: expected dtype torch.int32 or torch.int64, found {req_to_token.dtype}")
    if req_to_token.shape[1] > 1 and req_to_token.stride(1) != 1:
        raise ValueError(f"req_to_token: expected unit stride along a row, found strides {req_to_token.stride()}")
    device = req_to_token.device
    bs = _check_vector("req_pool_indices", req_pool_indices, None, device).shape[0]
    _check_vector("start_offsets", start_offsets, bs, device)
    _check_vector("end_offsets", end_offsets, bs, device)
    _check_vector("out_cache_loc", out_cache_loc, None, device)
    if _use_triton(backend, device):
        _launch_assign_req_to_token_pool(req_to_token, req_pool_indices, start_offsets, end_offsets, out_cache_loc)
        return
    reference.assign_req_to_token_pool(req_to_token, req_pool_indices, start_offsets, end_offsets, out_cache_loc)


def alloc_extend(
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    page_size: int,
    out_indices: torch.Tensor | None = None,
    *,
    backend: Backend = "auto",
) -> torch.Tensor:
    """KV slots for extending each request from ``prefix_lens[i]`` to ``seq_lens[i]``.

    Layout, preconditions and the short-``free_pages`` rule: see
    ``allocator.reference.alloc_extend``. The caller checks there are enough pages
    and removes ``sum(ceil(seq/ps) - ceil(prefix/ps))`` pages from its free list.

    Args:
        prefix_lens: int64 ``[bs]``.
        seq_lens: int64 ``[bs]``.
        last_loc: int64 ``[bs]`` slot of position ``prefix_len - 1``, or -1.
        free_pages: int64 ``[num_free_pages]`` page ids, head first.
        page_size: tokens per page (>= 1).
        out_indices: optional int64 output ``[sum(seq - prefix)]``; without it the
            total is read back from the device (one sync).
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Returns:
        int64 ``[sum(seq - prefix)]`` slots, requests in batch order.

    Raises:
        ValueError: an argument has the wrong type, shape, dtype, layout or device.
    """
    page_size = _check_page_size(page_size)
    device = _check_vector("seq_lens", seq_lens, None, None).device
    bs = seq_lens.shape[0]
    _check_vector("prefix_lens", prefix_lens, bs, device)
    _check_vector("last_loc", last_loc, bs, device)
    _check_vector("free_pages", free_pages, None, device)
    if out_indices is not None:
        _check_vector("out_indices", out_indices, None, device)
    if _use_triton(backend, device):
        if out_indices is None:
            num_tokens = int((seq_lens - prefix_lens).sum().item()) if bs else 0
            out_indices = torch.empty(num_tokens, dtype=torch.int64, device=device)
        return _launch_alloc_extend(prefix_lens, seq_lens, last_loc, free_pages, page_size, out_indices)
    return reference.alloc_extend(prefix_lens, seq_lens, last_loc, free_pages, page_size, out_indices)


def alloc_decode(
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    page_size: int,
    *,
    backend: Backend = "auto",
) -> torch.Tensor:
    """One KV slot per request for its next decode token (``seq_lens`` after the token).

    Semantics: see ``allocator.reference.alloc_decode``.

    Args:
        seq_lens: int64 ``[bs]`` lengths after the new token (>= 1).
        last_loc: int64 ``[bs]`` slot of position ``seq_len - 2``.
        free_pages: int64 ``[num_free_pages]`` page ids, head first.
        page_size: tokens per page (>= 1).
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Returns:
        int64 ``[bs]`` slots.

    Raises:
        ValueError: an argument has the wrong type, shape, dtype, layout or device.
    """
    page_size = _check_page_size(page_size)
    device = _check_vector("seq_lens", seq_lens, None, None).device
    _check_vector("last_loc", last_loc, seq_lens.shape[0], device)
    _check_vector("free_pages", free_pages, None, device)
    if _use_triton(backend, device):
        return _launch_alloc_decode(seq_lens, last_loc, free_pages, page_size)
    return reference.alloc_decode(seq_lens, last_loc, free_pages, page_size)
