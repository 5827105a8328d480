"""Triton helpers for how weights and states are stored: fp32, or bf16 as raw 16-bit patterns.

bf16 values travel as int16 bit patterns and are rounded in the integer domain. That
makes rounding explicit (round-to-nearest-even or stochastic, paper §2.3 / Appendix C)
and identical on the GPU and in the CPU interpreter, whose own fp32->bf16 casts
truncate. The random bits come from a cheap integer hash of (salt, step, slot, element),
so a given seed always gives the same bits, whatever the tile shape or launch order.
"""

import triton
import triton.language as tl

# Multipliers of the hash (constexpr so kernels may read them); reference.py uses the same.
GOLDEN = tl.constexpr(0x9E3779B1)
MIX_A = tl.constexpr(0x85EBCA6B)
MIX_B = tl.constexpr(0xC2B2AE35)
STEP_MUL = tl.constexpr(0x85EBCA77)
SLOT_MUL = tl.constexpr(0x27D4EB2F)


@triton.jit
def mix32(h):
    # murmur3's 32-bit finaliser: full avalanche in six integer operations
    h ^= h >> 16
    h = h * MIX_A
    h ^= h >> 13
    h = h * MIX_B
    h ^= h >> 16
    return h


@triton.jit
def random_bits(elem, salt, step, slot: tl.constexpr):
    """32 uniform bits for each element index (uint32 tensors in, uint32 out)."""
    h = mix32((elem * GOLDEN) ^ salt)
    return mix32(h ^ (step * STEP_MUL + slot * SLOT_MUL))


@triton.jit
def bf16_bits_to_fp32(bits):
    return (bits.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def fp32_to_bf16_bits(x, elem, salt, step, slot: tl.constexpr, STOCHASTIC: tl.constexpr):
    bits = x.to(tl.uint32, bitcast=True)
    if STOCHASTIC:
        # round up with probability (discarded fraction): unbiased (paper Prop. 5)
        bits = bits + (random_bits(elem, salt, step, slot) & 0xFFFF)
    else:
        bits = bits + (0x7FFF + ((bits >> 16) & 1))  # round to nearest, ties to even
    return (bits >> 16).to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def load_value(ptr, offsets, mask, IS_BF16: tl.constexpr):
    # one return: compiled Triton unifies the types of all returns, constexpr or not
    if IS_BF16:
        value = bf16_bits_to_fp32(tl.load(ptr + offsets, mask=mask, other=0))
    else:
        value = tl.load(ptr + offsets, mask=mask, other=0.0)
    return value


@triton.jit
def store_value(ptr, offsets, value, mask, elem, salt, step, slot: tl.constexpr,
                IS_BF16: tl.constexpr, STOCHASTIC: tl.constexpr):
    if IS_BF16:
        tl.store(ptr + offsets, fp32_to_bf16_bits(value, elem, salt, step, slot, STOCHASTIC), mask=mask)
    else:
        tl.store(ptr + offsets, value, mask=mask)
