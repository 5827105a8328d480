"""Triton: the lean loss's row kernels (nn/loss.py): each row's log-sum-exp and target logit in
one read of the logits, and the gradient written over them in one more read and write, in
fp32 registers (docs/kernels.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096
NUM_WARPS = 8


@triton.jit
def _row_lse_kernel(logits, stride, targets, lse_out, picked_out, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    lanes = tl.arange(0, BLOCK)
    top = tl.full([BLOCK], float("-inf"), tl.float32)  # each lane's running maximum
    previous = top
    total = tl.zeros([BLOCK], tl.float32)  # and its sum of exp(x - top)
    for start in range(0, n_cols, BLOCK):
        cols = start + lanes
        x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        top = tl.maximum(top, x)
        shift = tl.where(top == float("-inf"), 0.0, top)  # a lane with nothing yet: exp(-inf) = 0, not nan
        total = total * tl.exp(previous - shift) + tl.exp(x - shift)
        previous = top
    row_top = tl.max(top, axis=0)
    row_total = tl.sum(total * tl.exp(top - tl.where(row_top == float("-inf"), 0.0, row_top)), axis=0)
    tl.store(lse_out + row, row_top + tl.log(row_total))
    target = tl.load(targets + row)
    tl.store(picked_out + row, tl.load(base + target).to(tl.float32))


@triton.jit
def _row_grad_kernel(logits, stride, targets, lse, scale, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    lanes = tl.arange(0, BLOCK)
    target = tl.load(targets + row)
    row_lse = tl.load(lse + row)
    row_scale = tl.load(scale + row)
    for start in range(0, n_cols, BLOCK):
        cols = start + lanes
        inside = cols < n_cols
        x = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
        p = tl.exp(x - row_lse)
        p = tl.where(cols == target, p - 1.0, p)
        tl.store(base + cols, (p * row_scale).to(logits.dtype.element_ty), mask=inside)


def _check(logits: torch.Tensor, targets: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1 or targets.shape != logits.shape[:1]:
        raise ValueError(f"row kernels take (rows, vocabulary) logits with contiguous rows and (rows,) targets, "
                         f"got {tuple(logits.shape)} with strides {logits.stride()} and {tuple(targets.shape)}")


def row_lse(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's fp32 log-sum-exp and its logit at ``targets`` (indices in range: the
    caller replaces ignored ones)."""
    _check(logits, targets)
    rows, cols = logits.shape
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    picked = torch.empty_like(lse)
    if rows:
        _row_lse_kernel[(rows,)](logits, logits.stride(0), targets, lse, picked, cols, BLOCK=BLOCK,
                                 num_warps=NUM_WARPS)
    return lse, picked


def row_grad_(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor) -> None:
    """``logits`` = (softmax(logits) - onehot(targets)) * scale, row by row, in place."""
    _check(logits, targets)
    rows, cols = logits.shape
    if rows:
        _row_grad_kernel[(rows,)](logits, logits.stride(0), targets, lse, scale, cols, BLOCK=BLOCK,
                                  num_warps=NUM_WARPS)
