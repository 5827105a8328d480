"""The fused step's per-tile gradient statistics and non-finite skip, for the rolled epilogue
(rolled.py), as the Triton kernel's ``record_tile`` does them (kernels/triton/fused_update.py).

Before any subtile of a CTA tile is stored, each consumer thread sums the squares of its share
of the fp32 accumulator (the tile's whole gradient is in registers: 128 values a thread on a
128 x 128 tile), each warp sums its lanes, and after the epilogue barrier every thread adds the
warps' sums from shared memory in one order, so all agree on the tile's squared sum. A tile
whose sum is not finite (a NaN or inf in its gradient, or a square overflowing: as
tile_step.finite_sumsq tests it) is counted in ``stats[1]`` and none of its weight or state
subtiles is stored; any other tile adds its sum to ``stats[0]``.

The skip granularity is this kernel's CTA tile (tile_m x tile_n of the config: 128 x 128 by
default); the Triton kernel's is its BLOCK_N x BLOCK_K block (64 x 64). Each skips exactly the
tiles of its own grid that hold a non-finite gradient, so with a non-finite gradient the two
kernels share the semantics tile by tile but not the bits: one NaN leaves a whole 128 x 128
tile unchanged here, where the Triton kernel still updates the tile's other three 64 x 64
blocks, and the skip counts differ. Finite steps agree bit for bit, and the squared sums up to
the order of fp32 additions.
"""

from __future__ import annotations

import hashlib
import math
import operator
from pathlib import Path

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr
from quack.epilogue.ops import EpiSmemBytes

from .host_pointer import HostPointerOp

# The host value of the op when no statistics are asked for: tiles are still skipped
OFF = 0.0
SOURCE_DIGEST = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def pairwise_sum(values: list):
    """The sum of traced values as a balanced tree: a short dependency chain."""
    while len(values) > 1:
        pairs = [values[i] + values[i + 1] for i in range(0, len(values) - 1, 2)]
        values = pairs + values[2 * len(pairs):]
    return values[0]


class TileStats(HostPointerOp):
    """An extra op the rolled driver consumes (the epilogue's function never sees it): the
    host passes ``stats`` (a CUDA fp32 tensor of 2: squared sum, skipped tiles), or ``OFF`` to
    skip non-finite tiles without recording. The driver calls ``stage`` before its barrier and
    ``finish`` after it, and stores the tile only where ``finish`` says so."""

    def config_key(self):
        return (SOURCE_DIGEST,)  # the kernel's code is this file's: part of every key

    # --- shared memory: one fp32 a consumer warp, for the exchange of the warps' sums

    def smem_bytes(self, arg_tensor, cta_tile_shape_mnk, epi_tile, warp_shape_mnk=None):
        return EpiSmemBytes(unstaged=warp_shape_mnk[0] * (Float32.width // 8))

    def smem_struct_field(self, gemm, params):
        return (f"s_{self.name}", cute.struct.Align[cute.struct.MemRange[Float32, gemm.num_epi_warps], 16])

    def get_smem_tensor(self, gemm, params, storage_epi):
        return getattr(storage_epi, f"s_{self.name}").get_tensor(cute.make_layout(gemm.num_epi_warps))

    # --- device

    @cute.jit
    def begin(self, gemm, param, smem_tensor, ctx):
        return param, smem_tensor, ctx.tidx

    @cute.jit
    def stage(self, gemm, state, load_acc_subtile, tRS_rD, order, count):
        """Before the driver's barrier: this warp's squared sum of the tile, in shared memory.
        One sum a subtile, added at the end: independent chains of fused multiply-adds."""
        _, smem, tidx = state
        sums = []
        for j in cutlass.range_constexpr(count):
            load_acc_subtile(tRS_rD, order.get_hier_coord(j), no_release=True)
            s = Float32(0.0)
            for i in cutlass.range_constexpr(cute.size(tRS_rD)):
                s = s + tRS_rD[i] * tRS_rD[i]
            sums.append(s)
        warp_sum = cute.arch.warp_reduction(pairwise_sum(sums), operator.add)
        if cute.arch.lane_idx() == 0:
            smem[tidx // cute.arch.WARP_SIZE] = warp_sum

    @cute.jit
    def finish(self, gemm, state):
        """After the driver's barrier: whether the tile is applied (the same in every thread),
        recorded by the first thread."""
        stats, smem, tidx = state
        total = smem[0]
        for w in cutlass.range_constexpr(1, cute.size(smem)):
            total = total + smem[w]
        applied = total < Float32(math.inf)  # false for NaN too
        if const_expr(isinstance(stats, cute.Pointer)):
            if tidx == 0:
                # relaxed, as the Triton kernel's: the sums are read after the kernel
                if applied:
                    cute.arch.red(stats, total, op="add", dtype=Float32, sem="relaxed", scope="gpu")
                else:
                    cute.arch.red(stats + 1, Float32(1.0), op="add", dtype=Float32, sem="relaxed", scope="gpu")
        return applied
