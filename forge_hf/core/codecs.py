"""8-bit optimizer-state codecs, written once for both backends.

A quantised state is stored as weight-shaped 8-bit codes plus fp32 metadata for each block
of ``BLOCK`` = 64 contiguous elements of a row (the in_features axis). Since the kernel's
BLOCK_K is a multiple of 64, every block lies inside one tile, and a tile re-quantises its
own blocks in registers. Metadata is laid out (out_features, ceil(in_features / 64),
meta_width) in logical coordinates, whatever the parameter's storage orientation (Conv1D).

* ``absmax8``: symmetric absmax int8 (paper §2.3 and Appendix B; the quantisation seed's
  UF8): scale s = absmax / 127 per block, code round(x * (127 / absmax)) in [-127, 127]
  (to nearest, ties to even), error <= s / 2 (up to fp32 rounding of the two factors).
* ``absmax8_floored``: absmax8 for a state that is never negative (int8 second moments): a
  positive value keeps at least code 1, so 1/sqrt(v) never meets a zero that was not
  there (Appendix B). Such values err by up to one step instead of half.
* ``al8``: the seed's adaptive log code (§4) for never-negative states: per block, the log2
  interval [lo, lo + width] of its positive values; code 0 is exact zero, codes 1..255 are
  uniform in log2 over the interval, so the relative error is the same at every magnitude.

absmax codes round to nearest: Appendix B's argument needs it, and on a 1000-step EMA
stochastic codes drifted more (momentum 1.15 vs 0.78 steps RMS). al8 codes round
stochastically, unbiased in value, when the layer's rounding is "stochastic": with
beta2 = 0.999 a step of v is far below half a code, so round-to-nearest only ever moves v
up on gradient spikes: v ratcheted 7% high in that test (0.1% with stochastic codes).

The arithmetic (``*_encode``/``*_decode``) uses only the free name ``ops``, bound to
``triton.language`` by kernels/state_tiles.py and to torch here, like the rules' updates.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, replace

import torch

from .rules import bind_ops

BLOCK = 64
ROUNDER = 12582912.0  # 1.5 * 2**23 (absmax_encode)
MIN_LOG_WIDTH = 0.0625  # al8: a block of (nearly) equal values still gets a resolvable grid

# Storage kinds, as the kernel's per-slot compile-time selector.
NONE, FP32, BF16, ABSMAX8, ABSMAX8_FLOORED, AL8 = range(6)


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


def log_encode(x, valid, u):
    """Codes in [0, 255] (as floats), the block's log2 lower end and width. ``u`` is 0.5 to
    round to the nearer grid value, or uniform in [0, 1) to round up with probability equal
    to the position between the two (unbiased)."""
    positive = valid & (x > 0.0)
    lx = ops.log2(ops.maximum(x, 1.1754943508222875e-38))  # 2**-126: no subnormal logs
    lo = ops.min(ops.where(positive, lx, 1e30), axis=-1)
    hi = ops.minimum(ops.max(ops.where(positive, lx, -1e30), axis=-1), 126.0)  # 2**hi stays finite
    lo = ops.where(hi >= lo, lo, 0.0)  # a block with no positive value
    width = ops.maximum(hi - lo, 0.0625)  # MIN_LOG_WIDTH (a bound function sees only ops)
    step = ops.expand_dims(ops.div_rn(width, 254.0), -1)
    lo_x = ops.expand_dims(lo, -1)
    level = ops.minimum(ops.maximum(ops.floor(ops.div_rn(lx - lo_x, step)), 0.0), 253.0)
    below = ops.exp2(lo_x + level * step)
    above = ops.exp2(lo_x + (level + 1.0) * step)
    level = level + ops.where(x - below > u * (above - below), 1.0, 0.0)
    return ops.where(positive, level + 1.0, 0.0), lo, width


def log_decode(codes, lo, width):
    step = ops.expand_dims(ops.div_rn(width, 254.0), -1)
    return ops.where(codes > 0.0, ops.exp2(ops.expand_dims(lo, -1) + (codes - 1.0) * step), 0.0)


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
    Codec("al8", AL8, torch.uint8, 2, True),
)}
# state precision -> (codec of signed slots, codec of never-negative slots)
PRECISION_CODECS = {
    "int8": (CODECS["absmax8"], CODECS["absmax8_floored"]),
    "al8": (CODECS["absmax8"], CODECS["al8"]),
}


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
    where=torch.where, abs=torch.abs, floor=torch.floor, log2=torch.log2, exp2=torch.exp2,
    div_rn=_div_rn, expand_dims=torch.unsqueeze,
)
_absmax_encode, _floor_positive, _absmax_decode, _log_encode, _log_decode = (
    bind_ops(f, TORCH_OPS) for f in (absmax_encode, floor_positive, absmax_decode, log_encode, log_decode))


def _blocked(x: torch.Tensor, fill=0.0) -> torch.Tensor:
    """(rows, cols) -> (rows, blocks, BLOCK), the last block padded with ``fill``."""
    rows, cols = x.shape
    pad = blocks_per_row(cols) * BLOCK - cols
    if pad:
        x = torch.nn.functional.pad(x, (0, pad), value=fill)
    return x.reshape(rows, -1, BLOCK)


def uniform(bits: torch.Tensor) -> torch.Tensor:
    """Uniform [0, 1) from 16 random bits held in int64 (kernels/state_tiles.py: uniform); 2**-16
    steps are far finer than any 8-bit code's rounding needs."""
    return bits.float() * 2.0**-16


def encode(codec: Codec, x: torch.Tensor, u: torch.Tensor | float = 0.5):
    """Quantise a (rows, cols) block-aligned piece: codes (rows, cols) and metadata
    (rows, blocks, meta_width)."""
    rows, cols = x.shape
    x3 = _blocked(x.float())
    valid = _blocked(torch.ones_like(x, dtype=torch.bool), fill=False)
    if codec.kind == AL8:
        u3 = _blocked(u) if isinstance(u, torch.Tensor) else u
        codes, lo, width = _log_encode(x3, valid, u3)
        meta = torch.stack([lo, width], dim=-1)
    else:
        biased, scale = _absmax_encode(x3, valid)
        if codec.kind == ABSMAX8_FLOORED:
            biased = _floor_positive(biased, x3)
        codes = biased - ROUNDER
        meta = scale[..., None]
    return codes.flatten(1)[:, :cols].to(codec.code_dtype), meta


def decode(codec: Codec, codes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """fp32 values of (rows, cols) codes with their (rows, blocks, meta_width) metadata."""
    rows, cols = codes.shape
    c3 = _blocked(codes.float())
    if codec.kind == AL8:
        x3 = _log_decode(c3, meta[..., 0], meta[..., 1])
    else:
        x3 = _absmax_decode(c3, meta[..., 0])
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

    def write(self, value: torch.Tensor, rows=slice(None), cols=slice(None), u=0.5) -> None:
        codes, meta = encode(self.codec, value, u)
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
