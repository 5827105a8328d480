"""8-bit optimizer states in the rolled epilogue (rolled.py): core/codecs.py's absmax8,
absmax8_floored and al8 codes over blocks of 64 elements of a row, with each block's fp32
metadata word at ``(column // 64) * out_features + row`` (codecs.meta_strides).

The codes travel as QuACK tile operands and tile outputs (as uint8 bytes, through TMA). The
rolled driver makes the epilogue subtile 64 columns wide when an op here is present, so each
row of a subtile is one codec block: its statistics reduce the thread's values of that row,
then the few lanes that share the row (a quad in the wgmma layout), with no shared memory.
Per-row values live in register tensors whose layout has stride 0 along N (QuACK's
ColVecReduce does the same), so element i of a subtile finds its row's value at index i.

Three ops for each 8-bit slot ``s``:
- ``MetaLoad("s_meta")``, a value port: each element's block metadata, for the step's function
  to decode the codes with (``decode``);
- ``BlockEncode("s_encode", output="s_new")``, the quantize codec of the slot's tile output:
  from the new fp32 values it forms each block's statistics, codes and metadata as
  kernels/triton/state_tiles.py's store_state does, stores the metadata of an applied tile, and
  hands the codes to the tile store;
- ``WordSink("s_word")``, al8 with stochastic rounding only: the element hash the function
  computed, for the codes to round with (codecs.log_encode's ``word``).
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32, const_expr
from quack.epilogue.ops import _lane_warp_info_n
from quack.reduce import warp_reduce

from ...core import codecs
from .exact import PTX, Exact, where
from .host_pointer import HostPointerOp

BLOCK = codecs.BLOCK
ROUNDER = codecs.ROUNDER
INT_MIN = -(2**31)
SIGN = Int32(INT_MIN)  # xor with it orders int32 values as their unsigned patterns
KINDS = (codecs.ABSMAX8, codecs.ABSMAX8_FLOORED, codecs.AL8)
SOURCE_DIGEST = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()  # in every op's key


def pick(cond, a, b) -> Int32:
    """An int32 select typed as Int32: cutlass.select_ returns a signless value, which
    Float32() refuses to convert ("signless to float conversion is not implemented")."""
    return Int32(cutlass.select_(cond, a, b))


@cute.jit
def tile_coordinates(ctx):
    """(row, column) in the CTA tile of each accumulator element a thread holds, by subtile:
    index it ``[None, None, None, epi_coord]`` for a subtile's, congruent with its fragment."""
    coords = ctx.partition_for_epilogue_fn(cute.make_identity_tensor((ctx.tile_M, ctx.tile_N)))
    if const_expr(ctx.tiled_copy_t2r is not None):
        coords = ctx.tiled_copy_r2s.retile(coords)
    return cute.group_modes(coords, 3, cute.rank(coords))


def epi_tile(tile_m: int) -> tuple[int, int]:
    """The epilogue subtile that makes each subtile row one codec block."""
    return (math.gcd(64, tile_m), BLOCK)


# ------------------------------------------------------------------ decoding (in the step's function)


def decode(kind: int, code, meta) -> Exact:
    """The fp32 value of a code (its tile operand's value: the byte, as a float) with its block's
    metadata (MetaLoad's value), as state_tiles.decode_state reads it."""
    byte = Int32(code) & Int32(0xFF)  # the DSL widens a uint8 tile as signed: keep the stored byte
    if kind == codecs.AL8:
        codes = Uint32(byte)
        word = PTX.f32_bits(meta)
        shift = word & Uint32(31)
        value = PTX.bits_f32(codes * (Uint32(1) << shift) + (word - shift))  # wraps as Triton's int32
        return where(codes != Uint32(codecs.AL8_ZERO), value, 0.0)
    signed = pick(byte > Int32(127), byte - Int32(256), byte)  # absmax codes are int8
    return Exact(Float32(signed)) * meta


# ------------------------------------------------------------------ per-tile geometry


class Geometry(NamedTuple):
    coords: object  # (row, column) of each fragment element in the CTA tile, by subtile
    row_layout: object  # a subtile fragment's layout with stride 0 along N: one register a row
    lanes: int  # lanes that share a row
    leader: object  # whether this lane writes its rows' metadata
    m0: object  # the tile's first row and column
    n0: object
    rows: object  # the weight's rows (out features) and columns (in features)
    cols: object
    meta: object  # the slot's metadata, a flat fp32 tensor in global memory


