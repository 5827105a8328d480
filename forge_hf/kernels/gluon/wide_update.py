"""Gluon (Hopper): the fused step of one linear layer at thousands of tokens, on 128 x 128
tiles whose epilogue runs beside the next tile's GEMM (a producer warp, an MMA warpgroup
staging each tile's gradient in shared memory, two epilogue warpgroups). Same bits as the
other kernels; launch/wide_launch.py says which layers it takes. Design: docs/kernels.md.
"""
# no `from __future__ import annotations`: the aggregate checks its field types at run time

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.language.core import _aggregate as aggregate

from ..triton.bf16_bits import bf16_bits_to_fp32, element_hash, fp32_to_bf16_bits
from ..triton.state_tiles import (
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
from ..triton.tile_step import applicable, load_step_args
from .chunk_ring import fill_chunks, multiply_chunks

# Triton 3.6's name, renamed in later releases
partition_barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # the calling partition's warps

TILE_SIZE = 128  # rows and columns of a tile
CHUNK_SIZE = 64  # tokens of a ring slot
SUB_SIZE = 64  # rows and columns of an epilogue block (the unit of non-finite skipping)
TILE = gl.constexpr(TILE_SIZE)
SUB = gl.constexpr(SUB_SIZE)


@aggregate
class Wide:
    """Descriptors, shared buffers and barriers every partition sees."""
    x_desc: tma.tensor_descriptor
    dy_desc: tma.tensor_descriptor
    x_bufs: gl.shared_memory_descriptor  # (NUM_BUF, 64, 128): token chunks of x
    dy_bufs: gl.shared_memory_descriptor  # of dy
    acc_buf: gl.shared_memory_descriptor  # (128, 128) fp32: a tile's gradient, MMA -> epilogue
    sums_buf: gl.shared_memory_descriptor  # (4,) fp32: its 64 x 64 blocks' squared sums, row by row
    empty: gl.shared_memory_descriptor  # (NUM_BUF, 1): a ring slot may be refilled
    ready: gl.shared_memory_descriptor  # its chunk has landed
    acc_empty: gl.shared_memory_descriptor  # (1, 1): the epilogue has read the staged gradient
    acc_ready: gl.shared_memory_descriptor  # a gradient is staged

    @gluon.constexpr_function
    def __init__(self, x_desc, dy_desc, x_bufs, dy_bufs, acc_buf, sums_buf, empty, ready, acc_empty, acc_ready):
        self.x_desc, self.dy_desc = x_desc, dy_desc
        self.x_bufs, self.dy_bufs, self.acc_buf, self.sums_buf = x_bufs, dy_bufs, acc_buf, sums_buf
        self.empty, self.ready, self.acc_empty, self.acc_ready = empty, ready, acc_empty, acc_ready


@gluon.constexpr_function
def epilogue_rows(S0, S1, S2):
    """Rows of a 64 x 64 block the epilogue's 8 warps take at once: 8 elements a thread, 4
    for a rule with three states (8 would spill registers)."""
    return 16 if (S0 != NONE) + (S1 != NONE) + (S2 != NONE) == 3 else 32


@gluon.constexpr_function
def epilogue_layout(rows):
    """8 warps over rows x 64: each thread 64 // (64 * rows // 256) consecutive elements."""
    if rows == 32:
        return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[8, 1], order=[1, 0])
    return gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[2, 16], warps_per_cta=[8, 1], order=[1, 0])


