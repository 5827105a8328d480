"""The fused layer as torch.library custom ops, so torch.compile traces a patched model
without a graph break and compiles its own ops (norms, rotary, SwiGLU, residuals) around
forge's step: ``forge_hf::fused_linear`` and ``forge_hf::fused_linear_backward`` (dX from
the weight before its update, then the layer's fused step), run as opaque Python by the
compiled graph. The eager path (FusedWeightFunction) is unchanged. Why the graph stays
correct (the weight outside the graph, the anchor, the tag, ``cudagraph_unsafe``):
docs/architecture.md, "torch.compile: the fused layer as custom ops".
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .backward_checks import input_gradient, refuse_second_backward

# id(anchor's storage) -> (the storage, its layer), both weakly. The storage, not the
# tensor: a compiled graph passes the anchor on as another tensor object over it.
_LAYERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}
# layer -> its forward calls whose autograd graph is alive: [weak ref to the tag's
# storage, whether its backward stepped the weight]
_CALLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

_OP_TAGS = (torch.Tag.cudagraph_unsafe,)


def new_anchor(layer: nn.Module) -> Tensor:
    """An empty leaf that requires grad, on the layer's device, registered as ``layer``'s
    key for the custom ops (FusedWeightMixin keeps it as ``_forge_anchor``)."""
    anchor = torch.empty(0, device=layer.weight.device, requires_grad=True)
    storage = anchor.untyped_storage()
    key = id(storage)
    _LAYERS[key] = (weakref.ref(storage, lambda _, k=key: _LAYERS.pop(k, None)), weakref.ref(layer))
    return anchor


def layer_of(anchor: Tensor) -> nn.Module:
    storage = anchor.untyped_storage()
    entry = _LAYERS.get(id(storage))
    layer = entry[1]() if entry is not None and entry[0]() is storage else None
    if layer is None:
        raise RuntimeError(
            "forge_hf::fused_linear was given an anchor that belongs to no live fused layer: pass the "
            "layer's own _forge_anchor (made by nn/compiled_linear.new_anchor)")
    return layer


@torch.compiler.disable
def _forward_eagerly(layer: nn.Module, x: Tensor) -> Tensor:
    """A layer without an anchor on its device (a copy, a move): one eager call at a graph
    break makes one, and the recompiled graph uses the custom ops."""
    layer.forge_note_call()
    return layer.forge_forward(x)


def compiled_forward(layer: nn.Module, x: Tensor) -> Tensor:
    """The fused layer's forward as torch.compile traces it (FusedWeightMixin.forge_forward)."""
    anchor = layer.__dict__.get("_forge_anchor")
    if anchor is None or anchor.device != x.device:
        return _forward_eagerly(layer, x)
    shape = layer.weight.shape  # read as metadata: the weight stays out of the graph
    n_out = shape[1] if layer.forge_transposed else shape[0]
    device = x.device.type
    if torch.is_autocast_enabled(device):
        # autocast does not reach inside a custom op: cast as it would for linear
        x = x.to(torch.get_autocast_dtype(device))
        with torch.autocast(device, enabled=False):
            return fused_linear(x, anchor, layer.bias, n_out)[0]
    return fused_linear(x, anchor, layer.bias, n_out)[0]


# ------------------------------------------------------------------ forward op


@torch.library.custom_op("forge_hf::fused_linear", mutates_args=(), tags=_OP_TAGS)
def fused_linear(x: Tensor, anchor: Tensor, bias: Tensor | None, n_out: int) -> tuple[Tensor, Tensor]:
    """y = x W^T + b with W read from the anchor's layer; ``tag`` marks this call until
    its autograd graph is freed."""
    layer = layer_of(anchor)
    layer.forge_note_call()
    dp = layer.forge_dp
    if dp is not None:
        dp.announce_tokens(x.numel() // max(x.shape[-1], 1))
    tag = x.new_empty(0)
    calls = [call for call in _CALLS.get(layer, ()) if call[0]() is not None]
    calls.append([weakref.ref(tag.untyped_storage()), False])
    _CALLS[layer] = calls
    y = F.linear(x, layer.forge_weight_view().to(x.dtype), None if bias is None else bias.to(x.dtype))
    return y, tag


@fused_linear.register_fake
def _(x, anchor, bias, n_out):
    return x.new_empty(*x.shape[:-1], n_out), x.new_empty(0)


def _setup_context(ctx, inputs, output):
    x, anchor, bias, _ = inputs
    ctx.save_for_backward(x, anchor, output[1])  # not the weight: it is overwritten during backward
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ctx, dy, _):
    x, anchor, tag = ctx.saved_tensors
    need_dx, _, need_db = ctx.needs_input_grad[:3]
    dx, d_anchor = fused_linear_backward(x, dy, anchor, tag, need_dx)
    # db is traced (the compiler may fuse it): the float32 sum of fused_backward
    db = dy.reshape(-1, dy.shape[-1]).float().sum(0).to(ctx.bias_dtype) if need_db else None
    return (dx if need_dx else None), d_anchor, db, None


