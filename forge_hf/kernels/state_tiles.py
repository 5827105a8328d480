"""Triton: load and store one optimizer-state tile in its storage (fp32, bf16, absmax8, al8).

An 8-bit tile (BLOCK_N, BLOCK_K) is viewed as (BLOCK_N, BLOCK_K // 64, 64), so each codec
block is one row of the last axis and its statistics are one reduction. The codec
arithmetic is core/codecs.py's, bound to triton.language here. Metadata is addressed
by block index ``(column // 64) * out_features + row`` (codecs.meta_strides).
"""

import struct

import triton
import triton.language as tl

from ..core import codecs
from ..core.rules import bind_ops
from .storage import decode_value, load_tile, slot_bits, store_value

NONE = tl.constexpr(codecs.NONE)
FP32 = tl.constexpr(codecs.FP32)
BF16 = tl.constexpr(codecs.BF16)
ABSMAX8 = tl.constexpr(codecs.ABSMAX8)
ABSMAX8_FLOORED = tl.constexpr(codecs.ABSMAX8_FLOORED)
AL8 = tl.constexpr(codecs.AL8)
QBLOCK = tl.constexpr(codecs.BLOCK)

absmax_encode, floor_positive, absmax_decode, log_encode, log_decode = (
    triton.jit(bind_ops(f, tl)) for f in
    (codecs.absmax_encode, codecs.floor_positive, codecs.absmax_decode, codecs.log_encode, codecs.log_decode))
ROUNDER = tl.constexpr(codecs.ROUNDER)
ROUNDER_BITS = tl.constexpr(struct.unpack("<i", struct.pack("<f", codecs.ROUNDER))[0])  # 0x4B400000


@triton.jit
def uniform(bits):
    """Uniform [0, 1) from 16 random bits (codecs.uniform)."""
    return bits.to(tl.float32) * 1.52587890625e-05  # 2**-16


@triton.jit
def code_to_float(codes):
    """An 8-bit code (int8 or uint8) as fp32 without a conversion instruction: its bits,
    extended to 32, added to ROUNDER's pattern make the float ROUNDER + code
    (codecs.absmax_encode)."""
    return (codes.to(tl.int32) + ROUNDER_BITS).to(tl.float32, bitcast=True) - ROUNDER


@triton.jit
def absmax_biased(x, valid, KIND: tl.constexpr):
    """An absmax8(_floored) slot's codes as biased floats (codecs.absmax_encode), blocks
    along the last axis, and the blocks' scales; int8_code makes the stored byte."""
    biased, scale = absmax_encode(x, valid)
    if KIND == ABSMAX8_FLOORED:
        biased = floor_positive(biased, x)
    return biased, scale


@triton.jit
def int8_code(biased):
    """The code is the low byte of the biased float's pattern (two's complement)."""
    return biased.to(tl.int32, bitcast=True).to(tl.int8)


@triton.jit
def block_index(rn, pid_k, N, KB, BLOCK_K: tl.constexpr):
    """Metadata index (BLOCK_N, BLOCK_K // 64) of the tile's codec blocks, and its mask:
    block column by block column (codecs.meta_strides), so a tile's rows are contiguous."""
    kb = pid_k * (BLOCK_K // QBLOCK) + tl.arange(0, BLOCK_K // QBLOCK)
    return kb[None, :] * N + rn[:, None], (rn[:, None] < N) & (kb[None, :] < KB)


@triton.jit
def load_state_raw(ptr, offs, mask, KIND: tl.constexpr, EVEN: tl.constexpr):
    """What a state tile stores (fp32 values, bf16 bits or 8-bit codes), undecoded (decode_state
    reads it). A missing slot reads nothing."""
    if KIND == NONE:
        raw = 0
    else:
        raw = load_tile(ptr, offs, mask, EVEN)
    return raw


@triton.jit
def load_meta(meta_ptr, block, block_mask, KIND: tl.constexpr):
    """The tile's per-block metadata of an 8-bit slot, (scale, unused) or (lo, width);
    zeros for other slots. Small: the kernel loads it before its token loop, whose time
    hides the load's latency."""
    if KIND == AL8:
        first = tl.load(meta_ptr + 2 * block, mask=block_mask, other=0.0)
        second = tl.load(meta_ptr + 2 * block + 1, mask=block_mask, other=0.0)
    elif KIND >= ABSMAX8:
        first = tl.load(meta_ptr + block, mask=block_mask, other=0.0)
        second = first
    else:
        first = 0.0
        second = 0.0
    return first, second


@triton.jit
def decode_state(raw, meta, KIND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 values of what load_state_raw read, with load_meta's ``meta``."""
    # if/elif, not `a or b`: compiled Triton folds only plain constexpr comparisons
    if KIND == FP32:
        value = decode_value(raw, False)
    elif KIND == BF16:
        value = decode_value(raw, True)
    else:
        codes = tl.reshape(code_to_float(raw), (BLOCK_N, BLOCK_K // QBLOCK, QBLOCK))
        if KIND == AL8:
            value = tl.reshape(log_decode(codes, meta[0], meta[1]), (BLOCK_N, BLOCK_K))
        else:
            value = tl.reshape(absmax_decode(codes, meta[0]), (BLOCK_N, BLOCK_K))
    return value


@triton.jit
def store_state(ptr, meta_ptr, offs, value, mask, keep, block, block_keep, h,
                slot: tl.constexpr, KIND: tl.constexpr, STOCHASTIC: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Store a tile; ``mask`` marks the elements inside the weight (the codec blocks'
    statistics see only those), ``keep`` those to write (None: all)."""
    if KIND == FP32:
        store_value(ptr, offs, value, keep, h, slot, False, STOCHASTIC)
    elif KIND == BF16:
        store_value(ptr, offs, value, keep, h, slot, True, STOCHASTIC)
    else:
        x = tl.reshape(value, (BLOCK_N, BLOCK_K // QBLOCK, QBLOCK))
        valid = tl.reshape(mask, (BLOCK_N, BLOCK_K // QBLOCK, QBLOCK))
        if KIND == AL8:
            if STOCHASTIC:
                u = tl.reshape(uniform(slot_bits(h, slot)),
                               (BLOCK_N, BLOCK_K // QBLOCK, QBLOCK))
            else:
                u = 0.5
            codes, lo, width = log_encode(x, valid, u)
            tl.store(meta_ptr + 2 * block, lo, mask=block_keep)
            tl.store(meta_ptr + 2 * block + 1, width, mask=block_keep)
            tl.store(ptr + offs, tl.reshape(codes, (BLOCK_N, BLOCK_K)).to(tl.uint8), mask=keep)
        else:
            biased, scale = absmax_biased(x, valid, KIND)
            tl.store(meta_ptr + block, scale, mask=block_keep)
            tl.store(ptr + offs, int8_code(tl.reshape(biased, (BLOCK_N, BLOCK_K))), mask=keep)
