"""Launching a compiled Triton or Gluon kernel again without the JIT's per-call dispatch
(generic: any kernel): ``launch_compiled`` compiles once per specialisation (dtypes, pointer
alignment, integers' divisibility) and returns a relauncher, direct_launch.py's where it
applies. Why: docs/kernels.md.
"""

from __future__ import annotations

import torch

from .direct_launch import direct_launcher

_COMPILED: dict = {}


def tensor_spec(t: torch.Tensor) -> tuple:
    """What Triton specialises a tensor argument on: its dtype and 16-byte alignment."""
    return (t.dtype, t.data_ptr() % 16 == 0)


def int_spec(v: int) -> tuple[bool, bool]:
    """What Triton specialises an integer argument on: whether it is 1, a multiple of 16."""
    return (v == 1, v % 16 == 0)


def _specialisation(positional: list) -> tuple:
    def spec(a):
        if isinstance(a, torch.Tensor):
            return tensor_spec(a)
        if hasattr(a, "block_shape"):  # a TMA tensor descriptor
            return ("descriptor", a.base.dtype, tuple(a.block_shape))
        return int_spec(a)
    return tuple(spec(a) for a in positional)


def launch_compiled(kernel, grid: tuple, positional: list, constexprs: dict, options: dict):
    """kernel[grid](*positional, **constexprs, **options), compiled once per specialisation.
    Returns a function that launches the same compiled kernel again, ``again(grid,
    positional)``, for arguments Triton would specialise the same way: a DirectLauncher
    where Triton's launcher has the layout direct_launch.py reads."""
    device = next(a.device if isinstance(a, torch.Tensor) else a.base.device
                  for a in positional if isinstance(a, torch.Tensor) or hasattr(a, "block_shape"))
    # one device per launch (a compiled kernel is loaded on one)
    key = (kernel, device, _specialisation(positional), tuple(constexprs.items()), tuple(options.items()))
    compiled = _COMPILED.get(key)
    if compiled is None and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"a fused-kernel variant ({tuple(constexprs.items())[:6]}...) is first needed while a CUDA graph "
            "is captured, where it cannot be compiled: run an eager step with the same model, shapes and "
            "dtypes before capturing (GraphedStep's warmup_steps)")
    if compiled is None:  # compile (or find in Triton's cache) through the JIT, once
        kernel_ = kernel[grid](*positional, **constexprs, **options)
        compiled = _COMPILED[key] = _relauncher(kernel, kernel_, device, constexprs)
    else:
        compiled(grid, positional)
    return compiled


def _relauncher(kernel, kernel_, device: torch.device, constexprs: dict):
    """launch(grid, positional) of ``kernel_``, ``kernel`` as compiled for these constexprs."""
    # the constexprs in the kernel's parameter order, after the others
    constexpr_values = tuple(constexprs[p.name] for p in kernel.params if p.is_constexpr)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        direct = direct_launcher(kernel_, constexpr_values, index)
        if direct is not None:
            return direct
    return lambda grid, positional: kernel_[(*grid, 1, 1)[:3]](*positional, *constexpr_values)
