"""Triton: a bf16 buffer's rows plus an fp32 band of sums, stored back rounded stochastically
with core/rounding.py's hash (the held gradient's bf16 buffer, nn/held_buffer.py); the same
bits as kernels/rounded_sum.py's PyTorch twin. FRESH: the rows are new, the band is stored
without reading them (the same bits as adding it to zeros)."""

import triton
import triton.language as tl

from .bf16_bits import bf16_bits_to_fp32, element_hash, fp32_to_bf16_bits


@triton.jit
def rounded_sum_kernel(buf_ptr, band_ptr, n, elem0, salt, count_ptr, BLOCK: tl.constexpr, FRESH: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    total = tl.load(band_ptr + offs, mask=mask, other=0.0)
    if not FRESH:
        total = bf16_bits_to_fp32(tl.load(buf_ptr + offs, mask=mask, other=0)) + total
    # the count is read on the device: a replayed CUDA graph's adds each take the next stream
    count = tl.load(count_ptr).to(tl.uint32)
    h = element_hash((elem0 + offs).to(tl.uint32), salt.to(tl.uint32), count)
    tl.store(buf_ptr + offs, fp32_to_bf16_bits(total, h, 0, True), mask=mask)
