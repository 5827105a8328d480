"""The weight-gradient buffer a held gradient moves to (held_gradient.py): fp32, each backward's
dY^T X added by cuBLAS in place (exact: the FORGE paper's Appendix L), or bf16, each backward's
sum formed in fp32 a band of rows at a time and added rounded stochastically (unbiased).

The bf16 buffer's rounding bits come from core/rounding.py's hash of (element index in the
layer's (out, in) buffer, the layer's held-gradient salt, the count of its adds). The count is
a device tensor, advanced on the device by each add: a CUDA graph's replays take fresh bits,
and the same seed gives the same bits in every run and on both backends (the Triton kernel or
its PyTorch twin, kernels/rounded_sum.py).

Transient memory of a bf16 add: one fp32 band of at most ROUND_CHUNK entries (64 MiB), plus on
the PyTorch path its hash's int64 temporaries (a few band-sized tensors).
"""

from __future__ import annotations

import torch

from ..core.rounding import held_salt
from ..kernels import add_rounded, addmm_fp32, matmul_fp32

ROUND_CHUNK = 1 << 24  # fp32 entries of a bf16 buffer's sum formed at once


class RoundedSums:
    """A bf16 buffer's rounding stream: the layer's key and the device count of its adds."""

    def __init__(self, salt: int, device: torch.device | str, kernel: bool):
        self.salt = held_salt(salt)
        self.count = torch.zeros((), dtype=torch.int64, device=device)
        self.kernel = kernel  # the Triton kernel (else its PyTorch twin)

    def on(self, device: torch.device) -> RoundedSums:
        if self.count.device != device:  # the model moved after the optimizer was built (eager)
            self.count = self.count.to(device)
        return self


def add_products(buffer: torch.Tensor, pairs: list, rounded: RoundedSums | None) -> None:
    """``buffer`` += the sum of dy^T x over ``pairs``, in place: fp32 exactly as cuBLAS adds;
    bf16 (``rounded``) with the sum formed in fp32 and rounded once a band of rows."""
    if buffer.dtype == torch.float32:
        for x, dy in pairs:
            addmm_fp32(buffer, dy.t(), x)
        return
    n, k = buffer.shape
    rows = min(n, max(1, ROUND_CHUNK // max(k, 1)))
    band = torch.empty(rows, k, dtype=torch.float32, device=buffer.device)
    (x0, dy0), rest = pairs[0], pairs[1:]
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        b = matmul_fp32(dy0[:, r0:r1].t(), x0, band[:r1 - r0])
        for x, dy in rest:
            addmm_fp32(b, dy[:, r0:r1].t(), x)
        add_rounded(buffer[r0:r1], b, r0 * k, rounded.salt, rounded.count, rounded.kernel)
    rounded.count += 1


def squared_sum(buffer: torch.Tensor) -> torch.Tensor:
    """The buffer's squared sum, fp32 (0-dim); a bf16 one read in fp32 a band at a time."""
    g = buffer.view(-1)
    if g.dtype == torch.float32:
        return torch.dot(g, g)
    total = torch.zeros((), dtype=torch.float32, device=g.device)
    for i in range(0, g.numel(), ROUND_CHUNK):
        part = g[i:i + ROUND_CHUNK].float()
        total += torch.dot(part, part)
    return total
