"""Gluon (Hopper): the fused step of one linear layer as a persistent, warp-specialised kernel
on 64 x 64 blocks, two lanes a program (producer warp: TMA copies; consumer warpgroup: wgmma,
then the rule on the accumulator). Same arithmetic and rounding bits as
triton/fused_update.py's kernel; launch/persistent_launch.py says which layers it takes.
Design: docs/kernels.md.
"""
# no `from __future__ import annotations`: the aggregate checks its field types at run time

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
)
from triton.language.core import _aggregate as aggregate

from ..triton.bf16_bits import bf16_bits_to_fp32, element_hash, fp32_to_bf16_bits
from ..triton.state_tiles import (
    ABSMAX8,
    AL8,
    BF16,
    NONE,
    absmax_biased,
    absmax_decode,
    al8_word,
    int8_code,
    log_decode,
    log_encode,
)
from ..triton.tile_step import finite_sumsq, load_step_args
from .chunk_ring import fill_chunks, multiply_chunks, tma_load

# TMA stores: Triton 3.6's name, renamed async_store in later releases
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

BLOCK_SIZE = 64  # rows, columns and tokens of one block or chunk
BLOCK = gl.constexpr(BLOCK_SIZE)
# benchmark ablations (ABLATE, 0: none): the kernel without its epilogue, or without its main loop
MAINLOOP_ONLY, EPILOGUE_ONLY = gl.constexpr(1), gl.constexpr(2)


@aggregate
class Shared:
    """Descriptors, shared buffers and barriers every partition sees."""
    x_desc: tma.tensor_descriptor
    dy_desc: tma.tensor_descriptor
    w_desc: tma.tensor_descriptor
    s0_desc: tma.tensor_descriptor
    s1_desc: tma.tensor_descriptor
    s2_desc: tma.tensor_descriptor
    x_bufs: gl.shared_memory_descriptor  # (2 * NUM_BUF, 64, 64): token chunks of x, a ring per lane
    dy_bufs: gl.shared_memory_descriptor  # of dy
    w_bufs: gl.shared_memory_descriptor  # (2, 64, 64) bf16 bits: a lane's weight block
    s_bufs: gl.shared_memory_descriptor  # (2 * slots, 64, 64): its state blocks (bf16 bits or 8-bit codes)
    empty: gl.shared_memory_descriptor  # (2 * NUM_BUF, 1): a ring slot may be refilled
    ready: gl.shared_memory_descriptor  # its chunk has landed
    ep_empty: gl.shared_memory_descriptor  # (2, 1): a lane's epilogue buffers are free again
    ep_ready: gl.shared_memory_descriptor  # its weight and state blocks have landed

    @gluon.constexpr_function
    def __init__(self, x_desc, dy_desc, w_desc, s0_desc, s1_desc, s2_desc, x_bufs, dy_bufs, w_bufs, s_bufs,
                 empty, ready, ep_empty, ep_ready):
        self.x_desc, self.dy_desc, self.w_desc = x_desc, dy_desc, w_desc
        self.s0_desc, self.s1_desc, self.s2_desc = s0_desc, s1_desc, s2_desc
        self.x_bufs, self.dy_bufs, self.w_bufs, self.s_bufs = x_bufs, dy_bufs, w_bufs, s_bufs
        self.empty, self.ready, self.ep_empty, self.ep_ready = empty, ready, ep_empty, ep_ready


@gluon.constexpr_function
def present(S0, S1, S2):
    """State slots the rule has (absent ones take no buffer)."""
    return (S0 != NONE) + (S1 != NONE) + (S2 != NONE)


@gluon.constexpr_function
def s_index(lane, slot, S0, S1, S2):
    """s_bufs index of a lane's block of state slot ``slot`` (0-2)."""
    return lane * max(present(S0, S1, S2), 1) + [0, (S0 != NONE), (S0 != NONE) + (S1 != NONE)][slot]


