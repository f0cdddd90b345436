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
"""

from __future__ import annotations

from typing import Literal

import torch

from allocator import reference

__all__ = [
    "Backend",
    "alloc_decode",
    "alloc_extend",
    "assign_req_to_token_pool",
]

Backend = Literal["auto", "triton", "torch"]
_BACKENDS = ("auto", "triton", "torch")


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
    if backend == "auto":
        return device.type == "cuda"
    raise ValueError(
        f"backend='triton': the Triton kernels are not available in this version; "
        f"use backend='torch' or 'auto' (tensors on {device})"
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
        raise AssertionError("unreachable")
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
        raise AssertionError("unreachable")
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
        raise AssertionError("unreachable")
    return reference.alloc_decode(seq_lens, last_loc, free_pages, page_size)
