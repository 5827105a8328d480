"""A bf16 buffer's rows plus an fp32 band of sums, stored back in bf16 rounded stochastically
(unbiased): the held gradient's bf16 buffer (nn/held_buffer.py). The Triton kernel
(triton/rounded_sum.py) and its PyTorch twin here round with the same hash bits
(core/rounding.py, slot 0 of the element hash), so the two store the same bits."""

from __future__ import annotations

import torch

from .reference import round_to_bf16

BLOCK = 1024


def add_rounded(rows: torch.Tensor, band: torch.Tensor, elem0: int, salt: int, count: torch.Tensor,
                kernel: bool, fresh: bool = False) -> None:
    """``rows`` (bf16, contiguous) = stochastic round(rows + ``band``) (fp32, same shape), in
    place. Element i of ``rows`` is element ``elem0 + i`` of the whole buffer; its bits come
    from (that index, ``salt``, ``count``), ``count`` a 0-dim int64 device tensor. ``fresh``:
    ``rows`` are new (torch.empty) and taken as zeros, not read."""
    if rows.numel() == 0 or rows.is_meta:  # meta: shapes only (benchmarks/held_bytes.py)
        return
    if not kernel:
        elem = torch.arange(elem0, elem0 + rows.numel(), device=rows.device).view(rows.shape)
        total = band if fresh else rows.float() + band
        rows.copy_(round_to_bf16(total, elem, salt, count, 0, True))
        return
    from .triton.rounded_sum import rounded_sum_kernel  # here, not at import: Triton's import is slow

    n = rows.numel()
    rounded_sum_kernel[(-(-n // BLOCK),)](rows.view(torch.int16), band, n, elem0, salt, count, BLOCK=BLOCK,
                                          FRESH=fresh)
