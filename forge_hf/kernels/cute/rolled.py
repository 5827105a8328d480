"""QuACK's sm90 GEMM with its epilogue's subtiles run as a loop rather than unrolled.

QuACK unrolls the epilogue over a tile's subtiles (8 of 64 x 32 on a 128 x 128 tile). For a
short epilogue that costs nothing; the fused step's rule, hash and three roundings make each
subtile ~1,000 instructions, so the unrolled epilogue is ~130 KB of code and its warps wait
on the instruction cache (Nsight Compute: "no instruction", the largest stall, at every
cache-line start of the epilogue). Here the rule's code is emitted once: only the copy of a
subtile out of the accumulator, which needs static register indices, stays one small branch
per subtile.

This driver covers the fused step's shape of epilogue and refuses others at trace time: the
C operand and tile loads through TMA, D and tile outputs stored through TMA, no prepass, no
predicated stores, and no quantized ones but block_codes.py's 8-bit states (their codes are formed
just before the stores, on 64-column subtiles). An epilogue with a TileStats op (tile_stats.py) has its
tile's gradient tested before the first store, and a tile that is not applied is not stored.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import cutlass
import cutlass.cute as cute
from cutlass import const_expr
from quack.epilogue import frontend
from quack.epilogue.ops import DStore
from quack.gemm_sm90 import GemmSm90

from . import block_codes
from .block_codes import BlockEncode
from .tile_stats import TileStats

# Fewer main-loop stages than this and the wgmma main loop cannot overlap a load with an MMA:
# with one (three fp32 states' epilogue staging, at QuACK's split) the kernel never finishes
MIN_AB_STAGES = 2


class RolledEpilogueSm90(GemmSm90):
    """GemmSm90 whose epilogue loops over its subtiles at run time."""

    @classmethod
    def _compute_stages(cls, *args, **kwargs):
        # QuACK's split of shared memory, with fewer epilogue load stages where the epilogue's
        # staging would leave the main loop fewer than MIN_AB_STAGES
        stages = super()._compute_stages(*args, **kwargs)
        base = cls.epi_c_stage_base
        while stages[0] < MIN_AB_STAGES and base > 1:
            base -= 1
            fewer = type(cls.__name__, (cls,), {"epi_c_stage_base": base})
            stages = super(RolledEpilogueSm90, fewer)._compute_stages(*args, **kwargs)
        if stages[0] < MIN_AB_STAGES:
            raise ValueError(f"the epilogue's shared memory leaves the GEMM {stages[0]} stage(s) of "
                             f"{MIN_AB_STAGES}: smaller tiles (a config with tile_n 64) leave it more")
        return stages

    def _compute_tile_shape_or_override(self, cta_tile_shape_mnk, atom_layout_mnk, element_type=None,
                                        epi_tile_override=None):
        # 8-bit states: a subtile row is one codec block (block_codes.py)
        if epi_tile_override is None and any(isinstance(op, BlockEncode) for op in type(self)._epi_ops):
            epi_tile_override = block_codes.epi_tile(cta_tile_shape_mnk[0])
        return super()._compute_tile_shape_or_override(cta_tile_shape_mnk, atom_layout_mnk, element_type,
                                                       epi_tile_override)

    @cute.jit
    def epilogue(self, params, epi_smem_tensors, epi_pipeline, epi_store_pipeline, epi_read_state,
                 epi_producer_state, epi_tile, load_acc_subtile, tRS_rD, tRS_rC, tiled_copy_t2r,
                 tiled_copy_r2s, tRS_sD, tiled_copy_s2r, tSR_rC, tSR_sC, copy_D, copy_C, tile_coord_mnkl,
                 varlen_manager, epilogue_barrier, tile_scheduler, tidx, is_tma_warp):
        if const_expr(tRS_rC is None or copy_C is None or copy_D is None or epi_pipeline is None
                      or epi_store_pipeline is None or self.epi_needs_acc_prepass):
            raise NotImplementedError("the rolled epilogue needs C and D through TMA and no prepass")
        stores = ((DStore(), None, tiled_copy_r2s, tRS_sD, copy_D, None),) + self.epi_setup_aux_out(
            params, epi_smem_tensors, tiled_copy_r2s, tiled_copy_t2r, tile_coord_mnkl, varlen_manager, tidx)
        for store in stores:
            if const_expr(store[5] is not None or not (store[1] is None or isinstance(store[1], BlockEncode))):
                raise NotImplementedError("the rolled epilogue stores no predicated outputs, and quantizes only "
                                          "with block_codes.BlockEncode")

        grid = cute.zipped_divide(cute.make_layout(self.cta_tile_shape_mnk[:2]), epi_tile).shape[1]
        order = cute.make_ordered_layout(grid, order=(0, 1) if const_expr(self.epi_m_major) else (1, 0))
        count = cute.size(grid)
        earlier = tile_scheduler.num_tiles_executed * count  # subtiles this CTA stored before: the store stage
        ahead = min(count, self.epi_c_stage)
        epi_tensors = self.epi_begin(params, epi_smem_tensors, epi_tile, tiled_copy_t2r, tiled_copy_r2s,
                                     tile_coord_mnkl, varlen_manager, epilogue_barrier, tidx, tRS_rD.layout)
        gates = [op for op in self._epi_ops if isinstance(op, TileStats)]
        if const_expr(len(gates) > 1):
            raise NotImplementedError("the rolled epilogue takes one TileStats op")

        # the first loads (C and the tile operands of a subtile together) before any wait
        for i in cutlass.range(ahead, unroll=1):
            if is_tma_warp:
                epi_pipeline.producer_acquire(epi_producer_state)
                copy_C(src_idx=order.get_hier_coord(i), producer_state=epi_producer_state)
                epi_pipeline.producer_commit(epi_producer_state)
            epi_producer_state.advance()
        applied = True
        if const_expr(gates):  # the tile's test, while the loads fly; the barrier publishes its warps' sums
            gates[0].stage(self, epi_tensors[gates[0].name], load_acc_subtile, tRS_rD, order, count)
        epilogue_barrier.arrive_and_wait()
        if const_expr(gates):
            applied = gates[0].finish(self, epi_tensors[gates[0].name])

        for epi_idx in cutlass.range(count, unroll=1):
            coord = order.get_hier_coord(epi_idx)
            for j in cutlass.range_constexpr(count):  # registers take static indices only
                if epi_idx == j:
                    load_acc_subtile(tRS_rD, order.get_hier_coord(j))
            epi_pipeline.consumer_wait(epi_read_state)
            cute.copy(tiled_copy_s2r, tSR_sC[None, None, None, epi_read_state.index], tSR_rC)
            self.epi_tile_load_s2r(params, epi_tensors, epi_read_state.index)
            cute.arch.fence_view_async_shared()
            epi_pipeline.consumer_release(epi_read_state)
            epi_read_state.advance()
            loop_tensors = self.epi_begin_loop(params, epi_tensors, coord)
            if epi_idx + ahead < count:
                if is_tma_warp:
                    epi_pipeline.producer_acquire(epi_producer_state)
                    copy_C(src_idx=order.get_hier_coord(epi_idx + ahead), producer_state=epi_producer_state)
                    epi_pipeline.producer_commit(epi_producer_state)
                epi_producer_state.advance()

            outputs = (tRS_rD,) + self.epi_visit_subtile(params, loop_tensors, tRS_rD, tRS_rC)
            self.epi_end_loop(params, epi_tensors, coord, tRS_rD, epi_tile, tiled_copy_t2r, tiled_copy_r2s,
                              tile_coord_mnkl, varlen_manager, tidx)
            outputs = tuple(outputs[i] if const_expr(stores[i][1] is None)  # 8-bit states: their codes
                            else stores[i][1].encode(self, loop_tensors, outputs[i], applied)
                            for i in range(len(stores)))
            converted = [stores[i][0].store_convert(self, outputs[i], loop_tensors.get("sr_seed"), tidx,
                                                    tile_coord_mnkl, earlier, epi_idx)
                         for i in range(len(stores))]  # a comprehension is plain Python: static
            if is_tma_warp:
                epi_store_pipeline.producer_acquire()
            epilogue_barrier.arrive_and_wait()
            stage = (earlier + epi_idx) % self.epi_stage
            for i in cutlass.range_constexpr(len(stores)):
                stores[i][0].store_r2s(self, stores[i][2], converted[i], stores[i][3][None, None, None, stage], tidx)
            cute.arch.fence_view_async_shared()  # the stores' smem writes before TMA reads them
            epilogue_barrier.arrive_and_wait()
            if is_tma_warp:
                if applied:  # a skipped tile's weight and states are left as they are
                    for i in cutlass.range_constexpr(len(stores)):
                        stores[i][4](src_idx=stage, dst_idx=coord)
                epi_store_pipeline.producer_commit()

        self.epi_end(params, epi_tensors, epi_tile, tiled_copy_t2r, tiled_copy_r2s, tile_coord_mnkl,
                     varlen_manager, tidx)
        return epi_read_state, epi_producer_state


# What the rolled kernels are made of beyond QuACK: this file, part of each rolled epilogue's key
SOURCE_DIGEST = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


class RolledEpiMod(frontend.EpiMod):
    """An epilogue (as ``gemm_epilogue`` makes one) whose sm90 kernels are RolledEpilogueSm90.
    Its key differs from the unrolled epilogue's of the same function, so neither kernel is
    ever taken for the other."""

    def __init__(self, fn, **kwargs):
        super().__init__(fn, **kwargs)
        self.semantic_key = self.semantic_key + (("rolled epilogue", SOURCE_DIGEST),)
        self.semantic_digest = hashlib.sha256(repr(self.semantic_key).encode()).hexdigest()
        self._ident = f"{fn.__name__}_rolled_{self.semantic_digest[:16]}"
        frontend.TORCH_OP_EPI_MODS[self.semantic_digest] = self

    def _mint(self, *key):
        bases = frontend._SM_BASE
        saved = bases[9]
        bases[9] = RolledEpilogueSm90
        try:
            return super()._mint(*key)
        finally:
            bases[9] = saved


def rolled_epilogue(**kwargs):
    """``gemm_epilogue`` with the subtiles rolled: the same keywords, a RolledEpiMod."""
    return lambda fn: RolledEpiMod(fn, **kwargs)
