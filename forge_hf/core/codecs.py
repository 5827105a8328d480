"""8-bit and 4-bit optimizer-state codecs, written once for both backends.

``absmax8`` (symmetric absmax int8), ``absmax8_floored`` (the same for never-negative
states: a positive value keeps at least code 1) and ``al8`` (an adaptive log code on the
float's own bits, code 255 exact zero), each over blocks of ``BLOCK`` = 64 elements of a row
with fp32 metadata a block. ``slog4`` (signed first moments: a sign and 2**-6..2**0 or 0) and
``log4`` (never-negative states: 2**-15..2**0, no zero code), over groups of ``GROUP4``
elements of a row with a bf16 scale a group, two codes a byte. The arithmetic uses only the free name ``ops``, bound to
``triton.language`` in kernels/triton/state_tiles.py and to torch here, like the rules' updates. The design,
its rounding and the legacy al8 format: docs/architecture.md, "8-bit state codes".
"""

from __future__ import annotations

import types
from dataclasses import dataclass, replace

import torch

from .factored import FactoredSlot
from .rules import bind_ops

BLOCK = 64
ROUNDER = 12582912.0  # 1.5 * 2**23 (absmax_encode)
HALF_WORD = 0x80000000  # al8: random bits that round to nearest (ties up)
AL8_ZERO = 255  # the al8 code of exact zero
MIN_SHIFT, MAX_SHIFT = 5, 24  # al8: 2**5 keeps the shift in the metadata word's low bits
GROUP4 = 64  # 4-bit codes: elements a group (one bf16 scale); inside one kernel tile's row
UNIT = 2.0**-16  # 4-bit codes: a 16-bit random draw times UNIT is uniform in [0, 1)

# Storage kinds, as the kernel's per-slot compile-time selector (LEGACY_AL8: read on load only).
NONE, FP32, BF16, ABSMAX8, ABSMAX8_FLOORED, AL8, LEGACY_AL8, SLOG4, LOG4 = range(9)
FACTORED = 9  # a factored second moment (core/factored.py): vectors, not a tile of the weight's shape


# ------------------------------------------------------------ shared arithmetic
# x, valid, u, codes: (..., BLOCK), one block per row of the last axis; metadata: (...).


def absmax_encode(x, valid):
    """The codes in [-127, 127] as *biased* floats, ROUNDER + code, and the per-block
    scale. Adding ROUNDER (1.5 * 2**23, where the float grid's step is 1) rounds x / s to
    the nearest integer, ties to even, and leaves that integer as the low bits of the
    float's pattern: the kernel stores the low byte and needs neither a rounding nor a
    float-to-integer conversion instruction. No clamp: |x| <= amax, so
    |x * (127 / amax)| exceeds 127 by at most two roundings and rounds back to 127."""
    amax = ops.maximum(ops.max(ops.where(valid, ops.abs(x), 0.0), axis=-1), 1e-30)
    # One correctly rounded division per block (div_rn: the GPU's default division is
    # approximate), then a product per element: a division per element cost the kernel
    # ~12%. Equal inputs give equal codes on every backend, ties included.
    inverse = ops.div_rn(127.0, amax)
    biased = x * ops.expand_dims(inverse, -1) + 12582912.0  # ROUNDER
    return biased, ops.div_rn(amax, 127.0)


def floor_positive(biased, x):
    """absmax8_floored: a positive value keeps at least code 1."""
    return ops.where(x > 0.0, ops.maximum(biased, 12582913.0), biased)  # ROUNDER + 1


def absmax_decode(codes, scale):
    return codes * ops.expand_dims(scale, -1)


