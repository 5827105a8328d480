"""Benchmark-only variants of the fused kernel, to place its time (benchmarks/NOTES.md):
an ablation leaves one stage out, a candidate does it another way. Each replaces one of
the kernel's helper functions before the kernel is first compiled, so a process measures
one variant (kernel_microbench.py --variant NAME).

Ablations give wrong results on purpose; only their times mean anything."""

import triton
import triton.language as tl

from forge_hf import rules
from forge_hf.kernels import codecs as kernel_codecs
from forge_hf.kernels import fused_update


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


def _adamw_reciprocal(w, g, m, v, s2, decay, omb1, b2, omb2, bc2_sqrt, eps, neg_step, c7, c8, c9, c10, c11):
    w = w * decay
    m = m + omb1 * (g - m)
    v = v * b2 + omb2 * g * g
    denom = ops.sqrt(v) * (1.0 / bc2_sqrt) + eps  # noqa: F821 - bound by rules.bind_ops
    w = w + neg_step * (m / denom)
    return w, m, v, s2


@triton.jit
def _block_index_masked(rn, pid_k, N, KB, BLOCK_K: tl.constexpr):
    # the kernel's own indices with every element masked off: no metadata is read or written
    block, block_mask = kernel_codecs.block_index(rn, pid_k, N, KB, BLOCK_K)
    return block, block_mask & (block < 0)


def _set(module, name, value):
    setattr(module, name, value)


VARIANTS = {
    "base": lambda: None,
    # ablations
    "no_stats": lambda: _set(fused_update, "record_tile", _no_record),
    "no_epilogue_loads": lambda: (_set(fused_update, "load_tile", _zeros_tile),
                                  _set(kernel_codecs, "load_tile", _zeros_tile)),
    "mainloop_only": lambda: (_set(fused_update, "store_value", _no_store_value),
                              _set(fused_update, "store_state", _no_store_state)),
    "no_meta": lambda: _set(fused_update, "block_index", _block_index_masked),  # 8-bit: no metadata traffic
    # candidates (int8's product by the block's reciprocal, measured here, is now the codec's)
    "rule_reciprocal": lambda: fused_update.RULE_UPDATES.__setitem__(
        "adamw", triton.jit(rules.bind_ops(_adamw_reciprocal, tl))),
}


def apply(name: str) -> None:
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}: choose from {sorted(VARIANTS)}")
    VARIANTS[name]()
