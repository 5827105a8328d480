"""8-bit optimizer-state codecs, written once for both backends.

``absmax8`` (symmetric absmax int8), ``absmax8_floored`` (the same for never-negative
states: a positive value keeps at least code 1) and ``al8`` (an adaptive log code on the
float's own bits, code 255 exact zero), each over blocks of ``BLOCK`` = 64 elements of a row
with fp32 metadata a block. The arithmetic uses only the free name ``ops``, bound to
``triton.language`` in kernels/triton/state_tiles.py and to torch here, like the rules' updates. The design,
its rounding and the legacy al8 format: docs/architecture.md, "8-bit state codes".
"""

from __future__ import annotations

import types
from dataclasses import dataclass, replace

import torch

from .rules import bind_ops

BLOCK = 64
ROUNDER = 12582912.0  # 1.5 * 2**23 (absmax_encode)
HALF_WORD = 0x80000000  # al8: random bits that round to nearest (ties up)
AL8_ZERO = 255  # the al8 code of exact zero
MIN_SHIFT, MAX_SHIFT = 5, 24  # al8: 2**5 keeps the shift in the metadata word's low bits

# Storage kinds, as the kernel's per-slot compile-time selector (LEGACY_AL8: read on load only).
NONE, FP32, BF16, ABSMAX8, ABSMAX8_FLOORED, AL8, LEGACY_AL8 = range(7)


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


# ------------------------------------------------------------ codec table


@dataclass(frozen=True)
class Codec:
    name: str
    kind: int  # the kernel's storage selector
    code_dtype: torch.dtype
    meta_width: int  # fp32 metadata values per block
    stochastic: bool  # follows the layer's rounding (else always rounds to nearest)


CODECS = {c.name: c for c in (
    Codec("absmax8", ABSMAX8, torch.int8, 1, False),
    Codec("absmax8_floored", ABSMAX8_FLOORED, torch.int8, 1, False),
    Codec("al8", AL8, torch.uint8, 1, True),
)}
# forge_hf 0.1.0's al8 (a uniform log2 grid, metadata lo and width), as its checkpoints name it
LEGACY_AL8_CODEC = Codec("al8", LEGACY_AL8, torch.uint8, 2, True)
# state precision -> (codec of signed slots, codec of never-negative slots)
PRECISION_CODECS = {
    "int8": (CODECS["absmax8"], CODECS["absmax8_floored"]),
    "al8": (CODECS["absmax8"], CODECS["al8"]),
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


def blocks_per_row(in_features: int) -> int:
    return -(-in_features // BLOCK)


def meta_strides(out_features: int, codec: Codec) -> tuple[int, int, int]:
    """The strides of a slot's (out_features, blocks, meta_width) metadata as allocated."""
    return (codec.meta_width, out_features * codec.meta_width, 1)


def meta_layout(out_features: int, in_features: int, codec: Codec) -> tuple[tuple, tuple]:
    """(shape, strides) of a slot's metadata as allocated, what the kernels require."""
    shape = (out_features, blocks_per_row(in_features), codec.meta_width)
    return shape, meta_strides(out_features, codec)


def storage_kind(slot) -> int:
    """The kernel's storage selector for a slot (a tensor, a QuantisedSlot or None)."""
    if slot is None:
        return NONE
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


def _legacy_log_decode(codes, lo, width):
    """forge_hf 0.1.0's al8: code c > 0 is 2**(lo + (c - 1) * width / 254)."""
    step = _div_rn(width, 254.0).unsqueeze(-1)
    return torch.where(codes > 0, torch.exp2(lo.unsqueeze(-1) + (codes - 1.0) * step), 0.0)


def _blocked(x: torch.Tensor, fill=0.0) -> torch.Tensor:
    """(rows, cols) -> (rows, blocks, BLOCK), the last block padded with ``fill``."""
    rows, cols = x.shape
    pad = blocks_per_row(cols) * BLOCK - cols
    if pad:
        x = torch.nn.functional.pad(x, (0, pad), value=fill)
    return x.reshape(rows, -1, BLOCK)


def encode(codec: Codec, x: torch.Tensor, bits: torch.Tensor | None = None):
    """Quantise a (rows, cols) block-aligned piece: codes (rows, cols) and metadata
    (rows, blocks, meta_width). ``bits``: each element's 32-bit hash (integers) for a
    stochastic codec's rounding; None rounds to nearest."""
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


def decode(codec: Codec, codes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """fp32 values of (rows, cols) codes with their (rows, blocks, meta_width) metadata."""
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
    contiguous run, not a word per row 256 bytes apart (that cost the int8 kernel ~5%)."""

    codec: Codec
    codes: torch.Tensor
    meta: torch.Tensor

    @classmethod
    def empty_like(cls, param: torch.Tensor, codec: Codec, transposed: bool) -> QuantisedSlot:
        codes = torch.zeros_like(param, dtype=codec.code_dtype, memory_format=torch.preserve_format)
        out_features, in_features = param.shape[::-1] if transposed else param.shape
        meta = torch.zeros(blocks_per_row(in_features), out_features, codec.meta_width,
                           dtype=torch.float32, device=param.device).transpose(0, 1)
        return cls(codec, codes, meta)  # all codes 0: every state value is exactly 0

    def logical(self, transposed: bool) -> QuantisedSlot:
        """The slot as (out_features, in_features): what the kernels read."""
        return replace(self, codes=self.codes.t()) if transposed else self

    def read(self, rows=slice(None), cols=slice(None)) -> torch.Tensor:
        """fp32 values of a logical slot; ``cols`` must cover whole blocks."""
        return decode(self.codec, self.codes[rows, cols], self.meta[rows, _block_cols(cols, self.codes.shape[1])])

    def write(self, value: torch.Tensor, rows=slice(None), cols=slice(None), bits=None) -> None:
        """Store ``value``; ``bits`` as encode's."""
        codes, meta = encode(self.codec, value, bits)
        self.codes[rows, cols] = codes
        self.meta[rows, _block_cols(cols, self.codes.shape[1])] = meta

    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in (self.codes, self.meta))


def _block_cols(cols: slice, in_features: int) -> slice:
    """The metadata columns of whole blocks ``cols`` covers (it must not split one)."""
    start, stop, _ = cols.indices(in_features)
    if start % BLOCK or (stop % BLOCK and stop != in_features):
        raise ValueError(f"columns {start}:{stop} split a {BLOCK}-element codec block: start and end "
                         f"tiles on multiples of {BLOCK} (or at in_features={in_features})")
    return slice(start // BLOCK, blocks_per_row(stop))
