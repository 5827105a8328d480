"""Triton: a factored second moment's tile (core/factored.py): read as R_i C_j / S from the
vector set the step reads, and summed into the step's set with atomics (row sums, column
sums, total); the tiles of the first tile row and column clear the set the next step sums
into. ``vectors`` is fp32 (3, N + K + 1), each set R (N), C (K), S."""

import triton
import triton.language as tl

from ...core import codecs

FACTORED = tl.constexpr(codecs.FACTORED)


@triton.jit
def _set(vectors_ptr, step, shift: tl.constexpr, N, K):
    """The set (step + shift) % 3: shift 2 the read set, 0 the summed one, 1 the cleared one."""
    return vectors_ptr + ((step + shift) % 3).to(tl.int32) * (N + K + 1)


@triton.jit
def load_factored(vectors_ptr, rn, rk, N, K, step):
    """V_{t-1} on the tile: (R_i C_j) / S, products in the reference's order; 0 before any sum."""
    base = _set(vectors_ptr, step, 2, N, K)
    r = tl.load(base + rn, mask=rn < N, other=0.0)
    c = tl.load(base + N + rk, mask=rk < K, other=0.0)
    total = tl.load(base + N + K)
    # div_rn: the GPU's default division is approximate; 1 where S is 0, so nothing divides by 0
    inverse = tl.where(total > 0.0, tl.div_rn(1.0, tl.where(total > 0.0, total, 1.0)), 0.0)
    return r[:, None] * c[None, :] * inverse


@triton.jit
def add_factored(vectors_ptr, value, mask, rn, rk, N, K, step, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The tile's v (inside the weight: ``mask``) into the step's sums; clear the next step's."""
    base = _set(vectors_ptr, step, 0, N, K)
    v = tl.where(mask, value, 0.0)
    row_sums = tl.sum(v, axis=1)
    # relaxed: read by later launches only, which the stream orders (as the stats' sums)
    tl.atomic_add(base + rn, row_sums, mask=rn < N, sem="relaxed")
    tl.atomic_add(base + N + rk, tl.sum(v, axis=0), mask=rk < K, sem="relaxed")
    tl.atomic_add(base + N + K, tl.sum(row_sums, axis=0), sem="relaxed")
    cleared = _set(vectors_ptr, step, 1, N, K)
    # the program ids compared as vectors: the interpreter's masks take no scalar bool
    first_col = (rn * 0 + tl.program_id(1)) == 0
    first_row = (rk * 0 + tl.program_id(0)) == 0
    tl.store(cleared + rn, tl.zeros((BLOCK_N,), tl.float32), mask=(rn < N) & first_col)
    tl.store(cleared + N + rk, tl.zeros((BLOCK_K,), tl.float32), mask=(rk < K) & first_row)
    one = tl.arange(0, 2)  # the total: tile (0, 0), a block of two (no scalar mask, no 1-element arange)
    tl.store(cleared + N + K + one, tl.zeros((2,), tl.float32),
             mask=(one == 0) & ((one * 0 + tl.program_id(0) + tl.program_id(1)) == 0))
