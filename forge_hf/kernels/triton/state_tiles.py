"""Triton: load and store one optimizer-state tile in its storage kind (fp32, bf16, absmax8,
al8, slog4, log4: codecs.storage_kind), core/codecs.py's arithmetic bound to triton.language.
An 8-bit tile (BLOCK_N, BLOCK_K) is viewed as (BLOCK_N, BLOCK_K // 64, 64), a codec block a
row of the last axis; metadata index ``(column // 64) * out_features + row``
(codecs.meta_strides). A 4-bit tile is (BLOCK_N, BLOCK_K // 2) bytes of a row-major
(N, ceil(K / 2)) code tensor, unpacked to (BLOCK_N, BLOCK_K // GROUP4, GROUP4) groups.
"""

import struct
import types

import triton
import triton.language as tl

from ...core import codecs
from ...core.rules import bind_ops
from .bf16_bits import decode_value, load_tile, slot_bits, store_value

NONE = tl.constexpr(codecs.NONE)
FP32 = tl.constexpr(codecs.FP32)
BF16 = tl.constexpr(codecs.BF16)
ABSMAX8 = tl.constexpr(codecs.ABSMAX8)
ABSMAX8_FLOORED = tl.constexpr(codecs.ABSMAX8_FLOORED)
AL8 = tl.constexpr(codecs.AL8)
SLOG4 = tl.constexpr(codecs.SLOG4)
LOG4 = tl.constexpr(codecs.LOG4)
FACTORED = tl.constexpr(codecs.FACTORED)
QBLOCK = tl.constexpr(codecs.BLOCK)
GROUP4 = tl.constexpr(codecs.GROUP4)
UNIT = tl.constexpr(codecs.UNIT)


@triton.jit
def _bits(x):
    return x.to(tl.int32, bitcast=True)


@triton.jit
def _from_bits(i):
    return i.to(tl.float32, bitcast=True)


@triton.jit
def _to_float(i):
    return i.to(tl.float32)


@triton.jit
def _to_int(f):
    return f.to(tl.int32)


@triton.jit
def _high_bits(word, n):
    """The top ``n`` bits (1..32) of a 32-bit word, as int32 in [0, 2**n)."""
    return (tl.cast(word, tl.uint32) >> (32 - n).to(tl.uint32)).to(tl.int32)


@triton.jit
def _unsigned_min(i, n):
    """min(i, n) with i read as unsigned: a negative i gives n."""
    return tl.minimum(i.to(tl.uint32, bitcast=True), n).to(tl.int32, bitcast=True)


@triton.jit
def _min_positive(b, axis: tl.constexpr):
    """The least positive value along ``axis`` (0 where none is): b - 1 as unsigned puts
    zero and negative values above every positive one, with no select an element."""
    return (tl.min((b - 1).to(tl.uint32, bitcast=True), axis=axis) + 1).to(tl.int32, bitcast=True)


# the bit casts the codecs use, and triton.language for the rest, looked up at each use (the
# interpreter patches triton.language's functions while it runs a kernel); a jit function may
# read a module's attributes
_ops = types.ModuleType("forge_hf.kernels.triton.state_tiles.codec_ops")
_ops.__getattr__ = lambda name: getattr(tl, name)
_ops.bits, _ops.from_bits, _ops.to_float, _ops.to_int = _bits, _from_bits, _to_float, _to_int
_ops.min_positive, _ops.high_bits, _ops.unsigned_min = _min_positive, _high_bits, _unsigned_min
absmax_encode, floor_positive, absmax_decode, log_encode, log_decode = (
    triton.jit(bind_ops(f, _ops, tl=tl)) for f in
    (codecs.absmax_encode, codecs.floor_positive, codecs.absmax_decode, codecs.log_encode, codecs.log_decode))
