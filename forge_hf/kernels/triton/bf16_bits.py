"""Triton: bf16 values as raw 16-bit patterns (int16), their fp32 <-> bf16 conversion with
explicit rounding (to nearest even, or stochastic: paper §2.3 / Appendix C), the same on the
GPU and in the interpreter, and core/rounding.py's hash bound to Triton for the random bits.
Loading and storing tiles of fp32 values or bf16 bits.
"""

import types

import triton
import triton.language as tl

from ...core import rounding


@triton.jit
def _mul32(h, c):
    return h * c  # uint32 arithmetic wraps modulo 2**32


# core/rounding.py's hash bound to Triton (a module: the only kind of global namespace a
# jit function may read attributes of): element_hash and slot_bits on uint32 tensors.
_ops = types.ModuleType("forge_hf.kernels.triton.bf16_bits.hash_ops")
_ops.mul32 = _mul32
HASH = rounding.bind_hash(_ops, triton.jit, tl=tl)
element_hash, slot_bits = HASH.element_hash, HASH.slot_bits


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
