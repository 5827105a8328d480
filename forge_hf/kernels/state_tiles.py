"""Triton: load and store one optimizer-state tile in its storage (fp32, bf16, absmax8, al8).

An 8-bit tile (BLOCK_N, BLOCK_K) is viewed as (BLOCK_N, BLOCK_K // 64, 64), so each codec
block is one row of the last axis and its statistics are one reduction. The codec
arithmetic is core/codecs.py's, bound to triton.language here (log2 to the GPU's
approximate one: codec_ops). Metadata is addressed by block index
``(column // 64) * out_features + row`` (codecs.meta_strides).
"""

import os
import struct
import types

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


@triton.jit
def log2_approx(x):
    """log2 in one MUFU.LG2 (absolute error about 2**-22, far below al8's grid step; input
    below 2**-126 flushes to zero, where the codec clamps): tl.log2 is libdevice's accurate
    log2f, ~20 instructions, the largest part of al8's encode."""
    return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def log2_interpreted(x):
    """The interpreter runs no assembly: tl.log2, 0 -> -inf without numpy's warning."""
    return tl.where(x > 0.0, tl.log2(tl.where(x > 0.0, x, 1.0)), float("-inf"))


# The codecs' ``ops``: triton.language but for log2. A plain module, the only kind of global
# namespace a jit function may read attributes of; other names are looked up in tl at each
# use (a module __getattr__), as the interpreter patches tl's own functions.
codec_ops = types.ModuleType("forge_hf.kernels.state_tiles.codec_ops")
codec_ops.__getattr__ = lambda name: getattr(tl, name)
codec_ops.log2 = log2_interpreted if os.environ.get("TRITON_INTERPRET") == "1" else log2_approx
absmax_encode, floor_positive, absmax_decode, log_encode, log_decode = (
    triton.jit(bind_ops(f, codec_ops, tl=tl)) for f in
    (codecs.absmax_encode, codecs.floor_positive, codecs.absmax_decode, codecs.log_encode, codecs.log_decode))
ROUNDER = tl.constexpr(codecs.ROUNDER)
ROUNDER_BITS = tl.constexpr(struct.unpack("<i", struct.pack("<f", codecs.ROUNDER))[0])  # 0x4B400000


@triton.jit
def uniform16(bits):
    """16 random bits as log_encode's ``u``: codecs.uniform in units of 2**-16."""
    return bits.to(tl.float32)


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
                u = tl.reshape(uniform16(slot_bits(h, slot)), (BLOCK_N, BLOCK_K // QBLOCK, QBLOCK))
            else:
                u = 32768.0  # a half
            biased, lo, width = log_encode(x, valid, u)
            tl.store(meta_ptr + 2 * block, lo, mask=block_keep)
            tl.store(meta_ptr + 2 * block + 1, width, mask=block_keep)
            # the code's byte as absmax's: no float-to-integer conversion
            tl.store(ptr + offs, int8_code(tl.reshape(biased, (BLOCK_N, BLOCK_K))).to(tl.uint8, bitcast=True),
                     mask=keep)
        else:
            biased, scale = absmax_biased(x, valid, KIND)
            tl.store(meta_ptr + block, scale, mask=block_keep)
            tl.store(ptr + offs, int8_code(tl.reshape(biased, (BLOCK_N, BLOCK_K))), mask=keep)
