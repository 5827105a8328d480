"""Benchmark-only ablations of the fused kernels, to place their time: each leaves one stage
out, so its results are wrong on purpose and only its time means anything
(kernel_microbench.py --ablate NAME).

The Triton kernel's ablations replace one of its helper functions before the kernel is
first compiled, so a process measures one of them; the persistent kernel takes its
ablation as a launch argument (persistent_update.MAINLOOP_ONLY / EPILOGUE_ONLY).
"""

import triton
import triton.language as tl

from forge_hf.kernels.triton import fused_update, state_tiles


@triton.jit
def _no_record(stats_ptr, acc):
    return True


@triton.jit
def _zeros_tile(ptr, offsets, mask, EVEN: tl.constexpr):
    return tl.zeros(offsets.shape, ptr.dtype.element_ty)


@triton.jit
def _no_store_value(ptr, offsets, value, mask, h, slot: tl.constexpr, IS_BF16: tl.constexpr,
                    STOCHASTIC: tl.constexpr):
    pass


@triton.jit
def _no_store_state(ptr, meta_ptr, offs, value, mask, keep, block, block_keep, h, slot: tl.constexpr,
                    KIND: tl.constexpr, STOCHASTIC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pass


@triton.jit
def _no_add_factored(vectors_ptr, value, mask, rn, rk, N, K, step, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pass


@triton.jit
def _block_index_masked(rn, pid_k, N, KB, BLOCK_K: tl.constexpr):
    # the kernel's own indices with every element masked off: no metadata is read or written
    block, block_mask = state_tiles.block_index(rn, pid_k, N, KB, BLOCK_K)
    return block, block_mask & (block < 0)


def _patch(*pairs):
    def apply():
        for module, name, value in pairs:
            setattr(module, name, value)
    return apply


TRITON = {
    "no_stats": _patch((fused_update, "record_tile", _no_record)),  # no squared sum, no atomics
    "no_epilogue_loads": _patch((fused_update, "load_tile", _zeros_tile), (state_tiles, "load_tile", _zeros_tile)),
    "mainloop_only": _patch((fused_update, "store_value", _no_store_value),
                            (fused_update, "store_state", _no_store_state)),
    "no_meta": _patch((fused_update, "block_index", _block_index_masked)),  # 8-bit states: no metadata traffic
    "no_state_stores": _patch((fused_update, "store_state", _no_store_state)),  # the weight still stored
    "no_factored_sums": _patch((fused_update, "add_factored", _no_add_factored)),  # no row and column sums
}
PERSISTENT = ("mainloop_only", "epilogue_only")
ABLATIONS = sorted(set(TRITON) | set(PERSISTENT))


def apply_triton(name: str) -> None:
    if name not in TRITON:
        raise ValueError(f"the Triton kernel has no ablation {name!r}: choose from {sorted(TRITON)}")
    TRITON[name]()


def persistent_flag(name: str):
    """The persistent kernel's ABLATE launch argument for ``name`` (0: the whole kernel)."""
    from forge_hf.kernels.gluon.persistent_update import EPILOGUE_ONLY, MAINLOOP_ONLY

    flags = {"none": 0, "mainloop_only": MAINLOOP_ONLY, "epilogue_only": EPILOGUE_ONLY}
    if name not in flags:
        raise ValueError(f"the persistent kernel has no ablation {name!r}: choose from {list(PERSISTENT)}")
    return flags[name]