@gluon.jit
def _lane_blocks(N, K, lane: gl.constexpr):
    """(blocks along N, this lane's first block, all blocks, stride between its blocks)."""
    blocks_n = N // BLOCK
    return blocks_n, gl.program_id(0) * 2 + lane, blocks_n * (K // BLOCK), gl.num_programs(0) * 2


@gluon.jit
def _copy(desc, buf, off_n, off_k, bar, IN: gl.constexpr):
    if IN:
        tma_load(desc, [off_n, off_k], bar, buf)
    else:
        tma_store(desc, [off_n, off_k], buf)


@gluon.jit
def _ep_copies(p, lane: gl.constexpr, off_n, off_k, IN: gl.constexpr,
               S0: gl.constexpr, S1: gl.constexpr, S2: gl.constexpr):
    """TMA copies of a lane's weight and state blocks, in (IN, completing ep_ready) or out."""
    bar = p.ep_ready.index(lane)
    _copy(p.w_desc, p.w_bufs.index(lane), off_n, off_k, bar, IN)
    if S0 != NONE:
        _copy(p.s0_desc, p.s_bufs.index(s_index(lane, 0, S0, S1, S2)), off_n, off_k, bar, IN)
    if S1 != NONE:
        _copy(p.s1_desc, p.s_bufs.index(s_index(lane, 1, S0, S1, S2)), off_n, off_k, bar, IN)
    if S2 != NONE:
        _copy(p.s2_desc, p.s_bufs.index(s_index(lane, 2, S0, S1, S2)), off_n, off_k, bar, IN)


@gluon.jit
def producer(p, N, K, T, lane: gl.constexpr, NUM_BUF: gl.constexpr,
             S0: gl.constexpr, S1: gl.constexpr, S2: gl.constexpr, ABLATE: gl.constexpr):
    ep_bytes: gl.constexpr = p.w_desc.block_type.nbytes + (
        (S0 != NONE) * p.s0_desc.block_type.nbytes + (S1 != NONE) * p.s1_desc.block_type.nbytes
        + (S2 != NONE) * p.s2_desc.block_type.nbytes)
    blocks_n, first, num_blocks, stride = _lane_blocks(N, K, lane)
    i = 0  # chunks issued
    j = 0  # blocks issued
    for block in range(first, num_blocks, stride):
        off_n = (block % blocks_n) * BLOCK
        off_k = (block // blocks_n) * BLOCK
        if ABLATE != EPILOGUE_ONLY:
            i = fill_chunks(p.x_desc, p.dy_desc, p.x_bufs, p.dy_bufs, p.empty, p.ready, T, off_n, off_k, i,
                            lane * NUM_BUF, NUM_BUF)
        if ABLATE != MAINLOOP_ONLY:
            # the epilogue's blocks, once the lane's previous epilogue has written its own out
            mbarrier.wait(p.ep_empty.index(lane), (j & 1) ^ 1)
            mbarrier.expect(p.ep_ready.index(lane), ep_bytes)
            _ep_copies(p, lane, off_n, off_k, True, S0, S1, S2)
        j += 1


@gluon.jit
def _scales(meta_ptr, off_n, off_k, N, layout: gl.constexpr, KIND: gl.constexpr):
    """An 8-bit slot's per-row metadata words of a block (an absmax8 scale or al8's
    base | shift; its codec blocks are the block's rows; metadata index (column // 64) * N +
    row, codecs.meta_strides); 0 for other slots."""
    if KIND >= ABSMAX8:
        rows = off_n + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, layout))
        scale = gl.load(meta_ptr + (off_k // BLOCK) * N + rows)
    else:
        scale = 0.0
    return scale


@gluon.jit
def _load_state(p, lane: gl.constexpr, slot: gl.constexpr, scale, layout: gl.constexpr,
                S0: gl.constexpr, S1: gl.constexpr, S2: gl.constexpr, KIND: gl.constexpr):
    raw = p.s_bufs.index(s_index(lane, slot, S0, S1, S2)).load(layout)
    if KIND == BF16:
        value = bf16_bits_to_fp32(raw)
    elif KIND == AL8:  # the uint8 code, carried as int8 in the ring
        value = log_decode(raw.to(gl.uint8, bitcast=True).to(gl.int32), scale.to(gl.int32, bitcast=True))
    else:
        # one conversion (I2F.S8, the byte picked in the instruction) in place of
        # code_to_float's three: this kernel's time follows its instruction count
        value = absmax_decode(raw.to(gl.float32), scale)
    return value


@gluon.jit
def _stage_state(p, lane: gl.constexpr, slot: gl.constexpr, value, h, meta_ptr, off_n, off_k, N,
                 STOCHASTIC: gl.constexpr, S0: gl.constexpr, S1: gl.constexpr, S2: gl.constexpr,
                 KIND: gl.constexpr):
    """Write a state block into its buffer (an 8-bit one's metadata straight to memory), as
    state_tiles.store_state does: a bf16 slot s takes the hash's slot s + 1, al8 codes
    state_tiles.al8_word."""
    buf = p.s_bufs.index(s_index(lane, slot, S0, S1, S2))
    rows = off_n + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, value.type.layout))
    if KIND == BF16:
        buf.store(fp32_to_bf16_bits(value, h, slot + 1, STOCHASTIC))
    elif KIND == AL8:
        codes, meta = log_encode(value, True, al8_word(h, STOCHASTIC))  # every element lies inside the weight
        buf.store(codes.to(gl.int8))  # the uint8 code's bits
        gl.store(meta_ptr + (off_k // BLOCK) * N + rows, meta.to(gl.float32, bitcast=True))
    else:
        biased, scale = absmax_biased(value, True, KIND)
        buf.store(int8_code(biased))
        gl.store(meta_ptr + (off_k // BLOCK) * N + rows, scale)


@gluon.jit
def epilogue(p, acc, lane: gl.constexpr, phase, off_n, off_k, N, K, c, row0, salt, step, meta, scales,
             RULE_UPDATE: gl.constexpr, STOCHASTIC: gl.constexpr,
             S0: gl.constexpr, S1: gl.constexpr, S2: gl.constexpr):
    """The rule on one block's gradient; returns its squared sum and whether the block
    was applied (one whose squared sum is not finite is not written)."""
    layout: gl.constexpr = acc.type.layout
    sumsq, ok = finite_sumsq(acc)
    mbarrier.wait(p.ep_ready.index(lane), phase)
    w = bf16_bits_to_fp32(p.w_bufs.index(lane).load(layout))
    s0 = gl.zeros_like(acc)
    s1 = s0
    s2 = s0
    if S0 != NONE:
        s0 = _load_state(p, lane, 0, scales[0], layout, S0, S1, S2, S0)
    if S1 != NONE:
        s1 = _load_state(p, lane, 1, scales[1], layout, S0, S1, S2, S1)
    if S2 != NONE:
        s2 = _load_state(p, lane, 2, scales[2], layout, S0, S1, S2, S2)
    w, s0, s1, s2 = RULE_UPDATE(w, acc, s0, s1, s2, c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8], c[9],
                                c[10], c[11])
    if STOCHASTIC:
        rn = off_n + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, layout))
        rk = off_k + gl.arange(0, BLOCK, layout=gl.SliceLayout(0, layout))
        h = element_hash(((row0 + rn)[:, None] * K + rk[None, :]).to(gl.uint32, bitcast=True), salt, step)
    else:
        h = 0
    if ok:
        # each thread overwrites only the elements it read: no barrier in between
        p.w_bufs.index(lane).store(fp32_to_bf16_bits(w, h, 0, STOCHASTIC))
        if S0 != NONE:
            _stage_state(p, lane, 0, s0, h, meta[0], off_n, off_k, N, STOCHASTIC, S0, S1, S2, S0)
        if S1 != NONE:
            _stage_state(p, lane, 1, s1, h, meta[1], off_n, off_k, N, STOCHASTIC, S0, S1, S2, S1)
        if S2 != NONE:
            _stage_state(p, lane, 2, s2, h, meta[2], off_n, off_k, N, STOCHASTIC, S0, S1, S2, S2)
        fence_async_shared()
        _ep_copies(p, lane, off_n, off_k, False, S0, S1, S2)
        tma.store_wait(0)  # the copies have read the buffers (deferring this gained nothing)
    mbarrier.arrive(p.ep_empty.index(lane), count=1)
    return sumsq, ok


@gluon.jit
def consumer(p, m0_ptr, m1_ptr, m2_ptr, args_ptr, stats_ptr, N, K, T, lane: gl.constexpr, NUM_BUF: gl.constexpr,
             S0: gl.constexpr, S1: gl.constexpr, S2: gl.constexpr,
             RULE_UPDATE: gl.constexpr, STOCHASTIC: gl.constexpr, ABLATE: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK, 16])
    c, step, salt, row0 = load_step_args(args_ptr)
    blocks_n, first, num_blocks, stride = _lane_blocks(N, K, lane)
    total = gl.to_tensor(0.0)
    bad = gl.to_tensor(0.0)
    i = 0  # chunks consumed
    j = 0  # blocks done
    for block in range(first, num_blocks, stride):
        off_n = (block % blocks_n) * BLOCK
        off_k = (block // blocks_n) * BLOCK
        acc = gl.zeros((BLOCK, BLOCK), gl.float32, mma)
        # 8-bit slots' scales: loaded now, used after the main loop
        scales = (_scales(m0_ptr, off_n, off_k, N, mma, S0), _scales(m1_ptr, off_n, off_k, N, mma, S1),
                  _scales(m2_ptr, off_n, off_k, N, mma, S2))
        if ABLATE != EPILOGUE_ONLY:
            acc, i = multiply_chunks(acc, p.x_bufs, p.dy_bufs, p.empty, p.ready, T, i, lane * NUM_BUF, NUM_BUF)
        if ABLATE == MAINLOOP_ONLY:  # keep the gradient alive, skip the rule
            total += gl.sum(gl.sum(acc, axis=1), axis=0)
        else:
            sumsq, ok = epilogue(p, acc, lane, j & 1, off_n, off_k, N, K, c, row0, salt, step,
                                 (m0_ptr, m1_ptr, m2_ptr), scales, RULE_UPDATE, STOCHASTIC, S0, S1, S2)
            total += gl.where(ok, sumsq, 0.0)
            bad += gl.where(ok, 0.0, 1.0)
        j += 1
    # relaxed: the sums are read after the kernel, which orders them
    gl.atomic_add(stats_ptr, total, sem="relaxed")
    gl.atomic_add(stats_ptr + 1, bad, sem="relaxed")


@gluon.jit
def persistent_update_kernel(x_desc, dy_desc, w_desc, s0_desc, s1_desc, s2_desc, m0_ptr, m1_ptr, m2_ptr,
                             args_ptr, stats_ptr, N, K, T,
                             RULE_UPDATE: gl.constexpr, S0: gl.constexpr, S1: gl.constexpr, S2: gl.constexpr,
                             STOCHASTIC: gl.constexpr, NUM_BUF: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                             PRODUCER_REGS: gl.constexpr, ABLATE: gl.constexpr):
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [2 * NUM_BUF] + x_desc.block_type.shape, x_desc.layout)
    dy_bufs = gl.allocate_shared_memory(dy_desc.dtype, [2 * NUM_BUF] + dy_desc.block_type.shape, dy_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [2] + w_desc.block_type.shape, w_desc.layout)
    # the state slots share one dtype (bf16 bits or 8-bit codes): the first present one's
    if S0 != NONE:
        s_desc = s0_desc
    elif S1 != NONE:
        s_desc = s1_desc
    else:
        s_desc = s2_desc
    s_bufs = gl.allocate_shared_memory(s_desc.dtype, [2 * max(present(S0, S1, S2), 1)] + s_desc.block_type.shape,
                                       s_desc.layout)
    empty = gl.allocate_shared_memory(gl.int64, [2 * NUM_BUF, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [2 * NUM_BUF, 1], mbarrier.MBarrierLayout())
    ep_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ep_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(2 * NUM_BUF):
        mbarrier.init(empty.index(b), count=1)
        mbarrier.init(ready.index(b), count=1)
    for b in gl.static_range(2):
        mbarrier.init(ep_empty.index(b), count=1)
        mbarrier.init(ep_ready.index(b), count=1)
    p = Shared(x_desc, dy_desc, w_desc, s0_desc, s1_desc, s2_desc, x_bufs, dy_bufs, w_bufs, s_bufs,
               empty, ready, ep_empty, ep_ready)
    # lane 0's consumer is the default partition; worker partitions take no tensors
    gl.warp_specialize([
        (consumer, (p, m0_ptr, m1_ptr, m2_ptr, args_ptr, stats_ptr, N, K, T, 0, NUM_BUF, S0, S1, S2,
                    RULE_UPDATE, STOCHASTIC, ABLATE)),
        (consumer, (p, m0_ptr, m1_ptr, m2_ptr, args_ptr, stats_ptr, N, K, T, 1, NUM_BUF, S0, S1, S2,
                    RULE_UPDATE, STOCHASTIC, ABLATE)),
        (producer, (p, N, K, T, 0, NUM_BUF, S0, S1, S2, ABLATE)),
        (producer, (p, N, K, T, 1, NUM_BUF, S0, S1, S2, ABLATE)),
    ], [4, 1, 1], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])


@functools.cache
def _block_layout(dtype: torch.dtype):
    # computed once a dtype: 8 of the ~20 us a descriptor took on the host, six a launch
    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.int16: gl.int16, torch.int8: gl.int8}[dtype]
    return gl.NVMMASharedLayout.get_default_for([BLOCK_SIZE, BLOCK_SIZE], gl_dtype)


def tensor_descriptor(t: torch.Tensor):
    """A TMA descriptor of 64 x 64 blocks of a 2-D bf16, int16 (bf16 bits) or int8 tensor."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    return TensorDescriptor.from_tensor(t, [BLOCK_SIZE, BLOCK_SIZE], _block_layout(t.dtype))