_ops.group_scale = triton.jit(bind_ops(codecs.group_scale, _ops, tl=tl))
slog4_encode, slog4_decode, log4_encode, log4_decode = (
    triton.jit(bind_ops(f, _ops, tl=tl)) for f in
    (codecs.slog4_encode, codecs.slog4_decode, codecs.log4_encode, codecs.log4_decode))
HALF_WORD = tl.constexpr(codecs.HALF_WORD)
ROUNDER = tl.constexpr(codecs.ROUNDER)
ROUNDER_BITS = tl.constexpr(struct.unpack("<i", struct.pack("<f", codecs.ROUNDER))[0])  # 0x4B400000


@triton.jit
def al8_word(h, STOCHASTIC: tl.constexpr):
    """The random bits al8 codes round with (codecs.log_encode): the whole element hash, its
    high half being hash slot 1 (free: an al8 layer's other states are absmax8, rounded to
    nearest) and its low half only refining the last 2**-16 of a step; HALF_WORD rounds to
    nearest."""
    if STOCHASTIC:
        word = h
    else:
        word = HALF_WORD
    return word


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
def packed_index(rn, pid_k, N, K, BLOCK_K: tl.constexpr):
    """Offsets and mask (BLOCK_N, BLOCK_K // 2) of a tile's bytes in 4-bit codes, row-major
    (N, ceil(K / 2)), two codes a byte along the row."""
    half = (K + 1) // 2
    cb = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    return rn[:, None] * half + cb[None, :], (rn[:, None] < N) & (cb[None, :] < half)


