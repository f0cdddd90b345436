"""Page arithmetic of the KV pool: the one definition of every rounding to pages.

Each function works on a Python int, a numpy integer array (element-wise) or a torch
integer tensor alike, with integer arithmetic only (exact for any non-negative
length). Imports nothing from the package, so every allocator module can use it::

    page_size 4     length  0 1 2 3 4 5 ... 8 9
    num_pages               0 1 1 1 1 2 ... 2 3
    ceil_align              0 4 4 4 4 8 ... 8 12
    floor_align             0 0 0 0 4 4 ... 8 8
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = ["ceil_align", "floor_align", "new_page_tokens", "num_new_pages", "num_pages"]

# A length, or a batch of them (the result has the same kind).
Lengths = TypeVar("Lengths", int, "np.ndarray", "torch.Tensor")


def num_pages(length: Lengths, page_size: int) -> Lengths:
    """Pages that hold ``length`` positions: ``ceil(length / page_size)``.

    Args:
        length: positions (int, or an integer array / tensor of them).
        page_size: tokens per page (>= 1).

    Returns:
        The page count, of the same kind as ``length``.
    """
    return (length + (page_size - 1)) // page_size


def ceil_align(length: Lengths, page_size: int) -> Lengths:
    """``length`` rounded up to a whole page (the slots a row of that length holds).

    Args:
        length: positions (int, or an integer array / tensor of them).
        page_size: tokens per page (>= 1).

    Returns:
        ``num_pages(length) * page_size``, of the same kind as ``length``.
    """
    return (length + (page_size - 1)) // page_size * page_size


def floor_align(length: Lengths, page_size: int) -> Lengths:
    """``length`` rounded down to a whole page (the part a radix key keeps).

    Args:
        length: positions (int, or an integer array / tensor of them).
        page_size: tokens per page (>= 1).

    Returns:
        The aligned length, of the same kind as ``length``.
    """
    return length // page_size * page_size


def new_page_tokens(prefix_lens: Lengths, seq_lens: Lengths, page_size: int) -> Lengths:
    """Slots of the new pages a row takes growing from ``prefix_lens`` to ``seq_lens``
    positions: ``ceil_align(seq) - ceil_align(prefix)`` (page 1: ``seq - prefix``).

    Args:
        prefix_lens: positions the row holds now (int, or one per request).
        seq_lens: positions after the growth (``>= prefix_lens``).
        page_size: tokens per page.

    Returns:
        Slots per request, of the same kind as the lengths.
    """
    if page_size == 1:
        return seq_lens - prefix_lens
    return ceil_align(seq_lens, page_size) - ceil_align(prefix_lens, page_size)


def num_new_pages(prefix_lens: np.ndarray, seq_lens: np.ndarray, page_size: int) -> int:
    """Pages an extend from ``prefix_lens`` to ``seq_lens`` needs, summed over the batch
    (SGLang ``get_num_new_pages``).

    Args:
        prefix_lens: int64 ``[bs]`` positions each row holds now.
        seq_lens: int64 ``[bs]`` positions after the extend.
        page_size: tokens per page.

    Returns:
        The number of new pages of the whole batch.
    """
    return int((num_pages(seq_lens, page_size) - num_pages(prefix_lens, page_size)).sum())
