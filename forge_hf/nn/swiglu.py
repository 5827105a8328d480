"""down_proj of a SwiGLU MLP that recomputes its input instead of keeping it.

A gated MLP computes ``down_proj(silu(gate) * up)``. Autograd keeps gate, up, silu(gate)
and the product for backward (Liger's SwiGLU keeps gate, up and the product): four (or
three) tensors of tokens x intermediate_size per layer, most of a model's activations.
``recompute_swiglu`` gives each such MLP whose down_proj is fused one Function for
"product, then down_proj": it keeps gate and up only and forms the product again in
backward, where the fused step needs it. The arithmetic is torch's own (``F.silu`` and
its backward, the same multiplications), so gradients and updates are bit-identical to
the MLP's eager autograd; only the memory differs.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .linear import FusedWeightMixin, fused_backward

SILU_ACTS = ("silu", "swish")


class SwiGLUDownFunction(torch.autograd.Function):
    """y = (silu(gate) * up) W^T + b; backward returns d(gate), d(up), db and steps W."""

    forge_autocast_neutral = True  # silu, mul and linear: autocast casts none of them to fp32

    @staticmethod
    def forward(ctx, gate, up, anchor, bias, layer):
        ctx.layer = layer
        ctx.save_for_backward(gate, up)  # not the product: formed again in backward
        layer.forge_track(ctx)
        product = F.silu(gate) * up
        return F.linear(product, layer.forge_weight_view().to(product.dtype),
                        None if bias is None else bias.to(product.dtype))

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        act = F.silu(gate)
        need_gate, need_up = ctx.needs_input_grad[:2]
        d_product, db = fused_backward(ctx, act * up, dy, anchor_index=2, need_dx=need_gate or need_up)
        d_up = d_product * act if need_up else None
        d_gate = torch.ops.aten.silu_backward(d_product * up, gate) if need_gate else None
        return d_gate, d_up, None, db, None


def _is_swiglu_mlp(module: nn.Module) -> bool:
    config = getattr(module, "config", None)
    return (all(isinstance(getattr(module, name, None), nn.Module) for name in ("gate_proj", "up_proj", "down_proj"))
            and getattr(config, "hidden_act", None) in SILU_ACTS)


def _product(gate, up):
    return F.silu(gate) * up


def _swiglu_forward(self, x):
    gate, up = self.gate_proj(x), self.up_proj(x)
    down = self.down_proj
    if not (isinstance(down, FusedWeightMixin) and down.forge_active()):  # no grad, unpatched, fallen back for good
        return down(F.silu(gate) * up)
    if torch.compiler.is_compiling():
        # The fused linear's custom op on a product the compiler forms again in backward:
        # gate and up kept only, as by SwiGLUDownFunction.
        return down(checkpoint(_product, gate, up, use_reentrant=False))
    down.forge_note_call()
    return down.forge_apply(SwiGLUDownFunction, gate, up)


def recompute_swiglu(model: nn.Module, required: bool = True) -> list[str]:
    """Make every SwiGLU MLP of ``model`` (Llama, Qwen, Mistral, ... with hidden_act silu,
    Liger's SwiGLU MLP too) whose down_proj is fused keep gate and up only. Call it after
    ``patch_model``. Returns the MLPs' names; ``restore_swiglu`` undoes it. ``required``:
    a model with no such MLP raises, else returns []."""
    changed = []
    for name, module in model.named_modules():
        down = getattr(module, "down_proj", None)
        # a tensor-parallel down_proj keeps the plan's forward around it, which the Function would skip
        if _is_swiglu_mlp(module) and isinstance(down, FusedWeightMixin) and down.forge_tp is None:
            module.forward = types.MethodType(_swiglu_forward, module)
            changed.append(name)
    if not changed and required:
        raise ValueError(
            f"{type(model).__name__} has no SwiGLU MLP with a fused down_proj (modules with gate_proj, "
            "up_proj, down_proj and config.hidden_act 'silu'; not tensor-parallel): call patch_model first, "
            "and leave down_proj fused")
    return changed


def restore_swiglu(model: nn.Module) -> list[str]:
    """The MLPs' own forward back. Returns their names."""
    restored = []
    for name, module in model.named_modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, types.MethodType) and forward.__func__ is _swiglu_forward:
            del module.forward
            restored.append(name)
    return restored
