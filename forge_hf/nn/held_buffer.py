"""The weight-gradient buffer a held gradient moves to (held_gradient.py): fp32, each backward's
dY^T X added by cuBLAS in place (exact: the FORGE paper's Appendix L), or bf16, each backward's
sum formed in fp32 a band of rows at a time and added rounded stochastically (unbiased).

The bf16 buffer's rounding bits come from core/rounding.py's hash of (element index in the
layer's (out, in) buffer, the layer's held-gradient salt, a count of backwards). The count is a
device tensor that every layer of one optimizer shares (AddCounts), advanced on the device once
a backward - by the first add of a layer that added since the last advance, so no layer adds
twice at one count and a CUDA graph's replays take fresh bits - and the layers' salts keep
their bits apart. The same seed gives the same bits in every run and on both backends (the
Triton kernel or its PyTorch twin, kernels/rounded_sum.py). A window's first add writes its
buffer (torch.empty) without reading it.

Transient memory of a bf16 add: one fp32 band of at most ROUND_CHUNK entries (64 MiB), plus on
the PyTorch path its hash's int64 temporaries (a few band-sized tensors).
"""

from __future__ import annotations

import torch

from ..core.rounding import held_salt
from ..kernels import add_rounded, addmm_fp32, matmul_fp32

ROUND_CHUNK = 1 << 24  # fp32 entries of a bf16 buffer's sum formed at once
HELD_ADDS = "forge_held_adds"  # an optimizer state dict's key of the count (AddCounts.value)


class AddCounts:
    """The count of backwards the bf16 buffers of one optimizer's layers round with, one 0-dim
    int64 tensor a device: one increment a backward instead of one an add."""

    def __init__(self):
        self.counts: dict[torch.device, torch.Tensor] = {}
        self.added: dict[torch.device, set] = {}  # the layers that added at the device's count
        self.start = 0  # a device's count before its first add (a resumed run's saved count)

    def value(self) -> int:
        """The count to save with the optimizer (checkpoints), so a resumed run rounds as the
        straight one: the devices' counts agree, each advanced once a backward."""
        return max([int(count.item()) for count in self.counts.values()], default=self.start)

    def restore(self, value: int) -> None:
        """Go on from a saved ``value`` (in place: a captured CUDA graph reads these tensors)."""
        self.start = int(value)
        for count in self.counts.values():
            count.fill_(self.start)
        for added in self.added.values():
            added.clear()

    def take(self, layer_key: int, device: torch.device | str) -> torch.Tensor:
        """The count layer ``layer_key`` adds at on ``device``: advanced first when that layer
        has added at the present count (the next backward's first add) or none has yet."""
        device = torch.device(device)
        count, added = self.counts.get(device), self.added.setdefault(device, set())
        if count is None:
            count = self.counts[device] = torch.full((), self.start, dtype=torch.int64, device=device)
        if not added or layer_key in added:
            count += 1
            added.clear()
        added.add(layer_key)
        return count


class RoundedSums:
    """A bf16 buffer's rounding stream: the layer's key and the counts it shares with the
    optimizer's other layers (its own when none is given)."""

    def __init__(self, salt: int, kernel: bool, counts: AddCounts | None = None):
        self.salt = held_salt(salt)
        self.counts = counts if counts is not None else AddCounts()
        self.kernel = kernel  # the Triton kernel (else its PyTorch twin)

    def count(self, device: torch.device) -> torch.Tensor:
        """The count of this layer's next add, on ``device`` (where the model is now)."""
        return self.counts.take(id(self), device)


def add_products(buffer: torch.Tensor, pairs: list, rounded: RoundedSums | None, fresh: bool = False) -> None:
    """``buffer`` += the sum of dy^T x over ``pairs``, in place: fp32 exactly as cuBLAS adds;
    bf16 (``rounded``) with the sum formed in fp32 and rounded once a band of rows. ``fresh``:
    the buffer is new (torch.empty) and taken as zeros, not read."""
    (x0, dy0), rest = pairs[0], pairs[1:]
    if buffer.dtype == torch.float32:
        if fresh:  # the first product written, the rest added
            matmul_fp32(dy0.t(), x0, buffer)
        for x, dy in rest if fresh else pairs:
            addmm_fp32(buffer, dy.t(), x)
        return
    n, k = buffer.shape
    rows = min(n, max(1, ROUND_CHUNK // max(k, 1)))
    band = torch.empty(rows, k, dtype=torch.float32, device=buffer.device)
    count = rounded.count(buffer.device)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        b = matmul_fp32(dy0[:, r0:r1].t(), x0, band[:r1 - r0])
        for x, dy in rest:
            addmm_fp32(b, dy[:, r0:r1].t(), x)
        add_rounded(buffer[r0:r1], b, r0 * k, rounded.salt, count, rounded.kernel, fresh)


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