fused_linear.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------- backward op


@torch.library.custom_op("forge_hf::fused_linear_backward", mutates_args=(), tags=_OP_TAGS)
def fused_linear_backward(x: Tensor, dy: Tensor, anchor: Tensor, tag: Tensor,
                          need_dx: bool) -> tuple[Tensor, Tensor]:
    """dX (empty unless ``need_dx``) from the weight before its update, then the fused step
    with dY^T X: FusedWeightFunction's backward, consumers checked by the call's tag. The
    anchor's gradient is empty."""
    layer = layer_of(anchor)
    calls = _CALLS.get(layer, ())
    mine = tag.untyped_storage()
    call = next((c for c in calls if c[0]() is mine), None)
    refuse_second_backward(layer, call is not None and call[1])
    n_out, n_in = layer.forge_weight_view().shape
    dx = input_gradient(layer, dy) if need_dx else dy.new_empty(0)
    # The anchor's AccumulateGrad stands for the weight: not executed under
    # autograd.grad(outputs, inputs) that leaves the weight out, so no step then.
    if layer.weight.requires_grad and _anchor_in_this_backward(layer):
        others = [c for c in calls if c is not call]
        stepped = layer.forge_consume_gradient(x.reshape(-1, n_in), dy.reshape(-1, n_out),
                                               lambda: _conflict(layer, others))
        if call is not None:
            call[1] = stepped
    return dx, anchor.new_empty(0)


@fused_linear_backward.register_fake
def _(x, dy, anchor, tag, need_dx):
    return (dy.new_empty(x.shape) if need_dx else dy.new_empty(0)), anchor.new_empty(0)


_ANCHORS: tuple = (None, {})  # (the running compiled backward node, id(leaf) -> its AccumulateGrad)


def _release_anchors() -> None:
    """Drop the index at the end of the backward that built it. Autograd reuses a leaf's
    AccumulateGrad while anything holds it, on the stream it was made on: one kept from an
    eager step would make a captured step wait on that stream, which fails the capture."""
    global _ANCHORS
    _ANCHORS = (None, {})


def _anchor_in_this_backward(layer: nn.Module) -> bool:
    """Whether the running backward executes the AccumulateGrad of ``layer``'s anchor (an
    input of the compiled graph's backward node; its edges are indexed once per node)."""
    global _ANCHORS
    node = torch._C._current_autograd_node()
    if node is None:  # called outside a backward: nothing to leave out
        return True
    ref, accumulators = _ANCHORS
    if ref is None or ref() is not node:
        accumulators = {id(fn.variable): fn for fn, _ in node.next_functions if hasattr(fn, "variable")}
        torch.autograd.Variable._execution_engine.queue_callback(_release_anchors)
        _ANCHORS = (weakref.ref(node), accumulators)
    acc = accumulators.get(id(layer.__dict__.get("_forge_anchor")))
    return acc is None or torch._C._will_engine_execute_node(acc)


def _conflict(layer: nn.Module, other_calls: list) -> str | None:
    """Why the weight must not be stepped in this backward, or None: the checks of
    FusedWeightMixin.forge_conflict that hold without the graph's nodes. A gradient from
    another reader of the weight is caught by the weight's hook, as in eager."""
    if layer.weight.grad is not None:
        return "its weight already holds a gradient (.grad was set outside the module)"
    # Without nodes, any other call whose graph is alive counts, in this backward or not.
    if any(call[0]() is not None for call in other_calls):
        return ("the module is called more than once in this step (under torch.compile: another "
                "forward call of it still holds its autograd graph)")
    return None