def log_encode(x, valid, word):
    """al8: the codes (0..254 on the block's grid, 255 for zero) as int32, and each block's
    metadata word (base | shift) as int32; ``x`` must not be negative. ``word``: an element's
    32 random bits (the element hash: its high half is this slot's, hash slot 1; the low half
    only refines the last 2**-16 of a step) to round up with probability equal to the
    position between two grid values (unbiased), or HALF_WORD to round to the nearer."""
    b = ops.bits(ops.where(valid, x, 0.0))  # 0 for zero and padding
    hi = ops.max(b, axis=-1)
    lo = ops.where(hi > 0, ops.min_positive(b, -1), 0)  # 0: a block of zeros
    # the smallest shift with span <= 252 * 2**shift, from the span's float exponent
    # (252 = 1.96875 * 2**7; adding 0x3FFFF carries into the exponent above mantissa 1.96875):
    # then (hi - base) >> shift <= 253, and rounding up reaches code 254 at most
    span = ops.to_float(hi - lo)
    shift = ops.minimum(ops.maximum(((ops.bits(span) + 0x3FFFF) >> 23) - 134, 5), 24)  # MIN_SHIFT, MAX_SHIFT
    base = (lo >> shift) << shift
    up = ops.high_bits(word, ops.expand_dims(shift, -1))  # uniform in [0, 2**shift)
    codes = (b - ops.expand_dims(base, -1) + up) >> ops.expand_dims(shift, -1)
    # zero lies below a positive base: a negative code, which as unsigned exceeds 255
    return ops.unsigned_min(codes, 255), base | shift  # AL8_ZERO


def log_decode(codes, meta):
    """al8: the values of int32 codes with their blocks' int32 metadata words."""
    shift = meta & 31
    # 2**shift through a float: a multiplier the compiler does not turn back into a shift,
    # so an element's code becomes its bits in one multiply-add
    step = ops.to_int(ops.from_bits((shift + 127) << 23))
    value = ops.from_bits(codes * ops.expand_dims(step, -1) + ops.expand_dims(meta - shift, -1))
    return ops.where(codes != 255, value, 0.0)  # AL8_ZERO


# 4-bit: x, valid, u: (..., GROUP4), one group per row of the last axis; u uniform in [0, 1)
# (0.5 rounds to nearest). A group's scale is its largest magnitude rounded *up* to bf16 (so
# |x| / scale <= 1 up to the one rounding of the product), kept as the bf16 bits in an int32
# word. The grids are powers of two: the code below y is y's float exponent, and the step to
# the next code is exact, so rounding up with probability (y - lo) / step needs no division.


def group_scale(x, valid):
    """The group's bf16 scale word (int32 holding bf16 bits) and 1 / scale (fp32)."""
    amax = ops.max(ops.where(valid, ops.abs(x), 0.0), axis=-1)
    word = (ops.bits(amax) + 0xFFFF) >> 16  # amax >= 0: rounding the bits up rounds the value up
    inverse = ops.div_rn(1.0, ops.maximum(ops.from_bits(word << 16), 1e-30))  # 1e-30: an all-zero group
    return word, inverse


def slog4_encode(x, valid, u):
    """Signed 4-bit codes (bit 3 the sign, bits 0-2 k: 0 for 0, else 2**(k - 7) of the scale)
    as int32, and the groups' scale words."""
    x = ops.where(valid, x, 0.0)
    word, inverse = ops.group_scale(x, valid)
    y = ops.abs(x) * ops.expand_dims(inverse, -1)
    k = ops.maximum(ops.minimum((ops.bits(y) >> 23) - 120, 7), 0)  # floor(log2 y) + 7 in [0, 7]
    lo = ops.where(k > 0, ops.from_bits((k + 120) << 23), 0.0)  # the grid value below y
    step = ops.from_bits((ops.maximum(k, 1) + 120) << 23)  # to the next: 2**(k - 7), 2**-6 from 0
    code = ops.minimum(k + ops.to_int((y - lo) > u * step), 7)  # y may round just above 1
    return ops.where((x < 0.0) & (code > 0), code + 8, code), word