@triton.jit
def group_index(rn, pid_k, N, K, BLOCK_K: tl.constexpr):
    """block_index for 4-bit groups of GROUP4 elements."""
    kb = pid_k * (BLOCK_K // GROUP4) + tl.arange(0, BLOCK_K // GROUP4)
    return kb[None, :] * N + rn[:, None], (rn[:, None] < N) & (kb[None, :] < (K + GROUP4 - 1) // GROUP4)


@triton.jit
def unpack4(raw, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(BLOCK_N, BLOCK_K // 2) bytes -> int32 codes (BLOCK_N, BLOCK_K // GROUP4, GROUP4):
    element 2j is byte j's low half."""
    b = raw.to(tl.int32)
    return tl.reshape(tl.join(b & 15, b >> 4), (BLOCK_N, BLOCK_K // GROUP4, GROUP4))


@triton.jit
def pack4(codes, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """unpack4's inverse: int32 codes (..., GROUP4) -> (BLOCK_N, BLOCK_K // 2) uint8."""
    lo, hi = tl.split(tl.reshape(codes, (BLOCK_N, BLOCK_K // 2, 2)))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def load_state_raw(ptr, offs, mask, KIND: tl.constexpr, EVEN: tl.constexpr):
    """What a state tile stores (fp32 values, bf16 bits or 8-bit codes), undecoded (decode_state
    reads it). A missing slot reads nothing."""
    if KIND == NONE:
        raw = 0
    elif KIND == FACTORED:  # vectors, not a tile (kernels/triton/factored_tiles.py)
        raw = 0
    else:
        raw = load_tile(ptr, offs, mask, EVEN)
    return raw


@triton.jit
def load_meta(meta_ptr, block, block_mask, KIND: tl.constexpr):
    """The tile's per-block metadata word of an 8-bit slot (an absmax8 scale, or al8's
    base | shift bits, as stored in fp32); zeros for other slots. Small: the kernel loads it
    before its token loop, whose time hides the load's latency."""
    if KIND == SLOG4:  # bf16 scale bits, passed as int16
        meta = tl.load(meta_ptr + block, mask=block_mask, other=0).to(tl.int32)
    elif KIND == LOG4:
        meta = tl.load(meta_ptr + block, mask=block_mask, other=0).to(tl.int32)
    elif KIND == FACTORED:
        meta = 0.0
    elif KIND >= ABSMAX8:
        meta = tl.load(meta_ptr + block, mask=block_mask, other=0.0)
    else:
        meta = 0.0
    return meta


@triton.jit
def decode_state(raw, meta, KIND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 values of what load_state_raw read, with load_meta's ``meta``."""
    # if/elif, not `a or b`: compiled Triton folds only plain constexpr comparisons
    if KIND == FP32:
        value = decode_value(raw, False)
    elif KIND == BF16:
        value = decode_value(raw, True)
    elif KIND == AL8:
        codes = tl.reshape(raw.to(tl.int32), (BLOCK_N, BLOCK_K // QBLOCK, QBLOCK))
        value = tl.reshape(log_decode(codes, meta.to(tl.int32, bitcast=True)), (BLOCK_N, BLOCK_K))
    elif KIND == SLOG4:
        value = tl.reshape(slog4_decode(unpack4(raw, BLOCK_N, BLOCK_K), meta), (BLOCK_N, BLOCK_K))
    elif KIND == LOG4:
        value = tl.reshape(log4_decode(unpack4(raw, BLOCK_N, BLOCK_K), meta), (BLOCK_N, BLOCK_K))
    else:
        codes = tl.reshape(code_to_float(raw), (BLOCK_N, BLOCK_K // QBLOCK, QBLOCK))
        value = tl.reshape(absmax_decode(codes, meta), (BLOCK_N, BLOCK_K))
    return value


@triton.jit
def store_state(ptr, meta_ptr, offs, value, mask, keep, block, block_keep, h,
                slot: tl.constexpr, KIND: tl.constexpr, STOCHASTIC: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Store a tile; ``mask`` marks the elements inside the weight (the codec blocks'
    statistics see only those), ``keep`` those to write (None: all); 4-bit: ``offs`` and
    ``keep`` are packed_index's bytes, ``block`` group_index's."""
    if KIND == FP32:
        store_value(ptr, offs, value, keep, h, slot, False, STOCHASTIC)
    elif KIND == BF16:
        store_value(ptr, offs, value, keep, h, slot, True, STOCHASTIC)
    elif KIND >= SLOG4:
        x = tl.reshape(value, (BLOCK_N, BLOCK_K // GROUP4, GROUP4))
        valid = tl.reshape(mask, (BLOCK_N, BLOCK_K // GROUP4, GROUP4))
        if STOCHASTIC:  # the slot's 16 bits of the element hash, as a bf16 state's
            u = tl.reshape(slot_bits(h, slot).to(tl.float32) * UNIT, (BLOCK_N, BLOCK_K // GROUP4, GROUP4))
        else:
            u = 0.5
        if KIND == SLOG4:
            codes, word = slog4_encode(x, valid, u)
        else:
            codes, word = log4_encode(x, valid, u)
        tl.store(meta_ptr + block, word.to(tl.int16), mask=block_keep)
        tl.store(ptr + offs, pack4(codes, BLOCK_N, BLOCK_K), mask=keep)
    else:
        x = tl.reshape(value, (BLOCK_N, BLOCK_K // QBLOCK, QBLOCK))
        valid = tl.reshape(mask, (BLOCK_N, BLOCK_K // QBLOCK, QBLOCK))
        if KIND == AL8:
            word = al8_word(h, STOCHASTIC)
            if STOCHASTIC:
                word = tl.reshape(word, (BLOCK_N, BLOCK_K // QBLOCK, QBLOCK))
            codes, meta = log_encode(x, valid, word)
            tl.store(meta_ptr + block, meta.to(tl.float32, bitcast=True), mask=block_keep)
            tl.store(ptr + offs, tl.reshape(codes, (BLOCK_N, BLOCK_K)).to(tl.uint8), mask=keep)
        else:
            biased, scale = absmax_biased(x, valid, KIND)
            tl.store(meta_ptr + block, scale, mask=block_keep)
            tl.store(ptr + offs, int8_code(tl.reshape(biased, (BLOCK_N, BLOCK_K))), mask=keep)
