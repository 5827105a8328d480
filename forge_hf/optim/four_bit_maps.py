"""Candidate 4-bit state maps for the fidelity study (quantization.trajectory_report): each a
store-and-load of one state in groups of a row with a bf16 scale (rounded up, so a group's
values normalise into [-1, 1]) and stochastic or nearest rounding in the value domain. Torch
only: they choose the format; the chosen one lives in core/codecs.py for both backends.

Signed maps: a sign and 3 magnitude bits (magnitudes with 0). Never-negative maps: 16
magnitudes with no zero code (a small v never becomes 0 under 1/sqrt(v)), or ``lin0`` with
a zero code, to show that zero point; ``al4``: a geometric grid per group from its least
positive value to its largest (two bf16 words a group). ``factored``: a never-negative state
kept as its row and column sums only (state_precision="log4_factored", core/factored.py).
"""

from __future__ import annotations

import torch

from ..core.factored import rank1

_C8, _C16 = torch.arange(8.0), torch.arange(16.0)
SIGNED_MAPS = {  # magnitude grids in [0, 1], 8 entries
    "lin": _C8 / 7,
    "pow2": (_C8 / 7) ** 2,
    "pow3": (_C8 / 7) ** 3,
    "log2": torch.cat([torch.zeros(1), torch.exp2(_C8[1:] - 7)]),
}
UNSIGNED_MAPS = {  # 16 entries in (0, 1]; lin0 keeps a zero code
    "lin0": _C16 / 15,
    "lin": (_C16 + 1) / 16,
    "pow2": ((_C16 + 1) / 16) ** 2,
    "pow4": ((_C16 + 1) / 16) ** 4,
    "log2": torch.exp2(_C16 - 15),
}


def _bf16_up(s: torch.Tensor) -> torch.Tensor:
    """The least bf16 value >= s (s >= 0), as fp32."""
    return ((s.view(torch.int32) + 0xFFFF) & ~0xFFFF).view(torch.float32)


def _grouped(x: torch.Tensor, group: int) -> tuple[torch.Tensor, int]:
    rows, cols = x.shape
    pad = -cols % group
    return torch.nn.functional.pad(x, (0, pad)).reshape(rows, -1, group), cols


def _round_on_grid(y: torch.Tensor, grid: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """y in [0, 1] onto ``grid`` (sorted): up from the grid value below with probability equal
    to the position between the two (u uniform; 0.5 rounds to nearest); below grid[0], up."""
    lower = torch.searchsorted(grid, y.contiguous(), right=True) - 1
    lo = grid[lower.clamp(0, len(grid) - 1)]
    hi = grid[(lower + 1).clamp(0, len(grid) - 1)]
    up = (y - lo) > u * (hi - lo)
    return torch.where(lower < 0, grid[0], torch.where(up, hi, lo))


class WeylDither:
    """Rounding thresholds for the successive stores of one state: a random offset per element
    plus the store's count times the golden ratio, mod 1 (a Weyl sequence). Each threshold is
    uniform, so the rounding stays unbiased, but an element's thresholds cover [0, 1) evenly
    over successive stores, so the rounding errors of a slowly moving value cancel sooner than
    independent draws' do: less of them accumulates in a moment."""

    GOLDEN = 0.6180339887498949

    def __init__(self, seed: int = 0):
        self.seed, self.stores = seed, 0

    def __call__(self, shape: torch.Size) -> torch.Tensor:
        self.stores += 1
        offset = torch.rand(shape, generator=torch.Generator().manual_seed(self.seed), dtype=torch.float64)
        return torch.remainder(offset + self.stores * self.GOLDEN, 1.0).float()


def store(x: torch.Tensor, name: str, signed: bool, group: int = 64,
          generator: torch.Generator | None = None, dither: WeylDither | None = None) -> torch.Tensor:
    """``x`` (rows, cols) after a store in map ``name`` (SIGNED_MAPS or UNSIGNED_MAPS, or
    ``al4``) and a load; ``generator`` draws the stochastic rounding, or ``dither`` gives its
    thresholds (neither: to nearest)."""
    if generator is not None and dither is not None:
        raise ValueError("store() takes a generator (independent draws) or a dither (WeylDither), not both")
    x3, cols = _grouped(x.float(), group)
    if dither is not None:
        u = dither(x3.shape)
    else:
        u = torch.full_like(x3, 0.5) if generator is None else torch.rand(x3.shape, generator=generator)
    mag = x3.abs() if signed else x3.clamp_min(0.0)
    if name == "al4" and not signed:
        out = _al4(mag, u)
    else:
        grid = (SIGNED_MAPS if signed else UNSIGNED_MAPS)[name]
        s = _bf16_up(mag.amax(-1, keepdim=True))
        y = torch.where(s > 0, mag / s.clamp_min(1e-38), 0.0).clamp_max(1.0)
        out = torch.where(s > 0, _round_on_grid(y, grid, u) * s, 0.0)
        out = torch.where(x3 < 0, -out, out) if signed else out
    return out.flatten(1)[:, :cols]


def _al4(v: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """16 log-spaced codes from the group's least positive value to its largest (bf16 each)."""
    hi = _bf16_up(v.amax(-1, keepdim=True))
    lo = torch.where(v > 0, v, float("inf")).amin(-1, keepdim=True).bfloat16().float()
    lo = torch.where(torch.isfinite(lo), lo.clamp_max(hi), hi)
    width = torch.log2(hi.clamp_min(1e-38)) - torch.log2(lo.clamp_min(1e-38))
    grid = torch.exp2(torch.log2(lo.clamp_min(1e-38)) + width * (_C16 / 15))  # (rows, groups, 16)
    lower = (torch.searchsorted(grid.contiguous(), v.contiguous(), right=True) - 1)
    lo_v = grid.gather(-1, lower.clamp(0, 15))
    hi_v = grid.gather(-1, (lower + 1).clamp(0, 15))
    up = (v - lo_v) > u * (hi_v - lo_v)
    out = torch.where(lower < 0, grid[..., :1], torch.where(up, hi_v, lo_v))
    return torch.where(hi > 0, out, 0.0)


def factored(v: torch.Tensor) -> torch.Tensor:
    """A never-negative (rows, cols) state after being kept as its fp32 row sums R, column sums
    C and total S, read back as R_i C_j / S (core/factored.py): its rank-1 estimate with the same
    row and column sums."""
    v = v.float()
    return rank1(v.sum(1), v.sum(0), v.sum())