def slog4_decode(codes, word):
    """Values of int32 slog4 codes with their groups' int32 scale words."""
    k = codes & 7
    scale = ops.expand_dims(ops.from_bits(word << 16), -1)
    mag = ops.where(k > 0, ops.from_bits((k + 120) << 23), 0.0) * scale  # a power of two: exact
    return ops.where(codes > 7, -mag, mag)


def log4_encode(x, valid, u):
    """Never-negative 4-bit codes c (2**(c - 15) of the scale; no zero code, so a small
    second moment is never read as 0 under 1/sqrt(v)) as int32, and the groups' scale words.
    Below 2**-15 of the scale a value rounds up to code 0."""
    x = ops.where(valid, x, 0.0)
    word, inverse = ops.group_scale(x, valid)
    y = x * ops.expand_dims(inverse, -1)
    c = ops.minimum((ops.bits(y) >> 23) - 112, 15)  # floor(log2 y) + 15
    lo = ops.from_bits((ops.maximum(c, 0) + 112) << 23)  # 2**(c - 15), also the step to the next
    up = (c >= 0) & ((y - lo) > u * lo)
    return ops.minimum(ops.maximum(c, 0) + ops.to_int(up), 15), word


def log4_decode(codes, word):
    """Values of int32 log4 codes with their groups' int32 scale words (an all-zero group: 0)."""
    return ops.from_bits((codes + 112) << 23) * ops.expand_dims(ops.from_bits(word << 16), -1)


# ------------------------------------------------------------ codec table


@dataclass(frozen=True)
class Codec:
    name: str
    kind: int  # the kernel's storage selector
    code_dtype: torch.dtype
    meta_width: int  # metadata values per block
    stochastic: bool  # follows the layer's rounding (else always rounds to nearest)
    bits: int = 8  # 4: two codes a byte, packed along the row, in logical (out, in) layout
    group: int = BLOCK  # elements a block (a metadata entry)
    meta_dtype: torch.dtype = torch.float32


CODECS = {c.name: c for c in (
    Codec("absmax8", ABSMAX8, torch.int8, 1, False),
    Codec("absmax8_floored", ABSMAX8_FLOORED, torch.int8, 1, False),
    Codec("al8", AL8, torch.uint8, 1, True),
    Codec("slog4", SLOG4, torch.uint8, 1, True, bits=4, group=GROUP4, meta_dtype=torch.bfloat16),
    Codec("log4", LOG4, torch.uint8, 1, True, bits=4, group=GROUP4, meta_dtype=torch.bfloat16),
)}
# forge_hf 0.1.0's al8 (a uniform log2 grid, metadata lo and width), as its checkpoints name it
LEGACY_AL8_CODEC = Codec("al8", LEGACY_AL8, torch.uint8, 2, True)
# state precision -> (codec of signed slots, codec of never-negative slots)
PRECISION_CODECS = {
    "int8": (CODECS["absmax8"], CODECS["absmax8_floored"]),
    "al8": (CODECS["absmax8"], CODECS["al8"]),
    "log4": (CODECS["slog4"], CODECS["log4"]),
    "log4_factored": (CODECS["slog4"], None),  # never-negative slots: a FactoredSlot (core/factored.py)
}


def saved_codec(name: str, meta: torch.Tensor) -> Codec:
    """The codec a checkpoint's slot was written with, from its name and metadata width."""
    codec = CODECS[name]
    if codec.kind == AL8 and meta.shape[-1] == LEGACY_AL8_CODEC.meta_width:
        return LEGACY_AL8_CODEC
    return codec


def slot_codec(precision: str, signed: bool) -> Codec | None:
    """The codec of a slot under ``precision`` (None for fp32/bf16)."""
    pair = PRECISION_CODECS.get(precision)
    return None if pair is None else pair[0 if signed else 1]


