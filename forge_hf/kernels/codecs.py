"""Triton: load and store one optimizer-state tile in its storage (fp32, bf16, absmax8, al8).

An 8-bit tile (BLOCK_N, BLOCK_K) is viewed as (BLOCK_N, BLOCK_K // 64, 64), so each codec
block is one row of the last axis and its statistics are one reduction. The codec
arithmetic is forge_hf/codecs.py's, bound to triton.language here. Metadata is addressed
by block index ``row * blocks_per_row + column // 64`` (codecs.py's logical layout).
"""

import triton
import triton.language as tl

from .. import codecs
from ..rules import bind_ops
from .storage import load_value, random_bits, store_value

NONE = tl.constexpr(codecs.NONE)
FP32 = tl.constexpr(codecs.FP32)
BF16 = tl.constexpr(codecs.BF16)
ABSMAX8_FLOORED = tl.constexpr(codecs.ABSMAX8_FLOORED)
AL8 = tl.constexpr(codecs.AL8)
QBLOCK = tl.constexpr(codecs.BLOCK)

absmax_encode, absmax_decode, log_encode, log_decode = (
    triton.jit(bind_ops(f, tl)) for f in
    (codecs.absmax_encode, codecs.absmax_decode, codecs.log_encode, codecs.log_decode))


@triton.jit
def uniform(bits):
    """Uniform [0, 1) from uint32 random bits (codecs.uniform)."""
    return (bits >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2**-24


@triton.jit
def block_index(rn, pid_k, N, KB, BLOCK_K: tl.constexpr):
    """Metadata index (BLOCK_N, BLOCK_K // 64) of the tile's codec blocks, and its mask."""
    kb = pid_k * (BLOCK_K // QBLOCK) + tl.arange(0, BLOCK_K // QBLOCK)
    return rn[:, None] * KB + kb[None, :], (rn[:, None] < N) & (kb[None, :] < KB)


@triton.jit
def load_state(ptr, meta_ptr, offs, mask, block, block_mask,
               KIND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # if/elif, not `a or b`: compiled Triton folds only plain constexpr comparisons
    if KIND == FP32:
        value = load_value(ptr, offs, mask, False)
    elif KIND == BF16:
        value = load_value(ptr, offs, mask, True)
    else:
        codes = tl.load(ptr + offs, mask=mask, other=0).to(tl.float32)
        codes = tl.reshape(codes, (BLOCK_N, BLOCK_K // QBLOCK, QBLOCK))
        if KIND == AL8:
            lo = tl.load(meta_ptr + 2 * block, mask=block_mask, other=0.0)
            width = tl.load(meta_ptr + 2 * block + 1, mask=block_mask, other=0.0)
            value = tl.reshape(log_decode(codes, lo, width), (BLOCK_N, BLOCK_K))
        else:
            scale = tl.load(meta_ptr + block, mask=block_mask, other=0.0)
            value = tl.reshape(absmax_decode(codes, scale), (BLOCK_N, BLOCK_K))
    return value


@triton.jit
def store_state(ptr, meta_ptr, offs, value, mask, keep, block, block_keep, elem, salt, step,
                slot: tl.constexpr, KIND: tl.constexpr, STOCHASTIC: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Store a tile; ``mask`` marks the elements inside the weight (the codec blocks'
    statistics see only those), ``keep`` those to write."""
    if KIND == FP32:
        store_value(ptr, offs, value, keep, elem, salt, step, slot, False, STOCHASTIC)
    elif KIND == BF16:
        store_value(ptr, offs, value, keep, elem, salt, step, slot, True, STOCHASTIC)
    else:
        x = tl.reshape(value, (BLOCK_N, BLOCK_K // QBLOCK, QBLOCK))
        valid = tl.reshape(mask, (BLOCK_N, BLOCK_K // QBLOCK, QBLOCK))
        if KIND == AL8:
            if STOCHASTIC:
                u = tl.reshape(uniform(random_bits(elem, salt, step, slot)),
                               (BLOCK_N, BLOCK_K // QBLOCK, QBLOCK))
            else:
                u = 0.5
            codes, lo, width = log_encode(x, valid, u)
            tl.store(meta_ptr + 2 * block, lo, mask=block_keep)
            tl.store(meta_ptr + 2 * block + 1, width, mask=block_keep)
            tl.store(ptr + offs, tl.reshape(codes, (BLOCK_N, BLOCK_K)).to(tl.uint8), mask=keep)
        else:
            if KIND == ABSMAX8_FLOORED:
                codes, scale = absmax_encode(x, valid, 1.0)
            else:
                codes, scale = absmax_encode(x, valid, 0.0)
            tl.store(meta_ptr + block, scale, mask=block_keep)
            tl.store(ptr + offs, tl.reshape(codes, (BLOCK_N, BLOCK_K)).to(tl.int8), mask=keep)