@gluon.jit
def _tiles(N, K):
    """(this program's first tile, all tiles, stride between its tiles)."""
    return gl.program_id(0), (N // TILE) * (K // TILE), gl.num_programs(0)


@gluon.jit
def _tile_origin(tile, N, K):
    """(first row, first column) of a tile. Consecutive tiles, which the programs at work
    take together, run across the shorter side: they share the longer side's chunks (dy's
    for many rows, x's for many columns), read from memory once, while the shorter side's
    tokens stay in L2. Run down a long side, each band of the other side would read its
    whole token matrix again (gate/up_proj's 14336 rows, lm_head's 128256)."""
    if K <= N:
        across = K // TILE
        return (tile // across) * TILE, (tile % across) * TILE
    down = N // TILE
    return (tile % down) * TILE, (tile // down) * TILE


@gluon.jit
def producer(p, N, K, T, NUM_BUF: gl.constexpr):
    first, num_tiles, stride = _tiles(N, K)
    i = 0  # chunks issued
    for tile in range(first, num_tiles, stride):
        off_n, off_k = _tile_origin(tile, N, K)
        i = fill_chunks(p.x_desc, p.dy_desc, p.x_bufs, p.dy_bufs, p.empty, p.ready, T, off_n, off_k, i, 0, NUM_BUF)


@gluon.jit
def _block_sums(acc):
    """The squared sums of a tile's four 64 x 64 blocks, row by row, as a (4,) tensor: formed
    from the accumulator's registers, so the epilogue reads the staged gradient once."""
    layout: gl.constexpr = acc.type.layout
    cols = gl.arange(0, TILE, layout=gl.SliceLayout(0, layout))
    rows = gl.arange(0, TILE, layout=gl.SliceLayout(1, layout))
    square = acc * acc
    left = gl.sum(gl.where(cols[None, :] < SUB, square, 0.0), axis=1)
    right = gl.sum(gl.where(cols[None, :] < SUB, 0.0, square), axis=1)
    top = rows < SUB
    s00 = gl.sum(gl.where(top, left, 0.0), axis=0)
    s01 = gl.sum(gl.where(top, right, 0.0), axis=0)
    s10 = gl.sum(gl.where(top, 0.0, left), axis=0)
    s11 = gl.sum(gl.where(top, 0.0, right), axis=0)
    index = gl.arange(0, 4, layout=gl.BlockedLayout([1], [32], [4], [0]))
    return gl.where(index == 0, s00, gl.where(index == 1, s01, gl.where(index == 2, s10, s11)))


@gluon.jit
def mma(p, N, K, T, NUM_BUF: gl.constexpr):
    """Each tile's gradient dY[:, rows]^T X[:, cols] in fp32, staged for the epilogue."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, TILE, 16])
    first, num_tiles, stride = _tiles(N, K)
    i = 0  # chunks consumed
    j = 0  # tiles staged
    for _tile in range(first, num_tiles, stride):
        acc = gl.zeros((TILE, TILE), gl.float32, layout)
        acc, i = multiply_chunks(acc, p.x_bufs, p.dy_bufs, p.empty, p.ready, T, i, 0, NUM_BUF)
        sums = _block_sums(acc)
        mbarrier.wait(p.acc_empty.index(0), (j & 1) ^ 1)  # the epilogue has read the last tile
        p.acc_buf.store(acc)
        p.sums_buf.store(sums)
        partition_barrier()  # every thread's part is stored before the one arrival
        mbarrier.arrive(p.acc_ready.index(0), count=1)
        j += 1


@gluon.jit
def _load_state(s_ptr, m_ptr, offs, meta_offs, KIND: gl.constexpr):
    """fp32 values of a state's rows (bf16 bits, or 8-bit codes whose codec blocks are the
    rows, with their metadata words at ``meta_offs``)."""
    raw = gl.load(s_ptr + offs)
    if KIND == BF16:
        value = bf16_bits_to_fp32(raw)
    elif KIND == AL8:  # the uint8 code, passed as int8
        meta = gl.load(m_ptr + meta_offs).to(gl.int32, bitcast=True)
        value = log_decode(raw.to(gl.uint8, bitcast=True).to(gl.int32), meta)
    else:
        value = absmax_decode(raw.to(gl.float32), gl.load(m_ptr + meta_offs))
    return value


@gluon.jit
def _store_state(s_ptr, m_ptr, offs, meta_offs, value, h, slot: gl.constexpr, STOCHASTIC: gl.constexpr,
                 KIND: gl.constexpr):
    """Store a state's rows as state_tiles.store_state does: a bf16 slot s takes the hash's
    slot s + 1, al8 codes state_tiles.al8_word; an 8-bit row's metadata word with it."""
    if KIND == BF16:
        gl.store(s_ptr + offs, fp32_to_bf16_bits(value, h, slot + 1, STOCHASTIC))
    elif KIND == AL8:
        codes, meta = log_encode(value, True, al8_word(h, STOCHASTIC))  # every element lies inside the weight
        gl.store(s_ptr + offs, codes.to(gl.int8))  # the uint8 code's bits
        gl.store(m_ptr + meta_offs, meta.to(gl.float32, bitcast=True))
    else:
        biased, scale = absmax_biased(value, True, KIND)
        gl.store(s_ptr + offs, int8_code(biased))
        gl.store(m_ptr + meta_offs, scale)


@gluon.jit
def _epilogue_rows(p, w_ptr, s_ptrs, m_ptrs, off_n, off_k, r0: gl.constexpr, c0: gl.constexpr, N, K, ok,
                   consts, row0, salt, step, ROWS: gl.constexpr, layout: gl.constexpr, RULE_UPDATE: gl.constexpr,
                   STOCHASTIC: gl.constexpr, S0: gl.constexpr, S1: gl.constexpr, S2: gl.constexpr):
    """The rule on ROWS staged rows from (r0, c0), 64 columns, written where ``ok``."""
    g = p.acc_buf.slice(r0, ROWS, dim=0).slice(c0, SUB, dim=1).load(layout)
    rn = off_n + r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    rk = off_k + c0 + gl.arange(0, SUB, layout=gl.SliceLayout(0, layout))
    offs = rn[:, None] * K + rk[None, :]
    # an 8-bit state's metadata: a word a row's 64 columns (codecs.meta_strides: (column // 64) * N + row)
    meta_offs = ((off_k + c0) // SUB) * N + rn
    w = bf16_bits_to_fp32(gl.load(w_ptr + offs))
    s0 = gl.zeros_like(g)
    s1 = s0
    s2 = s0
    if S0 != NONE:
        s0 = _load_state(s_ptrs[0], m_ptrs[0], offs, meta_offs, S0)
    if S1 != NONE:
        s1 = _load_state(s_ptrs[1], m_ptrs[1], offs, meta_offs, S1)
    if S2 != NONE:
        s2 = _load_state(s_ptrs[2], m_ptrs[2], offs, meta_offs, S2)
    w, s0, s1, s2 = RULE_UPDATE(w, g, s0, s1, s2, consts[0], consts[1], consts[2], consts[3], consts[4],
                                consts[5], consts[6], consts[7], consts[8], consts[9], consts[10], consts[11])
    if STOCHASTIC:
        h = element_hash(((row0 + rn)[:, None] * K + rk[None, :]).to(gl.uint32, bitcast=True), salt, step)
    else:
        h = 0
    if ok:
        gl.store(w_ptr + offs, fp32_to_bf16_bits(w, h, 0, STOCHASTIC))
        if S0 != NONE:
            _store_state(s_ptrs[0], m_ptrs[0], offs, meta_offs, s0, h, 0, STOCHASTIC, S0)
        if S1 != NONE:
            _store_state(s_ptrs[1], m_ptrs[1], offs, meta_offs, s1, h, 1, STOCHASTIC, S1)
        if S2 != NONE:
            _store_state(s_ptrs[2], m_ptrs[2], offs, meta_offs, s2, h, 2, STOCHASTIC, S2)


@gluon.jit
def epilogue(p, w_ptr, s0_ptr, s1_ptr, s2_ptr, m0_ptr, m1_ptr, m2_ptr, args_ptr, stats_ptr, N, K,
             RULE_UPDATE: gl.constexpr, STOCHASTIC: gl.constexpr,
             S0: gl.constexpr, S1: gl.constexpr, S2: gl.constexpr):
    ROWS: gl.constexpr = epilogue_rows(S0, S1, S2)
    layout: gl.constexpr = epilogue_layout(ROWS)
    sums_layout: gl.constexpr = gl.BlockedLayout([1], [32], [8], [0])
    consts, step, salt, row0 = load_step_args(args_ptr)
    first, num_tiles, stride = _tiles(N, K)
    total = gl.to_tensor(0.0)
    bad = gl.to_tensor(0.0)
    j = 0
    for tile in range(first, num_tiles, stride):
        off_n, off_k = _tile_origin(tile, N, K)
        mbarrier.wait(p.acc_ready.index(0), j & 1)
        for r in gl.static_range(TILE // SUB):
            for c in gl.static_range(TILE // SUB):
                # the block's sum (the MMA warpgroup's) decides for all of it; then its rows in parts
                block_sum = p.sums_buf.slice(r * (TILE // SUB) + c, 1, dim=0).load(sums_layout)
                sumsq = gl.sum(block_sum, axis=0)
                ok = applicable(sumsq)
                total += gl.where(ok, sumsq, 0.0)
                bad += gl.where(ok, 0.0, 1.0)
                for part in gl.static_range(SUB // ROWS):
                    _epilogue_rows(p, w_ptr, (s0_ptr, s1_ptr, s2_ptr), (m0_ptr, m1_ptr, m2_ptr), off_n, off_k,
                                   r * SUB + part * ROWS, c * SUB, N, K, ok, consts, row0, salt, step, ROWS, layout,
                                   RULE_UPDATE, STOCHASTIC, S0, S1, S2)
        partition_barrier()  # every thread has read the staged gradient before the one arrival
        mbarrier.arrive(p.acc_empty.index(0), count=1)
        j += 1
    # relaxed: the sums are read after the kernel, which orders them
    gl.atomic_add(stats_ptr, total, sem="relaxed")
    gl.atomic_add(stats_ptr + 1, bad, sem="relaxed")


@gluon.jit
def wide_update_kernel(x_desc, dy_desc, w_ptr, s0_ptr, s1_ptr, s2_ptr, m0_ptr, m1_ptr, m2_ptr, args_ptr, stats_ptr,
                       N, K, T,
                       RULE_UPDATE: gl.constexpr, S0: gl.constexpr, S1: gl.constexpr, S2: gl.constexpr,
                       STOCHASTIC: gl.constexpr, NUM_BUF: gl.constexpr, MMA_REGS: gl.constexpr,
                       PRODUCER_REGS: gl.constexpr):
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [NUM_BUF] + x_desc.block_type.shape, x_desc.layout)
    dy_bufs = gl.allocate_shared_memory(dy_desc.dtype, [NUM_BUF] + dy_desc.block_type.shape, dy_desc.layout)
    # rows of 128 fp32 rotated by 4 words a row: the MMA layout's stores and the epilogue's
    # row-wise loads then spread over the banks
    staged: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0])
    acc_buf = gl.allocate_shared_memory(gl.float32, [TILE, TILE], staged)
    sums_buf = gl.allocate_shared_memory(gl.float32, [4], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    acc_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    acc_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(NUM_BUF):
        mbarrier.init(empty.index(b), count=1)
        mbarrier.init(ready.index(b), count=1)
    mbarrier.init(acc_empty.index(0), count=1)
    mbarrier.init(acc_ready.index(0), count=1)
    p = Wide(x_desc, dy_desc, x_bufs, dy_bufs, acc_buf, sums_buf, empty, ready, acc_empty, acc_ready)
    # the epilogue is the default partition (the kernel's 8 warps); worker partitions take no tensors
    gl.warp_specialize([
        (epilogue, (p, w_ptr, s0_ptr, s1_ptr, s2_ptr, m0_ptr, m1_ptr, m2_ptr, args_ptr, stats_ptr, N, K,
                    RULE_UPDATE, STOCHASTIC, S0, S1, S2)),
        (mma, (p, N, K, T, NUM_BUF)),
        (producer, (p, N, K, T, NUM_BUF)),
    ], [4, 1], [MMA_REGS, PRODUCER_REGS])
