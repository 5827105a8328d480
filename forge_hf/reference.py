"""The same fused step in plain PyTorch, tile by tile: the backend for devices without
Triton, and the oracle the Triton kernel is tested against.

It mirrors kernels/fused_update.py: identical tiles, fp32 accumulation, the same rule code
object (``ops`` bound to torch), the same non-finite-tile skipping and statistics, and the
same integer-domain bf16 rounding with the same hash, so stochastic rounding gives the
same bits on both backends, and the same 8-bit codec arithmetic (codecs.py).
"""

from __future__ import annotations

import torch

from .codecs import BLOCK, QuantisedSlot, uniform
from .rules import NUM_SCALARS, RULES, bind_update

RULE_UPDATES = {name: bind_update(rule, torch) for name, rule in RULES.items()}

# The hash of kernels/storage.py, in Python integers (no Triton import needed here).
_M32 = 0xFFFFFFFF
GOLDEN, MIX_A, MIX_B, STEP_MUL, SLOT_MUL = 0x9E3779B1, 0x85EBCA6B, 0xC2B2AE35, 0x85EBCA77, 0x27D4EB2F


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    # (h * c) mod 2**32 without overflowing int64: split c into 16-bit halves
    lo = h * (c & 0xFFFF)
    hi = ((h * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def mix32(h):
    """murmur3's finaliser on int64 tensors (or Python ints) holding 32-bit values."""
    if isinstance(h, int):
        h ^= h >> 16
        h = (h * MIX_A) & _M32
        h ^= h >> 13
        h = (h * MIX_B) & _M32
        return h ^ (h >> 16)
    h = h ^ (h >> 16)
    h = _mul32(h, MIX_A)
    h = h ^ (h >> 13)
    h = _mul32(h, MIX_B)
    return h ^ (h >> 16)


def random_bits(elem: torch.Tensor, salt: int, step: int, slot: int) -> torch.Tensor:
    """16 random bits: kernels/storage.py's element_hash, then slot_bits."""
    word = mix32(_mul32(elem, GOLDEN) ^ ((salt ^ (step * STEP_MUL)) & _M32))
    if slot >= 2:
        word = mix32(word ^ SLOT_MUL)
    return word & 0xFFFF if slot % 2 == 0 else word >> 16


def round_to_bf16(x: torch.Tensor, elem: torch.Tensor, salt: int, step: int, slot: int,
                  stochastic: bool) -> torch.Tensor:
    """fp32 -> bf16 in the integer domain (kernels/storage.py:fp32_to_bf16_bits)."""
    bits = x.contiguous().view(torch.int32).to(torch.int64) & _M32
    if stochastic:
        bits = bits + random_bits(elem, salt, step, slot)
    else:
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (((bits >> 16) & 0xFFFF).to(torch.int32).to(torch.int16)).view(torch.bfloat16)


def reference_fused_update(
    x: torch.Tensor,
    dy: torch.Tensor,
    weight: torch.Tensor,
    slots: list,
    args: torch.Tensor,
    stats: torch.Tensor,
    rule_name: str,
    stochastic: bool,
    blocks: tuple[int, int, int] = (64, 64, 64),
) -> None:
    """Same contract as kernels.fused_update.launch_fused_update."""
    update = RULE_UPDATES[rule_name]
    args_cpu = args.cpu()
    scalars = args_cpu[:NUM_SCALARS].view(torch.float32).to(weight.device)
    consts = [scalars[i] for i in range(NUM_SCALARS)]
    step = int(args_cpu[NUM_SCALARS].item()) & _M32
    salt = int(args_cpu[NUM_SCALARS + 1].item()) & _M32
    row0 = int(args_cpu[NUM_SCALARS + 2].item())
    N, K = weight.shape
    BN, BK, _ = blocks
    if BK % BLOCK and any(isinstance(s, QuantisedSlot) for s in slots):
        raise ValueError(f"reference BLOCK_K={BK} splits {BLOCK}-element codec blocks: use a multiple of {BLOCK}")
    xf = x.float()
    dyf = dy.float()
    for n0 in range(0, N, BN):
        rows = slice(n0, min(n0 + BN, N))
        for k0 in range(0, K, BK):
            cols = slice(k0, min(k0 + BK, K))
            g = dyf[:, rows].t() @ xf[:, cols]
            sumsq = (g * g).sum()
            if not bool(torch.isfinite(sumsq)):  # the kernel's test: NaN, inf, or a square overflowing
                stats[1] += 1
                continue
            stats[0] += sumsq
            w_tile = weight[rows, cols]
            zero = torch.zeros_like(g)
            s_in = [zero if s is None else s.read(rows, cols) if isinstance(s, QuantisedSlot)
                    else s[rows, cols].float() for s in slots]
            outs = update(w_tile.float(), g, *s_in, *consts)
            r = torch.arange(row0 + rows.start, row0 + rows.stop, device=weight.device, dtype=torch.int64)
            c = torch.arange(cols.start, cols.stop, device=weight.device, dtype=torch.int64)
            elem = r[:, None] * K + c[None, :]
            for slot_id, (dst, value) in enumerate(zip([weight, *slots], outs)):
                if dst is None:
                    continue
                if isinstance(dst, QuantisedSlot):
                    stochastic_codes = stochastic and dst.codec.stochastic
                    u = uniform(random_bits(elem, salt, step, slot_id)) if stochastic_codes else 0.5
                    dst.write(value, rows, cols, u)
                    continue
                if dst.dtype == torch.bfloat16:
                    value = round_to_bf16(value, elem, salt, step, slot_id, stochastic)
                dst[rows, cols] = value
