"""Gluon (Hopper): the ring of 64-token chunks of x and dy both Gluon kernels form their
gradients from. A producer fills a slot once its last reader has released it; the consumer
multiplies a slot's chunks into its accumulator by wgmma, one MMA in flight, and releases the
slot before."""

from triton.experimental import gluon
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

# TMA copies: Triton 3.6's name, renamed async_load in later releases
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.jit
def fill_slot(x_desc, dy_desc, x_buf, dy_buf, empty, ready, phase, t0, off_n, off_k):
    """Copy the chunk of tokens from ``t0`` (x's columns from ``off_k``, dy's from ``off_n``)
    into a slot whose ``phase``-th use has been released (the first use needs none); TMA
    fills tokens past the end with zeros."""
    mbarrier.wait(empty, phase ^ 1)
    mbarrier.expect(ready, x_desc.block_type.nbytes + dy_desc.block_type.nbytes)
    tma_load(x_desc, [t0, off_k], ready, x_buf)
    tma_load(dy_desc, [t0, off_n], ready, dy_buf)


@gluon.jit
def multiply_slot(acc, x_buf, dy_buf, ready, phase, previous_empty, release_previous):
    """acc + dy_chunk^T x_chunk once the slot's ``phase``-th chunk has landed, left in flight;
    the MMA before it is then done and, where ``release_previous``, its slot is released."""
    mbarrier.wait(ready, phase)
    acc = warpgroup_mma(dy_buf.permute((1, 0)), x_buf, acc, is_async=True)
    acc = warpgroup_mma_wait(1, deps=[acc])
    mbarrier.arrive(previous_empty, count=1, pred=release_previous)
    return acc
