"""How the persistent Gluon kernel (gluon/persistent_update.py) runs a layer's step: which
layers and tokens it can take, its launch arguments, its grid. When it runs: select.py.
"""

from __future__ import annotations

import torch
import triton

from ...core.codecs import storage_kinds
from ..gluon.persistent_update import BLOCK_SIZE, persistent_update_kernel, tensor_descriptor
from ..runtime.compiled import launch_compiled
from .gluon_launch import (
    LayerLaunch,
    device_unsupported,
    multiprocessors,
    stored_tensors,
    tokens_unsupported,
    weight_layout_unsupported,
)

NUM_BUF = 5  # ring slots a lane: 4 -> 5 was 49.3 -> 48.1 ms; 6 does not fit shared memory
CONSUMER_REGS, PRODUCER_REGS, MAXNREG = 232, 40, 168  # 12 warps: 8 consumers, 2 producers (a warpgroup)


def persistent_unsupported(x, dy, weight, slots) -> str | None:
    """Why the persistent kernel cannot take this step (None: it can)."""
    return device_unsupported(weight.device) or layout_unsupported(x, dy, weight, slots)


def layout_unsupported(x, dy, weight, slots) -> str | None:
    """Why these tensors' dtypes and layouts do not suit the kernel (None: they do)."""
    return weight_unsupported(weight, slots, storage_kinds(slots)) or tokens_unsupported(x, dy)


def weight_unsupported(weight, slots, kinds) -> str | None:
    """Why a weight and its state slots (of storage ``kinds``) do not suit the kernel (None: they do)."""
    return weight_layout_unsupported(weight, slots, kinds, BLOCK_SIZE)


def persistent_launch_arguments(x, dy, weight, slots, args, stats, rule_update, stochastic, ablate: int = 0):
    """(positional arguments, constexpr arguments, compile options) of the launch for these
    tensors; tests compile exactly this for the GPU without one (tests/kernels/test_kernel_compiles.py).
    Arguments as fused_update.fused_launch_arguments', ``rule_update`` the rule's jitted update;
    ``ablate``: benchmarks only (persistent_update.MAINLOOP_ONLY / EPILOGUE_ONLY)."""
    n, k = weight.shape
    stored, metas, kinds = stored_tensors(weight, slots, stats)  # the slots share one ring of one dtype
    descs = [tensor_descriptor(x), tensor_descriptor(dy)] + [tensor_descriptor(t) for t in stored]
    constexprs = dict(RULE_UPDATE=rule_update, S0=kinds[0], S1=kinds[1], S2=kinds[2], STOCHASTIC=stochastic,
                      NUM_BUF=NUM_BUF, CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, ABLATE=ablate)
    options = dict(num_warps=4, maxnreg=MAXNREG, enable_fp_fusion=False)  # no FMA contraction, as the other kernel
    return descs + metas + [args, stats, n, k, x.shape[0]], constexprs, options


def _grid(weight: torch.Tensor) -> tuple[int]:
    n, k = weight.shape
    return (min(multiprocessors(weight.device), triton.cdiv((n // BLOCK_SIZE) * (k // BLOCK_SIZE), 2)),)  # two lanes


def launch_persistent(x, dy, weight, slots, args, stats, rule_update, stochastic, ablate: int = 0) -> None:
    """One fused step of one layer by the persistent kernel (arguments as persistent_launch_arguments')."""
    positional, constexprs, options = persistent_launch_arguments(x, dy, weight, slots, args, stats, rule_update,
                                                                  stochastic, ablate)
    launch_compiled(persistent_update_kernel, _grid(weight), positional, constexprs, options)


class PersistentLaunch(LayerLaunch):
    """One layer's launches of the persistent kernel (gluon_launch.py): its weight's and
    states' descriptors and the states' metadata fixed."""

    kernel = persistent_update_kernel
    launch_arguments = staticmethod(persistent_launch_arguments)
    grid_for = staticmethod(_grid)
    describe_tokens = staticmethod(tensor_descriptor)
    fixed_descriptors = 4
