"""How the wide Gluon kernel (gluon/wide_update.py) runs a layer's step: a bf16 weight with
bf16, 8-bit or absent states, both dimensions multiples of 128, on a Hopper GPU. When it runs
(from select.MANY_TOKENS tokens a step): select.py."""

from __future__ import annotations

import functools

import torch
import triton

from ...core.codecs import storage_kinds
from ..gluon.wide_update import CHUNK_SIZE, TILE_SIZE, wide_update_kernel
from ..runtime.compiled import launch_compiled
from .gluon_launch import (
    LayerLaunch,
    device_unsupported,
    multiprocessors,
    stored_tensors,
    tokens_unsupported,
    weight_layout_unsupported,
)

NUM_BUF = 4  # ring slots of 32 KB; with the 64 KB staging buffer, 192 of the 227 KB
MMA_REGS, PRODUCER_REGS, MAXNREG = 168, 40, 128  # 16 warps: 8 epilogue, 4 MMA, a producer (a warpgroup)


def wide_unsupported(x, dy, weight, slots) -> str | None:
    """Why the wide kernel cannot take this step (None: it can)."""
    return (device_unsupported(weight.device) or wide_layer_unsupported(weight, slots, storage_kinds(slots))
            or tokens_unsupported(x, dy))


def wide_layer_unsupported(weight, slots, kinds) -> str | None:
    """Why a weight and its state slots (of storage ``kinds``) do not suit the kernel, whatever
    its tokens (None: they do)."""
    return weight_layout_unsupported(weight, slots, kinds, TILE_SIZE)


@functools.cache
def _chunk_layout():
    from triton.experimental.gluon import language as gl
    return gl.NVMMASharedLayout.get_default_for([CHUNK_SIZE, TILE_SIZE], gl.bfloat16)


def chunk_descriptor(t: torch.Tensor):
    """A TMA descriptor of (64 tokens, 128 features) chunks of bf16 tokens."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    return TensorDescriptor.from_tensor(t, [CHUNK_SIZE, TILE_SIZE], _chunk_layout())


def wide_launch_arguments(x, dy, weight, slots, args, stats, rule_update, stochastic):
    """(positional arguments, constexpr arguments, compile options) of the launch; arguments
    as persistent_launch.persistent_launch_arguments'."""
    n, k = weight.shape
    stored, metas, kinds = stored_tensors(weight, slots, stats)
    constexprs = dict(RULE_UPDATE=rule_update, S0=kinds[0], S1=kinds[1], S2=kinds[2], STOCHASTIC=stochastic,
                      NUM_BUF=NUM_BUF, MMA_REGS=MMA_REGS, PRODUCER_REGS=PRODUCER_REGS)
    options = dict(num_warps=8, maxnreg=MAXNREG, enable_fp_fusion=False)  # no FMA contraction, as the other kernels
    positional = [chunk_descriptor(x), chunk_descriptor(dy), *stored, *metas, args, stats, n, k, x.shape[0]]
    return positional, constexprs, options


def _grid(weight: torch.Tensor) -> tuple[int]:
    n, k = weight.shape
    return (min(multiprocessors(weight.device), triton.cdiv(n, TILE_SIZE) * triton.cdiv(k, TILE_SIZE)),)


def launch_wide(x, dy, weight, slots, args, stats, rule_update, stochastic) -> None:
    """One fused step of one layer by the wide kernel."""
    positional, constexprs, options = wide_launch_arguments(x, dy, weight, slots, args, stats, rule_update,
                                                            stochastic)
    launch_compiled(wide_update_kernel, _grid(weight), positional, constexprs, options)


class WideLaunch(LayerLaunch):
    """One layer's launches of the wide kernel (gluon_launch.py): its weight, states and their
    metadata fixed."""

    kernel = wide_update_kernel
    launch_arguments = staticmethod(wide_launch_arguments)
    grid_for = staticmethod(_grid)
    describe_tokens = staticmethod(chunk_descriptor)