def blocks_per_row(in_features: int, group: int = BLOCK) -> int:
    return -(-in_features // group)


def meta_strides(out_features: int, codec: Codec) -> tuple[int, int, int]:
    """The strides of a slot's (out_features, blocks, meta_width) metadata as allocated."""
    return (codec.meta_width, out_features * codec.meta_width, 1)


def meta_layout(out_features: int, in_features: int, codec: Codec) -> tuple[tuple, tuple]:
    """(shape, strides) of a slot's metadata as allocated, what the kernels require."""
    shape = (out_features, blocks_per_row(in_features, codec.group), codec.meta_width)
    return shape, meta_strides(out_features, codec)


def packed_shape(out_features: int, in_features: int) -> tuple[int, int]:
    """The (out, in) shape of a 4-bit slot's packed codes: two a byte along the row."""
    return (out_features, -(-in_features // 2))


def storage_kind(slot) -> int:
    """The kernel's storage selector for a slot (a tensor, a QuantisedSlot or None)."""
    if slot is None:
        return NONE
    if isinstance(slot, FactoredSlot):
        return FACTORED
    if isinstance(slot, QuantisedSlot):
        return slot.codec.kind
    return BF16 if slot.dtype == torch.bfloat16 else FP32


def storage_kinds(slots) -> tuple[int, ...]:
    """Each slot's storage_kind: what a layer's kernel is chosen and compiled for."""
    return tuple(storage_kind(s) for s in slots)


# ------------------------------------------------------------ torch side


def _div_rn(a, b):
    """A correctly rounded a / b, a Python number on either side (torch may divide a tensor
    by a number as a product with the number's reciprocal: two roundings)."""
    like = a if torch.is_tensor(a) else b
    a, b = (v if torch.is_tensor(v) else torch.full_like(like, v) for v in (a, b))
    return torch.div(a, b)


TORCH_OPS = types.SimpleNamespace(
    max=lambda x, axis: torch.amax(x, dim=axis),
    min=lambda x, axis: torch.amin(x, dim=axis),
    maximum=lambda a, b: torch.maximum(a, torch.as_tensor(b, dtype=a.dtype, device=a.device)),
    minimum=lambda a, b: torch.minimum(a, torch.as_tensor(b, dtype=a.dtype, device=a.device)),
    where=torch.where, abs=torch.abs, div_rn=_div_rn, expand_dims=torch.unsqueeze,
    bits=lambda x: x.view(torch.int32), from_bits=lambda i: i.view(torch.float32),
    min_positive=lambda b, axis: torch.amin(torch.where(b > 0, b, 0x7FFFFFFF), dim=axis),
    high_bits=lambda word, n: ((torch.as_tensor(word, dtype=torch.int64, device=n.device) & 0xFFFFFFFF)
                               >> (32 - n.long())).to(torch.int32),
    to_int=lambda f: f.to(torch.int32),
    unsigned_min=lambda i, n: torch.where(i >= 0, torch.clamp_max(i, n), n),
    to_float=lambda i: i.to(torch.float32),
)
_absmax_encode, _floor_positive, _absmax_decode, _log_encode, _log_decode = (
    bind_ops(f, TORCH_OPS) for f in (absmax_encode, floor_positive, absmax_decode, log_encode, log_decode))
TORCH_OPS.group_scale = bind_ops(group_scale, TORCH_OPS)
_ENCODE4 = {SLOG4: bind_ops(slog4_encode, TORCH_OPS), LOG4: bind_ops(log4_encode, TORCH_OPS)}
_DECODE4 = {SLOG4: bind_ops(slog4_decode, TORCH_OPS), LOG4: bind_ops(log4_decode, TORCH_OPS)}


def _legacy_log_decode(codes, lo, width):
    """forge_hf 0.1.0's al8: code c > 0 is 2**(lo + (c - 1) * width / 254)."""
    step = _div_rn(width, 254.0).unsqueeze(-1)
    return torch.where(codes > 0, torch.exp2(lo.unsqueeze(-1) + (codes - 1.0) * step), 0.0)


def _blocked(x: torch.Tensor, fill=0.0, group: int = BLOCK) -> torch.Tensor:
    """(rows, cols) -> (rows, blocks, group), the last block padded with ``fill``."""
    rows, cols = x.shape
    pad = blocks_per_row(cols, group) * group - cols
    if pad:
        x = torch.nn.functional.pad(x, (0, pad), value=fill)
    return x.reshape(rows, -1, group)


def _encode4(codec: Codec, x: torch.Tensor, bits):
    """4-bit: packed codes (rows, ceil(cols / 2)), element 2j in byte j's low half; bf16 scales.
    ``bits``: each element's 16 random bits (the slot's, core/rounding.random_bits)."""
    rows, cols = x.shape
    x3 = _blocked(x.float(), group=codec.group)
    valid = _blocked(torch.ones_like(x, dtype=torch.bool), fill=False, group=codec.group)
    u = 0.5 if bits is None else _blocked(bits.to(torch.float32) * UNIT, group=codec.group)
    codes, word = _ENCODE4[codec.kind](x3, valid, u)
    codes = codes.flatten(1).to(torch.int32)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)  # the group size is even
    return packed[:, :-(-cols // 2)], word.to(torch.int16).view(torch.bfloat16)[..., None]


def _decode4(codec: Codec, packed: torch.Tensor, meta: torch.Tensor, cols: int) -> torch.Tensor:
    b = packed.to(torch.int32)
    codes = torch.stack([b & 15, b >> 4], dim=-1).flatten(1)[:, :cols]
    x3 = _DECODE4[codec.kind](_blocked(codes, group=codec.group),
                              meta[..., 0].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF)
    return x3.flatten(1)[:, :cols]


def encode(codec: Codec, x: torch.Tensor, bits: torch.Tensor | None = None):
    """Quantise a (rows, cols) block-aligned piece: codes (rows, cols) and metadata
    (rows, blocks, meta_width); 4-bit codes packed, (rows, ceil(cols / 2)). ``bits``: each
    element's 32-bit hash (integers) for a stochastic codec's rounding (4-bit: the slot's 16
    bits); None rounds to nearest."""
    if codec.bits == 4:
        return _encode4(codec, x, bits)
    rows, cols = x.shape
    x3 = _blocked(x.float())
    valid = _blocked(torch.ones_like(x, dtype=torch.bool), fill=False)
    if codec.kind == AL8:
        # the kernels never give a never-negative state a negative value (nor -0.0); values
        # from elsewhere (a checkpoint) are clamped, as the codec requires
        x3 = torch.where(x3 > 0, x3, 0.0)
        b3 = HALF_WORD if bits is None else _blocked(bits)
        codes, meta_bits = _log_encode(x3, valid, b3)
        meta = meta_bits.view(torch.float32)[..., None]  # the word's bits, kept in fp32 storage
    elif codec.kind in (ABSMAX8, ABSMAX8_FLOORED):
        biased, scale = _absmax_encode(x3, valid)
        if codec.kind == ABSMAX8_FLOORED:
            biased = _floor_positive(biased, x3)
        codes = biased - ROUNDER
        meta = scale[..., None]
    else:
        raise ValueError(f"codec {codec.name!r} (kind {codec.kind}) is read on load only: it stores nothing")
    return codes.flatten(1)[:, :cols].to(codec.code_dtype), meta


def decode(codec: Codec, codes: torch.Tensor, meta: torch.Tensor, cols: int | None = None) -> torch.Tensor:
    """fp32 values of (rows, cols) codes with their (rows, blocks, meta_width) metadata; 4-bit
    codes are packed, and ``cols`` says how many they hold (default: an even number)."""
    if codec.bits == 4:
        return _decode4(codec, codes, meta, 2 * codes.shape[1] if cols is None else cols)
    rows, cols = codes.shape
    if codec.kind == AL8:
        c3 = _blocked(codes.to(torch.int32), fill=AL8_ZERO)
        x3 = _log_decode(c3, meta[..., 0].contiguous().view(torch.int32))
    elif codec.kind == LEGACY_AL8:
        x3 = _legacy_log_decode(_blocked(codes.float()), meta[..., 0], meta[..., 1])
    else:
        x3 = _absmax_decode(_blocked(codes.float()), meta[..., 0])
    return x3.flatten(1)[:, :cols]


@dataclass
class QuantisedSlot:
    """One quantised state: ``codes`` in the parameter's shape and layout, ``meta`` fp32
    (out_features, blocks per row, meta_width) in logical coordinates, stored block column
    by block column (``meta_strides``): a kernel tile's rows of one block column are one
    contiguous run, not a word per row 256 bytes apart (that cost the int8 kernel ~5%).
    4-bit codes: packed two a byte along the row, (out, ceil(in / 2)) row-major whatever the
    parameter's orientation (a pair must lie in one byte); bf16 scales a group."""

    codec: Codec
    codes: torch.Tensor
    meta: torch.Tensor
    width: int | None = None  # in_features, where 4-bit codes leave it open (an odd one)

    @classmethod
    def empty_like(cls, param: torch.Tensor, codec: Codec, transposed: bool) -> QuantisedSlot:
        out_features, in_features = param.shape[::-1] if transposed else param.shape
        if codec.bits == 4:
            codes = torch.zeros(packed_shape(out_features, in_features), dtype=codec.code_dtype, device=param.device)
        else:
            codes = torch.zeros_like(param, dtype=codec.code_dtype, memory_format=torch.preserve_format)
        meta = torch.zeros(blocks_per_row(in_features, codec.group), out_features, codec.meta_width,
                           dtype=codec.meta_dtype, device=param.device).transpose(0, 1)
        return cls(codec, codes, meta, in_features)  # all codes 0 and scales 0: every state value is exactly 0

    def logical(self, transposed: bool) -> QuantisedSlot:
        """The slot as (out_features, in_features): what the kernels read."""
        return replace(self, codes=self.codes.t()) if transposed and self.codec.bits == 8 else self

    def in_features(self) -> int:
        """in_features of a logical slot."""
        if self.width is not None:
            return self.width
        return self.codes.shape[1] * (2 if self.codec.bits == 4 else 1)

    def _places(self, cols: slice) -> tuple[slice, slice, int]:
        """(code columns, metadata columns, elements) of the logical columns ``cols``."""
        n = self.in_features()
        start, stop, _ = cols.indices(n)
        blocks = _block_cols(slice(start, stop), n, self.codec.group)
        if self.codec.bits == 4:
            return slice(start // 2, -(-stop // 2)), blocks, stop - start
        return slice(start, stop), blocks, stop - start

    def read(self, rows=slice(None), cols=slice(None)) -> torch.Tensor:
        """fp32 values of a logical slot; ``cols`` must cover whole blocks."""
        code_cols, blocks, n = self._places(cols)
        return decode(self.codec, self.codes[rows, code_cols], self.meta[rows, blocks], n)

    def write(self, value: torch.Tensor, rows=slice(None), cols=slice(None), bits=None) -> None:
        """Store ``value`` (its columns: ``cols``); ``bits`` as encode's."""
        code_cols, blocks, _ = self._places(cols)
        codes, meta = encode(self.codec, value, bits)
        self.codes[rows, code_cols] = codes
        self.meta[rows, blocks] = meta

    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in (self.codes, self.meta))


def _block_cols(cols: slice, in_features: int, group: int = BLOCK) -> slice:
    """The metadata columns of whole blocks ``cols`` covers (it must not split one)."""
    start, stop, _ = cols.indices(in_features)
    if start % group or (stop % group and stop != in_features):
        raise ValueError(f"columns {start}:{stop} split a {group}-element codec block: start and end "
                         f"tiles on multiples of {group} (or at in_features={in_features})")
    return slice(start // group, blocks_per_row(stop, group))