class _SlotOp(HostPointerOp):
    """An op handed the slot's metadata tensor (its host value): the tile's geometry."""

    @cute.jit
    def begin(self, gemm, param, smem_tensor, ctx):
        coords = tile_coordinates(ctx)
        rows = ctx.partition_for_epilogue_fn(
            cute.make_rmem_tensor(cute.make_layout((ctx.tile_M, ctx.tile_N), stride=(1, 0)), Float32))
        rows = cute.group_modes(rows, 3, cute.rank(rows))
        lanes, warps_in_n, _, leader = _lane_warp_info_n(ctx.tiled_copy_r2s, True, ctx.tidx)
        assert warps_in_n == 1, "a codec block's row must lie in one warp"
        n_rows = ctx.varlen_manager.len_m(ctx.batch_idx)
        n_cols = ctx.varlen_manager.len_n()
        meta = cute.make_tensor(param, cute.make_layout(n_rows * ((n_cols + BLOCK - 1) // BLOCK)))
        return Geometry(coords, rows[None, None, None, 0].layout, lanes, leader,
                        ctx.tile_coord_mnkl[0] * ctx.tile_M, ctx.tile_coord_mnkl[1] * ctx.tile_N,
                        n_rows, n_cols, meta)

    @cute.jit
    def begin_loop(self, gemm, state, epi_coord):
        return state, state.coords[None, None, None, epi_coord]


@cute.jit
def _row_ids(geometry: Geometry, here):
    """The tile row of each distinct row register (a filtered tensor), and the subtile's block
    column (in the weight)."""
    ids = cute.make_rmem_tensor(geometry.row_layout, Int32)
    for i in cutlass.range_constexpr(cute.size(here)):
        ids[i] = here[i][0]  # every element of a row writes the same register, the same value
    return cute.filter_zeros(ids), (geometry.n0 + here[0][1]) // BLOCK


class MetaLoad(_SlotOp):
    """A value port: the block metadata of each element of the subtile (0 outside the weight)."""

    fn_port = "value"

    def config_key(self):
        return (SOURCE_DIGEST,)

    @cute.jit
    def begin_loop(self, gemm, state, epi_coord):
        here = state.coords[None, None, None, epi_coord]
        ids, block = _row_ids(state, here)
        meta = cute.make_rmem_tensor(state.row_layout, Float32)
        values = cute.filter_zeros(meta)
        for j in cutlass.range_constexpr(cute.size(ids)):
            row = state.m0 + ids[j]
            value = Float32(0.0)
            if (row < state.rows) & (block * BLOCK < state.cols):
                value = state.meta[block * state.rows + row]
            values[j] = value
        return meta


class WordSink(HostPointerOp):
    """A sink: al8's random bits (the element hash as an fp32 pattern) of each element, kept
    for BlockEncode in the same subtile. Its host value is 0 (no pointer: nothing is stored)."""

    fn_port = "sink"

    def config_key(self):
        return (SOURCE_DIGEST,)

    @cute.jit
    def begin(self, gemm, param, smem_tensor, ctx):
        return ctx.tRS_rD_layout

    @cute.jit
    def begin_loop(self, gemm, state, epi_coord):
        return cute.make_rmem_tensor(state, Float32)

    @cute.jit
    def fn_sink_flush(self, gemm, state, frag):
        for i in cutlass.range_constexpr(cute.size(frag)):
            state[i] = frag[i]


class BlockEncode(_SlotOp):
    """The quantize codec of an 8-bit slot's tile output ``output``: ``encode`` turns a
    subtile's new fp32 values into codes (their bytes as fp32 integers, converted exactly by the
    uint8 store) and stores the blocks' metadata. ``word``: the WordSink's name (al8,
    stochastic), else None."""

    def __init__(self, name, output: str, kind: int, word: str | None = None):
        super().__init__(name)
        if kind not in KINDS:
            raise ValueError(f"storage kind {kind}: BlockEncode takes {KINDS}")
        self.quant_output, self.kind, self.word = output, kind, word

    def config_key(self):
        return (self.quant_output, self.kind, self.word, SOURCE_DIGEST)

    @cute.jit
    def encode(self, gemm, loop_tensors, values, applied):
        state, here = loop_tensors[self.name]
        ids, block = _row_ids(state, here)
        valid = cute.make_rmem_tensor(values.layout, cutlass.Boolean)
        for i in cutlass.range_constexpr(cute.size(values)):
            valid[i] = (state.m0 + here[i][0] < state.rows) & (state.n0 + here[i][1] < state.cols)
        codes = cute.make_rmem_tensor(values.layout, Float32)
        meta = cute.make_rmem_tensor(state.row_layout, Float32)
        if const_expr(self.kind == codecs.AL8):
            self._log_codes(state, values, valid, loop_tensors, codes, meta)
        else:
            self._absmax_codes(state, values, valid, codes, meta)
        store = state.leader & (block * BLOCK < state.cols)
        if const_expr(applied is not True):
            store = store & applied  # a skipped tile keeps its metadata, as its codes
        if store:
            stored = cute.filter_zeros(meta)
            for j in cutlass.range_constexpr(cute.size(ids)):
                row = state.m0 + ids[j]
                if row < state.rows:
                    state.meta[block * state.rows + row] = stored[j]
        return codes

    @cute.jit
    def _absmax_codes(self, state, values, valid, codes, meta):
        """codecs.absmax_encode (and floor_positive): the block's largest magnitude, found on
        the values' bit patterns (ordered as the magnitudes), one division by it a block."""
        amax = cute.make_rmem_tensor(state.row_layout, Int32)
        cute.filter_zeros(amax).fill(0)
        for i in cutlass.range_constexpr(cute.size(values)):
            magnitude = pick(valid[i], Int32(PTX.f32_bits(values[i])) & Int32(0x7FFFFFFF), Int32(0))
            amax[i] = pick(magnitude > amax[i], magnitude, amax[i])
        inverse = cute.make_rmem_tensor(state.row_layout, Float32)
        rows_amax, rows_inverse, rows_scale = (cute.filter_zeros(t) for t in (amax, inverse, meta))
        for j in cutlass.range_constexpr(cute.size(rows_amax)):
            largest = warp_reduce(rows_amax[j], max, threads_in_group=state.lanes)
            a = cute.arch.fmax(PTX.bits_f32(Uint32(largest)), Float32(1e-30))
            rows_inverse[j] = PTX.div_rn(Float32(127.0), a)
            rows_scale[j] = PTX.div_rn(a, Float32(127.0))
        for i in cutlass.range_constexpr(cute.size(values)):
            biased = Exact(values[i]) * inverse[i] + ROUNDER
            if const_expr(self.kind == codecs.ABSMAX8_FLOORED):
                biased = where(values[i] > Float32(0.0), cute.arch.fmax(biased.v, Float32(ROUNDER + 1.0)), biased)
            code = (biased - ROUNDER).v  # exact: the code, an integer in [-127, 127]
            codes[i] = cutlass.select_(code < Float32(0.0), code + Float32(256.0), code)  # its byte, unsigned

    @cute.jit
    def _log_codes(self, state, values, valid, loop_tensors, codes, meta):
        """codecs.log_encode on the values' bit patterns: each block's largest and least
        positive pattern, the shift that spans them in 253 steps, the codes rounded up by the
        word's top ``shift`` bits (the element hash; HALF_WORD rounds to nearest)."""
        bits = cute.make_rmem_tensor(values.layout, Int32)
        hi = cute.make_rmem_tensor(state.row_layout, Int32)
        low = cute.make_rmem_tensor(state.row_layout, Int32)  # (b - 1) ^ SIGN: unsigned order
        cute.filter_zeros(hi).fill(INT_MIN)
        cute.filter_zeros(low).fill(2**31 - 1)
        for i in cutlass.range_constexpr(cute.size(values)):
            b = pick(valid[i], Int32(PTX.f32_bits(values[i])), Int32(0))
            bits[i] = b
            hi[i] = pick(b > hi[i], b, hi[i])
            flipped = (b - Int32(1)) ^ SIGN
            low[i] = pick(flipped < low[i], flipped, low[i])
        base = cute.make_rmem_tensor(state.row_layout, Int32)
        shift = cute.make_rmem_tensor(state.row_layout, Int32)
        rows_hi, rows_low, rows_base, rows_shift, rows_meta = (
            cute.filter_zeros(t) for t in (hi, low, base, shift, meta))
        for j in cutlass.range_constexpr(cute.size(rows_hi)):
            top = Int32(warp_reduce(rows_hi[j], max, threads_in_group=state.lanes))
            least = (Int32(warp_reduce(rows_low[j], min, threads_in_group=state.lanes)) ^ SIGN) + Int32(1)
            lo = pick(top > Int32(0), least, Int32(0))
            span = Int32(PTX.f32_bits(Float32(top - lo)))
            s = ((span + Int32(0x3FFFF)) >> Int32(23)) - Int32(134)
            s = pick(s < Int32(codecs.MIN_SHIFT), Int32(codecs.MIN_SHIFT), s)
            s = pick(s > Int32(codecs.MAX_SHIFT), Int32(codecs.MAX_SHIFT), s)
            rows_shift[j] = s
            rows_base[j] = (lo >> s) << s
            rows_meta[j] = PTX.bits_f32(Uint32(rows_base[j] | s))
        for i in cutlass.range_constexpr(cute.size(values)):
            if const_expr(self.word is not None):
                word = PTX.f32_bits(loop_tensors[self.word][i])
            else:
                word = Uint32(codecs.HALF_WORD)
            up = Int32(word >> Uint32(Int32(32) - shift[i]))
            code = (bits[i] - base[i] + up) >> shift[i]
            # a negative code (zero below a positive base) is above 255 as unsigned: code 255, zero
            code = pick((code < Int32(0)) | (code > Int32(codecs.AL8_ZERO)), Int32(codecs.AL8_ZERO), code)
            codes[i] = Float32(code)
