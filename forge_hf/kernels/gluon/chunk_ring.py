"""Gluon (Hopper): the ring of token chunks of x and dy both Gluon kernels form their
gradients from, as many tokens a chunk as the descriptors' blocks have rows. A producer
fills a slot once its last reader has released it; the consumer multiplies a slot's chunks
into its accumulator by wgmma, one MMA in flight, and releases the slot before."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

# TMA copies: Triton 3.6's name, renamed async_load in later releases
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.jit
def fill_chunks(x_desc, dy_desc, x_bufs, dy_bufs, empty, ready, T, off_n, off_k, i, first_slot,
                NUM_BUF: gl.constexpr):
    """Copy a tile's T tokens, chunk by chunk (x's columns from ``off_k``, dy's from
    ``off_n``), into ring slots ``first_slot`` .. + NUM_BUF, each once its last use has been
    released; ``i``: chunks the ring has taken so far, returned updated. TMA fills tokens
    past T with zeros."""
    CHUNK: gl.constexpr = x_desc.block_type.shape[0]
    for t0 in range(0, T, CHUNK):
        slot = first_slot + i % NUM_BUF
        bar = ready.index(slot)
        mbarrier.wait(empty.index(slot), (i // NUM_BUF & 1) ^ 1)
        mbarrier.expect(bar, x_desc.block_type.nbytes + dy_desc.block_type.nbytes)
        tma_load(x_desc, [t0, off_k], bar, x_bufs.index(slot))
        tma_load(dy_desc, [t0, off_n], bar, dy_bufs.index(slot))
        i += 1
    return i


@gluon.jit
def multiply_chunks(acc, x_bufs, dy_bufs, empty, ready, T, i, first_slot, NUM_BUF: gl.constexpr):
    """acc + dY^T X over a tile's T tokens from the chunks fill_chunks put in the same slots,
    every slot released once its MMA is done; returns the accumulator and ``i`` updated."""
    CHUNK: gl.constexpr = x_bufs.type.shape[1]
    prev = first_slot + i % NUM_BUF  # released only after a first chunk: any slot
    for t0 in range(0, T, CHUNK):
        slot = first_slot + i % NUM_BUF
        mbarrier.wait(ready.index(slot), i // NUM_BUF & 1)
        acc = warpgroup_mma(dy_bufs.index(slot).permute((1, 0)), x_bufs.index(slot), acc, is_async=True)
        # this chunk's MMA stays in flight; the previous one is done, its slot free
        acc = warpgroup_mma_wait(1, deps=[acc])
        mbarrier.arrive(empty.index(prev), count=1, pred=t0 > 0)
        prev = slot
        i += 1
    acc = warpgroup_mma_wait(0, deps=[acc])
    mbarrier.arrive(empty.index(prev), count=1)
    return acc, i
