"""Triton helpers for how weights and states are stored: fp32, or bf16 as raw 16-bit patterns.

bf16 values travel as int16 bit patterns and are rounded in the integer domain. That
makes rounding explicit (round-to-nearest-even or stochastic, paper §2.3 / Appendix C)
and identical on the GPU and in the CPU interpreter, whose own fp32->bf16 casts
truncate. The random bits come from a cheap integer hash of (salt, step, element): one mix
per element serves two stored tensors (16 bits each), a second mix the next two. So a given
seed always gives the same bits, whatever the tile shape or launch order.
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
def element_hash(elem, salt, step):
    """32 uniform bits for each element index and step (uint32 tensors in, uint32 out).
    ``elem * GOLDEN`` is a bijection, so within a step no two elements share an input."""
    return mix32((elem * GOLDEN) ^ (salt ^ (step * STEP_MUL)))


@triton.jit
def slot_bits(h, slot: tl.constexpr):
    """16 random bits for stored tensor ``slot`` (0 the weight, 1-3 the states): the
    halves of the element hash, then of one more mix of it (the compiler computes that
    once for slots 2 and 3)."""
    if slot < 2:
        word = h
    else:
        word = mix32(h ^ SLOT_MUL)
    if slot % 2 == 0:
        bits = word & 0xFFFF
    else:
        bits = word >> 16
    return bits


@triton.jit
def bf16_bits_to_fp32(bits):
    return (bits.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def fp32_to_bf16_bits(x, h, slot: tl.constexpr, STOCHASTIC: tl.constexpr):
    bits = x.to(tl.uint32, bitcast=True)
    if STOCHASTIC:
        # round up with probability (discarded fraction): unbiased (paper Prop. 5)
        bits = bits + slot_bits(h, slot)
    else:
        bits = bits + (0x7FFF + ((bits >> 16) & 1))  # round to nearest, ties to even
    return (bits >> 16).to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def decode_value(raw, IS_BF16: tl.constexpr):
    """fp32 from what load_raw read (bf16 bit patterns or fp32)."""
    # one return: compiled Triton unifies the types of all returns, constexpr or not
    if IS_BF16:
        value = bf16_bits_to_fp32(raw)
    else:
        value = raw
    return value


@triton.jit
def load_tile(ptr, offsets, mask, EVEN: tl.constexpr):
    """A tile as stored; EVEN: it lies wholly inside the tensor, so no mask is applied."""
    if EVEN:
        raw = tl.load(ptr + offsets)
    else:
        raw = tl.load(ptr + offsets, mask=mask, other=0)
    return raw


@triton.jit
def store_value(ptr, offsets, value, mask, h, slot: tl.constexpr,
                IS_BF16: tl.constexpr, STOCHASTIC: tl.constexpr):
    if IS_BF16:
        tl.store(ptr + offsets, fp32_to_bf16_bits(value, h, slot, STOCHASTIC), mask=mask)
    else:
        tl.store(ptr + offsets, value, mask=mask)
